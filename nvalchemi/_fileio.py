"""Durable and atomic file writes: the one helper every writer in the package uses.

* :func:`write_durable` writes a new file and ``fsync``-s it (its directory is synced by
  the caller once all entries are in place, or by :func:`write_atomic`).
* :func:`write_atomic` replaces a file so that readers (and a crash at any moment) see
  either the old or the new content, never a partial file: a temporary sibling is written
  and ``fsync``-ed, ``os.replace``-d over the target, and the directory is ``fsync``-ed.

>>> import pathlib, tempfile
>>> target = pathlib.Path(tempfile.mkdtemp()) / "note.txt"
>>> write_atomic(target, b"first")
>>> write_atomic(target, lambda handle: handle.write(b"second"))
>>> target.read_bytes()
b'second'
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["fsync_dir", "json_bytes", "write_atomic", "write_durable"]

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
        handle.flush()
        os.fsync(handle.fileno())
    return path.stat().st_size


def write_atomic(path: str | os.PathLike, content: Content) -> None:
    """Replace ``path`` with ``content`` atomically and durably (see the module docstring).

    On any error the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        write_durable(tmp, content)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def json_bytes(data: Any) -> bytes:
    """``data`` as pretty-printed JSON (indent 2, trailing newline)."""
    return json.dumps(data, indent=2, allow_nan=True).encode() + b"\n"
