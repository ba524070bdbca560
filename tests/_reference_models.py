"""Two potentials whose MD behaviour is known, as BaseModelMixin models (for MD tests).

* :class:`EMTModel`: ASE's EMT (the potential that labelled the bundled data), run per
  structure through ASE: physically sound, so relaxations converge and MD stays stable.
* :class:`AttractionOnlyModel`: a Gaussian attraction between every pair and no repulsion
  at all, so atoms fall onto each other: MD with it must be flagged unstable.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from nvalchemi.models._utils import energy_and_derivatives, graph_layout
from nvalchemi.models.base import BaseModelMixin, ModelConfig, NeighborConfig


class EMTModel(nn.Module, BaseModelMixin):
    """ASE's EMT for energies, forces and stress (not differentiable; float64 results)."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros((), dtype=torch.float64))  # gives a dtype/device
        self.model_config = ModelConfig(
            outputs={"energy", "forces", "stress"}, optional_inputs={"cell", "pbc"}
        )

    embedding_shapes: dict = {}

    def compute_embeddings(self, data: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward(self, data: Any, **kwargs: Any):
        from ase import Atoms
        from ase.calculators.emt import EMT

        batch_idx, num_graphs = graph_layout(data)
        positions = data["positions"].detach().double().cpu().numpy()
        numbers = data["atomic_numbers"].cpu().numpy()
        owner = batch_idx.cpu().numpy()
        cells = data["cell"].reshape(-1, 3, 3).double().cpu().numpy() if "cell" in data else None
        pbcs = data["pbc"].reshape(-1, 3).cpu().numpy() if "pbc" in data else None
        active = self.output_data()
        energies, forces, stresses = [], np.zeros_like(positions), np.zeros((num_graphs, 3, 3))
        for g in range(num_graphs):
            mask = owner == g
            atoms = Atoms(numbers=numbers[mask], positions=positions[mask])
            if cells is not None and pbcs[g].any():
                atoms.cell, atoms.pbc = cells[g], pbcs[g]
            atoms.calc = EMT()
            energies.append(atoms.get_potential_energy())
            if "forces" in active:
                forces[mask] = atoms.get_forces()
            if "stress" in active and atoms.pbc.any():
                stresses[g] = atoms.get_stress(voigt=False)
        like = self.anchor
        out = {"energy": torch.tensor(energies, dtype=like.dtype).reshape(-1, 1)}
        if "forces" in active:
            out["forces"] = torch.as_tensor(forces, dtype=like.dtype)
        if "stress" in active:
            out["stress"] = torch.as_tensor(stresses, dtype=like.dtype)
        return self.adapt_output({k: v.to(like.device) for k, v in out.items()}, data)


class AttractionOnlyModel(nn.Module, BaseModelMixin):
    """``E = -depth * sum_pairs exp(-(r / width)^2)``: nothing keeps atoms apart."""

    def __init__(self, depth: float = 1.0, width: float = 2.0, cutoff: float = 5.0) -> None:
        super().__init__()
        self.depth, self.width = depth, width
        self.anchor = nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.model_config = ModelConfig(
            outputs={"energy", "forces"},
            autograd_outputs={"forces"},
            optional_inputs={"cell", "pbc", "neighbor_list_shifts"},
            supports_pbc=True,
            neighbor_config=NeighborConfig(cutoff=cutoff),
        )

    embedding_shapes: dict = {}

    def compute_embeddings(self, data: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward(self, data: Any, **kwargs: Any):
        from nvalchemi.data.neighbors import edge_vectors

        inputs = self.adapt_input(data)
        batch_idx, num_graphs = graph_layout(data)
        pairs = inputs["neighbor_list"]
        shifts = inputs.get("neighbor_list_shifts")
        cell = inputs.get("cell")

        def energy_fn(positions: torch.Tensor, _cell: Any) -> torch.Tensor:
            vectors = edge_vectors(positions, cell, pairs, shifts, batch_idx)
            pair_energy = -0.5 * self.depth * torch.exp(-((vectors.norm(dim=1) / self.width) ** 2))
            owner = batch_idx.index_select(0, pairs[:, 0])
            return pair_energy.new_zeros(num_graphs).index_add(0, owner, pair_energy)

        out = energy_and_derivatives(
            energy_fn,
            inputs["positions"].to(self.anchor.dtype),
            batch_idx=batch_idx,
            num_graphs=num_graphs,
            compute_forces="forces" in self.output_data(),
        )
        return self.adapt_output(out, data)
