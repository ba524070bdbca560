"""Atoms too close together: duplicate atoms, swapped arrays, positions in the wrong units.

No physical structure has two atoms closer than about 0.6 Å (H2's bond is 0.74 Å).
Two atoms at the same place (a structure written twice into one frame, an atom
appended twice) make every model's energy infinite; positions swapped with forces,
or written in nm, put atoms a fraction of an ångström apart. :func:`closest_pair`
finds the closest pair of one structure (periodic images included, so an atom may
pair with its own image in a cell that is far too small) with one call of vesin's
cell list, whose cutoff is sized by the structure's density so that it costs a few
pairs per atom whatever the cell, also for a cluster in a large empty box.

* below :data:`DUPLICATE_DISTANCE` (0.1 Å): duplicate atoms; ``data convert``
  refuses the structure, ``data check`` reports a problem;
* below :data:`IMPLAUSIBLE_DISTANCE` (0.5 Å): implausible; reported as a warning
  (``data check``, ``data stats``, ``data convert``) with the likely causes.

Example:
    >>> import numpy as np
    >>> pair = closest_pair(np.array([[0.0, 0, 0], [3.0, 0, 0], [3.0, 0, 0.05]]))
    >>> pair.first, pair.second, round(pair.distance, 3)
    (1, 2, 0.05)
    >>> closest_pair(np.array([[0.0, 0, 0], [2.5, 0, 0]])) is None  # nothing below 0.5 Å
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from nvalchemi.data._vesin import as_numpy, box_and_periodic, calculator, run_vesin

__all__ = [
    "DUPLICATE_DISTANCE",
    "IMPLAUSIBLE_DISTANCE",
    "ClosePair",
    "closest_pair",
    "describe_close_pair",
]

DUPLICATE_DISTANCE = 0.1
"""Å: two atoms closer than this are duplicates (refused by ``data convert``)."""
IMPLAUSIBLE_DISTANCE = 0.5
"""Å: two atoms closer than this are implausible (a warning naming the pair)."""


@dataclass(frozen=True)
class ClosePair:
    """Atoms ``first`` and ``second`` (``first <= second``; equal: an atom and its own
    periodic image) of one structure, ``distance`` Å apart."""

    first: int
    second: int
    distance: float

    @property
    def duplicate(self) -> bool:
        return self.distance < DUPLICATE_DISTANCE


def _search_radius(positions: np.ndarray, below: float) -> float:
    """A cutoff of a few neighbours per atom (at least ``below``), from the atoms' extent.

    vesin's cell list makes bins of the cutoff's size over the whole cell: a tiny
    cutoff in a large cell costs millions of empty bins, a large one many pairs. The
    mean spacing of the atoms over their bounding box gives a few pairs per atom; it
    is rounded up to a power of sqrt(2) so that few calculators are made.
    """
    extent = np.maximum(np.ptp(positions, axis=0), 1.0)
    spacing = float(np.prod(extent) / positions.shape[0]) ** (1.0 / 3.0)
    radius = max(below, spacing)
    return 2.0 ** (math.ceil(2.0 * math.log2(radius)) / 2.0)


def closest_pair(
    positions: Any, cell: Any = None, pbc: Any = None, *, below: float = IMPLAUSIBLE_DISTANCE
) -> ClosePair | None:
    """The closest pair of atoms of one structure when closer than ``below`` Å, else ``None``.

    Args:
        positions: ``[N, 3]`` positions in Å (numpy or a tensor).
        cell: ``[3, 3]`` (or ``[1, 3, 3]``) lattice vectors as rows, or ``None``.
        pbc: periodic flags, or ``None`` for open boundaries.
        below: only pairs closer than this count.

    Structures with non-finite positions or a degenerate periodic cell are left to
    the checks that name those (``None`` here).
    """
    pos = as_numpy(positions, np.float64).reshape(-1, 3)
    if pos.shape[0] == 0 or not np.isfinite(pos).all():
        return None
    try:
        box, periodic = box_and_periodic(cell, pbc, "closest_pair")
    except ValueError:
        return None
    if pos.shape[0] == 1 and not periodic.any():
        return None
    calc = calculator(_search_radius(pos, below), full_list=False, n_threads=1)
    pairs, shifts = run_vesin(calc, pos, box, periodic, "closest_pair")
    if pairs.shape[0] == 0:
        return None
    vectors = pos[pairs[:, 1]] - pos[pairs[:, 0]] + shifts @ box
    distances = np.sqrt(np.einsum("ij,ij->i", vectors, vectors))
    k = int(np.argmin(distances))
    if not distances[k] < below:
        return None
    i, j = sorted((int(pairs[k, 0]), int(pairs[k, 1])))
    return ClosePair(i, j, float(distances[k]))


def describe_close_pair(pair: ClosePair, where: str) -> str:
    """One sentence naming the structure (``where``), the two atoms and what it means."""
    if pair.first == pair.second:
        what = (
            f"atom {pair.first} is {pair.distance:.3g} Å from its own periodic image (the "
            "cell is far too small: wrong units?)"
        )
    else:
        what = f"atoms {pair.first} and {pair.second} are {pair.distance:.3g} Å apart"
    if pair.duplicate:
        return (
            f"{where}: {what}: duplicate atoms (below {DUPLICATE_DISTANCE} Å); remove one of "
            "them or drop the structure (when many structures show this, their positions "
            "hold another array, e.g. the forces)"
        )
    return (
        f"{where}: {what}, closer than any physical pair (below {IMPLAUSIBLE_DISTANCE} Å): "
        "positions in the wrong units (nm, Bohr, fractional), or positions swapped with "
        "another array?"
    )
