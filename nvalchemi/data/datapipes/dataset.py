"""Map-style datasets of atomic structures that also load whole batches.

* :class:`Dataset` wraps a reader (anything with ``read_many``/``read`` and
  ``__len__``) and turns its raw tensors into :class:`~nvalchemi.data.AtomicData`,
  applying per-structure transforms on every path (single items and batches).
* :class:`InMemoryDataset` keeps everything in one resident :class:`Batch` and
  serves batches by ``index_select`` (transforms run once, when it is built).

``dataset[i]`` returns an ``AtomicData``, so a plain
``torch.utils.data.DataLoader(dataset, collate_fn=Batch.from_data_list)`` works;
``dataset.get_with_metadata(i)`` returns the ``(AtomicData, metadata)`` pair;
``dataset.load_batches([[0, 1], [2, 3]])`` returns collated batches (what
:class:`~nvalchemi.data.datapipes.DataLoader` calls).

Example:
    >>> import torch
    >>> from nvalchemi.data import AtomicData
    >>> from nvalchemi.data.datapipes.dataset import InMemoryDataset
    >>> data = [AtomicData(atomic_numbers=torch.tensor([1] * (i + 1)),
    ...                    positions=torch.zeros(i + 1, 3)) for i in range(4)]
    >>> ds = InMemoryDataset(data_list=data)
    >>> len(ds), ds[2].num_nodes, ds.get_batch([3, 0]).num_nodes_list
    (4, 3, [4, 1])
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from nvalchemi.data.atomic_data import AtomicData
from nvalchemi.data.batch import Batch
from nvalchemi.data.datapipes.reader import ReaderProtocol
from nvalchemi.data.transforms import Compose

# ReaderProtocol is re-exported (the reference's import path)
__all__ = ["BatchDatasetProtocol", "Dataset", "InMemoryDataset", "ReaderProtocol"]


@runtime_checkable
class BatchDatasetProtocol(Protocol):
    """A dataset the nvalchemi ``DataLoader`` and ``MultiDataset`` can batch.

    ``dataset[i]`` is one ``AtomicData``; ``load_batches(lists)`` returns one
    ``Batch`` per index list, in order; ``get_metadata(i)`` is ``(num_atoms,
    num_edges)`` of structure ``i``.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> AtomicData: ...

    def load_batches(self, batch_index_lists: Sequence[Sequence[int]]) -> list[Batch]: ...

    def get_metadata(self, index: int) -> tuple[int, int]: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------- helpers
def resolve_device(device: Any) -> torch.device | None:
    """``None`` -> ``None`` (keep); ``"auto"`` -> cuda if available else cpu."""
    if device is None:
        return None
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, (str, torch.device)):
        return torch.device(device)
    raise TypeError(
        f"device must be None, 'auto', a string or a torch.device; got {type(device).__name__}."
    )


def sample_transforms(transforms: Any, owner: str) -> Compose | None:
    """A sample ``Compose`` from a sequence of callables (``None``/empty -> None)."""
    if transforms is None:
        return None
    if not isinstance(transforms, (Sequence, Compose)) or isinstance(transforms, str):
        raise TypeError(
            f"{owner}: transforms must be a Sequence of callables (e.g. a list); got "
            f"{type(transforms).__name__}. Wrap a single transform in a list."
        )
    compose = transforms if isinstance(transforms, Compose) else Compose(transforms)
    if compose.is_batch:
        raise TypeError(
            f"{owner}: transforms holds batch transforms; pass them as the DataLoader's "
            "batch_transforms (or InMemoryDataset's batch_transforms) instead."
        )
    return compose if compose.transforms else None


def batch_transforms_of(transforms: Any, owner: str) -> Compose | None:
    """A batch ``Compose`` from a sequence of callables (``None``/empty -> None)."""
    if transforms is None:
        return None
    if not isinstance(transforms, (Sequence, Compose)) or isinstance(transforms, str):
        raise TypeError(
            f"{owner}: batch_transforms must be a Sequence of callables (e.g. a list); got "
            f"{type(transforms).__name__}. Wrap a single transform in a list."
        )
    compose = transforms if isinstance(transforms, Compose) else Compose(transforms)
    if compose.kind == "sample":
        raise TypeError(
            f"{owner}: batch_transforms holds sample transforms (first parameter annotated "
            "AtomicData); pass them as the Dataset's transforms instead."
        )
    return compose if compose.transforms else None


