"""Units of every number reporting shows: metric keys, loss terms, display in meV.

One table for reporters, plots and the command line:

* validation metrics carry their unit in the key: ``validation/forces_mae_eV_per_A``,
  ``validation/energy_per_atom_rmse_eV_per_atom``, ``validation/energy_mae_eV`` (the
  total energy), ``validation/stress_mae_eV_per_A3`` (:func:`metric_key`); values are
  in those units (eV ...), displays show meV (:func:`display`);
* loss terms are labelled with the unit of their value (:func:`loss_units`:
  ``ForceMSELoss`` -> ``(eV/Å)²``, a per-atom ``EnergyMSELoss`` -> ``(eV/atom)²``); the
  total loss is a weighted sum of terms of different units and is labelled so.

Example:
    >>> metric_key("forces_mae"), key_unit("validation/forces_mae_eV_per_A")
    ('forces_mae_eV_per_A', 'eV/Å')
    >>> display("validation/energy_per_atom_mae_eV_per_atom", 0.0123)
    ('energy/atom MAE', '12.3 meV/atom')
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "QUANTITY_UNITS",
    "TOTAL_LOSS_LABEL",
    "display",
    "key_unit",
    "loss_units",
    "metric_key",
    "metric_label",
]

QUANTITY_UNITS = {"energy_per_atom": "eV/atom", "energy": "eV", "forces": "eV/Å", "stress": "eV/Å³"}
"""Unit of each compared quantity (energies in eV, forces eV/Å, stress eV/Å³)."""

TOTAL_LOSS_LABEL = "weighted sum"
"""What the total loss is: a sum of weighted terms of different units (no unit of its own)."""

_TOKENS = {"eV/atom": "eV_per_atom", "eV": "eV", "eV/Å": "eV_per_A", "eV/Å³": "eV_per_A3"}
_FROM_TOKEN = {token: unit for unit, token in _TOKENS.items()}
_METRIC = re.compile(r"^(energy_per_atom|energy|forces|stress)_(mae|rmse)$")
_WITH_UNIT = re.compile(r"^(?:.*/)?(energy_per_atom|energy|forces|stress)_(mae|rmse)_(\w+)$")
_LABELS = {
    "energy_per_atom": "energy/atom",
    "energy": "energy (total)",
    "forces": "forces",
    "stress": "stress",
}


def metric_key(name: str) -> str:
    """A validation metric name with its unit: ``forces_mae`` -> ``forces_mae_eV_per_A``.

    Names that are not an error of a known quantity are returned unchanged.
    """
    match = _METRIC.match(name)
    if match is None:
        return name
    return f"{name}_{_TOKENS[QUANTITY_UNITS[match.group(1)]]}"


def key_unit(key: str) -> str | None:
    """The unit a scalar key carries (``None`` when it carries none)."""
    match = _WITH_UNIT.match(key)
    return None if match is None else _FROM_TOKEN.get(match.group(3))


def metric_label(key: str) -> str | None:
    """``"forces MAE"`` for ``.../forces_mae_eV_per_A`` (``None`` for other keys)."""
    match = _WITH_UNIT.match(key)
    if match is None or match.group(3) not in _FROM_TOKEN:
        return None
    return f"{_LABELS[match.group(1)]} {match.group(2).upper()}"


def display(key: str, value: float) -> tuple[str, str] | None:
    """``(label, "12.3 meV/atom")`` for a key with a unit, the value shown in meV.

    ``None`` for keys without a unit.
    """
    unit, label = key_unit(key), metric_label(key)
    if unit is None or label is None:
        return None
    scaled = 1000 * value
    text = f"{scaled:.0f}" if abs(scaled) >= 1000 else f"{scaled:.3g}"
    return label, f"{text} m{unit}"


def loss_units(loss_fn: Any) -> dict[str, str]:
    """``{component name: unit of its value}`` of a (composed) loss, where known.

    MSE terms are squared units, MAE / L2-norm terms plain units; Huber terms are
    labelled with the plain unit (they are squared below their ``delta``).

    Example:
        >>> from nvalchemi.training.losses import ComposedLossFunction, EnergyMSELoss, ForceMSELoss
        >>> loss_units(ComposedLossFunction([EnergyMSELoss(per_atom=True), ForceMSELoss()]))
        {'EnergyMSELoss': '(eV/atom)²', 'ForceMSELoss': '(eV/Å)²'}
    """
    components = list(getattr(loss_fn, "components", None) or [])
    names = list(getattr(loss_fn, "component_names", None) or [])
    if not components and loss_fn is not None:
        components, names = [loss_fn], [type(loss_fn).__name__]
    out = {}
    for name, component in zip(names, components):
        unit = _unit_of(component)
        if unit is not None:
            out[name] = unit
    return out


def _unit_of(component: Any) -> str | None:
    cls = type(component).__name__
    quantity = next(
        (
            q
            for prefix, q in (("Energy", "energy"), ("Force", "forces"), ("Stress", "stress"))
            if cls.startswith(prefix)
        ),
        None,
    )
    if quantity is None:
        return None
    if quantity == "energy" and getattr(component, "per_atom", False):
        quantity = "energy_per_atom"
    unit = QUANTITY_UNITS[quantity]
    if "MSE" in cls:
        return f"({unit})²"
    return unit


def units_of(keys: Mapping[str, Any] | list[str], loss: Mapping[str, str]) -> dict[str, str]:
    """The unit of every key of ``keys`` that has one (metric suffixes, loss terms)."""
    out = {}
    for key in keys:
        unit = key_unit(key)
        if unit is None and key.endswith("/unweighted"):
            unit = loss.get(key.split("/")[-2])
        if unit is None and key.endswith("loss/total"):
            unit = TOTAL_LOSS_LABEL
        if unit is not None:
            out[key] = unit
    return out
