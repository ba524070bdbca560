"""Committees: N models trained together whose disagreement says where they are unsure.

A :class:`Committee` is one ``nn.Module`` + ``BaseModelMixin`` holding ``N`` member
models that differ by the seed of their initial weights (member ``i`` is built under
``torch.manual_seed(seed + i)``) and, with ``bootstrap=True``, by the structures they
learn from. Every batch feeds every member: collation and neighbour lists are paid
once. Because it is one model, a training run, its checkpoint root, exact resume, EMA
and DDP treat a committee like any other model.

Calling it returns the committee mean and its spread for every quantity it computes:

* ``energy`` ``[B, 1]`` and ``energy_std`` ``[B, 1]`` (eV);
* ``forces`` ``[V, 3]`` and ``forces_std`` ``[V, 3]`` (eV/Å, per component);
* ``max_force_deviation`` ``[B, 1]`` (eV/Å): DP-GEN's model deviation, the largest over
  the atoms of a structure of ``sqrt(mean_m |F_m,i - mean F_i|^2)``;
* ``stress`` ``[B, 3, 3]`` and ``stress_std`` ``[B, 3, 3]`` (eV/Å³);
* ``atomic_energies`` ``[V]`` (eV), the members' mean, when every member computes them;
* every member's own prediction under :func:`member_key` (``energy_m0``, ``forces_m2``,
  ...), which the training loss reads (``nvalchemi.app.committee.committee_loss``).

Spreads are population standard deviations over the members (``ddof=0``), multiplied by
the model's calibration factors (:attr:`Committee.uncertainty_scale`, one per quantity,
1 until fitted, e.g. by ``nvalchemi.app.uncertainty.calibrate``); they are computed
whenever their quantity is and carry no gradient.

A committee of exportable members exports (``nvalchemi.models.export.export_model``,
``nvalchemi-training export``): the file computes every member and returns the mean and
the calibrated spreads as extra output keys (:meth:`Committee.atomic_energy_module`).

With ``bootstrap=True`` each member weights every training structure by its own
Poisson(1) count (an online bootstrap of the training set): the count scales the
gradient that structure sends to that member (the reported loss is unchanged). The
count is a hash of the structure's atoms and positions (to 0.001 Å), the member index
and ``seed``, so it is the same every epoch, on every rank and after a resume.

Example:
    >>> import torch
    >>> from nvalchemi.data import AtomicData
    >>> from nvalchemi.models import PaiNN
    >>> from nvalchemi.spec import create_model_spec
    >>> member = create_model_spec(PaiNN, cutoff=4.0, hidden_channels=8, elements=[29])
    >>> committee = Committee([member], size=3)
    >>> data = AtomicData(
    ...     atomic_numbers=torch.tensor([29, 29]),
    ...     positions=torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 2.5]]),
    ...     neighbor_list=torch.tensor([[0, 1], [1, 0]]),
    ... )
    >>> out = committee(data)
    >>> out["energy"].shape, out["forces_std"].shape, out["max_force_deviation"].shape
    (torch.Size([1, 1]), torch.Size([2, 3]), torch.Size([1, 1]))
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from nvalchemi.models._utils import graph_layout
from nvalchemi.models.base import BaseModelMixin, ModelConfig
from nvalchemi.spec import BaseSpec

__all__ = [
    "QUANTITIES",
    "SPREADS",
    "SPREAD_NAMES",
    "Committee",
    "bootstrap_counts",
    "member_key",
]

QUANTITIES = ("energy", "forces", "stress")
"""The quantities whose spread a committee reports, in the order of
:attr:`Committee.uncertainty_scale`."""

_AVERAGED = (*QUANTITIES, "atomic_energies")
"""What a committee averages over its members (per-atom energies get no spread)."""

SPREADS = {
    "energy": ("energy_std",),
    "forces": ("forces_std", "max_force_deviation"),
    "stress": ("stress_std",),
}
"""The spread outputs of each quantity."""

SPREAD_NAMES = tuple(name for names in SPREADS.values() for name in names)
"""Every spread output: ``energy_std``, ``forces_std``, ``max_force_deviation``, ``stress_std``."""

_SPREAD_OF = {name: quantity for quantity, names in SPREADS.items() for name in names}


def member_key(key: str, index: int) -> str:
    """The output key of member ``index``'s ``key`` (``member_key("forces", 1) == "forces_m1"``)."""
    return f"{key}_m{index}"


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Build under ``torch.manual_seed(seed)`` without touching the caller's CPU RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class Committee(nn.Module, BaseModelMixin):
    """``N`` models evaluated on every batch; outputs their mean and spread.

    Args:
        members: one module or model spec per member; or a single spec built ``size``
            times (member ``i`` under ``torch.manual_seed(seed + i)``). Modules are used
            as they are (their weights are not redrawn).
        size: the number of members (default: ``len(members)``); at least 2.
        seed: seed of the first member's initial weights (spec members) and of the
            bootstrap counts.
        bootstrap: weight every training structure by a per-member Poisson(1) count.

    Members must share their neighbour-list format and half/full choice; the committee's
    neighbour list reaches the largest member cutoff (each member ignores pairs beyond
    its own).

    Raises:
        ValueError: fewer than 2 members, ``size`` disagreeing with ``members``, or
            members whose neighbour lists cannot be shared.
    """

    def __init__(
        self,
        members: Sequence[nn.Module | BaseSpec],
        *,
        size: int | None = None,
        seed: int = 0,
        bootstrap: bool = False,
    ) -> None:
        super().__init__()
        members = list(members)
        size = len(members) if size is None else int(size)
        if len(members) == 1 and size > 1:
            members = members * size
        if len(members) != size:
            raise ValueError(
                f"Committee got {len(members)} members but size={size}; give one member "
                "(built size times) or one per member."
            )
        if size < 2:
            raise ValueError(f"A committee needs at least 2 members; got size={size}.")
        built = []
        for index, member in enumerate(members):
            if isinstance(member, BaseSpec):
                with _seeded(int(seed) + index):
                    member = member.build()
            if not isinstance(member, nn.Module) or not isinstance(
                getattr(member, "model_config", None), ModelConfig
            ):
                raise TypeError(
                    f"Committee member {index} is a {type(member).__name__}; members must be "
                    "nn.Module + BaseModelMixin models (or specs of them)."
                )
            built.append(member)
        self.members = nn.ModuleList(built)
        self.size = size
        self.seed = int(seed)
        self.bootstrap = bool(bootstrap)
        # Calibration factors of the spreads of (energy, forces, stress): a buffer, so
        # checkpoints, EMA copies and exports carry them.
        self.register_buffer("uncertainty_scale", torch.ones(len(QUANTITIES), dtype=torch.float64))
        self.model_config = _committee_config([m.model_config for m in built])

    # -------------------------------------------------------------- attributes
    @property
    def dtype(self) -> torch.dtype:
        """The first member's parameter dtype."""
        first = next(self.members[0].parameters(), None)
        return torch.get_default_dtype() if first is None else first.dtype

    @property
    def head_names(self) -> tuple[str, ...] | None:
        """The members' readout heads (``None`` when they have none)."""
        return getattr(self.members[0], "head_names", None)

    @property
    def cutoff(self) -> float | None:
        """The committee's neighbour-list cutoff in Å (``None``: no neighbour list)."""
        config = self.model_config.neighbor_config
        return None if config is None else config.cutoff

    @property
    def elements(self) -> list[int] | None:
        """The atomic numbers every member knows (``None`` when a member does not say)."""
        known = [getattr(member, "elements", None) for member in self.members]
        if any(found is None for found in known):
            return None
        return sorted(set.intersection(*({int(z) for z in found} for found in known)))

    @property
    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        """The members' embeddings concatenated along the feature axis."""
        shapes: dict[str, tuple[int, ...]] = {}
        for member in self.members:
            for name, shape in member.embedding_shapes.items():
                width = shapes.get(name, (0,))[0]
                shapes[name] = (width + shape[0], *shape[1:])
        return shapes

    def set_config(self, key: str, value: Any) -> None:
        """Set a field of ``model_config``; ``active_outputs`` also sets the members' (what
        their specs, and so checkpoints, record), e.g. ``{"energy", "forces", "stress"}``."""
        super().set_config(key, value)
        if key == "active_outputs":
            wanted = {_SPREAD_OF.get(k, k) for k in self.model_config.active_outputs}
            for member in self.members:
                member.set_config(key, wanted & set(_AVERAGED) & set(member.model_config.outputs))

    def set_uncertainty_scale(self, **factors: float) -> None:
        """Set calibration factors, e.g. ``set_uncertainty_scale(forces=1.8, energy=2.5)``."""
        unknown = sorted(set(factors) - set(QUANTITIES))
        if unknown:
            raise ValueError(f"unknown quantities {unknown}; use {list(QUANTITIES)}.")
        for name, value in factors.items():
            value = float(value)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"the calibration factor of {name} must be > 0; got {value}.")
            self.uncertainty_scale[QUANTITIES.index(name)] = value

    # ------------------------------------------------------------------ model
    def forward(self, data: Any, **kwargs: Any) -> OrderedDict[str, torch.Tensor | None]:
        """Mean, spread and per-member outputs on an ``AtomicData`` or ``Batch``.

        ``kwargs`` (e.g. ``head=``) go to every member.
        """
        active = self.output_data()
        wanted = {_SPREAD_OF.get(key, key) for key in active} & set(_AVERAGED)
        outputs = []
        for member in self.members:
            # For this call only: the members' own setting is what their specs record.
            config = member.model_config
            previous, config.active_outputs = config.active_outputs, set(wanted)
            try:
                outputs.append(member(data, **kwargs))
            finally:
                config.active_outputs = previous
        weights = None
        if self.bootstrap and self.training and torch.is_grad_enabled():
            weights = bootstrap_counts(data, self.size, self.seed)
        layout = None
        result: OrderedDict[str, torch.Tensor | None] = OrderedDict()
        members: dict[str, torch.Tensor] = {}
        for key in _AVERAGED:
            if key not in wanted:
                continue
            values = [out.get(key) for out in outputs]
            if any(value is None for value in values):
                result[key] = None
                continue
            if key == "atomic_energies":
                result[key] = torch.stack(values).mean(0)
                continue
            position = QUANTITIES.index(key)
            if key == "energy":
                values = [value.reshape(-1, 1) for value in values]
            if layout is None and (key == "forces" or weights is not None):
                layout = graph_layout(data)
            stacked = torch.stack(values)
            result[key] = stacked.mean(0)
            scale = self.uncertainty_scale[position].to(stacked.dtype)
            with torch.no_grad():
                variance = (stacked - stacked.mean(0)).pow(2).mean(0)
                result[SPREADS[key][0]] = variance.sqrt() * scale
                if key == "forces":
                    result["max_force_deviation"] = _max_per_structure(
                        variance.sum(-1).sqrt() * scale, *layout
                    )
            for index, value in enumerate(values):
                if weights is not None:
                    rows = weights[index] if key != "forces" else weights[index][layout[0]]
                    value = _scale_gradient(value, rows)
                members[member_key(key, index)] = value
        result.update(members)
        return result

    def compute_embeddings(self, data: Any, **kwargs: Any) -> Any:
        """Every member's embeddings, concatenated along the feature axis."""
        found: dict[str, list[torch.Tensor]] = {}
        for member in self.members:
            member.compute_embeddings(data, **kwargs)
            for name in member.embedding_shapes:
                found.setdefault(name, []).append(data[name])
        for name, parts in found.items():
            data[name] = torch.cat(parts, dim=-1)
        return data

    def atomic_energy_module(self, head: str | None = None) -> nn.Module:
        """Every member's per-atom energies as one TorchScript-compatible module (the export).

        ``forward(positions, atomic_numbers, edge_index, shifts, batch, num_systems)``
        returns ``[M, N]`` energies (eV), one row per member, from the export contract's
        inputs; the export (:func:`nvalchemi.models.export.export_model`) derives each
        member's forces and stress and returns their mean and spread. Attributes:
        ``cutoff`` (the largest member's), ``atomic_numbers`` (the elements every member
        knows) and the buffer ``uncertainty_scale`` (the calibration factors).

        Raises:
            TypeError: a member without ``atomic_energy_module`` (it cannot be exported).
        """
        return _CommitteeAtomicEnergies(self, head)

    # ------------------------------------------------------------ data fitting
    @classmethod
    def from_data(
        cls,
        train_data: Any,
        *,
        members: Sequence[nn.Module | BaseSpec],
        size: int | None = None,
        seed: int = 0,
        bootstrap: bool = False,
        **member_kwargs: Any,
    ) -> Committee:
        """A committee whose spec members are fitted to ``train_data`` (once) and built.

        Members whose class has ``from_data`` (e.g. PaiNN) are fitted once; when the
        fitted model reports its constructor arguments (``init_kwargs()``) every member
        is built from them under its own seed, else each is fitted under its seed.
        ``member_kwargs`` (e.g. ``elements``) override the members' spec arguments.

        Example:
            >>> committee = Committee.from_data(  # doctest: +SKIP
            ...     train_structures, members=[create_model_spec(PaiNN, cutoff=5.0)], size=4)
        """
        members = list(members)
        size = len(members) if size is None else int(size)
        if len(members) == 1:
            members = members * size
        fitted: dict[int, dict[str, Any]] = {}  # id(spec) -> fitted constructor arguments
        built: list[nn.Module] = []
        for index, member in enumerate(members):
            if not isinstance(member, BaseSpec):
                built.append(member)
                continue
            target = member.target()
            kwargs = {**member.built_kwargs(), **member_kwargs}
            fit = getattr(target, "from_data", None)
            if callable(fit) and id(member) not in fitted:
                first = fit(train_data, **kwargs)
                init_kwargs = getattr(first, "init_kwargs", None)
                fitted[id(member)] = {**kwargs, **init_kwargs()} if callable(init_kwargs) else {}
            with _seeded(int(seed) + index):
                if fitted.get(id(member)):
                    built.append(target(**fitted[id(member)]))
                elif callable(fit):
                    built.append(fit(train_data, **kwargs))
                else:
                    built.append(target(**kwargs))
        return cls(built, size=size, seed=seed, bootstrap=bootstrap)


