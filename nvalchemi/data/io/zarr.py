"""A chunked on-disk store of ``AtomicData`` in zarr v3: writer and reader.

On-disk layout (kept compatible with the reference toolkit)::

    <store>/
      zarr.json      root attributes: "format" ("nvalchemi-atomicdata-zarr/3"),
                     "num_samples" (physical samples),
                     "fields": {"core": {name: level}, "custom": {name: level}},
                     and, when the stored neighbour lists carry one, "neighbor_list":
                     {"cutoff": float, "half_list": bool}
      meta/atoms_ptr     int64 [N+1]   cumulative atom counts
      meta/edges_ptr     int64 [N+1]   cumulative edge counts
      meta/samples_mask  bool  [N]     False = soft-deleted sample
      meta/atoms_mask    bool  [V]     False = atom of a deleted sample
      meta/edges_mask    bool  [E]     False = edge of a deleted sample
      core/<field>       atom fields [V, ...], edge fields [E, ...], system fields [N, ...]
      custom/<key>       arrays added with add_custom (leading dimension by level)

Each array's own ``zarr.json`` records the field it holds, its level and its unit
(``{"field": "positions", "level": "atom", "unit": "Å"}``); the reader refuses an
array holding another field than its name says (directories swapped on disk).

Dtypes are stored as given, except ``core/atomic_numbers``: uint8 (1..118; read back
as int64). ``core/neighbor_list`` holds *store-global* atom indices
(``atoms_ptr[sample]`` added), also for appended samples; the reader returns
sample-local indices. Storing neighbour lists (e.g. built with
``NeighborListTransform`` before writing) means training need not recompute them.

Small and fast at any size (see :class:`ZarrArrayConfig`): arrays are sharded (a
shard file holds many chunks and their index, so a million structures are a few hundred
files), chunks are small (16 KiB decoded; 4 KiB for system-level arrays) and
compressed with Blosc LZ4HC (decoded in microseconds) when that saves 3% or more, so a
random read decodes one small chunk per field whatever the store's size. Every chunk is
written, also chunks of zeros, so a missing chunk always means a damaged store (formats
2 and 3; stores of format 1 and the reference's left zero chunks out and still read,
with absent chunks as zeros). Stores of format 2 (one file per chunk, no per-array
records) read and take appends as they are; :meth:`AtomicDataZarrWriter.defragment`
rewrites one in the current layout.

Correctness rules of the writer: a write or append validates the whole incoming
data before touching the store; an append whose samples lack a stored non-label
field, or bring a field the store does not have, raises ``ValueError`` (labels,
``cell`` and ``pbc`` missing from appended samples are filled as ``Batch`` fills
them: NaN, zeros, False); the sample count attribute is updated last, so an
interrupted append leaves the earlier samples readable.

Reading is built for random access: pointer arrays are cached, requested samples
are merged into contiguous runs (one read per field per run), and arrays in a local
directory (the default) are read straight from the chunk and shard files: raw chunks
with ``preadv`` of the requested rows, compressed ones by decoding a chunk (arrays that
fit in the reader's ``cache_bytes``, 64 MiB, are decoded once and kept whole).
A chunk that is missing, truncated or undecodable raises
:class:`StoreDamagedError` naming the store, the array and the samples.

Example:
    >>> import torch
    >>> from nvalchemi.data import AtomicData
    >>> from nvalchemi.data.io.zarr import AtomicDataZarrReader, AtomicDataZarrWriter
    >>> data = AtomicData(atomic_numbers=torch.tensor([1, 8]), positions=torch.zeros(2, 3),
    ...                   energy=torch.tensor(-1.0))
    >>> store = {}  # or a directory path
    >>> AtomicDataZarrWriter(store).write([data, data])
    >>> reader = AtomicDataZarrReader(store)
    >>> len(reader), reader.read(1)[0]["energy"].tolist()
    (2, [[-1.0]])
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from nvalchemi._fileio import replace_dir, temporary_sibling
from nvalchemi.data.fields import FIELDS
from nvalchemi.data.io._zarr_common import (
    FORMAT,
    LEVELS,
    META_LEVELS,
    StoreDamagedError,
    array_attributes,
    describe,
    open_store,
    store_exists,
    writing_every_chunk,
    zarr_module,
)
from nvalchemi.data.io._zarr_reader import AtomicDataZarrReader

__all__ = [
    "CHUNK_BYTES",
    "AtomicDataZarrReader",
    "AtomicDataZarrWriter",
    "StoreDamagedError",
    "ZarrArrayConfig",
    "ZarrWriteConfig",
]

CHUNK_BYTES = 16 << 10
"""Default size of one chunk (decoded bytes): what a random read decodes."""
SHARD_BYTES = 64 << 20
"""Largest shard (decoded bytes): one file holding many chunks and their index."""
# "auto" compresses per-atom arrays (the bulk of a store) that shrink by 3% or more, and
# per-structure arrays (a few numbers per structure, read raw in a microsecond) only when
# they shrink by a quarter (fixed or repeated cells).
_WORTH_COMPRESSING = {"atom": 0.97, "edge": 0.97, "system": 0.75}
_SAMPLE_BYTES = 1 << 20  # "auto" judges codecs on the first MiB of the first write
_CLEVEL = 5  # LZ4HC's level: levels 1-9 decode alike; 5 writes ~50 MB/s per core
# A random read decodes one chunk per field: a structure's few system-level numbers (cell,
# energy, stress) come from chunks of 4 KiB, its atoms' rows from chunks of 16 KiB (the
# last chunk of a raw array is stored whole, padding and all: small chunks waste little).
_SYSTEM_CHUNK_DIVISOR = 4


# ------------------------------------------------------------------------ configs
def auto_compressors(data: np.ndarray, rows: int, worth: float = 0.97) -> tuple[Any, ...] | None:
    """The codec ``compressors="auto"`` picks for an array starting with ``data``.

    Blosc with LZ4HC (decoded at LZ4's speed, a few microseconds per chunk) and the
    byte or bit shuffle that shrinks the first MiB of ``data`` most, cut in chunks of
    ``rows`` rows as stored; ``None`` (raw bytes) unless that shrinks it to ``worth``
    of its size or less.
    """
    import numcodecs

    zarr = zarr_module()
    itemsize = max(1, int(data.dtype.itemsize))
    row_bytes = max(1, data[:1].nbytes) if data.ndim else itemsize
    head = np.ascontiguousarray(
        data[: max(rows, _SAMPLE_BYTES // row_bytes)] if data.ndim else data
    )
    if head.nbytes == 0:
        return None
    blocks = (
        [head[i : i + rows] for i in range(0, max(1, len(head)), rows)] if head.ndim else [head]
    )
    shuffles = ("noshuffle",) if itemsize == 1 else ("shuffle", "bitshuffle")
    modes = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
    best, size = None, worth * head.nbytes
    for shuffle in shuffles:
        codec = numcodecs.Blosc(cname="lz4hc", clevel=_CLEVEL, shuffle=modes[shuffle])
        encoded = sum(len(codec.encode(np.ascontiguousarray(b))) for b in blocks)
        if encoded < size:
            best, size = shuffle, encoded
    if best is None:
        return None
    return (zarr.codecs.BloscCodec(cname="lz4hc", clevel=_CLEVEL, shuffle=best, typesize=itemsize),)


def _fit(rows: int) -> int:
    """The next power of two at or above ``rows`` (at least 1)."""
    return 1 << max(0, rows - 1).bit_length()


class ZarrArrayConfig(BaseModel):
    """How arrays of one group (or one field) are encoded, chunked and sharded.

    By default (no ``chunk_size``) an array is stored in shards: files holding many
    chunks and an index of where each chunk lies, so that a store of a million
    structures is a few hundred files and a random read touches one small chunk per
    field. Chunks hold about ``chunk_bytes`` (16 KiB decoded; a quarter of that for
    system-level arrays, whose rows are one structure each); a shard
    holds what the first write holds (rounded up to a power of
    two), at most 64 MiB (decoded), so a small store stays small and an append
    rewrites at most about one shard per array. Write large stores in large first
    writes (``data convert`` writes about a million atoms at a time).

    ``compressors="auto"`` (the default) compresses an array with Blosc (LZ4HC, byte or
    bit shuffle, whichever shrinks the first MiB most) when that saves at least 3% (a
    quarter for system-level arrays, whose raw rows read fastest) and stores it raw
    otherwise; ``None`` stores raw bytes; a tuple of zarr codecs (e.g.
    ``(zarr.codecs.ZstdCodec(level=3),)``) is used as given.

    ``chunk_size`` (rows) fixes the chunks and turns sharding off unless ``shard_size``
    (rows, a multiple of ``chunk_size``) is given too: the reference toolkit's meaning.

    Every chunk is written, also chunks of zeros (zarr leaves those out by default),
    so a missing chunk always means a damaged store.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    compressors: tuple[Any, ...] | Literal["auto"] | None = "auto"
    filters: tuple[Any, ...] | None = None
    serializer: Any | None = None
    chunk_bytes: int = Field(default=CHUNK_BYTES, ge=1)
    chunk_size: int | None = Field(default=None, ge=1)
    shard_size: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check_shards(self) -> ZarrArrayConfig:
        if self.shard_size is not None and self.chunk_size is not None:  # noqa: SIM102
            if self.shard_size % self.chunk_size:
                raise ValueError(
                    f"shard_size={self.shard_size} must be a multiple of "
                    f"chunk_size={self.chunk_size}."
                )
        return self

    def chunk_rows(
        self, shape: tuple[int, ...], itemsize: int, compressed: bool = False, level: str = "atom"
    ) -> int:
        """Rows per chunk of a new array of ``shape`` (see the class docstring)."""
        if self.chunk_size is not None:
            return self.chunk_size
        target = self.chunk_bytes
        if level == "system":
            target = max(1, target // _SYSTEM_CHUNK_DIVISOR)
        rows = int(shape[0]) if shape else 1
        return max(1, min(target // _row_bytes(shape, itemsize), _fit(rows)))

    def shard_rows(self, shape: tuple[int, ...], itemsize: int, chunk: int) -> int | None:
        """Rows per shard (a multiple of ``chunk``), or ``None``: one file per chunk."""
        if self.shard_size is not None or self.chunk_size is not None:
            return self.shard_size
        rows = int(shape[0]) if shape else 1
        cap = max(1, SHARD_BYTES // (_row_bytes(shape, itemsize) * chunk))
        return chunk * min(cap, -(-_fit(rows) // chunk))

    def array_kwargs(self, data: np.ndarray, level: str = "atom") -> dict[str, Any]:
        """Keyword arguments of ``zarr.Group.create_array`` for a new array holding ``data``
        (rows of ``level``: ``"system"`` rows get smaller compressed chunks)."""
        shape = tuple(data.shape)
        trailing = tuple(max(1, d) for d in shape[1:])
        itemsize = data.dtype.itemsize
        compressors = self.compressors
        if compressors == "auto":
            rows = self.chunk_rows(shape, itemsize, True, level)
            compressors = auto_compressors(data, rows, _WORTH_COMPRESSING.get(level, 0.97))
        rows = self.chunk_rows(shape, itemsize, bool(compressors), level)
        kwargs: dict[str, Any] = {
            "chunks": (rows, *trailing),
            "compressors": compressors,
            "filters": self.filters if self.filters is not None else (),
        }
        shard = self.shard_rows(shape, itemsize, rows)
        if shard is not None and self.chunk_size is None and self.shard_size is not None:
            rows = min(rows, shard)  # a shard size alone: chunks that divide it
            shard = max(shard // rows, 1) * rows
            kwargs["chunks"] = (rows, *trailing)
        if shard is not None:
            kwargs["shards"] = (shard, *trailing)
        if self.serializer is not None:
            kwargs["serializer"] = self.serializer
        return kwargs


def _row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    trailing = tuple(max(1, d) for d in shape[1:])
    return max(1, itemsize * int(np.prod(trailing, dtype=np.int64)))


class ZarrWriteConfig(BaseModel):
    """Encoding of the ``meta``, ``core`` and ``custom`` groups, with per-field overrides."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    meta: ZarrArrayConfig = Field(default_factory=ZarrArrayConfig)
    core: ZarrArrayConfig = Field(default_factory=ZarrArrayConfig)
    custom: ZarrArrayConfig = Field(default_factory=ZarrArrayConfig)
    field_overrides: dict[str, ZarrArrayConfig] = Field(default_factory=dict)

    def for_array(self, group: str, name: str) -> ZarrArrayConfig:
        """The config of array ``group/name`` (a field override wins)."""
        return self.field_overrides.get(name) or getattr(self, group)


def _as_config(config: Any) -> ZarrWriteConfig:
    if config is None:
        return ZarrWriteConfig()
    if isinstance(config, ZarrWriteConfig):
        return config
    if isinstance(config, Mapping):
        return ZarrWriteConfig.model_validate(dict(config))
    raise TypeError(f"config must be a ZarrWriteConfig or a mapping; got {type(config).__name__}.")


# --------------------------------------------------------------------- payloads
class _Payload:
    """Validated numpy view of the data to write: counts, fields and levels."""

    def __init__(self, data: Any) -> None:
        from nvalchemi.data._neighbor_stamps import stamp_of
        from nvalchemi.data.atomic_data import AtomicData
        from nvalchemi.data.batch import Batch

        if isinstance(data, AtomicData):
            data = [data]
        if isinstance(data, Batch):
            stamp = stamp_of(data)
            batch = data
        else:
            items = list(data)
            if not items:
                raise ValueError("No data provided to write.")
            stamps = {stamp_of(d) for d in items}
            stamp = stamps.pop() if len(stamps) == 1 else None
            batch = Batch.from_data_list(items, device="cpu")
        if batch.num_graphs == 0:
            raise ValueError("No data provided to write.")
        self.num_samples = batch.num_graphs
        self.atom_counts = batch.num_nodes_per_graph.cpu().numpy().astype(np.int64)
        self.edge_counts = (
            batch.num_edges_per_graph.cpu().numpy().astype(np.int64)
            if "neighbor_list" in batch
            else np.zeros(self.num_samples, dtype=np.int64)
        )
        self.stamp = stamp if "neighbor_list" in batch else None
        self.arrays: dict[str, np.ndarray] = {}
        self.levels: dict[str, str] = {}
        counts = {
            "atom": int(self.atom_counts.sum()),
            "edge": int(self.edge_counts.sum()),
            "system": self.num_samples,
        }
        for key, _ in batch:
            level = batch.level_of(key)
            array = batch[key].detach().cpu().numpy()
            if array.shape[0] != counts[level]:
                raise ValueError(
                    f"Field {key!r} ({level} level) has {array.shape[0]} rows; expected "
                    f"{counts[level]}."
                )
            self.arrays[key] = array
            self.levels[key] = level
        if "atomic_numbers" in self.arrays:
            self.arrays["atomic_numbers"] = _species(self.arrays["atomic_numbers"])
        nl = self.arrays.get("neighbor_list")
        if nl is not None and nl.size and (nl.min() < 0 or nl.max() >= counts["atom"]):
            raise ValueError(
                f"neighbor_list holds atom indices outside [0, {counts['atom']}); the batch "
                "is inconsistent."
            )

    def atom_rows(self) -> int:
        return int(self.atom_counts.sum())

    def edge_rows(self) -> int:
        return int(self.edge_counts.sum())


def _species(values: np.ndarray) -> np.ndarray:
    """Atomic numbers as stored: one byte per atom (``AtomicData`` allows only 1..118)."""
    if values.size and (values.min() < 1 or values.max() > 255):
        raise ValueError(
            f"atomic_numbers holds {int(values.min())}..{int(values.max())}; atomic numbers "
            "must be 1..118 (build the samples as AtomicData, which checks them)."
        )
    return values.astype(np.uint8)


def _fill_missing(key: str, like: np.ndarray | tuple, dtype: np.dtype, rows: int) -> np.ndarray:
    """Values for appended samples lacking ``key``, or raise when it may not be missing."""
    shape = (rows, *like)
    if key == "cell":
        return np.zeros(shape, dtype=dtype)
    if key == "pbc":
        return np.zeros(shape, dtype=bool)
    spec = FIELDS.get(key)
    if spec is not None and spec.label and np.issubdtype(dtype, np.floating):
        return np.full(shape, np.nan, dtype=dtype)
    raise KeyError(key)


def _every_chunk(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a writer method with zarr writing every chunk (see ``writing_every_chunk``)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with writing_every_chunk():
            return method(*args, **kwargs)

    return wrapper


# ------------------------------------------------------------------------ writer
class AtomicDataZarrWriter:
    """Write, append, extend, soft-delete and compact an ``AtomicData`` zarr store.

    Args:
        store: a directory path, a ``dict`` (in-memory store) or any zarr store.
        config: :class:`ZarrWriteConfig` (or a mapping of it) for new arrays.

    Example:
        >>> writer = AtomicDataZarrWriter("data.zarr")       # doctest: +SKIP
        >>> writer.write(train_structures)                   # doctest: +SKIP
        >>> writer.append(more_structures)                   # doctest: +SKIP
        >>> writer.delete([3, 4]); writer.defragment()       # doctest: +SKIP
    """

    def __init__(self, store: Any, config: ZarrWriteConfig | Mapping | None = None) -> None:
        self.store = store
        self.config = _as_config(config)
        self._zstore = open_store(store)

    # ----------------------------------------------------------------- helpers
    def _root(self, mode: str = "r+") -> Any:
        zarr = zarr_module()
        if not store_exists(self.store):
            raise FileNotFoundError(
                f"Zarr store {describe(self.store)} does not exist; call write() first."
            )
        return zarr.open_group(self._zstore, mode=mode)

    def _create(self, group: Any, name: str, data: np.ndarray, group_name: str, level: str) -> Any:
        config = self.config.for_array(group_name, name)
        kwargs = config.array_kwargs(data, level)
        attributes = array_attributes(group_name, name, level)
        array = group.create_array(
            name, shape=data.shape, dtype=data.dtype, attributes=attributes, **kwargs
        )
        if data.size:
            array[...] = data
        return array

    def _write_new(self, payload: _Payload, root: Any) -> None:
        meta = root.require_group("meta")
        core = root.require_group("core")
        root.require_group("custom")
        for key, array in payload.arrays.items():
            self._create(core, key, array, "core", payload.levels[key])
        atoms_ptr = np.concatenate([[0], np.cumsum(payload.atom_counts)]).astype(np.int64)
        edges_ptr = np.concatenate([[0], np.cumsum(payload.edge_counts)]).astype(np.int64)
        for name, values in (
            ("atoms_ptr", atoms_ptr),
            ("edges_ptr", edges_ptr),
            ("samples_mask", np.ones(payload.num_samples, bool)),
            ("atoms_mask", np.ones(payload.atom_rows(), bool)),
            ("edges_mask", np.ones(payload.edge_rows(), bool)),
        ):
            self._create(meta, name, values, "meta", META_LEVELS[name])
        attrs = {
            "format": FORMAT,
            "fields": {"core": dict(payload.levels), "custom": {}},
            "neighbor_list": _stamp_attr(payload.stamp),
            "num_samples": payload.num_samples,
        }
        root.attrs.update(attrs)

    # ------------------------------------------------------------------ write
    @_every_chunk
    def write(self, data: Any) -> None:
        """Create the store from ``data`` (``AtomicData``, a list of them, or a ``Batch``).

        Raises:
            FileExistsError: the store already exists (use :meth:`append`).
            ValueError: no samples, or inconsistent data.
        """
        if store_exists(self.store):
            raise FileExistsError(
                f"Zarr store {describe(self.store)} already exists; use append() to add "
                "samples or choose a new path."
            )
        payload = _Payload(data)
        root = zarr_module().open_group(self._zstore, mode="w")
        self._write_new(payload, root)

    # ----------------------------------------------------------------- append
    @_every_chunk
    def append(self, data: Any) -> None:
        """Add samples at the end of an existing store.

        Neighbour lists are offset by the atoms already stored. Appended samples
        must carry the same fields as the store (labels, ``cell`` and ``pbc`` may
        be missing and are then stored as NaN / zeros / False), with the same
        dtypes and trailing shapes, plus every custom array as a field of the same
        name. Nothing is written unless all of that holds.

        Raises:
            FileNotFoundError: the store does not exist.
            ValueError: new or missing fields, dtype or shape mismatches,
                neighbour lists built with another cutoff.
        """
        root = self._root()
        if isinstance(data, Sequence) and not isinstance(data, (str, bytes)) and len(data) == 0:
            return
        payload = _Payload(data)
        fields = dict(root.attrs.get("fields", {}))
        core_levels = dict(fields.get("core", {}))
        custom_levels = dict(fields.get("custom", {}))
        num_samples = int(root.attrs.get("num_samples", 0))
        if num_samples == 0 and not core_levels:
            self._write_new(payload, root)
            return
        meta, core = root["meta"], root["core"]
        custom = root.get("custom")
        atoms_ptr = np.asarray(meta["atoms_ptr"][: num_samples + 1], dtype=np.int64)
        edges_ptr = np.asarray(meta["edges_ptr"][: num_samples + 1], dtype=np.int64)
        totals = {"atom": int(atoms_ptr[-1]), "edge": int(edges_ptr[-1]), "system": num_samples}
        new_rows = {
            "atom": payload.atom_rows(),
            "edge": payload.edge_rows(),
            "system": payload.num_samples,
        }
        plan = self._plan_append(payload, core, custom, core_levels, custom_levels, new_rows)
        stamp = self._merged_stamp(root.attrs.get("neighbor_list"), payload)
        if "neighbor_list" in plan:
            group, values = plan["neighbor_list"]
            plan["neighbor_list"] = (group, values + totals["atom"])
        # Data arrays first, pointers and masks next, the sample count last.
        for key, (group, values) in plan.items():
            level = core_levels.get(key) or custom_levels[key]
            _extend(group[key], totals[level], values)
        _extend(meta["atoms_ptr"], num_samples + 1, totals["atom"] + np.cumsum(payload.atom_counts))
        _extend(meta["edges_ptr"], num_samples + 1, totals["edge"] + np.cumsum(payload.edge_counts))
        _extend(meta["samples_mask"], num_samples, np.ones(payload.num_samples, bool))
        _extend(meta["atoms_mask"], totals["atom"], np.ones(new_rows["atom"], bool))
        _extend(meta["edges_mask"], totals["edge"], np.ones(new_rows["edge"], bool))
        root.attrs.update(
            {"neighbor_list": stamp, "num_samples": num_samples + payload.num_samples}
        )

    @staticmethod
    def _plan_append(
        payload: _Payload,
        core: Any,
        custom: Any,
        core_levels: dict[str, str],
        custom_levels: dict[str, str],
        new_rows: dict[str, int],
    ) -> dict[str, tuple[Any, np.ndarray]]:
        """Check the incoming fields against the store; return what to write where."""
        incoming = set(payload.arrays)
        stored = set(core_levels) | set(custom_levels)
        new = sorted(incoming - stored)
        if new:
            raise ValueError(
                f"Cannot append: the samples carry fields {new} that the store does not have "
                f"(stored: {sorted(stored)}). Drop them, write a new store, or add them to the "
                "store first with add_custom()."
            )
        if payload.edge_rows() and "neighbor_list" not in core_levels:
            raise ValueError("Cannot append samples with neighbour lists to a store without them.")
        plan: dict[str, tuple[Any, np.ndarray]] = {}
        problems: list[str] = []
        for key in sorted(stored):
            if key in core_levels:
                group, level = core, core_levels[key]
            else:
                group, level = custom, custom_levels[key]
            array = group[key]
            dtype = np.dtype(array.dtype)
            if key in payload.arrays:
                values = payload.arrays[key]
                if key == "atomic_numbers" and np.issubdtype(dtype, np.integer):
                    values = values.astype(dtype)  # stores of format 1 hold int64
                if payload.levels[key] != level:
                    problems.append(f"{key!r} is {payload.levels[key]}-level, stored as {level}")
                elif values.dtype != dtype:
                    problems.append(
                        f"{key!r} has dtype {values.dtype}, stored as {dtype} (cast the data, "
                        "e.g. data.to(dtype=...))"
                    )
                elif values.shape[1:] != tuple(array.shape[1:]):
                    problems.append(
                        f"{key!r} has trailing shape {list(values.shape[1:])}, stored as "
                        f"{list(array.shape[1:])}"
                    )
                else:
                    plan[key] = (group, values)
                continue
            try:
                plan[key] = (group, _fill_missing(key, array.shape[1:], dtype, new_rows[level]))
            except KeyError:
                problems.append(
                    f"{key!r} is missing from the appended samples "
                    f"({'custom array' if key in custom_levels else 'stored field'}; only labels, "
                    "cell and pbc may be missing)"
                )
        if problems:
            raise ValueError("Cannot append: " + "; ".join(problems) + ".")
        return plan

    @staticmethod
    def _merged_stamp(stored: Any, payload: _Payload) -> Any:
        """The store's neighbour-list stamp after the append (None: unknown settings)."""
        incoming = _stamp_attr(payload.stamp)
        if stored is not None and incoming is not None and stored != incoming:
            raise ValueError(
                f"Cannot append: the store's neighbour lists were built with {stored} but the "
                f"appended ones with {incoming}; rebuild them with the store's settings."
            )
        # Lists of unknown settings make the whole store's lists unknown.
        return stored if incoming == stored else None

    # ---------------------------------------------------------------- custom
    @_every_chunk
    def add_custom(self, key: str, data: Any, level: str, *, overwrite: bool = False) -> None:
        """Store a user array under ``custom/<key>`` with one row per atom, edge or sample.

        ``data`` must have as many rows as the store has physical atoms / edges /
        samples (deleted ones included).
        """
        if level not in LEVELS:
            raise ValueError(f"level must be one of {list(LEVELS)}; got {level!r}.")
        root = self._root()
        array = data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
        num_samples = int(root.attrs.get("num_samples", 0))
        meta = root["meta"]
        expected = {
            "atom": int(meta["atoms_ptr"][num_samples]) if num_samples else 0,
            "edge": int(meta["edges_ptr"][num_samples]) if num_samples else 0,
            "system": num_samples,
        }[level]
        if array.ndim == 0 or array.shape[0] != expected:
            raise ValueError(
                f"add_custom({key!r}): {level}-level data needs {expected} rows; got shape "
                f"{list(array.shape)}."
            )
        fields = dict(root.attrs.get("fields", {"core": {}, "custom": {}}))
        if key in fields.get("core", {}):
            raise ValueError(f"add_custom({key!r}): {key!r} is already a core field.")
        custom_levels = dict(fields.get("custom", {}))
        group = root.require_group("custom")
        if key in custom_levels or key in group:
            if not overwrite:
                raise ValueError(
                    f"add_custom({key!r}): the store already has it; pass overwrite=True."
                )
            del group[key]
        self._create(group, key, array, "custom", level)
        custom_levels[key] = level
        fields["custom"] = custom_levels
        root.attrs["fields"] = fields

    # ---------------------------------------------------------------- delete
    @_every_chunk
    def delete(self, indices: Any) -> None:
        """Soft-delete samples by *physical* index (masks set False, their rows zeroed).

        Pointers are untouched; readers skip deleted samples after ``refresh()``;
        :meth:`defragment` removes them for good.
        """
        root = self._root()
        num_samples = int(root.attrs.get("num_samples", 0))
        if isinstance(indices, torch.Tensor):
            indices = indices.tolist()
        idx = np.atleast_1d(np.asarray(indices, dtype=np.int64))
        bad = idx[(idx < -num_samples) | (idx >= num_samples)]
        if bad.size:
            raise IndexError(
                f"delete: sample indices {bad.tolist()} out of range for {num_samples} samples."
            )
        idx = np.unique(idx % num_samples) if num_samples else idx
        if idx.size == 0:
            return
        meta = root["meta"]
        atoms_ptr = np.asarray(meta["atoms_ptr"][: num_samples + 1], dtype=np.int64)
        edges_ptr = np.asarray(meta["edges_ptr"][: num_samples + 1], dtype=np.int64)
        fields = root.attrs.get("fields", {})
        for start, stop in _runs(idx):
            spans = {
                "system": (start, stop),
                "atom": (int(atoms_ptr[start]), int(atoms_ptr[stop])),
                "edge": (int(edges_ptr[start]), int(edges_ptr[stop])),
            }
            for group_name in ("core", "custom"):
                for key, level in fields.get(group_name, {}).items():
                    a, b = spans[level]
                    if b > a:
                        array = root[group_name][key]
                        array[a:b] = np.zeros((b - a, *array.shape[1:]), dtype=array.dtype)
            meta["samples_mask"][start:stop] = False
            for name, level in (("atoms_mask", "atom"), ("edges_mask", "edge")):
                a, b = spans[level]
                if b > a:
                    meta[name][a:b] = False

    # ------------------------------------------------------------- defragment
    @_every_chunk
    def defragment(self, config: ZarrWriteConfig | Mapping | None = None) -> None:
        """Rewrite the store without deleted samples (optionally with a new ``config``).

        Neighbour-list indices are renumbered. Local stores are rebuilt in a
        sibling directory and swapped in; other stores are rewritten in place.
        Loads the active data into memory. A damaged store (see
        :meth:`AtomicDataZarrReader.verify`) is refused: rewriting it would turn lost
        chunks into zeros in a store that then looks whole.

        Raises:
            StoreDamagedError: a chunk is missing (format 2), truncated or undecodable.
        """
        if config is not None:
            self.config = _as_config(config)
        root = self._root(mode="r")
        report = AtomicDataZarrReader(self.store).verify()
        problems = [
            p
            for p in report["problems"]
            if not (report["absent_may_be_zeros"] and " is missing " in p)
        ]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise StoreDamagedError(
                f"Cannot defragment zarr store {describe(self.store)}: {problems[0]}{more}. "
                "Fix: copy it again from its source, or rewrite it from the source files."
            )
        num_samples = int(root.attrs.get("num_samples", 0))
        fields = root.attrs.get("fields", {"core": {}, "custom": {}})
        stamp = root.attrs.get("neighbor_list")
        meta = root["meta"]
        keep = np.asarray(meta["samples_mask"][:num_samples], dtype=bool)
        atoms_ptr = np.asarray(meta["atoms_ptr"][: num_samples + 1], dtype=np.int64)
        edges_ptr = np.asarray(meta["edges_ptr"][: num_samples + 1], dtype=np.int64)
        kept = np.flatnonzero(keep)
        atom_counts = np.diff(atoms_ptr)[kept]
        edge_counts = np.diff(edges_ptr)[kept]
        rows = {
            "atom": _ranges(atoms_ptr[kept], atom_counts),
            "edge": _ranges(edges_ptr[kept], edge_counts),
            "system": kept,
        }
        arrays: dict[str, dict[str, np.ndarray]] = {"core": {}, "custom": {}}
        for group_name in ("core", "custom"):
            for key, level in fields.get(group_name, {}).items():
                full = np.asarray(root[group_name][key][...])
                arrays[group_name][key] = full[rows[level]]
        if "neighbor_list" in arrays["core"]:
            new_atoms_ptr = np.concatenate([[0], np.cumsum(atom_counts)])[:-1]
            delta = np.repeat(new_atoms_ptr - atoms_ptr[kept], edge_counts)
            arrays["core"]["neighbor_list"] = arrays["core"]["neighbor_list"] + delta[:, None]
        new_attrs = {
            "format": FORMAT,
            "fields": fields if kept.size else {"core": {}, "custom": {}},
            "neighbor_list": stamp if kept.size else None,
            "num_samples": int(kept.size),
        }

        def build(group: Any) -> None:
            if kept.size:
                meta_g = group.require_group("meta")
                for group_name in ("core", "custom"):
                    target = group.require_group(group_name)
                    for key, values in arrays[group_name].items():
                        self._create(target, key, values, group_name, fields[group_name][key])
                for name, values in (
                    ("atoms_ptr", np.concatenate([[0], np.cumsum(atom_counts)]).astype(np.int64)),
                    ("edges_ptr", np.concatenate([[0], np.cumsum(edge_counts)]).astype(np.int64)),
                    ("samples_mask", np.ones(kept.size, bool)),
                    ("atoms_mask", np.ones(int(atom_counts.sum()), bool)),
                    ("edges_mask", np.ones(int(edge_counts.sum()), bool)),
                ):
                    self._create(meta_g, name, values, "meta", META_LEVELS[name])
            else:
                for name in ("meta", "core", "custom"):
                    group.require_group(name)
            group.attrs.update(new_attrs)

        zarr = zarr_module()
        if isinstance(self.store, (str, os.PathLike)):
            tmp = temporary_sibling(self.store, "defragmenting")
            try:
                build(zarr.open_group(zarr.storage.LocalStore(str(tmp)), mode="w"))
                replace_dir(tmp, self.store)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # ours; gone once swapped in
            self._zstore = open_store(self.store)
        else:
            build(zarr.open_group(self._zstore, mode="w"))


def _stamp_attr(stamp: tuple[float, bool] | None) -> dict | None:
    return None if stamp is None else {"cutoff": float(stamp[0]), "half_list": bool(stamp[1])}


def _extend(array: Any, old_rows: int, values: np.ndarray) -> None:
    """Grow ``array`` to ``old_rows + len(values)`` rows and write ``values`` at the end."""
    values = np.asarray(values)
    new_rows = old_rows + values.shape[0]
    if array.shape[0] != new_rows:
        array.resize((new_rows, *array.shape[1:]))
    if values.shape[0]:
        array[old_rows:new_rows] = values.astype(array.dtype, copy=False)


def _runs(sorted_idx: np.ndarray) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of consecutive values in a sorted unique array."""
    if sorted_idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_idx) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [sorted_idx.size]])
    return [(int(sorted_idx[a]), int(sorted_idx[b - 1]) + 1) for a, b in zip(starts, stops)]


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + c)`` for every pair."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return offsets + np.arange(total, dtype=np.int64)