def check_index(index: Any, length: int, source: Any) -> int:
    """``index`` as a non-negative int, or ``IndexError`` naming the source."""
    if isinstance(index, torch.Tensor) and index.dim() == 0:
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise TypeError(f"Index must be an integer; got {type(index).__name__} ({index!r}).")
    index = int(index)
    if not -length <= index < length:
        raise IndexError(f"Index {index} is out of range for {source!r} with {length} structures.")
    return index % length


def flat_indices(batch_index_lists: Sequence[Sequence[int]], length: int, source: Any):
    """All requested indices as one list of non-negative ints, range-checked at once."""
    flat: list[int] = []
    for indices in batch_index_lists:
        if isinstance(indices, torch.Tensor):
            indices = indices.reshape(-1).tolist()
        elif isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
            raise TypeError(
                f"Each batch must be a sequence of integer indices; got {type(indices).__name__}."
            )
        flat.extend(int(i) for i in indices)
    if flat:
        low, high = min(flat), max(flat)
        if low < -length or high >= length:
            bad = low if low < -length else high
            raise IndexError(
                f"Index {bad} is out of range for {source!r} with {length} structures."
            )
        if low < 0:
            flat = [i % length for i in flat]
    return flat


def _split_batch_neighbors(compose: Compose | None) -> tuple[Compose | None, Any]:
    """``(per-sample part, neighbour-list transform run on collated batches)``.

    An uncached ``NeighborListTransform`` at the end of the transforms builds the
    lists of a whole batch in one pass (the same lists, several times faster than
    one vesin call per structure); with a cache it stays per sample (its cache is
    keyed by sample).
    """
    from nvalchemi.data.neighbors import NeighborListTransform

    if compose is None:
        return None, None
    last = compose.transforms[-1]
    if type(last) is not NeighborListTransform or last.cache:
        return compose, None
    rest = compose.transforms[:-1]
    return (Compose(rest) if rest else None), last


class _SampleNames:
    """``names[g]``: how errors name structure ``g`` of a batch (built only when asked)."""

    def __init__(self, source: Any, metadata: list[dict]) -> None:
        self.source, self.metadata = source, metadata

    def __getitem__(self, g: int) -> str:
        meta = self.metadata[g]
        text = f"{self.source!r}, structure {meta.get('index')}"
        if meta.get("source_file"):
            text += f" ({meta['source_file']}"
            text += f", frame {meta['frame']})" if "frame" in meta else ")"
        return text


class _ChunkNames:
    def __init__(self, start: int) -> None:
        self.start = start

    def __getitem__(self, g: int) -> str:
        return f"structure {self.start + g}"


def _with_index_context(exc: Exception, index: int, source: Any) -> Exception:
    message = f"{source!r}, structure {index}: {exc}"
    if isinstance(exc, (ValueError, TypeError, KeyError, IndexError)):
        try:
            new = type(exc)(message)
        except Exception:  # exotic constructor
            new = RuntimeError(message)
    else:
        new = RuntimeError(message)
    new.__cause__ = exc
    return new


# ---------------------------------------------------------------------- Dataset
def _read_mode(reader: Any) -> str:
    """Which method reads structures: ``read_many``, ``read`` or ``_load_sample``."""
    for name in ("read_many", "read", "_load_sample"):
        if callable(getattr(reader, name, None)):
            if not hasattr(reader, "__len__"):
                raise TypeError(f"Dataset reader {type(reader).__name__} has no __len__.")
            return name
    raise TypeError(
        f"Dataset needs a reader with read_many(indices) (or read(index)) and __len__; got "
        f"{type(reader).__name__}."
    )


