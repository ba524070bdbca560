"""Documented import path for the validation API (defined in :mod:`nvalchemi.training.validation`)."""

from nvalchemi.training.validation import (
    BatchValidationCallback,
    ValidationConfig,
    ValidationLoop,
)

__all__ = ["BatchValidationCallback", "ValidationConfig", "ValidationLoop"]
