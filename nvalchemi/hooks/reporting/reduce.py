"""Reduce a :class:`ScalarSnapshot` across data-parallel ranks.

With ``rank_reduction`` set, a reporter calls :func:`reduce_scalar_snapshot`
on every rank at the same events; the scalar values are packed into one
float64 tensor and all-reduced in a single collective. The key sets must be
identical on every rank (checked with one ``all_gather_object`` first, so a
mismatch raises the same ``ValueError`` everywhere instead of hanging).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nvalchemi.distributed.runtime import (
    all_reduce,
    collective_device,
    get_world_size,
    is_distributed_initialized,
)
from nvalchemi.hooks.reporting.scalars import ScalarSnapshot

__all__ = ["RANK_REDUCTIONS", "normalize_rank_reduction", "reduce_scalar_snapshot"]

_OPS = {
    "mean": (dist.ReduceOp.SUM, True),
    "avg": (dist.ReduceOp.SUM, True),
    "average": (dist.ReduceOp.SUM, True),
    "sum": (dist.ReduceOp.SUM, False),
    "min": (dist.ReduceOp.MIN, False),
    "max": (dist.ReduceOp.MAX, False),
}
RANK_REDUCTIONS = ("none", *_OPS)


def normalize_rank_reduction(reduction: Any) -> tuple[Any, bool]:
    """``(ReduceOp or None, average)`` for ``None``, a name in :data:`RANK_REDUCTIONS` or a ReduceOp.

    Example:
        >>> normalize_rank_reduction("mean")[1], normalize_rank_reduction(None)
        (True, (None, False))
    """
    if reduction is None:
        return None, False
    if isinstance(reduction, str):
        key = reduction.strip().lower()
        if key == "none":
            return None, False
        if key not in _OPS:
            raise ValueError(
                f"Unknown rank_reduction {reduction!r}; use one of {RANK_REDUCTIONS} "
                "or a torch.distributed.ReduceOp."
            )
        return _OPS[key]
    if isinstance(reduction, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        return reduction, False
    raise TypeError(
        f"rank_reduction must be None, a string {RANK_REDUCTIONS} or a "
        f"torch.distributed.ReduceOp; got {type(reduction).__name__}."
    )


def reduce_scalar_snapshot(
    snapshot: ScalarSnapshot, reduction: Any, *, reporter_name: str = "reporter"
) -> ScalarSnapshot:
    """Return ``snapshot`` with its scalars reduced over all ranks (a no-op in one process).

    Must be called on every rank at the same event. ``ValueError`` (on every
    rank) when the ranks hold different scalar keys.
    """
    op, average = normalize_rank_reduction(reduction)
    if op is None or not is_distributed_initialized():
        return snapshot
    world_size = get_world_size()
    if world_size <= 1:
        return snapshot
    keys = tuple(sorted(snapshot.scalars))
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, keys)
    if any(other != keys for other in gathered):
        differing = sorted(set().union(*map(set, gathered)) - set.intersection(*map(set, gathered)))
        raise ValueError(
            f"{reporter_name}: cannot reduce scalars across ranks because the ranks report "
            f"different keys (only on some ranks: {differing}). Make every rank produce the "
            "same scalars (e.g. custom scalars that return a value on every rank), or set "
            "rank_reduction=None."
        )
    if not keys:
        return snapshot
    values = torch.tensor(
        [snapshot.scalars[k] for k in keys], dtype=torch.float64, device=collective_device()
    )
    values = all_reduce(values, op=op)
    if average:
        values = values / world_size
    return snapshot.with_scalars(dict(zip(keys, values.tolist())))
