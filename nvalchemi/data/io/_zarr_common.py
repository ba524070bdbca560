"""Helpers shared by the zarr store's writer and reader (store handles, formats, errors)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FORMAT = "nvalchemi-atomicdata-zarr/2"
"""Format of the stores written now: every chunk of every array is written, so a chunk
file that is absent means damage (an interrupted copy), never "all zeros"."""
FORMAT_V1 = "nvalchemi-atomicdata-zarr/1"
"""Stores written before: chunks holding only zeros were left out, so an absent chunk
reads as zeros (as does the reference toolkit's layout, which has no ``format``)."""
LEVELS = ("atom", "edge", "system")


class StoreDamagedError(ValueError):
    """A zarr store's files or metadata are damaged or inconsistent (names store and array)."""


def zarr_module():
    from nvalchemi._optional import OptionalDependency

    return OptionalDependency.ZARR.require("the zarr store")


@contextlib.contextmanager
def writing_every_chunk() -> Iterator[None]:
    """zarr writes inside this block store every chunk, also those holding only zeros.

    zarr skips such chunks by default and reads them back as the fill value; then an
    absent file could mean "zeros" or "lost in a copy". Writing them all makes absence
    always mean damage, which the reader reports instead of returning zeros.
    """
    with zarr_module().config.set({"array.write_empty_chunks": True}):
        yield


# ----------------------------------------------------------------------- stores
def open_store(store: Any) -> Any:
    """A zarr store object for a path, a dict, or any zarr store."""
    zarr = zarr_module()
    if isinstance(store, (str, os.PathLike)):
        return zarr.storage.LocalStore(str(store))
    if isinstance(store, dict):
        return zarr.storage.MemoryStore(store)
    return store


def store_exists(store: Any) -> bool:
    if isinstance(store, (str, os.PathLike)):
        path = Path(store)  # an empty directory (e.g. made by mkdtemp) is not a store yet
        return path.exists() and (not path.is_dir() or any(path.iterdir()))
    zarr = zarr_module()
    try:
        group = zarr.open_group(open_store(store), mode="r")
    except (FileNotFoundError, KeyError, ValueError, zarr.errors.GroupNotFoundError):
        return False
    return any(True for _ in group.members())


def describe(store: Any) -> str:
    return str(store) if isinstance(store, (str, os.PathLike)) else type(store).__name__
