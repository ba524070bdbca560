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
keys ``"neighbor_list_cutoff"`` / ``"neighbor_list_half_list"``.

Example:
    >>> import numpy as np
    >>> from nvalchemi.data.neighbors import neighbor_list_for_system
    >>> pairs, shifts = neighbor_list_for_system(
    ...     np.zeros((1, 3)), np.eye(3) * 2.0, [True, True, True], cutoff=2.5)
    >>> pairs.shape, shifts.shape  # an atom alone in a 2 Å cube sees its 6 nearest images
    ((6, 2), (6, 3))
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from nvalchemi.data.atomic_data import AtomicData

__all__ = [
    "NeighborListTransform",
    "compute_neighbors",
    "edge_vectors",
    "has_neighbor_list",
    "neighbor_list_for_system",
    "resolve_neighbor_options",
]

STAMP_CUTOFF = "neighbor_list_cutoff"
STAMP_HALF = "neighbor_list_half_list"
# Edge fields that compute_neighbors owns (recomputed), versus user edge fields that
# would silently stop matching a new edge set.
_OWNED_EDGE_FIELDS = ("neighbor_list", "neighbor_list_shifts", "shifts")
_VESIN_METHODS = {"auto": "auto", "cell_list": "cell_list", "naive": "auto", "brute_force": "auto"}

_local = threading.local()


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


def _vesin_method(method: str | None) -> str:
    if method is None:
        return "auto"
    try:
        return _VESIN_METHODS[str(method).lower()]
    except KeyError:
        raise ValueError(
            f"Unknown neighbour-list method {method!r}; use one of {sorted(_VESIN_METHODS)}."
        ) from None


def _calculator(cutoff: float, full_list: bool, method: str = "auto", n_threads: int = 0):
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


# ------------------------------------------------------------------- one structure
def _as_numpy(value: Any, dtype: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        value = value.numpy()
    return np.asarray(value, dtype=dtype)


def _box_and_periodic(cell: Any, pbc: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The vesin box (float64 [3,3]) and periodic flags for one structure.

    vesin needs a box even without periodicity; rows of non-periodic directions are
    zeroed (they never enter a displacement because their shift is always 0), which
    is also how vesin handles open boundaries. Degenerate periodic rows would make
    vesin crash the process (SIGFPE), so they are rejected here.
    """
    if pbc is None or cell is None:
        if pbc is not None and np.asarray(_as_numpy(pbc, bool)).any():
            raise ValueError(f"{where}: pbc is set but no cell was given.")
        return np.zeros((3, 3)), np.zeros(3, dtype=bool)
    periodic = _as_numpy(pbc, bool).reshape(-1)
    if periodic.shape == (1,):
        periodic = np.repeat(periodic, 3)
    box = _as_numpy(cell, np.float64).reshape(-1)
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


def _run_vesin(calc, positions: np.ndarray, box, periodic, where: str):
    if positions.shape[0] == 0:
        return np.zeros((0, 2), dtype=np.int64), np.zeros((0, 3), dtype=np.int64)
    try:
        pairs, shifts = calc.compute(positions, box, periodic, "PS", copy=False)
    except RuntimeError as exc:
        raise ValueError(f"{where}: neighbour-list computation failed: {exc}") from exc
    # The outputs are views into vesin's buffers; astype copies them out (once).
    return pairs.astype(np.int64), shifts.astype(np.int64)


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
    pos = _as_numpy(positions, np.float64)
    if pos.ndim != 2 or pos.shape[1] != 3:
        raise ValueError(f"positions must have shape [n_atoms, 3]; got {list(pos.shape)}.")
    box, periodic = _box_and_periodic(cell, pbc, "neighbor_list_for_system")
    calc = _calculator(cutoff, bool(full_list), _vesin_method(method), int(n_threads))
    return _run_vesin(calc, pos, box, periodic, "neighbor_list_for_system")


# ------------------------------------------------------------------------- stamps
# Batch attributes of a stamp, per format: "<prefix>_cutoff", "<prefix>_half_list" and
# "<prefix>_positions" (what the list was built from).
_PREFIX = {"coo": "_neighbor_list", "matrix": "_neighbor_matrix"}


def _stamp_of(obj: Any, format: str = "coo") -> tuple[float, bool] | None:
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


def _stamp_batch(batch: Any, cutoff: float, half_list: bool, format: str = "coo") -> None:
    prefix = _PREFIX[format]
    object.__setattr__(batch, prefix + "_cutoff", cutoff)
    object.__setattr__(batch, prefix + "_half_list", half_list)
    remember_positions(batch, format)


def _format_name(format: Any) -> str:
    return str(getattr(format, "value", format)).lower()


def has_neighbor_list(
    obj: Any, cutoff: float, *, half_list: bool = False, format: Any = "coo"
) -> bool:
    """Whether ``obj`` (a ``Batch`` or ``AtomicData``) holds a list built for these options.

    True only when the list's stamp (see the module docstring) says it was built
    with this cutoff, half/full choice and format and, for lists built by
    :func:`compute_neighbors`, the positions have not been replaced or modified in
    place since; a list of unknown origin is not trusted.
    """
    fmt = _format_name(format)
    if fmt not in _PREFIX or ("neighbor_matrix" if fmt == "matrix" else "neighbor_list") not in obj:
        return False
    stamp = _stamp_of(obj, fmt)
    return stamp is not None and stamp == (float(cutoff), bool(half_list))


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
            box, periodic = _box_and_periodic(cells[g], pbcs[g], where)
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
    positions = _as_numpy(batch.positions, np.float64)
    counts = batch.num_nodes_list
    cells = pbcs = None
    if "pbc" in batch and "cell" in batch:
        pbcs = _as_numpy(batch.pbc, bool).reshape(-1, 3)
        cells = _as_numpy(batch.cell, np.float64).reshape(-1, 3, 3) if pbcs.any() else None
    calc = _calculator(cutoff, not half_list, _vesin_method(method), int(n_threads))
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
    _stamp_batch(batch, cutoff, half_list, fmt)


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
        self.method = _vesin_method(method)
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
            if _stamp_of(data) == stamp or meta_stamp == stamp:
                data.info[STAMP_CUTOFF], data.info[STAMP_HALF] = stamp
                return data, metadata
        positions = _as_numpy(data.positions, np.float64)
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
        box, periodic = _box_and_periodic(cell, pbc, _where(metadata))
        calc = _calculator(self.cutoff, not self.half_list, self.method, self._threads())
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
        parts.append(b"" if value is None else _as_numpy(value, None).tobytes())
    return hash(b"|".join(parts))


def _compact(shifts: np.ndarray) -> np.ndarray:
    if shifts.size == 0 or np.abs(shifts).max() < 127:
        return shifts.astype(np.int8)
    return shifts.astype(np.int32)
