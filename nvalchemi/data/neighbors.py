"""Neighbour lists on vesin (C++), their periodic shifts, and differentiable edge vectors.

Convention (the same as ``ase.neighborlist.neighbor_list``): an edge ``e = (i, j)``
is stored as ``neighbor_list[e] = [i, j]`` (``[sender, receiver]``) with integer
lattice images ``neighbor_list_shifts[e] = S``, and its displacement vector is::

    positions[j] - positions[i] + S @ cell        # cell rows are lattice vectors

so distances, forces and stresses computed from :func:`edge_vectors` are
differentiable with respect to positions *and* cell. Lists are sorted by sender.
A full list holds every pair in both directions; a half list holds each pair once
(including the pair of an atom with one of its own periodic images).

Entry points:

* :func:`neighbor_list_for_system`: one structure, numpy in and out.
* :func:`compute_neighbors`: every structure of a ``Batch``, written in place.
* :class:`NeighborListTransform`: a per-sample dataset transform, so lists can
  be built in loader workers (with an optional per-index cache).
* :func:`edge_vectors`: displacement vectors from positions, cell and a list.

Lists built here carry a *stamp* (cutoff and half/full) so that consumers such as
``NeighborListHook`` can tell a valid precomputed list from a stale one: on a
``Batch`` it is the attributes ``_neighbor_list_cutoff`` /
``_neighbor_list_half_list`` (``_neighbor_matrix_*`` for the matrix format), tied
to the positions tensor they were built from; on an ``AtomicData`` the ``info``
keys ``"neighbor_list_cutoff"`` / ``"neighbor_list_half_list"``
(:mod:`nvalchemi.data._neighbor_stamps` keeps them).

Example:
    >>> import numpy as np
    >>> from nvalchemi.data.neighbors import neighbor_list_for_system
    >>> pairs, shifts = neighbor_list_for_system(
    ...     np.zeros((1, 3)), np.eye(3) * 2.0, [True, True, True], cutoff=2.5)
    >>> pairs.shape, shifts.shape  # an atom alone in a 2 Å cube sees its 6 nearest images
    ((6, 2), (6, 3))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from nvalchemi.data._neighbor_stamps import (
    STAMP_CUTOFF,
    STAMP_HALF,
    has_neighbor_list,
    stamp_batch,
    stamp_of,
)
from nvalchemi.data._vesin import as_numpy, box_and_periodic, calculator, vesin_method
from nvalchemi.data._vesin import run_vesin as _run_vesin
from nvalchemi.data.atomic_data import AtomicData

__all__ = [
    "NeighborListTransform",
    "compute_neighbors",
    "edge_vectors",
    "has_neighbor_list",
    "neighbor_list_for_system",
    "resolve_neighbor_options",
]

# Edge fields that compute_neighbors owns (recomputed), versus user edge fields that
# would silently stop matching a new edge set.
_OWNED_EDGE_FIELDS = ("neighbor_list", "neighbor_list_shifts", "shifts")


# --------------------------------------------------------------------------- options
def resolve_neighbor_options(
    cutoff: float | None = None,
    config: Any = None,
    half_list: bool | None = None,
    format: Any = None,
) -> tuple[float, bool, str]:
    """Turn a cutoff and/or a ``NeighborConfig``-like object into ``(cutoff, half_list, format)``.

    ``config`` is duck-typed: any object with a ``cutoff`` attribute, optionally
    ``half_list`` and ``format`` (``"coo"``/``"matrix"`` or an enum with that
    ``value``). Values from ``config`` take precedence; a plain number is accepted
    as ``config`` too. ``format`` is returned lower-case.
    """
    if config is not None:
        if isinstance(config, (int, float)) and not isinstance(config, bool):
            cutoff = float(config)
        else:
            if not hasattr(config, "cutoff"):
                raise TypeError(
                    f"config must be a NeighborConfig-like object with a 'cutoff' attribute "
                    f"(or a number); got {type(config).__name__}."
                )
            cutoff = config.cutoff
            half_list = getattr(config, "half_list", half_list)
            format = getattr(config, "format", format)
    if cutoff is None:
        raise ValueError(
            "No neighbour-list cutoff given; pass cutoff=... (Å) or config=NeighborConfig(...)."
        )
    if isinstance(cutoff, bool) or not isinstance(cutoff, (int, float, np.floating, np.integer)):
        raise TypeError(f"cutoff must be a number in Å; got {cutoff!r}.")
    cutoff = float(cutoff)
    if not np.isfinite(cutoff) or cutoff <= 0.0:
        raise ValueError(f"cutoff must be a positive, finite number of Å; got {cutoff}.")
    fmt = str(getattr(format, "value", format) if format is not None else "coo").lower()
    if fmt not in ("coo", "matrix"):
        raise ValueError(f"Unknown neighbour-list format {format!r}; use 'coo' or 'matrix'.")
    return cutoff, bool(half_list), fmt


# ------------------------------------------------------------------- one structure
def neighbor_list_for_system(
    positions: Any,
    cell: Any,
    pbc: Any,
    cutoff: float,
    *,
    full_list: bool = True,
    method: str | None = None,
    n_threads: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Neighbour list of one structure.

    Args:
        positions: ``[N, 3]`` positions in Å (numpy or a CPU/GPU tensor).
        cell: ``[3, 3]`` (or ``[1, 3, 3]``) lattice vectors as rows, or ``None``.
        pbc: periodic flags ``[3]`` (or one bool), or ``None`` for open boundaries.
        cutoff: pairs closer than ``cutoff`` Å are neighbours.
        full_list: both directions of every pair (``True``) or each pair once.
        method: vesin algorithm: ``"auto"`` (default) or ``"cell_list"``.
        n_threads: vesin threads (0: vesin's default, all cores).

    Returns:
        ``(neighbor_list [E, 2] int64, shifts [E, 3] int64)``, sorted by sender
        (``neighbor_list[:, 0]``), with ``positions[j] - positions[i] + shifts @ cell``
        the displacement of edge ``(i, j)``. Atoms may lie outside the cell, the
        cutoff may exceed the cell (an atom then sees its own images), the cell may
        be triclinic and periodicity may be mixed (e.g. a slab).

    Raises:
        ValueError: bad cutoff, non-finite positions or a degenerate periodic cell.
    """
    cutoff, _, _ = resolve_neighbor_options(cutoff)
    pos = as_numpy(positions, np.float64)
    if pos.ndim != 2 or pos.shape[1] != 3:
        raise ValueError(f"positions must have shape [n_atoms, 3]; got {list(pos.shape)}.")
    box, periodic = box_and_periodic(cell, pbc, "neighbor_list_for_system")
    calc = calculator(cutoff, bool(full_list), vesin_method(method), int(n_threads))
    return _run_vesin(calc, pos, box, periodic, "neighbor_list_for_system")


