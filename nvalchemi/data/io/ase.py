"""Read structures lazily from extxyz files and ASE databases; write extxyz.

:class:`ASEReader` never parses a whole file up front. For extxyz it scans the file
once for the byte offset of every frame (numpy over raw bytes, one Python step per
frame, not per line), caches that index on disk, and parses a single frame with
ASE on demand; compressed files (``.gz``, ``.bz2``, ``.xz``) are decompressed once
into the cache directory. For ASE databases (``.db``) it lists the row ids once
and fetches one row per read. Any other ASE-readable format is read whole at
construction (fine for small files).

Every problem with the input raises an error naming the file and the frame: a
malformed or truncated file, an empty file, a frame without a required label,
NaN/inf values, wrong shapes, an out-of-range index.

Units are ASE's: eV, Å, eV/Å, eV/Å³ (stress positive = tensile).

Example:
    >>> from nvalchemi.data.io.ase import ASEReader
    >>> reader = ASEReader("train.extxyz", required_labels=("energy", "forces"))  # doctest: +SKIP
    >>> data = reader.read_data(0)           # AtomicData  # doctest: +SKIP
    >>> fields, meta = reader.read(0)        # tensors + {"index", "source_file", "frame"}  # doctest: +SKIP
"""

from __future__ import annotations

import bz2
import functools
import gzip
import hashlib
import io
import logging
import lzma
import os
import shutil
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nvalchemi._fileio import atomic_path, write_atomic
from nvalchemi.data._ase_convert import valid_calculator_results
from nvalchemi.data.atomic_data import AtomicData
from nvalchemi.data.datapipes.reader import Reader
from nvalchemi.data.label_precision import EXTENSIVE_LABELS, rounding_warning, worst_rounding
from nvalchemi.data.neighbors import check_neighbor_explosion
from nvalchemi.data.weights import CONFIG_TYPE_KEY, WEIGHT_FIELDS, check_config_type_weights

__all__ = ["ASEReader", "default_cache_dir", "write_extxyz"]

_log = logging.getLogger(__name__)

_EXTXYZ_SUFFIXES = (".xyz", ".extxyz")
_COMPRESSION = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_LABELS = ("energy", "forces", "stress", "virial", "dipole", "charges")
# (from_atoms keyword, its default key, calculator results it may fall back to)
_LABEL_KEYS = (
    ("energy_key", "energy", ("energy", "free_energy")),
    ("forces_key", "forces", ("forces",)),
    ("stress_key", "stress", ("stress",)),
    ("virials_key", "virials", ("virial",)),
    ("dipole_key", "dipole", ("dipole",)),
    ("charges_key", "charges", ("charges",)),
)
_SCAN_CHUNK = 1 << 24  # bytes per read while indexing
_INDEX_VERSION = 1


def default_cache_dir() -> Path:
    """Where frame indexes and decompressed copies go: ``$NVALCHEMI_CACHE_DIR``,
    else ``~/.cache/nvalchemi``."""
    root = os.environ.get("NVALCHEMI_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "nvalchemi"


def _file_key(path: Path) -> str:
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_INDEX_VERSION}"
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def _atomic_save(path: Path, array: np.ndarray) -> None:
    try:
        write_atomic(path, lambda handle: np.save(handle, array))
    except OSError as exc:  # a read-only cache only costs a rescan next time
        _log.debug("Could not cache %s: %s", path, exc)


