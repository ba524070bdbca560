"""Samplers: seeded shuffling, weighted multi-dataset sampling, distributed sharding.

Every order produced here is a pure function of ``(seed, epoch)`` (and of the
rank for the shard it keeps): no sampler touches the global RNG, so a resumed
run, or another rank, sees exactly the same epoch. Call ``set_epoch(epoch)`` to
reshuffle; iterating twice in the same epoch gives the same order.

* :class:`ShuffleSampler` - indices ``0..n-1``, shuffled per epoch (the
  DataLoader's default sampler).
* :class:`MultiDatasetSampler` - global indices of a ``MultiDataset`` drawn at
  per-dataset rates, sharded like ``torch.utils.data.DistributedSampler``.
* :class:`MultiDatasetBatchSampler` - whole batches with a fixed number of
  structures from each child dataset, whole batches sharded across ranks.
* :class:`GroupBalancedSampler` - structures of groups (``config_type``, any label)
  drawn with probability proportional to ``count ** alpha``: rare groups more often.

Example:
    >>> from nvalchemi.data.datapipes.samplers import ShuffleSampler
    >>> sampler = ShuffleSampler(5, seed=0)
    >>> first = list(sampler)
    >>> first == list(sampler), sorted(first)
    (True, [0, 1, 2, 3, 4])
    >>> sampler.set_epoch(1)
    >>> list(sampler) != first
    True
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence, Sized
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = [
    "DistributedSamplerProtocol",
    "EpochPolicy",
    "GroupBalancedSampler",
    "MultiDatasetBatchSampler",
    "MultiDatasetSampler",
    "ShuffleSampler",
    "epoch_generator",
]

EpochPolicy = Literal["dataset_size", "min_size", "max_size"]


@runtime_checkable
class DistributedSamplerProtocol(Protocol):
    """A sampler that shards data across ranks (``torch.utils.data.DistributedSampler`` is one)."""

    num_replicas: int
    rank: int

    def set_epoch(self, epoch: int) -> None: ...


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A fresh CPU generator determined by ``(seed, epoch)`` alone.

    The pair is mixed with numpy's ``SeedSequence`` so that ``(seed, epoch + 1)``
    and ``(seed + 1, epoch)`` give unrelated streams (``seed + epoch`` would not).
    """
    words = np.random.SeedSequence([int(seed) & (2**63 - 1), int(epoch)]).generate_state(2)
    value = (int(words[0]) << 32 | int(words[1])) & (2**63 - 1)
    return torch.Generator().manual_seed(value)


def _seed_from(generator: torch.Generator | None, seed: int) -> int:
    """The base seed: ``seed``, or one drawn once from a user generator."""
    if generator is None:
        return int(seed)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator; got {type(generator).__name__}.")
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def _check_epoch(epoch: Any) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative integer; got {epoch!r}.")
    return int(epoch)


class ShuffleSampler(Sampler[int]):
    """Indices ``0..n-1``, shuffled per epoch as a pure function of ``(seed, epoch)``.

    Args:
        data_source: the number of items, or a sized object (its length is read at
            every iteration, so a growing dataset is followed).
        seed: base seed; identical on every rank.
        shuffle: False yields ``0..n-1`` in order.

    ``set_epoch(epoch)`` selects the permutation; the sampler never advances the
    epoch itself.
    """

    def __init__(self, data_source: int | Sized, seed: int = 0, shuffle: bool = True) -> None:
        if isinstance(data_source, bool) or not isinstance(data_source, (numbers.Integral, Sized)):
            raise TypeError(
                f"ShuffleSampler needs a length or a sized dataset; got {type(data_source).__name__}."
            )
        if isinstance(data_source, numbers.Integral) and data_source < 0:
            raise ValueError(f"ShuffleSampler: negative length {data_source}.")
        self.data_source = data_source
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0

    def __len__(self) -> int:
        if isinstance(self.data_source, numbers.Integral):
            return int(self.data_source)
        return len(self.data_source)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation the next iteration yields."""
        self.epoch = _check_epoch(epoch)

    def indices(self) -> torch.Tensor:
        """This epoch's order as an int64 tensor."""
        n = len(self)
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=epoch_generator(self.seed, self.epoch))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __repr__(self) -> str:
        return f"ShuffleSampler(n={len(self)}, seed={self.seed}, shuffle={self.shuffle})"


