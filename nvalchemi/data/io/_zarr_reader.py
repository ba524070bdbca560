"""Random-access reader of the ``AtomicData`` zarr store (see :mod:`nvalchemi.data.io.zarr`).

Uncompressed, unsharded arrays in a local directory are read with ``preadv``
straight from the chunk files (the zarr v3 on-disk format: a chunk of the
``bytes`` codec is the raw C-order rows), which avoids zarr's per-call overhead of
a few hundred microseconds; other arrays go through zarr with a small cache of
decoded chunks.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nvalchemi.data.datapipes.reader import Reader
from nvalchemi.data.fields import FIELDS
from nvalchemi.data.io._zarr_common import describe, open_store, zarr_module

__all__ = ["AtomicDataZarrReader"]


class _Rows:
    """Reads row ranges of one array: raw ``preadv`` from chunk files, or zarr."""

    _MAX_OPEN = 32  # open chunk files kept per array
    _MAX_CHUNKS = 4  # decoded chunks kept per array (zarr path)

    def __init__(self, array: Any) -> None:
        self.array = array
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)
        self.raw = self._raw_layout(array)
        self.chunk_rows = max(1, int(array.chunks[0])) if len(self.shape) else 1
        self._chunks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._fds: OrderedDict[int, int] = OrderedDict()
        self.trailing = self.shape[1:]
        weakref.finalize(self, _close_fds, self._fds)

    def _raw_layout(self, array: Any) -> tuple | None:
        try:
            from zarr.codecs import BytesCodec
            from zarr.storage import LocalStore

            store = array.store_path.store
            meta = array.metadata
            if not isinstance(store, LocalStore) or getattr(meta, "zarr_format", 2) != 3:
                return None
            codecs = tuple(meta.codecs)
            if len(codecs) != 1 or not isinstance(codecs[0], BytesCodec):
                return None
            chunks = tuple(array.chunks)
            if chunks[1:] != self.shape[1:] or 0 in self.shape[1:]:
                return None
            endian = getattr(codecs[0].endian, "value", codecs[0].endian)
            dtype = self.dtype
            if dtype.itemsize > 1 and endian in ("little", "big"):
                dtype = dtype.newbyteorder("<" if endian == "little" else ">")
            root = str(Path(store.root) / array.store_path.path)
            encode = meta.chunk_key_encoding.encode_chunk_key
            zeros = (0,) * (len(self.shape) - 1)
            row_bytes = dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
            fill = array.fill_value
            return root, encode, zeros, chunks[0], row_bytes, dtype, fill
        except Exception:
            return None

    def close(self) -> None:
        _close_fds(self._fds)
        self._chunks.clear()

    def _fd(self, chunk: int) -> int | None:
        # Descriptors survive fork and pread ignores the shared offset, so worker
        # processes may keep using them; pickling (spawn) drops the whole _Rows.
        fds = self._fds
        fd = fds.get(chunk)
        if fd is not None:
            fds.move_to_end(chunk)
            return fd
        root, encode, zeros, *_ = self.raw
        try:
            fd = os.open(os.path.join(root, encode((chunk, *zeros))), os.O_RDONLY)
        except FileNotFoundError:
            return None
        fds[chunk] = fd
        if len(fds) > self._MAX_OPEN:
            os.close(fds.popitem(last=False)[1])
        return fd

    def _read_zarr(self, start: int, stop: int) -> np.ndarray:
        """Rows through zarr, whole chunks at a time with a small cache of decoded chunks.

        A compressed chunk is decoded whole anyway, so neighbouring samples read
        later (sequential or block-shuffled order) cost nothing extra.
        """
        rows = self.chunk_rows
        first, last = start // rows, max(start, stop - 1) // rows
        if stop <= start or last - first > 2:
            return np.asarray(self.array[start:stop])
        parts = []
        for chunk in range(first, last + 1):
            block = self._chunks.get(chunk)
            if block is None:
                block = np.asarray(
                    self.array[chunk * rows : min((chunk + 1) * rows, self.shape[0])]
                )
                self._chunks[chunk] = block
                if len(self._chunks) > self._MAX_CHUNKS:
                    self._chunks.popitem(last=False)
            else:
                self._chunks.move_to_end(chunk)
            lo = max(start, chunk * rows) - chunk * rows
            hi = min(stop, (chunk + 1) * rows) - chunk * rows
            parts.append(block[lo:hi])
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as a new, writable numpy array."""
        raw = self.raw
        if raw is None:
            return self._read_zarr(start, stop)
        rows_per_chunk, row_bytes, dtype, fill = raw[3:]
        out = np.empty((stop - start, *self.trailing), dtype=dtype)
        if stop <= start:
            return out
        chunk = start // rows_per_chunk
        if stop <= (chunk + 1) * rows_per_chunk:  # the common case: one chunk
            fd = self._fd(chunk)
            if fd is None:
                out[...] = fill
            elif os.preadv(fd, [out], (start - chunk * rows_per_chunk) * row_bytes) != out.nbytes:
                self._short(chunk)
            return out
        view = memoryview(out.reshape(-1).view(np.uint8))
        row = start
        while row < stop:
            chunk = row // rows_per_chunk
            end = min(stop, (chunk + 1) * rows_per_chunk)
            a, b = (row - start) * row_bytes, (end - start) * row_bytes
            fd = self._fd(chunk)
            if fd is None:
                out[row - start : end - start] = fill
            elif os.preadv(fd, [view[a:b]], (row - chunk * rows_per_chunk) * row_bytes) != b - a:
                self._short(chunk)
            row = end
        return out

    def _short(self, chunk: int) -> None:
        raise OSError(
            f"Chunk {chunk} of {self.raw[0]} is shorter than expected; the store is being "
            "rewritten or is corrupt (call refresh() after writes)."
        )


