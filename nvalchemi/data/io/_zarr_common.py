"""Helpers shared by the zarr store's writer and reader (store handles, formats, errors)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FORMAT_FAMILY = "nvalchemi-atomicdata-zarr/"
"""Prefix of the ``format`` attribute of every store this package wrote (any version)."""
FORMAT = "nvalchemi-atomicdata-zarr/3"
"""Format of the stores written now: as format 2, and arrays are sharded by default (few
files, small compressed chunks) and record their field, level and unit."""
FORMAT_V2 = "nvalchemi-atomicdata-zarr/2"
"""Every chunk of every array is written, so a chunk file that is absent means damage
(an interrupted copy), never "all zeros". Stores of format 2 still read as they are."""
EVERY_CHUNK_WRITTEN = (FORMAT_V2, FORMAT)
FORMAT_V1 = "nvalchemi-atomicdata-zarr/1"
"""Stores written before: chunks holding only zeros were left out, so an absent chunk
reads as zeros (as does the reference toolkit's layout, which has no ``format``)."""
LEVELS = ("atom", "edge", "system")
META_LEVELS = {
    "atoms_ptr": "pointer",
    "edges_ptr": "pointer",
    "samples_mask": "system",
    "atoms_mask": "atom",
    "edges_mask": "edge",
}
"""The arrays of the ``meta`` group and their levels (``"pointer"``: ``num_samples + 1`` rows)."""


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


# ----------------------------------------------------------------------- arrays
def array_attributes(group: str, name: str, level: str) -> dict[str, str]:
    """What the writer records in each array's own ``zarr.json``: field, level and unit.

    The record travels with the array's directory, so arrays swapped or renamed on disk
    (``core/positions`` holding the forces) no longer pass as valid; see
    :func:`attribute_problems`.
    """
    from nvalchemi.data.fields import FIELDS

    attributes = {"field": name, "level": level}
    spec = FIELDS.get(name) if group == "core" else None
    if spec is not None and spec.unit is not None:
        attributes["unit"] = spec.unit
    return attributes


_KINDS = {"float": "f", "int": "iu", "index": "iu", "bool": "b"}


def attribute_problems(group: str, name: str, level: str, array: Any, *, ours: bool) -> list[str]:
    """Why array ``group/name`` cannot hold what the store's metadata says it holds.

    Checks the record :func:`array_attributes` wrote (absent in older stores) and, for
    known fields of stores written by this package (``ours``), the level, trailing
    shape and dtype kind of :data:`~nvalchemi.data.fields.FIELDS`.
    """
    import numpy as np

    from nvalchemi.data.fields import FIELDS

    where = f"array {group}/{name}"
    problems = []
    attrs = dict(getattr(array, "attrs", {}) or {})
    recorded = attrs.get("field")
    if recorded is not None and recorded != name:
        problems.append(
            f"{where} holds {recorded!r} (as its own zarr.json records): arrays were swapped "
            "or renamed"
        )
    if attrs.get("level") not in (None, level):
        problems.append(f"{where} holds {attrs['level']}-level rows; the store lists it as {level}")
    spec = FIELDS.get(name) if group == "core" else None
    if spec is None or recorded not in (None, name):
        return problems
    unit = attrs.get("unit")
    if unit is not None and unit != spec.unit:
        problems.append(f"{where} is in {unit}; {name} must be in {spec.unit}")
    if not ours:
        return problems
    shape = tuple(int(d) for d in array.shape[1:])
    kind = np.dtype(array.dtype).kind
    if level != spec.level:
        problems.append(f"{where} is listed as {level}-level; {name} is {spec.level}-level")
    elif not spec.check_trailing_shape(shape):
        problems.append(
            f"{where} has rows of shape {list(shape)}; {name} needs {spec.shape_text()}"
        )
    elif kind not in _KINDS[spec.kind]:
        problems.append(f"{where} has dtype {array.dtype}; {name} needs {spec.kind} values")
    return problems


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
