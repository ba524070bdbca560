"""Collation for :class:`~nvalchemi.data.Batch`: concatenating fields level by level.

Also the index helpers the batch builds its ``batch_idx``/``ptr`` and selections with
(all on int64 CPU count tensors, without Python loops over structures).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from nvalchemi.data.fields import FIELDS, Level, is_label
from nvalchemi.data.weights import WEIGHT_FIELDS

_LEVEL_ALIASES: dict[str, Level] = {
    "atom": "atom",
    "atoms": "atom",
    "node": "atom",
    "nodes": "atom",
    "edge": "edge",
    "edges": "edge",
    "system": "system",
    "graph": "system",
}


def normalize_level(level: str) -> Level:
    try:
        return _LEVEL_ALIASES[level]
    except KeyError:
        raise ValueError(
            f"Unknown level {level!r}; use 'atom' (alias 'node'), 'edge' or 'system'."
        ) from None


def exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


def repeat(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times (both 1-D int64).

    On CPU this goes through numpy: ``torch.repeat_interleave`` opens an OpenMP
    region even for a few hundred elements, which stalls for milliseconds on a busy
    machine (data-loading workers).
    """
    if values.device.type == "cpu" and counts.device.type == "cpu":
        return torch.from_numpy(np.repeat(values.numpy(), counts.numpy()))
    return torch.repeat_interleave(values, counts)


def owners(counts: torch.Tensor) -> torch.Tensor:
    """The owning system of every row: ``i`` repeated ``counts[i]`` times."""
    return repeat(torch.arange(counts.shape[0]), counts)


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """``[0, c_0, c_0 + c_1, ...]`` (int64, one more entry than ``counts``)."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])


def ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + c)`` for every pair, without a Python loop."""
    shift = repeat(starts - exclusive_cumsum(counts), counts)
    return shift + torch.arange(shift.shape[0], dtype=torch.int64)


def select_systems(idx: Any, n: int) -> torch.Tensor:
    """System indices (int64, CPU) for a batch index: int, slice, sequence, array or mask."""
    if isinstance(idx, slice):
        return torch.arange(n)[idx]
    if isinstance(idx, (int, np.integer)):
        idx = [int(idx)]
    if isinstance(idx, np.ndarray):
        idx = torch.from_numpy(idx)
    if isinstance(idx, torch.Tensor):
        if idx.dtype.is_floating_point:
            raise IndexError("Batch index tensors must be integer or bool, not float.")
        if idx.dtype == torch.bool:
            if idx.shape != (n,):
                raise IndexError(f"Boolean mask must have shape [{n}]; got {list(idx.shape)}.")
            idx = idx.nonzero().flatten()
        out = idx.to(device="cpu", dtype=torch.int64).flatten()
    elif isinstance(idx, Sequence) and not isinstance(idx, str):
        items = list(idx)
        if items and all(isinstance(i, (bool, np.bool_)) for i in items):
            return select_systems(torch.tensor(items, dtype=torch.bool), n)
        if not all(
            isinstance(i, (int, np.integer)) or (isinstance(i, torch.Tensor) and i.dim() == 0)
            for i in items
        ):
            raise IndexError("Batch indices must be integers.")
        out = torch.tensor([int(i) for i in items], dtype=torch.int64)
    else:
        raise IndexError(f"Unsupported index type {type(idx).__name__} for Batch.")
    if out.numel() == 0:
        raise IndexError("Index is empty.")
    if bool(((out < -n) | (out >= n)).any()):
        raise IndexError(f"Batch index out of range for {n} systems: {out.tolist()}.")
    return out % n


