"""The checkpoint store on disk, write side: durable writes, retention and one writer at a
time. It knows nothing of training: callers hand it named JSON and tensor files.

The layout, the manifest and its upgrades and every read (safe ``torch.load``, paths
checked to stay in the root, models rebuilt from their specs) are in
:mod:`nvalchemi.checkpoint_files`, which the exported models and engine adapters
use without this package.

Guarantees of :meth:`CheckpointStore.write`:

* **Crash safety**: files go to a temporary folder, each ``fsync``-ed; the folder is
  renamed into place, and only then does the atomically replaced manifest name it. A kill,
  a full disk or a permission error at any moment leaves the previous manifest and every
  checkpoint it lists intact (errors raise :class:`CheckpointWriteError` naming the
  checkpoint and the path).
* **One writer**: an inter-process lock (``flock`` on ``.nvalchemi.lock``, which copying
  the root does not drop and which forked data-loader workers let go of) per root; a second
  writer gets :class:`CheckpointLockError` naming the holder. A lock left by a dead process
  is free. The lock file is never followed through a link, and a file there that this
  package did not write is refused, never truncated.
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
import shutil
import socket
import stat
import threading
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from nvalchemi._fileio import fsync_dir, json_bytes, write_durable
from nvalchemi.checkpoint_files import (
    CHECKPOINTS,
    CURRENT_SCHEMA_VERSION,
    MANIFEST,
    UPGRADES,
    CheckpointEntry,
    CheckpointManifest,
    EntryFiles,
    UnsafeCheckpointError,
    _listdir,
    _pause,
    _safe_relative,
    open_entry,
    read_json,
    safe_component_name,
    safe_torch_load,
    utc_now,
)

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
    "read_json",
    "safe_component_name",
    "safe_torch_load",
]

MARKER = ".nvalchemi-checkpoint"
LOCK_FILE = ".nvalchemi.lock"
TEMP_PREFIX = ".tmp-"


class CheckpointLockError(RuntimeError):
    """Another live process is writing this checkpoint root."""


class CheckpointRootError(ValueError):
    """The directory is not a checkpoint root this package may write into."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (disk full, permissions); the previous one is intact."""


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
    """Hold the writer lock of ``root`` between processes (``flock``; re-entrant in-process).

    Raises:
        CheckpointLockError: a live process holds it; the message names pid, host and since.
        CheckpointRootError: ``<root>/.nvalchemi.lock`` is not a lock file of this package
            (a symbolic link, another user's file, a file with other content); nothing is
            written into it.
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
            if held[1] == 0 and _HELD.get(key) is held:
                del _HELD[key]
                with contextlib.suppress(OSError):
                    fcntl.flock(held[0], fcntl.LOCK_UN)
                os.close(held[0])


@contextlib.contextmanager
def _writing(root: Path) -> Iterator[None]:
    """The lock of ``root`` plus one write at a time within this process."""
    with root_lock(root):
        with _GUARD:
            mutex = _WRITING.setdefault(os.path.realpath(root), threading.Lock())
        with mutex:
            yield


def _forget_locks_after_fork() -> None:
    """In a forked child (e.g. a DataLoader worker): let go of the parent's lock files.

    An ``flock`` belongs to the open file, which a fork shares: a worker outliving a killed
    writer would keep the root locked. Closing (not unlocking) the child's copies leaves the
    parent's lock as it is. (``flock`` rather than a POSIX record lock, which any close of
    the file in the writer's process drops, e.g. a hook copying the root.)
    """
    global _GUARD
    for held in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(held[0])
    _HELD.clear()
    _WRITING.clear()
    _GUARD = threading.Lock()


os.register_at_fork(after_in_child=_forget_locks_after_fork)

_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_RECORD_LIMIT = 4096  # bytes: a holder record is about 100


def _acquire(root: Path) -> int:
    fd = _open_lock_file(root / LOCK_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            warnings.warn(
                f"Cannot lock {root / LOCK_FILE} ({exc}); make sure only one process writes "
                f"{root}.",
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


def _open_lock_file(path: Path) -> int:
    """Create the lock file, or open one this package wrote; never follow a link into data."""
    for _ in range(3):  # another process may create or remove it in between
        try:
            return os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            continue
        except OSError as exc:  # ELOOP: a symbolic link; ENXIO: a socket or a FIFO
            raise _foreign_lock(
                path, f"it cannot be opened as a plain file ({exc.strerror})"
            ) from None
        problem = _not_a_lock_record(fd)
        if problem is None:
            return fd
        os.close(fd)
        raise _foreign_lock(path, problem)
    raise CheckpointLockError(f"{path} keeps appearing and disappearing; is another run starting?")


def _not_a_lock_record(fd: int) -> str | None:
    """Why the open file ``fd`` is not a lock file this package wrote (``None`` if it is)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != os.geteuid():
        return f"it belongs to another user (uid {info.st_uid})"
    if info.st_nlink != 1:
        return f"it has {info.st_nlink} hard links, so it is also another file"
    if info.st_size == 0:
        return None  # created, then the writer died before recording itself
    if info.st_size > _RECORD_LIMIT:
        return f"it holds {info.st_size} bytes, not a lock record"
    try:
        record = json.loads(os.pread(fd, _RECORD_LIMIT, 0))
    except ValueError:
        record = None
    if not (isinstance(record, dict) and {"pid", "host", "since"} <= set(record)):
        return "its content is not a lock record (pid, host, since)"
    return None


def _foreign_lock(path: Path, problem: str) -> CheckpointRootError:
    return CheckpointRootError(
        f"Refusing to use {path} as the writer lock: {problem}. nvalchemi writes its lock "
        "record into that file, and it does not look like one it created. Nothing was "
        "written; remove it if it is not yours to keep, or choose another directory."
    )


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, _RECORD_LIMIT, 0) or b"{}")
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
        return open_entry(self.root, index)

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