class _CommitteeAtomicEnergies(nn.Module):
    """The members' per-atom energy modules side by side: ``[M, N]`` (scriptable)."""

    def __init__(self, committee: Committee, head: str | None) -> None:
        super().__init__()
        modules = []
        for index, member in enumerate(committee.members):
            make = getattr(member, "atomic_energy_module", None)
            if not callable(make):
                raise TypeError(
                    f"committee member {index} ({type(member).__name__}) has no "
                    "atomic_energy_module(head), so the committee cannot be exported"
                )
            modules.append(make(head))
        self.members = nn.ModuleList(modules)
        self.cutoff = max(float(module.cutoff) for module in modules)
        known = [{int(z) for z in module.atomic_numbers} for module in modules]
        self.atomic_numbers = sorted(set.intersection(*known))
        self.register_buffer("uncertainty_scale", committee.uncertainty_scale.detach().clone())

    def forward(
        self,
        positions: torch.Tensor,
        atomic_numbers: torch.Tensor,
        edge_index: torch.Tensor,
        shifts: torch.Tensor,
        batch: torch.Tensor,
        num_systems: int,
    ) -> torch.Tensor:
        energies: list[torch.Tensor] = []
        for member in self.members:
            energies.append(
                member(positions, atomic_numbers, edge_index, shifts, batch, num_systems)
            )
        return torch.stack(energies)


