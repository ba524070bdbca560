"""Neighbour lists of many structures in one pass of torch operations, on any device.

The idea: for two atoms ``a`` and ``b`` of one structure, the lattice images of ``b``
that can lie within the cutoff of ``a`` form a small box of integer shifts. Along a
periodic axis ``d`` the fractional coordinate of a displacement ``v`` is
``v . B[:, d]`` (``B`` the reciprocal vectors), so ``|v| < cutoff`` implies
``|f_b - f_a + S|_d <= cutoff * |B[:, d]|`` (``1 / |B[:, d]|`` is the spacing of the
lattice planes): ``S_d`` is one of at most ``K_d = floor(2 r_d) + 1`` consecutive
integers starting at ``ceil(f_a - f_b - r_d)``, with ``r_d = cutoff * |B[:, d]|``.
Every (pair, shift) candidate of a group of structures padded to one atom count is
tested at once with two batched matrix products; the kept ones come out ordered by
structure, sender, receiver and shift, so lists are sorted by sender without a sort.
Padding atoms are NaN and never pass the distance test.

The work grows with ``atoms**2 * prod(K)`` per structure, which is the fastest way for
the small cells of most training sets (tens of atoms) and on GPUs; on the CPU
:func:`nvalchemi.data.neighbors.compute_neighbors` sends large structures to vesin's
cell list instead. Positions, cells and lists never leave the device of the
positions: the host reads a few numbers per structure once (image ranges,
periodicity, cell checks: they size the search and the explosion guard) and, as any
variable-length result needs, the number of pairs found (``nonzero``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "CPU_COSTS",
    "DEVICE_COSTS",
    "Costs",
    "candidate_count",
    "plan_groups",
    "search",
    "search_structures",
    "structure_scalars",
    "windows_of",
]

# Slack on the image range so rounding never drops a shift whose image sits at the cutoff.
_RANGE_SLACK = 1e-9
# Squared distances within this fraction of (cutoff + search reach)^2 of the cutoff are
# tested again directly, as vesin does, so ties at the cutoff come out the same.
_TIE_TOLERANCE = 1e-10


def candidate_count(num_atoms: int, windows: Sequence[int]) -> int:
    """Candidates (pair, shift) the search tests for one structure."""
    return num_atoms * num_atoms * windows[0] * windows[1] * windows[2]


def _positive_half(shifts: torch.Tensor) -> torch.Tensor:
    """For pairs of an atom with its own image, which of ``S`` / ``-S`` a half list keeps.

    vesin's choice (the one lists built on the CPU follow): the positive half-space
    of ``Sx + Sy + Sz``, on its boundary plane positive ``Sz``, then positive ``Sy``.
    """
    x, y, z = shifts.unbind(-1)
    total = x + y + z
    return (total > 0) | ((total == 0) & ((z > 0) | ((z == 0) & (y > 0))))


def search(
    positions: torch.Tensor,
    cell: torch.Tensor,
    recip: torch.Tensor,
    ranges: torch.Tensor,
    windows: Sequence[int],
    cutoff: float,
    *,
    full_list: bool = True,
    rows: tuple[int, int] | None = None,
    narrower: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs within ``cutoff`` of ``G`` structures padded to ``n`` atoms.

    Args:
        positions: ``[G, n, 3]`` float64, NaN for padding atoms.
        cell, recip, ranges: ``[G, 3, 3]``, ``[G, 3, 3]``, ``[G, 3]`` (see
            :func:`structure_scalars`), float64.
        windows: shifts tried per axis (``>=`` every structure's :func:`window_sizes`).
        full_list: both directions of every pair, or each pair once (vesin's choice).
        rows: only senders ``a0 <= a < a1`` (to bound memory on large structures).
        narrower: some structures need fewer shifts than ``windows`` (mixed in a group).

    Returns:
        ``(graph, sender, receiver, shifts [E, 3] int64, counts [G])``: local structure
        and atom indices, ordered by structure, then sender.
    """
    num_graphs, n, _ = positions.shape
    a0, a1 = rows if rows is not None else (0, n)
    na = a1 - a0
    device = positions.device
    offsets = torch.cartesian_prod(*(torch.arange(k, device=device) for k in windows))
    offsets = offsets.reshape(-1, 3)
    num_offsets = offsets.shape[0]

    frac = torch.bmm(positions, recip)
    senders = positions[:, a0:a1]
    # First shift of each pair's window: ceil(-r - (f_b - f_a)).
    padded = (ranges * (1.0 + _RANGE_SLACK) + _RANGE_SLACK)[:, None, None, :]
    low = torch.ceil(frac[:, a0:a1, None, :] - frac[:, None, :, :] - padded)
    # Displacement at the first shift, then |v0 + o_c|^2 = |v0|^2 + 2 v0.o_c + |o_c|^2.
    base = (positions[:, None, :, :] - senders[:, :, None, :]).reshape(num_graphs, na * n, 3)
    v0 = torch.baddbmm(base, low.reshape(num_graphs, na * n, 3), cell)
    ones = torch.ones(3, 1, dtype=v0.dtype, device=device)
    room = cutoff * cutoff - (v0 * v0) @ ones  # a matmul sums 3 columns far faster than .sum
    image = torch.matmul(offsets.to(cell.dtype), cell)  # [G, C, 3]
    dist2 = torch.baddbmm(image.square().sum(-1).unsqueeze(1), v0, image.transpose(1, 2), alpha=2)
    # The expansion rounds differently from the direct |v|^2 (a far bigger error than
    # float64's): candidates this close to the cutoff are decided again directly below.
    reach = cutoff + (torch.tensor(windows, device=device) * cell.norm(dim=2)).sum(1)
    tolerance = (_TIE_TOLERANCE * reach * reach)[:, None, None]
    keep = (dist2 < room + tolerance).view(num_graphs, na, n, num_offsets)
    # Structures of a group may need narrower windows than the group's: shifts beyond
    # their own would repeat an open axis's zero shift (or fall out of range anyway).
    if narrower:
        own = torch.floor(2.0 * (ranges * (1.0 + _RANGE_SLACK) + _RANGE_SLACK)).long() + 1
        keep &= (offsets.unsqueeze(0) < own.unsqueeze(1)).all(-1)[:, None, None, :]

    # An atom is not its own neighbour: drop the (a, a, S = 0) candidate, whose
    # window offset is floor(r) on every axis (the window starts at -floor(r)).
    self_offset = (torch.floor(ranges * (1.0 + _RANGE_SLACK) + _RANGE_SLACK)).long()
    self_code = (self_offset[:, 0] * windows[1] + self_offset[:, 1]) * windows[2] + self_offset[
        :, 2
    ]
    local_rows = torch.arange(a0, a1, device=device)
    keep[:, local_rows - a0, local_rows, :] &= (
        torch.arange(num_offsets, device=device) != self_code[:, None]
    ).unsqueeze(1)
    if not full_list:
        # each pair once: b > a, or b == a with S (not -S) for an atom and its own image
        own_shift = offsets.unsqueeze(0) - self_offset.unsqueeze(1)  # [G, C, 3]
        diagonal = keep[:, local_rows - a0, local_rows, :] & _positive_half(own_shift).unsqueeze(1)
        column = torch.arange(n, device=device)
        keep &= (column[None, :] > local_rows[:, None])[None, :, :, None]
        keep[:, local_rows - a0, local_rows, :] = diagonal

    flat = keep.view(-1).nonzero().squeeze(1)
    pair = torch.div(flat, num_offsets, rounding_mode="floor")
    code = flat - pair * num_offsets
    row = torch.div(pair, n, rounding_mode="floor")
    receiver = pair - row * n
    graph = torch.div(row, na, rounding_mode="floor")
    sender = row - graph * na + a0
    low_int = low.reshape(-1, 3).to(torch.int32)
    shifts = (low_int.index_select(0, pair) + offsets.to(torch.int32).index_select(0, code)).long()
    counts = torch.bincount(graph, minlength=num_graphs)
    near = dist2.view(-1).index_select(0, flat) > (
        room.view(-1).index_select(0, pair) - 2.0 * tolerance.view(-1).index_select(0, graph)
    )
    near = near.nonzero().squeeze(1)
    if near.numel():
        kept = _direct_test(positions, cell, cutoff, graph, sender, receiver, shifts, near)
        if kept is not None:
            graph, sender, receiver, shifts = (
                graph[kept],
                sender[kept],
                receiver[kept],
                shifts[kept],
            )
            counts = torch.bincount(graph, minlength=num_graphs)
    return graph, sender, receiver, shifts, counts


