"""PaiNN: an E(3)-equivariant message-passing interatomic potential in pure PyTorch.

After Schütt, Unke and Gastegger, "Equivariant message passing for the prediction of
tensorial properties and molecular spectra" (ICML 2021). Every atom carries scalar
features ``s [V, F]`` and vector features ``v [V, 3, F]``; each interaction block
passes messages along edges (radial filters times a smooth cutoff, edge directions)
and then mixes scalars and vectors per atom. The energy is a sum of per-atom
energies ``E_i = scale * MLP(s_i) + shift + E0[Z_i]``; forces and stress are its
derivatives (:func:`nvalchemi.models._utils.energy_and_derivatives`).

The constructor is described entirely by keyword arguments with usable defaults, so
checkpoints can rebuild the model from its attributes. Fit the data-dependent ones
(elements, reference energies ``E0``, ``scale``, ``shift``) with :meth:`PaiNN.from_data`
or :func:`fit_atomic_energies` / :func:`fit_scale_shift`.

Several readout heads (one per dataset or level of theory) can share the trunk:
``PaiNN(heads=("pbe", "r2scan"))`` or, on a trained model, :meth:`PaiNN.add_head`.
Each head has its own readout MLP, reference energies, scale and shift; a structure
uses the head named by ``model(data, head="r2scan")``, else its ``head`` field (a
per-structure index into :attr:`PaiNN.head_names`), else ``default_head`` (the first
head unless set; :meth:`PaiNN.add_head` can make the new head the default).

Example:
    >>> import torch
    >>> from nvalchemi.data import AtomicData
    >>> model = PaiNN(cutoff=4.0, hidden_channels=16, num_interactions=2, elements=[29])
    >>> data = AtomicData(
    ...     atomic_numbers=torch.tensor([29, 29]),
    ...     positions=torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 2.5]]),
    ...     neighbor_list=torch.tensor([[0, 1], [1, 0]]),
    ... )
    >>> out = model(data)
    >>> out["energy"].shape, out["forces"].shape
    (torch.Size([1, 1]), torch.Size([2, 3]))
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvalchemi.data.neighbors import edge_vectors
from nvalchemi.models._utils import energy_and_derivatives, graph_layout
from nvalchemi.models.base import BaseModelMixin, ModelConfig, NeighborConfig
from nvalchemi.models.statistics import (
    atomic_number,
    fit_atomic_energies,
    fit_scale_shift,
    mean_num_neighbors,
)

__all__ = ["PaiNN", "fit_atomic_energies", "fit_scale_shift"]

MAX_ATOMIC_NUMBER = 94
_CUTOFF_FNS = ("cosine", "polynomial")


def _chemical_symbol(z: int) -> str:
    from ase.data import chemical_symbols

    return chemical_symbols[z] if 0 < z < len(chemical_symbols) else f"Z={z}"


class _BesselBasis(nn.Module):
    """``sqrt(2/rc) sin(n pi r / rc) / r`` for ``n = 1..num_rbf`` (the sinc basis of PaiNN)."""

    def __init__(self, cutoff: float, num_rbf: int) -> None:
        super().__init__()
        self.cutoff = cutoff
        self.register_buffer(
            "frequencies", torch.arange(1, num_rbf + 1) * math.pi / cutoff, persistent=False
        )
        self.prefactor = math.sqrt(2.0 / cutoff)

    def forward(self, distances: torch.Tensor) -> torch.Tensor:
        arg = distances.unsqueeze(-1) * self.frequencies.to(distances.dtype)
        return self.prefactor * torch.sin(arg) / distances.unsqueeze(-1)


def _cosine_cutoff(distances: torch.Tensor, cutoff: float) -> torch.Tensor:
    inside = distances < cutoff
    value = 0.5 * (torch.cos(distances * (math.pi / cutoff)) + 1.0)
    return value * inside


def _polynomial_cutoff(distances: torch.Tensor, cutoff: float, p: int = 6) -> torch.Tensor:
    """The smooth envelope of DimeNet: 1 at 0, value and first two derivatives 0 at the cutoff."""
    x = distances / cutoff
    value = (
        1.0
        - (p + 1) * (p + 2) / 2 * x**p
        + p * (p + 2) * x ** (p + 1)
        - p * (p + 1) / 2 * x ** (p + 2)
    )
    return value * (x < 1.0)


class _Interaction(nn.Module):
    """One PaiNN message + update block."""

    def __init__(self, hidden: int, num_rbf: int) -> None:
        super().__init__()
        self.hidden = hidden
        # No bias: the radial features already carry the cutoff envelope, so the
        # filter (and with it every message) vanishes smoothly at the cutoff.
        self.filter_net = nn.Linear(num_rbf, 3 * hidden, bias=False)
        self.message_mlp = nn.Sequential(
            nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 3 * hidden)
        )
        self.vector_mix = nn.Linear(hidden, 2 * hidden, bias=False)  # U and V, fused
        self.update_mlp = nn.Sequential(
            nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, 3 * hidden)
        )

    def forward(
        self,
        s: torch.Tensor,
        v: torch.Tensor | None,
        radial: torch.Tensor,
        directions: torch.Tensor,
        centers: torch.Tensor,
        neighbors: torch.Tensor,
        norm: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.hidden
        # Message: every neighbour j sends phi(s_j) * W(r_ij) to the centre i.
        phi = self.message_mlp(s)
        if v is None:
            # v is zero before the first block, so the v-gating third of the message
            # does not contribute: skip it (a third less edge work in this block).
            phi = torch.cat([phi[:, :f], phi[:, 2 * f :]], dim=-1)
            weight = self.filter_net.weight
            filters = nn.functional.linear(radial, torch.cat([weight[:f], weight[2 * f :]]))
            ds_edge, dvs_edge = (phi.index_select(0, neighbors) * filters).split(f, dim=-1)
            dv_edge = dvs_edge.unsqueeze(1) * directions.unsqueeze(-1)
        else:
            x = phi.index_select(0, neighbors) * self.filter_net(radial)
            ds_edge, dvv_edge, dvs_edge = x.split(f, dim=-1)
            dv_edge = dvs_edge.unsqueeze(1) * directions.unsqueeze(-1)
            dv_edge = torch.addcmul(dv_edge, v.index_select(0, neighbors), dvv_edge.unsqueeze(1))
        s = s + norm * torch.zeros_like(s).index_add_(0, centers, ds_edge)
        dv = torch.zeros(s.shape[0], 3, f, dtype=s.dtype, device=s.device)
        dv = dv.index_add_(0, centers, dv_edge)
        v = norm * dv if v is None else v + norm * dv
        # Update: mix scalars and vectors on every atom.
        u_v, v_v = self.vector_mix(v).split(f, dim=-1)
        v_norm = torch.sqrt((v_v * v_v).sum(dim=1) + 1e-8)
        a = self.update_mlp(torch.cat([s, v_norm], dim=-1))
        a_vv, a_sv, a_ss = a.split(f, dim=-1)
        s = s + a_sv * (u_v * v_v).sum(dim=1) + a_ss
        v = torch.addcmul(v, a_vv.unsqueeze(1), u_v)
        return s, v


def _readout_mlp(hidden: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(hidden, hidden // 2 or 1), nn.SiLU(), nn.Linear(hidden // 2 or 1, 1)
    )


class _Head(nn.Module):
    """A readout head after the first: its MLP, reference energies ``e0``, scale and shift."""

    def __init__(self, readout: nn.Module, e0: torch.Tensor, scale: float, shift: float) -> None:
        super().__init__()
        self.readout = readout
        self.register_buffer("e0", e0)
        self.scale = float(scale)
        self.shift = float(shift)


class PaiNN(nn.Module, BaseModelMixin):
    """Polarizable atom interaction neural network: energy, forces and stress.

    Inputs: ``positions``, ``atomic_numbers``, a full (both directions) neighbour
    list ``neighbor_list [E, 2]``, and for periodic systems ``cell`` and
    ``neighbor_list_shifts``. Outputs ``energy [B, 1]``, ``forces [V, 3]``,
    ``stress [B, 3, 3]`` and ``atomic_energies [V]`` (the per-atom energies ``E_i``
    that sum to the energy; active by default: energy and forces; enable stress with
    ``PaiNN(active_outputs=("energy", "forces", "stress"))`` or, on a live model,
    ``model.set_config("active_outputs", {"energy", "forces", "stress"})``; either way
    checkpoints record the choice).

    Args:
        cutoff: interaction cutoff in Å (also the model's neighbour-list cutoff).
        hidden_channels: feature width ``F``.
        num_interactions: message-passing blocks.
        num_rbf: radial basis functions.
        elements: atomic numbers the model supports (default: 1..94); others raise
            ``ValueError``.
        atomic_energies: reference energy ``E0`` per element in eV, as a mapping
            keyed by atomic number or chemical symbol (``{29: -3.5}`` or
            ``{"Cu": -3.5}``; missing elements get 0) or a sequence aligned with
            ``elements``; see :func:`fit_atomic_energies`.
        scale: multiplies the network's per-atom energy (eV); e.g. the force RMS.
        shift: added to every per-atom energy (eV).
        avg_num_neighbors: messages are divided by this (``None``: not normalised).
        cutoff_fn: ``"cosine"`` or ``"polynomial"`` envelope.
        dtype: parameter dtype (default ``torch.get_default_dtype()``); inputs are
            cast to it and outputs use it.
        active_outputs: outputs to compute, a subset of energy, forces, stress,
            atomic_energies.
        heads: names of the readout heads (default: one head, ``"default"``). The
            first head uses ``atomic_energies``, ``scale`` and ``shift`` and the
            parameters ``readout.*``; the others live under ``head_readouts.<name>.*``.
        head_params: ``{name: {"atomic_energies": ..., "scale": s, "shift": t}}`` for
            the heads after the first (missing entries: no ``E0``, scale 1, shift 0).
        default_head: the head of structures that name none (default: the first).
    """

    def __init__(
        self,
        *,
        cutoff: float = 5.0,
        hidden_channels: int = 64,
        num_interactions: int = 3,
        num_rbf: int = 20,
        elements: Sequence[int] | None = None,
        atomic_energies: Mapping[int | str, float] | Sequence[float] | torch.Tensor | None = None,
        scale: float = 1.0,
        shift: float = 0.0,
        avg_num_neighbors: float | None = None,
        cutoff_fn: str = "cosine",
        dtype: torch.dtype | str | None = None,
        active_outputs: Sequence[str] = ("energy", "forces"),
        heads: Sequence[str] | None = None,
        head_params: Mapping[str, Mapping[str, Any]] | None = None,
        default_head: str | None = None,
    ) -> None:
        super().__init__()
        if cutoff <= 0:
            raise ValueError(f"PaiNN cutoff must be positive; got {cutoff}.")
        if cutoff_fn not in _CUTOFF_FNS:
            raise ValueError(f"PaiNN cutoff_fn={cutoff_fn!r}; expected one of {_CUTOFF_FNS}.")
        if hidden_channels < 1 or num_interactions < 1 or num_rbf < 1:
            raise ValueError(
                "PaiNN needs hidden_channels, num_interactions and num_rbf >= 1; got "
                f"{hidden_channels}, {num_interactions}, {num_rbf}."
            )
        if avg_num_neighbors is not None and avg_num_neighbors <= 0:
            raise ValueError(f"avg_num_neighbors must be positive; got {avg_num_neighbors}.")
        self.cutoff = float(cutoff)
        self.hidden_channels = int(hidden_channels)
        self.num_interactions = int(num_interactions)
        self.num_rbf = int(num_rbf)
        self.scale = float(scale)
        self.shift = float(shift)
        self.avg_num_neighbors = None if avg_num_neighbors is None else float(avg_num_neighbors)
        self.cutoff_fn = cutoff_fn
        zs = _normalise_elements(elements)
        self.elements = None if elements is None else zs

        # z -> row; unknown elements map to the last row, whose E0 is NaN.
        num_elements = len(zs)
        table = torch.full((MAX_ATOMIC_NUMBER + 2,), num_elements, dtype=torch.long)
        table[torch.tensor(zs)] = torch.arange(num_elements)
        self.register_buffer("z_to_index", table, persistent=False)
        self.register_buffer("_element_zs", torch.tensor(zs, dtype=torch.long), persistent=False)
        self.register_buffer("e0", _reference_energies(atomic_energies, zs))

        f = self.hidden_channels
        self.embedding = nn.Embedding(num_elements + 1, f)
        self.radial_basis = _BesselBasis(self.cutoff, self.num_rbf)
        self.interactions = nn.ModuleList(
            _Interaction(f, self.num_rbf) for _ in range(self.num_interactions)
        )
        self.readout = _readout_mlp(f)
        names = _head_names(heads)
        self.heads = None if heads is None else names
        self.head_readouts = nn.ModuleDict()
        extra = dict(head_params or {})
        unknown = sorted(set(extra) - set(names[1:]))
        if unknown:
            raise ValueError(
                f"head_params names heads {unknown} that are not among the extra heads "
                f"{names[1:]} (the first head, {names[0]!r}, uses atomic_energies/scale/shift)."
            )
        for name in names[1:]:
            params = dict(extra.get(name) or {})
            bad = sorted(set(params) - {"atomic_energies", "scale", "shift"})
            if bad:
                raise ValueError(
                    f"head_params[{name!r}] has unknown keys {bad}; use atomic_energies, "
                    "scale and shift."
                )
            self.head_readouts[name] = _Head(
                _readout_mlp(f),
                _reference_energies(params.get("atomic_energies"), zs),
                params.get("scale", 1.0),
                params.get("shift", 0.0),
            )
        if default_head is not None and default_head not in names:
            raise ValueError(
                f"default_head={default_head!r} is not one of the heads {list(names)}."
            )
        self.default_head = default_head
        self.to(_resolve_dtype(dtype))

        self.model_config = ModelConfig(
            outputs={"energy", "forces", "stress", "atomic_energies"},
            autograd_outputs={"forces", "stress"},
            autograd_inputs={"positions"},
            optional_inputs={"cell", "pbc", "neighbor_list_shifts"},
            supports_pbc=True,
            neighbor_config=NeighborConfig(cutoff=self.cutoff),
            active_outputs=set(active_outputs),
        )
        unknown = set(active_outputs) - set(self.model_config.outputs)
        if unknown:
            raise ValueError(
                f"PaiNN cannot produce {sorted(unknown)}; active_outputs must be a subset of "
                f"{sorted(self.model_config.outputs)}."
            )

    # -------------------------------------------------------------- attributes
    @property
    def active_outputs(self) -> tuple[str, ...]:
        """What the model computes now (a constructor argument, so checkpoints keep it)."""
        return tuple(sorted(self.model_config.active_outputs))

    @property
    def dtype(self) -> torch.dtype:
        """Current parameter dtype (follows ``model.to(dtype)``)."""
        return self.embedding.weight.dtype

    @property
    def atomic_energies(self) -> dict[str, float] | None:
        """Reference energies ``{symbol: E0}`` in eV (``None`` when all are zero).

        Keyed by chemical symbol so the value survives JSON (checkpoint specs).
        """
        return _energies_by_symbol(self.e0, self._element_zs)

    @property
    def head_names(self) -> tuple[str, ...]:
        """Names of the readout heads, in index order (the ``head`` field indexes them)."""
        return (self.heads or ("default",))[:1] + tuple(self.head_readouts)

    @property
    def head_params(self) -> dict[str, dict[str, Any]] | None:
        """Reference energies, scale and shift of the heads after the first (``None``: none)."""
        if not self.head_readouts:
            return None
        return {
            name: {
                "atomic_energies": _energies_by_symbol(head.e0, self._element_zs),
                "scale": head.scale,
                "shift": head.shift,
            }
            for name, head in self.head_readouts.items()
        }

    def head_index(self, head: str | int | None) -> int:
        """The index of ``head`` (a name or an index; ``None``: the default head)."""
        names = self.head_names
        if head is None:
            return 0 if self.default_head is None else names.index(self.default_head)
        if isinstance(head, int) and not isinstance(head, bool):
            if 0 <= head < len(names):
                return head
        elif head in names:
            return names.index(head)
        raise ValueError(f"PaiNN has no head {head!r}; its heads are {list(names)}.")

    def add_head(
        self, name: str, copy_from: str | int | None = None, *, make_default: bool = False
    ) -> None:
        """Add a readout head ``name``: a copy of head ``copy_from`` (default: the default head).

        The copy predicts exactly what its original does until it is trained, so a
        fine-tune that adds a head starts from the source model's predictions. The
        new head's parameters are ``head_readouts.<name>.*``. ``make_default=True``
        makes it the head of structures that name none.
        """
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"head names must be non-empty strings without '.'; got {name!r}.")
        if name in self.head_names:
            raise ValueError(f"PaiNN already has a head {name!r} (heads: {list(self.head_names)}).")
        index = self.head_index(copy_from)
        readout, e0 = self._head_parts(index)
        scale, shift = self.get_scale_shift(index)
        self.head_readouts[name] = _Head(copy.deepcopy(readout), e0.detach().clone(), scale, shift)
        self.heads = (*self.head_names[:1], *self.head_readouts)
        if make_default:
            self.default_head = name

    def _head_parts(self, index: int) -> tuple[nn.Module, torch.Tensor]:
        if index == 0:
            return self.readout, self.e0
        head = list(self.head_readouts.values())[index - 1]
        return head.readout, head.e0

    def get_reference_energies(self, head: str | int | None = None) -> dict[int, float]:
        """``{Z: E0}`` in eV of every supported element for ``head`` (0 where unset)."""
        _, e0 = self._head_parts(self.head_index(head))
        values = e0[:-1].detach().cpu().double().tolist()
        return {int(z): float(e) for z, e in zip(self._element_zs.tolist(), values)}

    def set_reference_energies(
        self, values: Mapping[int | str, float], head: str | int | None = None
    ) -> None:
        """Set ``E0`` (eV) of the given elements for ``head``; the others keep theirs."""
        _, e0 = self._head_parts(self.head_index(head))
        rows = {z: i for i, z in enumerate(self._element_zs.tolist())}
        updates = {atomic_number(z): float(v) for z, v in values.items()}
        unknown = sorted(z for z in updates if z not in rows)
        if unknown:
            raise ValueError(
                f"PaiNN was built for elements {sorted(rows)}; cannot set E0 of {unknown}."
            )
        with torch.no_grad():
            for z, value in updates.items():
                e0[rows[z]] = value

    def get_scale_shift(self, head: str | int | None = None) -> tuple[float, float]:
        """``(scale, shift)`` of ``head`` (eV)."""
        index = self.head_index(head)
        if index == 0:
            return self.scale, self.shift
        head_module = list(self.head_readouts.values())[index - 1]
        return head_module.scale, head_module.shift

    def set_scale_shift(self, scale: float, shift: float, head: str | int | None = None) -> None:
        """Set ``scale`` and ``shift`` (eV) of ``head``."""
        index = self.head_index(head)
        target = self if index == 0 else list(self.head_readouts.values())[index - 1]
        target.scale, target.shift = float(scale), float(shift)

    @property
    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        f = self.hidden_channels
        return {"node_embeddings": (f,), "graph_embeddings": (f,)}

    # ------------------------------------------------------------------ model
    def species_index(self, atomic_numbers: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ``atomic_numbers``; raises ``ValueError`` for unsupported ones.

        The check needs a device sync, so it is skipped while training on CUDA (an
        unsupported element then yields a NaN energy through its NaN ``E0``).
        """
        table = self.z_to_index
        index = table.index_select(0, atomic_numbers.clamp(0, table.shape[0] - 1))
        if not (index.is_cuda and self.training):
            unknown = index == self.e0.shape[0] - 1
            if bool(unknown.any()):
                bad = sorted(set(atomic_numbers[unknown].tolist()))
                names = ", ".join(f"{_chemical_symbol(z)} (Z={z})" for z in bad)
                raise ValueError(
                    f"PaiNN was built for elements {self._element_zs.tolist()} and cannot "
                    f"handle {names}. Build it with elements=[...] including them "
                    "(PaiNN.from_data(train_data) uses the elements of the training data)."
                )
        return index

    def node_features(
        self,
        species: torch.Tensor,
        positions: torch.Tensor,
        neighbor_list: torch.Tensor,
        shifts: torch.Tensor | None,
        cell: torch.Tensor | None,
        batch_idx: torch.Tensor,
    ) -> torch.Tensor:
        """Scalar features ``s [V, F]`` after all interaction blocks."""
        vectors = edge_vectors(positions, cell, neighbor_list, shifts, batch_idx)
        return self.features_from_vectors(
            species, vectors, neighbor_list[:, 0], neighbor_list[:, 1]
        )

    def features_from_vectors(
        self,
        species: torch.Tensor,
        vectors: torch.Tensor,
        centers: torch.Tensor,
        neighbors: torch.Tensor,
    ) -> torch.Tensor:
        """Scalar features ``s [V, F]`` from the edge vectors ``r_j - r_i [E, 3]`` of every
        edge ``(centers[e], neighbors[e])``. TorchScript compiles it: the exported model
        (:meth:`atomic_energy_module`) runs this same method."""
        distances = torch.sqrt((vectors * vectors).sum(dim=-1))
        directions = vectors / distances.unsqueeze(-1)
        if self.cutoff_fn == "cosine":
            envelope = _cosine_cutoff(distances, self.cutoff)
        else:
            envelope = _polynomial_cutoff(distances, self.cutoff)
        radial = self.radial_basis(distances) * envelope.unsqueeze(-1)
        norm = 1.0 if self.avg_num_neighbors is None else 1.0 / self.avg_num_neighbors
        s = self.embedding(species)
        v: torch.Tensor | None = None
        for block in self.interactions:
            s, v = block(s, v, radial, directions, centers, neighbors, norm)
        return s

    def atomic_energy(
        self, species: torch.Tensor, features: torch.Tensor, head: Any = 0
    ) -> torch.Tensor:
        """Per-atom energy ``[V]`` in eV from head ``head`` (an index, or per-atom indices)."""
        if isinstance(head, int):
            readout, e0 = self._head_parts(head)
            scale, shift = self.get_scale_shift(head)
            return _head_energy(readout(features), scale, shift, e0, species)
        energies = torch.stack(
            [self.atomic_energy(species, features, h) for h in range(len(self.head_names))], -1
        )
        return energies.gather(-1, head.unsqueeze(-1)).squeeze(-1)

    def _atom_heads(self, data: Any, head: Any, batch_idx: torch.Tensor) -> Any:
        """The head of every atom: one index for all, or ``[V]`` indices from ``data.head``."""
        if head is not None:
            return self.head_index(head)
        per_graph = _get_field(data, "head")
        if per_graph is None:
            return self.head_index(None)
        per_graph = per_graph.reshape(-1).long()
        if len(self.head_names) == 1:
            return 0  # every index but 0 is checked below; one head has nothing to choose
        if not (per_graph.is_cuda and self.training):
            bad = (per_graph < 0) | (per_graph >= len(self.head_names))
            if bool(bad.any()):
                raise ValueError(
                    f"The batch's 'head' field holds {sorted(set(per_graph[bad].tolist()))}, "
                    f"but PaiNN has heads {list(self.head_names)} (indices 0..."
                    f"{len(self.head_names) - 1})."
                )
        return per_graph.to(batch_idx.device).index_select(0, batch_idx)

    def _prepare(self, data: Any) -> dict[str, Any]:
        inputs = self.adapt_input(data)
        batch_idx, num_graphs = graph_layout(data)
        shifts = inputs.get("neighbor_list_shifts")
        cell = inputs.get("cell")
        if "pbc" in inputs and (shifts is None or cell is None):
            missing = [
                k for k, v in (("cell", cell), ("neighbor_list_shifts", shifts)) if v is None
            ]
            raise ValueError(
                f"The input has 'pbc' but no {missing}: periodic systems need the cell and "
                "the lattice shifts of every edge. Compute neighbour lists with "
                "nvalchemi.data.neighbors.compute_neighbors(batch, config=model.model_config."
                "neighbor_config) (it writes neighbor_list and neighbor_list_shifts)."
            )
        if cell is not None:
            cell = cell.to(self.dtype)
            if cell.dim() == 2:
                cell = cell.unsqueeze(0)
        return {
            "species": self.species_index(inputs["atomic_numbers"]),
            "positions": inputs["positions"].to(self.dtype),
            "neighbor_list": inputs["neighbor_list"],
            "shifts": shifts,
            "cell": cell,
            "batch_idx": batch_idx,
            "num_graphs": num_graphs,
        }

    def forward(self, data: Any, head: str | int | None = None, **kwargs: Any):
        """Energy, forces and stress of an ``AtomicData`` or ``Batch`` (active outputs only).

        ``head`` names the readout head for every structure; without it each structure
        uses its ``head`` field (an index into :attr:`head_names`), else the first head.
        """
        x = self._prepare(data)
        active = self.output_data()
        species, batch_idx, num_graphs = x["species"], x["batch_idx"], x["num_graphs"]
        heads = self._atom_heads(data, head, batch_idx)

        per_atom_energies: list[torch.Tensor] = []
        # kept only when asked for: a tensor leaked out of torch.func.grad (the compiled
        # step's derivatives) cannot be read outside it
        keep_atomic = "atomic_energies" in active

        def energy_fn(positions: torch.Tensor, cell: torch.Tensor | None) -> torch.Tensor:
            s = self.node_features(
                species, positions, x["neighbor_list"], x["shifts"], cell, batch_idx
            )
            per_atom = self.atomic_energy(species, s, heads)
            if keep_atomic:
                per_atom_energies.append(per_atom)
            return per_atom.new_zeros(num_graphs).index_add_(0, batch_idx, per_atom)

        result = energy_and_derivatives(
            energy_fn,
            x["positions"],
            x["cell"],
            batch_idx=batch_idx,
            num_graphs=num_graphs,
            compute_forces="forces" in active,
            compute_stress="stress" in active,
            training=self.training,
        )
        if keep_atomic:
            per_atom = per_atom_energies[-1]
            result["atomic_energies"] = per_atom if torch.is_grad_enabled() else per_atom.detach()
        return self.adapt_output(result, data)

    def compute_embeddings(self, data: Any, **kwargs: Any) -> Any:
        """Write ``node_embeddings [V, F]`` and sum-pooled ``graph_embeddings [B, F]``."""
        x = self._prepare(data)
        with torch.no_grad():
            s = self.node_features(
                x["species"],
                x["positions"],
                x["neighbor_list"],
                x["shifts"],
                x["cell"],
                x["batch_idx"],
            )
        graphs = s.new_zeros(x["num_graphs"], s.shape[-1]).index_add_(0, x["batch_idx"], s)
        data["node_embeddings"] = s
        data["graph_embeddings"] = graphs
        return data

    def atomic_energy_module(self, head: str | int | None = None) -> nn.Module:
        """The per-atom energies of ``head`` as a TorchScript-compatible module (the export).

        It shares this model's layers (no copy) and runs :meth:`features_from_vectors`;
        ``forward(positions, atomic_numbers, edge_index, shifts, batch, num_systems)``
        returns ``[N]`` energies in eV from the contract's inputs (see
        :mod:`nvalchemi.models.export`); attributes ``cutoff`` and ``atomic_numbers``.
        """
        return _PaiNNAtomicEnergies(self, self.head_index(head))

    # ------------------------------------------------------------ data fitting
    @staticmethod
    def fit_atomic_energies(data: Any, elements: Sequence[int] | None = None) -> dict[int, float]:
        """Least-squares reference energies ``{Z: E0}``; see :func:`fit_atomic_energies`."""
        return fit_atomic_energies(data, elements)

    @staticmethod
    def fit_scale_shift(
        data: Any, atomic_energies: Mapping[int, float] | None = None
    ) -> tuple[float, float]:
        """``(scale, shift)`` from data statistics; see :func:`fit_scale_shift`."""
        return fit_scale_shift(data, atomic_energies)

    @classmethod
    def from_data(cls, train_data: Any, **kwargs: Any) -> PaiNN:
        """Build a PaiNN whose data-dependent arguments are fitted on ``train_data``.

        ``train_data`` is an ``AtomicData``, a ``Batch``, an ``ase.Atoms``, or an
        iterable/dataset of those (a DataLoader works). Fits ``elements``,
        ``atomic_energies`` (least squares), ``scale`` and ``shift`` unless given in
        ``kwargs``; ``avg_num_neighbors="auto"`` measures the mean neighbour count
        from the neighbour lists the data carries. Every fitted value is an ordinary
        constructor argument.

        Example:
            >>> model = PaiNN.from_data(train_structures, cutoff=5.0)  # doctest: +SKIP
        """
        from nvalchemi.models.statistics import data_elements

        if kwargs.get("elements") is None:
            kwargs["elements"] = data_elements(train_data)
        if kwargs.get("atomic_energies") is None:
            kwargs["atomic_energies"] = fit_atomic_energies(train_data, kwargs["elements"])
        if "scale" not in kwargs or "shift" not in kwargs:
            scale, shift = fit_scale_shift(train_data, kwargs["atomic_energies"])
            kwargs.setdefault("scale", scale)
            kwargs.setdefault("shift", shift)
        if kwargs.get("avg_num_neighbors") == "auto":
            kwargs["avg_num_neighbors"] = mean_num_neighbors(train_data, kwargs.get("cutoff", 5.0))
            if kwargs["avg_num_neighbors"] is None:
                raise ValueError(
                    "avg_num_neighbors='auto' needs neighbour lists on the training data; "
                    "compute them first (nvalchemi.data.neighbors.compute_neighbors)."
                )
        return cls(**kwargs)

    # -------------------------------------------------------------- save/load
    def init_kwargs(self) -> dict[str, Any]:
        """The constructor arguments that rebuild this model (weights not included)."""
        return {
            "cutoff": self.cutoff,
            "hidden_channels": self.hidden_channels,
            "num_interactions": self.num_interactions,
            "num_rbf": self.num_rbf,
            "elements": None if self.elements is None else list(self.elements),
            "atomic_energies": self.atomic_energies,
            "scale": self.scale,
            "shift": self.shift,
            "avg_num_neighbors": self.avg_num_neighbors,
            "cutoff_fn": self.cutoff_fn,
            "dtype": self.dtype,
            "heads": None if self.heads is None else list(self.heads),
            "head_params": self.head_params,
            "default_head": self.default_head,
        }

    def export_model(self, path: str | Path, as_state_dict: bool = False) -> None:
        """Save weights (``as_state_dict=True``) or weights plus constructor arguments,
        loadable without pickle by :meth:`load`."""
        if as_state_dict:
            torch.save(self.state_dict(), Path(path))
            return
        kwargs = self.init_kwargs()
        kwargs["dtype"] = str(kwargs["dtype"]).removeprefix("torch.")
        torch.save({"painn_kwargs": kwargs, "state_dict": self.state_dict()}, Path(path))

    @classmethod
    def load(cls, path: str | Path, map_location: Any = "cpu") -> PaiNN:
        """Rebuild a model written by :meth:`export_model` (``weights_only``, no pickle)."""
        payload = torch.load(Path(path), map_location=map_location, weights_only=True)
        if not isinstance(payload, dict) or "painn_kwargs" not in payload:
            raise ValueError(f"{path} is not a PaiNN export; write it with model.export_model().")
        model = cls(**payload["painn_kwargs"])
        model.load_state_dict(payload["state_dict"])
        return model


def _head_energy(
    readout: torch.Tensor, scale: float, shift: float, e0: torch.Tensor, species: torch.Tensor
) -> torch.Tensor:
    """``E_i = scale * readout_i + shift + E0[Z_i]`` (eV), from the readout's ``[V, 1]``."""
    return readout.squeeze(-1) * scale + shift + e0.index_select(0, species)


class _PaiNNAtomicEnergies(nn.Module):
    """Per-atom energies of one PaiNN head from the export contract's inputs (scriptable).

    Holds the model's own layers (shared, not copied) and runs its
    :meth:`PaiNN.features_from_vectors`; the edge vectors come from the Cartesian
    shifts (``positions[j] - positions[i] + shifts``), so a strain applied to positions
    and shifts by the caller gives the stress.
    """

    def __init__(self, model: PaiNN, head: int) -> None:
        super().__init__()
        self.embedding = model.embedding
        self.radial_basis = model.radial_basis
        self.interactions = model.interactions
        self.readout, e0 = model._head_parts(head)
        self.scale, self.shift = (float(v) for v in model.get_scale_shift(head))
        self.register_buffer("e0", e0.detach().clone())
        self.register_buffer("species_of", model.z_to_index.detach().clone())
        self.cutoff = model.cutoff
        self.cutoff_fn = model.cutoff_fn
        self.avg_num_neighbors = model.avg_num_neighbors
        self.atomic_numbers = [int(z) for z in model._element_zs.tolist()]

    features_from_vectors = PaiNN.features_from_vectors

    def forward(
        self,
        positions: torch.Tensor,
        atomic_numbers: torch.Tensor,
        edge_index: torch.Tensor,
        shifts: torch.Tensor,
        batch: torch.Tensor,
        num_systems: int,
    ) -> torch.Tensor:
        species = self.species_of.index_select(0, atomic_numbers)
        centers, neighbors = edge_index[0], edge_index[1]
        vectors = positions.index_select(0, neighbors) - positions.index_select(0, centers)
        features = self.features_from_vectors(species, vectors + shifts, centers, neighbors)
        return _head_energy(self.readout(features), self.scale, self.shift, self.e0, species)


def _head_names(heads: Sequence[str] | None) -> tuple[str, ...]:
    if heads is None:
        return ("default",)
    if isinstance(heads, str):
        heads = (heads,)
    names = tuple(heads)
    if not names or not all(isinstance(n, str) and n and "." not in n for n in names):
        raise ValueError(f"heads must be non-empty names without '.'; got {heads!r}.")
    if len(set(names)) != len(names):
        raise ValueError(f"heads must be distinct; got {list(names)}.")
    return names


def _energies_by_symbol(e0: torch.Tensor, zs: torch.Tensor) -> dict[str, float] | None:
    """``{symbol: E0}`` of the non-zero rows (``None`` when all are zero), JSON-friendly."""
    values = e0[:-1].detach().cpu().double().tolist()
    if not any(values):
        return None
    return {_chemical_symbol(z): float(e) for z, e in zip(zs.tolist(), values) if e != 0.0}


def _get_field(data: Any, key: str) -> Any:
    if isinstance(data, Mapping):
        return data.get(key)
    return getattr(data, key, None)


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"Unknown dtype {dtype!r}; use e.g. 'float32' or 'float64'.")
        dtype = resolved
    if not dtype.is_floating_point:
        raise ValueError(f"PaiNN dtype must be floating point; got {dtype}.")
    return dtype