# -------------------------------------------------------------------- helpers
def _committee_config(configs: list[ModelConfig]) -> ModelConfig:
    """The committee's contract: what every member computes, plus the spreads."""
    common = set(QUANTITIES)
    for config in configs:
        common &= set(config.outputs)
    if not common:
        raise ValueError(
            f"Committee members share none of {list(QUANTITIES)} among their outputs; a "
            "committee averages energies, forces or stresses."
        )
    neighbor = None
    found = [c.neighbor_config for c in configs if c.neighbor_config is not None]
    if found:
        if len(found) != len(configs) or len({(c.format, c.half_list) for c in found}) > 1:
            raise ValueError(
                "Committee members must share one neighbour-list format and half/full choice; "
                f"got {[_describe_neighbors(c.neighbor_config) for c in configs]}."
            )
        neighbor = max(found, key=lambda c: c.cutoff + c.skin).model_copy()
    spreads = {name for quantity in common for name in SPREADS[quantity]}
    active = set(configs[0].active_outputs or common) & common
    if all("atomic_energies" in config.outputs for config in configs):
        common.add("atomic_energies")
    return ModelConfig(
        outputs=common | spreads,
        autograd_outputs=set().union(*(c.autograd_outputs for c in configs)) & common,
        autograd_inputs=set().union(*(c.autograd_inputs for c in configs)),
        required_inputs=set().union(*(c.required_inputs for c in configs)),
        optional_inputs=set().union(*(c.optional_inputs for c in configs)),
        supports_pbc=all(c.supports_pbc for c in configs),
        needs_pbc=any(c.needs_pbc for c in configs),
        neighbor_config=neighbor,
        active_outputs=active,
    )


