"""nvalchemi checkpoints on disk, read side: the layout, the manifest and its upgrades, safe
reads, and the models a checkpoint holds (:func:`load_model_from_checkpoint`).

This is what the exported models and the engine adapters (ASE calculator, torch-sim,
LAMMPS, TorchScript export) need to run a trained model, so it sits in the bottom layer
(beside :mod:`nvalchemi.spec`) and needs nothing from ``nvalchemi.training``; the writer
(atomic checkpoint folders, the writer lock, retention) is
:mod:`nvalchemi.training.checkpoint.store`.

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

Reads are safe: every file through :func:`open_checkpoint_file` (regular files within a
size bound only: a FIFO or ``/dev/zero`` named ``spec.json`` is refused, not read),
tensors with ``torch.load(weights_only=True)`` only, every dotted path of a ``spec.json``
through the trust rule of :mod:`nvalchemi.spec`, every path a manifest names checked to
stay inside the root.

Example:
    >>> model = load_model_from_checkpoint("runs/x/checkpoints", map_location="cpu")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from nvalchemi._fileio import json_bytes, write_atomic
from nvalchemi._serialization import untrusted_build
from nvalchemi.spec import BaseSpec, create_model_spec_from_json

__all__ = [
    "CURRENT_SCHEMA_VERSION",
    "UPGRADES",
    "CheckpointEntry",
    "CheckpointManifest",
    "EntryFiles",
    "UnsafeCheckpointError",
    "averaged_weights",
    "build_model",
    "load_model_from_checkpoint",
    "load_models_from_checkpoint",
    "load_spec",
    "open_checkpoint_file",
    "open_entry",
    "read_json",
    "read_models",
    "safe_component_name",
    "safe_torch_load",
]

CURRENT_SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"
KINDS = ("models", "optimizers", "schedulers")
_SLOW_ENV = "NVALCHEMI_CHECKPOINT_SLOW_WRITES"  # crash tests: seconds to sleep per file


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something that is refused when loading (e.g. pickled code)."""


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
        if not os.path.lexists(meta) and index == latest:
            meta = root / "strategy.json"  # the reference kept only the latest one here
        if os.path.lexists(meta):
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
MAX_JSON_BYTES = 64 << 20
"""The largest JSON file (manifest, ``spec.json``, ``strategy.json``, ...) that is read."""
MAX_TENSOR_FILE_BYTES = 1 << 40
"""The largest tensor file (weights, optimizer state, ...) that is read: 1 TiB."""


