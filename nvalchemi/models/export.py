"""The export contract: one way to call a potential, eager (:class:`Potential`) or exported.

Every engine that runs a trained potential (the ASE calculator, torch-sim, LAMMPS, the MD
check, committees) calls it the same way, with a ``Dict[str, Tensor]``:

==================  ============  ==========================================================
input               shape         meaning
==================  ============  ==========================================================
``positions``       ``(N, 3)``    Å
``atomic_numbers``  ``(N,)``      int64
``cell``            ``(3, 3)``    lattice vectors as rows, Å (``(B, 3, 3)`` when batched)
``pbc``             ``(3,)``      bool (``(B, 3)`` when batched)
``edge_index``      ``(2, E)``    int64 ``(i, j)`` pairs, both directions present
``shifts``          ``(E, 3)``    Cartesian shift vectors, Å: the vector of edge ``k`` is
                                  ``positions[j] - positions[i] + shifts[k]``
``batch``           ``(N,)``      optional, int64: the system of every atom (``0..B-1``,
                                  the atoms of a system contiguous)
==================  ============  ==========================================================

It returns ``energy`` (a scalar, eV; ``(B,)`` when batched), ``atomic_energies (N,)`` (eV),
``forces (N, 3)`` (eV/Å) and, when any ``pbc`` is true, ``stress (3, 3)`` (eV/Å³, ASE's sign:
positive = tensile) and ``virial (3, 3)`` (eV, ``-stress * volume``), ``(B, 3, 3)`` when
batched with zero rows for systems that are not periodic (or whose cell has no volume).
Attributes: ``cutoff`` (float, Å) and ``atomic_numbers`` (the elements it knows).

A committee (:class:`~nvalchemi.models.committee.Committee`) follows the same contract with
the members' mean as ``energy``, ``atomic_energies``, ``forces`` and ``stress``, and adds its
calibrated spread as extra keys: ``energy_std`` (eV, shaped like ``energy``),
``forces_std (N, 3)`` (eV/Å), ``max_force_deviation`` (eV/Å, DP-GEN's model deviation, shaped
like ``energy``) and, with ``stress``, ``stress_std`` (eV/Å³, shaped like ``stress``). An
exported committee has the attribute ``committee_size`` (its number of members; 1 for a
single model).

:func:`neighbor_inputs` builds ``edge_index`` and ``shifts`` (vesin, full list) for one
system or a batch, so every engine builds them the same way.

Example:
    >>> import torch
    >>> from ase.build import bulk
    >>> from nvalchemi.models import PaiNN
    >>> atoms = bulk("Cu", "fcc", a=3.6) * (2, 2, 2)
    >>> potential = Potential(PaiNN(elements=[29], hidden_channels=8, cutoff=4.0))
    >>> inputs = {
    ...     "positions": torch.tensor(atoms.positions),
    ...     "atomic_numbers": torch.tensor(atoms.numbers),
    ...     "cell": torch.tensor(atoms.cell.array),
    ...     "pbc": torch.tensor(atoms.pbc),
    ... }
    >>> inputs.update(neighbor_inputs(**inputs, cutoff=potential.cutoff))
    >>> out = potential(inputs)
    >>> out["energy"].shape, out["forces"].shape, out["stress"].shape
    (torch.Size([]), torch.Size([8, 3]), torch.Size([3, 3]))
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import platform
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import nvalchemi
from nvalchemi._errors import FieldError
from nvalchemi._fileio import write_atomic
from nvalchemi.data.atomic_data import AtomicData
from nvalchemi.data.batch import Batch
from nvalchemi.data.neighbors import neighbor_list_for_system
from nvalchemi.models.base import NeighborListFormat

__all__ = [
    "FORMATS",
    "METADATA_FILE",
    "SELF_CHECK_TOLERANCE",
    "ExportError",
    "Potential",
    "export_model",
    "neighbor_inputs",
    "read_export_metadata",
    "sample_structures",
]

INPUT_KEYS = ("positions", "atomic_numbers", "cell", "pbc", "edge_index", "shifts")
"""The inputs every call needs (``batch`` is optional)."""


# --------------------------------------------------------------------------- neighbours
def neighbor_inputs(
    positions: Any,
    atomic_numbers: Any,
    cell: Any,
    pbc: Any,
    cutoff: float,
    batch: Any = None,
) -> dict[str, torch.Tensor]:
    """``edge_index (2, E)`` and Cartesian ``shifts (E, 3)`` of one system or a batch.

    The full neighbour list (both directions of every pair, vesin) of every pair closer
    than ``cutoff``; a periodic direction contributes its lattice images (the cutoff may
    exceed the cell), a non-periodic one none.

    Args:
        positions: ``(N, 3)`` in Å (a tensor or an array).
        atomic_numbers: ``(N,)``; only checked against ``positions``.
        cell: ``(3, 3)``, or ``(B, 3, 3)`` with ``batch``; ``None`` for open boundaries.
        pbc: ``(3,)``, or ``(B, 3)`` with ``batch``; ``None`` for open boundaries.
        cutoff: in Å, e.g. the ``cutoff`` of a :class:`Potential` or an exported model.
        batch: ``(N,)`` system of every atom (``0..B-1``, each system's atoms contiguous).

    Returns:
        ``{"edge_index": (2, E) int64, "shifts": (E, 3)}`` on the device of ``positions``
        (a tensor) and in its floating dtype (float64 for arrays), edges ordered by system
        and then by sender; merge it into the inputs.

    Raises:
        ValueError: shapes that do not match, a batch whose systems are not contiguous,
            a degenerate periodic cell, or a list that would explode (see
            :func:`nvalchemi.data.neighbors.check_neighbor_explosion`).

    Example:
        >>> import torch
        >>> pos = torch.tensor([[0.0, 0.0, 0.0], [1.5, 0.0, 0.0]])
        >>> out = neighbor_inputs(pos, torch.tensor([1, 1]), None, None, cutoff=2.0)
        >>> out["edge_index"].tolist(), out["shifts"].shape
        ([[0, 1], [1, 0]], torch.Size([2, 3]))
    """
    pos = _as_tensor(positions)
    device = pos.device
    dtype = pos.dtype if pos.dtype.is_floating_point else torch.float64
    pos64 = pos.detach().to("cpu", torch.float64)
    if pos64.dim() != 2 or pos64.shape[1] != 3:
        raise ValueError(f"neighbor_inputs: positions must be (N, 3); got {list(pos64.shape)}.")
    n = pos64.shape[0]
    numbers = _as_tensor(atomic_numbers).reshape(-1)
    if numbers.shape[0] != n:
        raise ValueError(f"neighbor_inputs: {numbers.shape[0]} atomic numbers for {n} positions.")
    counts, systems = _system_counts(batch, n, "neighbor_inputs")
    cells = _per_system(cell, systems, (3, 3), torch.float64, "cell")
    pbcs = _per_system(pbc, systems, (3,), torch.bool, "pbc")
    pairs, shifts = [], []
    start = 0
    for s, count in enumerate(counts):
        periodic = pbcs is not None and bool(pbcs[s].any())
        box = cells[s] if periodic and cells is not None else None
        local, images = neighbor_list_for_system(
            pos64[start : start + count].numpy(),
            None if box is None else box.numpy(),
            pbcs[s].numpy() if periodic else None,
            cutoff,
            full_list=True,
        )
        pairs.append(torch.from_numpy(local) + start)
        images = torch.from_numpy(images).to(torch.float64)
        shifts.append(images @ box if box is not None else torch.zeros_like(images))
        start += count
    edge_index = torch.cat(pairs).T.contiguous() if pairs else torch.zeros(2, 0, dtype=torch.long)
    cartesian = torch.cat(shifts) if shifts else torch.zeros(0, 3, dtype=torch.float64)
    return {"edge_index": edge_index.to(device), "shifts": cartesian.to(device, dtype)}


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(np.asarray(value))


def _system_counts(batch: Any, n: int, where: str) -> tuple[list[int], int]:
    """Atoms per system (``[n]`` without ``batch``) and the number of systems."""
    if batch is None:
        return [n], 1
    index = _as_tensor(batch).reshape(-1).to("cpu", torch.long)
    if index.shape[0] != n:
        raise ValueError(f"{where}: batch has {index.shape[0]} entries for {n} atoms.")
    if n and (bool((index[1:] < index[:-1]).any()) or int(index[0]) < 0):
        raise ValueError(
            f"{where}: batch must number the systems 0..B-1 with each system's atoms "
            "contiguous and in order (non-decreasing)."
        )
    counts = torch.bincount(index).tolist() if n else []
    return counts, len(counts)


def _per_system(
    value: Any, systems: int, shape: tuple[int, ...], dtype: torch.dtype, name: str
) -> torch.Tensor | None:
    """``value`` as ``(systems, *shape)`` on the CPU, or ``None``."""
    if value is None:
        return None
    tensor = _as_tensor(value).detach().to("cpu", dtype)
    if tensor.numel() != systems * int(np.prod(shape)):
        raise ValueError(
            f"neighbor_inputs: {name} must be {tuple(shape)} per system ({systems} system(s)); "
            f"got {list(tensor.shape)}."
        )
    return tensor.reshape(systems, *shape)


# --------------------------------------------------------------------------- eager
def check_head(model: Any, head: str | None) -> None:
    """Raise ``ValueError`` unless ``head`` is ``None`` or a readout head of ``model``."""
    if head is None:
        return
    names = getattr(model, "head_names", None)
    if names is None:
        raise ValueError(
            f"head={head!r}: {type(model).__name__} has no readout heads to choose from; "
            "drop head= (or use a multi-head model such as PaiNN(heads=[...]))."
        )
    if head not in names:
        raise ValueError(f"head={head!r} is not a head of this model; its heads are {list(names)}.")


def known_elements(model: Any) -> list[int]:
    """The atomic numbers ``model`` was built for (its ``elements``; ``[]``: it does not say)."""
    elements = getattr(model, "elements", None)
    return [] if elements is None else [int(z) for z in elements]


class Potential(nn.Module):
    """Any nvalchemi model behind the export contract, eager (no scripting).

    Calls ``model`` (run in eval mode, restored afterwards, without building a graph)
    on the contract's inputs and returns the contract's outputs (see the module
    docstring): what engines call, and the reference an export is checked against.
    Outputs the model cannot produce are left out (``atomic_energies`` needs a model
    that computes them, as PaiNN and MACEWrapper do; ``stress``/``virial`` a model with
    stress).

    Args:
        model: an ``nn.Module`` + ``BaseModelMixin`` model whose neighbour list, if it
            reads one, is a full ``COO`` list (every model of this package).
        head: the readout head of a multi-head model (default: its default head).

    Attributes:
        cutoff: the model's neighbour cutoff in Å (0.0 for a model without neighbours).
        atomic_numbers: the elements the model knows (``[]`` when it does not say).

    Raises:
        ValueError: an unknown ``head``, or a model that wants a half or matrix
            neighbour list.
    """

    def __init__(self, model: nn.Module, head: str | None = None) -> None:
        super().__init__()
        check_head(model, head)
        config = model.model_config.neighbor_config
        if config is not None and (config.half_list or config.format != NeighborListFormat.COO):
            raise ValueError(
                f"Potential needs a model that reads a full COO neighbour list; "
                f"{type(model).__name__} wants a {'half' if config.half_list else 'full'} "
                f"{config.format.value} list."
            )
        self.model = model
        self.head = head
        self.cutoff = 0.0 if config is None else float(config.cutoff)
        self.atomic_numbers = known_elements(model)

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The contract's outputs for ``inputs`` (one system, or a batch with ``batch``)."""
        missing = [k for k in INPUT_KEYS if k not in inputs]
        if missing:
            raise KeyError(f"Potential inputs lack {missing}; the contract needs {INPUT_KEYS}.")
        batched = inputs.get("batch") is not None
        n = inputs["positions"].shape[0]
        counts, systems = _system_counts(inputs.get("batch"), n, "Potential")
        cells = inputs["cell"].reshape(-1, 3, 3)
        pbcs = inputs["pbc"].reshape(-1, 3).to(torch.bool)
        if cells.shape[0] != systems or pbcs.shape[0] != systems:
            raise ValueError(
                f"Potential: {systems} system(s) but cell {list(inputs['cell'].shape)} and "
                f"pbc {list(inputs['pbc'].shape)}."
            )
        periodic = pbcs.any(dim=1)
        any_periodic = bool(periodic.any())
        images = _lattice_images(inputs, cells, counts)
        data = _model_input(inputs, images, counts, any_periodic, batched)
        outputs = set(self.model.model_config.outputs)
        wanted = outputs & {"energy", "forces", "atomic_energies", *_SPREADS[:3]}
        if any_periodic and "stress" in outputs:
            wanted |= outputs & {"stress", "stress_std"}
        raw = self._call(data, wanted)
        return _contract_outputs(raw, cells, periodic, any_periodic, batched)

    def _call(self, data: Any, wanted: set[str]) -> Mapping[str, Any]:
        model, config = self.model, self.model.model_config
        previous, was_training = config.active_outputs, model.training
        config.active_outputs = wanted
        model.eval()
        try:
            with torch.no_grad():
                return model(data) if self.head is None else model(data, head=self.head)
        finally:
            config.active_outputs = previous
            model.train(was_training)


def _lattice_images(
    inputs: Mapping[str, torch.Tensor], cells: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """Integer lattice images ``(E, 3)`` of the Cartesian ``shifts`` (what models read).

    ``shifts = images @ cell`` of the sender's system; solved with the pseudo-inverse
    (a slab's cell may have a zero vector along its open direction) and rounded.
    """
    shifts = inputs["shifts"].detach().to(torch.float64)
    if shifts.shape[0] == 0:
        return torch.zeros(0, 3, dtype=torch.long, device=shifts.device)
    cells64 = cells.detach().to(shifts.device, torch.float64)
    if len(counts) == 1:
        images = (shifts @ torch.linalg.pinv(cells64[0])).round()
        rebuilt = images @ cells64[0]
    else:
        owner = torch.repeat_interleave(
            torch.arange(len(counts), device=shifts.device),
            torch.tensor(counts, device=shifts.device),
        )
        edge_system = owner.index_select(0, inputs["edge_index"][0].to(shifts.device))
        inverse = torch.linalg.pinv(cells64).index_select(0, edge_system)
        images = torch.einsum("ej,ejk->ek", shifts, inverse).round()
        rebuilt = torch.einsum("ej,ejk->ek", images, cells64.index_select(0, edge_system))
    error = (rebuilt - shifts).abs().max()
    if bool(error > 1e-6 * (1.0 + shifts.abs().max())):
        raise ValueError(
            f"Potential: shifts are not lattice translations of the cell (off by up to "
            f"{float(error):.3g} Å); build them with neighbor_inputs(...)."
        )
    return images.long()


def _model_input(
    inputs: Mapping[str, torch.Tensor],
    images: torch.Tensor,
    counts: list[int],
    any_periodic: bool,
    batched: bool,
) -> AtomicData | Batch:
    """The contract's inputs as the ``AtomicData``/``Batch`` models read."""
    positions, numbers = inputs["positions"], inputs["atomic_numbers"].long()
    pairs = inputs["edge_index"].long().T
    cells, pbcs = inputs["cell"].reshape(-1, 3, 3), inputs["pbc"].reshape(-1, 3).bool()
    if not batched:
        fields: dict[str, Any] = {"atomic_numbers": numbers, "positions": positions}
        if any_periodic:
            fields.update(cell=cells.to(positions.dtype), pbc=pbcs)
        return AtomicData(**fields, neighbor_list=pairs, neighbor_list_shifts=images)
    owner = torch.repeat_interleave(
        torch.arange(len(counts), device=pairs.device), torch.tensor(counts, device=pairs.device)
    )
    edge_system = owner.index_select(0, pairs[:, 0])
    order = torch.argsort(edge_system, stable=True)
    pairs, images = pairs[order], images[order]
    edge_counts = torch.bincount(edge_system, minlength=len(counts)).tolist()
    systems, atom, edge = [], 0, 0
    for s, (count, edges) in enumerate(zip(counts, edge_counts)):
        fields = {
            "atomic_numbers": numbers[atom : atom + count],
            "positions": positions[atom : atom + count],
            "neighbor_list": pairs[edge : edge + edges] - atom,
            "neighbor_list_shifts": images[edge : edge + edges],
        }
        if any_periodic:
            fields.update(cell=cells[s : s + 1].to(positions.dtype), pbc=pbcs[s : s + 1])
        systems.append(AtomicData(**fields))
        atom, edge = atom + count, edge + edges
    return Batch.from_data_list(systems)


def _contract_outputs(
    raw: Mapping[str, Any],
    cells: torch.Tensor,
    periodic: torch.Tensor,
    any_periodic: bool,
    batched: bool,
) -> dict[str, torch.Tensor]:
    """The model's outputs (``energy [B, 1]``, ``stress [B, 3, 3]``, ...) in the contract's form."""
    out: dict[str, torch.Tensor] = {}
    energy = raw.get("energy")
    if energy is not None:
        energy = energy.detach().reshape(-1)
        out["energy"] = energy if batched else energy.reshape(())
    for key in ("atomic_energies", "forces", "forces_std"):
        if raw.get(key) is not None:
            out[key] = raw[key].detach()
    for key in ("energy_std", "max_force_deviation"):  # per system, as the energy
        if raw.get(key) is not None:
            value = raw[key].detach().reshape(-1)
            out[key] = value if batched else value.reshape(())
    stress = raw.get("stress")
    if any_periodic and stress is not None:
        stress = stress.detach().reshape(-1, 3, 3)
        volume = torch.linalg.det(cells.to(stress.dtype)).abs()
        keep = (periodic.to(stress.device) & (volume > 0)).to(stress.dtype).view(-1, 1, 1)
        stress = stress * keep
        virial = -stress * volume.view(-1, 1, 1)
        out["stress"], out["virial"] = (stress, virial) if batched else (stress[0], virial[0])
        if raw.get("stress_std") is not None:
            spread = raw["stress_std"].detach().reshape(-1, 3, 3) * keep
            out["stress_std"] = spread if batched else spread[0]
    return out


# --------------------------------------------------------------------------- exported
_MAX_Z = 118


_SPREADS = ("energy_std", "forces_std", "max_force_deviation", "stress_std")


class _ExportedPotential(nn.Module):
    """The contract around a model's per-atom energy module: what ``export_model`` scripts.

    ``energies`` (from ``model.atomic_energy_module(head)``) maps
    ``(positions, atomic_numbers, edge_index, shifts, batch, num_systems)`` to per-atom
    energies ``[N]``, or a committee's ``[M, N]`` (one row per member); this module checks
    the inputs and elements, sums the energies per system and takes forces and, for
    periodic systems, the virial and stress by one ``autograd.grad`` per member through a
    symmetric strain of positions and shifts. A committee's outputs are the members' mean
    plus their spread (population standard deviations times ``uncertainty_scale``, the
    committee's calibration factors of energy, forces and stress), as
    :class:`~nvalchemi.models.committee.Committee` computes them. Every method compiles
    with TorchScript; eager, it computes what the scripted module does.
    """

    def __init__(self, energies: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        from ase.data import chemical_symbols  # ase is a dependency; only needed here

        self.energies = energies
        self.cutoff = float(energies.cutoff)
        self.atomic_numbers = [int(z) for z in energies.atomic_numbers]
        members = getattr(energies, "members", None)
        self.committee_size = len(members) if isinstance(members, nn.ModuleList) else 1
        scale = getattr(energies, "uncertainty_scale", None)
        scale = torch.ones(3) if scale is None else scale.detach().clone()
        self.register_buffer("uncertainty_scale", scale.to(dtype))
        self.symbols = list(chemical_symbols[: _MAX_Z + 1])
        known = torch.zeros(_MAX_Z + 1, dtype=torch.bool)
        known[torch.tensor(self.atomic_numbers, dtype=torch.long)] = True
        self.register_buffer("known", known)
        self.register_buffer("dtype_of", torch.zeros(0, dtype=dtype))

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for key in ["positions", "atomic_numbers", "cell", "pbc", "edge_index", "shifts"]:
            if key not in inputs:
                raise KeyError(
                    "the inputs have no " + key + "; the model needs positions, atomic_numbers, "
                    "cell, pbc, edge_index and shifts (and batch for several systems)"
                )
        dtype = self.dtype_of.dtype
        positions = inputs["positions"].to(dtype)
        numbers = inputs["atomic_numbers"].to(torch.long)
        edge_index = inputs["edge_index"].to(torch.long)
        shifts = inputs["shifts"].to(dtype)
        batched = "batch" in inputs
        if batched:
            batch = inputs["batch"].to(torch.long)
        else:
            batch = torch.zeros_like(numbers)
        cells = inputs["cell"].to(dtype).reshape(-1, 3, 3)
        pbcs = inputs["pbc"].to(torch.bool).reshape(-1, 3)
        self._check_elements(numbers)
        num_systems = cells.shape[0]
        if pbcs.shape[0] != num_systems or (num_systems != 1 and not batched):
            raise ValueError(
                "cell and pbc must be (3, 3) and (3,) for one system, or (B, 3, 3) and (B, 3) "
                "with a batch input saying which system every atom belongs to"
            )
        periodic = pbcs.any(dim=1)
        with_stress = bool(periodic.any())
        grad_was_enabled = torch.is_grad_enabled()
        # Forces are derivatives, also under torch.no_grad() (TorchScript has no
        # enable_grad(); the mode is set back below, unless the energy module raises).
        torch.set_grad_enabled(True)
        leaf = positions.detach().requires_grad_(True)
        displacement = torch.zeros([num_systems, 3, 3], dtype=dtype, device=positions.device)
        displacement.requires_grad_(with_stress)
        strained, strained_shifts = leaf, shifts
        if with_stress:
            strain = 0.5 * (displacement + displacement.transpose(1, 2))
            if num_systems == 1:  # one matrix product instead of one per atom and edge
                strained = leaf + leaf @ strain[0]
                strained_shifts = shifts + shifts @ strain[0]
            else:
                atom_strain = strain.index_select(0, batch)
                strained = leaf + torch.bmm(leaf.unsqueeze(1), atom_strain).squeeze(1)
                edge_strain = atom_strain.index_select(0, edge_index[0])
                strained_shifts = shifts + torch.bmm(shifts.unsqueeze(1), edge_strain).squeeze(1)
        atomic = self.energies(strained, numbers, edge_index, strained_shifts, batch, num_systems)
        # [M, N]: one row per committee member (M = 1 for a single model)
        per_member = atomic if atomic.dim() == 2 else atomic.unsqueeze(0)
        size = per_member.shape[0]
        energies = torch.zeros([size, num_systems], dtype=atomic.dtype, device=atomic.device)
        energies = energies.index_add(1, batch, per_member)
        wrt = [leaf, displacement] if with_stress else [leaf]
        forces_of: list[torch.Tensor] = []
        strain_of: list[torch.Tensor] = []
        for m in range(size):
            grads = torch.autograd.grad(
                [energies[m].sum()], wrt, retain_graph=m + 1 < size, allow_unused=True
            )
            grad_positions = grads[0]
            if grad_positions is None:
                forces_of.append(torch.zeros_like(positions))
            else:
                forces_of.append(-grad_positions.detach())
            if with_stress:
                grad_strain = grads[1]
                if grad_strain is None:
                    grad_strain = torch.zeros_like(displacement)
                strain_of.append(grad_strain.detach())
        torch.set_grad_enabled(grad_was_enabled)
        energies = energies.detach()
        forces = torch.stack(forces_of)
        out: dict[str, torch.Tensor] = {
            "energy": self._one(self._mean(energies), batched),
            "atomic_energies": self._mean(per_member.detach()),
            "forces": self._mean(forces),
        }
        if size > 1:
            energy_std = self._std(energies, 0)
            forces_variance = self._variance(forces)
            per_atom = forces_variance.sum(-1).sqrt() * self.uncertainty_scale[1]
            deviation = torch.zeros([num_systems], dtype=per_atom.dtype, device=per_atom.device)
            deviation = deviation.scatter_reduce(0, batch, per_atom, "amax", include_self=False)
            out["energy_std"] = self._one(energy_std, batched)
            out["forces_std"] = forces_variance.sqrt() * self.uncertainty_scale[1]
            out["max_force_deviation"] = self._one(deviation, batched)
        if with_stress:
            volume = torch.linalg.det(cells).abs()
            keep = periodic & (volume > 0)
            safe_volume = torch.where(keep, volume, torch.ones_like(volume))
            stresses = torch.stack(strain_of) / safe_volume.view(1, -1, 1, 1)
            stresses = stresses * keep.to(dtype).view(1, -1, 1, 1)
            stress = self._mean(stresses)
            virial = -stress * volume.view(-1, 1, 1)
            out["stress"] = stress if batched else stress[0]
            out["virial"] = virial if batched else virial[0]
            if size > 1:
                stress_std = self._std(stresses, 2)
                out["stress_std"] = stress_std if batched else stress_std[0]
        return out

    def _mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over the members (dimension 0); a single model's own values."""
        return values[0] if values.shape[0] == 1 else values.mean(0)

    def _variance(self, values: torch.Tensor) -> torch.Tensor:
        """The members' population variance (as the eager committee computes it)."""
        return (values - values.mean(0)).pow(2).mean(0)

    def _std(self, values: torch.Tensor, quantity: int) -> torch.Tensor:
        """The calibrated spread of quantity ``quantity`` (0 energy, 1 forces, 2 stress)."""
        return self._variance(values).sqrt() * self.uncertainty_scale[quantity]

    def _one(self, per_system: torch.Tensor, batched: bool) -> torch.Tensor:
        """``(B,)`` for a batch, a scalar for one system."""
        return per_system if batched else per_system[0]

    def _check_elements(self, numbers: torch.Tensor) -> None:
        largest = self.known.shape[0] - 1
        inside = (numbers >= 0) & (numbers <= largest)
        known = self.known.index_select(0, numbers.clamp(0, largest)) & inside
        if bool((~known).any()):
            names: list[str] = []
            unknown: list[int] = torch.unique(numbers[~known]).tolist()
            for z in unknown:
                symbol = self.symbols[z] if 0 < z <= largest else "?"
                names.append(symbol + " (Z=" + str(z) + ")")
            raise ValueError(
                "this model knows the elements Z = "
                + str(self.atomic_numbers)
                + " and cannot handle "
                + ", ".join(names)
            )


# --------------------------------------------------------------------------- export_model
FORMATS = ("torchscript", "aoti")
"""Formats ``export_model`` knows; only ``torchscript`` is written (see :func:`export_model`)."""

METADATA_FILE = "metadata.json"
"""The archive's extra file holding the export's metadata (:func:`read_export_metadata`)."""

SELF_CHECK_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}
"""Largest relative difference between the exported and the eager model that the self-check
accepts, per dtype. Relative to the largest magnitude of each output over a structure (at
least 1e-3 of its unit): float64 agrees to round-off; in float32 TorchScript and eager
PyTorch sum in different orders, which moves forces of a few eV/Å by ~1e-6."""

_FLOOR = 1e-3
_DTYPE_FIX = "export in float64 or float32"

_UNITS = {
    "positions": "Å",
    "cell": "Å",
    "shifts": "Å",
    "energy": "eV",
    "atomic_energies": "eV",
    "forces": "eV/Å",
    "stress": "eV/Å³ (positive = tensile, ASE's sign)",
    "virial": "eV (-stress * volume)",
    "energy_std": "eV",
    "forces_std": "eV/Å",
    "max_force_deviation": "eV/Å",
    "stress_std": "eV/Å³",
}


class ExportError(FieldError):
    """A model that cannot be exported, or an export that disagrees with its model.

    A :class:`~nvalchemi._errors.FieldError`: its text names the argument (``field``)
    and the fix, as the command line prints it.
    """


def export_model(
    model: nn.Module,
    path: str | Path,
    *,
    head: str | None = None,
    dtype: torch.dtype | str | None = None,
    structures: Iterable[Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    format: str = "torchscript",
) -> dict[str, Any]:
    """Export ``model`` to a file that runs with torch only (``torch.jit.load(path)``).

    The file follows the contract of this module (inputs, outputs, ``cutoff``,
    ``atomic_numbers``; an unknown element raises inside it, naming the element) and
    holds a JSON metadata file (:data:`METADATA_FILE`, read it with
    :func:`read_export_metadata`). Before anything is written the export checks itself:
    the saved and reloaded module and the eager model (:class:`Potential`) must agree on
    ``structures``, one by one and as one batch, to :data:`SELF_CHECK_TOLERANCE`;
    otherwise nothing is written and :class:`ExportError` says by how much. The file
    is replaced atomically (an existing file is overwritten only if it is an export).

    A model exports when it has ``atomic_energy_module(head)``, a TorchScript-compatible
    module that maps ``(positions, atomic_numbers, edge_index, shifts, batch,
    num_systems)`` to per-atom energies (eV) and has ``cutoff`` and ``atomic_numbers``
    attributes (:class:`~nvalchemi.models.PaiNN` and
    :class:`~nvalchemi.models.MACEWrapper` have one); forces, stress and virial are
    derived from it by the export.

    Args:
        model: the model (not modified: a CPU copy is exported).
        path: the output file (conventionally ``.pt``); parent folders are created.
        head: the readout head of a multi-head model (default: its default head).
        dtype: ``float64``/``float32`` (default: the model's own).
        structures: ``ase.Atoms`` to check on (default: :func:`sample_structures`).
        metadata: more JSON-ready entries for the metadata (training step, data, ...).
        format: ``"torchscript"``. ``"aoti"`` (AOTInductor) is not provided yet and
            raises :class:`ExportError`.

    Returns:
        The metadata written into the file.

    Raises:
        ExportError: an unknown format, a model without ``atomic_energy_module``, a
            module TorchScript cannot compile (the message names the construct), a
            self-check that fails, or ``path`` naming a file that is not an export.

    Example:
        >>> model = PaiNN(elements=[29], hidden_channels=8)  # doctest: +SKIP
        >>> info = export_model(model, "cu.pt")  # doctest: +SKIP
        >>> m = torch.jit.load("cu.pt"); m.cutoff, m.atomic_numbers  # doctest: +SKIP
        (5.0, [29])
    """
    path = Path(path)
    check_format(format)
    _check_target(path)
    prepared = _prepared_copy(model, dtype)
    run_dtype = _parameter_dtype(prepared)
    loaded = _round_trip(script_potential(prepared, head, run_dtype))
    structures = list(structures) if structures is not None else None
    if not structures:
        structures = sample_structures(loaded.atomic_numbers)
    report = self_check(Potential(prepared, head), loaded, structures, run_dtype)
    info = _metadata(prepared, loaded, head, run_dtype, report, metadata)
    buffer = io.BytesIO()
    with quiet_torchscript():
        torch.jit.save(loaded, buffer, _extra_files={METADATA_FILE: json.dumps(info, indent=2)})
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, buffer.getvalue())
    return info


def read_export_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata JSON of an exported file (model, units, dtype, checks, training run).

    Reads it the way any torch program can:
    ``torch.jit.load(path, _extra_files={"metadata.json": ""})``.
    """
    extra = {METADATA_FILE: ""}
    with quiet_torchscript():
        torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    if not extra[METADATA_FILE]:
        raise ValueError(f"{path} has no {METADATA_FILE}: it is not an nvalchemi export.")
    return json.loads(extra[METADATA_FILE])


def script_potential(model: nn.Module, head: str | None, dtype: torch.dtype) -> Any:
    """The model's contract module compiled by TorchScript (not saved, not checked).

    Raises:
        ExportError: no ``atomic_energy_module``, or a construct TorchScript cannot compile.
    """
    check_head(model, head)
    energy_module = getattr(model, "atomic_energy_module", None)
    name = type(model).__name__
    if not callable(energy_module):
        raise ExportError(
            f"{name} cannot be exported: it has no atomic_energy_module(head) method",
            field="model",
            fix="give it one that returns a TorchScript-compatible nn.Module mapping "
            "(positions, atomic_numbers, edge_index, shifts, batch, num_systems) to per-atom "
            "energies, with cutoff and atomic_numbers attributes (as PaiNN's)",
        )
    energies = energy_module(head)
    # Innermost modules first: TorchScript's message names the construct but not always
    # the module using it (a library function it tried to compile, say), and a class
    # that failed once cannot be compiled again in this process to find out.
    for path, module in reversed(list(energies.named_modules())):
        if isinstance(module, torch.jit.ScriptModule):
            continue
        try:
            with quiet_torchscript():
                torch.jit.script(module)
        except Exception as exc:  # TorchScript raises several types; all mean "cannot compile"
            where = type(module).__name__ + (f" (the energy module's {path})" if path else "")
            raise ExportError(
                f"{name} cannot be exported: TorchScript cannot compile {where}: "
                f"{_torchscript_reason(exc)}",
                field="model",
                fix=f"write that construct of {type(module).__name__} in TorchScript's "
                "subset of Python (torch operations, typed arguments, no library calls)",
            ) from exc
    with quiet_torchscript():
        return torch.jit.script(_ExportedPotential(energies, dtype))


def self_check(
    eager: nn.Module, exported: Any, structures: Sequence[Any], dtype: torch.dtype
) -> dict[str, Any]:
    """Compare ``exported`` with ``eager`` on ``structures`` (alone and as one batch).

    Returns:
        ``{"structures", "tolerance", "max_relative_error": {output: value}, ...}``.

    Raises:
        ExportError: an output missing or off by more than :data:`SELF_CHECK_TOLERANCE`.
    """
    tolerance = SELF_CHECK_TOLERANCE.get(dtype, SELF_CHECK_TOLERANCE[torch.float32])
    worst: dict[str, tuple[float, str]] = {}
    names = [_formula(s) for s in structures]
    cases = [(names[i], [s]) for i, s in enumerate(structures)]
    if len(structures) > 1:
        cases.append(("all structures as one batch", list(structures)))
    for where, group in cases:
        inputs = _inputs_of(group, exported.cutoff, dtype, batched=len(group) > 1)
        expected = eager(inputs)
        # Without the profiling executor's optimizations, which only re-plan the same
        # operations (on the CPU) but cost a second or more for every new input shape.
        with torch.jit.optimized_execution(False):
            got = exported(inputs)
        for key, reference in expected.items():
            if key not in got:
                raise ExportError(
                    f"the exported model returned no {key!r} for {where}",
                    field="model",
                    fix="make its atomic_energy_module compute every output the model does",
                )
            error = _relative_error(got[key], reference)
            if key not in worst or error > worst[key][0]:
                worst[key] = (error, where)
    failed = {k: v for k, v in worst.items() if not v[0] <= tolerance}
    if failed:
        details = "; ".join(
            f"{key} off by {error:.3g} (relative) on {where}"
            for key, (error, where) in failed.items()
        )
        raise ExportError(
            f"the exported model disagrees with the eager model beyond the {dtype_name(dtype)} "
            f"tolerance {tolerance:g}: {details}; nothing was written",
            field="model",
            fix="make the model's atomic_energy_module compute what its forward does (an "
            "export must not change the potential); for a float32 export, try float64",
        )
    return {
        "structures": names,
        "reference": "the eager model (nvalchemi.models.export.Potential), same dtype",
        "tolerance": tolerance,
        "max_relative_error": {key: error for key, (error, _) in sorted(worst.items())},
    }


def sample_structures(atomic_numbers: Sequence[int], seed: int = 0) -> list[Any]:
    """Three small structures of the given elements for the self-check.

    A sheared periodic cell, a slab (periodic in x and y) and a four-atom cluster, atoms
    about 2.6 Å apart and rattled: not physical, but every output is exercised.
    """
    from ase import Atoms  # ase is a dependency; only the self-check builds structures

    zs = [int(z) for z in atomic_numbers] or [1]
    rng = np.random.default_rng(seed)
    grid = np.array([[i, j, k] for i in range(2) for j in range(2) for k in range(2)]) * 2.6
    shear = np.array([[5.2, 0.0, 0.0], [0.4, 5.2, 0.0], [0.3, -0.2, 5.2]])
    numbers = [zs[i % len(zs)] for i in range(len(grid))]
    bulk = Atoms(numbers, positions=grid @ (shear / 5.2), cell=shear, pbc=True)
    slab = Atoms(numbers, positions=grid, cell=np.diag([5.2, 5.2, 14.0]), pbc=[True, True, False])
    tetrahedron = np.array([[0, 0, 0], [2.5, 0, 0], [1.25, 2.1, 0], [1.25, 0.7, 2.0]])
    cluster = Atoms([zs[i % len(zs)] for i in range(4)], positions=tetrahedron)
    for atoms in (bulk, slab, cluster):
        atoms.positions += rng.normal(scale=0.1, size=atoms.positions.shape)
    return [bulk, slab, cluster]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_format(format: str) -> None:
    """Raise :class:`ExportError` unless ``format`` is one :func:`export_model` writes."""
    if format == "torchscript":
        return
    if format == "aoti":
        raise ExportError(
            "'aoti' (AOTInductor) is not provided yet: the exported model computes forces "
            "and stress with autograd inside its forward, which torch.export does not "
            "capture here",
            field="format",
            fix="use 'torchscript' (the default), which torch, torch-sim, LAMMPS and ASE load",
        )
    raise ExportError(f"unknown export format {format!r}", field="format", fix="use 'torchscript'")


def _check_target(path: Path) -> None:
    if path.is_dir():
        raise ExportError(
            f"{path} is a directory", field="path", fix="give the file to write, e.g. model.pt"
        )
    if path.exists():
        try:
            read_export_metadata(path)
        except Exception:  # any failure to read it back means: not ours
            raise ExportError(
                f"{path} exists and is not an nvalchemi export; it is left alone",
                field="path",
                fix="choose another output path (or remove the file yourself)",
            ) from None


def _prepared_copy(model: nn.Module, dtype: torch.dtype | str | None) -> nn.Module:
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if resolved not in SELF_CHECK_TOLERANCE:
            raise ExportError(f"unknown dtype {dtype!r}", field="dtype", fix=_DTYPE_FIX)
        dtype = resolved
    if dtype is not None and dtype not in SELF_CHECK_TOLERANCE:
        raise ExportError(f"cannot export in {dtype}", field="dtype", fix=_DTYPE_FIX)
    prepared = copy.deepcopy(model).to("cpu")
    if dtype is not None:
        prepared = prepared.to(dtype)
    return prepared.eval()


def _parameter_dtype(model: nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    for parameter in model.parameters():
        if parameter.dtype.is_floating_point:
            return parameter.dtype
    return torch.get_default_dtype()


def _round_trip(scripted: Any) -> Any:
    """Save and load ``scripted``: the self-check runs what the file will hold."""
    buffer = io.BytesIO()
    with quiet_torchscript():
        torch.jit.save(scripted, buffer)
        buffer.seek(0)
        return torch.jit.load(buffer, map_location="cpu")


@contextlib.contextmanager
def quiet_torchscript() -> Iterator[None]:
    """Silence torch's notice that TorchScript is deprecated: the issue fixes it as the format."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=DeprecationWarning)
        yield


def _torchscript_reason(exc: BaseException) -> str:
    """TorchScript's message: what it cannot compile and where (its first lines)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return "\n".join(lines[:12])


def _formula(structure: Any) -> str:
    get = getattr(structure, "get_chemical_formula", None)
    return get() if callable(get) else f"{len(structure)} atoms"


def _inputs_of(
    structures: Sequence[Any], cutoff: float, dtype: torch.dtype, batched: bool
) -> dict[str, torch.Tensor]:
    """The contract's inputs of ``ase.Atoms`` (one system, or a batch)."""
    positions = np.concatenate([np.asarray(s.positions) for s in structures])
    inputs = {
        "positions": torch.tensor(positions, dtype=dtype),
        "atomic_numbers": torch.tensor(np.concatenate([s.numbers for s in structures])),
        "cell": torch.tensor(np.stack([s.cell.array for s in structures]), dtype=dtype),
        "pbc": torch.tensor(np.stack([s.pbc for s in structures])),
    }
    if batched:
        counts = torch.tensor([len(s) for s in structures])
        inputs["batch"] = torch.repeat_interleave(torch.arange(len(structures)), counts)
    else:
        inputs["cell"], inputs["pbc"] = inputs["cell"][0], inputs["pbc"][0]
    inputs.update(neighbor_inputs(**inputs, cutoff=cutoff))
    return inputs


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().double(), expected.detach().double()
    if got.shape != expected.shape:
        return float("inf")
    if expected.numel() == 0:
        return 0.0
    scale = max(float(expected.abs().max()), _FLOOR)
    return float((got - expected).abs().max()) / scale


def _metadata(
    model: nn.Module,
    loaded: Any,
    head: str | None,
    dtype: torch.dtype,
    report: dict[str, Any],
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    info: dict[str, Any] = {
        "format": "nvalchemi.export",
        "format_version": 1,
        "model": {"class": f"{type(model).__module__}.{type(model).__qualname__}", "head": head},
        "dtype": dtype_name(dtype),
        "cutoff": float(loaded.cutoff),
        "atomic_numbers": list(loaded.atomic_numbers),
        "units": _UNITS,
        "inputs": [*INPUT_KEYS, "batch (optional)"],
        "outputs": ["energy", "atomic_energies", "forces", "stress", "virial"],
        "versions": _versions(),
        "self_check": report,
    }
    size = int(loaded.committee_size)
    if size > 1:
        info["outputs"] += list(_SPREADS)
        factors = loaded.uncertainty_scale.tolist()
        info["committee"] = {
            "size": size,
            "calibration_factors": dict(zip(("energy", "forces", "stress"), factors)),
            "spreads": "population standard deviations over the members times the factors",
        }
    for key, value in (extra or {}).items():
        if isinstance(value, Mapping) and isinstance(info.get(key), Mapping):
            info[key] = {**info[key], **value}
        else:
            info[key] = value
    return json.loads(json.dumps(info))  # JSON-ready, or a TypeError naming the value


def _versions() -> dict[str, str]:
    versions = {
        "nvalchemi": nvalchemi.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    for name in ("mace", "e3nn"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "__version__"):
            versions[name] = str(module.__version__)
    return versions