def missing_fill(name: str, like: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Value for a structure that lacks ``name``, or ``None`` when it may not be missing."""
    shape = (rows, *like.shape[1:])
    if name == "cell":
        return torch.zeros(shape, dtype=like.dtype)
    if name == "pbc":
        return torch.zeros(shape, dtype=torch.bool)
    if name in WEIGHT_FIELDS:  # a structure without a weight counts once
        return torch.ones(shape, dtype=like.dtype)
    spec = FIELDS.get(name)
    if spec is not None and spec.label:
        return torch.full(shape, float("nan"), dtype=like.dtype)
    return None


def collate(
    parts: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, Level]]],
    part_nodes: torch.Tensor,
    part_edges: torch.Tensor,
    part_graphs: torch.Tensor,
    exclude: set[str],
    field_levels: Mapping[str, str] | None,
    part_missing: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Level], dict[str, torch.Tensor]]:
    """Concatenate the fields of ``parts`` (structures or batches) level by level.

    Returns the fields, their levels, and the missing-label masks: for every label that
    some structure lacks, a CPU bool ``(B,)`` tensor that is ``True`` for those structures
    (``part_missing`` holds the masks the parts already carry, for batches).
    """
    levels: dict[str, Level] = {}
    for fields, part_levels in parts:
        for key in fields:
            if key in exclude or key in levels:
                continue
            level = part_levels.get(key)
            if level is None and field_levels is not None and key in field_levels:
                level = normalize_level(field_levels[key])
            levels[key] = level or "system"
    rows = {
        "atom": part_nodes.tolist(),
        "edge": part_edges.tolist(),
        "system": part_graphs.tolist(),
    }
    out: dict[str, torch.Tensor] = {}
    masks: dict[str, torch.Tensor] = {}
    for key, level in levels.items():
        tensors = [fields.get(key) for fields, _ in parts]
        present = next(t for t in tensors if t is not None)
        missing = [i for i, t in enumerate(tensors) if t is None]
        carried = part_missing is not None and any(key in m for m in part_missing)
        if (missing or carried) and is_label(key):
            masks[key] = _missing_mask(key, tensors, rows["system"], part_missing, present.device)
        if missing:
            fill_rows = rows[level]
            if missing_fill(key, present, 1) is None:
                hint = (
                    " Compute neighbour lists for all structures or none."
                    if level == "edge"
                    else ""
                )
                raise ValueError(
                    f"Field {key!r} is present in some structures but missing in structures "
                    f"{missing[:10]}{'...' if len(missing) > 10 else ''}; every structure in a "
                    f"batch needs it (only labels, cell, pbc and weights may be missing).{hint}"
                )
            for i in missing:
                tensors[i] = missing_fill(key, present, fill_rows[i])
        first = tensors[0].dtype
        if any(t.dtype != first for t in tensors):
            bad = next(i for i, t in enumerate(tensors) if t.dtype != first)
            raise ValueError(
                f"Field {key!r} has dtype {first} in structure 0 but {tensors[bad].dtype} in "
                f"structure {bad}; cast the structures to one dtype (e.g. data.to(dtype=...))."
            )
        try:
            value = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
        except RuntimeError as exc:
            shapes = sorted({tuple(t.shape[1:]) for t in tensors})
            raise ValueError(
                f"Cannot concatenate field {key!r}: trailing shapes {shapes} or devices differ "
                f"across structures ({exc})."
            ) from None
        if key == "neighbor_list" and len(tensors) > 1:
            per_edge = repeat(exclusive_cumsum(part_nodes), part_edges)
            value = value + per_edge.to(value.device).unsqueeze(1)
        out[key] = value
    return out, levels, masks


def _missing_mask(
    key: str,
    tensors: Sequence[torch.Tensor | None],
    graphs: Sequence[int],
    part_missing: Sequence[Mapping[str, torch.Tensor]] | None,
    device: torch.device,
) -> torch.Tensor:
    """``(B,)`` bool: ``True`` for the structures of the parts that lack ``key``."""
    pieces = []
    for i, (tensor, count) in enumerate(zip(tensors, graphs)):
        carried = part_missing[i].get(key) if part_missing is not None else None
        if tensor is None:
            pieces.append(torch.ones(count, dtype=torch.bool, device=device))
        elif carried is not None:
            pieces.append(carried.to(device=device, dtype=torch.bool))
        else:
            pieces.append(torch.zeros(count, dtype=torch.bool, device=device))
    return torch.cat(pieces)