def _direct_test(positions, cell, cutoff, graph, sender, receiver, shifts, near):
    """Mask of the edges to keep after testing ``near`` ones as ``|p_j - p_i + S @ cell|``.

    ``None`` when all of them pass (the usual case).
    """
    g = graph.index_select(0, near)
    flat = positions.reshape(-1, 3)
    n = positions.shape[1]
    vectors = flat.index_select(0, g * n + receiver.index_select(0, near)) - flat.index_select(
        0, g * n + sender.index_select(0, near)
    )
    vectors = vectors + torch.einsum(
        "ej,ejk->ek", shifts.index_select(0, near).to(cell.dtype), cell.index_select(0, g)
    )
    failed = near[(vectors * vectors).sum(1) >= cutoff * cutoff]
    if not failed.numel():
        return None
    kept = torch.ones_like(graph, dtype=torch.bool)
    kept[failed] = False
    return kept


# ------------------------------------------------------------------- a whole batch
# Candidates tested per torch pass (about 9 bytes each): small on the CPU, where
# passes that stay in cache are fastest; large on accelerators.
CPU_PASS_CANDIDATES = 1 << 18
DEVICE_PASS_CANDIDATES = 1 << 22
# On the CPU, vesin's cell list beats the pass for structures with more candidates.
CPU_PASS_LIMIT = 1 << 14


