"""``AtomicData``: one atomic system (atoms, optional cell, labels, neighbour list).

Conventions (see :mod:`nvalchemi.data.fields` for the full table):

* positions ``[n_atoms, 3]`` in Å; ``cell`` ``[1, 3, 3]`` with lattice vectors as
  **rows** (ASE convention); ``pbc`` ``[1, 3]`` bool.
* labels: ``energy`` ``[1, 1]`` (eV), ``forces`` ``[n_atoms, 3]`` (eV/Å),
  ``stress`` ``[1, 3, 3]`` (eV/Å³, positive = tensile, ASE's sign).
* ``neighbor_list`` ``[n_edges, 2]`` int64 ``[sender, receiver]`` with local atom
  indices and ``neighbor_list_shifts`` ``[n_edges, 3]`` int64 lattice images; the
  displacement of edge ``e = (i, j)`` is
  ``positions[j] - positions[i] + neighbor_list_shifts[e] @ cell``.
* index fields (``atomic_numbers``, ``neighbor_list``) are stored as int64; every
  other tensor keeps the dtype it was given (float64 labels stay float64).
* floating-point fields (positions, cell, labels) must be given as floating point:
  integer or boolean values raise ``TypeError`` naming the field and the dtype
  (convert them first if they are right); atomic numbers must be 1..118.
* per-system fields are stored as ``[1, ...]``; the only other shapes accepted, and
  converted, are the value without the leading 1 (``dipole [3]``, ``cell [3, 3]``),
  a scalar or ``[1]`` for one-number fields (``energy``, ``charge``), and for
  ``stress``/``virial`` Voigt ``[6]`` (xx, yy, zz, yz, xz, xy) or row-major ``[9]``
  (also ``[1, 6]``/``[1, 9]``). Any other shape raises ``ValueError`` with the
  expected one (see :func:`accepted_shapes`).

Example:
    >>> import torch
    >>> from nvalchemi.data import AtomicData
    >>> data = AtomicData(
    ...     atomic_numbers=torch.tensor([29, 29]),
    ...     positions=torch.tensor([[0.0, 0.0, 0.0], [1.8, 1.8, 0.0]]),
    ...     energy=torch.tensor(-0.5, dtype=torch.float64),
    ... )
    >>> data.num_nodes, data.energy.shape, data.energy.dtype
    (2, torch.Size([1, 1]), torch.float64)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from nvalchemi.data._ase_convert import atoms_from_data, fields_from_atoms
from nvalchemi.data.fields import FIELDS, LEVELS, RESERVED_NAMES, FieldSpec, Level, atomic_masses_of

__all__ = [
    "MAX_ATOMIC_NUMBER",
    "AtomicData",
    "AtomicNumberTable",
    "accepted_shapes",
    "atomic_numbers_to_indices",
    "to_one_hot",
    "voigt_to_matrix",
]


def voigt_to_matrix(values: torch.Tensor) -> torch.Tensor:
    """Convert a stress-like tensor to a ``[3, 3]`` matrix.

    Accepts ``[3, 3]`` (returned as is), ``[9]`` (row-major) or Voigt ``[6]`` in the
    order ``xx, yy, zz, yz, xz, xy`` (ASE's order). Differentiable.
    """
    values = torch.as_tensor(values)
    if values.shape == (3, 3):
        return values
    if values.shape == (9,):
        return values.reshape(3, 3)
    if values.shape == (6,):
        xx, yy, zz, yz, xz, xy = values.unbind()
        return torch.stack(
            [torch.stack([xx, xy, xz]), torch.stack([xy, yy, yz]), torch.stack([xz, yz, zz])]
        )
    raise ValueError(
        f"Cannot interpret a stress/virial of shape {tuple(values.shape)}; expected [3, 3], "
        "[9] (row-major) or Voigt [6] (xx, yy, zz, yz, xz, xy)."
    )


class AtomicNumberTable:
    """An ordered set of atomic numbers with index lookups (for one-hot species).

    >>> table = AtomicNumberTable([1, 6, 8])
    >>> table.z_to_index(6), table.index_to_z(2), len(table)
    (1, 8, 3)
    """

    def __init__(self, zs) -> None:
        self.zs = [int(z) for z in zs]

    def __len__(self) -> int:
        return len(self.zs)

    def __str__(self) -> str:
        return f"AtomicNumberTable: {tuple(self.zs)}"

    def index_to_z(self, index: int) -> int:
        return self.zs[index]

    def z_to_index(self, z: int) -> int:
        try:
            return self.zs.index(int(z))
        except ValueError:
            raise ValueError(f"Atomic number {z} is not in {self}.") from None


def atomic_numbers_to_indices(atomic_numbers: np.ndarray, z_table: AtomicNumberTable) -> np.ndarray:
    """Map atomic numbers to their positions in ``z_table``."""
    lookup = {z: i for i, z in enumerate(z_table.zs)}
    try:
        return np.array([lookup[int(z)] for z in np.asarray(atomic_numbers).ravel()])
    except KeyError as exc:
        raise ValueError(f"Atomic number {exc.args[0]} is not in {z_table}.") from None


def to_one_hot(indices: torch.Tensor, num_classes: int) -> torch.Tensor:
    """One-hot encode ``indices`` of shape ``[..., 1]`` into ``[..., num_classes]`` (float32)."""
    out = torch.zeros(*indices.shape[:-1], num_classes, device=indices.device)
    return out.scatter_(-1, indices.long(), 1.0)


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and values on any device, NaN equal to NaN (missing labels).

    Compares on the CPU (it syncs): for tests and checks, not for hot loops.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"AtomicData field {name!r} must be a tensor or array-like; got {type(value).__name__}."
        ) from exc


MAX_ATOMIC_NUMBER = 118
"""The largest atomic number ``AtomicData`` accepts (oganesson); the smallest is 1."""

_SYMMETRIC_TENSORS = ("stress", "virial")


def _system_shape(spec: FieldSpec, value: torch.Tensor) -> torch.Tensor:
    """``value`` in the canonical ``[1, *spec.shape]`` shape of a per-system field.

    The only non-canonical shapes accepted (see :func:`accepted_shapes`): the value of
    one system without the leading 1 (``[3]`` for a dipole, ``[3, 3]`` for a cell), a
    scalar or ``[1]`` for one-number fields (``energy``, ``charge``), and, for ``stress``
    and ``virial``, Voigt ``[6]`` (xx, yy, zz, yz, xz, xy) or row-major ``[9]`` (also with
    a leading 1). Anything else raises ``ValueError`` naming the expected shape.
    """
    shape = tuple(value.shape)
    if shape[:1] == (1,) and spec.check_trailing_shape(shape[1:]):
        return value
    if spec.check_trailing_shape(shape):
        return value.unsqueeze(0)
    if spec.shape == (1,) and shape == ():
        return value.reshape(1, 1)
    if spec.name in _SYMMETRIC_TENSORS and shape in ((6,), (9,), (1, 6), (1, 9)):
        return voigt_to_matrix(value.reshape(-1)).unsqueeze(0)
    raise ValueError(
        f"AtomicData field {spec.name!r} has shape {list(shape)}; expected "
        f"{spec.shape_text().replace('n_systems', '1')} (accepted: "
        f"{', '.join(accepted_shapes(spec))})."
    )


def accepted_shapes(spec: FieldSpec) -> list[str]:
    """The shapes ``AtomicData`` accepts for a per-system field, canonical one first.

    >>> from nvalchemi.data.fields import FIELDS
    >>> accepted_shapes(FIELDS["energy"])
    ['[1, 1]', '[1]', 'a scalar']
    >>> accepted_shapes(FIELDS["stress"])
    ['[1, 3, 3]', '[3, 3]', 'Voigt [6] or [1, 6]', 'row-major [9] or [1, 9]']
    """
    trailing = ["*" if d is None else str(d) for d in spec.shape]
    out = ["[" + ", ".join(["1", *trailing]) + "]", "[" + ", ".join(trailing) + "]"]
    if spec.shape == (1,):
        out.append("a scalar")
    if spec.name in _SYMMETRIC_TENSORS:
        out += ["Voigt [6] or [1, 6]", "row-major [9] or [1, 9]"]
    return out


def _check_atomic_numbers(value: torch.Tensor) -> None:
    if value.numel() == 0:
        return
    bad = (value < 1) | (value > MAX_ATOMIC_NUMBER)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"AtomicData field 'atomic_numbers' holds {int(value[index])} at atom {index}; "
            f"atomic numbers must be 1..{MAX_ATOMIC_NUMBER} (ASE's dummy atom 'X' has 0: "
            "remove such atoms, or map custom species to real elements)."
        )


def _check_finite(name: str, value: torch.Tensor) -> None:
    if value.dtype.is_floating_point and not bool(torch.isfinite(value).all()):
        fix = (
            "drop the structure"
            if name in ("positions", "cell")
            else ("drop the label, or the structure, when it is unknown")
        )
        raise ValueError(
            f"AtomicData field {name!r} contains NaN or inf values; it must be finite ({fix})."
        )


def _coerce_known(spec: FieldSpec, value: torch.Tensor, count: int) -> torch.Tensor:
    """Check dtype and shape of a known field, converting only the documented cases.

    Integer or boolean values of a floating-point field (positions, cell, labels) are
    refused rather than cast: an integer energy or position is almost always a parsing
    mistake (a truncated column, the wrong key) that training would silently learn.
    """
    if spec.kind == "index":
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(
                f"AtomicData field {spec.name!r} must hold integers; got dtype {value.dtype}."
            )
        value = value.to(torch.int64)
    elif spec.kind == "bool":
        value = value.to(torch.bool)
    elif spec.kind == "float" and not value.dtype.is_floating_point:
        unit = f" ({spec.unit})" if spec.unit else ""
        raise TypeError(
            f"AtomicData field {spec.name!r}{unit} must be floating point; got dtype "
            f"{value.dtype}. Integer values here usually mean a parsing mistake; if they are "
            f"right, convert them first, e.g. {spec.name}=values.to(torch.float32) (or "
            "float64, or pass Python floats)."
        )
    elif spec.kind == "int" and not spec.check_dtype(value.dtype):
        raise TypeError(
            f"AtomicData field {spec.name!r} must hold integers; got dtype {value.dtype}."
        )

    if spec.level == "system":
        return _system_shape(spec, value)
    if (
        value.dim() == 0
        or value.shape[0] != count
        or not spec.check_trailing_shape(tuple(value.shape[1:]))
    ):
        raise ValueError(
            f"AtomicData field {spec.name!r} has shape {list(value.shape)}; expected "
            f"{spec.shape_text()} with {spec.level}s={count}."
        )
    if spec.name == "atomic_numbers":
        _check_atomic_numbers(value)
    return value


class AtomicData:
    """One atomic system: atoms, optional periodic cell, labels and neighbour list.

    All arguments are keyword-only. ``atomic_numbers`` and ``positions`` are
    required; every other known field (see :data:`nvalchemi.data.fields.FIELDS`) is
    optional. Unknown tensors are allowed: their level is taken from
    ``field_levels`` or inferred from the leading dimension (atoms, then edges,
    then a leading 1 for per-system values).

    Args:
        atomic_numbers: ``[n_atoms]`` integer tensor (stored as int64).
        positions: ``[n_atoms, 3]`` float tensor; its device is the system's device.
        info: free-form metadata; never batched.
        field_levels: levels of custom fields, e.g. ``{"weight": "system"}``.
        validate: check shapes, dtypes and finiteness (labels, positions, cell).
            Readers that already validated their data may pass ``False``.
        **fields: every other field.

    Raises:
        ValueError: wrong shape, inconsistent counts, or NaN/inf values.
        TypeError: wrong dtype kind (e.g. float atomic numbers).
    """

    __slots__ = ("_data", "_levels", "info")

    def __init__(
        self,
        *,
        atomic_numbers: Any = None,
        positions: Any = None,
        info: Mapping[str, Any] | None = None,
        field_levels: Mapping[str, Level] | None = None,
        validate: bool = True,
        **fields: Any,
    ) -> None:
        if atomic_numbers is None or positions is None:
            missing = [
                n
                for n, v in (("atomic_numbers", atomic_numbers), ("positions", positions))
                if v is None
            ]
            raise ValueError(f"AtomicData requires {' and '.join(missing)}.")
        object.__setattr__(self, "_data", {})
        object.__setattr__(self, "_levels", {})
        object.__setattr__(self, "info", dict(info) if info else {})
        levels = dict(field_levels or {})
        items = {"atomic_numbers": atomic_numbers, "positions": positions}
        items.update((k, v) for k, v in fields.items() if v is not None)
        if not validate:
            self._data.update(items)
            for name, value in items.items():
                spec = FIELDS.get(name)
                self._levels[name] = (
                    spec.level if spec else levels.get(name) or self._infer_level(name, value)
                )
            return
        positions = _as_tensor("positions", positions)
        n_atoms = positions.shape[0] if positions.dim() else -1
        atomic_numbers = _coerce_known(
            FIELDS["atomic_numbers"], _as_tensor("atomic_numbers", atomic_numbers), n_atoms
        )
        self._store("atomic_numbers", atomic_numbers, "atom", positions.device)
        positions = _coerce_known(FIELDS["positions"], positions, n_atoms)
        self._store("positions", positions, "atom", positions.device)
        if "neighbor_list" in items:
            self._set_validated(
                "neighbor_list", items.pop("neighbor_list"), levels.get("neighbor_list")
            )
        for name, value in items.items():
            if name not in ("atomic_numbers", "positions"):
                self._set_validated(name, value, levels.get(name))
        if "pbc" in self._data and "cell" not in self._data:
            raise ValueError("AtomicData has 'pbc' but no 'cell'; give both or neither.")

    # ------------------------------------------------------------------ storage
    def _store(self, name: str, value: torch.Tensor, level: Level, device: torch.device) -> None:
        if value.device != device:
            value = value.to(device)
        self._data[name] = value
        self._levels[name] = level

    def _count(self, level: Level) -> int:
        if level == "atom":
            return self._data["positions"].shape[0]
        if level == "edge":
            nl = self._data.get("neighbor_list")
            return 0 if nl is None else nl.shape[0]
        return 1

    def _infer_level(self, name: str, value: torch.Tensor) -> Level:
        if value.dim() == 0:
            return "system"
        lead = value.shape[0]
        has_edges = "neighbor_list" in self._data
        matches = [
            lvl for lvl in LEVELS if self._count(lvl) == lead and (lvl != "edge" or has_edges)
        ]
        if not matches:
            raise ValueError(
                f"Cannot tell the level of custom field {name!r} with shape {list(value.shape)}: "
                f"its leading dimension matches neither n_atoms={self._count('atom')}, "
                f"n_edges={self._count('edge')} nor 1 (one system). Pass "
                f"field_levels={{{name!r}: 'atom'|'edge'|'system'}}."
            )
        return matches[0]

    def _set_validated(self, name: str, value: Any, level: Level | None = None) -> None:
        if name in RESERVED_NAMES:
            raise ValueError(f"{name!r} is derived by nvalchemi and cannot be stored as a field.")
        device = self._data["positions"].device
        if value is None:
            self._data.pop(name, None)
            self._levels.pop(name, None)
            return
        value = _as_tensor(name, value)
        spec = FIELDS.get(name)
        if name == "neighbor_list":
            count = value.shape[0] if value.dim() else -1
            stale = [k for k, lvl in self._levels.items() if lvl == "edge" and k != name]
            if stale and count != self._count("edge"):
                raise ValueError(
                    f"New neighbor_list has {count} edges but edge fields {stale} have "
                    f"{self._count('edge')}; delete them first."
                )
            value = _coerce_known(spec, value, count)
            level = "edge"
        elif spec is not None:
            value = _coerce_known(spec, value, self._count(spec.level))
            level = spec.level
        else:
            if level is None:
                level = self._levels.get(name) or self._infer_level(name, value)
            if level == "system" and (value.dim() == 0 or value.shape[0] != 1):
                value = value.unsqueeze(0)
            if value.shape[0] != self._count(level):
                raise ValueError(
                    f"Inconsistent number of {level}s in {name!r}: expected "
                    f"{self._count(level)}, got {value.shape[0]}."
                )
        if spec is None or spec.label or name in ("positions", "cell"):
            _check_finite(name, value)
        self._store(name, value, level, device)

    # --------------------------------------------------------------- mapping API
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._data[name]
        except KeyError:
            if name in FIELDS:
                return None
            raise AttributeError(f"'AtomicData' has no attribute {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in AtomicData.__slots__:
            object.__setattr__(self, name, value)
        else:
            self._set_validated(name, value)

    def __delattr__(self, name: str) -> None:
        self._set_validated(name, None)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, key, value)

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(list(self._data.items()))

    def keys(self) -> list[str]:
        """Names of the tensor fields that are set."""
        return list(self._data)

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return list(self._data.items())

    def level_of(self, key: str) -> Level:
        """Level (``"atom"``, ``"edge"`` or ``"system"``) of a stored field."""
        try:
            return self._levels[key]
        except KeyError:
            raise KeyError(f"AtomicData has no field {key!r}.") from None

    def add_node_property(self, key: str, value: Any) -> None:
        """Store a custom per-atom field."""
        self._set_validated(key, value, "atom")

    def add_edge_property(self, key: str, value: Any) -> None:
        """Store a custom per-edge field (needs a neighbour list)."""
        self._set_validated(key, value, "edge")

    def add_system_property(self, key: str, value: Any) -> None:
        """Store a custom per-system field (leading dimension 1 added if absent)."""
        self._set_validated(key, value, "system")

    def _level_dict(self, level: Level) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self._data.items() if self._levels[k] == level}

    @property
    def node_properties(self) -> dict[str, torch.Tensor]:
        return self._level_dict("atom")

    @property
    def edge_properties(self) -> dict[str, torch.Tensor]:
        return self._level_dict("edge")

    @property
    def system_properties(self) -> dict[str, torch.Tensor]:
        return self._level_dict("system")

    # ------------------------------------------------------------ derived values
    @property
    def num_nodes(self) -> int:
        return self._data["positions"].shape[0]

    @property
    def num_edges(self) -> int:
        return self._count("edge")

    @property
    def device(self) -> torch.device:
        return self._data["positions"].device

    @property
    def dtype(self) -> torch.dtype:
        return self._data["positions"].dtype

    @property
    def atomic_masses(self) -> torch.Tensor:
        """Masses in amu: the stored field, else looked up from ``atomic_numbers``."""
        return atomic_masses_of(self._data)

    @property
    def is_periodic(self) -> bool:
        pbc = self._data.get("pbc")
        return pbc is not None and bool(pbc.any())

    @property
    def chemical_hash(self) -> str:
        """BLAKE2s digest of species, positions, cell and pbc (labels ignored)."""
        z = self._data["atomic_numbers"].cpu()
        order = torch.argsort(z, stable=True)
        parts = [z[order].tolist(), self._data["positions"].cpu()[order].double().tolist()]
        for key in ("pbc", "cell"):
            value = self._data.get(key)
            parts.append(None if value is None else value.cpu().tolist())
        return hashlib.blake2s(json.dumps(parts).encode(), digest_size=32).hexdigest()

    # ------------------------------------------------------------------ copying
    def _rebuilt(self, data: dict[str, torch.Tensor]) -> AtomicData:
        out = AtomicData.__new__(AtomicData)
        object.__setattr__(out, "_data", data)
        object.__setattr__(out, "_levels", dict(self._levels))
        object.__setattr__(out, "info", dict(self.info))
        return out

    def to(
        self,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> AtomicData:
        """A copy on ``device`` with floating fields cast to ``dtype`` (when given)."""
        out = {}
        for key, value in self._data.items():
            cast = dtype if dtype is not None and value.dtype.is_floating_point else None
            out[key] = value.to(device=device, dtype=cast, non_blocking=non_blocking)
        return self._rebuilt(out)

    def cpu(self) -> AtomicData:
        return self.to("cpu")

    def clone(self) -> AtomicData:
        """A deep copy: tensors cloned, custom levels and info copied."""
        out = self._rebuilt({k: v.clone() for k, v in self._data.items()})
        object.__setattr__(out, "info", {k: _clone_value(v) for k, v in self.info.items()})
        return out

    def model_copy(self, *, deep: bool = False) -> AtomicData:
        return self.clone() if deep else self._rebuilt(dict(self._data))

    def __copy__(self) -> AtomicData:
        return self.model_copy()

    def __deepcopy__(self, memo: dict) -> AtomicData:
        return self.clone()

    def __getstate__(self) -> tuple:
        return self._data, self._levels, self.info

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(AtomicData.__slots__, state):
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict[str, Any]:
        """Tensor fields plus ``info`` (a shallow dict)."""
        return {**self._data, "info": self.info}

    model_dump = to_dict

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], **kwargs: Any) -> AtomicData:
        """Build from a mapping of field name to value (inverse of :meth:`to_dict`)."""
        return cls(**{**values, **kwargs})

    model_validate = from_dict

    def model_dump_json(self) -> str:
        """JSON text with tensors as nested lists (for inspection, not storage)."""
        payload = {k: v.detach().cpu().tolist() for k, v in self._data.items()}
        return json.dumps(payload)

    # -------------------------------------------------------------- comparisons
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AtomicData):
            return NotImplemented
        if self._data.keys() != other._data.keys():
            return False
        return all(tensors_equal(self._data[k], other._data[k]) for k in self._data)

    __hash__ = None  # mutable container

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={list(v.shape)}" for k, v in self._data.items())
        return f"AtomicData({inner})"

    # -------------------------------------------------------------------- ASE
    @classmethod
    def from_atoms(
        cls,
        atoms: Any,
        *,
        energy_key: str = "energy",
        forces_key: str = "forces",
        stress_key: str = "stress",
        virials_key: str = "virials",
        dipole_key: str = "dipole",
        charges_key: str = "charges",
        dtype: torch.dtype = torch.float32,
        label_dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        z_table: AtomicNumberTable | None = None,
        use_calculator: bool = True,
        info_keys: tuple[str, ...] | None = None,
    ) -> AtomicData:
        """Build from an ``ase.Atoms``.

        Labels come from ``atoms.info`` / ``atoms.arrays`` under the given keys, else
        from the results already stored on ``atoms.calc`` (nothing is recomputed).
        Calculator results are used only while they are valid for the atoms as they
        are now (``atoms.calc.check_state(atoms)`` reports no change): after
        ``atoms.rattle()`` or any other change of positions, numbers, cell or pbc,
        ASE still holds the old geometry's results, and such a label is treated as
        absent (call ``atoms.get_potential_energy()`` first to recompute it).
        Units are ASE's: eV, Å, eV/Å, eV/Å³ (stress positive = tensile).

        ASE stores labels as float64; they are converted to ``label_dtype``, which
        defaults to ``dtype`` (float32 unless given). To keep float64 labels with
        float32 positions, pass ``label_dtype=torch.float64``.

        Args:
            dtype: dtype of positions and cell (and of labels unless ``label_dtype``
                is given).
            label_dtype: dtype every label (energy, forces, stress, virial, dipole,
                charges, charge) is converted to; defaults to ``dtype``.
            z_table: when given, also store one-hot ``node_attrs``.
            use_calculator: read labels from ``atoms.calc.results`` when absent
                from info/arrays (only results valid for the current geometry).
            info_keys: ``atoms.info`` entries to keep in ``info`` (default: all but
                the consumed labels). ``info`` is metadata and is never batched.
        """
        fields, info = fields_from_atoms(
            atoms,
            keys={
                "energy": energy_key,
                "forces": forces_key,
                "stress": stress_key,
                "virial": virials_key,
                "dipole": dipole_key,
                "charges": charges_key,
            },
            dtype=dtype,
            label_dtype=label_dtype or dtype,
            use_calculator=use_calculator,
            info_keys=info_keys,
        )
        if z_table is not None:
            idx = torch.as_tensor(atomic_numbers_to_indices(atoms.numbers, z_table))
            fields["node_attrs"] = to_one_hot(idx.unsqueeze(-1), len(z_table)).to(dtype)
        data = cls(**fields, info=info)
        return data.to(device) if torch.device(device) != data.device else data

    def to_atoms(self) -> Any:
        """Convert to ``ase.Atoms`` with labels on a ``SinglePointCalculator``."""
        return atoms_from_data(self)


def _clone_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    import copy

    return copy.deepcopy(value)
