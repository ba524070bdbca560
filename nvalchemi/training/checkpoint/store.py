"""The checkpoint store on disk: layout, manifest and upgrades, durable writes, safe reads,
retention and one writer at a time. It knows nothing of training: callers hand it named
JSON and tensor files.

Layout (schema version 2)::

    <root>/
      manifest.json                 # which checkpoints exist; replaced atomically, last
      .nvalchemi.lock               # holder of the writer lock (pid, host, since)
      checkpoints/<N>/              # one complete checkpoint, renamed into place
        .nvalchemi-checkpoint       # marker: this folder was written by nvalchemi
        models/<name>/spec.json, models/<name>/weights.pt
        optimizers/<name>/spec.json, state.pt     schedulers/<name>/spec.json, state.pt
        associations.json  strategy.json  hooks.pt  rng/rank_<r>.pt
      checkpoints/.tmp-<N>-<pid>-<hex>/   # a save in progress (or interrupted)

Version 1 (the reference layout) kept one file per index inside each component directory
(``models/<name>/checkpoints/<N>.pt``, ``strategy/checkpoints/<N>.json``,
``hooks/checkpoints/<N>.pt``); version 0 is version 1 without ``schema_version``.
:meth:`CheckpointManifest.read` upgrades old manifests in memory through the ordered list
:data:`UPGRADES`; the next save writes version 2.

Guarantees of :meth:`CheckpointStore.write`:

* **Crash safety**: files go to a temporary folder, each ``fsync``-ed; the folder is
  renamed into place, and only then does the atomically replaced manifest name it. A kill,
  a full disk or a permission error at any moment leaves the previous manifest and every
  checkpoint it lists intact (errors raise :class:`CheckpointWriteError` naming the
  checkpoint and the path).
* **One writer**: an inter-process lock (a POSIX record lock, which data-loader worker
  processes forked from the writer do not inherit) per root; a second writer gets
  :class:`CheckpointLockError` naming the holder. A lock left by a dead process is free.
* **Nothing deleted that is not ours**: a root without a manifest but with content is
  refused (:class:`CheckpointRootError`); retention deletes only folders that resolve
  exactly to ``<root>/checkpoints/<name>`` with no symlinked component (reference-layout
  files likewise inside the root); leftovers are deleted only when they carry the marker.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from nvalchemi._fileio import fsync_dir, json_bytes, write_atomic, write_durable
from nvalchemi._serialization import untrusted_build
from nvalchemi.spec import BaseSpec, create_model_spec_from_json

__all__ = [
    "CURRENT_SCHEMA_VERSION",
    "UPGRADES",
    "CheckpointEntry",
    "CheckpointLockError",
    "CheckpointManifest",
    "CheckpointRootError",
    "CheckpointStore",
    "CheckpointWriteError",
    "EntryFiles",
    "Retention",
    "UnsafeCheckpointError",
    "averaged_weights",
    "build_model",
    "load_model_from_checkpoint",
    "load_models_from_checkpoint",
    "load_spec",
    "read_json",
    "read_models",
    "safe_component_name",
    "safe_torch_load",
]

CURRENT_SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"
MARKER = ".nvalchemi-checkpoint"
LOCK_FILE = ".nvalchemi.lock"
TEMP_PREFIX = ".tmp-"
KINDS = ("models", "optimizers", "schedulers")
_SLOW_ENV = "NVALCHEMI_CHECKPOINT_SLOW_WRITES"  # crash tests: seconds to sleep per file


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something that is refused when loading (e.g. pickled code)."""


class CheckpointLockError(RuntimeError):
    """Another live process is writing this checkpoint root."""


class CheckpointRootError(ValueError):
    """The directory is not a checkpoint root this package may write into."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, permissions); the previous one is intact."""


def utc_now() -> str:
    """ISO-8601 UTC timestamp."""
    return datetime.now(UTC).isoformat()


def _pause() -> None:
    value = os.environ.get(_SLOW_ENV)
    if value:
        time.sleep(float(value))


