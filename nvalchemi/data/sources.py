"""Open training data: extxyz / ASE db files and zarr stores, splits, datasets, loaders.

* :func:`detect_format` tells the format from the path (``.extxyz``/``.xyz`` (also
  compressed), ``.db``, a ``.zarr`` directory or any directory holding ``zarr.json``);
* :func:`open_reader` opens one source lazily (``ASEReader`` or ``AtomicDataZarrReader``);
* :func:`split_reader` makes the seeded train/validation split of ``--val-fraction``;
* :func:`make_dataset` wraps readers as datasets (several become one ``MultiDataset``),
  with neighbour lists for the model's cutoff computed once per structure and cached
  (stores written with lists for the same cutoff are used as they are);
* :func:`make_loader` builds the batch ``DataLoader``.

Example:
    >>> detect_format("data/train.extxyz.gz"), detect_format("data/train.db")
    ('extxyz', 'ase-db')
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError
from nvalchemi.data.datapipes.reader import Reader
from nvalchemi.data.io._zarr_common import StoreDamagedError

__all__ = [
    "ChainedBatches",
    "DataSources",
    "SubsetReader",
    "detect_format",
    "make_dataset",
    "make_loader",
    "open_reader",
    "neighbor_config_of",
    "open_sources",
    "split_reader",
]

_EXTXYZ = (".xyz", ".extxyz")
_COMPRESSED = (".gz", ".bz2", ".xz")
_FORMATS = "extxyz (.xyz/.extxyz, optionally .gz/.bz2/.xz), ASE database (.db) or zarr store"


def detect_format(path: str | Path, declared: str = "auto") -> str:
    """``"extxyz"``, ``"ase-db"`` or ``"alchemi-zarr"`` for ``path``."""
    if declared not in ("auto", None):
        return "alchemi-zarr" if declared.startswith("alchemi-zarr") else declared
    path = Path(path)
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes = suffixes[:-1]
    if path.is_dir() or (suffixes and suffixes[-1] == ".zarr"):
        return "alchemi-zarr"
    if suffixes and suffixes[-1] in _EXTXYZ:
        return "extxyz"
    if suffixes and suffixes[-1] == ".db":
        return "ase-db"
    raise FieldError(
        f"cannot tell the format of {path}", fix=f"use {_FORMATS}, or set dataset.format"
    )


class SubsetReader(Reader):
    """Selected structures of another reader (``indices`` into it), in that order.

    Metadata keeps the parent's ``index`` so per-structure caches stay valid.
    """

    def __init__(self, reader: Any, indices: Sequence[int]) -> None:
        super().__init__(include_index_in_metadata=False)
        self.reader = reader
        self.indices = [int(i) for i in indices]
        self.validates = getattr(reader, "validates", False)

    def __len__(self) -> int:
        return len(self.indices)

    def _parent(self, index: int) -> int:
        if not -len(self.indices) <= index < len(self.indices):
            raise IndexError(f"Index {index} is out of range for {len(self.indices)} structures.")
        return self.indices[index]

    def read(self, index: int) -> Any:
        return self.reader.read(self._parent(int(index)))

    __getitem__ = read

    def read_many(self, indices: Sequence[int]) -> list[Any]:
        return self.reader.read_many([self._parent(int(i)) for i in indices])

    def _load_sample(self, index: int) -> Any:
        return self.read(index)[0]

    def get_metadata(self, index: int) -> Any:
        """``(num_atoms, num_edges)``: the parent's when it knows them, else read."""
        getter = getattr(self.reader, "get_metadata", None)
        if callable(getter):
            return getter(self._parent(int(index)))
        sample = self._load_sample(index)
        edges = sample.get("edge_index")
        return len(sample["atomic_numbers"]), 0 if edges is None else int(edges.shape[-1])

    @property
    def field_levels(self) -> dict[str, str]:
        return dict(getattr(self.reader, "field_levels", {}) or {})

    def close(self) -> None:
        self.reader.close()


