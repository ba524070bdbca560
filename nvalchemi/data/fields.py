"""The one table of known per-structure fields.

Every known field has a level (``"atom"``, ``"edge"`` or ``"system"``), a trailing
shape, a dtype kind and a unit. ``AtomicData`` validation, ``Batch`` collation and
assignment routing, the zarr store and error messages all read this table, so the
knowledge lives in one place (like ASE's property registry).

Shapes are the *trailing* shape after the leading dimension: number of atoms for
``"atom"`` fields, number of edges for ``"edge"`` fields and number of systems
(1 for a single ``AtomicData``) for ``"system"`` fields. ``None`` in a shape means
"any size".

Example:
    >>> from nvalchemi.data.fields import FIELDS
    >>> FIELDS["stress"].level, FIELDS["stress"].shape, FIELDS["stress"].unit
    ('system', (3, 3), 'eV/Å^3')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

Level = Literal["atom", "edge", "system"]
Kind = Literal["float", "int", "bool", "index"]
LEVELS: tuple[Level, ...] = ("atom", "edge", "system")


@dataclass(frozen=True)
class FieldSpec:
    """What the framework knows about one named field.

    Attributes:
        name: field name as used on ``AtomicData`` and ``Batch``.
        level: ``"atom"`` (one row per atom), ``"edge"`` (one row per edge) or
            ``"system"`` (one row per structure).
        shape: trailing shape after the leading dimension; ``None`` entries are free.
        kind: ``"float"``, ``"int"``, ``"bool"`` or ``"index"`` (stored as int64).
        unit: physical unit, or ``None`` when dimensionless.
        label: a reference label that a structure may lack; collating structures
            where only some carry it fills the others with NaN and records them in
            ``Batch.missing_labels`` (losses leave them out by that mask).
        description: one line for error messages and docs.
    """

    name: str
    level: Level
    shape: tuple[int | None, ...]
    kind: Kind
    unit: str | None = None
    label: bool = False
    description: str = ""

    def check_trailing_shape(self, shape: tuple[int, ...]) -> bool:
        """Whether ``shape`` (without the leading dimension) fits this field."""
        if len(shape) != len(self.shape):
            return False
        return all(want is None or want == got for want, got in zip(self.shape, shape))

    def check_dtype(self, dtype: torch.dtype) -> bool:
        """Whether ``dtype`` belongs to this field's dtype kind."""
        if self.kind == "float":
            return dtype.is_floating_point
        if self.kind == "bool":
            return dtype == torch.bool
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool

    def shape_text(self) -> str:
        """Human-readable expected shape, e.g. ``[n_atoms, 3]``."""
        lead = {"atom": "n_atoms", "edge": "n_edges", "system": "n_systems"}[self.level]
        dims = [lead, *("*" if d is None else str(d) for d in self.shape)]
        return "[" + ", ".join(dims) + "]"


_f = FieldSpec


FIELDS: dict[str, FieldSpec] = {
    spec.name: spec
    for spec in (
        # atoms
        _f("atomic_numbers", "atom", (), "index", None, description="atomic number Z"),
        _f("positions", "atom", (3,), "float", "Å", description="Cartesian positions"),
        _f("forces", "atom", (3,), "float", "eV/Å", label=True, description="forces"),
        _f("charges", "atom", (), "float", "e", label=True, description="partial charges"),
        _f("atomic_energies", "atom", (), "float", "eV", label=True),
        _f("atomic_masses", "atom", (), "float", "amu"),
        _f("velocities", "atom", (3,), "float", "Å/fs"),
        _f("momenta", "atom", (3,), "float", "amu·Å/fs"),
        _f("kinetic_energies", "atom", (1,), "float", "eV"),
        _f("atom_categories", "atom", (), "int"),
        _f("node_attrs", "atom", (None,), "float"),
        _f("node_embeddings", "atom", (None,), "float"),
        _f("node_alpha_spins", "atom", (1,), "float"),
        _f("node_beta_spins", "atom", (1,), "float"),
        _f("neighbor_matrix", "atom", (None,), "index"),
        _f("neighbor_matrix_shifts", "atom", (None, 3), "int"),
        _f("num_neighbors", "atom", (), "index"),
        # edges
        _f(
            "neighbor_list",
            "edge",
            (2,),
            "index",
            description="[sender, receiver] atom indices",
        ),
        _f(
            "neighbor_list_shifts",
            "edge",
            (3,),
            "index",
            description="integer lattice images of the receiver",
        ),
        _f("shifts", "edge", (3,), "float", "Å", description="Cartesian image shifts"),
        _f("edge_embeddings", "edge", (None,), "float"),
        # systems
        _f("cell", "system", (3, 3), "float", "Å", description="lattice vectors as rows"),
        _f("pbc", "system", (3,), "bool", description="periodic along each cell vector"),
        _f("energy", "system", (1,), "float", "eV", label=True, description="total energy"),
        _f(
            "stress",
            "system",
            (3, 3),
            "float",
            "eV/Å^3",
            label=True,
            description="Cauchy stress, positive = tensile (ASE sign)",
        ),
        _f("virial", "system", (3, 3), "float", "eV", label=True),
        _f("dipole", "system", (3,), "float", "e·Å", label=True),
        _f("charge", "system", (1,), "float", "e", description="total charge"),
        _f("spin", "system", (1,), "float"),
        _f("graph_alpha_spins", "system", (1,), "float"),
        _f("graph_embeddings", "system", (None,), "float"),
        _f(
            "loss_weight",
            "system",
            (1,),
            "float",
            description="per-structure weight of its loss terms (1 when absent)",
        ),
        _f("energy_weight", "system", (1,), "float", description="weight of its energy term"),
        _f("forces_weight", "system", (1,), "float", description="weight of its force term"),
        _f("stress_weight", "system", (1,), "float", description="weight of its stress term"),
        _f("virial_weight", "system", (1,), "float", description="weight of its virial term"),
    )
}

# Fields derived by Batch itself; never stored as data and never collated.
RESERVED_NAMES = frozenset(
    {
        "batch_idx",
        "batch_ptr",
        "ptr",
        "num_graphs",
        "batch_size",
        "num_nodes",
        "num_edges",
        "num_nodes_per_graph",
        "num_edges_per_graph",
        "num_nodes_list",
        "num_edges_list",
        "edge_batch_idx",
        "device",
        "dtype",
        "info",
        "keys",
    }
)


def field_spec(name: str) -> FieldSpec | None:
    """The spec of a known field, or ``None`` for a custom one."""
    return FIELDS.get(name)


def atomic_masses_of(fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Masses in amu: the stored ``atomic_masses``, else ASE's table by ``atomic_numbers``.

    Looked-up masses have the dtype and device of ``positions``.
    """
    stored = fields.get("atomic_masses")
    if stored is not None:
        return stored
    from ase.data import atomic_masses

    positions = fields["positions"]
    table = torch.as_tensor(atomic_masses, dtype=positions.dtype, device=positions.device)
    return table[fields["atomic_numbers"]]


def is_label(name: str) -> bool:
    """Whether ``name`` is a reference label that structures may lack."""
    spec = FIELDS.get(name)
    return spec is not None and spec.label


LABEL_FIELDS: tuple[str, ...] = tuple(name for name, spec in FIELDS.items() if spec.label)
