"""Structure groups: the ``config_type`` (or any ``atoms.info`` key) of every structure.

Groups drive balanced sampling (:class:`~nvalchemi.data.datapipes.GroupBalancedSampler`),
``config_type_weights`` and the group table of ``data stats``. They are read from
extxyz comment lines and ASE db key-value pairs without parsing the atoms; zarr stores
keep no ``info``, so their structures have no group (``None``).

Example:
    >>> from nvalchemi.data.bundled import bundled_split_path
    >>> from nvalchemi.data.sources import open_reader
    >>> counts = group_counts(info_labels([open_reader(bundled_split_path("val"))]))
    >>> counts["rattle"], counts["cluster"]
    (48, 18)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = ["NO_GROUP", "group_counts", "info_labels"]

NO_GROUP = "(none)"
"""The group of a structure without the key (or from a store that keeps no ``info``)."""


def _labels_of(reader: Any, key: str) -> list[Any]:
    values = getattr(reader, "info_values", None)
    if callable(values):
        return list(values(key))
    inner, indices = getattr(reader, "reader", None), getattr(reader, "indices", None)
    if inner is not None and indices is not None:  # a subset (a validation split)
        labels = _labels_of(inner, key)
        return [labels[i] for i in indices]
    return [None] * len(reader)


def info_labels(readers: Sequence[Any], key: str = "config_type") -> list[Any]:
    """``atoms.info[key]`` of every structure of ``readers``, in order (``None`` if absent).

    Cheap: only the ``info`` of each structure is read (an extxyz frame's comment line).
    """
    return [label for reader in readers for label in _labels_of(reader, key)]


def group_counts(labels: Sequence[Any]) -> dict[str, int]:
    """``{group: structures}``, largest first; absent labels count as :data:`NO_GROUP`."""
    counts = Counter(NO_GROUP if label is None else str(label) for label in labels)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))
