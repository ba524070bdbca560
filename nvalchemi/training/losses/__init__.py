"""Leaf losses, their composition, reductions and loss-weight schedules."""

from nvalchemi._lazy import lazy_exports

_EXPORTS = {
    "BaseLossFunction": ".base",
    "DTypePolicy": ".base",
    "ReductionContext": ".base",
    "assert_same_shape": ".base",
    "LossWeightSchedule": ".schedules",
    "ConstantWeight": ".schedules",
    "CosineWeight": ".schedules",
    "LinearWeight": ".schedules",
    "PiecewiseWeight": ".schedules",
    "ComposedLossFunction": ".base",
    "ComposedLossOutput": ".base",
    "loss_component_to_spec": ".base",
    "LossTargetAssemblyProtocol": ".composition",
    "assemble_loss_targets": ".composition",
    "compute_supervised_loss": ".composition",
    "as_composed_loss": ".composition",
    "EnergyHuberLoss": ".terms",
    "EnergyMAELoss": ".terms",
    "EnergyMSELoss": ".terms",
    "ForceHuberLoss": ".terms",
    "ForceL2NormLoss": ".terms",
    "ForceMSELoss": ".terms",
    "StressHuberLoss": ".terms",
    "StressMSELoss": ".terms",
    "per_graph_sum": ".reductions",
    "per_graph_mean": ".reductions",
    "frobenius_mse": ".reductions",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
