"""Helpers shared by the zarr store's writer and reader (store handles, descriptions)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

FORMAT = "nvalchemi-atomicdata-zarr/1"
LEVELS = ("atom", "edge", "system")


def zarr_module():
    from nvalchemi._optional import OptionalDependency

    return OptionalDependency.ZARR.require("the zarr store")


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