# ----------------------------------------------------------------------- extxyz
def scan_extxyz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets ``[F + 1]`` and first line numbers ``[F]`` (1-based) of every frame.

    Raises ``ValueError`` naming the file, frame and line for a header that is not an
    atom count, and for a truncated last frame; blank lines between frames are
    skipped.
    """
    path = Path(path)
    starts: list[int] = []
    lines: list[int] = []
    skip = 0  # lines left in the current frame
    header_line = 0  # line and atom count of the last frame header
    header_count = 0
    line_no = 0  # lines consumed before buffer[0]
    buffer = b""
    base = 0  # file offset of buffer[0]
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(_SCAN_CHUNK)
            at_eof = not chunk
            buffer += chunk
            if at_eof and buffer and not buffer.endswith(b"\n"):
                buffer += b"\n"  # last line without a newline
            ends = np.flatnonzero(np.frombuffer(buffer, dtype=np.uint8) == 10)
            i, start = 0, 0
            while i < len(ends):
                if skip:
                    take = min(skip, len(ends) - i)
                    i += take
                    skip -= take
                    start = int(ends[i - 1]) + 1
                    continue
                end = int(ends[i])
                text = buffer[start:end].strip()
                if text:
                    try:
                        count = int(text)
                        if count < 0:
                            raise ValueError
                    except ValueError:
                        raise ValueError(
                            f"{path}: frame {len(starts)} (line {line_no + i + 1}) is malformed: "
                            f"expected the number of atoms, got {text[:60].decode(errors='replace')!r}."
                            + _previous_frame_hint(len(starts), header_line, header_count)
                        ) from None
                    starts.append(base + start)
                    lines.append(line_no + i + 1)
                    header_line = line_no + i + 1
                    header_count = count
                    skip = count + 1
                i += 1
                start = end + 1
            line_no += len(ends)
            base += start
            buffer = buffer[start:]
            if at_eof:
                break
        size = handle.tell()
    if skip:
        raise ValueError(
            f"{path}: frame {len(starts) - 1} (line {header_line}) is truncated: the file ends "
            f"{skip} line(s) before the frame's last atom line."
        )
    offsets = np.asarray([*starts, min(base, size)], dtype=np.int64)
    return offsets, np.asarray(lines, dtype=np.int64)


def _previous_frame_hint(frame: int, header_line: int, count: int) -> str:
    # A frame with one atom line too few or too many shifts every later line, so the
    # error shows up at the next header: point at the frame that is really wrong.
    if frame == 0:
        return ""
    return (
        f" If this line looks right, the previous frame {frame - 1} (line {header_line}) "
        f"may have more or fewer atom lines than its count of {count}: check that frame."
    )


class _ExtxyzSource:
    """One extxyz file: a cached frame index and single-frame parsing."""

    def __init__(self, path: Path, cache_dir: Path | None) -> None:
        self.path = path
        self.data_path = self._plain_copy(path, cache_dir)
        self.offsets, self.lines = self._index(cache_dir)
        self._handle: Any = None
        self._pid = -1

    def _plain_copy(self, path: Path, cache_dir: Path | None) -> Path:
        opener = _COMPRESSION.get(path.suffix.lower())
        if opener is None:
            return path
        target_dir = cache_dir or default_cache_dir()
        target = target_dir / f"{path.stem}.{_file_key(path)}.extxyz"
        if not target.exists():
            _log.info("Decompressing %s to %s (once) for random access.", path, target)
            try:
                with opener(path, "rb") as src:
                    write_atomic(target, functools.partial(shutil.copyfileobj, src, length=1 << 22))
            except (OSError, EOFError, lzma.LZMAError) as exc:
                raise ValueError(
                    f"{path}: cannot decompress ({exc}); the file is corrupt."
                ) from exc
        return target

    def _index(self, cache_dir: Path | None) -> tuple[np.ndarray, np.ndarray]:
        key = _file_key(self.data_path)
        cache = (cache_dir or default_cache_dir()) / "extxyz-index" / f"{key}.npy"
        try:
            table = np.load(cache)
            return table[0].copy(), table[1, :-1].copy()
        except (OSError, ValueError, IndexError):
            pass
        offsets, lines = scan_extxyz(self.data_path)
        _atomic_save(cache, np.stack([offsets, np.append(lines, 0)]))
        return offsets, lines

    def __len__(self) -> int:
        return len(self.lines)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handle": None, "_pid": -1}

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def _fd(self) -> int:
        if self._pid != os.getpid() or self._handle is None:
            self._handle = open(self.data_path, "rb")  # noqa: SIM115 (kept open for reuse)
            self._pid = os.getpid()
        return self._handle.fileno()

    def info(self, frame: int) -> dict[str, Any]:
        """The ``atoms.info`` entries of a frame's comment line, without parsing its atoms."""
        from ase.io.extxyz import key_val_str_to_dict

        start, stop = int(self.offsets[frame]), int(self.offsets[frame + 1])
        size, raw = 4096, b""
        while True:  # the count line and the comment line, whatever their length
            raw = os.pread(self._fd(), min(size, stop - start), start)
            if raw.count(b"\n") >= 2 or len(raw) >= stop - start:
                break
            size *= 4
        lines = raw.split(b"\n")
        comment = lines[1].decode("utf-8", errors="replace") if len(lines) > 1 else ""
        try:
            return key_val_str_to_dict(comment)
        except Exception as exc:
            raise ValueError(
                f"{self.path}: frame {frame} (line {int(self.lines[frame]) + 1}): the comment line "
                f"cannot be parsed: {type(exc).__name__}: {exc}"
            ) from exc

    def atoms(self, frame: int) -> Any:
        from ase.io import read

        start, stop = int(self.offsets[frame]), int(self.offsets[frame + 1])
        raw = os.pread(self._fd(), stop - start, start)
        try:
            return read(io.StringIO(raw.decode("utf-8")), index=0, format="extxyz")
        except Exception as exc:
            raise ValueError(
                f"{self.path}: frame {frame} (line {int(self.lines[frame])}) cannot be parsed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


# ----------------------------------------------------------------------- ASE db
class _DbSource:
    """One ASE database: row ids listed once, one row fetched per read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        db = self._connect()
        self.ids = np.asarray(
            [row.id for row in db.select(include_data=False, columns=["id"])], dtype=np.int64
        )
        self._db: Any = None

    def _connect(self) -> Any:
        from ase.db import connect

        try:
            return connect(str(self.path), type="db", create_indices=False)
        except Exception as exc:
            raise ValueError(f"{self.path}: not a readable ASE database ({exc}).") from exc

    def __len__(self) -> int:
        return len(self.ids)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_db": None}

    def close(self) -> None:
        self._db = None

    def info(self, frame: int) -> dict[str, Any]:
        """The key-value pairs of a row (its ``atoms.info`` but arrays kept as data)."""
        if self._db is None:
            self._db = self._connect()
        return dict(self._db.get(id=int(self.ids[frame])).key_value_pairs)

    def atoms(self, frame: int) -> Any:
        if self._db is None:
            self._db = self._connect()
        try:
            row = self._db.get(id=int(self.ids[frame]))
            atoms = row.toatoms()
        except Exception as exc:
            raise ValueError(
                f"{self.path}: frame {frame} (row id {int(self.ids[frame])}) cannot be read: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        atoms.info.update(row.key_value_pairs)
        for key, value in (row.get("data") or {}).items():
            value = np.array(value)  # a writable copy (database buffers are read-only)
            if value.ndim and value.shape[0] == len(atoms) and key not in atoms.info:
                atoms.arrays[key] = value
            else:
                atoms.info[key] = value
        return atoms


class _EagerSource:
    """Any other ASE-readable file, read whole at construction."""

    def __init__(self, path: Path, format: str | None) -> None:
        from ase.io import read

        self.path = path
        try:
            self.frames = list(read(path, index=":", format=format))
        except Exception as exc:
            raise ValueError(
                f"{path}: cannot be read by ASE ({type(exc).__name__}: {exc})."
            ) from exc

    def __len__(self) -> int:
        return len(self.frames)

    def close(self) -> None:
        pass

    def info(self, frame: int) -> dict[str, Any]:
        return dict(self.frames[frame].info)

    def atoms(self, frame: int) -> Any:
        # Atoms.copy() leaves the calculator behind, and with it the labels of
        # formats that store them as calculator results (ASE trajectories).
        original = self.frames[frame]
        atoms = original.copy()
        results = valid_calculator_results(original)
        if results:
            from ase.calculators.singlepoint import SinglePointCalculator

            atoms.calc = SinglePointCalculator(atoms, **results)
        return atoms


def _open_source(path: Path, format: str | None, cache_dir: Path | None) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"No such structure file: {path}")
    name = path.name.lower()
    for compression in _COMPRESSION:
        name = name.removesuffix(compression)
    plain = Path(name).suffix
    fmt = (format or "").lower()
    if fmt in ("extxyz", "xyz") or (not fmt and plain in _EXTXYZ_SUFFIXES):
        return _ExtxyzSource(path, cache_dir)
    if fmt == "db" or (not fmt and plain == ".db"):
        return _DbSource(path)
    return _EagerSource(path, format)


# ------------------------------------------------------------------------ reader
class ASEReader(Reader):
    """Lazy reader of extxyz files and ASE databases (one or several files).

    Args:
        path_or_paths: a file or a list of files; their frames are concatenated.
        index: which frames to keep: ``":"`` (all), an ASE-style string such as
            ``"0:1000:2"``, an int, a slice or a list of ints (over the
            concatenated frames).
        format: force ``"extxyz"`` or ``"db"`` (default: from the suffix).
        energy_key, forces_key, stress_key, virials_key, dipole_key, charges_key:
            where labels live in ``atoms.info`` / ``atoms.arrays`` (e.g.
            ``energy_key="REF_energy"``); labels on an attached calculator are used
            when the key is absent.
        dtype: dtype of positions and cell; ``label_dtype`` of labels (default
            ``dtype``). Labels below float64 that round a total energy or virial by
            more than 0.1 meV/atom warn once (see :mod:`nvalchemi.data.label_precision`).
        required_labels: labels every frame must carry, e.g. ``("energy", "forces")``;
            a frame without one raises ``ValueError`` naming file and frame.
        cache_dir: where frame indexes and decompressed copies are kept
            (default :func:`default_cache_dir`).
        as_atomic_data: ``read``/``read_many`` return the validated ``AtomicData``
            (with ``info``) instead of a dict of its tensors; ``Dataset`` accepts
            either, and this skips a second validation.
        config_type_weights: ``{config_type: weight}``: multiplies the ``loss_weight`` of
            every structure whose ``atoms.info["config_type"]`` is listed (MACE's
            ``--config_type_weights``). Weights in ``atoms.info`` (``config_weight``,
            ``config_energy_weight``, ``config_forces_weight``, ``config_stress_weight``,
            ``config_virials_weight`` and the aliases of :mod:`nvalchemi.data.weights`)
            are always read.

    ``validates = True``: the fields come from a validated ``AtomicData``, so
    ``Dataset`` need not check them again.

    ``read(i)`` returns ``(fields, metadata)`` with ``metadata`` holding ``index``,
    ``source_file``, ``frame`` (within that file) and ``info`` (the structure's
    non-label ``atoms.info``); ``read_data(i)`` returns the ``AtomicData``.
    """

    validates = True

    def __init__(
        self,
        path_or_paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        index: Any = ":",
        format: str | None = None,
        energy_key: str = "energy",
        forces_key: str = "forces",
        stress_key: str = "stress",
        virials_key: str = "virials",
        dipole_key: str = "dipole",
        charges_key: str = "charges",
        dtype: torch.dtype = torch.float32,
        label_dtype: torch.dtype | None = None,
        required_labels: Iterable[str] = (),
        cache_dir: str | os.PathLike | None = None,
        as_atomic_data: bool = False,
        config_type_weights: dict[str, float] | None = None,
        pin_memory: bool = False,
        include_index_in_metadata: bool = True,
    ) -> None:
        super().__init__(pin_memory=pin_memory, include_index_in_metadata=include_index_in_metadata)
        self.as_atomic_data = bool(as_atomic_data)
        self.config_type_weights = check_config_type_weights(config_type_weights)
        if isinstance(path_or_paths, (str, os.PathLike)):
            path_or_paths = [path_or_paths]
        self.paths = [Path(p) for p in path_or_paths]
        if not self.paths:
            raise ValueError("ASEReader needs at least one file.")
        self.required_labels = tuple(required_labels)
        unknown = [k for k in self.required_labels if k not in _LABELS]
        if unknown:
            raise ValueError(f"Unknown required labels {unknown}; choose from {list(_LABELS)}.")
        self.atoms_kwargs = {
            "energy_key": energy_key,
            "forces_key": forces_key,
            "stress_key": stress_key,
            "virials_key": virials_key,
            "dipole_key": dipole_key,
            "charges_key": charges_key,
            "dtype": dtype,
            "label_dtype": label_dtype,
        }
        # Labels narrower than float64 are read in float64 first, to see what rounding costs.
        self._label_dtype = label_dtype or dtype
        self._exact_kwargs = (
            {**self.atoms_kwargs, "label_dtype": torch.float64}
            if self._label_dtype != torch.float64
            else self.atoms_kwargs
        )
        self._rounding_warned = False
        # A label read from a renamed key (e.g. REF_energy) must not fall back to the
        # calculator's result of the default name, which may be another level of theory.
        self._renamed_results = frozenset(
            result
            for name, default, result in _LABEL_KEYS
            if self.atoms_kwargs[name] != default
            for result in result
        )
        cache = Path(cache_dir) if cache_dir is not None else None
        self._sources = [_open_source(p, format, cache) for p in self.paths]
        for source in self._sources:
            if len(source) == 0:
                raise ValueError(f"{source.path}: the file contains no structures.")
        counts = np.asarray([len(s) for s in self._sources], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self._selected = self._select(index, int(self._starts[-1]))
        if len(self._selected) == 0:
            raise ValueError(f"index={index!r} selects no structures from {self._describe()}.")

    @staticmethod
    def _select(index: Any, total: int) -> np.ndarray:
        frames = np.arange(total, dtype=np.int64)
        if isinstance(index, str):
            from ase.io.formats import string2index

            index = string2index(index)
        try:
            selected = frames[index]
        except IndexError as exc:
            raise IndexError(f"index={index!r} is out of range for {total} frames.") from exc
        return np.atleast_1d(selected)

    def _describe(self) -> str:
        names = [str(p) for p in self.paths]
        return names[0] if len(names) == 1 else f"{len(names)} files ({names[0]}, ...)"

    def __len__(self) -> int:
        return len(self._selected)

    def _locate(self, index: int) -> tuple[Any, int]:
        n = len(self._selected)
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"ASEReader index must be an int; got {type(index).__name__}.")
        if not -n <= index < n:
            raise IndexError(
                f"Index {index} is out of range for {self._describe()} with {n} structures."
            )
        frame = int(self._selected[index % n])
        which = int(np.searchsorted(self._starts, frame, side="right")) - 1
        return self._sources[which], frame - int(self._starts[which])

    def get_atoms(self, index: int) -> Any:
        """Structure ``index`` as an ``ase.Atoms`` (with its labels)."""
        source, frame = self._locate(index)
        return source.atoms(frame)

    def info_values(self, key: str) -> list[Any]:
        """``atoms.info[key]`` of every structure (``None`` where absent), in order.

        Reads only what holds ``info`` (an extxyz frame's comment line, an ASE db row's
        key-value pairs), not the atoms: cheap enough to group a large file by
        ``config_type``.
        """
        return [
            source.info(frame).get(key) for source, frame in map(self._locate, range(len(self)))
        ]

    def read_data(self, index: int) -> AtomicData:
        """Structure ``index`` as a validated ``AtomicData`` (``info`` kept)."""
        source, frame = self._locate(index)
        atoms = source.atoms(frame)
        where = f"{source.path}: frame {frame}"
        if self._renamed_results:
            _drop_calculator_results(atoms, self._renamed_results)
        try:
            data = AtomicData.from_atoms(atoms, **self._exact_kwargs)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
        if self._exact_kwargs is not self.atoms_kwargs:
            self._narrow_labels(data, where)
        if self.config_type_weights:
            self._weigh_config_type(data)
        check_neighbor_explosion(data, where=where)  # a cell in the wrong units, named here
        for label in self.required_labels:
            if label not in data:
                present = [k for k in _LABELS if k in data]
                key = self.atoms_kwargs.get(f"{label}_key", self.atoms_kwargs["virials_key"])
                raise ValueError(
                    f"{where}: required label {label!r} is missing (looked for {key!r} in "
                    f"atoms.info/arrays and on the calculator); the frame has {present}."
                )
        data.info["source_file"] = str(source.path)
        data.info["frame"] = frame
        return data

    def _weigh_config_type(self, data: AtomicData) -> None:
        factor = self.config_type_weights.get(str(data.info.get(CONFIG_TYPE_KEY)))
        if factor is None or factor == 1.0:
            return
        if "loss_weight" in data:
            data["loss_weight"] = data.loss_weight * factor
        else:
            data["loss_weight"] = torch.tensor([[factor]], dtype=self._label_dtype)

    def _narrow_labels(self, data: AtomicData, where: str) -> None:
        """Labels read in float64 to ``label_dtype``, warning once of costly rounding."""
        for key in (*_LABELS, "charge", *WEIGHT_FIELDS):
            value = getattr(data, key, None)
            if value is None or value.dtype == self._label_dtype:
                continue
            if key in EXTENSIVE_LABELS and not self._rounding_warned:
                target = torch.empty(0, dtype=self._label_dtype).numpy().dtype
                worst = worst_rounding(value.numpy(), np.array([data.num_nodes]), target)
                if worst is not None:
                    self._rounding_warned = True
                    warnings.warn(
                        rounding_warning(where, key, worst[1], float(value.reshape(-1)[0]), target),
                        stacklevel=3,
                    )
            data[key] = value.to(self._label_dtype)

    def read(self, index: int) -> tuple[Any, dict[str, Any]]:
        data = self.read_data(index)
        fields, metadata = self._finish(index, dict(data.items()))
        metadata["source_file"] = data.info.pop("source_file")
        metadata["frame"] = data.info.pop("frame")
        metadata["info"] = data.info
        if self.as_atomic_data:
            return data, metadata
        return fields, metadata

    __getitem__ = read

    def read_many(self, indices: Sequence[int]) -> list[tuple[dict, dict]]:
        return [self.read(int(i)) for i in indices]

    def _load_sample(self, index: int) -> dict[str, torch.Tensor]:
        return dict(self.read_data(index).items())

    def _get_sample_metadata(self, index: int) -> dict[str, Any]:
        source, frame = self._locate(index)
        return {"source_file": str(source.path), "frame": frame}

    @property
    def field_levels(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        for source in self._sources:
            source.close()


def _drop_calculator_results(atoms: Any, names: frozenset[str]) -> None:
    calc = getattr(atoms, "calc", None)
    results = getattr(calc, "results", None)
    if not results or not names & results.keys():
        return
    from ase.calculators.singlepoint import SinglePointCalculator

    kept = {k: v for k, v in results.items() if k not in names}
    atoms.calc = SinglePointCalculator(atoms, **kept) if kept else None


# ------------------------------------------------------------------------ writer
def write_extxyz(path: str | os.PathLike, data_list: Any, *, append: bool = False) -> Path:
    """Write structures (``AtomicData`` items or a ``Batch``) to an extxyz file.

    Labels (energy, forces, stress, charges) are written through a
    ``SinglePointCalculator`` so ASE and :class:`ASEReader` read them back. The
    file is written to a temporary name and renamed (never half-written); a
    ``.gz``/``.bz2``/``.xz`` suffix compresses it. Returns the path.
    """
    from ase.io import write

    path = Path(path)
    if hasattr(data_list, "to_data_list"):
        data_list = data_list.to_data_list()
    frames = [d.to_atoms() for d in data_list]
    if not frames:
        raise ValueError(f"write_extxyz({path}): nothing to write (empty data list).")
    with atomic_path(path) as tmp:
        if append and path.exists():
            shutil.copyfile(path, tmp)
        write(tmp, frames, format="extxyz", append=append)
    return path