class Costs:
    """Rough cost (microseconds) of a torch pass and of a vesin call, to plan a batch.

    A pass costs ``per_pass`` (tens of small operations) plus ``per_pair`` for each
    (padded) atom pair and ``per_candidate`` for each pair and shift it tests; one
    vesin call costs ``per_call`` plus ``per_edge`` for each pair it finds. Fitted to
    timings of fcc cells of 4-108 atoms on one CPU core; on accelerators a pass is all
    overhead.
    """

    def __init__(self, per_pass, per_pair, per_candidate, per_call, per_edge) -> None:
        self.per_pass, self.per_pair, self.per_candidate = per_pass, per_pair, per_candidate
        self.per_call, self.per_edge = per_call, per_edge

    def group(self, size: int, n: int, windows: Sequence[int]) -> float:
        pairs = size * n * n
        return self.per_pass + pairs * (self.per_pair + self.per_candidate * math.prod(windows))

    def vesin(self, edges: float) -> float:
        return self.per_call + self.per_edge * edges


CPU_COSTS = Costs(per_pass=300.0, per_pair=0.05, per_candidate=0.005, per_call=50.0, per_edge=0.23)
DEVICE_COSTS = Costs(per_pass=400.0, per_pair=1e-4, per_candidate=1e-5, per_call=0.0, per_edge=0.0)


def structure_scalars(
    positions: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor, cutoff: float
) -> tuple[torch.Tensor, torch.Tensor, list[list[float]], list[list[bool]], list[bool], bool]:
    """Reciprocal vectors and image ranges, plus one host read of what sizes the search.

    ``recip [G, 3, 3]`` maps Cartesian displacements to fractional ones along the
    periodic axes (zero columns for open axes, which never shift): with ``A`` the
    cell whose open rows are zeroed, ``A^T (A A^T + diag(open))^-1`` is the
    pseudo-inverse of the periodic rows, for any mix of periodic axes.
    ``ranges[g, d]`` is the cutoff over the lattice-plane spacing of axis ``d``.
    Returns ``(recip, ranges, ranges_host, pbc_host, cell_ok_host, positions_finite)``
    (the ``_host`` ones as lists, from one device read); a cell
    is ok when its periodic rows are finite and independent (the test of
    :func:`nvalchemi.data._vesin.box_and_periodic`, for all structures at once).
    """
    periodic = pbc.to(cell.dtype)
    rows = cell * periodic.unsqueeze(-1)
    gram = rows @ rows.transpose(1, 2) + torch.diag_embed(1.0 - periodic)
    scale = torch.diagonal(gram, dim1=1, dim2=2).prod(1)
    det = torch.linalg.det(gram)
    ok = torch.isfinite(det) & (scale > 0) & (det * det > 1e-10 * scale * scale)
    eye = torch.eye(3, dtype=gram.dtype, device=gram.device)
    inverse, _ = torch.linalg.inv_ex(torch.where(ok[:, None, None], gram, eye))
    recip = (rows.transpose(1, 2) @ inverse) * periodic.unsqueeze(1)
    ranges = cutoff * torch.linalg.vector_norm(recip, dim=1)
    finite = torch.isfinite(positions).all().reshape(1)
    host = torch.cat(
        [ranges.reshape(-1), periodic.reshape(-1), ok.to(ranges.dtype), finite.to(ranges.dtype)]
    ).tolist()
    g = cell.shape[0]
    ranges_host = [host[3 * k : 3 * k + 3] for k in range(g)]
    pbc_host = [[bool(v) for v in host[3 * g + 3 * k : 3 * g + 3 * k + 3]] for k in range(g)]
    ok_host = [bool(v) for v in host[6 * g : 7 * g]]
    return recip, ranges, ranges_host, pbc_host, ok_host, bool(host[-1])


