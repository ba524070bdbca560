"""``BudgetBatchSampler``: batches by atom and edge budget instead of a fixed structure count.

A fixed ``batch_size`` means eight 500-atom slabs need fifteen times the memory of
eight 32-atom cells; out-of-memory errors follow. This sampler fills every batch up
to ``max_atoms`` atoms and/or ``max_edges`` neighbour pairs:

1. Each epoch the structures are shuffled (a pure function of ``seed`` and the
   epoch) and packed window by window: inside a window of about sixteen batches'
   worth of structures, first-fit-decreasing (largest first, each into the first
   batch with room); batches that still have room are carried into the next
   window. Batches come out nearly full.
2. The number of batches per epoch is the same every epoch (the training loop
   sizes schedules and resumes with it): it is fixed by the packing of epoch 0,
   and an epoch that packs into fewer batches splits its most populous batches in
   two (see ``drop_last`` for more). Each structure appears exactly once per epoch.
3. With ``num_replicas`` ranks, batches are ordered by their atom total and dealt
   in steps of ``num_replicas`` similar batches (rank ``r`` takes the ``r``-th of
   each step), so every rank has the same number of batches (no collective waits
   forever) and the ranks of a step carry nearly the same number of atoms; the
   order of the steps is shuffled.

Every rank computes the same plan from ``(seed, epoch)``, so no communication is
needed. ``state_dict``/``load_state_dict`` resume mid-epoch exactly.

Example:
    >>> sampler = BudgetBatchSampler([30, 10, 20, 40, 25, 5, 15, 35], max_atoms=60, seed=0)
    >>> batches = list(sampler)
    >>> sorted(i for b in batches for i in b)
    [0, 1, 2, 3, 4, 5, 6, 7]
    >>> max(sum([30, 10, 20, 40, 25, 5, 15, 35][i] for i in b) for b in batches) <= 60
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import math
import numbers
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from nvalchemi.data.datapipes.samplers import epoch_generator

__all__ = ["BudgetBatchSampler", "count_atoms", "count_edges"]

# Structures per packing window: enough for about this many batches.
_WINDOW_BATCHES = 16
# Partly filled batches carried from one window into the next, at most.
_CARRIED = 8
_CHUNK = 512  # structures per batch when counting edges
# A step whose largest total is within this factor of the mean is left as packed.
_BALANCED = 1.002

_edge_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------- sizes of a dataset
def _is_count_sequence(value: Any) -> bool:
    """Whether ``value`` is a 1-D sequence of integer counts (rather than a dataset)."""
    if isinstance(value, torch.Tensor):
        return value.ndim == 1 and not value.is_floating_point()
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and value.dtype.kind in "iu"
    if not isinstance(value, Sequence) or isinstance(value, str):
        return False
    return all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value[:8])


def _checked_counts(values: Any, name: str) -> list[int]:
    counts = [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
    bad = next((i for i, v in enumerate(counts) if v < 0), None)
    if bad is not None:
        raise ValueError(f"{name}[{bad}] is negative ({counts[bad]}); counts must be >= 0.")
    return counts


def count_atoms(dataset: Any) -> list[int]:
    """Atom count of every structure of ``dataset`` (cheap where the dataset knows it).

    Uses, in order: an ``InMemoryDataset``'s stored counts, a ``MultiDataset``'s
    children, the reader's ``get_metadata`` (a zarr store's pointers), and else
    reads each structure once (without transforms).
    """
    children = getattr(dataset, "datasets", None)
    if children is not None:
        return [n for child in children for n in count_atoms(child)]
    stored = getattr(dataset, "_node_counts", None)
    if stored is not None:
        return [int(n) for n in stored]
    reader = getattr(dataset, "reader", None)
    getter = getattr(reader, "get_metadata", None)
    if callable(getter):
        return [int(getter(i)[0]) for i in range(len(dataset))]
    return [n for batch in _raw_batches(dataset) for n in batch.num_nodes_list]


def _raw_batches(dataset: Any) -> Iterator[Any]:
    """The structures of ``dataset`` collated in chunks, without its transforms."""
    from nvalchemi.data.batch import Batch
    from nvalchemi.data.datapipes.dataset import Dataset, InMemoryDataset

    n = len(dataset)
    chunks = [list(range(s, min(n, s + _CHUNK))) for s in range(0, n, _CHUNK)]
    if isinstance(dataset, InMemoryDataset):
        for chunk in chunks:
            yield dataset.get_batch(chunk)
        return
    if isinstance(dataset, Dataset):
        plain = Dataset(dataset.reader, skip_validation=dataset.skip_validation)
        for chunk in chunks:
            yield plain.get_batch(chunk)
        return
    for chunk in chunks:
        items = [dataset[i] for i in chunk]
        items = [it[0] if isinstance(it, tuple) else it for it in items]
        yield Batch.from_data_list(items)


def _stored_edge_counts(dataset: Any, cutoff: float, half_list: bool) -> list[int] | None:
    """Exact edge counts from lists the dataset already stores for these options."""
    from nvalchemi.data._neighbor_stamps import has_neighbor_list

    resident = getattr(dataset, "batch", None)
    if resident is not None and has_neighbor_list(resident, cutoff, half_list=half_list):
        return [int(e) for e in resident.num_edges_per_graph.tolist()]
    reader = getattr(dataset, "reader", None)
    getter = getattr(reader, "get_metadata", None)
    read = getattr(reader, "read_many", None)
    if callable(getter) and callable(read) and len(dataset):
        meta = read([0])[0][1] or {}
        stamp = (meta.get("neighbor_list_cutoff"), meta.get("neighbor_list_half_list"))
        if stamp[0] is not None and (float(stamp[0]), bool(stamp[1])) == (cutoff, half_list):
            return [int(getter(i)[1]) for i in range(len(dataset))]
    return None


def count_edges(dataset: Any, cutoff: float, *, half_list: bool = False) -> list[int]:
    """Neighbour-pair count of every structure at ``cutoff`` (exact; computed once, cached).

    Lists the dataset already stores for these options (a zarr store written with
    lists, an ``InMemoryDataset`` built with them) are counted as they are; otherwise
    the lists are built batch by batch (:func:`~nvalchemi.data.neighbors.compute_neighbors`,
    about 0.1 ms per small structure) and only their lengths kept. The result is
    cached on the dataset object for the life of the process.
    """
    from nvalchemi.data.neighbors import compute_neighbors, resolve_neighbor_options

    cutoff, half_list, _ = resolve_neighbor_options(cutoff, half_list=half_list)
    key = (cutoff, half_list, len(dataset))
    try:
        cached = _edge_cache.get(dataset, {})
    except TypeError:  # not weak-referenceable
        cached = {}
    if key in cached:
        return list(cached[key])
    children = getattr(dataset, "datasets", None)
    if children is not None:
        counts = [e for child in children for e in count_edges(child, cutoff, half_list=half_list)]
    else:
        counts = _stored_edge_counts(dataset, cutoff, half_list)
        if counts is None:
            counts = []
            for batch in _raw_batches(dataset):
                for key_name in [k for k, lvl in batch._level_of.items() if lvl == "edge"]:
                    del batch[key_name]
                compute_neighbors(batch, cutoff, half_list=half_list)
                counts.extend(int(e) for e in batch.num_edges_per_graph.tolist())
    with contextlib.suppress(TypeError):  # not weak-referenceable: no cache
        _edge_cache.setdefault(dataset, {})[key] = tuple(counts)
    return counts


def _dataset_cutoff(dataset: Any) -> tuple[float, bool] | None:
    """``(cutoff, half_list)`` the dataset's structures get lists for, if it says.

    From its ``NeighborListTransform``, else the stamp of the lists it stores (an
    ``InMemoryDataset`` built with them, a zarr store written with them).
    """
    from nvalchemi.data._neighbor_stamps import stamp_of
    from nvalchemi.data.neighbors import NeighborListTransform

    for child in getattr(dataset, "datasets", None) or [dataset]:
        transforms = getattr(child, "transforms", None)
        for transform in getattr(transforms, "transforms", None) or ():
            if isinstance(transform, NeighborListTransform):
                return transform.cutoff, transform.half_list
        resident = getattr(child, "batch", None)
        if resident is not None and "neighbor_list" in resident:
            stamp = stamp_of(resident)
            if stamp is not None:
                return stamp
        read = getattr(getattr(child, "reader", None), "read_many", None)
        if callable(read) and len(child):
            meta = read([0])[0][1] or {}
            if meta.get("neighbor_list_cutoff") is not None:
                return float(meta["neighbor_list_cutoff"]), bool(
                    meta.get("neighbor_list_half_list", False)
                )
    return None


# ---------------------------------------------------------------------------- packing
def _pack(
    order: list[int],
    atoms: list[int],
    edges: list[int],
    max_atoms: float,
    max_edges: float,
    window: int,
) -> list[list[int]]:
    """First-fit-decreasing inside windows of ``order``; open batches carry over."""
    cost = [max(a / max_atoms, e / max_edges) for a, e in zip(atoms, edges)]
    done: list[list[int]] = []
    open_bins: list[list[Any]] = []  # [atoms, edges, members]
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=cost.__getitem__, reverse=True)
        for i in chunk:
            a, e = atoms[i], edges[i]
            for b in open_bins:
                if b[0] + a <= max_atoms and b[1] + e <= max_edges:
                    b[0] += a
                    b[1] += e
                    b[2].append(i)
                    break
            else:
                open_bins.append([a, e, [i]])
        least_a, least_e = min(atoms[i] for i in chunk), min(edges[i] for i in chunk)
        carried = []
        for b in open_bins:
            if b[0] + least_a > max_atoms or b[1] + least_e > max_edges:
                done.append(b[2])
            else:
                carried.append(b)
        carried.sort(key=lambda b: -max(b[0] / max_atoms, b[1] / max_edges))
        done.extend(b[2] for b in carried[:-_CARRIED] if len(carried) > _CARRIED)
        open_bins = carried[-_CARRIED:] if len(carried) > _CARRIED else carried
    done.extend(b[2] for b in open_bins)
    return done


def _split(batch: list[int], atoms: list[int], edges: list[int]) -> tuple[list[int], list[int]]:
    """Two halves of a batch with about equal atoms (largest first to the lighter half)."""
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for i in sorted(batch, key=lambda i: (-atoms[i], -edges[i])):
        k = 0 if loads[0] <= loads[1] else 1
        halves[k].append(i)
        loads[k] += atoms[i]
    return halves


class BudgetBatchSampler(Sampler[list[int]]):
    """Batches of structure indices within an atom and/or edge budget.

    Args:
        sizes: a dataset (atom counts from :func:`count_atoms`) or a sequence of
            per-structure atom counts.
        max_atoms: most atoms in a batch (``None``: no atom budget).
        max_edges: most neighbour pairs in a batch (``None``: no edge budget).
        edge_counts: per-structure pair counts; when ``max_edges`` is set and this
            is not given, they come from :func:`count_edges` at the cutoff of the
            dataset's ``NeighborListTransform`` (exact when lists are stored).
        shuffle: reshuffle every epoch (``False``: pack in index order).
        seed: base seed, the same on every rank.
        drop_last: ``False`` (default): every structure exactly once per epoch; the
            fixed batch count is kept by splitting the most populous batches of an
            epoch that packs into fewer. ``True``: no batch is ever split and the
            emptiest batches of an epoch are dropped instead: the count is that of
            epoch 0 without its last batch if that one is less than half full, and
            (with several ranks) rounded down to a multiple of ``num_replicas``; a
            few structures are skipped per epoch, different ones each epoch.
        num_replicas, rank: data-parallel ranks (``DDPHook`` injects them, see
            :meth:`shard`).
        sampler: an index sampler of one replica whose epoch order is packed instead of
            a shuffle (e.g. a :class:`~nvalchemi.data.datapipes.GroupBalancedSampler`,
            which may repeat structures); it must be a pure function of its epoch.

    A structure larger than a budget on its own forms a batch by itself (with a
    warning at construction). Iterating yields lists of indices; usable as the
    ``batch_sampler`` of ``nvalchemi.data.datapipes.DataLoader`` and of
    ``torch.utils.data.DataLoader``.

    Raises:
        ValueError: no budget, a non-positive budget, counts of the wrong length,
            ``max_edges`` without edge counts or a dataset cutoff to compute them.
    """

    def __init__(
        self,
        sizes: Any,
        max_atoms: int | None = None,
        max_edges: int | None = None,
        edge_counts: Sequence[int] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        sampler: Any = None,
    ) -> None:
        if sampler is not None and getattr(sampler, "num_replicas", 1) != 1:
            raise ValueError(
                "BudgetBatchSampler: sampler= must give the whole epoch (num_replicas=1); the "
                "budget sampler shards the batches it packs."
            )
        self.sampler = sampler
        if max_atoms is None and max_edges is None:
            raise ValueError(
                "BudgetBatchSampler needs a budget: max_atoms=..., max_edges=... or both "
                "(e.g. from nvalchemi.training.memory_probe.probe_batch_budget)."
            )
        for name, value in (("max_atoms", max_atoms), ("max_edges", max_edges)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0
            ):
                raise ValueError(
                    f"BudgetBatchSampler: {name} must be a positive number; got {value!r}."
                )
        if isinstance(num_replicas, bool) or int(num_replicas) < 1:
            raise ValueError(f"num_replicas must be >= 1; got {num_replicas!r}.")
        if not 0 <= int(rank) < int(num_replicas):
            raise ValueError(f"rank must be in [0, {num_replicas}); got {rank!r}.")
        self.atoms = (
            _checked_counts(sizes, "sizes") if _is_count_sequence(sizes) else count_atoms(sizes)
        )
        if not self.atoms:
            raise ValueError("BudgetBatchSampler needs at least one structure.")
        self.max_atoms = max_atoms
        self.max_edges = max_edges
        if edge_counts is None and max_edges is not None:
            edge_counts = self._edges_of(sizes)
        self.edges = None if edge_counts is None else _checked_counts(edge_counts, "edge_counts")
        if self.edges is not None and len(self.edges) != len(self.atoms):
            raise ValueError(
                f"edge_counts has {len(self.edges)} entries for {len(self.atoms)} structures."
            )
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.epoch = 0
        self._skip = 0
        self._yielded = 0
        self._plans: dict[int, list[list[int]]] = {}
        self._no_edges: list[int] = []
        self._warn_oversized()
        self.num_batches = self._batch_count()

    # ---------------------------------------------------------------- construction
    @staticmethod
    def _edges_of(sizes: Any) -> list[int]:
        if _is_count_sequence(sizes):
            raise ValueError(
                "BudgetBatchSampler: max_edges needs edge counts; pass edge_counts=[...] with "
                "the atom counts, or give the dataset (edges are counted at its cutoff)."
            )
        options = _dataset_cutoff(sizes)
        if options is None:
            raise ValueError(
                "BudgetBatchSampler: max_edges needs edge counts, and the dataset has no "
                "NeighborListTransform to take the cutoff from; pass "
                "edge_counts=count_edges(dataset, cutoff=<the model's cutoff>)."
            )
        return count_edges(sizes, options[0], half_list=options[1])

    def _budgets(self) -> tuple[float, float]:
        return (
            math.inf if self.max_atoms is None else float(self.max_atoms),
            math.inf if self.max_edges is None else float(self.max_edges),
        )

    def _edge_list(self) -> list[int]:
        if self.edges is not None:
            return self.edges
        if len(self._no_edges) != len(self.atoms):
            self._no_edges = [0] * len(self.atoms)
        return self._no_edges

    def _warn_oversized(self) -> None:
        max_a, max_e = self._budgets()
        edges = self._edge_list()
        big = [i for i, (a, e) in enumerate(zip(self.atoms, edges)) if a > max_a or e > max_e]
        if big:
            worst = max(big, key=lambda i: (self.atoms[i], edges[i]))
            warnings.warn(
                f"BudgetBatchSampler: {len(big)} structure(s) exceed the budget on their own "
                f"(largest: index {worst} with {self.atoms[worst]} atoms, {edges[worst]} edges; "
                f"budget max_atoms={self.max_atoms}, max_edges={self.max_edges}); each forms a "
                "batch by itself. Raise the budget if they do not fit in memory.",
                UserWarning,
                stacklevel=3,
            )

    def _window(self) -> int:
        max_a, max_e = self._budgets()
        edges = self._edge_list()
        mean = sum(max(a / max_a, e / max_e) for a, e in zip(self.atoms, edges)) / len(self.atoms)
        per_batch = 1.0 / mean if mean > 0 else len(self.atoms)
        return max(32, math.ceil(_WINDOW_BATCHES * per_batch))

    def _order_of(self, epoch: int) -> tuple[list[int], torch.Generator]:
        """This epoch's structure order, and the generator that then orders its steps."""
        generator = epoch_generator(self.seed, epoch)
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            return [int(i) for i in self.sampler], generator
        n = len(self.atoms)
        order = torch.randperm(n, generator=generator).tolist() if self.shuffle else list(range(n))
        return order, generator

    def _packed(self, order: list[int], window: int | None = None) -> list[list[int]]:
        max_a, max_e = self._budgets()
        return _pack(order, self.atoms, self._edge_list(), max_a, max_e, window or self._window())

    def _batch_count(self) -> int:
        """Batches per epoch over all ranks (a multiple of ``num_replicas``)."""
        first = self._packed(self._order_of(0)[0])
        count = len(first)
        replicas = self.num_replicas
        if self.drop_last:
            if count > 1 and self._load(first[-1]) < 0.5:
                count -= 1
            count = (count // replicas) * replicas
            if count == 0:
                raise ValueError(
                    f"BudgetBatchSampler: with drop_last=True the {len(self.atoms)} structures "
                    f"give no batch for each of {replicas} ranks; use drop_last=False or a "
                    "smaller budget."
                )
            return count
        return math.ceil(count / replicas) * replicas

    def _load(self, batch: list[int]) -> float:
        """Fill of a batch: the larger of its atom and edge fractions of the budget."""
        max_a, max_e = self._budgets()
        edges = self._edge_list()
        a = sum(self.atoms[i] for i in batch)
        e = sum(edges[i] for i in batch)
        return max(a / max_a, e / max_e)

    # -------------------------------------------------------------------- the plan
    def plan(self, epoch: int | None = None) -> list[list[int]]:
        """Every batch of ``epoch`` (all ranks), in step order: step ``s`` is
        ``plan[s * num_replicas : (s + 1) * num_replicas]``."""
        epoch = self.epoch if epoch is None else int(epoch)
        cached = self._plans.get(epoch)
        if cached is not None:
            return cached
        order, generator = self._order_of(epoch)
        batches = self._packed(order)
        target = self.num_batches
        if len(batches) > target and not self.drop_last:
            # rare: this shuffle packed worse than epoch 0; pack the whole epoch at once
            batches = self._packed(order, window=len(order))
        if len(batches) > target:
            if not self.drop_last:
                raise RuntimeError(
                    f"BudgetBatchSampler: epoch {epoch} packs into {len(batches)} batches, more "
                    f"than the {target} of every epoch; please report this with the atom counts."
                )
            batches.sort(key=self._load, reverse=True)
            batches = batches[:target]
        batches = self._fill_to(batches, target)
        plan = self._order(batches, generator)
        self._plans = {epoch: plan}
        return plan

    def _fill_to(self, batches: list[list[int]], target: int) -> list[list[int]]:
        """``target`` batches: split the most populous (then fullest) ones in two."""
        if len(batches) >= target:
            return batches
        edges = self._edge_list()
        heap = [(-len(b), -self._load(b), k) for k, b in enumerate(batches) if len(b) > 1]
        heapq.heapify(heap)
        out = list(batches)
        while len(out) < target and heap:
            _, _, k = heapq.heappop(heap)
            first, second = _split(out[k], self.atoms, edges)
            out[k] = first
            out.append(second)
            for j in (k, len(out) - 1):
                if len(out[j]) > 1:
                    heapq.heappush(heap, (-len(out[j]), -self._load(out[j]), j))
        repeated = 0
        while len(out) < target:  # fewer structures than batches: repeat from the start
            out.append(list(out[repeated]))
            repeated += 1
        return out

    def _order(self, batches: list[list[int]], generator: torch.Generator) -> list[list[int]]:
        """Steps of ``num_replicas`` batches with (nearly) equal totals, steps shuffled."""
        replicas = self.num_replicas
        if replicas > 1:
            weight = self._weights()
            batches = sorted(batches, key=lambda b: -sum(weight[i] for i in b))
        steps = [batches[s : s + replicas] for s in range(0, len(batches), replicas)]
        if replicas > 1:
            steps = [self._balanced(step) for step in steps]
        if self.shuffle:
            order = torch.randperm(len(steps), generator=generator).tolist()
            steps = [steps[k] for k in order]
        return [b for step in steps for b in step]

    def _weights(self) -> list[int]:
        """What ranks are balanced on: atoms (edges when only edges are budgeted)."""
        return self.atoms if self.max_atoms is not None else self._edge_list()

    def _balanced(self, step: list[list[int]]) -> list[list[int]]:
        """The structures of one step dealt again so every rank gets about the same total.

        Largest first, each to the lightest batch that still has room in both
        budgets; the step is kept as it is if that does not fit (or balances worse).
        """
        weight, edges = self._weights(), self._edge_list()
        totals = [sum(weight[i] for i in b) for b in step]
        if max(totals) * len(step) <= _BALANCED * sum(totals):
            return step  # already within 0.2 % (the usual case: full batches of one size)
        max_a, max_e = self._budgets()
        items = sorted((i for b in step for i in b), key=lambda i: (-weight[i], -edges[i], i))
        out: list[list[int]] = [[] for _ in step]
        atoms_in, edges_in, load = [0] * len(step), [0] * len(step), [0] * len(step)
        for i in items:
            room = [
                k
                for k in range(len(step))
                if atoms_in[k] + self.atoms[i] <= max_a and edges_in[k] + edges[i] <= max_e
            ]
            if not room:
                return step
            k = min(room, key=lambda k: (load[k], k))
            out[k].append(i)
            atoms_in[k] += self.atoms[i]
            edges_in[k] += edges[i]
            load[k] += weight[i]
        if any(not b for b in out):
            return step
        return out if max(load) <= max(totals) else step

    # ---------------------------------------------------------------- the protocol
    def __len__(self) -> int:
        """Batches this rank yields per epoch (the same every epoch and on every rank)."""
        return self.num_batches // self.num_replicas

    def __iter__(self) -> Iterator[list[int]]:
        mine = self.plan()[self.rank :: self.num_replicas]
        skip, self._skip = self._skip, 0
        self._yielded = skip
        for batch in mine[skip:]:
            self._yielded += 1
            yield list(batch)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose plan the next iteration yields (same value on every rank)."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer; got {epoch!r}.")
        self.epoch = int(epoch)

    def set_epoch_step(self, step: int) -> None:
        """Make the next iteration start at batch ``step`` of this rank's epoch."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative integer; got {step!r}.")
        self._skip = int(step)

    def shard(self, num_replicas: int, rank: int) -> BudgetBatchSampler:
        """The same sampler (sizes, budgets, seed, epoch) for ``rank`` of ``num_replicas``."""
        out = BudgetBatchSampler(
            self.atoms,
            self.max_atoms,
            self.max_edges,
            self.edges,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
            num_replicas=num_replicas,
            rank=rank,
            sampler=self.sampler,
        )
        out.epoch = self.epoch
        return out

    def fingerprint(self) -> str:
        """Hash of what the plans depend on (sizes, budgets, options), for resume checks."""
        digest = hashlib.sha256()
        digest.update(np.asarray(self.atoms, dtype=np.int64).tobytes())
        digest.update(np.asarray(self._edge_list(), dtype=np.int64).tobytes())
        digest.update(
            repr(
                (
                    self.max_atoms,
                    self.max_edges,
                    self.shuffle,
                    self.seed,
                    self.drop_last,
                    self.num_replicas,
                )
            ).encode()
        )
        if self.sampler is not None:  # its settings decide the order
            digest.update(repr(self.sampler).encode())
        return digest.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "epoch_step", "seed", "fingerprint"}``: where this rank is in its epoch.

        ``epoch_step`` counts batches of this epoch already handed out (or a pending
        :meth:`set_epoch_step`). With nvalchemi's ``DataLoader`` restore the loader
        (it seeks the sampler itself); with torch's, restore the sampler.
        """
        step = self._skip if self._skip else self._yielded
        return {
            "epoch": self.epoch,
            "epoch_step": step,
            "seed": self.seed,
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the next iteration continues that epoch exactly.

        Raises ``ValueError`` when the state belongs to other sizes, budgets or seed.
        """
        missing = {"epoch", "epoch_step"} - set(state)
        if missing:
            raise KeyError(f"BudgetBatchSampler.load_state_dict: missing keys {sorted(missing)}.")
        saved = state.get("fingerprint")
        if saved is not None and saved != self.fingerprint():
            raise ValueError(
                "BudgetBatchSampler.load_state_dict: the state was saved by a sampler with "
                "other structure sizes, budgets, seed or number of ranks; resume with the "
                "data and budget of the saved run."
            )
        self.set_epoch(int(state["epoch"]))
        self.set_epoch_step(int(state["epoch_step"]))

    def __repr__(self) -> str:
        return (
            f"BudgetBatchSampler(n={len(self.atoms)}, max_atoms={self.max_atoms}, "
            f"max_edges={self.max_edges}, batches={len(self)}, num_replicas={self.num_replicas}, "
            f"rank={self.rank})"
        )
