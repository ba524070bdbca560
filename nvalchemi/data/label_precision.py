"""What rounding labels to float32 costs, and the one warning when it matters.

A total energy of -4.6e5 eV (a few hundred heavy atoms) lies where float32 numbers are
0.03 eV apart: rounded to float32 it comes back up to 16 meV off, more than a good
model's error per atom on a small cell. Stores written by ``data convert`` therefore
keep total energies and virials (extensive, in eV) in float64, whatever dtype the
positions and the other labels get: a few numbers per structure. Forces, stresses and
charges keep 7 significant digits in float32, far below any model's error.

Batches still carry labels in the positions' dtype by default (a float32 model's
loss compares float32 predictions with them; the built-in losses refuse mixed dtypes
unless told otherwise). Where that rounds a total energy or virial by more than
:data:`ROUNDING_LIMIT` (0.1 meV/atom), the readers warn once, naming the structure, with
the fix: read in float64 (and train a float64 model), or keep the float64 labels and let
the loss cast (``dtype_policy="prediction_to_target"``).

Example:
    >>> import numpy as np
    >>> worst = worst_rounding(np.array([[-460000.014], [-10.0]]), np.array([64, 2]), np.float32)
    >>> worst[0], round(worst[1] * 1000, 2)  # structure 0, meV/atom
    (0, 0.22)
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["EXTENSIVE_LABELS", "ROUNDING_LIMIT", "rounding_warning", "worst_rounding"]

ROUNDING_LIMIT = 1e-4
"""eV/atom: rounding a label by more than this is worth a warning (0.1 meV/atom)."""
EXTENSIVE_LABELS = ("energy", "virial")
"""Labels in eV that grow with the structure (float32 rounds them by eV-scale amounts)."""


def worst_rounding(values: np.ndarray, atoms: np.ndarray, dtype: Any) -> tuple[int, float] | None:
    """``(row, eV per atom)`` of the row of ``values`` that rounding to ``dtype`` changes most.

    ``values`` holds one row per structure (float64, any trailing shape; NaN rows are
    missing labels), ``atoms`` the structures' atom counts. ``None`` when no row changes
    by more than :data:`ROUNDING_LIMIT` per atom.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return None
    change = np.abs(values - values.astype(dtype).astype(np.float64))
    change = np.nan_to_num(change.reshape(len(values), -1).max(axis=1), nan=0.0)
    per_atom = change / np.maximum(np.asarray(atoms, dtype=np.float64), 1.0)
    row = int(np.argmax(per_atom))
    if not per_atom[row] > ROUNDING_LIMIT:
        return None
    return row, float(per_atom[row])


def rounding_warning(where: str, field: str, per_atom: float, value: float, dtype: Any) -> str:
    """The warning for ``field`` of the structure ``where`` rounded by ``per_atom`` eV/atom."""
    name = np.dtype(dtype).name
    return (
        f"{where}: its {field} label rounded to {name} loses {1000 * per_atom:.2g} meV/atom "
        f"({value:.6f} eV; warned above {1000 * ROUNDING_LIMIT:g} meV/atom, once per data "
        f"source: other structures may lose as much). Read the data in float64 (e.g. "
        "dataset.dtype: float64) and train a float64 model, or read the labels in float64 "
        "and set the loss's dtype_policy to 'prediction_to_target'"
    )