# --------------------------------------------------------------------- helpers
def _child_lengths(dataset: Any) -> list[int]:
    datasets = getattr(dataset, "datasets", None)
    if datasets is None:
        raise TypeError(
            f"Multi-dataset samplers need a MultiDataset (with .datasets); got "
            f"{type(dataset).__name__}."
        )
    return [len(d) for d in datasets]


def normalize_weights(weights: Sequence[float] | None, lengths: Sequence[int]) -> list[float]:
    """Per-child sampling rates summing to one (``None``: proportional to size)."""
    if weights is None:
        weights = [float(n) for n in lengths]
    weights = [w for w in weights]
    if len(weights) != len(lengths):
        raise ValueError(f"Got {len(weights)} weights for {len(lengths)} datasets.")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise TypeError(f"Weight {i} must be a number; got {w!r}.")
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"Weight {i} must be finite and non-negative; got {w!r}.")
        if w > 0 and lengths[i] == 0:
            raise ValueError(f"Weight {i} is positive but dataset {i} is empty.")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"At least one weight must be positive; got {list(weights)}.")
    return [float(w) / total for w in weights]


def allocate(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder).

    >>> allocate(5, [0.8, 0.2]), allocate(7, [0.5, 0.5])
    ([4, 1], [4, 3])
    """
    exact = [total * w for w in weights]
    counts = [math.floor(x) for x in exact]
    remainder = total - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:remainder]:
        counts[i] += 1
    return counts


def resolve_replicas(
    num_replicas: int | None, rank: int | None, distributed_manager: Any = None
) -> tuple[int, int]:
    """``(num_replicas, rank)``: an initialised manager wins over explicit values."""
    if distributed_manager is not None:
        initialized = getattr(distributed_manager, "is_initialized", None)
        if initialized is None or initialized():
            num_replicas = int(distributed_manager.world_size)
            rank = int(distributed_manager.rank)
    num_replicas = 1 if num_replicas is None else int(num_replicas)
    rank = 0 if rank is None else int(rank)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1; got {num_replicas}.")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas}); got {rank}.")
    return num_replicas, rank


def shard_count(n: int, num_replicas: int, drop_last: bool) -> int:
    """Items per rank, as ``torch.utils.data.DistributedSampler`` computes it."""
    if drop_last and n % num_replicas:
        return math.ceil((n - num_replicas) / num_replicas)
    return math.ceil(n / num_replicas)


def shard(items: torch.Tensor, num_replicas: int, rank: int, drop_last: bool) -> torch.Tensor:
    """Rank ``rank``'s share: pad by repeating from the start (or truncate), then stride."""
    if num_replicas == 1:
        return items
    n = items.shape[0]
    total = shard_count(n, num_replicas, drop_last) * num_replicas
    if total > n and n > 0:
        items = torch.cat([items, items.repeat(math.ceil((total - n) / n))[: total - n]])
    return items[:total][rank::num_replicas]


def _validate_counts(counts: Sequence[Any], lengths: Sequence[int], batch_size: int) -> list[int]:
    out = []
    for i, c in enumerate(counts):
        if isinstance(c, bool) or not isinstance(c, numbers.Integral):
            raise TypeError(
                f"samples_per_dataset[{i}] must be an integer count (or give floats for "
                f"relative rates); got {c!r}."
            )
        if c < 0:
            raise ValueError(f"samples_per_dataset[{i}] is negative ({c}).")
        if c > 0 and lengths[i] == 0:
            raise ValueError(f"samples_per_dataset[{i}] = {c} but dataset {i} is empty.")
        out.append(int(c))
    if sum(out) != batch_size:
        raise ValueError(
            f"samples_per_dataset {out} sums to {sum(out)}, not batch_size={batch_size}."
        )
    if not any(out):
        raise ValueError("samples_per_dataset must not be all zero.")
    return out


