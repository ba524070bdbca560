"""Select: which explored frames are worth a label.

A frame's committee max force deviation puts it in one of three bands (DP-GEN's trust
levels): below ``trust_lo`` the committee agrees (already known), from ``trust_lo`` up to
``trust_hi`` it disagrees (a candidate), above ``trust_hi`` the frame is likely
unphysical (counted, not labelled). Up to ``max_structures`` candidates are taken:

* ``method: diverse`` (the default): farthest-point sampling weighted by uncertainty. The
  most uncertain candidate first, then each time the one with the largest
  ``uncertainty x fingerprint distance to the nearest frame already taken``: uncertain
  frames, spread over the structures explored rather than the last frames of the
  hottest trajectory one after another.
* ``method: deviation``: the most uncertain first.
* ``method: random``: a seeded random draw from every frame (the benchmark's baseline).

Either way a frame within ``min_distance`` of one already taken (a near-duplicate) is
skipped. A frame's uncertainty is its max force deviation, or with ``score:
forces+energy`` its max force deviation plus its energy spread per atom, each divided by
its median over the candidates (both count, whatever their units).

The fingerprint is a cheap structural descriptor: the Gaussian-smeared
radial distribution of every element pair within 5 Å, per atom; two fingerprints are
compared by their relative difference ``|a - b| / mean(|a|, |b|)``: 0 for the same
structure, about 0.02-0.07 for frames of one equilibrated MD run (8 Cu atoms, 800 K),
0.3-0.4 for a 2 % strain or a slab against the bulk, 0.7 for an alloy against the metal.

Example:
    >>> import numpy as np
    >>> from ase.build import bulk
    >>> frames = [bulk("Cu", "fcc", a=a, cubic=True) for a in (3.6, 3.6, 3.9)]
    >>> for frame, deviation in zip(frames, (0.1, 0.12, 0.2)):
    ...     frame.info["max_force_deviation"] = deviation
    >>> class Select:
    ...     trust_lo, trust_hi, max_structures, min_distance = 0.05, 0.3, 5, 0.05
    ...     method, score = "deviation", "forces"
    >>> chosen, counts = select(frames, Select(), seed=0)  # frame 0 duplicates frame 1
    >>> chosen, counts["candidate"]
    ([2, 1], 3)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "FINGERPRINT_CUTOFF",
    "band_of",
    "bands",
    "distance",
    "fingerprint",
    "select",
    "uncertainty",
]

FINGERPRINT_CUTOFF = 5.0
_GRID = np.linspace(1.0, FINGERPRINT_CUTOFF, 41)
_WIDTH = 0.15


def band_of(deviation: float, settings: Any) -> str:
    """``"accurate"``, ``"candidate"`` or ``"failed"`` (non-finite counts as failed)."""
    if not np.isfinite(deviation) or deviation >= settings.trust_hi:
        return "failed"
    return "candidate" if deviation >= settings.trust_lo else "accurate"


def bands(frames: Sequence[Any], settings: Any) -> dict[str, int]:
    """How many frames fall in each band."""
    out = {"accurate": 0, "candidate": 0, "failed": 0}
    for frame in frames:
        out[band_of(float(frame.info["max_force_deviation"]), settings)] += 1
    return out


def fingerprint(atoms: Any, elements: Sequence[int]) -> np.ndarray:
    """The smeared radial distribution per element pair of ``atoms``, per atom."""
    from nvalchemi.data.neighbors import neighbor_list_for_system

    pbc = np.asarray(atoms.pbc, dtype=bool)
    cell = np.asarray(atoms.cell.array) if pbc.any() else None
    pairs, shifts = neighbor_list_for_system(
        atoms.positions, cell, pbc if pbc.any() else None, FINGERPRINT_CUTOFF, full_list=False
    )
    positions = atoms.positions
    vectors = positions[pairs[:, 1]] - positions[pairs[:, 0]]
    if cell is not None:
        vectors = vectors + shifts @ cell
    distances = np.linalg.norm(vectors, axis=1)
    index = {z: i for i, z in enumerate(elements)}
    numbers = atoms.numbers
    a = np.array([index[z] for z in numbers[pairs[:, 0]]], dtype=int)
    b = np.array([index[z] for z in numbers[pairs[:, 1]]], dtype=int)
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    kinds = len(elements)
    channel = lo * kinds + hi
    smeared = np.exp(-0.5 * ((distances[:, None] - _GRID[None, :]) / _WIDTH) ** 2)
    out = np.zeros((kinds * kinds, _GRID.size))
    np.add.at(out, channel, smeared)
    return out.reshape(-1) / max(len(atoms), 1)


def distance(a: np.ndarray, b: np.ndarray) -> float:
    """The relative difference of two fingerprints (0: the same; see the module doc)."""
    scale = 0.5 * (np.linalg.norm(a) + np.linalg.norm(b))
    return float(np.linalg.norm(a - b) / scale) if scale > 0 else 0.0


def uncertainty(frames: Sequence[Any], score: str = "forces") -> np.ndarray:
    """The selection score of every frame (see the module doc): its max force deviation
    (``"forces"``), or with ``"forces+energy"`` that plus its energy spread per atom
    (``info["energy_std"]``), each over its median among ``frames``."""
    forces = np.array([float(f.info["max_force_deviation"]) for f in frames])
    if score == "forces" or not len(frames):
        return forces
    missing = [k for k, f in enumerate(frames) if "energy_std" not in f.info]
    if missing:
        raise ValueError(
            f"score 'forces+energy' needs every candidate's energy spread; frame {missing[0]} "
            "has no info['energy_std'] (explored before nvalchemi recorded it: explore again, "
            "or use score: forces)"
        )
    energy = np.array([float(f.info["energy_std"]) / max(len(f), 1) for f in frames])
    return sum(values / max(float(np.median(values)), 1e-12) for values in (forces, energy))


def select(frames: Sequence[Any], settings: Any, *, seed: int) -> tuple[list[int], dict]:
    """``(indices of the chosen frames, frames per band)``.

    ``method: diverse`` takes candidates by farthest-point sampling weighted by their
    uncertainty, ``deviation`` from the most uncertain down; ``random`` draws from every
    frame in a seeded random order. Either way a frame within ``min_distance`` of one
    already chosen is skipped, up to ``max_structures``.
    """
    counts = bands(frames, settings)
    deviations = np.array([float(f.info["max_force_deviation"]) for f in frames])
    elements = sorted({int(z) for frame in frames for z in frame.numbers})
    candidates = [i for i, d in enumerate(deviations) if band_of(d, settings) == "candidate"]
    if settings.method == "diverse":
        chosen = _farthest_first(frames, candidates, elements, settings)
        counts["selected"] = len(chosen)
        return chosen, counts
    if settings.method == "random":
        order = np.random.default_rng(seed).permutation(len(frames)).tolist()
    else:
        scores = uncertainty([frames[i] for i in candidates], settings.score)
        ranked = sorted(range(len(candidates)), key=lambda k: (-scores[k], candidates[k]))
        order = [candidates[k] for k in ranked]
    chosen: list[int] = []
    prints: list[np.ndarray] = []
    for i in order:
        if len(chosen) >= settings.max_structures:
            break
        vector = fingerprint(frames[i], elements)
        if any(distance(vector, other) < settings.min_distance for other in prints):
            continue
        chosen.append(i)
        prints.append(vector)
    counts["selected"] = len(chosen)
    return chosen, counts


def _farthest_first(
    frames: Sequence[Any], candidates: list[int], elements: list[int], settings: Any
) -> list[int]:
    """Farthest-point sampling of ``candidates`` weighted by their uncertainty."""
    if not candidates:
        return []
    scores = uncertainty([frames[i] for i in candidates], settings.score)
    prints = [fingerprint(frames[i], elements) for i in candidates]
    nearest = np.full(len(candidates), np.inf)  # distance to the nearest frame taken
    taken: list[int] = []
    while len(taken) < settings.max_structures:
        allowed = nearest >= max(settings.min_distance, 1e-12)  # not taken, no duplicate
        if not allowed.any():
            break
        value = np.where(allowed, scores * np.minimum(nearest, 1e12), -np.inf)
        pick = int(np.argmax(value))  # the first of equals: deterministic
        taken.append(pick)
        for k in np.flatnonzero(allowed):
            nearest[k] = min(nearest[k], distance(prints[k], prints[pick]))
    return [candidates[k] for k in taken]