def windows_of(ranges: list[float]) -> tuple[int, int, int]:
    """``K``: how many consecutive shifts per axis can hold an image within range."""
    return tuple(math.floor(2.0 * (r * (1.0 + _RANGE_SLACK) + _RANGE_SLACK)) + 1 for r in ranges)


def plan_groups(
    counts: Sequence[int],
    windows: Sequence[tuple[int, int, int]],
    graphs: Sequence[int],
    pass_candidates: int,
    costs: Costs = CPU_COSTS,
) -> list[tuple[list[int], tuple[int, int, int], int]]:
    """Groups of structures searched together: ``(members, windows, padded atoms)``.

    Structures in order of size join the current group while one pass over the
    merged group (padded to its largest member, trying its widest windows) costs no
    more than two, and it fits one pass (``pass_candidates``). Members are listed in
    batch order.
    """
    groups: list[tuple[list[int], tuple[int, int, int], int]] = []
    members: list[int] = []
    key, n = (1, 1, 1), 0
    for g in sorted(graphs, key=lambda g: (counts[g], windows[g], g)):
        merged_key = tuple(max(a, b) for a, b in zip(key, windows[g]))
        merged_n = max(n, counts[g])
        if members:
            merged = costs.group(len(members) + 1, merged_n, merged_key)
            apart = costs.group(len(members), n, key) + costs.group(1, counts[g], windows[g])
            size = (len(members) + 1) * merged_n * merged_n * math.prod(merged_key)
            if merged > apart or size > pass_candidates:
                groups.append((sorted(members), key, n))
                members, merged_key, merged_n = [], windows[g], counts[g]
        members.append(g)
        key, n = merged_key, merged_n
    if members:
        groups.append((sorted(members), key, n))
    return groups


def padded_positions(
    positions: torch.Tensor,
    starts: Sequence[int],
    counts: Sequence[int],
    members: Sequence[int],
    n: int,
) -> torch.Tensor:
    """``[len(members), n, 3]`` float64 positions, NaN beyond each structure's atoms."""
    first = starts[members[0]]
    contiguous = all(counts[g] == n and starts[g] == first + k * n for k, g in enumerate(members))
    if contiguous:
        return positions[first : first + len(members) * n].view(len(members), n, 3)
    out = positions.new_full((len(members), n, 3), math.nan)
    source = torch.cat([torch.arange(starts[g], starts[g] + counts[g]) for g in members])
    target = torch.cat([torch.arange(k * n, k * n + counts[g]) for k, g in enumerate(members)])
    out.view(-1, 3)[target.to(positions.device)] = positions[source.to(positions.device)]
    return out


def search_structures(
    positions: torch.Tensor,
    cell: torch.Tensor,
    recip: torch.Tensor,
    ranges: torch.Tensor,
    counts: Sequence[int],
    starts: Sequence[int],
    groups: Sequence[tuple[list[int], tuple[int, int, int], int]],
    windows_of_graph: Sequence[tuple[int, int, int]],
    cutoff: float,
    full_list: bool,
    pass_candidates: int,
) -> list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run :func:`search` over ``groups``: ``(members, pairs, shifts, counts)`` per group.

    Each entry covers its group's members in batch order, with global atom indices.
    ``windows_of_graph[g]`` is what structure ``g`` needs (at most its group's).
    """
    device = positions.device
    out = []
    for members, windows, n in groups:
        narrower = any(tuple(windows_of_graph[g]) != tuple(windows) for g in members)
        index = torch.tensor(members, device=device)
        block = padded_positions(positions, starts, counts, members, n)
        group_cell, group_recip = cell.index_select(0, index), recip.index_select(0, index)
        group_ranges = ranges.index_select(0, index)
        per_row = n * windows[0] * windows[1] * windows[2]
        step = max(1, pass_candidates // max(per_row, 1)) if len(members) == 1 else n
        parts = []
        for a0 in range(0, n, step):
            rows = (a0, min(n, a0 + step)) if step < n else None
            found = search(
                block,
                group_cell,
                group_recip,
                group_ranges,
                windows,
                cutoff,
                full_list=full_list,
                rows=rows,
                narrower=narrower,
            )
            parts.append(found)
        if len(parts) == 1:
            graph, sender, receiver, shifts, found = parts[0]
        else:  # one structure in row chunks: rows ascend, so senders stay sorted
            graph, sender, receiver, shifts = (torch.cat([p[k] for p in parts]) for k in range(4))
            found = sum(p[4] for p in parts)
        offset = torch.tensor([starts[g] for g in members], device=device).index_select(0, graph)
        pairs = torch.stack([offset + sender, offset + receiver], 1)
        out.append((members, pairs, shifts, found))
    return out
