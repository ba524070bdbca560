"""File primitives for checkpoints: durable writes, safe reads, CPU snapshots of state.

* Durability: every file is written, flushed and ``fsync``-ed; a directory is
  ``fsync``-ed after entries are added or renamed in it; a file that must change in
  place (``manifest.json``) is replaced atomically (temporary file + ``fsync`` +
  ``os.replace`` + ``fsync`` of the directory).
* Safety: tensors are read only with ``torch.load(weights_only=True)``, which refuses
  pickled code (a class whose ``__reduce__`` calls ``os.system`` is rejected before
  anything runs); relative paths and component names read from a checkpoint must stay
  inside its root.
* Snapshots: :func:`cpu_snapshot` copies a state dict (tensors to CPU, containers
  rebuilt) so a background thread can write it while training continues, and refuses
  values that ``weights_only`` could not load back (naming where they are).

``NVALCHEMI_CHECKPOINT_SLOW_WRITES=<seconds>`` makes the writer sleep after each file
and each commit step; crash tests use it to kill a process in the middle of a save.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SnapshotBuffers",
    "UnsafeCheckpointError",
    "cpu_snapshot",
    "fsync_dir",
    "read_json",
    "remove_tree",
    "safe_component_name",
    "safe_relative_path",
    "safe_torch_load",
    "slow_write_pause",
    "temp_dir_name",
    "write_json",
    "write_json_atomic",
    "write_torch",
]

_SLOW_ENV = "NVALCHEMI_CHECKPOINT_SLOW_WRITES"
TEMP_PREFIX = ".tmp-"


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something that is refused when loading (e.g. pickled code)."""


# ---------------------------------------------------------------------------- writing
def slow_write_pause() -> None:
    """Sleep ``$NVALCHEMI_CHECKPOINT_SLOW_WRITES`` seconds (crash tests only; default 0)."""
    value = os.environ.get(_SLOW_ENV)
    if value:
        time.sleep(float(value))


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (no-op where unsupported)."""
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


def _durable_write(path: Path, write: Any) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    slow_write_pause()
    return path.stat().st_size


def write_json(path: Path, data: Any) -> int:
    """Write ``data`` as pretty JSON to a new file, durably; return its size in bytes."""
    text = json.dumps(data, indent=2, allow_nan=True).encode() + b"\n"
    return _durable_write(path, lambda handle: handle.write(text))


def write_torch(path: Path, obj: Any) -> int:
    """``torch.save`` ``obj`` to a new file, durably; return its size in bytes."""
    return _durable_write(path, lambda handle: torch.save(obj, handle))


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace ``path`` with JSON ``data`` atomically: readers see the old or the new file."""
    tmp = path.with_name(f"{TEMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    write_json(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    slow_write_pause()


def temp_dir_name(index: int) -> str:
    """Name of the directory a checkpoint is written into before it is renamed into place."""
    return f"{TEMP_PREFIX}{index}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_tree(path: Path) -> None:
    """Delete a file or directory tree if it exists (errors ignored: it is unreferenced)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# ---------------------------------------------------------------------------- reading
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
        or name.startswith(TEMP_PREFIX)
    ):
        raise ValueError(
            f"{what} name {name!r} is not a valid checkpoint component name; use a non-empty "
            "name without path separators (e.g. 'main')."
        )
    return name


def safe_relative_path(root: Path, relative: Any, what: str) -> Path:
    """``root / relative`` if ``relative`` stays inside ``root`` (refuses ``..`` and absolute)."""
    if not isinstance(relative, str) or not relative:
        raise ValueError(f"{what}: expected a relative path string; got {relative!r}.")
    candidate = Path(relative)
    if candidate.is_absolute() or ".." in candidate.parts:
        raise ValueError(
            f"{what}: path {relative!r} leaves the checkpoint directory {root}; refusing it."
        )
    return root / candidate


# ---------------------------------------------------------------------------- snapshots
_LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


class SnapshotBuffers:
    """CPU tensors reused from one snapshot to the next (pinned when the source is on a GPU).

    A fresh allocation per save costs page faults on every byte (often more than the copy
    itself); reusing the previous snapshot's buffers leaves just the copy. Only reuse them
    once the previous snapshot has been written (the checkpoint hook waits for that).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending_streams: set[Any] = set()

    def copy(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """A CPU copy of ``tensor`` in the buffer for ``key``."""
        if tensor.layout is not torch.strided or tensor.is_quantized:
            return tensor.to("cpu", copy=True)
        on_gpu = tensor.device.type == "cuda"
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=on_gpu)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=on_gpu)
        if on_gpu:
            self._pending_streams.add(torch.cuda.current_stream(tensor.device))
        return buffer

    def finish(self) -> None:
        """Wait for asynchronous device-to-host copies (call before handing data to a writer)."""
        for stream in self._pending_streams:
            stream.synchronize()
        self._pending_streams.clear()


def cpu_snapshot(value: Any, where: str, buffers: SnapshotBuffers | None = None) -> Any:
    """A copy of ``value`` with every tensor copied to the CPU, loadable with ``weights_only``.

    Containers (dict, OrderedDict, list, tuple, ``torch.Size``, set) are rebuilt;
    numpy scalars become Python numbers. Anything else raises ``TypeError`` naming
    its location, because ``torch.load(weights_only=True)`` would refuse it later.
    With ``buffers`` tensors are copied into reused buffers (call ``buffers.finish()``
    before reading them).
    """
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if buffers is not None:
            return buffers.copy(value, where)
        if value.device.type == "cpu":
            return value.clone()
        return value.to("cpu", copy=True)
    if isinstance(value, _LEAVES):
        return value
    if isinstance(value, torch.Size):
        return value
    if isinstance(value, OrderedDict):
        return OrderedDict(
            (k, cpu_snapshot(v, f"{where}[{k!r}]", buffers)) for k, v in value.items()
        )
    if isinstance(value, dict):
        return {k: cpu_snapshot(v, f"{where}[{k!r}]", buffers) for k, v in value.items()}
    if isinstance(value, list):
        return [cpu_snapshot(v, f"{where}[{i}]", buffers) for i, v in enumerate(value)]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(cpu_snapshot(v, f"{where}[{i}]", buffers) for i, v in enumerate(value))
    if isinstance(value, set) and type(value) is set:
        return {cpu_snapshot(v, where) for v in value}
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and callable(item) and getattr(value, "ndim", 1) == 0:
        return item()
    raise TypeError(
        f"{where} holds a {type(value).__module__}.{type(value).__qualname__}, which a "
        "checkpoint cannot store safely (files are read with torch.load(weights_only=True)). "
        "Return tensors, numbers, strings and plain containers from state_dict()."
    )
