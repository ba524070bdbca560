"""``Batch``: many atomic systems concatenated into one graph.

Atom-level fields are concatenated along the atom axis, edge-level fields along the
edge axis (``neighbor_list`` holds *global* atom indices), and system-level fields
get one row per system (``energy [B, 1]``, ``cell [B, 3, 3]``, ``pbc [B, 3]``).
Index tensors (``batch_idx``, ``ptr``, counts) are int64 and live on the batch's
device.

Structures may differ in which labels they carry: collating a crystal with stress
and a molecule without it fills the molecule's stress with NaN and records, in
:attr:`Batch.missing_labels`, that the molecule has no stress; losses leave it out
by that mask (a NaN label that was *not* missing is a real non-finite value and
propagates). A molecule batched with crystals gets a zero ``cell`` and ``pbc``
False; a structure without a ``loss_weight`` gets weight 1. A non-label field
missing from some structures is an error that names the field and the structures.

Example:
    >>> import torch
    >>> from nvalchemi.data import AtomicData, Batch
    >>> a = AtomicData(atomic_numbers=torch.tensor([1, 1]), positions=torch.zeros(2, 3),
    ...                energy=torch.tensor(-1.0))
    >>> b = AtomicData(atomic_numbers=torch.tensor([8]), positions=torch.zeros(1, 3),
    ...                energy=torch.tensor(-2.0))
    >>> batch = Batch.from_data_list([a, b])
    >>> batch.num_graphs, batch.batch_idx.tolist(), batch.energy.shape
    (2, [0, 0, 1], torch.Size([2, 1]))
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from nvalchemi.data._collate import (
    collate,
    exclusive_cumsum,
    normalize_level,
    offsets,
    owners,
    ranges,
    repeat,
    select_systems,
)
from nvalchemi.data._neighbor_stamps import clear_stamps, common_stamps, copy_stamps
from nvalchemi.data.atomic_data import AtomicData, tensors_equal
from nvalchemi.data.fields import FIELDS, RESERVED_NAMES, Level, atomic_masses_of

__all__ = ["Batch", "iter_batches"]

_SPEC_LEVEL_NAMES = {"atom": "node", "edge": "edge", "system": "system"}


class Batch:
    """A batch of atomic systems; build it with :meth:`from_data_list`.

    See the module docstring for the layout. Attribute access returns stored
    tensors (``batch.positions``, ``batch.energy``); assignment of a tensor stores
    a field at the level of its name (known fields), of an existing field with that
    name, or of the only count its leading dimension matches; use :meth:`add_key`
    with an explicit ``level`` when the shape is ambiguous.
    """

    def __init__(self, *, device: torch.device | str | None = None) -> None:
        self._init(
            {},
            {},
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, dtype=torch.int64),
            torch.device(device or "cpu"),
        )

    def _init(
        self,
        data: dict[str, torch.Tensor],
        levels: dict[str, Level],
        node_counts: torch.Tensor,
        edge_counts: torch.Tensor,
        device: torch.device,
        index: dict[str, torch.Tensor] | None = None,
        missing: dict[str, torch.Tensor] | None = None,
    ) -> None:
        object.__setattr__(self, "_data", data)
        object.__setattr__(self, "_missing", missing if missing is not None else {})
        object.__setattr__(self, "_level_of", levels)
        object.__setattr__(self, "_node_counts", node_counts)  # CPU int64 [B]
        object.__setattr__(self, "_edge_counts", edge_counts)  # CPU int64 [B]
        object.__setattr__(self, "_index", index if index is not None else {})
        object.__setattr__(self, "device", device)

    @classmethod
    def _construct(cls, *args: Any, **kwargs: Any) -> Batch:
        batch = cls.__new__(cls)
        batch._init(*args, **kwargs)
        return batch

    # ---------------------------------------------------------------- collation
    @classmethod
    def from_data_list(
        cls,
        data_list: Sequence[AtomicData],
        device: torch.device | str | None = None,
        exclude_keys: Sequence[str] | None = None,
        field_levels: Mapping[str, str] | None = None,
        **_: Any,
    ) -> Batch:
        """Collate structures into one batch.

        Args:
            data_list: the structures (``AtomicData``).
            device: target device (default: the first structure's device).
            exclude_keys: fields to leave out.
            field_levels: levels of custom fields the structures do not declare.

        Raises:
            ValueError: empty list, mixed dtypes of one field, or a non-label field
                present in some structures only (the message names the field and
                the structures).
        """
        if len(data_list) == 0:
            raise ValueError("Cannot create batch from empty data list.")
        for i, d in enumerate(data_list):
            if not isinstance(d, AtomicData):
                raise TypeError(
                    f"Batch.from_data_list expects AtomicData items; item {i} is "
                    f"{type(d).__name__}."
                )
        node_counts = torch.tensor([d.num_nodes for d in data_list], dtype=torch.int64)
        edge_counts = torch.tensor([d.num_edges for d in data_list], dtype=torch.int64)
        parts = [(d._data, d._levels) for d in data_list]
        ones = torch.ones(len(data_list), dtype=torch.int64)
        data, levels, missing = collate(
            parts, node_counts, edge_counts, ones, set(exclude_keys or ()), field_levels
        )
        target = torch.device(device) if device is not None else data_list[0].device
        batch = cls._from_collated(data, levels, node_counts, edge_counts, target, missing)
        return common_stamps(data_list, batch) if "neighbor_list" in data else batch

    @classmethod
    def _from_collated(
        cls,
        data: dict[str, torch.Tensor],
        levels: dict[str, Level],
        node_counts: torch.Tensor,
        edge_counts: torch.Tensor,
        device: torch.device,
        missing: dict[str, torch.Tensor] | None = None,
    ) -> Batch:
        index = {
            "batch_idx": owners(node_counts),
            "ptr": offsets(node_counts),
            "num_nodes_per_graph": node_counts,
            "num_edges_per_graph": edge_counts,
        }
        missing = missing or {}
        if any(t.device != device for t in data.values()) or device.type != "cpu":
            data = {k: v.to(device, non_blocking=True) for k, v in data.items()}
            index = {k: v.to(device, non_blocking=True) for k, v in index.items()}
            missing = {k: v.to(device, non_blocking=True) for k, v in missing.items()}
        return cls._construct(data, levels, node_counts, edge_counts, device, index, missing)

    @classmethod
    def cat(cls, batches: Sequence[Batch]) -> Batch:
        """Concatenate batches (same rules as :meth:`from_data_list`)."""
        if len(batches) == 0:
            raise ValueError("Batch.cat needs at least one batch.")
        device = batches[0].device
        parts = [({k: v.to(device) for k, v in b._data.items()}, b._level_of) for b in batches]
        node_counts = torch.cat([b._node_counts for b in batches])
        edge_counts = torch.cat([b._edge_counts for b in batches])
        graphs = torch.tensor([b.num_graphs for b in batches], dtype=torch.int64)
        part_nodes = torch.tensor([b.num_nodes for b in batches], dtype=torch.int64)
        part_edges = torch.tensor([b.num_edges for b in batches], dtype=torch.int64)
        data, levels, missing = collate(
            parts, part_nodes, part_edges, graphs, set(), None, [b._missing for b in batches]
        )
        batch = cls._from_collated(data, levels, node_counts, edge_counts, device, missing)
        return common_stamps(batches, batch) if "neighbor_list" in data else batch

    # ------------------------------------------------------------ counts/index
    @property
    def num_graphs(self) -> int:
        return self._node_counts.shape[0]

    batch_size = num_graphs

    def __len__(self) -> int:
        return self.num_graphs

    @property
    def num_nodes(self) -> int:
        positions = self._data.get("positions")
        return int(positions.shape[0]) if positions is not None else int(self._node_counts.sum())

    @property
    def num_edges(self) -> int:
        nl = self._data.get("neighbor_list")
        return int(nl.shape[0]) if nl is not None else int(self._edge_counts.sum())

    def _cached(self, name: str, build) -> torch.Tensor:
        value = self._index.get(name)
        if value is None:
            value = build().to(self.device)
            self._index[name] = value
        return value

    @property
    def num_nodes_per_graph(self) -> torch.Tensor:
        """Atoms per system, int64 ``[B]`` on the batch device."""
        return self._cached("num_nodes_per_graph", lambda: self._node_counts)

    @property
    def num_edges_per_graph(self) -> torch.Tensor:
        """Edges per system, int64 ``[B]`` on the batch device."""
        return self._cached("num_edges_per_graph", lambda: self._edge_counts)

    @property
    def num_nodes_list(self) -> list[int]:
        return self._node_counts.tolist()

    @property
    def num_edges_list(self) -> list[int]:
        return self._edge_counts.tolist() if self.num_edges else []

    @property
    def max_num_nodes(self) -> int:
        return int(self._node_counts.max()) if self.num_graphs else 0

    @property
    def batch_idx(self) -> torch.Tensor:
        """System index of every atom, int64 ``[V]``."""
        return self._cached("batch_idx", lambda: owners(self._node_counts))

    @property
    def ptr(self) -> torch.Tensor:
        """Atom offsets ``[0, n_0, n_0 + n_1, ...]``, int64 ``[B + 1]``."""
        return self._cached("ptr", lambda: offsets(self._node_counts))

    batch_ptr = ptr

    @property
    def edge_batch_idx(self) -> torch.Tensor:
        """System index of every edge, int64 ``[E]``."""
        return self._cached("edge_batch_idx", lambda: owners(self._edge_counts))

    @property
    def missing_labels(self) -> dict[str, torch.Tensor]:
        """Labels some structures lack: ``{label: (B,) bool mask, True where it is missing}``.

        Known at collation, on the batch device; empty when every structure has every
        label it carries (the common case, which losses then handle with no masking work).
        The stored values of a missing label are NaN. Assigning a label field keeps its
        mask (``batch.energy = batch.energy * 2`` leaves missing rows missing); deleting
        the field drops it.

        Example:
            >>> import torch
            >>> from nvalchemi.data import AtomicData, Batch
            >>> a = AtomicData(atomic_numbers=torch.tensor([1]), positions=torch.zeros(1, 3),
            ...                energy=torch.tensor(-1.0))
            >>> b = AtomicData(atomic_numbers=torch.tensor([1]), positions=torch.zeros(1, 3))
            >>> Batch.from_data_list([a, b]).missing_labels
            {'energy': tensor([False,  True])}
        """
        return dict(self._missing)

    @property
    def dtype(self) -> torch.dtype:
        return self._data["positions"].dtype

    @property
    def atomic_masses(self) -> torch.Tensor:
        """Masses in amu: the stored field, else looked up from ``atomic_numbers``."""
        return atomic_masses_of(self._data)

    @property
    def keys(self) -> dict[str, set[str]]:
        """Field names per level: ``{"node": ..., "edge": ..., "system": ...}``."""
        out: dict[str, set[str]] = {"node": set(), "edge": set(), "system": set()}
        for key, level in self._level_of.items():
            out[_SPEC_LEVEL_NAMES[level]].add(key)
        return out

    def level_of(self, key: str) -> Level:
        """Level (``"atom"``, ``"edge"``, ``"system"``) of a stored field."""
        try:
            return self._level_of[key]
        except KeyError:
            raise KeyError(f"Batch has no field {key!r}.") from None

    def _count(self, level: Level) -> int:
        if level == "atom":
            return self.num_nodes
        if level == "edge":
            return self.num_edges
        return self.num_graphs

    # ----------------------------------------------------------- field access
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._data[name]
        except KeyError:
            raise AttributeError(f"'Batch' has no attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or not isinstance(value, torch.Tensor):
            object.__setattr__(self, name, value)
        else:
            self._set_field(name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._data:
            del self._data[name]
            del self._level_of[name]
            self._missing.pop(name, None)
        else:
            object.__delattr__(self, name)

    __delitem__ = __delattr__

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(list(self._data.items()))

    def _set_field(self, name: str, value: torch.Tensor, level: Level | None = None) -> None:
        if name in RESERVED_NAMES:
            raise ValueError(f"{name!r} is derived by Batch and cannot be assigned.")
        if level is None:
            level = self._level_of.get(name)
        if level is None and name in FIELDS:
            level = FIELDS[name].level
        if level is None:
            lead = value.shape[0] if value.dim() else None
            matches = [lvl for lvl in ("atom", "edge", "system") if self._count(lvl) == lead]
            if len(matches) != 1:
                raise ValueError(
                    f"Cannot tell the level of {name!r} (leading dimension {lead}; "
                    f"atoms={self.num_nodes}, edges={self.num_edges}, systems={self.num_graphs}). "
                    f"Use batch.add_key({name!r}, values, level='atom'|'edge'|'system')."
                )
            level = matches[0]
        expected = self._count(level)
        if value.dim() == 0 or value.shape[0] != expected:
            raise ValueError(
                f"Batch field {name!r} is {level}-level and needs a leading dimension of "
                f"{expected}; got shape {list(value.shape)}."
            )
        self._data[name] = value.to(self.device) if value.device != self.device else value
        self._level_of[name] = level

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            try:
                return self._data[key]
            except KeyError:
                raise KeyError(f"Batch has no field {key!r}.") from None
        if isinstance(key, (int, np.integer)):
            return self.get_data(int(key))
        return self.index_select(key)

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self._set_field(key, torch.as_tensor(value))

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)

    def add_key(
        self,
        key: str,
        values: torch.Tensor | Sequence[torch.Tensor],
        level: str = "node",
        overwrite: bool = False,
    ) -> None:
        """Store a field at an explicit level.

        ``values`` is either one tensor with the level's leading dimension or one
        tensor per system (concatenated; per-system values of shape ``[1, ...]``
        are stacked into ``[B, ...]``).
        """
        lvl = normalize_level(level)
        if key in self._data and not overwrite:
            raise ValueError(f"Batch already has {key!r}; pass overwrite=True to replace it.")
        if not isinstance(values, torch.Tensor):
            values = list(values)
            if len(values) != self.num_graphs:
                raise ValueError(
                    f"add_key({key!r}) got {len(values)} values for {self.num_graphs} systems."
                )
            tensors = [torch.as_tensor(v) for v in values]
            if lvl == "system":
                tensors = [t if t.dim() and t.shape[0] == 1 else t.unsqueeze(0) for t in tensors]
            values = torch.cat(tensors)
        self._set_field(key, values, lvl)

    def set_edges(
        self,
        neighbor_list: torch.Tensor,
        neighbor_list_shifts: torch.Tensor | None,
        num_edges_per_graph: torch.Tensor,
        **edge_fields: torch.Tensor,
    ) -> None:
        """Replace the whole edge level (e.g. with freshly computed neighbour lists).

        ``neighbor_list`` is ``[E, 2]`` with global atom indices, ordered by system.
        """
        for key in [k for k, lvl in self._level_of.items() if lvl == "edge"]:
            del self._data[key], self._level_of[key]
        for key in ("edge_batch_idx", "num_edges_per_graph"):
            self._index.pop(key, None)
        clear_stamps(self)
        counts = num_edges_per_graph.to(device="cpu", dtype=torch.int64)
        object.__setattr__(self, "_edge_counts", counts)
        fields = {"neighbor_list": neighbor_list, "neighbor_list_shifts": neighbor_list_shifts}
        fields.update(edge_fields)
        for key, value in fields.items():
            if value is not None:
                self._set_field(key, value, "edge")
        if num_edges_per_graph.device == self.device:
            self._index["num_edges_per_graph"] = num_edges_per_graph.to(torch.int64)

    # ---------------------------------------------------------- split / select
    def get_data(self, idx: int) -> AtomicData:
        """The ``idx``-th system as an ``AtomicData`` (labels missing there are omitted)."""
        n = self.num_graphs
        if not -n <= idx < n:
            raise IndexError(f"Batch index {idx} out of range for {n} systems.")
        idx %= n
        ptr = self._node_counts.cumsum(0)
        n0 = int(ptr[idx] - self._node_counts[idx])
        n1 = int(ptr[idx])
        eptr = self._edge_counts.cumsum(0)
        e0 = int(eptr[idx] - self._edge_counts[idx])
        e1 = int(eptr[idx])
        fields: dict[str, torch.Tensor] = {}
        for key, value in self._data.items():
            level = self._level_of[key]
            if level == "atom":
                part = value[n0:n1]
            elif level == "edge":
                part = value[e0:e1]
                if key == "neighbor_list":
                    part = part - n0
            else:
                part = value[idx : idx + 1]
            mask = self._missing.get(key)
            if mask is not None and bool(mask[idx]):
                continue  # filled in for a structure that lacks this label
            fields[key] = part
        if "pbc" in fields and not bool(fields["pbc"].any()) and not bool(fields["cell"].any()):
            del fields["pbc"], fields["cell"]
        levels = {k: self._level_of[k] for k in fields}
        return AtomicData(**fields, field_levels=levels, validate=False)

    def to_data_list(self) -> list[AtomicData]:
        """Split back into structures."""
        return [self.get_data(i) for i in range(self.num_graphs)]

    def index_select(self, idx: Any) -> Batch:
        """A new batch with the selected systems, in the given order."""
        graphs = select_systems(idx, self.num_graphs)
        node_counts = self._node_counts[graphs]
        edge_counts = self._edge_counts[graphs]
        old_node_start = exclusive_cumsum(self._node_counts)[graphs]
        node_rows = ranges(old_node_start, node_counts).to(self.device)
        edge_rows = ranges(exclusive_cumsum(self._edge_counts)[graphs], edge_counts).to(self.device)
        shift = repeat(exclusive_cumsum(node_counts) - old_node_start, edge_counts).to(self.device)
        graph_rows = graphs.to(self.device)
        data = {}
        for key, value in self._data.items():
            level = self._level_of[key]
            if level == "atom":
                data[key] = value.index_select(0, node_rows)
            elif level == "edge":
                data[key] = value.index_select(0, edge_rows)
                if key == "neighbor_list":
                    data[key] = data[key] + shift.unsqueeze(1)
            else:
                data[key] = value.index_select(0, graph_rows)
        missing = {k: v.index_select(0, graph_rows) for k, v in self._missing.items()}
        missing = {k: v for k, v in missing.items() if k in data}
        selected = Batch._from_collated(
            data, dict(self._level_of), node_counts, edge_counts, self.device, missing
        )
        return copy_stamps(self, selected)

    def append(self, other: Batch) -> None:
        """Append ``other``'s systems in place (``other`` is not modified)."""
        if other is self:
            raise ValueError("Cannot append a batch to itself.")
        merged = Batch.cat([self, other])
        self._init(
            merged._data,
            merged._level_of,
            merged._node_counts,
            merged._edge_counts,
            merged.device,
            merged._index,
            merged._missing,
        )
        clear_stamps(self)
        copy_stamps(merged, self)

    def append_data(self, data_list: Sequence[AtomicData]) -> None:
        """Append structures in place."""
        if len(data_list) == 0:
            raise ValueError("append_data needs at least one structure.")
        self.append(Batch.from_data_list(data_list, device=self.device))

    # -------------------------------------------------------- device and copy
    def _map(self, fn) -> Batch:
        data = {k: fn(v) for k, v in self._data.items()}
        index = {k: fn(v) for k, v in self._index.items()}
        missing = {k: fn(v) for k, v in self._missing.items()}
        device = next(iter(data.values())).device if data else self.device
        out = Batch._construct(
            data, dict(self._level_of), self._node_counts, self._edge_counts, device, index, missing
        )
        return copy_stamps(self, out)

    def to(
        self,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> Batch:
        """A batch on ``device``; floating fields are cast to ``dtype`` when given.

        Tensors already on ``device`` (with the right dtype) are shared, not copied.
        """
        target = torch.device(device) if device is not None else self.device
        if target == self.device and dtype is None:
            return self._map(lambda t: t)

        def move(t: torch.Tensor) -> torch.Tensor:
            cast = dtype if dtype is not None and t.dtype.is_floating_point else None
            return t.to(device=target, dtype=cast, non_blocking=non_blocking)

        out = self._map(move)
        object.__setattr__(out, "device", target)
        return out

    def cpu(self) -> Batch:
        return self.to("cpu")

    def cuda(self, device: int | str | None = None, non_blocking: bool = False) -> Batch:
        return self.to(
            torch.device("cuda" if device is None else device), non_blocking=non_blocking
        )

    def clone(self) -> Batch:
        """A deep copy."""
        out = self._map(torch.clone)
        object.__setattr__(out, "_node_counts", self._node_counts.clone())
        object.__setattr__(out, "_edge_counts", self._edge_counts.clone())
        return out

    def contiguous(self) -> Batch:
        for key, value in self._data.items():
            self._data[key] = value.contiguous()
        return self

    def pin_memory(self) -> Batch:
        """Pin every tensor (in place) for faster, asynchronous host-to-device copies."""
        if not torch.cuda.is_available():
            return self
        for store in (self._data, self._index, self._missing):
            for key, value in store.items():
                store[key] = value.pin_memory()
        return self

    def to_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._data)

    def model_dump(self, **_: Any) -> dict[str, Any]:
        """Fields plus batch metadata as a flat dict."""
        return {
            "device": self.device,
            "keys": self.keys,
            "batch_idx": self.batch_idx,
            "batch_ptr": self.ptr,
            "num_graphs": self.num_graphs,
            "num_nodes_list": self.num_nodes_list,
            "num_edges_list": self.num_edges_list,
            **self._data,
        }

    def __eq__(self, other: object) -> bool:
        """Same fields at the same levels, same per-system atom and edge counts, the same
        missing labels, and equal values (any device; NaN-filled missing labels compare
        equal). Syncs: meant for tests and checks, not for the training loop."""
        if not isinstance(other, Batch):
            return NotImplemented
        if self._level_of != other._level_of or set(self._missing) != set(other._missing):
            return False
        if not all(tensors_equal(v, other._missing[k]) for k, v in self._missing.items()):
            return False
        if not (
            torch.equal(self._node_counts, other._node_counts)
            and torch.equal(self._edge_counts, other._edge_counts)
        ):
            return False
        return all(tensors_equal(value, other._data[key]) for key, value in self._data.items())

    __hash__ = None  # mutable container; identity checks use ``is``

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_missing", {})  # batches pickled before missing-label masks
        for key, value in state.items():
            object.__setattr__(self, key, value)

    def __repr__(self) -> str:
        return (
            f"Batch(num_graphs={self.num_graphs}, num_nodes={self.num_nodes}, "
            f"num_edges={self.num_edges}, device={self.device})"
        )


def iter_batches(
    structures: Any, batch_size: int, *, dtype: torch.dtype | None = None
) -> Iterator[Batch]:
    """Batches of ``batch_size`` structures from a list, a map-style dataset or any iterable.

    Items may be ``AtomicData``, ASE ``Atoms`` (converted with ``dtype``, default float32)
    or whole ``Batch`` objects (passed through as they are).

    >>> from nvalchemi.data import AtomicData
    >>> import torch
    >>> data = [AtomicData(atomic_numbers=torch.tensor([1]), positions=torch.zeros(1, 3))] * 5
    >>> [b.num_graphs for b in iter_batches(data, 2)]
    [2, 2, 1]
    """
    from nvalchemi.data.atomic_data import AtomicData

    items = structures
    if hasattr(structures, "__len__") and hasattr(structures, "__getitem__"):
        items = (structures[i] for i in range(len(structures)))  # map-style datasets: by index
    pending: list[AtomicData] = []
    for item in items:
        if isinstance(item, Batch):
            yield item
            continue
        if not isinstance(item, AtomicData):
            item = AtomicData.from_atoms(item, dtype=dtype or torch.float32)
        pending.append(item)
        if len(pending) == batch_size:
            yield Batch.from_data_list(pending)
            pending = []
    if pending:
        yield Batch.from_data_list(pending)