# ---------------------------------------------------------------------------- manifest
class CheckpointEntry(BaseModel):
    """One complete checkpoint listed in the manifest.

    Attributes:
        index: checkpoint index (``checkpoint_index=N`` when loading).
        path: folder of the checkpoint relative to the root (``""`` for version-1
            checkpoints, whose files live in the component directories).
        layout: ``2`` (one folder per checkpoint) or ``1`` (reference layout).
        kind: ``"strategy"`` (restartable) or ``"components"`` (models/optimizers only).
        models, optimizers, schedulers: component names stored in this checkpoint.
        step_count, epoch_count, ...: the strategy counters when it was written.
        metric: ``{"name", "value", "mode"}`` of a validation at the same step, if any.
        reason: why it was written (``"step"``, ``"epoch"``, ``"best"``, ``"train_end"``,
            ``"preemption"``, ``"manual"``).
        files: relative file path -> size in bytes.
    """

    model_config = ConfigDict(extra="allow")

    index: int = Field(ge=0)
    path: str = ""
    layout: Literal[1, 2] = 2
    kind: Literal["strategy", "components"] = "components"
    models: list[str] = Field(default_factory=list)
    optimizers: list[str] = Field(default_factory=list)
    schedulers: list[str] = Field(default_factory=list)
    step_count: int | None = None
    global_step_count: int | None = None
    batch_count: int | None = None
    epoch_count: int | None = None
    epoch_step_count: int | None = None
    created: str = ""
    metric: dict[str, Any] | None = None
    reason: str = "manual"
    files: dict[str, int] = Field(default_factory=dict)


def _names(value: Any) -> Any:
    if value is None:
        return {}
    if isinstance(value, (list, tuple)):
        return dict.fromkeys(value)
    return value


class CheckpointManifest(BaseModel):
    """``manifest.json``: the index of a checkpoint root.

    ``models``/``optimizers``/``schedulers`` accept a list of names or a dict (after
    loading components they map names to ``(object, spec)`` tuples) and always serialize
    to sorted lists. ``checkpoint_index`` names the latest complete checkpoint;
    ``checkpoints`` lists every one that is kept; ``history`` records upgrades, spec
    changes approved on resume and other events.

    Example:
        >>> m = CheckpointManifest(checkpoint_index=0, models=["main"])
        >>> m.schema_version, m.model_dump()["models"]
        (2, ['main'])
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    schema_version: int = CURRENT_SCHEMA_VERSION
    checkpoint_index: int = Field(ge=0)
    models: dict[str, Any]
    optimizers: dict[str, Any] = Field(default_factory=dict)
    schedulers: dict[str, Any] = Field(default_factory=dict)
    associations: dict[str, Any] = Field(default_factory=dict)
    checkpoints: list[CheckpointEntry] = Field(default_factory=list)
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"
    history: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("models", "optimizers", "schedulers", mode="before")
    @classmethod
    def _as_dict(cls, value: Any) -> Any:
        return _names(value)

    @field_serializer("models", "optimizers", "schedulers")
    def _as_sorted_list(self, value: dict[str, Any]) -> list[str]:
        return sorted(value)

    @classmethod
    def read(cls, root: str | Path) -> CheckpointManifest:
        """Read ``<root>/manifest.json``, upgrading older schema versions in memory.

        Raises:
            FileNotFoundError: no ``manifest.json`` in ``root``.
            ValueError: a ``schema_version`` newer than this code supports, or bad JSON.
            pydantic.ValidationError: a malformed manifest.
        """
        root = Path(root)
        data = read_json(root / MANIFEST, "checkpoint manifest.json")
        if not isinstance(data, dict):
            raise ValueError(
                f"{root / MANIFEST} must hold a JSON object; got {type(data).__name__}."
            )
        return cls.model_validate(upgrade(data, root))

    def write(self, root: str | Path) -> None:
        """Replace ``<root>/manifest.json`` atomically."""
        write_atomic(Path(root) / MANIFEST, json_bytes(self.model_dump(mode="json")))
        _pause()

    def entry(self, index: int | str = "latest") -> CheckpointEntry:
        """The entry for ``index``: an int, ``-1``/``"latest"`` or ``"best"``."""
        if index in (-1, "latest", None):
            index = self.checkpoint_index
        elif index == "best":
            best = self.best_entry()
            if best is None:
                raise ValueError(
                    "checkpoint_index='best': no checkpoint in this root has a validation "
                    f"metric ({self.best_metric or 'total_loss'!r}). Save checkpoints with a "
                    "CheckpointHook during a run that validates, or load 'latest'."
                )
            return best
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(
                f"checkpoint_index must be an int >= 0, -1, 'latest' or 'best'; got {index!r}."
            )
        for entry in self.checkpoints:
            if entry.index == index:
                return entry
        raise KeyError(
            f"checkpoint index {index} is not in the manifest; available: "
            f"{sorted(e.index for e in self.checkpoints)} (latest {self.checkpoint_index})."
        )

    def best_entry(
        self, metric: str | None = None, mode: str | None = None
    ) -> CheckpointEntry | None:
        """The entry with the best recorded ``metric`` (ties: the later one), or ``None``."""
        ranked = self._ranked(metric or self.best_metric or "total_loss", mode or self.best_mode)
        return ranked[0] if ranked else None

    def _ranked(self, metric: str, mode: str) -> list[CheckpointEntry]:
        sign = 1.0 if mode == "min" else -1.0
        scored = [(e, _metric_value(e, metric)) for e in self.checkpoints]
        scored = [(e, v) for e, v in scored if v is not None]
        return [e for e, v in sorted(scored, key=lambda ev: (sign * ev[1], -ev[0].index))]

    def retained(
        self, keep_last: int | None, keep_best: int | None, metric: str, mode: str
    ) -> list[CheckpointEntry]:
        """Entries kept by the retention policy (latest always; ``keep_last=None`` keeps all)."""
        if keep_last is None:
            return list(self.checkpoints)
        order = sorted(self.checkpoints, key=lambda e: e.index)
        keep = {e.index for e in order[-keep_last:]} | {self.checkpoint_index}
        keep |= {e.index for e in self._ranked(metric, mode)[: keep_best or 0]}
        return [e for e in self.checkpoints if e.index in keep]


def _metric_value(entry: CheckpointEntry, name: str) -> float | None:
    metric = entry.metric
    if not metric or metric.get("name") != name:
        return None
    value = metric.get("value")
    if not isinstance(value, (int, float)) or value != value:  # NaN never ranks
        return None
    return float(value)


# ---------------------------------------------------------------------------- upgrades
def _v0_to_v1(data: dict[str, Any], root: Path) -> dict[str, Any]:
    """Version 0 (no ``schema_version``) has the version-1 layout."""
    return {**data, "schema_version": 1}


_INDEXED = re.compile(r"^(\d+)\.pt$")


def _v1_to_v2(data: dict[str, Any], root: Path) -> dict[str, Any]:
    """List the reference layout's checkpoints as version-1 entries of a version-2 manifest."""
    names = {kind: sorted(_names(data.get(kind))) for kind in KINDS}
    latest = data.get("checkpoint_index")
    indices: set[int] | None = None
    for name in names["models"]:
        folder = root / "models" / safe_component_name(name, "model") / "checkpoints"
        found = {int(m.group(1)) for p in _listdir(folder) if (m := _INDEXED.match(p.name))}
        indices = found if indices is None else indices & found
    entries = []
    for index in sorted(indices or ()):
        entry: dict[str, Any] = {
            "index": index,
            "path": "",
            "layout": 1,
            "kind": "components",
            "reason": "upgraded",
            **names,
        }
        meta = root / "strategy" / "checkpoints" / f"{index}.json"
        if not meta.is_file() and index == latest:
            meta = root / "strategy.json"  # the reference kept only the latest one here
        if meta.is_file():
            entry["kind"] = "strategy"
            entry["metadata_path"] = meta.relative_to(root).as_posix()
            state = read_json(meta, "strategy metadata").get("runtime_state") or {}
            for key in ("step_count", "global_step_count", "batch_count", "epoch_count"):
                if isinstance(state.get(key), int):
                    entry[key] = state[key]
        entries.append(entry)
    history = [
        *(data.get("history") or []),
        {"event": "upgraded", "from": 1, "to": 2, "time": utc_now()},
    ]
    return {**data, "schema_version": 2, "checkpoints": entries, "history": history}