class Dataset(torch.utils.data.Dataset):
    """A map-style dataset over a reader, with per-structure transforms.

    Args:
        reader: yields raw structures: ``read_many(indices)`` returning
            ``[(dict_of_tensors_or_AtomicData, metadata_dict), ...]`` in request
            order (or ``read(index)``), plus ``__len__``; optional
            ``field_levels`` (levels of custom fields), ``get_metadata(i)`` and
            ``close()``.
        device: where returned structures and batches live. ``None`` keeps the
            reader's device (CPU); ``"auto"`` picks CUDA when available. Transforms
            and collation run on the reader's device; the batch is moved once.
        transforms: a sequence of sample transforms (see
            :class:`~nvalchemi.data.transforms.Compose`), applied to every
            structure on every path: ``dataset[i]``, ``get_with_metadata`` and
            ``load_batches``.
        skip_validation: build ``AtomicData`` without shape/dtype/finiteness
            checks. ``None`` (default) trusts readers that declare
            ``validates = True`` (they return already-validated fields) and
            validates everything else; ``False`` always validates.
        num_workers: accepted for compatibility and ignored; parallel loading is
            the ``DataLoader``'s ``num_workers``.

    ``dataset[i]`` returns an ``AtomicData``; the reader's metadata (with
    ``"index"``) is available through :meth:`get_with_metadata`.
    """

    def __init__(
        self,
        reader: Any,
        *,
        device: Any = None,
        transforms: Sequence[Callable] | None = None,
        skip_validation: bool | None = None,
        num_workers: int | None = None,
    ) -> None:
        self._read_mode = _read_mode(reader)
        self.reader = reader
        self.target_device = resolve_device(device)
        self.transforms = sample_transforms(transforms, "Dataset")
        if skip_validation is None:
            skip_validation = getattr(reader, "validates", False) is True
        self.skip_validation = bool(skip_validation)
        self.num_workers = num_workers
        self._field_levels = dict(getattr(reader, "field_levels", None) or {})
        self._field_names: list[str] | None = None

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        return len(self.reader)

    @property
    def transforms(self) -> Compose | None:
        """The sample transforms (a ``Compose``, or ``None``)."""
        return self._transforms

    @transforms.setter
    def transforms(self, value: Compose | None) -> None:
        self._transforms = value
        self._per_sample, self._batch_neighbors = _split_batch_neighbors(value)

    @property
    def pin_memory(self) -> bool:
        return bool(getattr(self.reader, "pin_memory", False))

    @pin_memory.setter
    def pin_memory(self, value: bool) -> None:
        if hasattr(self.reader, "pin_memory"):
            self.reader.pin_memory = bool(value)

    @property
    def field_names(self) -> list[str]:
        """Fields of the structures this dataset returns (after transforms)."""
        if self._field_names is None:
            if len(self) == 0:
                self._field_names = list(getattr(self.reader, "field_names", None) or [])
            elif self.transforms is None and getattr(self.reader, "field_names", None):
                self._field_names = list(self.reader.field_names)
            else:
                self._field_names = sorted(self._load([0])[0][0].keys())
        return list(self._field_names)

    # ---------------------------------------------------------------- samples
    def _to_data(self, raw: Any, index: int) -> AtomicData:
        if isinstance(raw, AtomicData):
            # a new container, so transforms that set fields leave the reader's copy alone
            return raw.model_copy()
        try:
            return AtomicData(
                **raw, field_levels=self._field_levels, validate=not self.skip_validation
            )
        except Exception as exc:
            raise _with_index_context(exc, index, self.reader) from exc

    def _read_many(self, indices: list[int]) -> list[tuple[Any, Any]]:
        reader = self.reader
        if self._read_mode == "read_many":
            return reader.read_many(indices)
        if self._read_mode == "read":
            return [reader.read(i) for i in indices]
        meta = getattr(reader, "_get_sample_metadata", None)
        return [(reader._load_sample(i), meta(i) if meta else {}) for i in indices]

    def _load(
        self, indices: list[int], compose: Compose | bool | None = True
    ) -> list[tuple[AtomicData, dict]]:
        """Read, build and transform structures (on the reader's device).

        ``compose``: the transforms to apply (``True``: all of them).
        """
        pairs = self._read_many(indices)
        if len(pairs) != len(indices):
            raise RuntimeError(
                f"{self.reader!r}.read_many returned {len(pairs)} structures for "
                f"{len(indices)} indices."
            )
        out = []
        if compose is True:
            compose = self.transforms
        for index, (raw, metadata) in zip(indices, pairs):
            data = self._to_data(raw, index)
            metadata = dict(metadata) if metadata else {}
            metadata.setdefault("index", index)
            if compose is not None:
                try:
                    data, metadata = compose(data, metadata)
                except Exception as exc:
                    raise _with_index_context(exc, index, self.reader) from exc
            out.append((data, metadata))
        return out

    def _move(self, data: Any, device: torch.device | None) -> Any:
        if device is None or data.device == device:
            return data
        return data.to(device, non_blocking=True)

    def __getitem__(self, index: int) -> AtomicData:
        return self.get_with_metadata(index)[0]

    def get_with_metadata(self, index: int) -> tuple[AtomicData, dict[str, Any]]:
        """Structure ``index`` and its metadata (reader metadata plus ``"index"``)."""
        index = check_index(index, len(self), self.reader)
        data, metadata = self._load([index])[0]
        return self._move(data, self.target_device), metadata

    def read_many(self, indices: Sequence[int]) -> list[tuple[AtomicData, dict[str, Any]]]:
        """``(AtomicData, metadata)`` pairs for ``indices``, in order (one reader call)."""
        flat = flat_indices([indices], len(self), self.reader)
        return [(self._move(d, self.target_device), m) for d, m in self._load(flat)]

    def __iter__(self) -> Iterator[AtomicData]:
        for i in range(len(self)):
            yield self[i]

    def get_metadata(self, index: int) -> tuple[int, int]:
        """``(num_atoms, num_edges)`` of structure ``index`` (cheap when the reader knows)."""
        index = check_index(index, len(self), self.reader)
        getter = getattr(self.reader, "get_metadata", None)
        if callable(getter) and self.transforms is None:
            return tuple(getter(index))
        data = self._load([index])[0][0]
        return data.num_nodes, data.num_edges

    # ---------------------------------------------------------------- batches
    def load_batches(
        self, batch_index_lists: Sequence[Sequence[int]], *, device: Any = None
    ) -> list[Batch]:
        """One ``Batch`` per index list, read with a single ``read_many`` call.

        ``device`` overrides the dataset's device for this call (the DataLoader's
        workers pass ``"cpu"``).
        """
        lists = [
            list(b) if not isinstance(b, torch.Tensor) else b.tolist() for b in batch_index_lists
        ]
        flat = flat_indices(lists, len(self), self.reader)
        if any(len(b) == 0 for b in lists):
            raise ValueError("load_batches got an empty batch; every batch needs an index.")
        samples = self._load(flat, self._per_sample)
        target = resolve_device(device) if device is not None else self.target_device
        out = []
        start = 0
        for indices in lists:
            part = samples[start : start + len(indices)]
            start += len(indices)
            batch = Batch.from_data_list(
                [d for d, _ in part], device=target, field_levels=self._field_levels
            )
            if self._batch_neighbors is not None:
                names = _SampleNames(self.reader, [m for _, m in part])
                self._batch_neighbors.apply_to_batch(batch, names)
            out.append(batch)
        return out

    def get_batch(self, indices: Sequence[int]) -> Batch:
        """One ``Batch`` of ``indices``."""
        return self.load_batches([indices])[0]

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the reader (if it can be closed)."""
        close = getattr(self.reader, "close", None)
        if callable(close):
            close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        device = self.target_device if self.target_device is not None else "reader"
        return f"Dataset(len={len(self)}, device={device}, reader={self.reader!r})"


# --------------------------------------------------------------- InMemoryDataset
class InMemoryDataset(torch.utils.data.Dataset):
    """All structures in one resident ``Batch``; batches are ``index_select`` views.

    Give exactly one source:

    Args:
        in_memory_batch: a ready ``Batch``.
        reader: a reader (as for :class:`Dataset`); read in chunks of
            ``chunk_size`` and closed afterwards, even on errors.
        data_list: a sequence of ``AtomicData``.
        chunk_size: structures per read/collate step when materialising.
        device: where emitted batches live (``None``: where the resident batch is;
            ``"auto"``: CUDA if available). The resident batch stays on CPU when
            built from a reader or list.
        skip_validation: as for :class:`Dataset` (reader source only).
        transforms: sample transforms, run **once** per structure while
            materialising (deterministic preprocessing such as neighbour lists;
            random augmentations belong in a :class:`Dataset` or in batch
            transforms of the loader).
        batch_transforms: batch transforms, run once on each materialised chunk
            (or once on ``in_memory_batch``).
    """

    def __init__(
        self,
        in_memory_batch: Batch | None = None,
        *,
        reader: Any = None,
        data_list: Sequence[AtomicData] | None = None,
        chunk_size: int = 4096,
        device: Any = None,
        skip_validation: bool | None = None,
        transforms: Sequence[Callable] | None = None,
        batch_transforms: Sequence[Callable] | None = None,
    ) -> None:
        sources = [s for s in (in_memory_batch, reader, data_list) if s is not None]
        if len(sources) != 1:
            raise ValueError(
                "InMemoryDataset needs exactly one of in_memory_batch, reader= or data_list=."
            )
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer; got {chunk_size!r}.")
        self.target_device = resolve_device(device)
        compose = sample_transforms(transforms, "InMemoryDataset")
        batch_compose = batch_transforms_of(batch_transforms, "InMemoryDataset")
        if in_memory_batch is not None:
            if not isinstance(in_memory_batch, Batch):
                raise TypeError(
                    f"in_memory_batch must be a Batch; got {type(in_memory_batch).__name__}."
                )
            batch = in_memory_batch
            if compose is not None:
                batch = _collate_chunks(batch.to_data_list(), compose, None, chunk_size)
            if batch_compose is not None:
                batch = batch_compose(batch)
        elif data_list is not None:
            batch = _collate_chunks(list(data_list), compose, batch_compose, chunk_size)
        else:
            batch = _materialize(reader, compose, batch_compose, chunk_size, skip_validation)
        self.batch = batch
        self._node_counts = batch.num_nodes_list
        self._edge_counts = batch.num_edges_per_graph.cpu().tolist() if batch.num_graphs else []

    @property
    def in_memory_batch(self) -> Batch:
        return self.batch

    def __len__(self) -> int:
        return self.batch.num_graphs

    @property
    def field_names(self) -> list[str]:
        """Names of the fields stored in the resident batch."""
        return sorted(k for k, _ in self.batch)

    @property
    def pin_memory(self) -> bool:
        return False

    @pin_memory.setter
    def pin_memory(self, value: bool) -> None:
        if value and self.batch.device.type == "cpu":
            self.batch.pin_memory()

    def _target(self, device: Any) -> torch.device:
        if device is not None:
            return resolve_device(device)
        return self.target_device if self.target_device is not None else self.batch.device

    def __getitem__(self, index: int) -> AtomicData:
        return self.get_with_metadata(index)[0]

    def get_with_metadata(self, index: int) -> tuple[AtomicData, dict[str, Any]]:
        """Structure ``index`` and ``{"index": index}``."""
        index = check_index(index, len(self), self)
        data = self.batch.get_data(index)
        target = self._target(None)
        if data.device != target:
            data = data.to(target, non_blocking=True)
        return data, {"index": index}

    def __iter__(self) -> Iterator[AtomicData]:
        for i in range(len(self)):
            yield self[i]

    def get_metadata(self, index: int) -> tuple[int, int]:
        """``(num_atoms, num_edges)`` of structure ``index``."""
        index = check_index(index, len(self), self)
        return self._node_counts[index], self._edge_counts[index]

    def load_batches(
        self, batch_index_lists: Sequence[Sequence[int]], *, device: Any = None
    ) -> list[Batch]:
        """``index_select`` of the resident batch per index list (moved to the device)."""
        target = self._target(device)
        out = []
        for indices in batch_index_lists:
            if isinstance(indices, torch.Tensor):
                idx = indices.to("cpu", torch.int64).reshape(-1)
            else:
                idx = torch.tensor(flat_indices([indices], len(self), self), dtype=torch.int64)
            if idx.numel() == 0:
                raise ValueError("load_batches got an empty batch; every batch needs an index.")
            batch = self.batch.index_select(idx)
            out.append(batch if batch.device == target else batch.to(target, non_blocking=True))
        return out

    def get_batch(self, indices: Sequence[int]) -> Batch:
        return self.load_batches([indices])[0]

    def close(self) -> None:
        """Nothing to release (the reader was closed after materialising)."""

    def __enter__(self) -> InMemoryDataset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"InMemoryDataset(len={len(self)}, atoms={self.batch.num_nodes}, "
            f"device={self._target(None)})"
        )


def _collate_chunks(
    data_list: list[AtomicData],
    compose: Compose | None,
    batch_compose: Compose | None,
    chunk_size: int,
) -> Batch:
    if not data_list:
        raise ValueError("InMemoryDataset got an empty data_list.")
    chunks = []
    per_sample, batch_neighbors = _split_batch_neighbors(compose)
    for start in range(0, len(data_list), chunk_size):
        items = data_list[start : start + chunk_size]
        if per_sample is not None:
            items = [per_sample(d, {"index": start + k})[0] for k, d in enumerate(items)]
        chunk = Batch.from_data_list(items, device="cpu")
        if batch_neighbors is not None:
            batch_neighbors.apply_to_batch(chunk, _ChunkNames(start))
        chunks.append(batch_compose(chunk) if batch_compose is not None else chunk)
    return chunks[0] if len(chunks) == 1 else Batch.cat(chunks)


def _materialize(
    reader: Any,
    compose: Compose | None,
    batch_compose: Compose | None,
    chunk_size: int,
    skip_validation: bool | None,
) -> Batch:
    try:
        source = Dataset(reader, device="cpu", skip_validation=skip_validation)
        source.transforms = compose
        n = len(source)
        if n == 0:
            raise ValueError(f"InMemoryDataset: reader {reader!r} is empty.")
        chunks = []
        for start in range(0, n, chunk_size):
            chunk = source.get_batch(list(range(start, min(start + chunk_size, n))))
            chunks.append(batch_compose(chunk) if batch_compose is not None else chunk)
        return chunks[0] if len(chunks) == 1 else Batch.cat(chunks)
    finally:
        close = getattr(reader, "close", None)
        if callable(close):
            close()
