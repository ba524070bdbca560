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
* :func:`check_neighbor_explosion`: refuse a structure whose list would explode
  (a cell in the wrong units); every builder above calls it first.

Lists of a whole batch are built in one pass of torch operations on the batch's
device (:mod:`nvalchemi.data._batched_neighbors`; on CUDA the positions never
leave the GPU); on the CPU, structures too large for that pass go to vesin's cell
list, one call each. Both give the same lists (the same pairs and shifts, sorted
by sender; half lists keep the same member of each pair).

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

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from nvalchemi.data import _batched_neighbors as _batched
from nvalchemi.data._neighbor_guard import (
    _SPHERE_IN_CUBE,
    DEFAULT_MAX_PAIRS,
    MAX_PAIRS_ENV,
    check_structure,
)
from nvalchemi.data._neighbor_guard import max_pairs as _max_pairs
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
    "DEFAULT_MAX_PAIRS",
    "MAX_PAIRS_ENV",
    "NeighborListTransform",
    "check_neighbor_explosion",
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


# ------------------------------------------------------------------ explosion guard
def _structure_arrays(structure: Any) -> tuple[Any, Any, Any]:
    """``(positions, cell, pbc)`` of an ``AtomicData``, ``Batch`` row, ``ase.Atoms`` or dict."""

    def field(name: str) -> Any:
        if isinstance(structure, Mapping):
            return structure.get(name)
        return getattr(structure, name, None)

    positions, cell, pbc = field("positions"), field("cell"), field("pbc")
    if positions is None:
        raise TypeError(
            f"check_neighbor_explosion needs a structure with positions; got "
            f"{type(structure).__name__}."
        )
    if cell is not None and not isinstance(cell, (torch.Tensor, np.ndarray)):
        cell = np.asarray(cell, dtype=float)  # ase.Cell
    return positions, cell, pbc


def check_neighbor_explosion(
    structure: Any,
    cutoff: float | None = None,
    *,
    where: str | None = None,
    max_pairs: float | None = None,
) -> float:
    """Refuse a structure whose neighbour list would explode; return the expected pair count.

    The count is estimated from the atom count, the lattice-plane spacings of the
    periodic cell and the cutoff (see :mod:`nvalchemi.data._neighbor_guard`) in
    microseconds, before anything is allocated. Every builder of this module calls
    it (so loaders, ``NeighborListHook``, the ASE calculator and ``data convert``
    refuse such structures), and readers call it with ``cutoff=None``, which checks
    at a 6 Å cutoff: a cell in the wrong units is reported where it is read.

    Args:
        structure: an ``AtomicData``, ``ase.Atoms`` or mapping with ``positions``
            (and optionally ``cell``, ``pbc``).
        cutoff: the cutoff in Å (``None``: the 6 Å reading check).
        where: names the structure in the error (file and frame, sample index).
        max_pairs: the limit (default ``$NVALCHEMI_MAX_NEIGHBOR_PAIRS`` or 5e7 pairs
            per structure).

    Raises:
        ValueError: naming ``where``, the cell, the pair estimate and the likely
            cause (a cell in the wrong units), and how to raise the limit.

    Example:
        >>> import numpy as np
        >>> from ase import Atoms
        >>> tiny = Atoms("Cu2", positions=[[0, 0, 0], [0.01, 0.01, 0.01]],
        ...              cell=np.eye(3) * 0.02, pbc=True)
        >>> check_neighbor_explosion(tiny, 5.0, where="cu.extxyz: frame 0")
        Traceback (most recent call last):
        ...
        ValueError: cu.extxyz: frame 0: refusing to build a neighbour list of about 2.62e+08 ...
    """
    positions, cell, pbc = _structure_arrays(structure)
    positions = as_numpy(positions, np.float64).reshape(-1, 3)
    cell = None if cell is None else as_numpy(cell, np.float64).reshape(3, 3)
    pbc = None if pbc is None else as_numpy(pbc, bool).reshape(-1)
    return check_structure(
        positions.shape[0],
        cell,
        pbc,
        cutoff,
        positions,
        where=where or "check_neighbor_explosion",
        limit=max_pairs,
    )


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
        ValueError: bad cutoff, non-finite positions, a degenerate periodic cell, or
            a list that would explode (see :func:`check_neighbor_explosion`).
    """
    cutoff, _, _ = resolve_neighbor_options(cutoff)
    pos = as_numpy(positions, np.float64)
    if pos.ndim != 2 or pos.shape[1] != 3:
        raise ValueError(f"positions must have shape [n_atoms, 3]; got {list(pos.shape)}.")
    box, periodic = box_and_periodic(cell, pbc, "neighbor_list_for_system")
    check_structure(pos.shape[0], box, periodic, cutoff, pos, where="neighbor_list_for_system")
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


def _vesin_lists(
    positions: torch.Tensor,
    cells: torch.Tensor,
    pbcs: torch.Tensor,
    starts: list[int],
    counts: list[int],
    graphs: list[int],
    calc,
    name: Callable[[int], str],
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """vesin's list of each structure in ``graphs`` (CPU), with global atom indices."""
    out = {}
    for g in graphs:
        where = name(g)
        box, periodic = box_and_periodic(cells[g], pbcs[g], where)
        chunk = positions[starts[g] : starts[g] + counts[g]].numpy()
        pairs, shifts = _run_vesin(calc, chunk, box, periodic, where)
        out[g] = (torch.from_numpy(pairs).add_(starts[g]), torch.from_numpy(shifts))
    return out


