"""The vesin backend of the neighbour lists: reusable calculators, boxes, one call.

vesin (C++) computes the pairs and integer lattice shifts of one structure. This
module keeps one calculator per (options, thread), turns a cell and ``pbc`` into the
box vesin expects (rejecting degenerate periodic cells, on which vesin would crash
the process) and converts its outputs; :mod:`nvalchemi.data.neighbors` builds the
public functions on it.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch

__all__ = ["as_numpy", "box_and_periodic", "calculator", "run_vesin", "vesin_method"]

_VESIN_METHODS = {"auto": "auto", "cell_list": "cell_list", "naive": "auto", "brute_force": "auto"}
_local = threading.local()


def vesin_method(method: str | None) -> str:
    if method is None:
        return "auto"
    try:
        return _VESIN_METHODS[str(method).lower()]
    except KeyError:
        raise ValueError(
            f"Unknown neighbour-list method {method!r}; use one of {sorted(_VESIN_METHODS)}."
        ) from None


def calculator(cutoff: float, full_list: bool, method: str = "auto", n_threads: int = 0):
    """One reusable vesin ``NeighborList`` per (options, thread)."""
    cache = getattr(_local, "calculators", None)
    if cache is None:
        cache = _local.calculators = {}
    key = (cutoff, full_list, method, n_threads)
    calc = cache.get(key)
    if calc is None:
        import vesin

        if len(cache) > 16:  # many distinct cutoffs: keep memory bounded
            cache.clear()
        calc = cache[key] = vesin.NeighborList(
            cutoff=cutoff, full_list=full_list, sorted=True, algorithm=method, n_threads=n_threads
        )
    return calc


def as_numpy(value: Any, dtype: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        value = value.numpy()
    return np.asarray(value, dtype=dtype)


def box_and_periodic(cell: Any, pbc: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The vesin box (float64 [3,3]) and periodic flags for one structure.

    vesin needs a box even without periodicity; rows of non-periodic directions are
    zeroed (they never enter a displacement because their shift is always 0), which
    is also how vesin handles open boundaries. Degenerate periodic rows would make
    vesin crash the process (SIGFPE), so they are rejected here.
    """
    if pbc is None or cell is None:
        if pbc is not None and np.asarray(as_numpy(pbc, bool)).any():
            raise ValueError(f"{where}: pbc is set but no cell was given.")
        return np.zeros((3, 3)), np.zeros(3, dtype=bool)
    periodic = as_numpy(pbc, bool).reshape(-1)
    if periodic.shape == (1,):
        periodic = np.repeat(periodic, 3)
    box = as_numpy(cell, np.float64).reshape(-1)
    if periodic.shape != (3,) or box.shape != (9,):
        raise ValueError(
            f"{where}: expected cell [3, 3] and pbc [3]; got {box.size} cell values and "
            f"{periodic.size} pbc flags."
        )
    if not periodic.any():
        return np.zeros((3, 3)), periodic
    box = np.where(periodic[:, None], box.reshape(3, 3), 0.0)
    rows = [row for row, p in zip(box.tolist(), periodic.tolist()) if p]
    if not _independent(rows):
        raise ValueError(
            f"{where}: periodic cell vectors {rows} are zero, non-finite or linearly dependent "
            f"(pbc={periodic.tolist()}); give independent lattice vectors for every periodic "
            "direction."
        )
    return box, periodic


def _independent(rows: list[list[float]]) -> bool:
    """Whether 1-3 vectors are finite and linearly independent (Gram determinant test).

    Plain Python on at most 9 numbers: several times cheaper than numpy here, and
    this runs once per structure.
    """
    if not all(math.isfinite(x) for row in rows for x in row):
        return False

    def dot(u, v):
        return u[0] * v[0] + u[1] * v[1] + u[2] * v[2]

    norms = [dot(r, r) for r in rows]
    scale = math.prod(norms)
    if scale == 0.0:
        return False
    if len(rows) == 1:
        return True
    if len(rows) == 2:
        a, b = rows
        return norms[0] * norms[1] - dot(a, b) ** 2 > 1e-10 * scale
    a, b, c = rows
    det = (
        a[0] * (b[1] * c[2] - b[2] * c[1])
        - a[1] * (b[0] * c[2] - b[2] * c[0])
        + a[2] * (b[0] * c[1] - b[1] * c[0])
    )
    return det * det > 1e-10 * scale


def run_vesin(calc, positions: np.ndarray, box, periodic, where: str):
    if positions.shape[0] == 0:
        return np.zeros((0, 2), dtype=np.int64), np.zeros((0, 3), dtype=np.int64)
    try:
        pairs, shifts = calc.compute(positions, box, periodic, "PS", copy=False)
    except RuntimeError as exc:
        raise ValueError(f"{where}: neighbour-list computation failed: {exc}") from exc
    # The outputs are views into vesin's buffers; astype copies them out (once).
    return pairs.astype(np.int64), shifts.astype(np.int64)