def _describe_neighbors(config: Any) -> str:
    if config is None:
        return "no neighbour list"
    return f"{config.format.value} {'half' if config.half_list else 'full'} list"


def _max_per_structure(
    values: torch.Tensor, batch_idx: torch.Tensor, num_graphs: int
) -> torch.Tensor:
    """``[B, 1]``: the largest of each structure's per-atom ``values`` (0 for no atoms)."""
    out = values.new_zeros(num_graphs)
    out = out.scatter_reduce(0, batch_idx, values, reduce="amax", include_self=False)
    return out.reshape(-1, 1)


def _scale_gradient(value: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``value`` unchanged, with the gradient of row ``i`` multiplied by ``rows[i]``."""
    rows = rows.to(value.dtype).reshape(-1, *([1] * (value.dim() - 1)))
    frozen = value.detach()
    return frozen + rows * (value - frozen)


# Poisson(1) cumulative probabilities P(K <= k), k = 0..15 (P(K > 15) < 1e-13).
_POISSON_CDF = tuple(
    math.exp(-1.0) * sum(1.0 / math.factorial(j) for j in range(k + 1)) for k in range(16)
)
_MASK_53 = (1 << 53) - 1


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX = tuple(_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_COORD = tuple(_int64(c) for c in (0xD6E8FEB86659FD93, 0xA0761D6478BD642F, 0xE7037ED1A0B428DB))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (multiplications wrap around)."""
    x = (x ^ _shift_right(x, 30)) * _MIX[1]
    x = (x ^ _shift_right(x, 27)) * _MIX[2]
    return x ^ _shift_right(x, 31)


def bootstrap_counts(data: Any, size: int, seed: int = 0) -> torch.Tensor:
    """``[size, B]`` Poisson(1) counts: how often each member draws each structure.

    A deterministic function of the structure (atomic numbers and positions rounded to
    0.001 Å; atom order does not matter), the member index and ``seed``: the same
    structure gets the same counts in every epoch, batch, rank and process.

    Example:
        >>> import torch
        >>> from nvalchemi.data import AtomicData
        >>> atoms = AtomicData(atomic_numbers=torch.tensor([29]), positions=torch.zeros(1, 3))
        >>> counts = bootstrap_counts(atoms, 4)
        >>> counts.shape, bool((counts == bootstrap_counts(atoms, 4)).all())
        (torch.Size([4, 1]), True)
    """
    positions = data["positions"].detach()
    numbers = data["atomic_numbers"].to(torch.int64)
    batch_idx, num_graphs = graph_layout(data)
    grid = torch.round(positions.to(torch.float64) * 1000.0).to(torch.int64)
    atom_hash = _mix64(
        grid[:, 0] * _COORD[0] + grid[:, 1] * _COORD[1] + grid[:, 2] * _COORD[2] + numbers
    )
    structure = torch.zeros(num_graphs, dtype=torch.int64, device=positions.device)
    structure = structure.index_add(0, batch_idx, atom_hash)  # integer sums: order-free
    member = torch.arange(size, dtype=torch.int64, device=positions.device) + int(seed) * size
    x = _mix64(structure.unsqueeze(0) + _mix64(member * _MIX[0]).unsqueeze(1))
    uniform = (x & _MASK_53).to(torch.float64) / float(1 << 53)
    cdf = torch.tensor(_POISSON_CDF, dtype=torch.float64, device=positions.device)
    return torch.searchsorted(cdf, uniform, right=True).to(positions.dtype)