def _listdir(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


UPGRADES: list[tuple[int, Callable[[dict[str, Any], Path], dict[str, Any]]]] = [
    (0, _v0_to_v1),
    (1, _v1_to_v2),
]
"""Ordered ``(from_version, upgrade)`` steps; each returns the manifest one version newer."""


def upgrade(data: dict[str, Any], root: Path) -> dict[str, Any]:
    """Apply :data:`UPGRADES` until ``data`` has :data:`CURRENT_SCHEMA_VERSION`."""
    version = data.get("schema_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"{root / MANIFEST}: schema_version must be an int >= 0; got {version!r}.")
    if version > CURRENT_SCHEMA_VERSION:
        raise ValueError(
            f"{root / MANIFEST} has schema_version {version}, which is newer than supported "
            f"({CURRENT_SCHEMA_VERSION}); upgrade nvalchemi to read this checkpoint."
        )
    for from_version, step in UPGRADES:
        if version == from_version:
            data = step(data, root)
            version = data["schema_version"]
    return data


# ---------------------------------------------------------------------------- safe reads
def read_json(path: Path, what: str = "checkpoint file") -> Any:
    """Parse JSON at ``path`` (``FileNotFoundError``/``ValueError`` naming the file)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON: {exc}") from None


def safe_torch_load(path: Path, map_location: Any = None) -> Any:
    """``torch.load(path, map_location, weights_only=True)`` with errors that name the file.

    Raises:
        FileNotFoundError: the file is missing.
        UnsafeCheckpointError: the file holds anything but tensors and plain containers
            (e.g. a pickled object whose unpickling would run code); nothing is executed.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        text = str(exc)
        if "Weights only load failed" in text or "weights_only" in text:
            first = text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
            raise UnsafeCheckpointError(
                f"Refusing to load {path}: it contains objects other than tensors and plain "
                f"containers, which could run code when unpickled ({first}). Checkpoints are "
                "read with torch.load(weights_only=True) only; re-save the state with "
                "tensors, numbers and strings, or load the file yourself if you trust it."
            ) from None
        raise ValueError(f"Cannot read checkpoint file {path}: {exc}") from exc


def safe_component_name(name: Any, what: str) -> str:
    """``name`` if usable as one directory name (no separators, not ``.``/``..``)."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or any(c in name for c in "/\\\0")
        or name.startswith(".")
    ):
        raise ValueError(
            f"{what} name {name!r} is not a valid checkpoint component name; use a non-empty "
            "name without path separators that does not start with '.' (e.g. 'main')."
        )
    return name


def _safe_relative(root: Path, relative: Any, what: str) -> Path:
    if not isinstance(relative, str) or not relative:
        raise ValueError(f"{what}: expected a relative path string; got {relative!r}.")
    candidate = Path(relative)
    if candidate.is_absolute() or ".." in candidate.parts:
        raise ValueError(
            f"{what}: path {relative!r} leaves the checkpoint directory {root}; refusing it."
        )
    return root / candidate


def _checkpoint_folder_name(entry: CheckpointEntry) -> str:
    """``<name>`` of an entry path ``checkpoints/<name>`` (``ValueError`` for anything else)."""
    parts = entry.path.split("/")
    if len(parts) != 2 or parts[0] != CHECKPOINTS:
        raise ValueError(
            f"manifest entry {entry.index}: path {entry.path!r} leaves the checkpoint directory "
            f"layout (expected '{CHECKPOINTS}/<name>'); refusing it."
        )
    return safe_component_name(parts[1], "checkpoint folder")


class EntryFiles:
    """Where the files of one checkpoint entry live (layout 1 or 2).

    Every name and relative path read from a manifest is checked to stay inside ``root``.
    """

    def __init__(self, root: Path, entry: CheckpointEntry, manifest: Any = None) -> None:
        self.root, self.entry, self.manifest = root, entry, manifest
        if entry.layout == 2:
            self.base = root / CHECKPOINTS / _checkpoint_folder_name(entry)
        else:
            self.base = root

    def _component(self, kind: str, name: str) -> Path:
        base = self.root if self.entry.layout == 1 else self.base
        return base / kind / safe_component_name(name, kind[:-1])

    def spec(self, kind: str, name: str) -> Path:
        """``spec.json`` of component ``name`` of ``kind`` (``models``/``optimizers``/...)."""
        return self._component(kind, name) / "spec.json"

    def state(self, kind: str, name: str) -> Path:
        """Weights/state file of component ``name``."""
        if self.entry.layout == 1:
            return self._component(kind, name) / "checkpoints" / f"{self.entry.index}.pt"
        return self._component(kind, name) / ("weights.pt" if kind == "models" else "state.pt")

    def strategy(self) -> Path | None:
        """Strategy metadata JSON, or ``None`` for a component-only checkpoint."""
        if self.entry.layout == 2:
            path = self.base / "strategy.json"
            return path if path.is_file() else None
        if self.entry.kind == "components":
            return None
        relative = (self.entry.model_extra or {}).get("metadata_path")
        relative = relative or f"strategy/checkpoints/{self.entry.index}.json"
        path = _safe_relative(self.root, relative, "manifest metadata_path")
        if not path.is_file():
            raise FileNotFoundError(
                f"strategy metadata {path} of checkpoint {self.entry.index} is missing."
            )
        return path

    def associations(self) -> Path:
        """``associations.json`` of a version-2 checkpoint (may not exist)."""
        return self.base / "associations.json"

    def hooks(self) -> Path:
        """Hook-state file (may not exist)."""
        if self.entry.layout == 1:
            return self.root / "hooks" / "checkpoints" / f"{self.entry.index}.pt"
        return self.base / "hooks.pt"

    def rng(self, rank: int) -> Path:
        """RNG-state file of ``rank`` (version 2 only; may not exist)."""
        return self.base / "rng" / f"rank_{int(rank)}.pt"

    def owned(self) -> list[Path]:
        """What to delete when retention drops this entry (checked again before deleting)."""
        if self.entry.layout == 2:
            return [self.base]
        n = self.entry.index
        out = [self.root / "strategy" / "checkpoints" / f"{n}.json", self.hooks()]
        out += [self.state(kind, name) for kind in KINDS for name in getattr(self.entry, kind)]
        return out


def averaged_weights(hook_states: Any, model_key: str) -> dict[str, torch.Tensor] | None:
    """Averaged (EMA) weights of ``model_key`` saved in a checkpoint's hook states.

    The on-disk convention of averaging hooks: a hook state holding
    ``averaged_model_state`` (a state dict), ``model_key`` and ``num_updates``. ``None``
    (use the trained weights) when none is saved, or when it has had no update yet: such a
    shadow is not an average.
    """
    if not isinstance(hook_states, Mapping):
        return None
    averaged = hook_states.get("averaged_model_state")
    if isinstance(averaged, Mapping) and hook_states.get("model_key", "main") == model_key:
        count = hook_states.get("num_updates", averaged.get("n_averaged"))
        if isinstance(count, torch.Tensor) and count.numel() == 1:
            count = int(count)
        if count != 0:
            return {k.removeprefix("module."): v for k, v in averaged.items() if k != "n_averaged"}
    for value in hook_states.values():
        found = averaged_weights(value, model_key)
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------- retention
class Retention:
    """``keep_last`` most recent and ``keep_best`` best checkpoints (``None``: keep all)."""

    def __init__(
        self,
        keep_last: int | None = None,
        keep_best: int | None = None,
        metric: str = "total_loss",
        mode: str = "min",
    ) -> None:
        for name, value in (("keep_last", keep_last), ("keep_best", keep_best)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be None or an int >= 1; got {value!r}.")
        if mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max'; got {mode!r}.")
        self.keep_last, self.keep_best, self.metric, self.mode = keep_last, keep_best, metric, mode


# ---------------------------------------------------------------------------- the lock
_HELD: dict[str, list[int]] = {}  # real root path -> [lock file descriptor, holders]
_WRITING: dict[str, threading.Lock] = {}  # real root path -> one write at a time in-process
_GUARD = threading.Lock()


@contextlib.contextmanager
def root_lock(root: Path) -> Iterator[None]:
    """Hold the writer lock of ``root`` between processes (``lockf``; re-entrant in-process).

    Raises:
        CheckpointLockError: a live process holds it; the message names pid, host and since.
    """
    _refuse_foreign(root)  # before the lock file is created in it
    root.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(root)
    with _GUARD:
        held = _HELD.get(key)
        if held is None:
            held = _HELD[key] = [_acquire(root), 0]
        held[1] += 1
    try:
        yield
    finally:
        with _GUARD:
            held[1] -= 1
            if held[1] == 0:
                del _HELD[key]
                with contextlib.suppress(OSError):
                    fcntl.lockf(held[0], fcntl.LOCK_UN)
                os.close(held[0])


@contextlib.contextmanager
def _writing(root: Path) -> Iterator[None]:
    """The lock of ``root`` plus one write at a time within this process."""
    with root_lock(root):
        with _GUARD:
            mutex = _WRITING.setdefault(os.path.realpath(root), threading.Lock())
        with mutex:
            yield


def _acquire(root: Path) -> int:
    path = root / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # A POSIX lock: released when this process dies, never inherited by forked children
        # (DataLoader workers outliving a killed writer would otherwise keep it).
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            warnings.warn(
                f"Cannot lock {path} ({exc}); make sure only one process writes {root}.",
                RuntimeWarning,
                stacklevel=4,
            )
            return fd
        holder = _holder(fd)
        os.close(fd)
        raise CheckpointLockError(
            f"Checkpoint root {root} is being written by another process ({holder}). Two "
            "writers would overwrite and delete each other's checkpoints. Stop the other run "
            "(e.g. the previous job of a requeued run), or write to another directory."
        ) from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": utc_now()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    return fd


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


# ---------------------------------------------------------------------------- the store
class CheckpointStore:
    """Read and write the checkpoints of one root folder (see the module docstring).

    Example:
        >>> import tempfile
        >>> store = CheckpointStore(tempfile.mkdtemp())
        >>> store.write({"note.json": {"hello": 1}}, entry={"models": []}, top={"models": []})
        0
        >>> store.open("latest").entry.files["note.json"] > 0
        True
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def manifest(self) -> CheckpointManifest | None:
        """The manifest, or ``None`` if there is none yet."""
        if not (self.root / MANIFEST).is_file():
            return None
        return CheckpointManifest.read(self.root)

    def open(self, index: int | str = "latest") -> EntryFiles:
        """The files of checkpoint ``index`` (``FileNotFoundError`` if there is no manifest)."""
        manifest = CheckpointManifest.read(self.root)
        return EntryFiles(self.root, manifest.entry(index), manifest)

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """The writer lock (hold it for a whole run so no second writer interleaves)."""
        return root_lock(self.root)

    # ------------------------------------------------------------------ writing
    def write(
        self,
        files: Mapping[str, Any],
        *,
        entry: Mapping[str, Any],
        top: Mapping[str, Any],
        retention: Retention | None = None,
        index: int | None = None,
        history: Iterable[Mapping[str, Any]] = (),
    ) -> int:
        """Write one checkpoint; return its index.

        ``files`` maps relative paths to content: ``*.json`` values are written as JSON,
        anything else with ``torch.save``. ``entry`` are :class:`CheckpointEntry` fields
        (kind, component names, counters, metric, reason), ``top`` manifest fields
        (component names, associations). ``index=None`` takes the next index; an existing
        index is replaced (through a new folder).
        """
        retention = retention or Retention()
        with _writing(self.root):
            manifest = self._manifest_for_writing()
            if index is None:
                index = manifest.checkpoint_index + 1 if manifest is not None else 0
            folder = self.root / CHECKPOINTS
            tmp = folder / f"{TEMP_PREFIX}{index}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                sizes = _write_folder(tmp, files)
                name = (
                    str(index)
                    if not (folder / str(index)).exists()
                    else f"{index}.{uuid.uuid4().hex[:8]}"
                )
                os.rename(tmp, folder / name)
                fsync_dir(folder)
                _pause()
            except (OSError, RuntimeError) as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                cause = _os_error(exc)
                if cause is None:
                    raise
                raise self._write_error(index, tmp, cause, manifest) from exc
            old = list(manifest.checkpoints) if manifest is not None else []
            new = CheckpointManifest(
                checkpoint_index=index,
                checkpoints=[
                    *(e for e in old if e.index != index),
                    CheckpointEntry(
                        index=index,
                        path=f"{CHECKPOINTS}/{name}",
                        layout=2,
                        created=utc_now(),
                        files=sizes,
                        **entry,
                    ),
                ],
                history=[*(manifest.history if manifest is not None else []), *history],
                best_metric=retention.metric,
                best_mode=retention.mode,
                **top,
            )
            new.checkpoints.sort(key=lambda e: e.index)
            try:
                self._commit(new, retention, replaced=[e for e in old if e.index == index])
            except OSError as exc:
                self._delete(new.entry(index))
                raise self._write_error(index, self.root / MANIFEST, exc, manifest) from exc
            return index

    def attach_metric(self, index: int, metric: Mapping[str, Any], retention: Retention) -> bool:
        """Record a validation ``metric`` on checkpoint ``index`` (manifest only); re-apply retention."""
        with _writing(self.root):
            manifest = self.manifest()
            entries = [e for e in (manifest.checkpoints if manifest else []) if e.index == index]
            if not entries:
                return False
            entries[0].metric = dict(metric)
            manifest.best_metric, manifest.best_mode = retention.metric, retention.mode
            self._commit(manifest, retention, replaced=[])
            return True

    def _write_error(
        self, index: int, path: Path, exc: OSError, manifest: Any
    ) -> CheckpointWriteError:
        previous = (
            f"checkpoint {manifest.checkpoint_index} is still the latest loadable one"
            if manifest is not None
            else "no earlier checkpoint exists in this root"
        )
        return CheckpointWriteError(
            exc.errno,
            f"Could not write checkpoint {index} to {path}: {exc.strerror or exc}. Nothing "
            f"was lost: {previous}. Free disk space or fix the permissions of {self.root}, "
            "then save again",
        )

    def _manifest_for_writing(self) -> CheckpointManifest | None:
        """The manifest (a root with content but no manifest is refused); our leftovers removed."""
        _refuse_foreign(self.root)
        manifest = self.manifest()
        folder = self.root / CHECKPOINTS
        folder.mkdir(parents=True, exist_ok=True)
        listed = {e.path for e in manifest.checkpoints} if manifest is not None else set()
        for path in _listdir(folder):  # interrupted saves of this package
            unlisted = f"{CHECKPOINTS}/{path.name}" not in listed
            # Without a manifest only temporary folders go: a complete checkpoints/0 may be
            # the one checkpoint of a root whose manifest was lost (see _refuse_foreign).
            if manifest is None and not path.name.startswith(TEMP_PREFIX):
                continue
            if unlisted and (path / MARKER).is_file() and _not_ours(self.root, path, 2) is None:
                shutil.rmtree(path, ignore_errors=True)
        return manifest

    def _commit(self, manifest: CheckpointManifest, retention: Retention, replaced: list) -> None:
        kept = manifest.retained(
            retention.keep_last, retention.keep_best, retention.metric, retention.mode
        )
        kept_indices = {e.index for e in kept}
        dropped = [e for e in manifest.checkpoints if e.index not in kept_indices]
        manifest.checkpoints = kept
        manifest.write(self.root)
        live = {e.path for e in kept if e.path}
        for entry in [*dropped, *replaced]:
            if not (entry.path and entry.path in live):
                self._delete(entry)

    def _delete(self, entry: CheckpointEntry) -> None:
        """Delete what retention dropped, but only paths that are provably ours."""
        try:
            paths = EntryFiles(self.root, entry).owned()
        except ValueError as exc:
            paths, problem = [], str(exc)
            warnings.warn(
                f"Not deleting checkpoint {entry.index}: {problem}", RuntimeWarning, stacklevel=3
            )
        for path in paths:
            if not os.path.lexists(path):
                continue
            problem = _not_ours(self.root, path, entry.layout)
            if problem:
                warnings.warn(
                    f"Not deleting {path} (checkpoint {entry.index}): {problem}.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            elif entry.layout == 2:
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):  # retention never fails a committed save
                    path.unlink()


def _refuse_foreign(root: Path) -> None:
    """Raise :class:`CheckpointRootError` if ``root`` has content but no manifest.

    Only this package's own interrupted first save and its lock file count as empty: marked
    temporary folders, or a marked ``checkpoints/0`` alone (the first save was killed after
    renaming its folder into place and before writing the manifest; it is kept, and the
    next save writes beside it).
    """
    if (root / MANIFEST).is_file():
        return
    folder = root / CHECKPOINTS
    found = [
        p
        for p in [*_listdir(root), *_listdir(folder)]
        if p.name != LOCK_FILE
        and p != folder
        and not (p.parent == folder and p.name.startswith(TEMP_PREFIX) and (p / MARKER).is_file())
    ]
    if not found:
        return
    if found == [folder / "0"] and (folder / "0" / MARKER).is_file():
        warnings.warn(
            f"{folder / '0'} has no manifest entry: a first save was interrupted before its "
            f"{MANIFEST} was written. It is kept as it is; new checkpoints are written beside it.",
            RuntimeWarning,
            stacklevel=4,
        )
        return
    shown = ", ".join(sorted(p.relative_to(root).as_posix() for p in found)[:5])
    why = (
        "they look like nvalchemi checkpoints whose manifest.json was lost: restore "
        "manifest.json from a backup, or move them out of the way"
        if any((p / MARKER).is_file() for p in found)
        else "it is not an nvalchemi checkpoint directory"
    )
    raise CheckpointRootError(
        f"Refusing to write checkpoints into {root}: it has no {MANIFEST} but holds "
        f"{len(found)} other entries ({shown}); {why}. Choose a new or empty directory for the "
        "checkpoints (nothing was written or deleted)."
    )


def _not_ours(root: Path, path: Path, layout: int) -> str | None:
    """Why ``path`` must not be deleted as part of ``root`` (``None`` if it may)."""
    relative = path.relative_to(root)
    current = root
    for part in relative.parts:
        current = current / part
        if current.is_symlink():
            return f"{current} is a symbolic link"
    if os.path.realpath(path) != os.path.join(os.path.realpath(root), *relative.parts):
        return "it does not resolve inside the checkpoint root"
    if layout == 2 and (
        len(relative.parts) != 2 or relative.parts[0] != CHECKPOINTS or not path.is_dir()
    ):
        return f"it is not a folder {CHECKPOINTS}/<name> of the root"
    if layout == 1 and not path.is_file():
        return "it is not a file"
    return None


def _os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc`` (``torch.save`` reports failed writes as ``RuntimeError``)."""
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc


def _write_folder(tmp: Path, files: Mapping[str, Any]) -> dict[str, int]:
    """Write ``files`` (and the marker, first) into ``tmp``; fsync everything."""
    tmp.mkdir(parents=True)
    (tmp / MARKER).touch()  # no fsync of its own: a lost marker only keeps a leftover on disk
    sizes: dict[str, int] = {}
    for relative, content in files.items():
        path = _safe_relative(tmp, relative, "checkpoint file")
        if relative.endswith(".json"):
            sizes[relative] = write_durable(path, json_bytes(content))
        else:
            sizes[relative] = write_durable(
                path, lambda handle, obj=content: torch.save(obj, handle)
            )
        _pause()
    for directory in sorted(
        {p.parent for p in (tmp / r for r in sizes)}, key=lambda p: -len(p.parts)
    ):
        fsync_dir(directory)
    fsync_dir(tmp)
    return sizes


# ---------------------------------------------------------------------------- models to use
def load_spec(path: Path, *, trust: bool, expect: type | tuple[type, ...] | None) -> BaseSpec:
    """Read and rehydrate a ``spec.json`` under the trust rule; refusals name the file and key."""
    data = read_json(path, "spec file")
    if not isinstance(data, Mapping):
        raise ValueError(f"{path} must hold a JSON object (a BaseSpec dump).")
    return create_model_spec_from_json(data, trust=trust, expect=expect, where=str(path))


def build_model(spec: BaseSpec, device: Any) -> torch.nn.Module:
    """Build a model from ``spec`` (on ``device`` if the factory takes one).

    Runs in :func:`~nvalchemi._serialization.untrusted_build`, so a spec that was not
    trusted cannot reach a factory that unpickles files, not even through another factory.
    """
    with untrusted_build():
        model = (
            spec.build(device=device)
            if device is not None and spec.accepts_kwarg("device")
            else spec.build()
        )
    if not isinstance(model, torch.nn.Module):
        raise RuntimeError(
            f"Spec {spec.cls_path} built {type(model).__name__}; expected nn.Module."
        )
    return model.to(device) if device is not None else model


def read_models(
    files: EntryFiles,
    names: Iterable[str] | None = None,
    map_location: Any = None,
    *,
    use_ema: bool = False,
    trust: bool = False,
) -> dict[str, tuple[torch.nn.Module, BaseSpec]]:
    """``{name: (model in eval mode, its spec)}`` rebuilt from one checkpoint entry's files."""
    entry = files.entry
    names = list(entry.models) if names is None else list(names)
    unknown = sorted(set(names) - set(entry.models))
    if unknown:
        raise KeyError(f"Unknown model(s) {unknown}. Available: {sorted(entry.models)}")
    hook_states = (
        safe_torch_load(files.hooks(), map_location)
        if use_ema and files.hooks().is_file()
        else None
    )
    out = {}
    for name in names:
        spec = load_spec(files.spec("models", name), trust=trust, expect=torch.nn.Module)
        model = build_model(spec, map_location)
        state = averaged_weights(hook_states, name)
        if state is None:
            state = safe_torch_load(files.state("models", name), map_location)
        model.load_state_dict(state, strict=True)
        out[name] = (model.eval(), spec)
    return out


def load_models_from_checkpoint(
    root_folder: str | Path,
    checkpoint_index: int | str = "latest",
    map_location: Any = None,
    model_names: Iterable[str] | None = None,
    *,
    use_ema: bool = False,
    trust: bool = False,
) -> dict[str, torch.nn.Module]:
    """Rebuild models from their specs and load their weights only (no strategy state).

    ``use_ema=True`` loads the averaged (EMA) weights where a hook saved them, else the
    trained weights. Evaluation, the ASE calculator and fine-tuning read models this way.
    """
    files = CheckpointStore(root_folder).open(checkpoint_index)
    models = read_models(files, model_names, map_location, use_ema=use_ema, trust=trust)
    return {name: model for name, (model, _) in models.items()}


def load_model_from_checkpoint(
    path: str | Path,
    map_location: Any = None,
    model_key: str = "main",
    *,
    use_ema: bool = True,
    checkpoint_index: int | str = "latest",
    trust: bool = False,
) -> torch.nn.Module:
    """One model, in eval mode, from a checkpoint root (EMA weights by default if saved).

    Example:
        >>> model = load_model_from_checkpoint("runs/x/checkpoints", map_location="cpu")  # doctest: +SKIP
    """
    return load_models_from_checkpoint(
        path, checkpoint_index, map_location, [model_key], use_ema=use_ema, trust=trust
    )[model_key]


# ---------------------------------------------------------------------------- spec diffs
def spec_differences(old: Any, new: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """``(field path, old, new)`` for every difference of two spec dumps (``timestamp`` ignored)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            if key == "timestamp":
                continue
            sub = f"{path}.{key}" if path else str(key)
            if key not in old or key not in new:
                out.append((sub, old.get(key, "<absent>"), new.get(key, "<absent>")))
            else:
                out.extend(spec_differences(old[key], new[key], sub))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [
            d
            for i, (a, b) in enumerate(zip(old, new))
            for d in spec_differences(a, b, f"{path}[{i}]")
        ]
    return [] if old == new else [(path, old, new)]


def unapproved(differences: list[tuple[str, Any, Any]], approved: Iterable[str]) -> list:
    """The differences whose field path matches none of the ``approved`` fnmatch patterns."""
    patterns = list(approved)
    return [d for d in differences if not any(fnmatch.fnmatchcase(d[0], p) for p in patterns)]


def format_differences(differences: list[tuple[str, Any, Any]], limit: int = 5) -> str:
    """``"a: 1 -> 2, b: x -> y (+N more)"``."""
    shown = ", ".join(f"{p}: {a!r} -> {b!r}" for p, a, b in differences[:limit])
    more = len(differences) - limit
    return shown + (f" (+{more} more)" if more > 0 else "")