def open_reader(
    path: str | Path,
    *,
    format: str = "auto",
    dtype: str = "float32",
    label_dtype: str | None = None,
    label_keys: dict[str, str] | None = None,
    max_structures: int | None = None,
    field: str = "dataset.path",
    config_type_weights: dict[str, float] | None = None,
) -> Any:
    """A lazy reader of one file or store (:class:`FieldError` naming ``field`` when it fails).

    ``config_type_weights`` weight the structures of extxyz / ASE db files by their
    ``config_type`` (zarr stores keep no ``config_type``: a :class:`FieldError`).

    ``max_structures`` keeps the first N structures; ``label_keys`` says where labels
    live in extxyz / ASE db files (``{"energy": "REF_energy"}``). ``dtype`` is the dtype
    of positions and cells read from extxyz / ASE db files (stores keep theirs);
    labels come in ``label_dtype``, by default the positions' dtype, so a batch has
    one floating dtype (stores written by ``data convert`` hold structure-level labels
    in float64: pass ``"float64"`` to read them exactly).
    """
    import torch

    path = Path(path)
    if not path.exists():
        raise FieldError(
            f"{path} does not exist", field=field, fix=f"give the path of an {_FORMATS}"
        )
    kind = detect_format(path, format)
    try:
        if kind == "alchemi-zarr":
            from nvalchemi.data.io.zarr import AtomicDataZarrReader

            if config_type_weights:
                raise FieldError(
                    f"{path} is a zarr store, which keeps no config_type, so "
                    "config_type_weights cannot weight it",
                    field="dataset.config_type_weights",
                    fix="train from the extxyz/db files, or convert them with the weights "
                    "in the files (config_weight, which data convert keeps)",
                )

            labels = "positions" if label_dtype is None else getattr(torch, label_dtype)
            reader = AtomicDataZarrReader(str(path), label_dtype=labels)
            if max_structures is not None and max_structures < len(reader):
                reader = SubsetReader(reader, range(max_structures))
            return reader
        from nvalchemi.data.io.ase import ASEReader

        keys = {f"{label}_key": key for label, key in (label_keys or {}).items()}
        index: Any = ":" if max_structures is None else slice(0, max_structures)
        return ASEReader(
            path,
            index=index,
            format="db" if kind == "ase-db" else "extxyz",
            dtype=getattr(torch, dtype),
            label_dtype=None if label_dtype is None else getattr(torch, label_dtype),
            config_type_weights=config_type_weights,
            **keys,
        )
    except FieldError:
        raise
    except Exception as exc:
        message = " ".join(str(exc).split())
        if isinstance(exc, StoreDamagedError):  # names the store, the array and the fix
            raise FieldError(message, field=field) from None
        raise FieldError(
            f"cannot read {path}: {message}", field=field, fix=f"check that it is an {_FORMATS}"
        ) from None


def split_reader(reader: Any, fraction: float, seed: int) -> tuple[SubsetReader, SubsetReader]:
    """``(train, validation)`` subsets; validation is a seeded random ``fraction`` (>= 1)."""
    import numpy as np

    n = len(reader)
    count = max(1, min(n - 1, math.floor(n * fraction + 0.5)))
    if n < 2:
        raise FieldError(
            f"cannot hold out a validation fraction from {n} structure(s)",
            field="dataset.val_fraction",
            fix="use more data or a separate validation file",
        )
    order = np.random.default_rng(seed).permutation(n)
    val, train = sorted(order[:count].tolist()), sorted(order[count:].tolist())
    return SubsetReader(reader, train), SubsetReader(reader, val)


@dataclass
class DataSources:
    """Readers of the training and validation data of a job (close them when done)."""

    train: list[Any] = field(default_factory=list)
    validation: list[Any] = field(default_factory=list)

    def close(self) -> None:
        for reader in {id(r): r for r in [*self.train, *self.validation]}.values():
            with contextlib.suppress(Exception):
                reader.close()

    @property
    def num_train(self) -> int:
        return sum(len(r) for r in self.train)

    @property
    def num_validation(self) -> int:
        return sum(len(r) for r in self.validation)