def _close_fds(fds: dict) -> None:
    while fds:
        _, fd = fds.popitem()
        with contextlib.suppress(OSError):
            os.close(fd)


# ------------------------------------------------------------------------ reader
class AtomicDataZarrReader(Reader):
    """Random-access reader of a store written by :class:`AtomicDataZarrWriter`.

    ``len(reader)`` counts active (not deleted) samples; indices are logical
    (0 .. len-1, negatives allowed) and map to physical samples through the
    samples mask. ``read(i)`` returns CPU tensors: atom/edge fields sliced per
    sample, system fields as ``[1, ...]`` rows, ``neighbor_list`` with local
    indices; metadata holds ``index``, ``source_file``, ``physical_index`` (a
    string, as in the reference) and the neighbour-list stamp when the store has one.

    Call :meth:`refresh` after another process appended or deleted samples.

    ``validates = True``: :class:`AtomicDataZarrWriter` stores only validated
    ``AtomicData``, so ``Dataset`` need not check samples again (labels a sample
    lacks, stored as NaN, are left out of it, as ``Batch`` does when splitting).

    Raises:
        FileNotFoundError: no store at the path.
        ValueError: the store lacks the ``meta`` or ``core`` group.
    """

    validates = True

    def __init__(
        self,
        store: Any,
        *,
        pin_memory: bool = False,
        include_index_in_metadata: bool = True,
    ) -> None:
        super().__init__(pin_memory=pin_memory, include_index_in_metadata=include_index_in_metadata)
        self.store = store
        self._root: Any = None
        self._closed = False
        self._open()

    # ------------------------------------------------------------------ state
    def _open(self) -> None:
        zarr = zarr_module()
        if isinstance(self.store, (str, os.PathLike)) and not Path(self.store).exists():
            raise FileNotFoundError(f"Zarr store {self.store} does not exist.")
        try:
            root = zarr.open_group(open_store(self.store), mode="r")
        except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
            raise FileNotFoundError(f"No zarr store at {describe(self.store)}.") from exc
        for group in ("meta", "core"):
            if group not in root:
                raise ValueError(
                    f"Zarr store {describe(self.store)} is missing {group!r} group; it was not "
                    "written by AtomicDataZarrWriter."
                )
        attrs = dict(root.attrs)
        n = int(attrs.get("num_samples", 0))
        meta = root["meta"]
        zero = np.zeros(1, dtype=np.int64)
        self._atoms_ptr = np.asarray(meta["atoms_ptr"][: n + 1], dtype=np.int64) if n else zero
        self._edges_ptr = np.asarray(meta["edges_ptr"][: n + 1], dtype=np.int64) if n else zero
        mask = np.asarray(meta["samples_mask"][:n], dtype=bool) if n else np.zeros(0, bool)
        self._active = np.flatnonzero(mask).astype(np.int64)
        fields = attrs.get("fields", {})
        levels: dict[str, str] = {}
        arrays: dict[str, _Rows] = {}
        for group_name, default in (("core", "atom"), ("custom", "system")):
            declared = fields.get(group_name, {})
            if group_name not in root:
                continue
            group = root[group_name]
            for key in group.array_keys():
                levels[key] = declared.get(key, default)
                arrays[key] = _Rows(group[key])
        self._levels = levels
        self._arrays = arrays
        self._labels = frozenset(
            key
            for key, rows in arrays.items()
            if key in FIELDS and FIELDS[key].label and rows.dtype.kind == "f"
        )
        stamp = attrs.get("neighbor_list")
        self._stamp_meta = (
            {"neighbor_list_cutoff": stamp["cutoff"], "neighbor_list_half_list": stamp["half_list"]}
            if stamp
            else {}
        )
        self._root = root

    def refresh(self) -> None:
        """Re-read pointers, masks and fields (after external appends or deletes)."""
        if self._closed:
            raise RuntimeError("Cannot refresh a closed AtomicDataZarrReader.")
        self._close_arrays()
        self._open()

    def _close_arrays(self) -> None:
        for rows in getattr(self, "_arrays", {}).values():
            rows.close()

    def close(self) -> None:
        """Drop the store handle and open files; reads afterwards raise ``RuntimeError``."""
        self._close_arrays()
        self._arrays = {}
        self._root = None
        self._closed = True

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_arrays", None)
        state.pop("_root", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._arrays = {}
        self._root = None
        if not self._closed:
            self._open()

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        return int(self._active.size)

    @property
    def field_levels(self) -> dict[str, str]:
        return dict(self._levels)

    @property
    def field_names(self) -> list[str]:
        return list(self._levels) if len(self) else []

    def _physical(self, indices: Sequence[int]) -> np.ndarray:
        if self._closed:
            raise RuntimeError("AtomicDataZarrReader is closed.")
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self._active.size
        bad = idx[(idx < -n) | (idx >= n)]
        if bad.size:
            raise IndexError(
                f"Index {int(bad[0])} is out of range for zarr store {describe(self.store)} "
                f"with {n} active samples."
            )
        return self._active[idx % n] if n else idx

    def get_metadata(self, index: int) -> tuple[int, int]:
        """``(num_atoms, num_edges)`` of sample ``index`` from the cached pointers."""
        p = int(self._physical([index])[0])
        return (
            int(self._atoms_ptr[p + 1] - self._atoms_ptr[p]),
            int(self._edges_ptr[p + 1] - self._edges_ptr[p]),
        )

    def _get_sample_metadata(self, index: int) -> dict[str, Any]:
        p = int(self._physical([index])[0])
        return {
            "index": index,
            "source_file": describe(self.store),
            "physical_index": str(p),
            **self._stamp_meta,
        }

    # ------------------------------------------------------------------ reads
    def _load_sample(self, index: int) -> dict[str, torch.Tensor]:
        return self._load_many_samples([index])[0]

    def _load_many_samples(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        physical = self._physical(indices)
        if physical.size == 0:
            return []
        order = np.argsort(physical, kind="stable")
        ordered = physical[order]
        out: list[dict[str, torch.Tensor] | None] = [None] * physical.size
        seen: set[int] = set()
        position = 0
        for start, stop in self._merge_runs(ordered):
            block = self._read_run(start, stop)
            count = np.searchsorted(ordered, stop, side="left") - position
            for k in range(position, position + count):
                p = int(ordered[k])
                sample = self._slice(block, start, p, copy=p in seen)
                seen.add(p)
                out[int(order[k])] = sample
            position += count
        return out  # type: ignore[return-value]

    def _merge_runs(self, ordered: np.ndarray) -> list[tuple[int, int]]:
        """Physical ``[start, stop)`` ranges covering ``ordered`` (sorted) samples.

        Raw reads cost a few microseconds, so only (nearly) adjacent samples are
        merged; zarr reads cost far more per call, so gaps up to the number of
        requested samples are read through when the run stays dense (spanned
        samples at most 8x the requested ones).
        """
        raw = all(rows.raw is not None for rows in self._arrays.values())
        max_gap = 1 if raw else max(1, ordered.size)
        runs: list[tuple[int, int]] = []
        start = prev = int(ordered[0])
        count = 1
        for p in ordered[1:].tolist():
            gap = p - prev - 1
            if gap <= max_gap and (raw or (p + 1 - start) <= 8 * (count + 1)):
                prev, count = max(prev, p), count + 1
                continue
            runs.append((start, prev + 1))
            start = prev = p
            count = 1
        runs.append((start, prev + 1))
        return runs

    def _read_run(self, start: int, stop: int) -> dict[str, np.ndarray]:
        spans = {
            "system": (start, stop),
            "atom": (int(self._atoms_ptr[start]), int(self._atoms_ptr[stop])),
            "edge": (int(self._edges_ptr[start]), int(self._edges_ptr[stop])),
        }
        return {key: rows.read(*spans[self._levels[key]]) for key, rows in self._arrays.items()}

    def _slice(
        self, block: dict[str, np.ndarray], start: int, p: int, copy: bool
    ) -> dict[str, torch.Tensor]:
        a0 = int(self._atoms_ptr[start])
        e0 = int(self._edges_ptr[start])
        a, b = int(self._atoms_ptr[p]) - a0, int(self._atoms_ptr[p + 1]) - a0
        c, d = int(self._edges_ptr[p]) - e0, int(self._edges_ptr[p + 1]) - e0
        sample: dict[str, torch.Tensor] = {}
        for key, values in block.items():
            level = self._levels[key]
            if level == "atom":
                part = values[a:b]
            elif level == "edge":
                part = values[c:d]
            else:
                part = values[p - start : p - start + 1]
            if key in self._labels and part.size and np.isnan(part).all():
                continue  # a label this sample lacks, stored as NaN (as Batch fills it)
            if key == "neighbor_list":
                part = part - self._atoms_ptr[p]  # store-global -> local (a new array)
            elif copy:  # a duplicate request must not alias the first one's tensors
                part = part.copy()
            if not part.dtype.isnative:
                part = part.astype(part.dtype.newbyteorder("="))
            sample[key] = torch.from_numpy(part)
        pbc = sample.get("pbc")
        if pbc is not None and not pbc.any() and not sample["cell"].any():
            del sample["pbc"], sample["cell"]  # an open-boundary sample of a mixed store
        return sample
