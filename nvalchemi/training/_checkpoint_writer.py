"""Crash-safe writing of checkpoints, retention, and the background writer thread.

A save never modifies a complete checkpoint. It

1. removes leftovers of interrupted saves (``checkpoints/.tmp-*`` and directories no
   manifest entry references);
2. writes every file of the new checkpoint into ``checkpoints/.tmp-<N>-...``, each
   ``fsync``-ed, then ``fsync``-s the directories;
3. renames the directory to ``checkpoints/<N>`` (a fresh name if ``<N>`` is taken by a
   listed checkpoint that is being overwritten) and ``fsync``-s ``checkpoints/``;
4. replaces ``manifest.json`` atomically, which makes the new checkpoint the latest;
5. only then deletes checkpoints dropped by the retention policy.

A kill at any moment leaves the previous manifest, and every checkpoint it lists,
intact. One process writes a root at a time (a per-root lock serialises threads).
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nvalchemi.training._checkpoint_files import (
    TEMP_PREFIX,
    fsync_dir,
    read_json,
    remove_tree,
    slow_write_pause,
    temp_dir_name,
    write_json,
    write_torch,
)
from nvalchemi.training._checkpoint_manifest import (
    MANIFEST,
    CheckpointManifest,
    ComponentPaths,
    format_differences,
    spec_differences,
    unapproved,
)
from nvalchemi.training._checkpoint_state import Snapshot, entry_from_snapshot, history_event

__all__ = ["BackgroundWriter", "Retention", "attach_metric", "check_spec_changes", "write_snapshot"]

_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()
_CHECKPOINT_DIR = re.compile(r"^\d+(\.[0-9a-f]+)?$")


def _lock(root: Path) -> threading.Lock:
    key = str(root.resolve())
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(key, threading.Lock())


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


def read_manifest(root: Path) -> CheckpointManifest | None:
    """The manifest of ``root``, or ``None`` if there is none yet."""
    if not (root / MANIFEST).is_file():
        return None
    return CheckpointManifest.read(root)


def check_spec_changes(root: Path, snapshot: Snapshot) -> None:
    """Compare ``snapshot``'s specs with the latest checkpoint in ``root``.

    Unapproved differences raise ``ValueError`` naming the fields; approved ones are
    recorded as a ``spec_change`` event in the snapshot's history.
    """
    manifest = read_manifest(root)
    if manifest is None or not manifest.checkpoints:
        return
    try:
        latest = manifest.entry("latest")
    except KeyError:
        return
    paths = ComponentPaths(root, latest)
    diffs = []
    for key, spec in snapshot.specs.items():
        kind, name = key.split("/", 1)
        if name not in getattr(latest, kind, []):
            continue
        path = paths.spec(kind, name)
        if path.is_file():
            diffs.extend(spec_differences(read_json(path, "spec file"), spec, key))
    if not diffs:
        return
    refused = unapproved(diffs, snapshot.approved)
    if refused:
        raise ValueError(
            f"The specs being saved disagree with checkpoint {latest.index} in {root}. Differing "
            f"fields: {format_differences(refused)}. Resume with TrainingStrategy.load_checkpoint"
            "(..., overrides={'optimizer_kwargs': {...}}) or allow_spec_changes=True to change "
            "settings (recorded in the manifest history), or use a new checkpoint directory."
        )
    snapshot.history.append(
        history_event(
            "spec_change",
            previous_index=latest.index,
            step_count=snapshot.counters.get("step_count"),
            changes=[{"field": p, "old": a, "new": b} for p, a, b in diffs],
        )
    )


def write_snapshot(root: Path, snapshot: Snapshot, retention: Retention | None = None) -> int:
    """Write ``snapshot`` as a new checkpoint of ``root`` (see the module docstring)."""
    retention = retention or Retention()
    root = Path(root)
    with _lock(root):
        root.mkdir(parents=True, exist_ok=True)
        folder = root / "checkpoints"
        folder.mkdir(exist_ok=True)
        manifest = read_manifest(root)
        _remove_leftovers(folder, manifest)
        if snapshot.index is not None:
            index = snapshot.index
        else:
            index = manifest.checkpoint_index + 1 if manifest is not None else 0
        tmp = folder / temp_dir_name(index)
        files = _write_files(tmp, snapshot)
        name = str(index)
        listed = {e.path for e in manifest.checkpoints} if manifest is not None else set()
        if (folder / name).exists():
            if f"checkpoints/{name}" in listed:
                name = f"{index}.{uuid.uuid4().hex[:8]}"
            else:
                remove_tree(folder / name)
        os.rename(tmp, folder / name)
        fsync_dir(folder)
        slow_write_pause()
        entry = entry_from_snapshot(snapshot, index, f"checkpoints/{name}", files)
        old_entries = list(manifest.checkpoints) if manifest is not None else []
        replaced = [e for e in old_entries if e.index == index]
        history = list(manifest.history) if manifest is not None else []
        history.extend(snapshot.history)
        new = CheckpointManifest(
            checkpoint_index=index,
            models=snapshot.names["models"],
            optimizers=snapshot.names["optimizers"],
            schedulers=snapshot.names["schedulers"],
            associations=snapshot.associations,
            checkpoints=sorted([*(e for e in old_entries if e.index != index), entry], key=_key),
            best_metric=retention.metric,
            best_mode=retention.mode,
            history=history,
        )
        _commit(root, new, retention, extra_drops=replaced)
        return index


def attach_metric(root: Path, index: int, metric: dict[str, Any], retention: Retention) -> bool:
    """Record a validation ``metric`` on checkpoint ``index`` (manifest only); re-apply retention."""
    root = Path(root)
    with _lock(root):
        manifest = read_manifest(root)
        if manifest is None:
            return False
        found = False
        for entry in manifest.checkpoints:
            if entry.index == index:
                entry.metric = dict(metric)
                found = True
        if not found:
            return False
        manifest.best_metric, manifest.best_mode = retention.metric, retention.mode
        _commit(root, manifest, retention, extra_drops=[])
        return True


def _commit(
    root: Path,
    manifest: CheckpointManifest,
    retention: Retention,
    *,
    extra_drops: list[Any],
) -> None:
    kept = manifest.retained(
        retention.keep_last, retention.keep_best, retention.metric, retention.mode
    )
    kept_indices = {e.index for e in kept}
    dropped = [e for e in manifest.checkpoints if e.index not in kept_indices]
    manifest.checkpoints = kept
    manifest.write(root)
    live_paths = {e.path for e in kept if e.path}
    for entry in [*dropped, *extra_drops]:
        if entry.path and entry.path in live_paths:
            continue
        for path in ComponentPaths(root, entry).owned_files():
            remove_tree(path)


def _key(entry: Any) -> int:
    return entry.index


def _write_files(tmp: Path, snapshot: Snapshot) -> dict[str, int]:
    files: dict[str, int] = {}
    for rel, data in snapshot.json_files.items():
        files[rel] = write_json(tmp / rel, data)
    for key, spec in snapshot.specs.items():
        files[f"{key}/spec.json"] = write_json(tmp / key / "spec.json", spec)
    for rel, obj in snapshot.tensor_files.items():
        files[rel] = write_torch(tmp / rel, obj)
    for directory in sorted(
        {p.parent for p in (tmp / rel for rel in files)}, key=len_parts, reverse=True
    ):
        fsync_dir(directory)
    fsync_dir(tmp)
    return files


def len_parts(path: Path) -> int:
    """Depth of ``path`` (deepest directories are synced first)."""
    return len(path.parts)


def _remove_leftovers(folder: Path, manifest: CheckpointManifest | None) -> None:
    listed = {e.path for e in manifest.checkpoints} if manifest is not None else set()
    for child in folder.iterdir():
        name = child.name
        stale = _CHECKPOINT_DIR.match(name) and f"checkpoints/{name}" not in listed
        if name.startswith(TEMP_PREFIX) or stale:
            remove_tree(child)


class BackgroundWriter:
    """Runs checkpoint writes one at a time, on a thread (``asynchronous``) or inline.

    :meth:`submit` waits for the previous write first (indices stay ordered) and
    re-raises its error; :meth:`wait` returns the last result; :meth:`close` waits and
    stops the thread.
    """

    def __init__(self, asynchronous: bool = True) -> None:
        self.asynchronous = asynchronous
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._done: list[Callable[[Any], None]] = []

    @property
    def busy(self) -> bool:
        """Whether a write is in flight."""
        return self._future is not None and not self._future.done()

    def submit(
        self, fn: Callable[..., Any], *args: Any, on_done: Callable[[Any], None] | None = None
    ) -> None:
        """Run ``fn(*args)`` after the previous write; ``on_done(result)`` when it finishes."""
        self.wait()
        if not self.asynchronous:
            result = fn(*args)
            if on_done is not None:
                on_done(result)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="nvalchemi-checkpoint")
        self._future = self._executor.submit(fn, *args)
        self._done = [on_done] if on_done is not None else []

    def poll(self) -> None:
        """Collect a finished write without blocking (re-raises its error)."""
        if self._future is not None and self._future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight write (if any) finished; re-raise its error."""
        future, self._future = self._future, None
        if future is None:
            return
        result = future.result()
        for callback in self._done:
            callback(result)
        self._done = []

    def close(self) -> None:
        """Wait for the in-flight write and stop the thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
