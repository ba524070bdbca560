"""The nvalchemi training API: strategies, losses, optimizers, validation, hooks, checkpoints."""

from nvalchemi._lazy import lazy_exports

_LOSSES = "nvalchemi.training.losses"
_EXPORTS = {
    # losses
    "BaseLossFunction": _LOSSES,
    "ComposedLossFunction": _LOSSES,
    "ComposedLossOutput": _LOSSES,
    "DTypePolicy": _LOSSES,
    "ConstantWeight": _LOSSES,
    "CosineWeight": _LOSSES,
    "LinearWeight": _LOSSES,
    "PiecewiseWeight": _LOSSES,
    "EnergyHuberLoss": _LOSSES,
    "EnergyMAELoss": _LOSSES,
    "EnergyMSELoss": _LOSSES,
    "ForceHuberLoss": _LOSSES,
    "ForceL2NormLoss": _LOSSES,
    "ForceMSELoss": _LOSSES,
    "StressHuberLoss": _LOSSES,
    "StressMSELoss": _LOSSES,
    "LossWeightSchedule": _LOSSES,
    "LossTargetAssemblyProtocol": _LOSSES,
    "ReductionContext": _LOSSES,
    "assemble_loss_targets": _LOSSES,
    "loss_component_to_spec": _LOSSES,
    # specs
    "BaseSpec": ".spec",
    "create_model_spec": ".spec",
    "create_model_spec_from_json": ".spec",
    "register_type_serializer": ".spec",
    "UnsafeImportError": "nvalchemi._serialization",
    "trusted_imports": "nvalchemi._serialization",
    "allow_import_path": "nvalchemi._serialization",
    "register_trusted": "nvalchemi._serialization",
    # checkpoints
    "CheckpointManifest": ".checkpoint",
    "CheckpointValidator": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "save_checkpoint": ".checkpoint",
    # hooks
    "CheckpointHook": ".hooks.checkpoint",
    "DDPHook": ".hooks.ddp",
    "EMAHook": ".hooks.ema",
    "EarlyStoppingHook": ".hooks.early_stopping",
    # strategy and friends
    "TrainingStage": ".stages",
    "TrainingStrategy": ".strategy",
    "NonFiniteLossError": ".errors",
    "TrainingStalledError": ".errors",
    "model_spec_for": ".model_spec",
    "default_training_fn": ".strategy",
    "FineTuningStrategy": ".finetune",
    "OptimizerConfig": ".optimizers",
    "setup_optimizers": ".optimizers",
    "step_lr_schedulers": ".optimizers",
    "step_optimizers": ".optimizers",
    "zero_gradients": ".optimizers",
    "BatchValidationCallback": ".validation",
    "ValidationConfig": ".validation",
    "ValidationLoop": ".validation",
    "configure_dataloader": ".runtime",
    "configure_parallelism": ".runtime",
    "freeze_unconfigured_models": ".runtime",
    "move_to_devices": ".runtime",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