# -------------------------------------------------------------------------- batches
def _check_edge_fields(fields: Any, where: str) -> list[str]:
    """Edge fields other than the ones a rebuild recomputes (they would stop matching)."""
    levels = getattr(fields, "_level_of", None) or getattr(fields, "_levels", {})
    foreign = [k for k, lvl in levels.items() if lvl == "edge" and k not in _OWNED_EDGE_FIELDS]
    if foreign:
        raise ValueError(
            f"{where}: cannot rebuild the neighbour list because per-edge fields {foreign} "
            "belong to the current edge set and would no longer match. Delete them first "
            "(del batch[key]) or add them after the neighbour list is built."
        )
    return foreign


def _system_lists(
    positions: np.ndarray,
    counts: list[int],
    cells: np.ndarray | None,
    pbcs: np.ndarray | None,
    calc,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lists of every structure, concatenated with global atom indices."""
    pair_parts, shift_parts = [], []
    edge_counts = np.zeros(len(counts), dtype=np.int64)
    start = 0
    no_box = (np.zeros((3, 3)), np.zeros(3, dtype=bool))
    for g, n in enumerate(counts):
        stop = start + n
        where = f"compute_neighbors: system {g}"
        if pbcs is None or cells is None or not pbcs[g].any():
            box, periodic = no_box
        else:
            box, periodic = box_and_periodic(cells[g], pbcs[g], where)
        pairs, shifts = _run_vesin(calc, positions[start:stop], box, periodic, where)
        if start:
            pairs += start
        pair_parts.append(pairs)
        shift_parts.append(shifts)
        edge_counts[g] = pairs.shape[0]
        start = stop
    if len(pair_parts) == 1:
        return pair_parts[0], shift_parts[0], edge_counts
    return np.concatenate(pair_parts), np.concatenate(shift_parts), edge_counts


def _to_matrix(
    pairs: torch.Tensor, shifts: torch.Tensor, num_nodes: int, min_width: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """COO (sorted by sender) -> padded ``neighbor_matrix [V, K]`` (pad value ``V``)."""
    senders = pairs[:, 0]
    num_neighbors = torch.bincount(senders, minlength=num_nodes)
    width = int(num_neighbors.max()) if num_nodes and pairs.shape[0] else 0
    width = max(width, int(min_width or 0))
    first = torch.cumsum(num_neighbors, 0) - num_neighbors
    slot = torch.arange(pairs.shape[0]) - first[senders]
    matrix = torch.full((num_nodes, width), num_nodes, dtype=torch.int64)
    matrix[senders, slot] = pairs[:, 1]
    matrix_shifts = torch.zeros((num_nodes, width, 3), dtype=torch.int64)
    matrix_shifts[senders, slot] = shifts
    return matrix, num_neighbors, matrix_shifts


def compute_neighbors(
    batch: Any,
    cutoff: float | None = None,
    *,
    config: Any = None,
    half_list: bool = False,
    format: Any = None,
    max_neighbors: int | None = None,
    method: str | None = None,
    n_threads: int = 0,
) -> None:
    """Compute the neighbour lists of every structure in ``batch`` and store them in it.

    Writes ``neighbor_list [E, 2]`` (int64, *global* atom indices, sorted by sender
    and grouped by structure) and ``neighbor_list_shifts [E, 3]`` (int64 lattice
    images) through ``batch.set_edges``; a stored Cartesian ``shifts`` edge field is
    recomputed. With ``format="matrix"`` it writes the atom-level fields
    ``neighbor_matrix [V, K]`` (global indices, padded with ``V``),
    ``num_neighbors [V]`` and ``neighbor_matrix_shifts [V, K, 3]`` instead.
    Open-boundary structures in a mixed batch (``pbc`` all False) use open
    boundaries.

    Args:
        batch: a ``Batch`` (modified in place; stays on its device).
        cutoff: cutoff in Å (``config.cutoff`` wins when ``config`` is given).
        config: ``NeighborConfig``-like object (``cutoff``, ``half_list``, ``format``).
        half_list: each pair once instead of both directions.
        format: ``"coo"`` (default) or ``"matrix"``.
        max_neighbors: minimum width ``K`` of the matrix format.
        method: vesin algorithm (``"auto"`` or ``"cell_list"``).
        n_threads: vesin threads (0: all cores).

    Raises:
        ValueError: no cutoff, a degenerate periodic cell (naming the system), or
            per-edge fields that would no longer match the new edge set.

    Example:
        >>> import torch
        >>> from nvalchemi.data import AtomicData, Batch
        >>> from nvalchemi.data.neighbors import compute_neighbors
        >>> mol = AtomicData(atomic_numbers=torch.tensor([1, 1]),
        ...                  positions=torch.tensor([[0.0, 0, 0], [0.7, 0, 0]]))
        >>> batch = Batch.from_data_list([mol, mol])
        >>> compute_neighbors(batch, cutoff=1.0)
        >>> batch.neighbor_list.tolist()
        [[0, 1], [1, 0], [2, 3], [3, 2]]
    """
    cutoff, half_list, fmt = resolve_neighbor_options(cutoff, config, half_list, format)
    if fmt == "coo":
        _check_edge_fields(batch, "compute_neighbors")
    device = batch.device
    positions = as_numpy(batch.positions, np.float64)
    counts = batch.num_nodes_list
    cells = pbcs = None
    if "pbc" in batch and "cell" in batch:
        pbcs = as_numpy(batch.pbc, bool).reshape(-1, 3)
        cells = as_numpy(batch.cell, np.float64).reshape(-1, 3, 3) if pbcs.any() else None
    calc = calculator(cutoff, not half_list, vesin_method(method), int(n_threads))
    pairs_np, shifts_np, counts_np = _system_lists(positions, counts, cells, pbcs, calc)
    pairs = torch.from_numpy(pairs_np)
    shifts = torch.from_numpy(shifts_np)
    if fmt == "matrix":
        matrix, num_neighbors, matrix_shifts = _to_matrix(
            pairs, shifts, batch.num_nodes, max_neighbors
        )
        for key, value in (
            ("neighbor_matrix", matrix),
            ("num_neighbors", num_neighbors),
            ("neighbor_matrix_shifts", matrix_shifts),
        ):
            batch.add_key(key, value.to(device), level="atom", overwrite=True)
    else:
        extra = {}
        if "shifts" in batch:
            cell = batch.cell
            graph = torch.repeat_interleave(
                torch.arange(len(counts)), torch.from_numpy(counts_np)
            ).to(device)
            extra["shifts"] = torch.einsum(
                "ej,ejk->ek", shifts.to(device, cell.dtype), cell.index_select(0, graph)
            )
        batch.set_edges(pairs.to(device), shifts.to(device), torch.from_numpy(counts_np), **extra)
    stamp_batch(batch, cutoff, half_list, fmt)


# ------------------------------------------------------------------- edge vectors
def edge_vectors(
    data: Any,
    cell: torch.Tensor | None = None,
    neighbor_list: torch.Tensor | None = None,
    shifts: torch.Tensor | None = None,
    batch_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Displacement vectors ``positions[j] - positions[i] + shifts @ cell`` of every edge.

    Differentiable with respect to ``positions`` and ``cell`` (so forces and, through
    a strain of positions and cell, stresses follow by autograd).

    Args:
        data: a ``Batch``/``AtomicData`` (its ``positions``, ``cell``,
            ``neighbor_list``, ``neighbor_list_shifts`` and ``batch_idx`` are used
            unless given explicitly), or the ``[V, 3]`` positions tensor.
        cell: ``[B, 3, 3]`` (or ``[3, 3]``) lattice vectors as rows.
        neighbor_list: ``[E, 2]`` ``[sender, receiver]`` atom indices.
        shifts: ``[E, 3]`` integer lattice images (``None``: no periodic images).
        batch_idx: ``[V]`` structure of every atom (needed when ``cell`` has B > 1 rows).

    Returns:
        ``[E, 3]`` vectors in the dtype of ``positions``.

    Example:
        >>> import torch
        >>> pos = torch.tensor([[0.0, 0, 0], [1.0, 0, 0]], requires_grad=True)
        >>> cell = torch.eye(3).mul(3.0).unsqueeze(0)
        >>> vec = edge_vectors(pos, cell, torch.tensor([[0, 1]]), torch.tensor([[-1, 0, 0]]))
        >>> vec.tolist()
        [[-2.0, 0.0, 0.0]]
    """
    if isinstance(data, torch.Tensor):
        positions = data
    else:
        positions = data.positions
        if neighbor_list is None:
            neighbor_list = data.neighbor_list
        if shifts is None and "neighbor_list_shifts" in data:
            shifts = data.neighbor_list_shifts
        if cell is None and "cell" in data:
            cell = data.cell
        if batch_idx is None and hasattr(type(data), "batch_idx"):
            batch_idx = data.batch_idx
    if neighbor_list is None:
        raise ValueError("edge_vectors needs a neighbour list; call compute_neighbors first.")
    senders, receivers = neighbor_list[:, 0], neighbor_list[:, 1]
    vectors = positions.index_select(0, receivers) - positions.index_select(0, senders)
    if shifts is None or cell is None:
        return vectors
    cells = cell.reshape(-1, 3, 3).to(positions.dtype)
    images = shifts.to(positions.dtype)
    if cells.shape[0] == 1:
        return vectors + images @ cells[0]
    if batch_idx is None:
        raise ValueError(
            f"edge_vectors got {cells.shape[0]} cells but no batch_idx to tell which edge "
            "belongs to which structure."
        )
    edge_cells = cells.index_select(0, batch_idx.index_select(0, senders))
    return vectors + torch.einsum("ej,ejk->ek", images, edge_cells)


# ------------------------------------------------------------------ dataset transform
class NeighborListTransform:
    """Per-sample dataset transform that stores the neighbour list on the sample.

    ``(AtomicData, metadata) -> (AtomicData, metadata)``: sets ``neighbor_list``
    (local indices) and ``neighbor_list_shifts`` and stamps ``data.info`` with the
    cutoff, so lists are built in loader workers and ``NeighborListHook`` can skip
    the batch. A sample that already carries a list stamped with the same options
    (e.g. read from a zarr store written with lists, whose reader reports the stamp
    in ``metadata``) is passed through unchanged.

    Args:
        cutoff: cutoff in Å, or a ``NeighborConfig``-like object.
        half_list: each pair once (default: the config's value, else False).
        cache: keep every list, keyed by ``metadata["index"]`` (and
            ``metadata["dataset_index"]``), so epochs after the first skip vesin. The
            cached entry is used only if the sample's positions, cell and pbc are
            bit-identical to the cached ones (random augmentations before this
            transform simply recompute). Stored compactly (int32 pairs, small shifts).
        method: vesin algorithm.
        n_threads: vesin threads; ``None`` uses 1 inside DataLoader worker processes
            (the workers already use the cores) and all cores otherwise.

    Example:
        >>> import torch
        >>> from nvalchemi.data import AtomicData
        >>> t = NeighborListTransform(1.0)
        >>> d = AtomicData(atomic_numbers=torch.tensor([1, 1]),
        ...                positions=torch.tensor([[0.0, 0, 0], [0.7, 0, 0]]))
        >>> d, meta = t(d, {"index": 0})
        >>> d.neighbor_list.tolist(), d.info["neighbor_list_cutoff"]
        ([[0, 1], [1, 0]], 1.0)
    """

    def __init__(
        self,
        cutoff: Any,
        *,
        half_list: bool | None = None,
        cache: bool = False,
        method: str | None = None,
        n_threads: int | None = None,
    ) -> None:
        base_half = getattr(cutoff, "half_list", False)
        self.cutoff, self.half_list, _ = resolve_neighbor_options(
            config=cutoff, half_list=base_half
        )
        if half_list is not None:
            self.half_list = bool(half_list)
        self.method = vesin_method(method)
        self.n_threads = n_threads
        self.cache = bool(cache)
        self._cache: dict[Any, tuple] = {}
        self.cache_hits = 0

    def __repr__(self) -> str:
        return (
            f"NeighborListTransform(cutoff={self.cutoff}, half_list={self.half_list}, "
            f"cache={self.cache})"
        )

    def __getstate__(self) -> dict:
        # The cache is per process; do not ship it to loader workers.
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state

    def clear_cache(self) -> None:
        """Forget every cached list."""
        self._cache.clear()

    def _threads(self) -> int:
        if self.n_threads is not None:
            return int(self.n_threads)
        return 1 if torch.utils.data.get_worker_info() is not None else 0

    def __call__(
        self, data: AtomicData, metadata: dict | None = None
    ) -> tuple[AtomicData, dict | None]:
        stamp = (self.cutoff, self.half_list)
        if "neighbor_list" in data:
            meta_stamp = None
            if metadata and STAMP_CUTOFF in metadata:
                meta_stamp = (float(metadata[STAMP_CUTOFF]), bool(metadata.get(STAMP_HALF)))
            if stamp_of(data) == stamp or meta_stamp == stamp:
                data.info[STAMP_CUTOFF], data.info[STAMP_HALF] = stamp
                return data, metadata
        positions = as_numpy(data.positions, np.float64)
        cell = data.cell if "cell" in data else None
        pbc = data.pbc if "pbc" in data else None
        key = fingerprint = None
        if self.cache and metadata is not None and "index" in metadata:
            key = (metadata.get("dataset_index"), int(metadata["index"]))
            fingerprint = _fingerprint(positions, cell, pbc)
            hit = self._cache.get(key)
            if hit is not None and hit[0] == fingerprint:
                self.cache_hits += 1
                pairs = hit[1].astype(np.int64)
                shifts = hit[2].astype(np.int64)
                self._store(data, pairs, shifts)
                return data, metadata
        box, periodic = box_and_periodic(cell, pbc, _where(metadata))
        calc = calculator(self.cutoff, not self.half_list, self.method, self._threads())
        pairs, shifts = _run_vesin(calc, positions, box, periodic, _where(metadata))
        if key is not None:
            self._cache[key] = (fingerprint, pairs.astype(np.int32), _compact(shifts))
        self._store(data, pairs, shifts)
        return data, metadata

    def _store(self, data: Any, pairs: np.ndarray, shifts: np.ndarray) -> None:
        _check_edge_fields(data, "NeighborListTransform")
        for key in _OWNED_EDGE_FIELDS:
            if key in data:
                delattr(data, key)
        device = data.device
        data.neighbor_list = torch.from_numpy(pairs).to(device)
        data.neighbor_list_shifts = torch.from_numpy(shifts).to(device)
        data.info[STAMP_CUTOFF] = self.cutoff
        data.info[STAMP_HALF] = self.half_list


def _where(metadata: Mapping | None) -> str:
    if metadata and "index" in metadata:
        source = metadata.get("source_file")
        return f"NeighborListTransform: sample {metadata['index']}" + (
            f" of {source}" if source else ""
        )
    return "NeighborListTransform"


def _fingerprint(positions: np.ndarray, cell: Any, pbc: Any) -> int:
    parts = [positions.tobytes()]
    for value in (cell, pbc):
        parts.append(b"" if value is None else as_numpy(value, None).tobytes())
    return hash(b"|".join(parts))


def _compact(shifts: np.ndarray) -> np.ndarray:
    if shifts.size == 0 or np.abs(shifts).max() < 127:
        return shifts.astype(np.int8)
    return shifts.astype(np.int32)
