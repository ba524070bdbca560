"""Documented import path of :mod:`nvalchemi.training.finetune.statistics`."""

from nvalchemi.training.finetune.statistics import (
    STATISTICS_FILENAME,
    E0Mode,
    FineTuneStatistics,
    ScaleShiftMode,
    compute_finetune_statistics,
    prepare_finetune_model,
    read_finetune_statistics,
)

__all__ = [
    "STATISTICS_FILENAME",
    "E0Mode",
    "FineTuneStatistics",
    "ScaleShiftMode",
    "compute_finetune_statistics",
    "prepare_finetune_model",
    "read_finetune_statistics",
]
