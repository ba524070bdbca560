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

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from nvalchemi.data.atomic_data import AtomicData
from nvalchemi.data.batch import Batch
from nvalchemi.data.neighbors import neighbor_list_for_system
from nvalchemi.models.base import NeighborListFormat

__all__ = ["Potential", "neighbor_inputs"]

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
    """The atomic numbers ``model`` handles, as far as it says (``[]``: it does not say)."""
    exporter = getattr(model, "atomic_energy_module", None)
    if callable(exporter):
        return [int(z) for z in exporter().atomic_numbers]
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
        wanted = outputs & {"energy", "forces", "atomic_energies"}
        if any_periodic and "stress" in outputs:
            wanted.add("stress")
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
    for key in ("atomic_energies", "forces"):
        if raw.get(key) is not None:
            out[key] = raw[key].detach()
    stress = raw.get("stress")
    if any_periodic and stress is not None:
        stress = stress.detach().reshape(-1, 3, 3)
        volume = torch.linalg.det(cells.to(stress.dtype)).abs()
        keep = (periodic.to(stress.device) & (volume > 0)).to(stress.dtype).view(-1, 1, 1)
        stress = stress * keep
        virial = -stress * volume.view(-1, 1, 1)
        out["stress"], out["virial"] = (stress, virial) if batched else (stress[0], virial[0])
    return out
