"""Several datasets behind one global index space.

Global index ``g`` maps to child ``d`` and local index ``g - offsets[d]``, with
children concatenated in argument order. Batch requests are routed to the
children (one ``load_batches`` call per child per request) and mixed batches
are reassembled in the requested order.

Per-dataset constants can be attached to every structure: ``loss_weights`` (the
``loss_weight`` field, which the losses multiply into each structure's share, so a
weight scales that dataset's share of the gradient) and ``head_indices`` (the ``head``
field, which multi-head models use to pick a readout head per structure).

Example:
    >>> import torch
    >>> from nvalchemi.data import AtomicData
    >>> from nvalchemi.data.datapipes import InMemoryDataset, MultiDataset
    >>> def mols(z, n):
    ...     return InMemoryDataset(data_list=[AtomicData(atomic_numbers=torch.tensor([z]),
    ...                                                  positions=torch.zeros(1, 3))] * n)
    >>> multi = MultiDataset(mols(1, 2), mols(8, 3))
    >>> len(multi), multi.to_local_index(3)
    (5, (1, 1))
    >>> multi.get_batch([4, 0]).atomic_numbers.tolist()
    [8, 1]
    >>> weighted = MultiDataset(mols(1, 2), mols(8, 3), loss_weights=[1.0, 0.25])
    >>> weighted.get_batch([4, 0])["loss_weight"].reshape(-1).tolist()
    [0.25, 1.0]
"""

from __future__ import annotations

import bisect
import copy
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from nvalchemi.data.atomic_data import AtomicData
from nvalchemi.data.batch import Batch
from nvalchemi.data.datapipes.dataset import (
    BatchDatasetProtocol,
    Dataset,
    InMemoryDataset,
    check_index,
    flat_indices,
    resolve_device,
)

__all__ = ["DATASET_INDEX_METADATA_KEY", "HEAD_FIELD", "LOSS_WEIGHT_FIELD", "MultiDataset"]

DATASET_INDEX_METADATA_KEY = "dataset_index"
LOSS_WEIGHT_FIELD = "loss_weight"
"""Per-structure loss weight (system level); the losses multiply it into each share."""
HEAD_FIELD = "head"
"""Per-structure readout-head index (system level) of multi-head models."""


def _accepts_device(dataset: Any) -> bool:
    """Whether ``dataset.load_batches`` takes the ``device=`` override (ours do)."""
    return isinstance(dataset, (Dataset, InMemoryDataset, MultiDataset))


def load_child_batches(dataset: Any, lists: list[list[int]], device: Any = None) -> list[Batch]:
    """``dataset.load_batches(lists)``, forwarding ``device`` where supported."""
    if device is not None and _accepts_device(dataset):
        return dataset.load_batches(lists, device=device)
    return dataset.load_batches(lists)


def _per_dataset(values: Any, count: int, name: str, kind: type) -> tuple | None:
    """One validated value per child (``None`` stays ``None``)."""
    if values is None:
        return None
    values = tuple(values)
    if len(values) != count:
        raise ValueError(f"MultiDataset: {name} has {len(values)} entries for {count} datasets.")
    out = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"MultiDataset: {name}[{i}] must be a number; got {value!r}.")
        if kind is int and value != int(value):
            raise TypeError(f"MultiDataset: {name}[{i}] must be an integer; got {value!r}.")
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"MultiDataset: {name}[{i}] must be finite and non-negative; got {value!r}."
            )
        out.append(kind(value))
    return tuple(out)


