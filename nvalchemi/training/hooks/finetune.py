"""The fine-tuning hooks' documented import path (defined in :mod:`nvalchemi.training.finetune.hooks`)."""

from nvalchemi.training.finetune.hooks import (
    AddHeadHook,
    ForgettingHook,
    ModulePatchHook,
    PatchedModule,
    TrainableParameterHook,
    apply_module_patches,
)

__all__ = [
    "AddHeadHook",
    "ForgettingHook",
    "ModulePatchHook",
    "PatchedModule",
    "TrainableParameterHook",
    "apply_module_patches",
]
