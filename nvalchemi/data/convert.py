"""Convert extxyz / ASE db files into a zarr store without ever losing data.

* :func:`check_output` refuses outputs that would destroy an input or anything that is
  not a store;
* :func:`convert_to_zarr` streams structures into an ``AtomicDataZarrWriter`` store in
  chunks (optionally with neighbour lists for a cutoff, so training need not build
  them), reporting progress, in a temporary sibling that is moved into place when
  complete;
* :func:`remove_leftovers` deletes the partial stores of conversions that were killed
  (``SIGKILL``, a crash, a power cut) before they could clean up, and only those.

A partial store ``.converting-<hex>-<name>`` is marked by a file next to it,
``.converting-<hex>-<name>.owner``, that the converting process holds an exclusive
``flock`` on while it runs and deletes when done. A marker whose lock can be taken
belongs to a process that is gone: its partial store is ours to delete. A directory
without a marker (or one whose lock is held) is left alone.

Errors are :class:`~nvalchemi._errors.FieldError` naming ``INPUT`` / ``OUTPUT`` (the
arguments of ``nvalchemi-training data convert``).

Example:
    >>> from nvalchemi.data.convert import check_output
    >>> check_output(["data/train.extxyz"], "data/train.zarr", overwrite=False)  # doctest: +SKIP
    PosixPath('data/train.zarr')
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError
from nvalchemi._fileio import replace_dir, temporary_sibling

try:
    import fcntl
except ImportError:  # not POSIX: partial stores go unmarked, leftovers are never removed
    fcntl = None

__all__ = ["check_output", "convert_to_zarr", "open_inputs", "remove_leftovers"]

ProgressFn = Callable[[int, int], None]
_PARTIAL = "converting"  # partial stores are .converting-<hex>-<output name>
_OWNER = ".owner"  # their markers: .converting-<hex>-<output name>.owner
_MARK = "nvalchemi data convert"
_WRITE_ATOMS = 1 << 19  # without chunk_size, structures are written this many atoms at a time
_READ_STEP = 256  # structures read between progress reports (and stop checks)


def open_inputs(
    inputs: Sequence[str],
    *,
    dtype: str = "float32",
    label_keys: dict[str, str] | None = None,
    max_structures: int | None = None,
) -> list[Any]:
    """Readers of extxyz / ASE db ``inputs`` (``FieldError`` for stores or bad files).

    Labels are read in float64; :func:`convert_to_zarr` keeps total energies and virials
    exact and stores the others in the positions' ``dtype`` (see
    :mod:`nvalchemi.data.label_precision`).
    """
    from nvalchemi.data.sources import detect_format, open_reader

    for path in inputs:
        if Path(path).exists() and detect_format(path) == "alchemi-zarr":
            raise FieldError(
                f"{path} is already a zarr store",
                field="INPUT",
                fix="convert extxyz or ASE db files",
            )
    return [
        open_reader(
            p,
            dtype=dtype,
            label_dtype="float64",
            label_keys=label_keys,
            max_structures=max_structures,
            field="INPUT",
        )
        for p in inputs
    ]


def _is_our_store(path: Path) -> bool:
    """Whether ``path`` is a zarr store in our layout (any format, also the reference's)."""
    return (
        path.is_dir()
        and (path / "zarr.json").is_file()
        and (path / "meta").is_dir()
        and (path / "core").is_dir()
    )


def check_output(inputs: Sequence[str | Path], output: str | Path, *, overwrite: bool) -> Path:
    """``output`` checked for :func:`convert_to_zarr` (``FieldError`` when it may not be written).

    Refused, with or without ``overwrite``: an output that is one of the inputs, holds
    one (a directory above it) or lies inside one. An existing output needs
    ``overwrite``, and only a zarr store in our layout (or an empty directory) is ever
    replaced: a file or a directory with other contents is not ours to delete.
    """
    output = Path(output)
    target = output.resolve()
    for given in inputs:
        source = Path(given).resolve()
        if target == source or target in source.parents or source in target.parents:
            relation = (
                "is"
                if target == source
                else "contains"
                if target in source.parents
                else "is inside"
            )
            raise FieldError(
                f"{output} {relation} the input {given}; writing it would destroy the data "
                "being converted",
                field="OUTPUT",
                fix="write the store to a new path next to the inputs, e.g. data/train.zarr",
            )
    if not output.exists() and not output.is_symlink():
        return output
    if not overwrite:
        raise FieldError(
            f"{output} already exists", field="OUTPUT", fix="choose a new path or pass --overwrite"
        )
    empty_dir = output.is_dir() and not output.is_symlink() and not any(output.iterdir())
    if output.is_symlink() or not (empty_dir or _is_our_store(output)):
        kind = "a file" if output.is_file() else "not a zarr store written by nvalchemi"
        raise FieldError(
            f"{output} is {kind}; --overwrite replaces only such stores (or an empty directory)",
            field="OUTPUT",
            fix="choose another path, or move it away yourself if it can go",
        )
    return output


def convert_to_zarr(
    readers: Sequence[Any],
    output: str | Path,
    *,
    cutoff: float | None = None,
    half_list: bool = False,
    chunk_size: int | None = None,
    progress: ProgressFn | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write every structure of ``readers`` to a new zarr store ``output``; return a summary.

    The store is built in a temporary sibling directory and moved into place only when
    complete: an interrupted or failed conversion leaves ``output`` as it was (absent,
    or the store it replaces, with ``overwrite=True``; see :func:`check_output`, which
    the caller runs first with the input paths). Readers are closed afterwards.
    """
    output = Path(output)
    if output.exists() and not overwrite:
        raise FieldError(
            f"{output} already exists", field="OUTPUT", fix="choose a new path or pass --overwrite"
        )
    try:
        with _writing(output):
            output.parent.mkdir(parents=True, exist_ok=True)
        removed = remove_leftovers(output.parent)
        partial = temporary_sibling(output, _PARTIAL)
        with _writing(output), _claimed(partial, output):
            summary = _write_store(readers, partial, cutoff, half_list, chunk_size, progress)
            replace_dir(partial, output)
    finally:
        for reader in readers:
            reader.close()
    summary["output"] = str(output)
    summary["removed_leftovers"] = [str(p) for p in removed]
    return summary


@contextlib.contextmanager
def _writing(output: Path) -> Iterator[None]:
    """A failed write of the store (full disk, read-only folder) as a ``FieldError``.

    Raised inside :func:`_claimed`, so the message can say that the partial store is
    gone. Errors of reading the inputs never pass here: the readers raise
    ``ValueError`` naming the file.
    """
    try:
        yield
    except OSError as exc:
        folder = output.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent  # the folder that could not take the new one
        space = "free space there, or write OUTPUT to another disk"
        elsewhere = "choose an OUTPUT in a folder you can write to"
        cause, fix = {
            errno.ENOSPC: (f"the disk holding {folder} is full (no space left on device)", space),
            errno.EDQUOT: (f"your disk quota for {folder} is used up", space),
            errno.EFBIG: (
                "a file of the store would exceed the largest file size allowed here (the "
                "file system's limit or `ulimit -f`)",
                "raise the limit, or write OUTPUT to another disk",
            ),
            errno.EROFS: (f"{folder} is on a read-only file system", elsewhere),
            errno.EACCES: (f"{folder} is not writable for you (permission denied)", elsewhere),
            errno.EPERM: (f"{folder} is not writable for you (operation not permitted)", elsewhere),
        }.get(exc.errno, (f"{exc.strerror or exc} ({exc.filename or folder})", elsewhere))
        raise FieldError(
            f"cannot write {output}: {cause}; nothing was written (the partial store was removed)",
            field="OUTPUT",
            fix=fix,
        ) from exc


@contextlib.contextmanager
def _claimed(partial: Path, output: Path) -> Iterator[None]:
    """Mark ``partial`` as this process's while the block runs; remove it afterwards.

    The marker is created (and locked) before the partial store exists and deleted
    after it is gone (moved into place or removed), so no moment leaves an unmarked
    partial store behind, whatever kills the process.
    """
    if fcntl is None:
        try:
            yield
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return
    marker = partial.with_name(partial.name + _OWNER)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        note = {"mark": _MARK, "pid": os.getpid(), "host": socket.gethostname()}
        os.write(fd, json.dumps({**note, "output": str(output)}).encode())
        os.fsync(fd)
        try:
            yield
        finally:
            shutil.rmtree(partial, ignore_errors=True)  # only ever what this call created
    finally:
        with contextlib.suppress(OSError):
            marker.unlink()
        os.close(fd)


def remove_leftovers(folder: str | Path) -> list[Path]:
    """Delete the partial stores that killed conversions left in ``folder``; return them.

    Only a partial store whose marker (see the module docstring) is a regular file
    written by ``data convert`` and whose lock nobody holds is deleted: its process is
    gone. Running conversions (their lock is held), unmarked directories and anything
    else are left alone. Without ``flock`` (not POSIX) nothing is removed.
    """
    if fcntl is None:
        return []
    removed = []
    for marker in sorted(Path(folder).glob(f".{_PARTIAL}-*{_OWNER}")):
        try:
            fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # a symlink, gone meanwhile, unreadable: not ours to judge
        try:
            if not _is_our_marker(fd):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: that conversion is running
            partial = marker.with_name(marker.name[: -len(_OWNER)])
            if partial.is_dir() and not partial.is_symlink():
                shutil.rmtree(partial)
                removed.append(partial)
            marker.unlink()
        finally:
            os.close(fd)
    return removed


def _is_our_marker(fd: int) -> bool:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > 4096:
        return False
    try:
        note = json.loads(os.read(fd, 4096))
    except ValueError:
        return False  # empty (being created) or not ours
    return isinstance(note, dict) and note.get("mark") == _MARK


def _write_store(
    readers: Sequence[Any],
    path: Path,
    cutoff: float | None,
    half_list: bool,
    chunk_size: int | None,
    progress: ProgressFn | None,
) -> dict[str, Any]:
    from nvalchemi.data.io.zarr import AtomicDataZarrWriter
    from nvalchemi.data.neighbors import NeighborListTransform

    transform = None if cutoff is None else NeighborListTransform(cutoff, half_list=half_list)
    total = sum(len(r) for r in readers)
    writer = AtomicDataZarrWriter(str(path))
    done, atoms, edges, written = 0, 0, 0, 0
    pending: list[Any] = []  # read, not yet written
    pending_atoms = 0
    warnings: list[str] = []

    def flush() -> None:
        nonlocal pending, pending_atoms, written
        (writer.append if written else writer.write)(pending)
        written += len(pending)
        pending, pending_atoms = [], 0

    step = chunk_size or _READ_STEP
    for reader in readers:
        for start in range(0, len(reader), step):
            for i in range(start, min(start + step, len(reader))):
                data = _stored_dtypes(reader.read_data(i))
                warnings += _close_atoms(data, reader, i)
                if transform is not None:
                    data, _ = transform(data, {"index": done})
                    edges += int(data.num_edges)
                atoms += int(data.num_nodes)
                pending_atoms += int(data.num_nodes)
                pending.append(data)
                done += 1
            if len(pending) >= chunk_size if chunk_size else pending_atoms >= _WRITE_ATOMS:
                flush()
            if progress is not None:
                progress(done, total)
    if pending:
        flush()
    if not written:
        raise FieldError(
            "the inputs hold no structures", field="INPUT", fix="check the input files"
        )
    summary: dict[str, Any] = {"structures": done, "atoms": atoms, "warnings": warnings}
    if cutoff is not None:
        summary.update({"neighbor_cutoff": float(cutoff), "edges": edges})
    return summary


def _close_atoms(data: Any, reader: Any, index: int) -> list[str]:
    """Refuse duplicate atoms (``FieldError`` naming file, frame and pair); warn of close ones."""
    from nvalchemi.data.close_pairs import closest_pair, describe_close_pair

    pair = closest_pair(data.positions, data.cell, data.pbc)
    if pair is None:
        return []
    info = getattr(data, "info", {}) or {}
    where = (
        f"{info['source_file']}: frame {info['frame']}"
        if "source_file" in info
        else f"structure {index}"
    )
    text = describe_close_pair(pair, where)
    if pair.duplicate:
        message, _, fix = text.partition("; ")
        raise FieldError(message, field="INPUT", fix=fix)
    return [text]


def _stored_dtypes(data: Any) -> Any:
    """Floats in the positions' dtype, except total energies and virials (kept float64).

    An energy or a virial grows with the structure (float32 rounds -4.6e5 eV by up to
    16 meV); forces, stresses and the rest are fine in float32 (7 significant digits).
    """
    from nvalchemi.data.fields import FIELDS
    from nvalchemi.data.label_precision import EXTENSIVE_LABELS

    dtype = data.positions.dtype
    for key, value in data.items():
        known = key in FIELDS and key not in EXTENSIVE_LABELS
        if known and value.dtype.is_floating_point and value.dtype != dtype:
            data[key] = value.to(dtype)
    return data
