"""Documented import path for the checkpoint API (defined in :mod:`nvalchemi.training.checkpoint`)."""

from nvalchemi.training.checkpoint import (
    CheckpointManifest,
    CheckpointValidator,
    load_checkpoint,
    load_model_from_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CheckpointManifest",
    "CheckpointValidator",
    "load_checkpoint",
    "load_model_from_checkpoint",
    "save_checkpoint",
]
