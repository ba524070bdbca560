"""Random-access reader of the ``AtomicData`` zarr store (see :mod:`nvalchemi.data.io.zarr`).

Arrays of a local directory store in the zarr v3 format are read from their chunk
files, or from their shard files (zarr's ``sharding_indexed`` codec: a shard's index,
read once and checked against its CRC32C, says where each chunk lies), directly,
which avoids zarr's per-call overhead of a few hundred microseconds:

* raw chunks (the ``bytes`` codec alone: C-order rows) with ``preadv`` of exactly
  the requested rows;
* chunks compressed with Blosc or Zstd by decoding the chunk (numcodecs);

every other array (other codecs, other stores) goes through zarr. The compressed arrays
of a reader are kept decoded whole, smallest first, while they fit in its budget
(``cache_bytes``, 64 MiB: the cells and flags of a million structures, the positions
of a hundred thousand), each decoded at its first read; a larger array decodes the
chunk a read needs and keeps the last one, so neighbouring samples cost one decode.
(A cache of recently decoded chunks cost more in allocations and cold memory than its
hits saved once a store outgrew it.)

The reader keeps up to 1,024 chunk and shard files open (a quarter of the process's
file limit at most), so random reads in a store of a million structures open no file.
A chunk file that is absent, truncated or undecodable raises
:class:`~nvalchemi.data.io.zarr.StoreDamagedError` naming the store, the array and
the samples affected, for stores of the current format (which writes every chunk);
older stores (format 1, the reference toolkit's) leave out chunks of zeros, so there
an absent chunk reads as zeros, as zarr reads it.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:
    import resource
except ImportError:  # not POSIX: assume the common limit of 1,024 descriptors
    resource = None

from nvalchemi.data.datapipes.reader import Reader
from nvalchemi.data.fields import FIELDS
from nvalchemi.data.io._zarr_common import (
    EVERY_CHUNK_WRITTEN,
    FORMAT_FAMILY,
    META_LEVELS,
    StoreDamagedError,
    attribute_problems,
    describe,
    open_store,
    zarr_module,
)
from nvalchemi.data.label_precision import EXTENSIVE_LABELS, rounding_warning, worst_rounding

__all__ = ["AtomicDataZarrReader"]

CACHE_BYTES = 64 << 20
"""Default budget of compressed arrays one reader keeps decoded whole (per process)."""
_MAX_OPEN_FILES = 1024  # chunk and shard files one reader keeps open (1/4 of the fd limit at most)


class _ChunkProblem(Exception):
    """A chunk that cannot be read (the reader adds the store and the samples)."""

    def __init__(self, chunk: int, rows: tuple[int, int], reason: str) -> None:
        super().__init__(reason)
        self.chunk, self.rows, self.reason = chunk, rows, reason


class _OpenFiles:
    """Open chunk and shard files of one reader's arrays, within a descriptor budget.

    Descriptors survive ``fork`` and ``pread`` ignores the shared offset, so loader
    worker processes keep using them; pickling (``spawn``) starts without any.
    """

    def __init__(self) -> None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if resource else 1024
        self.limit = max(16, min(_MAX_OPEN_FILES, soft // 4 if soft > 0 else _MAX_OPEN_FILES))
        self.fds: OrderedDict[tuple[int, int], int] = OrderedDict()
        weakref.finalize(self, _close_fds, self.fds)

    def get(self, key: tuple[int, int], path: Callable[[int], str]) -> int | None:
        """The descriptor of file ``key`` at ``path(key[1])`` (``None``: it does not exist).

        The oldest opened is closed first (not the least used: a hit costs no
        bookkeeping, and a reader's files usually all fit).
        """
        fd = self.fds.get(key)
        if fd is not None:
            return fd
        try:
            fd = os.open(path(key[1]), os.O_RDONLY)
        except FileNotFoundError:
            return None
        self.fds[key] = fd
        if len(self.fds) > self.limit:
            os.close(self.fds.popitem(last=False)[1])
        return fd

    def clear(self) -> None:
        _close_fds(self.fds)


def _close_fds(fds: dict) -> None:
    while fds:
        _, fd = fds.popitem()
        with contextlib.suppress(OSError):
            os.close(fd)


class _Rows:
    """Reads row ranges of one array: raw ``preadv``, chunk decoding, or zarr.

    A chunk is found by :meth:`_locate`: its own file (unsharded arrays) or a byte
    range of its shard file, from the shard's index (read once per shard and checked
    against its CRC32C); inside it, raw rows are read with ``preadv`` and encoded
    ones decoded (numcodecs), the last chunk kept.
    """

    def __init__(self, array: Any, strict: bool, files: _OpenFiles):
        self.array = array
        self.strict = strict
        self.files = files
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype)
        self.trailing = self.shape[1:]
        self.fill = array.fill_value
        self.chunk_rows = max(1, int(array.chunks[0])) if len(self.shape) else 1
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.trailing, dtype=np.int64))
        self.root: str | None = None
        self.decoder: Any = None
        self.per_shard = 0  # chunks per shard (0: unsharded)
        self.index_at_end = True
        self.index_crc = False
        self.mode = self._layout(array)
        self._indexes: dict[int, list[list[int]]] = {}
        self._present: set[int] = set()
        self._whole: np.ndarray | None = None
        self.keep_whole = False  # decode the whole array at its first read (reader's budget)
        self._last: tuple[int, np.ndarray | None] | None = None  # the last chunk decoded

    @property
    def decoded_bytes(self) -> int:
        return (self.shape[0] if self.shape else 1) * self.row_bytes

    def _layout(self, array: Any) -> str:
        """``"raw"``, ``"decode"`` (local chunk or shard files read here) or ``"zarr"``."""
        try:
            from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec
            from zarr.storage import LocalStore

            store = array.store_path.store
            meta = array.metadata
            codecs = tuple(getattr(meta, "codecs", ()))
            if (
                not isinstance(store, LocalStore)
                or getattr(meta, "zarr_format", 2) != 3
                or len(codecs) == 0
                or tuple(array.chunks)[1:] != self.trailing
                or 0 in self.trailing
            ):
                return "zarr"
            if isinstance(codecs[0], ShardingCodec):
                sharding = codecs[0]
                index = tuple(sharding.index_codecs)
                if (
                    len(codecs) != 1
                    or tuple(sharding.chunk_shape)[1:] != self.trailing
                    or not index
                    or not isinstance(index[0], BytesCodec)
                    or index[1:] not in ((), (Crc32cCodec(),))
                ):
                    return "zarr"
                self.per_shard = int(array.shards[0]) // self.chunk_rows
                self.index_at_end = getattr(sharding.index_location, "value", "end") == "end"
                self.index_crc = len(index) == 2
                codecs = tuple(sharding.codecs)
            if not codecs or not isinstance(codecs[0], BytesCodec):
                return "zarr"
            rest = codecs[1:]
            if rest and (len(rest) > 1 or not isinstance(rest[0], (BloscCodec, ZstdCodec))):
                return "zarr"
            endian = getattr(codecs[0].endian, "value", codecs[0].endian)
            if self.dtype.itemsize > 1 and endian in ("little", "big"):
                self.dtype = self.dtype.newbyteorder("<" if endian == "little" else ">")
            self.root = str(Path(store.root) / array.store_path.path)
            if not rest:
                return "raw"
            import numcodecs.blosc
            import numcodecs.zstd

            # The module functions: numcodecs' codec objects add checks costing as much
            # as decompressing a chunk.
            self.decoder = (
                numcodecs.blosc.decompress
                if isinstance(rest[0], BloscCodec)
                else numcodecs.zstd.decompress
            )
            return "decode"
        except Exception:
            return "zarr"

    # ------------------------------------------------------------------ chunks
    def num_chunks(self) -> int:
        return -(-self.shape[0] // self.chunk_rows) if self.shape else 1

    def chunk_span(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_rows
        return start, min(start + self.chunk_rows, self.shape[0])

    def _file_key(self, number: int) -> str:
        return self.array.metadata.encode_chunk_key((number, *((0,) * len(self.trailing))))

    def chunk_key(self, chunk: int, whole_file: bool = False) -> str:
        """Where the chunk is, relative to the store root: its file, or its shard file."""
        number = chunk // self.per_shard if self.per_shard else chunk
        key = self._file_key(number)
        key = f"{self.array.store_path.path}/{key}" if self.array.store_path.path else key
        if not self.per_shard:
            return f"chunk file {key}"
        if whole_file:
            return f"shard file {key}"
        return f"chunk {chunk % self.per_shard} of shard file {key}"

    def close(self) -> None:
        self._indexes.clear()
        self._whole = self._last = None

    def _index(self, shard: int, fd: int) -> list[list[int]]:
        """``[offset, bytes]`` of each chunk of the shard (read once, then cached)."""
        index = self._indexes.get(shard)
        if index is not None:
            return index
        size = os.fstat(fd).st_size
        length = 16 * self.per_shard + (4 if self.index_crc else 0)
        where = f"shard file {self._shard_path(shard)}"
        span = self.chunk_span(shard * self.per_shard)
        if size < length:
            raise _ChunkProblem(
                shard * self.per_shard, span, f"{where} is truncated ({size:,} bytes)"
            )
        raw = os.pread(fd, length, size - length if self.index_at_end else 0)
        if self.index_crc:
            import numcodecs

            try:
                raw = numcodecs.CRC32C().decode(raw)
            except RuntimeError:
                raise _ChunkProblem(
                    shard * self.per_shard,
                    span,
                    f"{where} has a damaged index (checksum mismatch; truncated or overwritten)",
                ) from None
        index = np.frombuffer(raw, dtype="<u8").reshape(-1, 2).astype(np.int64).tolist()
        self._indexes[shard] = index
        return index

    def _file_path(self, number: int) -> str:
        return os.path.join(self.root, self._file_key(number))

    def _shard_path(self, shard: int) -> str:
        key = self._file_key(shard)
        return f"{self.array.store_path.path}/{key}" if self.array.store_path.path else key

    def _locate(self, chunk: int) -> tuple[int, int, int] | None:
        """``(fd, offset, bytes)`` of the chunk's encoded bytes (``None``: absent)."""
        if not self.per_shard:
            fd = self.files.get((id(self), chunk), self._file_path)
            if fd is None:
                return None
            size = self.chunk_rows * self.row_bytes if self.mode == "raw" else -1
            return fd, 0, size
        shard, slot = divmod(chunk, self.per_shard)
        fd = self.files.get((id(self), shard), self._file_path)
        if fd is None:
            return None
        index = self._indexes.get(shard) or self._index(shard, fd)
        offset, nbytes = index[slot]
        if offset < 0:  # 2**64 - 1: the shard holds no such chunk
            self._missing(chunk, whole_file=False)
            return fd, -1, 0
        return fd, offset, nbytes

    def _missing(self, chunk: int, whole_file: bool = True) -> None:
        """Raise for an absent chunk of a store that writes every chunk (else: zeros)."""
        if self.strict:
            where = self.chunk_key(chunk, whole_file=whole_file)
            raise _ChunkProblem(chunk, self.chunk_span(chunk), f"{where} is missing")

    def _decoded(self, chunk: int) -> np.ndarray | None:
        """Chunk ``chunk`` decoded to ``[chunk_rows, *trailing]`` (``None``: absent, lenient)."""
        last = self._last
        if last is not None and last[0] == chunk:
            return last[1]
        if self.mode == "zarr":
            if not self._exists(chunk):
                self._missing(chunk)
                return None
            start, stop = self.chunk_span(chunk)
            block = np.asarray(self.array[start:stop])
        else:
            where = self._locate(chunk)
            if where is None:
                self._missing(chunk)
                return None
            fd, offset, nbytes = where
            if offset < 0:
                return None  # absent in a store that leaves out chunks of zeros
            data = os.pread(fd, os.fstat(fd).st_size if nbytes < 0 else nbytes, offset)
            try:
                raw = self.decoder(data)
            except Exception as exc:
                raise _ChunkProblem(
                    chunk,
                    self.chunk_span(chunk),
                    f"{self.chunk_key(chunk)} cannot be decoded ({exc})",
                ) from None
            expected = self.chunk_rows * self.row_bytes
            if len(raw) != expected:
                raise _ChunkProblem(
                    chunk,
                    self.chunk_span(chunk),
                    f"{self.chunk_key(chunk)} decodes to {len(raw):,} bytes instead of "
                    f"{expected:,}",
                )
            block = np.frombuffer(raw, dtype=self.dtype).reshape(self.chunk_rows, *self.trailing)
        self._last = (chunk, block)
        return block

    def _exists(self, chunk: int) -> bool:
        """Whether the chunk's key is in the store (checked once per chunk; zarr path)."""
        if not self.strict or chunk in self._present:
            return True
        from zarr.core.sync import sync

        key = self._file_key(chunk)
        key = f"{self.array.store_path.path}/{key}" if self.array.store_path.path else key
        present = bool(sync(self.array.store_path.store.exists(key)))
        if present:
            self._present.add(chunk)
        return present

    # ------------------------------------------------------------------ reads
    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as a new, writable numpy array (``_ChunkProblem`` if damaged)."""
        if self._whole is not None:
            return self._whole[start:stop].copy()
        out = np.empty((max(0, stop - start), *self.trailing), dtype=self.dtype)
        if stop <= start:
            return out
        if self.keep_whole and self._keep_whole():
            return self._whole[start:stop].copy()
        rows = self.chunk_rows
        chunk = start // rows
        if stop <= (chunk + 1) * rows:  # the common case: one chunk
            self._read_chunk(chunk, out, start - chunk * rows)
            return out
        if self.mode == "zarr" and not self.strict:
            return np.asarray(self.array[start:stop])  # one call through zarr
        row = start
        while row < stop:
            chunk = row // rows
            end = min(stop, (chunk + 1) * rows)
            self._read_chunk(chunk, out[row - start : end - start], row - chunk * rows)
            row = end
        return out

    def _keep_whole(self) -> bool:
        """Decode the array once and keep it (not when a chunk is damaged).

        A damaged chunk leaves the array to chunked reads, which fail only for the
        samples in that chunk.
        """
        self.keep_whole = False
        whole = np.empty(self.shape, dtype=self.dtype)
        try:
            for chunk in range(self.num_chunks()):
                start, stop = self.chunk_span(chunk)
                self._read_chunk(chunk, whole[start:stop], 0)
        except _ChunkProblem:
            return False
        self._whole = whole
        return True

    def _read_chunk(self, chunk: int, part: np.ndarray, offset: int) -> None:
        """Fill ``part`` with the rows of ``chunk`` from row ``offset`` of the chunk on."""
        if self.mode != "raw":
            block = self._decoded(chunk)
            if block is None:
                part[...] = self.fill
            else:
                part[...] = block[offset : offset + part.shape[0]]
            return
        where = self._locate(chunk)
        if where is None:
            self._missing(chunk)
            part[...] = self.fill
            return
        fd, base, nbytes = where
        if base < 0:
            part[...] = self.fill  # absent in a store that leaves out chunks of zeros
            return
        expected = self.chunk_rows * self.row_bytes
        if (
            nbytes != expected
            or os.preadv(fd, [part], base + offset * self.row_bytes) != part.nbytes
        ):
            size = os.fstat(fd).st_size
            raise _ChunkProblem(
                chunk,
                self.chunk_span(chunk),
                f"{self.chunk_key(chunk)} is truncated ({min(size, nbytes):,} of {expected:,} "
                "bytes; or being rewritten: call refresh() after writes)",
            )

    def problems(self) -> list[_ChunkProblem]:
        """Every chunk that is absent, truncated or undecodable (reads each chunk once).

        Absent chunks are reported also for stores that leave out chunks of zeros (the
        caller says that those cannot be told from damage).
        """
        found = []
        strict, self.strict = self.strict, True
        self._indexes.clear()
        try:
            for chunk in range(self.num_chunks()):
                try:
                    if self.mode == "raw":
                        self._check_raw(chunk)
                    else:
                        self._last = None
                        self._decoded(chunk)
                except _ChunkProblem as problem:
                    found.append(problem)
                    if self.per_shard and "index" in problem.reason:
                        break  # one damaged index: the shard's other chunks say nothing new
        finally:
            self.strict = strict
        return found

    def _check_raw(self, chunk: int) -> None:
        where = self._locate(chunk)
        if where is None:
            self._missing(chunk)
        fd, offset, nbytes = where
        if offset < 0:
            return
        expected = self.chunk_rows * self.row_bytes
        size = os.fstat(fd).st_size
        if nbytes != expected or size < offset + expected:
            have = min(nbytes, size - offset)
            raise _ChunkProblem(
                chunk,
                self.chunk_span(chunk),
                f"{self.chunk_key(chunk)} has {have:,} bytes instead of {expected:,}",
            )


# ------------------------------------------------------------------------ reader
class AtomicDataZarrReader(Reader):
    """Random-access reader of a store written by :class:`AtomicDataZarrWriter`.

    ``len(reader)`` counts active (not deleted) samples; indices are logical
    (0 .. len-1, negatives allowed) and map to physical samples through the
    samples mask. ``read(i)`` returns CPU tensors: atom/edge fields sliced per
    sample, system fields as ``[1, ...]`` rows, ``neighbor_list`` with local
    indices; metadata holds ``index``, ``source_file``, ``physical_index`` (a
    string, as in the reference) and the neighbour-list stamp when the store has one.

    Call :meth:`refresh` after another process appended or deleted samples;
    :meth:`verify` reads every chunk (what ``nvalchemi-training data check`` runs).

    ``validates = True``: :class:`AtomicDataZarrWriter` stores only validated
    ``AtomicData``, so ``Dataset`` need not check samples again (labels a sample
    lacks, stored as NaN, are left out of it, as ``Batch`` does when splitting).

    Args:
        store: a directory path, a ``dict`` (in-memory store) or any zarr store.
        cache_bytes: how many bytes of compressed arrays to keep decoded whole (the
            smallest arrays first); the others decode a chunk per read.
        label_dtype: dtype the floating labels (energy, forces, stress, ...) are returned
            in: a torch dtype, ``"positions"`` (the stored positions' dtype, so that a
            sample has one floating dtype: what ``open_reader`` asks for) or ``None`` (as
            stored; ``data convert`` stores structure-level labels in float64). Rounding a
            total energy or virial by more than 0.1 meV/atom warns once (see
            :mod:`nvalchemi.data.label_precision`).

    Raises:
        FileNotFoundError: no store at the path.
        StoreDamagedError: (a ``ValueError``) the store lacks a group or an array its
            metadata declares, its sample count disagrees with its arrays, or a chunk
            file is missing, truncated or undecodable (also raised by reads).
    """

    validates = True

    def __init__(
        self,
        store: Any,
        *,
        pin_memory: bool = False,
        include_index_in_metadata: bool = True,
        cache_bytes: int = CACHE_BYTES,
        label_dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__(pin_memory=pin_memory, include_index_in_metadata=include_index_in_metadata)
        floating = isinstance(label_dtype, torch.dtype) and label_dtype.is_floating_point
        if label_dtype not in (None, "positions") and not floating:
            raise ValueError(
                f"label_dtype must be a floating torch dtype, 'positions' or None; got "
                f"{label_dtype!r}."
            )
        self.label_dtype = label_dtype
        self._rounding_warned = False
        self.store = store
        self._root: Any = None
        self._closed = False
        self.cache_bytes = int(cache_bytes)
        self._files = _OpenFiles()
        self._open()

    # ------------------------------------------------------------------ state
    def _damaged(self, text: str) -> StoreDamagedError:
        where = describe(self.store)
        return StoreDamagedError(
            f"Zarr store {where} is damaged: {text}. Fix: copy it again from its source (or "
            f"rewrite it with `nvalchemi-training data convert`); `nvalchemi-training data "
            f"check {where}` verifies every chunk."
        )

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
                raise StoreDamagedError(
                    f"Zarr store {describe(self.store)} is missing {group!r} group; it was not "
                    "written by AtomicDataZarrWriter."
                )
        attrs = dict(root.attrs)
        self._strict = attrs.get("format") in EVERY_CHUNK_WRITTEN
        n = attrs.get("num_samples", 0)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise self._damaged(f"its num_samples attribute (zarr.json) is {n!r}, not a count")
        self._ours = str(attrs.get("format", "")).startswith(FORMAT_FAMILY)
        meta = root["meta"]
        arrays: dict[str, _Rows] = {}
        levels: dict[str, str] = {}
        for name, level in META_LEVELS.items():
            if name in meta:
                problems = attribute_problems("meta", name, level, meta[name], ours=self._ours)
                if problems:
                    raise self._damaged("; ".join(problems))
                arrays[f"meta/{name}"] = _Rows(meta[name], self._strict, self._files)
                levels[f"meta/{name}"] = level
        for name, need in (("atoms_ptr", n + 1), ("edges_ptr", n + 1), ("samples_mask", n)):
            if f"meta/{name}" not in arrays:
                if n:  # an emptied (all deleted, defragmented) store has no arrays
                    raise self._damaged(f"array meta/{name} is missing")
                continue
            rows = arrays[f"meta/{name}"].shape[0]
            if rows < need:
                raise self._damaged(
                    f"its metadata claims {n:,} samples but meta/{name} has {rows:,} rows "
                    f"(needs {need:,}); the zarr.json was edited or the store truncated"
                )
        self._meta_levels = levels
        self._meta_arrays = arrays
        zero = np.zeros(1, dtype=np.int64)
        self._atoms_ptr = zero
        self._edges_ptr = zero
        if n:
            self._atoms_ptr = self._pointers("meta/atoms_ptr", n)
            self._edges_ptr = self._pointers("meta/edges_ptr", n)
        self._num_samples = n
        self._check_masks(n)
        mask = self._read("meta/samples_mask", 0, n).astype(bool) if n else np.zeros(0, bool)
        self._active = np.flatnonzero(mask).astype(np.int64)
        self._num_active = int(self._active.size)
        self._levels, self._arrays = self._data_arrays(root, attrs.get("fields", {}), n)
        self._plan_whole_arrays()
        self._labels = frozenset(
            key
            for key, rows in self._arrays.items()
            if key in FIELDS and FIELDS[key].label and rows.dtype.kind == "f"
        )
        self._casts = self._label_casts()
        self._widen = frozenset(  # index fields stored narrower (atomic numbers: uint8)
            key
            for key, rows in self._arrays.items()
            if key in FIELDS and FIELDS[key].kind == "index" and rows.dtype != np.int64
        )
        stamp = attrs.get("neighbor_list")
        self._stamp_meta = (
            {"neighbor_list_cutoff": stamp["cutoff"], "neighbor_list_half_list": stamp["half_list"]}
            if stamp
            else {}
        )
        self._root = root

    def _plan_whole_arrays(self) -> None:
        """Mark the compressed arrays to keep decoded whole: the smallest first, within
        ``cache_bytes`` (decoded at their first read, so an unread field costs nothing)."""
        left = self.cache_bytes
        for rows in sorted(self._arrays.values(), key=lambda rows: rows.decoded_bytes):
            if rows.mode != "raw" and rows.decoded_bytes <= left:
                rows.keep_whole = True
                left -= rows.decoded_bytes

    def _label_casts(self) -> dict[str, np.dtype]:
        """The labels to return in another dtype than stored (see ``label_dtype``)."""
        if self.label_dtype is None:
            return {}
        if self.label_dtype == "positions":
            rows = self._arrays.get("positions")
            if rows is None or rows.dtype.kind != "f":
                return {}
            target = np.dtype(rows.dtype.name)
        else:
            target = np.dtype(str(self.label_dtype).removeprefix("torch."))
        return {
            key: target for key in self._labels if np.dtype(self._arrays[key].dtype.name) != target
        }

    def _cast_label(self, key: str, values: np.ndarray, start: int) -> np.ndarray:
        """``values`` (rows of samples ``start``...) in the dtype asked for; warn of rounding."""
        target = self._casts[key]
        if key in EXTENSIVE_LABELS and not self._rounding_warned and values.size:
            atoms = np.diff(self._atoms_ptr[start : start + len(values) + 1])
            worst = worst_rounding(values, atoms, target)
            if worst is not None:
                self._rounding_warned = True
                row, per_atom = worst
                structure = int(np.searchsorted(self._active, start + row))
                value = float(np.asarray(values[row]).reshape(-1)[0])
                where = f"{describe(self.store)}: structure {structure}"
                warnings.warn(rounding_warning(where, key, per_atom, value, target), stacklevel=2)
        return values.astype(target)

    def _pointers(self, name: str, n: int) -> np.ndarray:
        ptr = self._read(name, 0, n + 1).astype(np.int64, copy=False)
        bad = np.flatnonzero(np.diff(ptr) < 0)
        if ptr[0] != 0 or bad.size:
            where = "its first entry" if ptr[0] != 0 else f"entry {int(bad[0]) + 1:,}"
            raise self._damaged(f"{name} does not count up from 0 ({where})")
        return ptr

    def _check_masks(self, n: int) -> None:
        """Atom and edge masks must cover the atoms and edges the pointers count.

        Appends extend the pointers before the masks, so a mask is never shorter than
        its pointer's total, also after an interrupted append; a shorter one means
        pointer arrays swapped or edited.
        """
        for mask, ptr, what in (
            ("atoms_mask", self._atoms_ptr, "atoms"),
            ("edges_mask", self._edges_ptr, "edges"),
        ):
            rows = self._meta_arrays.get(f"meta/{mask}")
            if rows is not None and n and rows.shape[0] < int(ptr[-1]):
                name = "atoms_ptr" if what == "atoms" else "edges_ptr"
                raise self._damaged(
                    f"meta/{name} counts {int(ptr[-1]):,} {what} in its {n:,} samples but "
                    f"meta/{mask} has {rows.shape[0]:,} rows (pointer arrays swapped or edited)"
                )

    def _data_arrays(
        self, root: Any, fields: dict[str, Any], n: int
    ) -> tuple[dict[str, str], dict[str, _Rows]]:
        """Levels and row readers of the core and custom arrays, checked against the counts."""
        totals = {"atom": int(self._atoms_ptr[-1]), "edge": int(self._edges_ptr[-1]), "system": n}
        levels: dict[str, str] = {}
        arrays: dict[str, _Rows] = {}
        for group_name, default in (("core", "atom"), ("custom", "system")):
            declared = dict(fields.get(group_name, {}) or {})
            group = root.get(group_name)
            present = set(group.array_keys()) if group is not None else set()
            lost = sorted(set(declared) - present)
            if lost:
                raise self._damaged(
                    f"its metadata lists {group_name} arrays {lost} that are not in the store"
                )
            for key in sorted(present):
                level = declared.get(key, default)
                problems = attribute_problems(group_name, key, level, group[key], ours=self._ours)
                if problems:
                    raise self._damaged("; ".join(problems))
                rows = _Rows(group[key], self._strict, self._files)
                need = totals.get(level, 0)
                if not rows.shape or rows.shape[0] < need:
                    have = rows.shape[0] if rows.shape else 0
                    raise self._damaged(
                        f"array {group_name}/{key} has {have:,} rows but the store's "
                        f"{n:,} samples need {need:,} ({level} level)"
                    )
                levels[key] = level
                arrays[key] = rows
        return levels, arrays

    def _samples_of_rows(self, level: str, start: int, stop: int) -> tuple[int, int]:
        """Physical samples ``[a, b)`` that own rows ``[start, stop)`` of a ``level`` array."""
        if level in ("system", "pointer"):
            return start, stop
        ptr = self._atoms_ptr if level == "atom" else self._edges_ptr
        first = max(0, int(np.searchsorted(ptr, start, side="right")) - 1)
        return first, max(first + 1, int(np.searchsorted(ptr, stop, side="left")))

    def _problem_text(self, name: str, level: str, problem: _ChunkProblem) -> str:
        a, b = problem.rows
        first, last = self._samples_of_rows(level, a, b)
        samples = f"sample {first:,}" if last - first == 1 else f"samples {first:,}-{last - 1:,}"
        return f"{problem.reason} (array {name}, rows {a:,}-{max(a, b - 1):,}: {samples})"

    def _read(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows of a meta array (``meta/...``) or a field, as ``StoreDamagedError`` if damaged."""
        rows = self._meta_arrays.get(name) or self._arrays[name]
        try:
            return rows.read(start, stop)
        except _ChunkProblem as problem:
            level = self._meta_levels.get(name) or self._levels[name]
            path = name if name.startswith("meta/") else self._array_path(name)
            raise self._damaged(self._problem_text(path, level, problem)) from None

    def _array_path(self, key: str) -> str:
        rows = self._arrays[key]
        return str(rows.array.store_path.path or key)

    @property
    def every_chunk_written(self) -> bool:
        """Whether the store writes every chunk (format 2), so an absent chunk is damage.

        False for stores of format 1 and the reference toolkit's, which leave out chunks
        of zeros: there an absent chunk reads as zeros.
        """
        return self._strict

    def verify(self) -> dict[str, Any]:
        """Read every chunk of every array; report what is missing, truncated or undecodable.

        Returns ``{"chunks": checked, "problems": [text, ...], "warnings": [text, ...],
        "absent_may_be_zeros": bool}``; warnings name arrays longer than the samples need
        (rows an interrupted append left, which are never read);
        the last is True for stores of an older format (or the reference toolkit's), which
        leave out chunks of zeros, so an absent chunk there may be zeros rather than damage.
        """
        if self._closed:
            raise RuntimeError("AtomicDataZarrReader is closed.")
        problems, chunks = [], 0
        named = [(name, rows, self._meta_levels[name]) for name, rows in self._meta_arrays.items()]
        named += [(self._array_path(k), r, self._levels[k]) for k, r in self._arrays.items()]
        n = self._num_samples
        need = {
            "atom": int(self._atoms_ptr[-1]),
            "edge": int(self._edges_ptr[-1]),
            "system": n,
            "pointer": n + 1,
        }
        warnings = []
        for name, rows, level in named:
            chunks += rows.num_chunks()
            problems += [self._problem_text(name, level, p) for p in rows.problems()]
            extra = (rows.shape[0] if rows.shape else 0) - need[level]
            if n and extra > 0:
                warnings.append(
                    f"array {name} has {extra:,} rows beyond the store's {n:,} samples (left by "
                    "an interrupted append; never read)"
                )
        return {
            "chunks": chunks,
            "problems": problems,
            "warnings": warnings,
            "absent_may_be_zeros": not self._strict,
        }

    def refresh(self) -> None:
        """Re-read pointers, masks and fields (after external appends or deletes)."""
        if self._closed:
            raise RuntimeError("Cannot refresh a closed AtomicDataZarrReader.")
        self._close_arrays()
        self._open()

    def _close_arrays(self) -> None:
        for rows in [
            *getattr(self, "_arrays", {}).values(),
            *getattr(self, "_meta_arrays", {}).values(),
        ]:
            rows.close()
        self._files.clear()  # keyed by the arrays' ids, which new arrays may reuse

    def close(self) -> None:
        """Drop the store handle and open files; reads afterwards raise ``RuntimeError``."""
        self._close_arrays()
        self._arrays = {}
        self._meta_arrays = {}
        self._root = None
        self._closed = True

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_arrays", "_meta_arrays", "_root"):
            state.pop(key, None)
        state.pop("_files", None)  # descriptors mean nothing in another process
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._files = _OpenFiles()
        self._arrays = {}
        self._meta_arrays = {}
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

    def _physical_one(self, index: int) -> int:
        """:meth:`_physical` of one index (the common case, without numpy's overhead)."""
        if self._closed:
            raise RuntimeError("AtomicDataZarrReader is closed.")
        n = self._num_active
        if not -n <= index < n:
            raise IndexError(
                f"Index {index} is out of range for zarr store {describe(self.store)} "
                f"with {n} active samples."
            )
        return int(self._active[index])

    def get_metadata(self, index: int) -> tuple[int, int]:
        """``(num_atoms, num_edges)`` of sample ``index`` from the cached pointers."""
        p = self._physical_one(int(index))
        return (
            int(self._atoms_ptr[p + 1] - self._atoms_ptr[p]),
            int(self._edges_ptr[p + 1] - self._edges_ptr[p]),
        )

    def _get_sample_metadata(self, index: int) -> dict[str, Any]:
        p = self._physical_one(index)
        return {
            "index": index,
            "source_file": describe(self.store),
            "physical_index": str(p),
            **self._stamp_meta,
        }

    # ------------------------------------------------------------------ reads
    def _load_sample(self, index: int) -> dict[str, torch.Tensor]:
        p = self._physical_one(index)
        return self._slice(self._read_run(p, p + 1), p, p, copy=False)

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
        raw = all(rows.mode != "zarr" for rows in self._arrays.values())
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
        levels = self._levels
        out = {}
        for key, rows in self._arrays.items():
            try:
                out[key] = rows.read(*spans[levels[key]])
            except _ChunkProblem as problem:
                text = self._problem_text(self._array_path(key), levels[key], problem)
                raise self._damaged(text) from None
            if key in self._casts:
                out[key] = self._cast_label(key, out[key], start)
        return out

    def _slice(
        self, block: dict[str, np.ndarray], start: int, p: int, copy: bool
    ) -> dict[str, torch.Tensor]:
        a0 = int(self._atoms_ptr[start])
        e0 = int(self._edges_ptr[start])
        a, b = int(self._atoms_ptr[p]) - a0, int(self._atoms_ptr[p + 1]) - a0
        c, d = int(self._edges_ptr[p]) - e0, int(self._edges_ptr[p + 1]) - e0
        s = p - start
        sample: dict[str, torch.Tensor] = {}
        labels, widen = self._labels, self._widen
        for key, values in block.items():
            level = self._levels[key]
            if level == "atom":
                part = values[a:b]
            elif level == "edge":
                part = values[c:d]
            else:
                part = values[s : s + 1]
            if key in labels and part.size and math.isnan(part.flat[0]) and np.isnan(part).all():
                continue  # a label this sample lacks, stored as NaN (as Batch fills it)
            if key == "neighbor_list":
                part = part - self._atoms_ptr[p]  # store-global -> local (a new array)
            elif key in widen:
                part = part.astype(np.int64)  # a new array
            elif copy:  # a duplicate request must not alias the first one's tensors
                part = part.copy()
            if not part.dtype.isnative:
                part = part.astype(part.dtype.newbyteorder("="))
            sample[key] = torch.from_numpy(part)
        pbc = block.get("pbc")
        if pbc is not None and not pbc[s].any() and not block["cell"][s].any():
            del sample["pbc"], sample["cell"]  # an open-boundary sample of a mixed store
        return sample
