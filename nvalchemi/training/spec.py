"""Specs for rebuilding objects from JSON (documented import path; defined in :mod:`nvalchemi.spec`).

The implementation sits below the model layer so that models (e.g. ``MACEWrapper``)
can record their own reconstruction specs without importing ``nvalchemi.training``.
"""

from nvalchemi.spec import (
    BaseSpec,
    create_model_spec,
    create_model_spec_from_json,
    register_type_serializer,
)

__all__ = [
    "BaseSpec",
    "create_model_spec",
    "create_model_spec_from_json",
    "register_type_serializer",
]
