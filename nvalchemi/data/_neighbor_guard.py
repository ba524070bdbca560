"""Refuse neighbour lists that would explode: estimate the pair count before building one.

A periodic cell much smaller than the cutoff (a cell written in nm or Bohr, or a
typo) makes every atom see thousands of images of itself: a 2-atom cubic cell of
0.02 Å edge with a 5 Å cutoff has about 2.6e8 pairs (gigabytes, then a crash), at
0.001 Å about 2e12 (it never returns). The estimate here costs a few microseconds
and needs only the atom count, the cell and the cutoff:

    pairs ~ (pi / 6) * N^2 * prod_d f_d

with ``f_d = 2 cutoff / h_d`` along a periodic axis of lattice-plane spacing
``h_d`` (more than one when the cell is smaller than the cutoff: periodic images)
and ``f_d = min(1, 2 cutoff / L_d)`` along an open axis over which the atoms spread
``L_d``. It is the pair count of a uniform density (exact for the tiny cells that
explode; a few times too high for very skewed cells, too low for a cluster in a
large empty box), compared with a limit of :data:`DEFAULT_MAX_PAIRS` pairs per
structure, or the value of the environment variable :data:`MAX_PAIRS_ENV`.

Example:
    >>> import numpy as np
    >>> estimate_pairs(2, np.eye(3) * 0.02, [True] * 3, 5.0) > 1e8
    True
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MAX_PAIRS",
    "MAX_PAIRS_ENV",
    "READ_CHECK_CUTOFF",
    "check_structure",
    "estimate_pairs",
    "max_pairs",
    "refuse",
]

DEFAULT_MAX_PAIRS = 5e7
MAX_PAIRS_ENV = "NVALCHEMI_MAX_NEIGHBOR_PAIRS"
# Readers do not know the model's cutoff; they check at the largest common one.
READ_CHECK_CUTOFF = 6.0
_SPHERE_IN_CUBE = math.pi / 6.0


def max_pairs(value: float | None = None) -> float:
    """The pair limit: ``value``, else ``$NVALCHEMI_MAX_NEIGHBOR_PAIRS``, else 5e7."""
    if value is not None:
        return float(value)
    raw = os.environ.get(MAX_PAIRS_ENV)
    if not raw:
        return DEFAULT_MAX_PAIRS
    try:
        limit = float(raw)
    except ValueError:
        raise ValueError(
            f"{MAX_PAIRS_ENV}={raw!r} is not a number; set it to a pair count such as 2e8."
        ) from None
    if not limit > 0:
        raise ValueError(f"{MAX_PAIRS_ENV} must be a positive pair count; got {raw!r}.")
    return limit


def _cross(u: Sequence[float], v: Sequence[float]) -> list[float]:
    return [u[1] * v[2] - u[2] * v[1], u[2] * v[0] - u[0] * v[2], u[0] * v[1] - u[1] * v[0]]


def _dot(u: Sequence[float], v: Sequence[float]) -> float:
    return u[0] * v[0] + u[1] * v[1] + u[2] * v[2]


def _norm(u: Sequence[float]) -> float:
    return math.sqrt(_dot(u, u))


def plane_spacings(rows: list[list[float]]) -> list[float]:
    """Spacing of the lattice planes of 1-3 periodic rows (0 when degenerate)."""
    if len(rows) == 1:
        return [_norm(rows[0])]
    if len(rows) == 2:
        a, b = rows
        area = _norm(_cross(a, b))
        return [area / _norm(b) if area else 0.0, area / _norm(a) if area else 0.0]
    a, b, c = rows
    volume = abs(_dot(a, _cross(b, c)))
    spacings = []
    for u, v in ((b, c), (c, a), (a, b)):
        area = _norm(_cross(u, v))
        spacings.append(volume / area if area else 0.0)
    return spacings


def _open_directions(rows: list[list[float]]) -> list[np.ndarray]:
    """Unit vectors spanning the complement of the periodic rows."""
    if not rows:
        return list(np.eye(3))
    if len(rows) == 2:
        normal = np.cross(rows[0], rows[1])
        return [normal / np.linalg.norm(normal)]
    axis = np.asarray(rows[0], dtype=float)
    axis = axis / np.linalg.norm(axis)
    helper = np.eye(3)[int(np.argmin(np.abs(axis)))]
    u = helper - helper.dot(axis) * axis
    u = u / np.linalg.norm(u)
    return [u, np.cross(axis, u)]


def estimate_pairs(
    num_atoms: int, cell: Any, pbc: Any, cutoff: float, positions: Any = None
) -> float:
    """Expected number of (full-list) neighbour pairs of one structure; see the module doc.

    ``positions`` (``[N, 3]``) refines the open axes (``None``: they count fully).
    NaN for a degenerate periodic cell (zero or dependent periodic rows).
    """
    n = int(num_atoms)
    if n < 1:
        return 0.0
    periodic = [False] * 3 if pbc is None else [bool(p) for p in np.asarray(pbc).reshape(-1)]
    if len(periodic) == 1:
        periodic = periodic * 3
    rows = []
    if cell is not None and any(periodic):
        box = np.asarray(cell, dtype=float).reshape(3, 3).tolist()
        rows = [row for row, p in zip(box, periodic) if p]
    factor = _SPHERE_IN_CUBE * n * n
    for spacing in plane_spacings(rows) if rows else []:
        if not spacing > 0 or not math.isfinite(spacing):
            return math.nan  # a degenerate cell: the builders' cell check explains it
        factor *= 2.0 * cutoff / spacing
    if positions is not None and len(rows) < 3 and n > 1:
        points = np.asarray(positions, dtype=float).reshape(-1, 3)
        for direction in _open_directions(rows):
            extent = float(np.ptp(points @ direction))
            if extent > 2.0 * cutoff:
                factor *= 2.0 * cutoff / extent
    return factor


def refuse(
    where: str,
    estimate: float,
    limit: float,
    num_atoms: int,
    cell: Any,
    pbc: Any,
    cutoff: float,
    reading: bool = False,
) -> ValueError:
    """The error for a structure whose list would have about ``estimate`` pairs."""
    periodic = [False] * 3 if pbc is None else [bool(p) for p in np.asarray(pbc).reshape(-1)]
    if len(periodic) == 1:
        periodic = periodic * 3
    rows = (
        np.asarray(cell, dtype=float).reshape(3, 3).round(6).tolist() if cell is not None else None
    )
    detail = ""
    periodic_rows = [r for r, p in zip(rows or [], periodic) if p]
    if periodic_rows:
        spacing = min(plane_spacings(periodic_rows))
        if spacing > 0:
            detail = (
                f"; its periodic lattice planes are {spacing:.3g} Å apart, so each atom "
                f"would see about {(2 * cutoff / spacing) ** len(periodic_rows):.3g} periodic "
                "images of the cell within the cutoff"
            )
    at = (
        f"at the {cutoff:g} Å cutoff used to check cells on reading"
        if reading
        else f"at cutoff {cutoff:g} Å"
    )
    return ValueError(
        f"{where}: refusing to build a neighbour list of about {estimate:.3g} pairs "
        f"(limit {limit:.3g}) for {num_atoms} atoms {at}, cell {rows} Å, pbc {periodic}"
        f"{detail}. Likely cause: the cell is in the wrong units (nm or Bohr instead of Å, "
        "or fractional) or far too small for the cutoff. Fix the cell of this structure, or "
        f"raise the limit with the environment variable {MAX_PAIRS_ENV}=<pairs> if it "
        "really is this dense."
    )


def check_structure(
    num_atoms: int,
    cell: Any,
    pbc: Any,
    cutoff: float | None,
    positions: Any = None,
    *,
    where: str,
    limit: float | None = None,
) -> float:
    """Estimate one structure's pair count and raise :func:`refuse`'s error above the limit."""
    reading = cutoff is None
    cutoff = READ_CHECK_CUTOFF if reading else float(cutoff)
    bound = max_pairs(limit)
    estimate = estimate_pairs(num_atoms, cell, pbc, cutoff)
    if estimate > bound and positions is not None:
        estimate = estimate_pairs(num_atoms, cell, pbc, cutoff, positions)
    if estimate > bound:
        raise refuse(where, estimate, bound, num_atoms, cell, pbc, cutoff, reading)
    return estimate
