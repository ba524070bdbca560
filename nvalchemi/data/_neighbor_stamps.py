"""Neighbour-list stamps: which cutoff and half/full choice a stored list was built with.

On a ``Batch`` a stamp is the attributes ``<prefix>_cutoff`` / ``<prefix>_half_list``
(prefix ``_neighbor_list``, or ``_neighbor_matrix`` for the matrix format), tied to the
positions tensor the list was built from (``<prefix>_positions``); on an
``AtomicData`` it is the ``info`` keys ``"neighbor_list_cutoff"`` /
``"neighbor_list_half_list"``. Consumers such as ``NeighborListHook`` use it to tell a
valid precomputed list from a stale one. Stamps describe the edge level, so every
batch operation that keeps the edges keeps them; the positions record is
deliberately not carried over.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nvalchemi.data.atomic_data import AtomicData

__all__ = [
    "STAMP_CUTOFF",
    "STAMP_HALF",
    "clear_stamps",
    "common_stamps",
    "copy_stamps",
    "has_neighbor_list",
    "remember_positions",
    "stamp_batch",
    "stamp_of",
]

STAMP_CUTOFF = "neighbor_list_cutoff"
STAMP_HALF = "neighbor_list_half_list"
_PREFIX = {"coo": "_neighbor_list", "matrix": "_neighbor_matrix"}
# The batch attributes that carry over with the edges (not the positions record).
_CARRIED = tuple(prefix + part for prefix in _PREFIX.values() for part in ("_cutoff", "_half_list"))


def stamp_of(obj: Any, format: str = "coo") -> tuple[float, bool] | None:
    """``(cutoff, half_list)`` of the valid list of ``format`` that ``obj`` carries, if known."""
    info = getattr(obj, "info", None)
    if format == "coo" and isinstance(info, Mapping) and STAMP_CUTOFF in info:
        return float(info[STAMP_CUTOFF]), bool(info.get(STAMP_HALF, False))
    attrs = getattr(obj, "__dict__", {})
    prefix = _PREFIX[format]
    cutoff = attrs.get(prefix + "_cutoff")
    if cutoff is None:
        return None
    # A list built here remembers which positions tensor (and which in-place version
    # of it) it was built from, so moved atoms (dynamics) are never served a stale list.
    built_from = attrs.get(prefix + "_positions")
    if built_from is not None and not built_from.matches(attrs.get("_data", {}).get("positions")):
        return None
    return float(cutoff), bool(attrs.get(prefix + "_half_list", False))


class _BuiltFrom:
    """The positions tensor (weakly) and its in-place version a list was built from.

    Pickles (and deep-copies) to ``None``: an unpickled batch has new tensors
    holding the same values, for which the list is valid.
    """

    __slots__ = ("ref", "version")

    def __init__(self, positions: torch.Tensor) -> None:
        self.ref = weakref.ref(positions)
        self.version = positions._version

    def matches(self, positions: Any) -> bool:
        return self.ref() is positions and positions._version == self.version

    def __reduce__(self) -> tuple:
        return (_no_record, ())


def _no_record() -> None:
    return None


def remember_positions(batch: Any, format: str = "coo") -> None:
    """Tie ``batch``'s neighbour-list stamp to its current positions.

    Later in-place changes or replacement of ``batch.positions`` then invalidate
    the stamp (see :func:`has_neighbor_list`).
    """
    object.__setattr__(batch, _PREFIX[format] + "_positions", _BuiltFrom(batch.positions))


def stamp_batch(batch: Any, cutoff: float, half_list: bool, format: str = "coo") -> None:
    """Record that ``batch``'s list of ``format`` was just built with these options."""
    prefix = _PREFIX[format]
    object.__setattr__(batch, prefix + "_cutoff", cutoff)
    object.__setattr__(batch, prefix + "_half_list", half_list)
    remember_positions(batch, format)


def has_neighbor_list(
    obj: Any, cutoff: float, *, half_list: bool = False, format: Any = "coo"
) -> bool:
    """Whether ``obj`` (a ``Batch`` or ``AtomicData``) holds a list built for these options.

    True only when the list's stamp (see :mod:`nvalchemi.data.neighbors`) says it was
    built with this cutoff, half/full choice and format and, for lists built by
    :func:`~nvalchemi.data.neighbors.compute_neighbors`, the positions have not been
    replaced or modified in place since; a list of unknown origin is not trusted.
    """
    fmt = str(getattr(format, "value", format)).lower()
    if fmt not in _PREFIX or ("neighbor_matrix" if fmt == "matrix" else "neighbor_list") not in obj:
        return False
    stamp = stamp_of(obj, fmt)
    return stamp is not None and stamp == (float(cutoff), bool(half_list))


# ------------------------------------------------------------------------- batches
def clear_stamps(batch: Any) -> None:
    """Forget ``batch``'s stamps (its edges were replaced)."""
    for name in _CARRIED:
        batch.__dict__.pop(name, None)


def copy_stamps(source: Any, target: Any) -> Any:
    """Give ``target`` (a batch with ``source``'s edges) ``source``'s stamps; return it."""
    for name in _CARRIED:
        value = source.__dict__.get(name)
        if value is not None:
            object.__setattr__(target, name, value)
    return target


def common_stamps(items: Sequence[Any], target: Any) -> Any:
    """Stamp ``target`` when every item (structure or batch) carries the same stamp."""
    pairs = ((STAMP_CUTOFF, "_neighbor_list_cutoff"), (STAMP_HALF, "_neighbor_list_half_list"))
    for info_key, attr in pairs:
        values = {
            (it.info.get(info_key) if isinstance(it, AtomicData) else it.__dict__.get(attr))
            for it in items
        }
        if len(values) == 1 and None not in values:
            object.__setattr__(target, attr, values.pop())
    return target
