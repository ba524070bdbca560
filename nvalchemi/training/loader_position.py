"""Where a data loader is in its epoch, and how a resumed run gets back there exactly.

A loader's batch order is decided when its epoch is opened (``iter(loader)``): torch's
``DataLoader(shuffle=True)`` draws a permutation (and its workers' base seed) from its
``generator`` if it has one, else from the global torch RNG; ``RandomSampler(generator=...)``
and friends draw from theirs; ``DistributedSampler`` and this package's samplers compute
it from ``(seed, epoch)``. So the training loop records, when it opens an epoch, the state
of every random generator the loader can draw from (:func:`capture`), and a checkpoint
stores that record with the current generator states. A resumed run replays the record
before opening the interrupted epoch, skips the consumed batches and continues with the
same order (:func:`replay`); a run resumed between epochs just continues the generators.

Loaders whose order cannot be reproduced this way (an ``IterableDataset``, a plain
iterator, an unknown sampler) get a warning naming them at resume (:func:`order_problem`);
nothing diverges silently.

>>> import torch
>>> from torch.utils.data import DataLoader
>>> loader = DataLoader(list(range(6)), batch_size=2, shuffle=True,
...                     generator=torch.Generator().manual_seed(1))
>>> record = capture(loader, epoch=0)
>>> first = [b.tolist() for b in loader]
>>> with replay(loader, record):
...     again = [b.tolist() for b in loader]
>>> again == first
True
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

__all__ = [
    "capture",
    "decode",
    "encode",
    "generators",
    "order_problem",
    "replay",
    "restore_generators",
]

_KNOWN_SAMPLERS = (
    SequentialSampler,
    RandomSampler,
    DistributedSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)


def generators(loader: Any) -> list[torch.Generator]:
    """The CPU ``torch.Generator`` objects ``loader`` (or its samplers) draws its order from."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    owners = (loader, getattr(loader, "sampler", None), batch_sampler)
    found = [
        getattr(obj, "generator", None)
        for obj in (*owners, getattr(batch_sampler, "sampler", None))
    ]
    unique = {id(g): g for g in found if isinstance(g, torch.Generator) and g.device.type == "cpu"}
    return list(unique.values())


def capture(loader: Any, epoch: int) -> dict[str, Any]:
    """The generator states ``loader``'s next ``iter()`` will draw from (cheap, no device sync)."""
    return {
        "epoch": int(epoch),
        "torch": torch.get_rng_state(),
        "generators": [g.get_state() for g in generators(loader)],
    }


@contextlib.contextmanager
def replay(loader: Any, record: Mapping[str, Any]) -> Iterator[None]:
    """Open the epoch of ``record`` as it was opened: inside the block the loader's generators
    and the global torch RNG hold their recorded states; afterwards the global RNG is back to
    its current state (the loader's own generators keep what the replayed epoch drew)."""
    current = torch.get_rng_state()
    torch.set_rng_state(record["torch"])
    restore_generators(loader, record.get("generators") or [])
    try:
        yield
    finally:
        torch.set_rng_state(current)


def restore_generators(loader: Any, states: list[torch.Tensor]) -> None:
    """Set ``loader``'s generators to ``states`` (in :func:`generators` order)."""
    for gen, state in zip(generators(loader), states):
        gen.set_state(state)


def order_problem(loader: Any) -> str | None:
    """Why resuming mid-epoch may not give ``loader``'s original order, or ``None`` if it will."""
    if isinstance(loader, (list, tuple)) or callable(getattr(loader, "set_epoch_step", None)):
        return None
    if not isinstance(loader, torch.utils.data.DataLoader):
        return (
            f"a {type(loader).__name__} gives no way to reproduce its order (use a list of "
            "batches, torch's DataLoader or nvalchemi's DataLoader)"
        )
    if isinstance(loader.dataset, IterableDataset):
        return "its IterableDataset decides the order itself"
    batch_sampler = loader.batch_sampler
    sampler = batch_sampler.sampler if isinstance(batch_sampler, BatchSampler) else batch_sampler
    if isinstance(sampler, _KNOWN_SAMPLERS) or type(sampler).__module__.startswith("nvalchemi."):
        return None
    return f"its sampler {type(sampler).__qualname__} is not one whose order is known to replay"


def encode(record: Mapping[str, Any], now: list[torch.Tensor]) -> dict[str, Any]:
    """JSON form of ``record`` and of the loader's current generator states ``now``."""
    return {
        "epoch": record["epoch"],
        "torch": _to_b64(record["torch"]),
        "generators": [_to_b64(s) for s in record["generators"]],
        "generators_now": [_to_b64(s) for s in now],
    }


def decode(value: Any) -> dict[str, Any] | None:
    """Inverse of :func:`encode` (``ValueError`` for a malformed record)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("epoch"), int):
        raise ValueError(f"runtime_state['loader_position'] is malformed: {value!r:.80}.")
    return {
        "epoch": value["epoch"],
        "torch": _from_b64(value["torch"]),
        "generators": [_from_b64(s) for s in value.get("generators") or []],
        "generators_now": [_from_b64(s) for s in value.get("generators_now") or []],
    }


def _to_b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _from_b64(text: Any) -> torch.Tensor:
    try:
        raw = base64.b64decode(text, validate=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"runtime_state['loader_position'] holds a malformed RNG state: {exc}"
        ) from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
