"""Hooks bundled with the training API."""

from nvalchemi._lazy import lazy_exports

_EXPORTS = {
    "CheckpointHook": ".checkpoint",
    "DDPHook": ".ddp",
    "EMAHook": ".ema",
    "EMAValidationHook": ".ema",
    "MixedPrecisionHook": ".mixed_precision",
    "TrainingUpdateHook": ".update",
    "TrainingUpdateOrchestrator": ".update",
    "GradientAccumulationHook": ".gradients",
    "GradientClipHook": ".gradients",
    "LossSpikeSkipHook": ".gradients",
    "AddHeadHook": "nvalchemi.training.finetune.hooks",
    "ForgettingHook": "nvalchemi.training.finetune.hooks",
    "ModulePatchHook": "nvalchemi.training.finetune.hooks",
    "TrainableParameterHook": "nvalchemi.training.finetune.hooks",
    "EarlyStoppingHook": ".early_stopping",
    "TorchProfilerHook": "nvalchemi.hooks.profiler",
    "TimeBudgetHook": "nvalchemi.training.time_budget",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