def open_checkpoint_file(path: Path, what: str, limit: int) -> BinaryIO:
    """``path`` opened for reading if it is a regular file of at most ``limit`` bytes.

    The one door of every checkpoint read: a FIFO, a device (``/dev/zero``, also through a
    symbolic link), a socket or a directory is refused before anything is read (a FIFO
    would block, a device never end), and so is a file larger than ``limit``.

    Raises:
        FileNotFoundError: nothing at ``path`` (or a link to nothing).
        ValueError: not a regular file, too large, or unreadable; naming the file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise ValueError(f"Cannot read {what} {path}: {exc.strerror or exc}.") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(info.st_mode), "not a plain file")
            raise ValueError(
                f"Refusing to read {what} {path}: it is {kind}, not a regular file. Checkpoints "
                "hold regular files only; replace it with the file that was saved there."
            )
        if info.st_size > limit:
            raise ValueError(
                f"Refusing to read {what} {path}: it holds {info.st_size} bytes, more than "
                f"{limit} (the largest {what} read). It is not a file this package wrote."
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


_FILE_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def read_json(path: Path, what: str = "checkpoint file") -> Any:
    """Parse JSON at ``path`` (a regular file of at most :data:`MAX_JSON_BYTES`).

    Raises ``FileNotFoundError``/``ValueError`` naming the file.
    """
    with open_checkpoint_file(path, what, MAX_JSON_BYTES) as handle:
        raw = handle.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"Refusing to read {what} {path}: it grew beyond {MAX_JSON_BYTES} bytes.")
    try:
        return json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{what} {path} is not valid JSON: {exc}") from None


def safe_torch_load(path: Path, map_location: Any = None) -> Any:
    """``torch.load(path, map_location, weights_only=True)`` with errors that name the file.

    Only a regular file of at most :data:`MAX_TENSOR_FILE_BYTES` is read.

    Raises:
        FileNotFoundError: the file is missing.
        UnsafeCheckpointError: the file holds anything but tensors and plain containers
            (e.g. a pickled object whose unpickling would run code); nothing is executed.
        ValueError: not a regular file, too large, or not a tensor file.
    """
    with open_checkpoint_file(path, "checkpoint file", MAX_TENSOR_FILE_BYTES) as handle:
        try:
            return torch.load(handle, map_location=map_location, weights_only=True)
        except Exception as exc:
            text = str(exc)
            if "Weights only load failed" in text or "weights_only" in text:
                first = text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
                raise UnsafeCheckpointError(
                    f"Refusing to load {path}: it contains objects other than tensors and "
                    f"plain containers, which could run code when unpickled ({first}). "
                    "Checkpoints are read with torch.load(weights_only=True) only; re-save the "
                    "state with tensors, numbers and strings, or load the file yourself if you "
                    "trust it."
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
    """Where the files of one checkpoint entry live (layout 1 or 2), and their JSON, read once.

    Every name and relative path read from a manifest is checked to stay inside ``root``.
    :meth:`spec_data`, :meth:`load_spec` and :meth:`strategy_data` read each file once per
    ``EntryFiles`` (one load), however many parts of the loader ask.
    """

    def __init__(self, root: Path, entry: CheckpointEntry, manifest: Any = None) -> None:
        self.root, self.entry, self.manifest = root, entry, manifest
        if entry.layout == 2:
            self.base = root / CHECKPOINTS / _checkpoint_folder_name(entry)
        else:
            self.base = root
        self._json: dict[Path, Any] = {}
        self._specs: dict[tuple[str, str, bool], BaseSpec] = {}

    def _read(self, path: Path, what: str) -> Any:
        if path not in self._json:
            data = read_json(path, what)
            if not isinstance(data, Mapping):
                raise ValueError(f"{path} must hold a JSON object ({what}).")
            self._json[path] = data
        return self._json[path]

    def spec_data(self, kind: str, name: str) -> Mapping[str, Any]:
        """The ``spec.json`` of component ``name`` as saved (a spec dump; not rehydrated)."""
        return self._read(self.spec(kind, name), "spec file")

    def load_spec(
        self, kind: str, name: str, *, trust: bool, expect: type | tuple[type, ...] | None = None
    ) -> BaseSpec:
        """The ``spec.json`` of component ``name`` rehydrated under the trust rule."""
        key = (kind, name, trust)
        if key not in self._specs:
            path = self.spec(kind, name)
            self._specs[key] = create_model_spec_from_json(
                self.spec_data(kind, name), trust=trust, expect=expect, where=str(path)
            )
        return self._specs[key]

    def strategy_data(self) -> Mapping[str, Any] | None:
        """``strategy.json`` (the recipe, counters and run record), or ``None`` (components)."""
        path = self.strategy()
        return None if path is None else self._read(path, "strategy metadata")

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
            return path if os.path.lexists(path) else None
        if self.entry.kind == "components":
            return None
        relative = (self.entry.model_extra or {}).get("metadata_path")
        relative = relative or f"strategy/checkpoints/{self.entry.index}.json"
        path = _safe_relative(self.root, relative, "manifest metadata_path")
        if not os.path.lexists(path):
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


def open_entry(root: str | Path, index: int | str = "latest") -> EntryFiles:
    """The files of checkpoint ``index`` of ``root`` (``FileNotFoundError`` without a manifest)."""
    manifest = CheckpointManifest.read(root)
    return EntryFiles(Path(root), manifest.entry(index), manifest)


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
        if use_ema and os.path.lexists(files.hooks())
        else None
    )
    out = {}
    for name in names:
        spec = files.load_spec("models", name, trust=trust, expect=torch.nn.Module)
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
    files = open_entry(root_folder, checkpoint_index)
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