def _normalise_elements(elements: Iterable[int] | None) -> list[int]:
    if elements is None:
        return list(range(1, MAX_ATOMIC_NUMBER + 1))
    zs = sorted({int(z) for z in elements})
    bad = [z for z in zs if not 1 <= z <= MAX_ATOMIC_NUMBER]
    if not zs or bad:
        raise ValueError(
            f"elements must be atomic numbers in 1..{MAX_ATOMIC_NUMBER}; got {list(elements)}."
        )
    return zs


def _reference_energies(values: Any, zs: list[int]) -> torch.Tensor:
    """``E0`` per row (``[len(zs) + 1]``, float64); the unknown-element row is NaN."""
    e0 = torch.zeros(len(zs) + 1, dtype=torch.float64)
    e0[-1] = float("nan")
    if values is None:
        return e0
    if isinstance(values, Mapping):
        row = {z: i for i, z in enumerate(zs)}
        by_z = {atomic_number(key): float(energy) for key, energy in values.items()}
        extra = sorted(z for z in by_z if z not in row)
        if extra:
            raise ValueError(
                f"atomic_energies has elements {extra} that are not in elements={zs}; "
                "add them to elements or drop them."
            )
        for z, energy in by_z.items():
            e0[row[z]] = energy
        return e0
    values = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    if values.numel() != len(zs):
        raise ValueError(
            f"atomic_energies has {values.numel()} values but the model has {len(zs)} "
            "elements; give one per element (in the order of elements) or a {Z: E0} mapping."
        )
    e0[:-1] = values
    return e0