def open_sources(
    paths: Sequence[str | Path],
    *,
    validation_paths: Sequence[str | Path] = (),
    val_fraction: float | None = None,
    seed: int = 0,
    format: str = "auto",
    dtype: str = "float32",
    label_keys: dict[str, str] | None = None,
    max_structures: int | None = None,
    config_type_weights: dict[str, float] | None = None,
) -> DataSources:
    """Readers of training data ``paths`` and of validation data (files or a split).

    Validation data comes from ``validation_paths`` or, with ``val_fraction``, a seeded
    random split of every training file (seed ``seed + i`` for file ``i``); give at
    most one of them. ``config_type_weights`` apply to both (the validation loss is
    weighted like the training loss; the error tables never are). Errors name the job fields ``dataset.path`` /
    ``dataset.validation_path``.

    Example:
        >>> from nvalchemi.data.bundled import bundled_split_path
        >>> sources = open_sources([bundled_split_path("val")], val_fraction=0.25,
        ...                        max_structures=8)
        >>> sources.num_train, sources.num_validation
        (6, 2)
    """
    if validation_paths and val_fraction is not None:
        raise FieldError(
            "give validation files or a validation fraction, not both",
            field="dataset.validation_path",
            fix="drop dataset.val_fraction (or the validation files)",
        )
    options = {
        "format": format,
        "dtype": dtype,
        "label_keys": label_keys,
        "max_structures": max_structures,
        "config_type_weights": config_type_weights,
    }
    sources = DataSources()
    train = [open_reader(p, field="dataset.path", **options) for p in paths]
    if validation_paths:
        sources.validation = [
            open_reader(p, field="dataset.validation_path", **options) for p in validation_paths
        ]
        sources.train = train
    elif val_fraction is not None:
        for i, reader in enumerate(train):
            kept, held_out = split_reader(reader, val_fraction, seed + i)
            sources.train.append(kept)
            sources.validation.append(held_out)
    else:
        sources.train = train
    return sources


def make_dataset(
    readers: Sequence[Any],
    *,
    neighbor_config: Any = None,
    in_memory: bool = False,
    n_threads: int | None = None,
) -> Any:
    """A dataset over ``readers`` (``MultiDataset`` for several) with cached neighbour lists.

    ``in_memory`` loads every structure once (and builds its list once); ``n_threads``
    is the neighbour-list builder's thread count (``None``: vesin's default).
    """
    from nvalchemi.data.datapipes.dataset import Dataset, InMemoryDataset
    from nvalchemi.data.datapipes.multidataset import MultiDataset
    from nvalchemi.data.neighbors import NeighborListTransform

    datasets = []
    for reader in readers:
        transforms = None
        if neighbor_config is not None:
            transforms = [
                NeighborListTransform(neighbor_config, cache=not in_memory, n_threads=n_threads)
            ]
        if in_memory:
            datasets.append(InMemoryDataset(reader=reader, transforms=transforms))
        else:
            datasets.append(Dataset(reader, transforms=transforms))
    if not datasets:
        raise FieldError("no data", field="dataset.path", fix="give at least one data file")
    # Sources may carry different labels (stress only for crystals, say): missing ones are NaN.
    return datasets[0] if len(datasets) == 1 else MultiDataset(*datasets, output_strict=False)


def make_loader(
    dataset: Any,
    *,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    num_workers: int = 0,
    drop_last: bool = False,
    balance_ranks: bool = False,
) -> Any:
    """The nvalchemi batch ``DataLoader``.

    ``balance_ranks`` under a multi-rank process group uses a
    :class:`~nvalchemi.data.datapipes.SizeBalancedBatchSampler` (equal atoms per rank and
    step; ``DDPHook`` keeps it) instead of round-robin shards, which leave ranks of
    mixed-size data waiting for each other at every gradient all-reduce.
    """
    import torch.distributed as dist

    from nvalchemi.data.datapipes import MultiDataset, SizeBalancedBatchSampler
    from nvalchemi.data.datapipes.dataloader import DataLoader

    multi_rank = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if balance_ranks and multi_rank and not isinstance(dataset, MultiDataset):
        sampler = SizeBalancedBatchSampler(
            dataset, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        num_workers=num_workers,
        drop_last=drop_last,
    )


class ChainedBatches:
    """Re-iterable batches of several readers, one reader after the other (no mixed batches).

    For statistics over sources that carry different fields (one file with stored
    neighbour lists, another without).
    """

    def __init__(self, readers: Sequence[Any], batch_size: int = 64) -> None:
        self.loaders = [make_loader(make_dataset([r]), batch_size=batch_size) for r in readers]

    def __iter__(self) -> Any:
        for loader in self.loaders:
            yield from loader

    def __len__(self) -> int:
        return sum(len(loader) for loader in self.loaders)


def neighbor_config_of(models: Any) -> Any:
    """The first ``model_config.neighbor_config`` among ``models`` (a module or mapping)."""
    candidates = models.values() if isinstance(models, dict) else [models]
    for model in candidates:
        while hasattr(model, "module") and not hasattr(model, "model_config"):
            model = model.module  # a DDP / compile wrapper
        config = getattr(getattr(model, "model_config", None), "neighbor_config", None)
        if config is not None:
            return config
    return None
