"""``SizeBalancedBatchSampler``: distributed batches with equal work on every rank.

Round-robin sharding deals structures of 4 and 128 atoms alike, so under data
parallelism one rank often waits for another at every gradient all-reduce. This
sampler forms each global step from ``batch_size * num_replicas`` shuffled
structures and splits them so that every rank gets ``batch_size`` structures with
nearly the same total number of atoms (greedy longest-processing-time assignment).
Every rank computes the same split from ``(seed, epoch)``, so no communication is
needed, and with one process it is a seeded batch sampler.

Example:
    >>> sampler = SizeBalancedBatchSampler(
    ...     [4, 128, 8, 120, 16, 100, 32, 64], batch_size=2, num_replicas=2, rank=0,
    ...     shuffle=False)
    >>> [sum([4, 128, 8, 120, 16, 100, 32, 64][i] for i in b) for b in sampler]
    [132, 116]

    Rank 1 gets 128 and 96 atoms; round-robin would give rank 0 (4 + 8, 16 + 32) and
    rank 1 (128 + 120, 100 + 64).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from nvalchemi.data.datapipes.samplers import epoch_generator

__all__ = ["SizeBalancedBatchSampler"]


def _sizes_of(dataset: Any) -> list[int]:
    """Atom count of every structure: from ``get_metadata`` when cheap, else by loading."""
    if isinstance(dataset, Sequence) and all(isinstance(s, int) for s in dataset[:1]):
        return [int(s) for s in dataset]
    get_metadata = getattr(dataset, "get_metadata", None)
    if callable(get_metadata):
        return [int(get_metadata(i)[0]) for i in range(len(dataset))]
    return [int(dataset[i].num_nodes) for i in range(len(dataset))]


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    dist = torch.distributed
    ready = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if ready else 1
    if rank is None:
        rank = dist.get_rank() if ready else 0
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(
            f"SizeBalancedBatchSampler: need num_replicas >= 1 and 0 <= rank < num_replicas; "
            f"got num_replicas={num_replicas}, rank={rank}."
        )
    return int(num_replicas), int(rank)


class SizeBalancedBatchSampler(Sampler[list[int]]):
    """Per-rank batches of ``batch_size`` structures, balanced by atom count across ranks.

    Args:
        dataset: a dataset (sizes from ``get_metadata(i)[0]`` or ``dataset[i].num_nodes``)
            or a sequence of atom counts.
        batch_size: structures per rank and step.
        num_replicas / rank: default from ``torch.distributed`` when initialised, else 1 / 0.
        shuffle: reshuffle every epoch (order is a function of ``seed`` and the epoch).
        seed: shuffle seed; identical on every rank.
        drop_last: drop the last incomplete global step instead of padding it with
            structures from the start of the epoch.

    It satisfies the distributed-sampler protocol (``num_replicas``, ``rank``,
    ``set_epoch``), so ``DDPHook`` leaves a loader that uses it untouched.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}.")
        self.sizes = torch.as_tensor(_sizes_of(dataset), dtype=torch.int64)
        if len(self.sizes) == 0:
            raise ValueError("SizeBalancedBatchSampler needs a non-empty dataset.")
        self.batch_size = batch_size
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle of ``epoch`` (call it with the same value on every rank)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        per_step = self.batch_size * self.num_replicas
        n = len(self.sizes)
        return n // per_step if self.drop_last else math.ceil(n / per_step)

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.sizes)
        if self.shuffle:
            order = torch.randperm(n, generator=epoch_generator(self.seed, self.epoch))
        else:
            order = torch.arange(n)
        per_step = self.batch_size * self.num_replicas
        total = len(self) * per_step
        if total > n:
            order = torch.cat([order, order.repeat(math.ceil(total / n))])
        order = order[:total].view(-1, per_step)
        for step in order:
            yield self._split(step)[self.rank]

    def _split(self, step: torch.Tensor) -> list[list[int]]:
        """Largest structures first, each to the rank with the fewest atoms and room left."""
        sizes = self.sizes[step].tolist()
        indices = step.tolist()
        loads = [0] * self.num_replicas
        batches: list[list[int]] = [[] for _ in range(self.num_replicas)]
        for k in sorted(range(len(indices)), key=lambda k: -sizes[k]):
            rank = min(
                (r for r in range(self.num_replicas) if len(batches[r]) < self.batch_size),
                key=lambda r: loads[r],
            )
            batches[rank].append(indices[k])
            loads[rank] += sizes[k]
        return batches

    def __repr__(self) -> str:
        return (
            f"SizeBalancedBatchSampler(n={len(self.sizes)}, batch_size={self.batch_size}, "
            f"num_replicas={self.num_replicas}, rank={self.rank}, shuffle={self.shuffle})"
        )
