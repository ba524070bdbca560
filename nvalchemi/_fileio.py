"""Durable and atomic file writes: the one helper every writer in the package uses.

* :func:`write_durable` writes a new file and ``fsync``-s it (its directory is synced by
  the caller once all entries are in place, or by :func:`write_atomic`).
* :func:`write_atomic` replaces a file so that readers (and a crash at any moment) see
  either the old or the new content, never a partial file: a temporary sibling is written
  and ``fsync``-ed, ``os.replace``-d over the target, and the directory is ``fsync``-ed.
* :func:`atomic_path` does the same for a writer that wants a file name rather than a
  handle (ASE's ``write``): it hands out the temporary sibling's path.
* :func:`replace_dir` swaps a finished directory (a zarr store written to a temporary
  sibling) in place of another, never leaving the target half-replaced.
* :func:`temporary_sibling` names such a temporary sibling.
* :func:`sync_file` makes what was written through an open handle durable (append logs).

>>> import pathlib, tempfile
>>> target = pathlib.Path(tempfile.mkdtemp()) / "note.txt"
>>> write_atomic(target, b"first")
>>> write_atomic(target, lambda handle: handle.write(b"second"))
>>> target.read_bytes()
b'second'
>>> with atomic_path(target) as tmp:
...     _ = tmp.write_text("third")
>>> target.read_text()
'third'
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_path",
    "fsync_dir",
    "json_bytes",
    "replace_dir",
    "sync_file",
    "temporary_sibling",
    "write_atomic",
    "write_durable",
]

Content = bytes | Callable[[IO[bytes]], Any]


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory ``path`` durable (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sync_file(handle: IO[Any]) -> None:
    """Flush ``handle`` and ``fsync`` its file: what was written survives a crash."""
    handle.flush()
    os.fsync(handle.fileno())


def write_durable(path: str | os.PathLike, content: Content) -> int:
    """Write ``content`` (bytes, or ``fn(handle)``) to the new file ``path``, ``fsync``-ed.

    Creates missing parent directories; returns the file size in bytes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        if callable(content):
            content(handle)
        else:
            handle.write(content)
        sync_file(handle)
    return path.stat().st_size


def temporary_sibling(path: str | os.PathLike, kind: str = "tmp") -> Path:
    """A hidden, unique name next to ``path`` that ends in ``path``'s name (same suffix).

    For a file or directory written in full before it is moved to ``path``.
    """
    path = Path(path)
    return path.with_name(f".{kind}-{uuid.uuid4().hex[:8]}-{path.name}")


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temporary sibling to fill; moved over ``path`` (then its folder synced) on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_path(path) as tmp:`` write the file ``tmp``; it then replaces ``path``.

    ``tmp`` is a temporary sibling whose name ends like ``path``'s (a writer that picks a
    format or a compression from the suffix treats it as ``path``). When the block
    succeeds ``tmp`` is ``fsync``-ed and moved over ``path`` atomically, and the directory
    is ``fsync``-ed; on any error ``tmp`` is removed and ``path`` is left as it was.
    Missing parent directories are created.
    """
    with _replacing(Path(path)) as tmp:
        yield tmp
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())


def write_atomic(path: str | os.PathLike, content: Content) -> None:
    """Replace ``path`` with ``content`` atomically and durably (see the module docstring).

    On any error the temporary file is removed and ``path`` is left as it was.
    """
    with _replacing(Path(path)) as tmp:
        write_durable(tmp, content)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(folder)


def replace_dir(new: str | os.PathLike, target: str | os.PathLike) -> None:
    """Move the finished directory ``new`` to ``target``, replacing what is there.

    ``new``'s files are ``fsync``-ed first. A directory already at ``target`` is moved to
    a hidden sibling, put back if the move of ``new`` fails, and deleted only once ``new``
    is in place: at every moment ``target`` is the old or the new directory, whole. ``new``
    must be on the same file system (a sibling, as written by the caller).
    """
    new, target = Path(new), Path(target)
    _fsync_tree(new)
    if not target.exists():
        os.replace(new, target)
        fsync_dir(target.parent)
        return
    old = temporary_sibling(target, "replaced")
    os.replace(target, old)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(old, target)  # put the previous directory back
        raise
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def json_bytes(data: Any) -> bytes:
    """``data`` as pretty-printed JSON (indent 2, trailing newline)."""
    return json.dumps(data, indent=2, allow_nan=True).encode() + b"\n"
