"""The checkpoint manifest: which checkpoints exist, which is latest and best, and history.

On-disk layout (schema version 2)::

    <root>/
      manifest.json                     # replaced atomically, last, on every save
      checkpoints/<N>/                  # one complete checkpoint (renamed into place)
        models/<name>/spec.json         # BaseSpec JSON that rebuilds the model
        models/<name>/weights.pt        # state_dict
        optimizers/<name>/spec.json     # optimizer class + kwargs
        optimizers/<name>/state.pt
        schedulers/<name>/spec.json
        schedulers/<name>/state.pt
        associations.json               # model -> optimizers/schedulers/parameter names
        strategy.json                   # strategy checkpoints: to_checkpoint_dict()
        hooks.pt                        # {hook key: state_dict()} of checkpointable hooks
        rng/rank_<r>.pt                 # torch/CUDA/numpy/python RNG states of rank r
      checkpoints/.tmp-*/               # an interrupted save (ignored, removed later)

Version 1 (the reference layout) kept one file per index inside each component
directory (``models/<name>/checkpoints/<N>.pt``, ``strategy/checkpoints/<N>.json``,
``hooks/checkpoints/<N>.pt``) and version 0 is version 1 without ``schema_version``.
:meth:`CheckpointManifest.read` upgrades old manifests in memory through the ordered
list :data:`UPGRADES`; the next save writes version 2 and records the upgrade.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from nvalchemi.training._checkpoint_files import (
    read_json,
    safe_component_name,
    safe_relative_path,
    write_json_atomic,
)

__all__ = [
    "CURRENT_SCHEMA_VERSION",
    "UPGRADES",
    "CheckpointEntry",
    "CheckpointManifest",
    "ComponentPaths",
    "spec_differences",
]

CURRENT_SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
KINDS = ("models", "optimizers", "schedulers")


def utc_now() -> str:
    """ISO-8601 UTC timestamp."""
    return datetime.now(UTC).isoformat()


class CheckpointEntry(BaseModel):
    """One complete checkpoint listed in the manifest.

    Attributes:
        index: checkpoint index (``checkpoint_index=N`` when loading).
        path: directory of the checkpoint relative to the root (``""`` for version-1
            checkpoints, whose files live in the component directories).
        layout: ``2`` (one directory per checkpoint) or ``1`` (reference layout).
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
    loading they map names to ``(object, spec)`` tuples) and always serialize to sorted
    lists. ``checkpoint_index`` names the latest complete checkpoint; ``checkpoints``
    lists every one that is kept; ``history`` records upgrades, spec changes approved
    on resume and other events.

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

    # ------------------------------------------------------------------ files
    @classmethod
    def read(cls, root: str | Path) -> CheckpointManifest:
        """Read ``<root>/manifest.json``, upgrading older schema versions in memory.

        Raises:
            FileNotFoundError: no ``manifest.json`` in ``root``.
            ValueError: a ``schema_version`` newer than this code supports.
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
        write_json_atomic(Path(root) / MANIFEST, self.model_dump(mode="json"))

    # ------------------------------------------------------------------ queries
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
        metric = metric or self.best_metric or "total_loss"
        mode = mode or self.best_mode
        scored = [e for e in self.checkpoints if _metric_value(e, metric) is not None]
        if not scored:
            return None
        sign = 1.0 if mode == "min" else -1.0
        return min(scored, key=lambda e: (sign * _metric_value(e, metric), -e.index))

    def retained(
        self, keep_last: int | None, keep_best: int | None, metric: str, mode: str
    ) -> list[CheckpointEntry]:
        """Entries kept by the retention policy (latest always; ``keep_last=None`` keeps all)."""
        if keep_last is None:
            return list(self.checkpoints)
        order = sorted(self.checkpoints, key=lambda e: e.index)
        keep = {e.index for e in order[-keep_last:]} | {self.checkpoint_index}
        if keep_best:
            sign = 1.0 if mode == "min" else -1.0
            scored = [e for e in order if _metric_value(e, metric) is not None]
            scored.sort(key=lambda e: (sign * _metric_value(e, metric), -e.index))
            keep |= {e.index for e in scored[:keep_best]}
        return [e for e in self.checkpoints if e.index in keep]


def _metric_value(entry: CheckpointEntry, name: str) -> float | None:
    metric = entry.metric
    if not metric or metric.get("name") != name:
        return None
    value = metric.get("value")
    if not isinstance(value, (int, float)) or value != value:  # NaN never ranks
        return None
    return float(value)


# ---------------------------------------------------------------------------- paths
class ComponentPaths:
    """Where the files of one checkpoint entry live (version 1 or 2 layout).

    Every name and relative path read from a manifest is checked to stay inside ``root``.
    """

    def __init__(self, root: Path, entry: CheckpointEntry) -> None:
        self.root = root
        self.entry = entry
        self.base = (
            safe_relative_path(root, entry.path, "manifest entry path") if entry.path else root
        )

    def _component_dir(self, kind: str, name: str) -> Path:
        return self.root / kind / safe_component_name(name, kind[:-1])

    def spec(self, kind: str, name: str) -> Path:
        """``spec.json`` of component ``name`` of ``kind`` (``models``/``optimizers``/...)."""
        if self.entry.layout == 1:
            return self._component_dir(kind, name) / "spec.json"
        return self.base / kind / safe_component_name(name, kind[:-1]) / "spec.json"

    def state(self, kind: str, name: str) -> Path:
        """Weights/state file of component ``name``."""
        if self.entry.layout == 1:
            return self._component_dir(kind, name) / "checkpoints" / f"{self.entry.index}.pt"
        stem = "weights.pt" if kind == "models" else "state.pt"
        return self.base / kind / safe_component_name(name, kind[:-1]) / stem

    def strategy(self) -> Path | None:
        """Strategy metadata JSON, or ``None`` for a component-only checkpoint."""
        if self.entry.layout == 2:
            path = self.base / "strategy.json"
            return path if path.is_file() else None
        if self.entry.kind == "components":
            return None
        relative = (self.entry.model_extra or {}).get("metadata_path")
        if relative is None:
            relative = f"strategy/checkpoints/{self.entry.index}.json"
        path = safe_relative_path(self.root, relative, "manifest metadata_path")
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

    def owned_files(self) -> list[Path]:
        """Files/dirs to delete when this entry is dropped by retention."""
        if self.entry.layout == 2:
            return [self.base] if self.entry.path else []
        n = self.entry.index
        out = [self.root / "strategy" / "checkpoints" / f"{n}.json", self.hooks()]
        for kind in KINDS:
            for name in getattr(self.entry, kind):
                out.append(self.state(kind, name))
        return out


# ---------------------------------------------------------------------------- upgrades
def _v0_to_v1(data: dict[str, Any], root: Path) -> dict[str, Any]:
    """Version 0 (no ``schema_version``) has the version-1 layout."""
    return {**data, "schema_version": 1}


_INDEXED = re.compile(r"^(\d+)\.pt$")


def _v1_to_v2(data: dict[str, Any], root: Path) -> dict[str, Any]:
    """List the reference layout's checkpoints as version-1 entries of a version-2 manifest."""
    models = sorted(_names(data.get("models")))
    optimizers = sorted(_names(data.get("optimizers")))
    schedulers = sorted(_names(data.get("schedulers")))
    latest = data.get("checkpoint_index")
    indices: set[int] | None = None
    for name in models:
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
            "models": models,
            "optimizers": optimizers,
            "schedulers": schedulers,
            "reason": "upgraded",
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
    history = list(data.get("history") or [])
    history.append({"event": "upgraded", "from": 1, "to": 2, "time": utc_now()})
    return {
        **data,
        "schema_version": 2,
        "checkpoints": entries,
        "history": history,
    }


def _listdir(folder: Path) -> Iterable[Path]:
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


# ---------------------------------------------------------------------------- spec diffs
def spec_differences(old: Any, new: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """``(field path, old, new)`` for every difference, ignoring ``timestamp`` keys."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            if key == "timestamp":
                continue
            sub = f"{path}.{key}" if path else str(key)
            if key not in old:
                out.append((sub, "<absent>", new[key]))
            elif key not in new:
                out.append((sub, old[key], "<absent>"))
            else:
                out.extend(spec_differences(old[key], new[key], sub))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new)):
            out.extend(spec_differences(a, b, f"{path}[{i}]"))
        return out
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