def _route(
    device: torch.device, method: str, counts: list[int], windows: list, expected: list[float]
) -> tuple[list, list[int]]:
    """``(groups for torch passes, structures for vesin)``: whichever is cheaper.

    On accelerators every structure goes to the torch pass. On the CPU structures
    with more candidates than ``CPU_PASS_LIMIT`` (or all, for ``method="cell_list"``)
    go to vesin, and so does a planned group whose pass would cost more than one
    vesin call per member (small, unlike structures that cannot share a pass).
    """
    busy = [g for g in range(len(counts)) if counts[g] > 0]
    if device.type != "cpu":
        plan = _batched.plan_groups(
            counts, windows, busy, _batched.DEVICE_PASS_CANDIDATES, _batched.DEVICE_COSTS
        )
        return plan, []
    if method == "cell_list":
        return [], busy
    costs = _batched.CPU_COSTS
    small = [
        g
        for g in busy
        if _batched.candidate_count(counts[g], windows[g]) <= _batched.CPU_PASS_LIMIT
    ]
    taken = set(small)
    by_vesin = [g for g in busy if g not in taken]
    groups = []
    for group in _batched.plan_groups(counts, windows, small, _batched.CPU_PASS_CANDIDATES, costs):
        members, key, n = group
        alone = sum(costs.vesin(expected[g]) for g in members)
        if costs.group(len(members), n, key) > alone:
            by_vesin.extend(members)
        else:
            groups.append(group)
    return groups, sorted(by_vesin)


def _system_name(g: int) -> str:
    return f"compute_neighbors: system {g}"