class MultiDataset(torch.utils.data.Dataset):
    """Concatenate datasets into one index space, keeping per-child batch loading.

    Args:
        *datasets: at least one dataset satisfying
            :class:`~nvalchemi.data.datapipes.BatchDatasetProtocol`.
        output_strict: require every non-empty child to produce the same field
            names (checked now, ``ValueError`` naming the children); with False,
            children may differ in labels (missing ones become NaN in mixed
            batches).
        num_workers: accepted for compatibility and ignored.
        loss_weights: one non-negative weight per dataset, attached to every structure
            as ``loss_weight`` (``[1, 1]`` per structure, ``[B, 1]`` per batch, in the
            structure's float dtype). ``None``: no field.
        head_indices: one readout-head index per dataset, attached as ``head``
            (int64). ``None``: no field.

    ``multi[g]`` is the child's ``AtomicData`` (a shallow copy carrying the attached
    fields, if any); :meth:`get_with_metadata` adds ``metadata["dataset_index"]``.
    """

    def __init__(
        self,
        *datasets: Any,
        output_strict: bool = True,
        num_workers: int | None = None,
        loss_weights: Sequence[float] | None = None,
        head_indices: Sequence[int] | None = None,
    ) -> None:
        if len(datasets) == 1 and isinstance(datasets[0], (list, tuple)):
            datasets = tuple(datasets[0])
        if not datasets:
            raise ValueError("MultiDataset needs at least one dataset.")
        for i, dataset in enumerate(datasets):
            if not isinstance(dataset, BatchDatasetProtocol):
                raise TypeError(
                    f"MultiDataset: dataset {i} ({type(dataset).__name__}) does not satisfy "
                    "BatchDatasetProtocol (__len__, __getitem__, load_batches, get_metadata, "
                    "close); wrap a reader in nvalchemi.data.datapipes.Dataset."
                )
        self.datasets = tuple(datasets)
        self.loss_weights = _per_dataset(loss_weights, len(datasets), "loss_weights", float)
        self.head_indices = _per_dataset(head_indices, len(datasets), "head_indices", int)
        self.output_strict = bool(output_strict)
        self.num_workers = num_workers
        self._refresh_offsets()
        self._field_names: list[str] | None = None
        if self.output_strict:
            self.validate_field_names()

    def _refresh_offsets(self) -> None:
        self.lengths = [len(d) for d in self.datasets]
        self.offsets = [0]
        for n in self.lengths[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self._total = sum(self.lengths)

    # ------------------------------------------------------------------ index
    def __len__(self) -> int:
        return self._total

    def to_global_index(self, dataset_index: int, local_index: int) -> int:
        """Global index of ``local_index`` in child ``dataset_index`` (negatives allowed)."""
        k = len(self.datasets)
        if not -k <= dataset_index < k:
            raise IndexError(f"Dataset index {dataset_index} out of range for {k} datasets.")
        dataset_index %= k
        n = self.lengths[dataset_index]
        if not -n <= local_index < n:
            raise IndexError(
                f"Local index {local_index} out of range for dataset {dataset_index} with "
                f"{n} structures."
            )
        return self.offsets[dataset_index] + local_index % n

    def to_local_index(self, index: int) -> tuple[int, int]:
        """``(dataset_index, local_index)`` of a global index (negatives allowed)."""
        index = check_index(index, self._total, self)
        # bisect_right skips empty children, which share the next child's offset
        child = bisect.bisect_right(self.offsets, index) - 1
        return child, index - self.offsets[child]

    # ----------------------------------------------------------------- fields
    @property
    def field_names(self) -> list[str]:
        """Field names of the first non-empty child (all agree when strict)."""
        if self._field_names is None:
            for dataset in self.datasets:
                if len(dataset):
                    self._field_names = list(getattr(dataset, "field_names", []))
                    break
            else:
                self._field_names = list(getattr(self.datasets[0], "field_names", []))
        return list(self._field_names)

    def validate_field_names(self, output_strict: bool | None = None) -> list[str]:
        """Check that non-empty children agree on field names (when strict); return them."""
        strict = self.output_strict if output_strict is None else output_strict
        self._field_names = None
        names = self.field_names
        if strict:
            reference = None
            for i, dataset in enumerate(self.datasets):
                if not len(dataset):
                    continue
                these = set(getattr(dataset, "field_names", []))
                if reference is None:
                    reference = (i, these)
                elif these != reference[1]:
                    only_first = sorted(reference[1] - these)
                    only_this = sorted(these - reference[1])
                    raise ValueError(
                        f"MultiDataset(output_strict=True): dataset {i} has different fields "
                        f"than dataset {reference[0]} (only in {reference[0]}: {only_first}; "
                        f"only in {i}: {only_this}). Make them agree or pass "
                        "output_strict=False (missing labels become NaN)."
                    )
        return names

    @property
    def target_device(self) -> torch.device | None:
        """The children's common device, or ``None`` when they differ or keep the reader's."""
        devices = {getattr(d, "target_device", None) for d in self.datasets}
        return devices.pop() if len(devices) == 1 else None

    # ---------------------------------------------------------------- samples
    def __getitem__(self, index: int) -> AtomicData:
        child, local = self.to_local_index(index)
        return self._with_constants(self.datasets[child][local], child)

    def get_with_metadata(self, index: int) -> tuple[AtomicData, dict[str, Any]]:
        """The child's ``(AtomicData, metadata)`` with ``metadata["dataset_index"]`` set."""
        child, local = self.to_local_index(index)
        dataset = self.datasets[child]
        getter = getattr(dataset, "get_with_metadata", None)
        if callable(getter):
            data, metadata = getter(local)
            metadata = dict(metadata)
        else:
            data, metadata = dataset[local], {}
        metadata[DATASET_INDEX_METADATA_KEY] = child
        return self._with_constants(data, child), metadata

    def __iter__(self) -> Iterator[AtomicData]:
        for child, dataset in enumerate(self.datasets):
            yield from (self._with_constants(dataset[i], child) for i in range(len(dataset)))

    # -------------------------------------------------------------- constants
    def _constants(self) -> list[tuple[str, tuple, torch.dtype | None, tuple[int, ...]]]:
        """``(field, per-dataset values, dtype, trailing shape)``; ``None`` dtype: the
        structure's float dtype."""
        out = []
        if self.loss_weights is not None:
            out.append((LOSS_WEIGHT_FIELD, self.loss_weights, None, (1,)))
        if self.head_indices is not None:
            out.append((HEAD_FIELD, self.head_indices, torch.int64, ()))
        return out

    def _with_constants(self, data: AtomicData, child: int) -> AtomicData:
        constants = self._constants()
        if not constants:
            return data
        data = copy.copy(data)  # never change the child's own (possibly cached) structure
        for name, values, dtype, trailing in constants:
            value = torch.tensor([values[child]], dtype=dtype or data["positions"].dtype)
            data.add_system_property(name, value.reshape(1, *trailing))
        return data

    def _attach_constants(self, batch: Batch, children: Sequence[int]) -> Batch:
        for name, values, dtype, trailing in self._constants():
            value = torch.tensor(
                [values[c] for c in children],
                dtype=dtype or batch["positions"].dtype,
                device=batch.device,
            )
            batch.add_key(name, value.reshape(-1, *trailing), level="system", overwrite=True)
        return batch

    def get_metadata(self, index: int) -> tuple[int, int]:
        child, local = self.to_local_index(index)
        return self.datasets[child].get_metadata(local)

    # ---------------------------------------------------------------- batches
    def load_batches(
        self, batch_index_lists: Sequence[Sequence[int]], *, device: Any = None
    ) -> list[Batch]:
        """One ``Batch`` per index list; each child is asked once for its share.

        Raises:
            ValueError: an empty batch.
            RuntimeError: a child returned the wrong number of batches or structures.
        """
        lists = [flat_indices([b], self._total, self) for b in batch_index_lists]
        if any(len(b) == 0 for b in lists):
            raise ValueError("load_batches got an empty batch; every batch needs an index.")
        device = resolve_device(device) if device is not None else None
        located = [[self.to_local_index(i) for i in b] for b in lists]
        children = {c for b in located for c, _ in b}
        if len(children) == 1:
            child = children.pop()
            local_lists = [[local for _, local in b] for b in located]
            batches = self._checked(child, local_lists, device)
            return [self._attach_constants(b, [child] * b.num_graphs) for b in batches]
        # per child: the local indices of its share of each batch, in request order
        shares: dict[int, list[list[int]]] = {c: [[] for _ in lists] for c in children}
        for k, batch in enumerate(located):
            for c, local in batch:
                shares[c][k].append(local)
        parts: dict[int, list[Batch | None]] = {}
        for c, per_batch in shares.items():
            wanted = [b for b in per_batch if b]
            loaded = iter(self._checked(c, wanted, device))
            parts[c] = [next(loaded) if b else None for b in per_batch]
        out = []
        for k, batch in enumerate(located):
            present = [c for c in sorted(children) if parts[c][k] is not None]
            if len(present) == 1:
                out.append(self._attach_constants(parts[present[0]][k], [c for c, _ in batch]))
                continue
            merged = Batch.cat([parts[c][k] for c in present])
            # position of each requested structure inside ``merged``
            base = {}
            start = 0
            for c in present:
                base[c] = start
                start += len(shares[c][k])
            cursor = dict(base)
            order = []
            for c, _ in batch:
                order.append(cursor[c])
                cursor[c] += 1
            merged = merged.index_select(torch.tensor(order, dtype=torch.int64))
            out.append(self._attach_constants(merged, [c for c, _ in batch]))
        return out

    def _checked(self, child: int, lists: list[list[int]], device: Any) -> list[Batch]:
        batches = load_child_batches(self.datasets[child], lists, device)
        if len(batches) != len(lists):
            raise RuntimeError(
                f"MultiDataset: dataset {child} returned {len(batches)} batches for "
                f"{len(lists)} requested."
            )
        for b, want in zip(batches, lists):
            if b.num_graphs != len(want):
                raise RuntimeError(
                    f"MultiDataset: dataset {child} returned a batch of {b.num_graphs} "
                    f"structures for {len(want)} indices."
                )
        return batches

    def get_batch(self, indices: Sequence[int]) -> Batch:
        return self.load_batches([indices])[0]

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close every child."""
        for dataset in self.datasets:
            dataset.close()

    def __enter__(self) -> MultiDataset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        inner = "\n".join(
            f"  [{i}] offset={o} len={n}: {d!r}"
            for i, (d, o, n) in enumerate(zip(self.datasets, self.offsets, self.lengths))
        )
        return f"MultiDataset(len={len(self)}, output_strict={self.output_strict},\n{inner}\n)"