class _DistributedBase:
    """Shared epoch/seed/rank bookkeeping of the multi-dataset samplers."""

    def _init_common(
        self, dataset, generator, seed, num_replicas, rank, distributed_manager, drop_last
    ) -> None:
        self.dataset = dataset
        self.lengths = _child_lengths(dataset)
        self.offsets = [0, *np.cumsum(self.lengths).tolist()][:-1]
        self.generator = generator
        self.seed = int(seed)
        self._base_seed = _seed_from(generator, seed)
        self.num_replicas, self.rank = resolve_replicas(num_replicas, rank, distributed_manager)
        self.drop_last = bool(drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; the order is a pure function of (seed, epoch)."""
        self.epoch = _check_epoch(epoch)

    def _generator(self) -> torch.Generator:
        return epoch_generator(self._base_seed, self.epoch)


class MultiDatasetSampler(_DistributedBase, Sampler[int]):
    """Global indices of a ``MultiDataset``, drawn at per-dataset rates.

    Args:
        dataset: a ``MultiDataset``.
        weights: per-child rates (default: proportional to child sizes).
        num_samples: indices per epoch over all ranks (default ``len(dataset)``).
        replacement: with ``shuffle``, draw the child of each sample at random and
            a random structure in it; otherwise allocate ``num_samples`` by weights
            (largest remainder) and walk each child's order, wrapping around when
            ``replacement`` (else the allocation may not exceed a child's size).
        shuffle: shuffle the child sequence and each child's order.
        generator: optional ``torch.Generator``; one draw from it replaces ``seed``
            (``set_epoch`` still changes the order).
        num_replicas, rank, distributed_manager: sharding (an initialised manager
            wins); the epoch is padded by repeating from the start or truncated
            with ``drop_last``, then rank ``r`` takes items ``r, r + R, ...``.
        seed: base seed, identical on every rank.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        weights: Sequence[float] | None = None,
        num_samples: int | None = None,
        replacement: bool = True,
        shuffle: bool = True,
        generator: torch.Generator | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        distributed_manager: Any = None,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self._init_common(
            dataset, generator, seed, num_replicas, rank, distributed_manager, drop_last
        )
        self.weights = normalize_weights(weights, self.lengths)
        self.num_samples = sum(self.lengths) if num_samples is None else int(num_samples)
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1; got {self.num_samples}.")
        self.replacement = bool(replacement)
        self.shuffle = bool(shuffle)
        self._counts = allocate(self.num_samples, self.weights)
        if not self.replacement:
            for i, (c, n) in enumerate(zip(self._counts, self.lengths)):
                if c > n:
                    raise ValueError(
                        f"Without replacement, dataset {i} would give {c} samples but has only "
                        f"{n}; lower num_samples or pass replacement=True."
                    )

    def epoch_indices(self) -> torch.Tensor:
        """The whole epoch (all ranks) as global indices."""
        gen = self._generator()
        offsets = torch.tensor(self.offsets, dtype=torch.int64)
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        if self.replacement and self.shuffle:
            child = torch.multinomial(
                torch.tensor(self.weights, dtype=torch.float64),
                self.num_samples,
                replacement=True,
                generator=gen,
            )
            local = (
                torch.rand(self.num_samples, generator=gen, dtype=torch.float64) * lengths[child]
            ).long()
            return offsets[child] + local
        counts = torch.tensor(self._counts, dtype=torch.int64)
        child = torch.repeat_interleave(torch.arange(len(self.lengths)), counts)
        if self.shuffle:
            child = child[torch.randperm(child.shape[0], generator=gen)]
        out = torch.empty_like(child)
        for c, n in enumerate(self.lengths):
            where = (child == c).nonzero().flatten()
            if where.numel() == 0:
                continue
            order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
            out[where] = offsets[c] + order[torch.arange(where.numel()) % n]
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(
            shard(self.epoch_indices(), self.num_replicas, self.rank, self.drop_last).tolist()
        )

    def __len__(self) -> int:
        return shard_count(self.num_samples, self.num_replicas, self.drop_last)


class MultiDatasetBatchSampler(_DistributedBase, Sampler[list[int]]):
    """Batches of global ``MultiDataset`` indices with a fixed share from each child.

    Each batch holds ``samples_per_dataset[c]`` structures of child ``c`` (from
    ``weights`` by largest remainder, default proportional to child sizes; or given
    as integer counts summing to ``batch_size``; floats are relative rates).

    Epoch length (``num_batches`` unset), over children contributing to a batch:
    per child ``ceil(len/count)`` batches with replacement, ``len // count``
    without. ``epoch_policy="dataset_size"``: ``ceil(len(dataset) / batch_size)``
    with replacement, else the minimum; ``"min_size"``: the minimum; ``"max_size"``:
    the maximum (needs ``replacement=True`` when children would be oversampled).

    Content: with replacement and shuffle, random structures of each child; with
    replacement and no shuffle, each child's structures in order, wrapping
    around; without replacement, consecutive slices of a per-epoch permutation
    (identity without shuffle). With ``shuffle`` each batch is shuffled too.

    Distributed: whole batches go round-robin to ranks (ordinal ``k`` to rank
    ``k % R``); the last round is padded with the epoch's first batches (or
    dropped with ``drop_last``), so every rank yields ``len(self)`` batches.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        weights: Sequence[float] | None = None,
        samples_per_dataset: Sequence[int | float] | None = None,
        num_batches: int | None = None,
        epoch_policy: EpochPolicy = "dataset_size",
        replacement: bool = True,
        shuffle: bool = True,
        generator: torch.Generator | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        distributed_manager: Any = None,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
            raise TypeError(f"batch_size must be an integer; got {batch_size!r}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}.")
        if weights is not None and samples_per_dataset is not None:
            raise ValueError("Pass either weights or samples_per_dataset, not both.")
        if epoch_policy not in ("dataset_size", "min_size", "max_size"):
            raise ValueError(
                f"epoch_policy must be 'dataset_size', 'min_size' or 'max_size'; got "
                f"{epoch_policy!r}."
            )
        self._init_common(
            dataset, generator, seed, num_replicas, rank, distributed_manager, drop_last
        )
        self.batch_size = int(batch_size)
        self.replacement = bool(replacement)
        self.shuffle = bool(shuffle)
        self.epoch_policy = epoch_policy
        self.samples_per_dataset = self._resolve_counts(weights, samples_per_dataset)
        total = sum(self.samples_per_dataset)
        self.weights = [c / total for c in self.samples_per_dataset]
        self.num_batches = self._resolve_num_batches(num_batches)

    @classmethod
    def balanced(cls, dataset: Any, *, batch_size: int, **kwargs: Any) -> MultiDatasetBatchSampler:
        """Equal share of every child in each batch (remainder by largest remainder)."""
        if "weights" in kwargs or "samples_per_dataset" in kwargs:
            raise ValueError("balanced() sets the weights itself.")
        n = len(_child_lengths(dataset))
        return cls(dataset, batch_size=batch_size, weights=[1.0] * n, **kwargs)

    def _resolve_counts(self, weights, samples_per_dataset) -> list[int]:
        k = len(self.lengths)
        if samples_per_dataset is None:
            return allocate(self.batch_size, normalize_weights(weights, self.lengths))
        counts = list(samples_per_dataset)
        if len(counts) != k:
            raise ValueError(f"samples_per_dataset has {len(counts)} entries for {k} datasets.")
        if any(isinstance(c, float) for c in counts):
            return allocate(self.batch_size, normalize_weights(counts, self.lengths))
        return _validate_counts(counts, self.lengths, self.batch_size)

    def _resolve_num_batches(self, num_batches: int | None) -> int:
        contributing = [(n, c) for n, c in zip(self.lengths, self.samples_per_dataset) if c > 0]
        if self.replacement:
            spans = [math.ceil(n / c) for n, c in contributing]
        else:
            spans = [n // c for n, c in contributing]
        smallest, largest = min(spans), max(spans)
        if num_batches is not None:
            if isinstance(num_batches, bool) or not isinstance(num_batches, numbers.Integral):
                raise TypeError(f"num_batches must be an integer; got {num_batches!r}.")
            if num_batches < 1:
                raise ValueError(f"num_batches must be >= 1; got {num_batches}.")
            if not self.replacement and num_batches > smallest:
                raise ValueError(
                    f"Without replacement only {smallest} complete batches fit "
                    f"(samples_per_dataset={self.samples_per_dataset}, dataset sizes "
                    f"{self.lengths}); lower num_batches or pass replacement=True."
                )
            return int(num_batches)
        if self.epoch_policy == "max_size":
            if not self.replacement and largest > smallest:
                raise ValueError(
                    "epoch_policy='max_size' oversamples the smaller datasets; pass "
                    "replacement=True (or use 'min_size')."
                )
            count = largest
        elif self.epoch_policy == "dataset_size" and self.replacement:
            count = math.ceil(sum(self.lengths) / self.batch_size)
        else:
            count = smallest
        if count < 1:
            raise ValueError(
                f"No complete batch fits without replacement (samples_per_dataset="
                f"{self.samples_per_dataset}, dataset sizes {self.lengths}); pass "
                "replacement=True or smaller counts."
            )
        return count

    def _epoch_batches(self) -> Iterator[list[int]]:
        """Every batch of the epoch in order (identical on all ranks)."""
        gen = self._generator()
        orders = {}
        if not self.replacement:
            for c, n in enumerate(self.lengths):
                if self.samples_per_dataset[c]:
                    orders[c] = (
                        torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
                    )
        for b in range(self.num_batches):
            parts = []
            for c, count in enumerate(self.samples_per_dataset):
                if count == 0:
                    continue
                n = self.lengths[c]
                if self.replacement and self.shuffle:
                    local = torch.randint(0, n, (count,), generator=gen)
                elif self.replacement:
                    local = torch.arange(b * count, (b + 1) * count) % n
                else:
                    local = orders[c][b * count : (b + 1) * count]
                parts.append(local + self.offsets[c])
            batch = torch.cat(parts)
            if self.shuffle:
                batch = batch[torch.randperm(batch.shape[0], generator=gen)]
            yield batch.tolist()

    def __iter__(self) -> Iterator[list[int]]:
        replicas, rank = self.num_replicas, self.rank
        per_rank = len(self)
        if replicas == 1:
            yield from (b for _, b in zip(range(per_rank), self._epoch_batches()))
            return
        total = per_rank * replicas
        pad = max(total - self.num_batches, 0)
        head: list[list[int]] = []
        emitted = 0
        for ordinal, batch in enumerate(self._epoch_batches()):
            if len(head) < pad:
                head.append(batch)
            if ordinal >= total:
                break
            if ordinal % replicas == rank:
                yield batch
                emitted += 1
        for ordinal in range(self.num_batches, total):
            if ordinal % replicas == rank and emitted < per_rank:
                yield head[(ordinal - self.num_batches) % len(head)]
                emitted += 1

    def __len__(self) -> int:
        return shard_count(self.num_batches, self.num_replicas, self.drop_last)


# --------------------------------------------------------------------- balanced groups
def group_shares(counts: Sequence[int], alpha: float) -> list[float]:
    """Each group's share of the draws: ``count ** alpha``, normalised.

    ``alpha=1``: in proportion to size (every structure equally often, as without
    groups); ``alpha=0``: every group equally often; in between, rare groups more
    often than their size says, but less than an equal share.

    >>> [round(p, 3) for p in group_shares([900, 100], 0.5)]
    [0.75, 0.25]
    """
    weights = [float(n) ** alpha if n > 0 else 0.0 for n in counts]
    total = sum(weights)
    return [w / total for w in weights]


def _stream_generator(seed: int, group: int, cycle: int) -> torch.Generator:
    """The generator of the ``cycle``-th pass over group ``group`` (a pure function)."""
    words = np.random.SeedSequence(
        [int(seed) & (2**63 - 1), int(group), int(cycle), 0x6B41]
    ).generate_state(2)
    return torch.Generator().manual_seed((int(words[0]) << 32 | int(words[1])) & (2**63 - 1))


class GroupBalancedSampler(Sampler[int]):
    """Structure indices with each group drawn in proportion to ``(its size) ** alpha``.

    Each epoch holds ``num_samples`` draws (default: the number of structures, so an
    epoch is as long as without balancing). Group ``g`` gets
    ``num_samples * n_g**alpha / sum_h n_h**alpha`` of them (largest remainder), taken in
    order from an endless stream of the group's structures: one seeded permutation per
    pass over the group, epoch after epoch. So a rare group's structures repeat within
    an epoch, a large group's are split over epochs, and over time every structure of a
    group is seen equally often. ``alpha=1`` is exactly the plain shuffle of
    :class:`ShuffleSampler` (same seed, same order); ``alpha=0`` draws every group
    equally often.

    The order is a pure function of ``(seed, epoch)``: a resumed run and every rank see
    the same epoch; with ``num_replicas > 1`` the epoch is padded (or truncated with
    ``drop_last``) and rank ``r`` takes items ``r, r + R, ...`` like
    ``DistributedSampler``, so ``DDPHook`` keeps it. As the ``sampler=`` of a
    :class:`~nvalchemi.data.datapipes.BudgetBatchSampler` (one replica) it gives the
    order that is packed into batches by atom budget.

    Args:
        groups: one label per structure (any hashable; ``None`` is a group of its own);
            kept as ``self.groups``.
        alpha: the exponent, 0 <= alpha <= 1 (values above 1 favour large groups).
        num_samples: draws per epoch over all ranks (default ``len(groups)``).
        shuffle: shuffle the epoch's draws (``False``: group by group, each in stream
            order).
        seed: base seed, identical on every rank.
        num_replicas, rank: data-parallel sharding (default: read from ``torch.distributed``
            when the sampler is iterated, so a loader built before DDP starts shards
            correctly; 1 and 0 without a process group).
        drop_last: truncate instead of padding when the epoch does not divide by the ranks.

    Example:
        >>> groups = ["bulk"] * 8 + ["slab"] * 2
        >>> sampler = GroupBalancedSampler(groups, alpha=0.0, seed=0)
        >>> sampler.counts  # draws per epoch: equal for both groups
        {'bulk': 5, 'slab': 5}
        >>> sorted(groups[i] for i in sampler).count("slab")
        5
    """

    def __init__(
        self,
        groups: Sequence[Any],
        *,
        alpha: float = 0.5,
        num_samples: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, numbers.Real)
            or not (math.isfinite(alpha) and alpha >= 0)
        ):
            raise ValueError(f"GroupBalancedSampler: alpha must be a number >= 0; got {alpha!r}.")
        labels = list(groups)
        if not labels:
            raise ValueError("GroupBalancedSampler needs at least one structure.")
        self.alpha = float(alpha)
        self.groups = labels
        self.names = sorted(set(labels), key=lambda g: (g is None, str(g)))
        ordinal = {name: k for k, name in enumerate(self.names)}
        codes = torch.tensor([ordinal[g] for g in labels], dtype=torch.int64)
        self.members = [torch.nonzero(codes == k).flatten() for k in range(len(self.names))]
        self.num_samples = len(labels) if num_samples is None else int(num_samples)
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1; got {self.num_samples}.")
        sizes = [int(m.numel()) for m in self.members]
        self.shares = group_shares(sizes, self.alpha)
        self._counts = allocate(self.num_samples, self.shares)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        if num_replicas is not None or rank is not None:
            resolve_replicas(num_replicas, rank)  # checked now
        self._replicas = (num_replicas, rank)
        self.drop_last = bool(drop_last)
        self.epoch = 0

    @property
    def num_replicas(self) -> int:
        """Ranks sharing each epoch: as given, else the process group's size when iterated."""
        return self._world()[0]

    @property
    def rank(self) -> int:
        """This process's share: as given, else its rank in the process group."""
        return self._world()[1]

    def _world(self) -> tuple[int, int]:
        # Read when used, not when built: a loader is often made before DDP starts.
        num_replicas, rank = self._replicas
        dist = torch.distributed
        if (num_replicas is None or rank is None) and dist.is_available() and dist.is_initialized():
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        return resolve_replicas(num_replicas, rank)

    @property
    def counts(self) -> dict[Any, int]:
        """Draws per epoch of every group (all ranks)."""
        return dict(zip(self.names, self._counts))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; the order is a pure function of (seed, epoch)."""
        self.epoch = _check_epoch(epoch)

    def _plain(self) -> bool:
        """``alpha == 1`` over one epoch of every structure: the plain shuffle."""
        return self.alpha == 1.0 and self.num_samples == sum(m.numel() for m in self.members)

    def _stream(self, k: int, start: int, count: int) -> torch.Tensor:
        """Items ``start .. start + count - 1`` of group ``k``'s endless stream."""
        members = self.members[k]
        n = members.numel()
        parts = []
        cycle, offset = divmod(start, n)
        while count > 0:
            if self.shuffle:
                order = torch.randperm(n, generator=_stream_generator(self.seed, k, cycle))
            else:
                order = torch.arange(n)
            take = min(count, n - offset)
            parts.append(members[order[offset : offset + take]])
            count -= take
            cycle, offset = cycle + 1, 0
        return torch.cat(parts) if parts else members[:0]

    def epoch_indices(self) -> torch.Tensor:
        """The whole epoch (all ranks) as indices."""
        if self._plain():
            n = self.num_samples
            if not self.shuffle:
                return torch.arange(n)
            return torch.randperm(n, generator=epoch_generator(self.seed, self.epoch))
        draws = torch.cat(
            [self._stream(k, self.epoch * c, c) for k, c in enumerate(self._counts) if c]
        )
        if self.shuffle:
            draws = draws[
                torch.randperm(draws.numel(), generator=epoch_generator(self.seed, self.epoch))
            ]
        return draws

    def __iter__(self) -> Iterator[int]:
        return iter(
            shard(self.epoch_indices(), self.num_replicas, self.rank, self.drop_last).tolist()
        )

    def __len__(self) -> int:
        return shard_count(self.num_samples, self.num_replicas, self.drop_last)

    def __repr__(self) -> str:
        shares = ", ".join(f"{n}: {c}" for n, c in self.counts.items())
        return f"GroupBalancedSampler(alpha={self.alpha}, draws per epoch {{{shares}}})"
