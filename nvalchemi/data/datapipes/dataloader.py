"""The batch ``DataLoader``: exact, seekable, optionally multi-process.

Index lists are always produced in the main process, from ``batch_sampler`` or
from ``sampler`` grouped by ``batch_size``; so sharding, shuffling and seeking
(``set_epoch_step``) are exact and identical with or without workers. Batches
are then loaded

* in-process (``num_workers=0``) with ``dataset.load_batches(window)``, one
  call (and one reader call) per window of ``prefetch_factor`` batches, or
  ``collate_fn([dataset[i] ...])`` for other map-style datasets; or
* by ``num_workers`` worker processes, each loading, transforming and collating
  whole windows of batches (per-structure transforms such as neighbour lists run
  in parallel), delivered in order.

Workers pay off when building a batch costs more than shipping it: the main process
spends about 12 microseconds per structure receiving and unpacking (a worker task
holds at least 64 structures, so the fixed cost of a task is spread thin). Reading a
zarr store of a million 32-atom structures costs a worker about 90 microseconds per
structure, so each worker adds about 11,000 structures/s, up to the cores the machine
has (on two cores: 13,300/s in-process, 11,100/s with one worker, 17,900/s with two).
Neighbour lists computed on the fly, text formats and augmentation gain more.

The default sampler shuffles (``shuffle=True``) as a pure function of ``(seed,
epoch)``; the global RNG is never used, so a resumed run sees the same batches.
Call ``set_epoch(epoch)`` before each epoch to reshuffle (iterating twice in the
same epoch repeats the order), and ``set_epoch_step(k)`` to make the next pass
start at batch ``k`` without loading the skipped batches.

Example:
    >>> import torch
    >>> from nvalchemi.data import AtomicData
    >>> from nvalchemi.data.datapipes import DataLoader, InMemoryDataset
    >>> data = [AtomicData(atomic_numbers=torch.tensor([1] * (i + 1)),
    ...                    positions=torch.zeros(i + 1, 3)) for i in range(5)]
    >>> loader = DataLoader(InMemoryDataset(data_list=data), batch_size=2)
    >>> [b.num_nodes_list for b in loader]
    [[1, 2], [3, 4], [5]]
    >>> loader.set_epoch_step(2)
    >>> [b.num_nodes_list for b in loader]
    [[5]]
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from nvalchemi.data.atomic_data import AtomicData
from nvalchemi.data.batch import Batch
from nvalchemi.data.datapipes.dataset import batch_transforms_of
from nvalchemi.data.datapipes.multidataset import load_child_batches
from nvalchemi.data.datapipes.samplers import ShuffleSampler
from nvalchemi.data.transforms import Compose

__all__ = ["DataLoader", "load_batches"]


def load_batches(
    dataset: Any,
    window: Sequence[list[int]],
    collate_fn: Callable | None = None,
    batch_transforms: Compose | None = None,
    device: Any = None,
) -> list[Batch]:
    """Load, collate and transform a window of batches (one loader step or worker task).

    Datasets with ``load_batches`` get the whole window in one call (one reader
    call for all of it); others are read item by item and collated.
    """
    if collate_fn is None and callable(getattr(dataset, "load_batches", None)):
        batches = load_child_batches(dataset, [list(b) for b in window], device)
    else:
        batches = []
        for indices in window:
            items = [dataset[i] for i in indices]
            # reference-style datasets return (AtomicData, metadata) pairs
            items = [
                it[0] if isinstance(it, tuple) and it and isinstance(it[0], AtomicData) else it
                for it in items
            ]
            batches.append(
                collate_fn(items) if collate_fn is not None else Batch.from_data_list(items)
            )
    if batch_transforms is not None:
        batches = [batch_transforms(b) for b in batches]
    return batches


def _windows(plan: Iterator[list[int]], size: int) -> Iterator[tuple[list[int], ...]]:
    while True:
        window = tuple(itertools.islice(plan, size))
        if not window:
            return
        yield window


# A worker task (a window of batches) has a fixed cost, about 0.6 ms of the worker's CPU
# and 0.15 ms of the main process's (the pool's queues, pickling, waking threads); tasks
# of at least this many structures make that a few microseconds per structure (worker
# CPU per structure 116 -> 88 us, the main process's 19 -> 12 us at batch size 8).
_TASK_STRUCTURES = 64
_ALIGN = 16  # bytes; every packed tensor starts at a multiple of its element size
_NARROW = (torch.int8, torch.int16, torch.int32)
_NARROW_MIN_NUMEL = 1024  # below this, narrowing saves too little to pay for min/max


def _narrowest(t: torch.Tensor) -> torch.dtype:
    """The smallest integer dtype holding every value of ``t`` (int tensors only)."""
    if t.numel() < _NARROW_MIN_NUMEL or t.dtype not in (torch.int64, torch.int32):
        return t.dtype
    low, high = (int(v) for v in torch.aminmax(t))
    for dtype in _NARROW:
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype if dtype.itemsize < t.dtype.itemsize else t.dtype
    return t.dtype


class _Packed:
    """A batch flattened into one byte buffer for the trip from a worker.

    Torch sends every tensor of a worker's result through its own shared-memory
    segment, whose file descriptor the main process must fetch from a helper
    thread of the (busy) worker: that costs more than loading a small batch.
    Packed, a batch travels as one byte string through the result pipe. Integer
    tensors travel in the narrowest dtype that holds their values (edge indices
    and lattice shifts of a batch fit in 16 and 8 bits: ~6x fewer bytes) and are
    widened on arrival; other tensors are zero-copy views of the received buffer.
    """

    __slots__ = ("buffer", "layout", "skeleton")

    def __init__(self, obj: Any) -> None:
        tensors: list[torch.Tensor] = []
        state = {k: v for k, v in obj.__getstate__().items() if not _holds_weakref(v)}
        self.skeleton = _strip(state, tensors)
        self.layout = []
        offset = 0
        for t in tensors:
            sent = _narrowest(t)
            self.layout.append((t.dtype, sent, tuple(t.shape), offset))
            offset += -(-t.numel() * sent.itemsize // _ALIGN) * _ALIGN
        self.buffer = torch.empty(offset, dtype=torch.uint8)
        for t, (_, sent, _, start) in zip(tensors, self.layout):
            nbytes = t.numel() * sent.itemsize
            if nbytes:
                flat = t.detach().reshape(-1).to(sent).contiguous().view(torch.uint8)
                self.buffer[start : start + nbytes].copy_(flat)

    def __getstate__(self) -> tuple:
        return self.buffer.numpy().tobytes(), self.layout, self.skeleton

    def __setstate__(self, state: tuple) -> None:
        raw, self.layout, self.skeleton = state
        self.buffer = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            if raw
            else (torch.empty(0, dtype=torch.uint8))
        )

    def pin_memory(self) -> _Packed:
        self.buffer = self.buffer.pin_memory()
        return self

    def unpack(self, cls: type) -> Any:
        tensors = []
        pinned = self.buffer.is_pinned() if torch.cuda.is_available() else False
        for dtype, sent, shape, start in self.layout:
            count = 1
            for n in shape:
                count *= n
            raw = self.buffer[start : start + count * sent.itemsize].view(sent).reshape(shape)
            if sent != dtype:  # widen, into pinned memory when the buffer was pinned
                raw = torch.empty(shape, dtype=dtype, pin_memory=pinned).copy_(raw)
            tensors.append(raw)
        out = cls.__new__(cls)
        out.__setstate__(_fill(self.skeleton, iter(tensors)))
        return out


class _TensorSlot:
    """Placeholder for a packed tensor inside a stripped state."""


_SLOT = _TensorSlot()


def _holds_weakref(value: Any) -> bool:
    """Process-local bookkeeping (e.g. "list built from this positions tensor")."""
    if isinstance(value, weakref.ref):
        return True
    if type(value) in (tuple, list):
        return any(isinstance(v, weakref.ref) for v in value)
    return False


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _SLOT
    if type(value) is dict:
        return {k: _strip(v, tensors) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_strip(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: Iterator[torch.Tensor]) -> Any:
    if isinstance(value, _TensorSlot):
        return next(tensors)
    if type(value) is dict:
        return {k: _fill(v, tensors) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_fill(v, tensors) for v in value)
    return value


class _BatchJobs(torch.utils.data.Dataset):
    """Worker-side view: item ``window`` (index lists) is those batches, collated and packed."""

    def __init__(self, dataset, collate_fn, batch_transforms) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.batch_transforms = batch_transforms

    def __getitem__(self, window: tuple[list[int], ...]) -> list[Any]:
        batches = load_batches(
            self.dataset, window, self.collate_fn, self.batch_transforms, device="cpu"
        )
        return [_Packed(b) if type(b) is Batch else b for b in batches]


class _PlanFeed(Sampler):
    """The worker pool's sampler: hands out the index lists of the current pass.

    ``plan`` is one iterator; torch may call ``iter()`` on the sampler more than
    once per pass and every call must continue the same pass.
    """

    def __init__(self) -> None:
        self.plan: Iterator[list[int]] = iter(())

    def __iter__(self) -> Iterator[list[int]]:
        return self.plan


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    """Run torch ops on one thread, as torch's own loader workers do.

    Loading touches many small tensors; fanning an op out to OpenMP threads costs
    more than it saves, and milliseconds per op when the other cores are busy
    (with our workers, other ranks or other jobs). The thread count is global, so
    it is only changed when loading runs on the main thread (a loader iterated
    from a helper thread must not slow down a model running on the main one).
    """
    threads = torch.get_num_threads()
    if threads == 1 or threading.current_thread() is not threading.main_thread():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _identity(batch: Any) -> Any:
    return batch


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"DataLoader: {name} must be an integer; got {value!r}.")
    if value < minimum:
        raise ValueError(f"DataLoader: {name} must be >= {minimum}; got {value}.")
    return int(value)


class DataLoader:
    """Iterate a dataset in ``Batch`` es.

    Args:
        dataset: a map-style dataset: ours (``Dataset``, ``InMemoryDataset``,
            ``MultiDataset``, which load whole batches at once) or any object with
            ``__len__`` and ``__getitem__`` returning ``AtomicData``.
        batch_size: structures per batch (with ``sampler``/default sampler).
        shuffle: shuffle with the default, seeded sampler.
        drop_last: drop the last incomplete batch.
        sampler: yields structure indices (e.g. ``DistributedSampler``).
        batch_sampler: yields lists of indices; excludes ``sampler``, ``shuffle``
            and ``drop_last``.
        seed: seed of the default sampler's shuffling.
        num_workers: worker processes loading whole batches (0: in-process).
        prefetch_factor: batches loaded together: in-process, per
            ``load_batches`` call (one reader call); with workers, per worker
            task (at least 64 structures' worth of batches of ``batch_size``),
            with two tasks in flight per worker (fewer, larger messages between
            processes). 0 behaves like 1.
        persistent_workers: keep the workers between passes (keeps their caches).
        pin_memory: pin batches for fast host-to-device copies (CUDA only).
        collate_fn: ``list[AtomicData] -> Batch``; when given, items are fetched
            with ``dataset[i]`` instead of ``load_batches``.
        batch_transforms: sequence of batch transforms applied to each batch
            where it is collated (in the worker when ``num_workers > 0``).
        multiprocessing_context, timeout, worker_init_fn: passed to the worker pool.
        num_streams, use_streams: accepted for compatibility; unused.

    Attributes ``dataset``, ``batch_size``, ``sampler``, ``batch_sampler``,
    ``drop_last`` (and the others) are public and may be reassigned, e.g. by a
    DDP hook installing a distributed batch sampler.

    Raises:
        ValueError: ``batch_size < 1``, ``prefetch_factor < 0``, ``num_workers <
            0``, ``batch_sampler`` with ``sampler``/``shuffle``/``drop_last``,
            ``sampler`` with ``shuffle``, ``persistent_workers`` without workers,
            an empty dataset.
        TypeError: non-sequence ``batch_transforms``, non-callable ``collate_fn``,
            a dataset without ``__len__``.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        sampler: Any = None,
        batch_sampler: Any = None,
        seed: int = 0,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        persistent_workers: bool = False,
        pin_memory: bool = False,
        collate_fn: Callable | None = None,
        batch_transforms: Sequence[Callable] | None = None,
        multiprocessing_context: Any = None,
        timeout: float = 0.0,
        worker_init_fn: Callable | None = None,
        num_streams: int = 4,
        use_streams: bool = True,
    ) -> None:
        batch_size = _check_int("batch_size", batch_size, 1)
        num_workers = _check_int("num_workers", num_workers, 0)
        prefetch_factor = _check_int("prefetch_factor", prefetch_factor, 0)
        if batch_sampler is not None and (sampler is not None or shuffle or drop_last):
            raise ValueError(
                "DataLoader: batch_sampler excludes sampler, shuffle and drop_last; configure "
                "those on the batch sampler."
            )
        if sampler is not None and shuffle:
            raise ValueError(
                "DataLoader: shuffle=True with a custom sampler; let the sampler shuffle."
            )
        if persistent_workers and num_workers == 0:
            raise ValueError("DataLoader: persistent_workers=True needs num_workers > 0.")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"DataLoader: collate_fn must be callable; got {collate_fn!r}.")
        try:
            size = len(dataset)
        except TypeError:
            raise TypeError(
                f"DataLoader needs a map-style dataset with __len__; got {type(dataset).__name__}."
            ) from None
        if size == 0:
            raise ValueError(f"DataLoader: the dataset is empty ({dataset!r}).")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.seed = int(seed)
        self.batch_sampler = batch_sampler
        if batch_sampler is not None:
            self.sampler = None
        elif sampler is not None:
            self.sampler = sampler
        else:
            self.sampler = ShuffleSampler(dataset, seed=self.seed, shuffle=self.shuffle)
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = bool(persistent_workers)
        self.pin_memory = bool(pin_memory)
        self.collate_fn = collate_fn
        self.batch_transforms = batch_transforms_of(batch_transforms, "DataLoader")
        self.multiprocessing_context = multiprocessing_context
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.num_streams = num_streams
        self.use_streams = bool(use_streams) and torch.cuda.is_available()
        self._epoch = 0
        self._pending_skip: int | None = None
        self._yielded = 0
        self._pool: torch.utils.data.DataLoader | None = None
        self._pool_key: tuple | None = None
        self._feed = _PlanFeed()

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        """Batches per pass (ignores a pending ``set_epoch_step``)."""
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        n = len(self.sampler) if self.sampler is not None else len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    # ------------------------------------------------------------ epoch/seek
    def _epoch_targets(self) -> list[Any]:
        candidates = [
            self.batch_sampler,
            getattr(self.batch_sampler, "sampler", None),
            self.sampler,
        ]
        seen, out = set(), []
        for c in candidates:
            if c is not None and id(c) not in seen and callable(getattr(c, "set_epoch", None)):
                seen.add(id(c))
                out.append(c)
        return out

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch: forwarded to the first of ``batch_sampler``,
        ``batch_sampler.sampler`` and ``sampler`` that has ``set_epoch``."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"DataLoader.set_epoch: epoch must be an integer >= 0; got {epoch!r}.")
        self._epoch = int(epoch)
        targets = self._epoch_targets()
        if targets:
            targets[0].set_epoch(self._epoch)

    @property
    def epoch(self) -> int:
        """The current epoch (read from the sampler when it tracks one)."""
        targets = self._epoch_targets()
        value = getattr(targets[0], "epoch", None) if targets else None
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        return self._epoch

    def set_epoch_step(self, step: int) -> None:
        """Make the next pass start at batch ``step`` of the epoch.

        The skipped index lists are generated (so the sampler's order is
        unchanged) but not loaded. One-shot: applies to the next pass only.
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(
                f"DataLoader.set_epoch_step: step must be an integer >= 0; got {step!r}."
            )
        self._pending_skip = int(step)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "epoch_step", "seed"}``: the position inside the current epoch.

        ``epoch_step`` counts batches of this epoch already handed out (including
        skipped ones), or the pending ``set_epoch_step`` if a pass has not started.
        """
        step = self._pending_skip if self._pending_skip is not None else self._yielded
        return {"epoch": self.epoch, "epoch_step": step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`: the next pass resumes where it left off."""
        missing = {"epoch", "epoch_step"} - set(state)
        if missing:
            raise KeyError(f"DataLoader.load_state_dict: missing keys {sorted(missing)}.")
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(
                f"DataLoader.load_state_dict: the state was saved with seed={state['seed']} but "
                f"this loader has seed={self.seed}; build the loader with the same seed."
            )
        self.set_epoch(int(state["epoch"]))
        self.set_epoch_step(int(state["epoch_step"]))

    # -------------------------------------------------------------- iteration
    def index_batches(self) -> Iterator[list[int]]:
        """The index lists of one pass (from the batch sampler or grouped sampler)."""
        if self.batch_sampler is not None:
            for indices in self.batch_sampler:
                yield [int(i) for i in indices]
            return
        sampler = self.sampler if self.sampler is not None else range(len(self.dataset))
        batch: list[int] = []
        for index in sampler:
            batch.append(int(index))
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __iter__(self) -> Iterator[Batch]:
        skip = self._pending_skip or 0
        self._pending_skip = None
        self._yielded = skip
        plan = self.index_batches()
        if skip:
            plan = itertools.islice(plan, skip, None)
        source = self._iter_workers(plan) if self.num_workers > 0 else self._iter_local(plan)
        return self._counted(source)

    def _counted(self, source: Iterator[Batch]) -> Iterator[Batch]:
        for batch in source:
            self._yielded += 1
            yield batch

    def _iter_local(self, plan: Iterator[list[int]]) -> Iterator[Batch]:
        pin = self.pin_memory and torch.cuda.is_available()
        for window in _windows(plan, max(self.prefetch_factor, 1)):
            with _single_threaded():
                batches = load_batches(self.dataset, window, self.collate_fn, self.batch_transforms)
            for batch in batches:
                if pin and batch.device.type == "cpu":
                    batch = batch.pin_memory()
                yield batch

    def _worker_pool(self) -> torch.utils.data.DataLoader:
        key = (
            id(self.dataset),
            id(self.collate_fn),
            id(self.batch_transforms),
            self.num_workers,
            self.prefetch_factor,
            self.pin_memory,
            id(self.multiprocessing_context),
            self.timeout,
            id(self.worker_init_fn),
        )
        if self._pool is not None and self.persistent_workers and key == self._pool_key:
            return self._pool
        self._pool = torch.utils.data.DataLoader(
            _BatchJobs(self.dataset, self.collate_fn, self.batch_transforms),
            batch_size=None,
            sampler=self._feed,
            num_workers=self.num_workers,
            collate_fn=_identity,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            prefetch_factor=2,  # tasks (windows of batches) in flight per worker
            persistent_workers=self.persistent_workers,
            multiprocessing_context=self.multiprocessing_context,
            timeout=self.timeout,
            worker_init_fn=self.worker_init_fn,
            # the workers' base seed comes from here, not from the global RNG
            generator=torch.Generator().manual_seed(self.seed),
        )
        self._pool_key = key
        return self._pool

    def _task_batches(self) -> int:
        """Batches per worker task: ``prefetch_factor``, more for small batches."""
        batches = max(self.prefetch_factor, 1)
        if self.batch_sampler is None:
            batches = max(batches, -(-_TASK_STRUCTURES // self.batch_size))
        return batches

    def _iter_workers(self, plan: Iterator[list[int]]) -> Iterator[Batch]:
        pool = self._worker_pool()
        self._feed.plan = _windows(plan, self._task_batches())
        target = getattr(self.dataset, "target_device", None)
        iterator = iter(pool)
        try:
            for window in iterator:
                for batch in window:
                    if isinstance(batch, _Packed):
                        with _single_threaded():
                            batch = batch.unpack(Batch)
                    if target is not None and batch.device != target:
                        batch = batch.to(target, non_blocking=True)
                    yield batch
        finally:
            if not self.persistent_workers:
                shutdown = getattr(iterator, "_shutdown_workers", None)
                if callable(shutdown):
                    shutdown()

    def __repr__(self) -> str:
        return (
            f"DataLoader(batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"num_workers={self.num_workers}, len={len(self)}, dataset={self.dataset!r})"
        )