def _batch_lists(
    batch: Any,
    cutoff: float,
    full_list: bool,
    method: str,
    n_threads: int,
    name: Callable[[int], str] = _system_name,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs, shifts and per-structure edge counts of every structure, on the batch's device.

    One torch pass per group of similar structures (:mod:`._batched_neighbors`); on
    the CPU :func:`_route` sends structures a pass would handle slowly to vesin.
    Refuses exploding lists first (:func:`check_neighbor_explosion`).
    """
    positions = batch.positions.detach().to(torch.float64)
    device = positions.device
    counts = batch.num_nodes_list
    num_graphs = len(counts)
    if "cell" in batch and "pbc" in batch:
        pbc = batch.pbc.reshape(-1, 3).to(device=device, dtype=torch.bool)
        cell = batch.cell.detach().to(device, torch.float64).reshape(-1, 3, 3)
        cell = cell * pbc.unsqueeze(-1)  # open rows never enter a displacement
    else:
        pbc = torch.zeros(num_graphs, 3, dtype=torch.bool, device=device)
        cell = torch.zeros(num_graphs, 3, 3, dtype=torch.float64, device=device)
    recip, ranges, ranges_host, pbc_host, cell_ok, finite = _batched.structure_scalars(
        positions, cell, pbc, cutoff
    )
    starts = [0] * num_graphs
    for g in range(1, num_graphs):
        starts[g] = starts[g - 1] + counts[g - 1]
    if not finite:
        bad = int(batch.batch_idx[~torch.isfinite(positions).all(1)][0])
        raise ValueError(f"{name(bad)}: non-finite positions; fix or drop this structure.")
    limit = _max_pairs()
    windows, expected = [], []
    for g, (n, r) in enumerate(zip(counts, ranges_host)):
        where = name(g)
        periodic = pbc_host[g]
        if not cell_ok[g]:
            box_and_periodic(cell[g].cpu(), periodic, where)  # raises the cell's error
        bound = _SPHERE_IN_CUBE * n * n
        for d in range(3):
            if periodic[d]:
                bound *= 2.0 * r[d]
        if bound > limit:
            check_structure(
                n,
                cell[g].cpu(),
                periodic,
                cutoff,
                positions[starts[g] : starts[g] + n].cpu(),
                where=where,
            )
        windows.append(_batched.windows_of(r))
        expected.append(min(bound, n * (n - 1)) if not any(periodic) else bound)
    groups, by_vesin = _route(device, method, counts, windows, expected)
    pass_size = (
        _batched.CPU_PASS_CANDIDATES if device.type == "cpu" else _batched.DEVICE_PASS_CANDIDATES
    )
    found = _batched.search_structures(
        positions,
        cell,
        recip,
        ranges,
        counts,
        starts,
        groups,
        windows,
        cutoff,
        full_list,
        pass_size,
    )
    if not by_vesin and len(found) == 1 and found[0][0] == list(range(num_graphs)):
        _, pairs, shifts, edge_counts = found[0]
        return pairs, shifts, edge_counts
    blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if by_vesin:
        calc = calculator(cutoff, full_list, method, int(n_threads))
        blocks.update(_vesin_lists(positions, cell, pbc_host, starts, counts, by_vesin, calc, name))
    for members, pairs, shifts, edge_counts in found:
        sizes = edge_counts.tolist()
        for g, p, s in zip(members, pairs.split(sizes), shifts.split(sizes)):
            blocks[g] = (p, s)
    empty = (
        torch.zeros(0, 2, dtype=torch.int64, device=device),
        torch.zeros(0, 3, dtype=torch.int64, device=device),
    )
    ordered = [blocks.get(g, empty) for g in range(num_graphs)]
    edge_counts = torch.tensor([p.shape[0] for p, _ in ordered], dtype=torch.int64)
    pairs = torch.cat([p for p, _ in ordered]).to(device)
    shifts = torch.cat([s for _, s in ordered]).to(device)
    return pairs, shifts, edge_counts


def _to_matrix(
    pairs: torch.Tensor, shifts: torch.Tensor, num_nodes: int, min_width: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """COO (sorted by sender) -> padded ``neighbor_matrix [V, K]`` (pad value ``V``)."""
    senders = pairs[:, 0]
    num_neighbors = torch.bincount(senders, minlength=num_nodes)
    width = int(num_neighbors.max()) if num_nodes and pairs.shape[0] else 0
    width = max(width, int(min_width or 0))
    first = torch.cumsum(num_neighbors, 0) - num_neighbors
    slot = torch.arange(pairs.shape[0], device=pairs.device) - first[senders]
    matrix = torch.full((num_nodes, width), num_nodes, dtype=torch.int64, device=pairs.device)
    matrix[senders, slot] = pairs[:, 1]
    matrix_shifts = torch.zeros((num_nodes, width, 3), dtype=torch.int64, device=pairs.device)
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
        method: ``"auto"`` (default): structures with up to about a hundred atoms in
            one torch pass on the batch's device, larger ones (on the CPU) with
            vesin's cell list; ``"cell_list"``: vesin for every structure on the CPU.
        n_threads: vesin threads (0: all cores).

    Raises:
        ValueError: no cutoff, a degenerate periodic cell or non-finite positions
            (naming the system), a list that would explode (see
            :func:`check_neighbor_explosion`), or per-edge fields that would no
            longer match the new edge set.

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
    _store_batch_lists(
        batch, cutoff, half_list, fmt, max_neighbors, vesin_method(method), int(n_threads)
    )


def _store_batch_lists(
    batch: Any,
    cutoff: float,
    half_list: bool,
    fmt: str,
    max_neighbors: int | None,
    method: str,
    n_threads: int,
    name: Callable[[int], str] = _system_name,
) -> None:
    if fmt == "coo":
        _check_edge_fields(batch, "compute_neighbors")
    device = batch.device
    pairs, shifts, edge_counts = _batch_lists(batch, cutoff, not half_list, method, n_threads, name)
    if fmt == "matrix":
        matrix, num_neighbors, matrix_shifts = _to_matrix(
            pairs, shifts, batch.num_nodes, max_neighbors
        )
        for key, value in (
            ("neighbor_matrix", matrix),
            ("num_neighbors", num_neighbors),
            ("neighbor_matrix_shifts", matrix_shifts),
        ):
            batch.add_key(key, value, level="atom", overwrite=True)
    else:
        extra = {}
        if "shifts" in batch:
            cell = batch.cell
            graph = torch.repeat_interleave(
                torch.arange(batch.num_graphs, device=device), edge_counts.to(device)
            )
            extra["shifts"] = torch.einsum(
                "ej,ejk->ek", shifts.to(cell.dtype), cell.index_select(0, graph)
            )
        batch.set_edges(pairs, shifts, edge_counts, **extra)
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
        where = _where(metadata, data)
        box, periodic = box_and_periodic(cell, pbc, where)
        check_structure(positions.shape[0], box, periodic, self.cutoff, positions, where=where)
        calc = calculator(self.cutoff, not self.half_list, self.method, self._threads())
        pairs, shifts = _run_vesin(calc, positions, box, periodic, where)
        if key is not None:
            self._cache[key] = (fingerprint, pairs.astype(np.int32), _compact(shifts))
        self._store(data, pairs, shifts)
        return data, metadata

    def apply_to_batch(self, batch: Any, names: Any = None) -> Any:
        """Build the lists of every structure of a collated ``batch`` at once; return it.

        What a ``Dataset`` does with this transform when it is the last one and
        uncached: one pass for the whole batch (:func:`compute_neighbors`) instead of
        one vesin call per structure, with the same lists. A batch whose structures
        all carried lists stamped with these options is returned as it is.
        ``names[g]`` (a sequence, or anything indexable) names structure ``g`` in
        errors (default ``system g``); it is only read when there is an error.
        """
        if has_neighbor_list(batch, self.cutoff, half_list=self.half_list):
            return batch
        name = _system_name if names is None else (lambda g: f"NeighborListTransform: {names[g]}")
        threads = self._threads()
        _store_batch_lists(
            batch, self.cutoff, self.half_list, "coo", None, self.method, threads, name
        )
        return batch

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


def _where(metadata: Mapping | None, data: Any = None) -> str:
    """``NeighborListTransform: sample 3 of train.extxyz, frame 7``, from what is known."""
    metadata = metadata or {}
    info = getattr(data, "info", None) or {}
    source = metadata.get("source_file") or info.get("source_file")
    frame = metadata.get("frame", info.get("frame"))
    text = "NeighborListTransform"
    if "index" in metadata:
        text += f": sample {metadata['index']}"
    if source:
        text += (" of " if "index" in metadata else ": ") + str(source)
        if frame is not None:
            text += f", frame {frame}"
    return text


def _fingerprint(positions: np.ndarray, cell: Any, pbc: Any) -> int:
    parts = [positions.tobytes()]
    for value in (cell, pbc):
        parts.append(b"" if value is None else as_numpy(value, None).tobytes())
    return hash(b"|".join(parts))


def _compact(shifts: np.ndarray) -> np.ndarray:
    if shifts.size == 0 or np.abs(shifts).max() < 127:
        return shifts.astype(np.int8)
    return shifts.astype(np.int32)
