"""Conversion between ``ase.Atoms`` and :class:`~nvalchemi.data.AtomicData`.

The public entry points are ``AtomicData.from_atoms`` and ``AtomicData.to_atoms``;
units are ASE's (eV, Å, eV/Å, eV/Å³ with stress positive = tensile), so nothing is
converted, only reshaped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nvalchemi.data.weights import INFO_KEYS, info_weight_keys, weights_from_info

if TYPE_CHECKING:
    from nvalchemi.data.atomic_data import AtomicData

__all__ = ["atoms_from_data", "fields_from_atoms", "valid_calculator_results"]

# field name -> (name of the calculator result, per atom?)
_LABELS = {
    "energy": ("energy", False),
    "forces": ("forces", True),
    "stress": ("stress", False),
    "virial": ("virial", False),
    "dipole": ("dipole", False),
    "charges": ("charges", True),
}


def valid_calculator_results(atoms: Any) -> dict[str, Any]:
    """The results stored on ``atoms.calc`` that are valid for ``atoms`` as it is now.

    ASE keeps a calculator's results after the atoms move (``atoms.rattle()``,
    ``atoms.positions += ...``); they describe the old geometry until the next
    calculation. ``calc.check_state(atoms)`` (ASE's own test, which neither
    recomputes nor clears anything) lists what changed since; any change, or a
    calculator that cannot tell, means no result is used.
    """
    calc = getattr(atoms, "calc", None)
    results = getattr(calc, "results", None)
    if not results:
        return {}
    check_state = getattr(calc, "check_state", None)
    if not callable(check_state) or check_state(atoms):
        return {}
    return dict(results)


def fields_from_atoms(
    atoms: Any,
    *,
    keys: Mapping[str, str],
    dtype: torch.dtype,
    label_dtype: torch.dtype,
    use_calculator: bool,
    info_keys: tuple[str, ...] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(fields, info)`` of ``atoms`` for ``AtomicData(**fields, info=info)``.

    ``keys`` maps each label field (``energy``, ``forces``, ``stress``, ``virial``,
    ``dipole``, ``charges``) to its key in ``atoms.info``/``atoms.arrays``. Weights in
    ``atoms.info`` (``config_weight``, ... see :mod:`nvalchemi.data.weights`) become weight
    fields and leave ``info``.
    """
    results = valid_calculator_results(atoms) if use_calculator else {}

    def label(key: str, result_key: str, per_atom: bool) -> Any:
        source = atoms.arrays if per_atom else atoms.info
        if key in source:
            return source[key]
        # A renamed key (e.g. "REF_energy") names one level of theory; the calculator's
        # result may come from another, so only the default name falls back to it.
        return results.get(result_key) if key == result_key else None

    fields: dict[str, Any] = {
        "atomic_numbers": torch.as_tensor(np.array(atoms.numbers), dtype=torch.int64),
        "positions": torch.as_tensor(np.array(atoms.positions), dtype=dtype),
    }
    pbc = np.asarray(atoms.pbc, dtype=bool)
    if pbc.any():
        cell = np.asarray(atoms.cell.array, dtype=float)
        if abs(np.linalg.det(cell)) < 1e-12:
            raise ValueError(
                "from_atoms: periodic structure with a degenerate cell (zero volume); set all "
                "three cell vectors, e.g. with atoms.center(vacuum=10.0) for a slab."
            )
        fields["cell"] = torch.as_tensor(cell, dtype=dtype).unsqueeze(0)
        fields["pbc"] = torch.as_tensor(pbc).unsqueeze(0)
    for name, (result_key, per_atom) in _LABELS.items():
        value = label(keys[name], result_key, per_atom)
        if value is not None:
            fields[name] = torch.as_tensor(np.array(value, dtype=float), dtype=label_dtype)
    charge = atoms.info.get("charge")
    if charge is not None:
        if not float(charge).is_integer():
            raise ValueError(f"from_atoms: atoms.info['charge']={charge!r} is not an integer.")
        fields["charge"] = torch.tensor([[float(charge)]], dtype=label_dtype)
    # Weights (MACE's config_weight, config_forces_weight, ...), stored when not 1.
    for name, value in weights_from_info(atoms.info).items():
        fields[name] = torch.tensor([[value]], dtype=label_dtype)
    consumed = {keys["energy"], keys["stress"], keys["virial"], keys["dipole"], "charge"}
    consumed |= info_weight_keys()
    info = {
        key: value
        for key, value in atoms.info.items()
        if key not in consumed and (info_keys is None or key in info_keys)
    }
    return fields, info


def atoms_from_data(data: AtomicData) -> Any:
    """``ase.Atoms`` with the labels of ``data`` on a ``SinglePointCalculator``."""
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    def np_(key: str) -> np.ndarray | None:  # known fields: None when not set
        value = getattr(data, key)
        return None if value is None else value.detach().cpu().double().numpy()

    cell = np_("cell")
    pbc = data.pbc
    atoms = Atoms(
        numbers=data.atomic_numbers.cpu().numpy(),
        positions=np_("positions"),
        cell=None if cell is None else cell[0],
        pbc=False if pbc is None else pbc[0].cpu().numpy(),
    )
    results = {}
    if (energy := np_("energy")) is not None:
        results["energy"] = results["free_energy"] = float(energy.reshape(-1)[0])
    if (forces := np_("forces")) is not None:
        results["forces"] = forces
    if (stress := np_("stress")) is not None:
        results["stress"] = stress[0]
    if (charges := np_("charges")) is not None:
        results["charges"] = charges
    if results:
        atoms.calc = SinglePointCalculator(atoms, **results)
    for key, value in data.info.items():
        atoms.info[key] = value.cpu().numpy() if isinstance(value, torch.Tensor) else value
    for name, keys in INFO_KEYS.items():  # MACE's keys, so the file trains the same anywhere
        value = getattr(data, name) if name in data else None
        if value is not None:
            atoms.info[keys[0]] = float(value.reshape(-1)[0])
    return atoms
