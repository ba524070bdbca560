"""Documented import path of :mod:`nvalchemi.training.finetune.parity`."""

from nvalchemi.training.finetune.parity import (
    ParityReport,
    check_zero_step_parity,
)

__all__ = [
    "ParityReport",
    "check_zero_step_parity",
]
