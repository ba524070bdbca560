"""Hook protocol, registry, contexts, and hooks shared by training workflows."""

from nvalchemi._lazy import lazy_exports

_REPORTING = "nvalchemi.hooks.reporting"
_EXPORTS = {
    "Hook": ".protocol",
    "CheckpointableHook": ".protocol",
    "HookContext": ".context",
    "DynamicsContext": ".context",
    "TrainContext": ".context",
    "HookRegistryMixin": ".registry",
    "NeighborListHook": ".neighbor_list",
    "WrapPeriodicHook": ".periodic",
    "BiasedPotentialHook": ".bias",
    "StageTimingHook": ".stage_timing",
    "TorchProfilerHook": ".profiler",
    "ReportingOrchestrator": _REPORTING,
    "ReportingErrorPolicy": _REPORTING,
    "ReportingState": _REPORTING,
    "ReporterMessage": _REPORTING,
    "Reporter": _REPORTING,
    "RichReporter": _REPORTING,
    "TensorBoardReporter": _REPORTING,
    "TensorBoardWriter": _REPORTING,
    "JSONLinesReporter": _REPORTING,
    "WandbReporter": _REPORTING,
    "MLflowReporter": _REPORTING,
    "ScalarSnapshot": _REPORTING,
    "ScalarCallback": _REPORTING,
    "collect_scalars": _REPORTING,
    "extract_loss_scalars": _REPORTING,
    "extract_optimizer_lr_scalars": _REPORTING,
    "extract_scalars": _REPORTING,
    "extract_dynamics_scalars": _REPORTING,
    "BaseRichLayout": _REPORTING,
    "RichLayout": _REPORTING,
    "TrainingRichLayout": _REPORTING,
    "DynamicsRichLayout": _REPORTING,
    "DEFAULT_REPORT_STAGES": _REPORTING,
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
