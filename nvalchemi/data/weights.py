"""Per-structure loss weights read from the data: MACE's info keys and ``config_type`` weights.

A structure's weights are system-level fields that the losses read (see
:mod:`nvalchemi.training.losses.base` and ``docs/weights.md``):

============================  ===============================================================
field                         ``atoms.info`` keys (extxyz comment line, ASE db key-value pairs)
============================  ===============================================================
``loss_weight`` (all terms)   ``config_weight`` (MACE), ``loss_weight``
``energy_weight``             ``config_energy_weight`` (MACE), ``energy_weight``
``forces_weight``             ``config_forces_weight`` (MACE), ``forces_weight``
``stress_weight``             ``config_stress_weight`` (MACE), ``stress_weight``
``virial_weight``             ``config_virials_weight`` (MACE), ``virials_weight``,
                              ``virial_weight``
============================  ===============================================================

A weight must be a finite number >= 0. A weight of 1 is not stored (it is what a structure
without the field gets), so data whose weights are all 1 trains exactly like data without
weights, at no cost. ``config_type_weights`` (``{"slab111": 3.0}``) multiply the
``loss_weight`` of every structure whose ``atoms.info["config_type"]`` is listed, as MACE's
``--config_type_weights`` do.

Example:
    >>> weights_from_info({"config_weight": 2.0, "config_forces_weight": 0.5, "x": 1})
    {'loss_weight': 2.0, 'forces_weight': 0.5}
    >>> weights_from_info({"config_weight": 1.0})  # 1 is the default: nothing stored
    {}
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CONFIG_TYPE_KEY",
    "INFO_KEYS",
    "WEIGHT_FIELDS",
    "check_config_type_weights",
    "info_weight_keys",
    "weights_from_info",
]

INFO_KEYS: dict[str, tuple[str, ...]] = {
    "loss_weight": ("config_weight", "loss_weight"),
    "energy_weight": ("config_energy_weight", "energy_weight"),
    "forces_weight": ("config_forces_weight", "forces_weight"),
    "stress_weight": ("config_stress_weight", "stress_weight"),
    "virial_weight": ("config_virials_weight", "virials_weight", "virial_weight"),
}
"""Weight field -> the ``atoms.info`` keys it is read from (MACE's name first)."""

WEIGHT_FIELDS: tuple[str, ...] = tuple(INFO_KEYS)
CONFIG_TYPE_KEY = "config_type"


def info_weight_keys() -> frozenset[str]:
    """Every ``atoms.info`` key that holds a weight (consumed when structures are read)."""
    return frozenset(key for keys in INFO_KEYS.values() for key in keys)


def _weight(value: Any, key: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            value = None
    elif hasattr(value, "item") and getattr(value, "size", 1) == 1:  # a numpy scalar
        value = value.item()
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"info[{key!r}] = {value!r} is not a weight: give a finite number >= 0.")
    return float(value)


def weights_from_info(info: Mapping[str, Any]) -> dict[str, float]:
    """The weight fields of a structure from its ``atoms.info`` (those other than 1).

    Raises ``ValueError`` naming the key for a value that is not a finite number >= 0, or
    for two keys of one field (``config_weight`` and ``loss_weight``) that disagree.
    """
    out: dict[str, float] = {}
    for field, keys in INFO_KEYS.items():
        found = [(key, _weight(info[key], key)) for key in keys if key in info]
        if not found:
            continue
        values = {value for _, value in found}
        if len(values) > 1:
            given = ", ".join(f"{key}={value}" for key, value in found)
            raise ValueError(
                f"{given} give two weights for {field}; keep one of the keys ({keys[0]} is "
                "MACE's name)."
            )
        value = found[0][1]
        if value != 1.0:
            out[field] = value
    return out


def check_config_type_weights(
    weights: Mapping[str, Any] | None, where: str = "config_type_weights"
) -> dict[str, float] | None:
    """``{config_type: weight}`` with every weight a finite number >= 0 (else ``ValueError``)."""
    if weights is None:
        return None
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{where} must map config_type names to weights, e.g. {{'slab111': 3.0}}; got "
            f"{type(weights).__name__}."
        )
    out = {}
    for name, value in weights.items():
        try:
            out[str(name)] = _weight(value, str(name))
        except ValueError:
            raise ValueError(
                f"{where}[{name!r}] = {value!r} is not a weight: give a finite number >= 0."
            ) from None
    return out
