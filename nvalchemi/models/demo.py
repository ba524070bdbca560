"""A tiny, fast, non-physical model for tests and examples.

``DemoModel`` embeds species and raw coordinates, mixes them in an MLP and sums a
per-atom energy; forces are ``-dE/dr``. It is neither translation nor rotation
invariant, so use :class:`nvalchemi.models.PaiNN` for anything physical.

Example:
    >>> import torch
    >>> from nvalchemi.data import AtomicData, Batch
    >>> model = DemoModelWrapper(DemoModel(num_atom_types=10, hidden_dim=8))
    >>> data = AtomicData(atomic_numbers=torch.tensor([1, 8, 1]), positions=torch.randn(3, 3))
    >>> out = model(Batch.from_data_list([data, data]))
    >>> out["energy"].shape, out["forces"].shape
    (torch.Size([2, 1]), torch.Size([6, 3]))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvalchemi.models._utils import energy_and_derivatives, graph_layout
from nvalchemi.models.base import BaseModelMixin, ModelConfig

__all__ = ["DemoModel", "DemoModelWrapper"]


class DemoModel(nn.Module):
    """Species + coordinate embeddings, a joint MLP and a linear energy projection.

    Parameters live under ``embedding`` (the species table), ``coord_embedding``,
    ``joint_mlp`` and ``projection`` (fine-tuning tests freeze or patch them by these
    names). Weights saved before the species table was named ``embedding`` (under
    ``species_embedding``) still load: their keys are renamed on load.

    Args:
        num_atom_types: size of the species table (atomic numbers ``< num_atom_types``).
        hidden_dim: width ``H`` of every hidden layer.
    """

    def __init__(self, num_atom_types: int = 100, hidden_dim: int = 64) -> None:
        super().__init__()
        self.num_atom_types = num_atom_types
        self.hidden_dim = hidden_dim
        self.embedding = nn.Embedding(num_atom_types, hidden_dim, padding_idx=0)
        self.coord_embedding = nn.Sequential(
            nn.Linear(3, hidden_dim, bias=False), nn.LayerNorm(hidden_dim), nn.SiLU()
        )
        self.joint_mlp = nn.Sequential(
            nn.Linear(2 * hidden_dim, hidden_dim),
            nn.LayerNorm(hidden_dim),
            nn.SiLU(),
            nn.Linear(hidden_dim, hidden_dim),
        )
        self.projection = nn.Linear(hidden_dim, 1)
        self.register_load_state_dict_pre_hook(_rename_species_table)

    def node_features(self, atomic_numbers: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Per-atom features ``[V, H]``."""
        species = self.embedding(atomic_numbers)
        coords = self.coord_embedding(positions)
        return species + coords + self.joint_mlp(torch.cat([species, coords], dim=-1))

    def forward(
        self,
        atomic_numbers: torch.Tensor,
        positions: torch.Tensor,
        batch_indices: torch.Tensor | None = None,
        compute_forces: bool = True,
        num_graphs: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Energy ``[B, 1]`` and (optionally) forces ``[V, 3]``.

        ``num_graphs`` avoids a device sync; without it ``B = max(batch_indices) + 1``.
        """
        if batch_indices is None:
            batch_indices = torch.zeros_like(atomic_numbers)
            num_graphs = 1
        elif num_graphs is None:
            num_graphs = int(batch_indices.max()) + 1 if batch_indices.numel() else 0

        def energy_fn(pos: torch.Tensor, _cell: torch.Tensor | None) -> torch.Tensor:
            atom_energy = self.projection(self.node_features(atomic_numbers, pos)).squeeze(-1)
            energy = atom_energy.new_zeros(num_graphs)
            return energy.index_add(0, batch_indices, atom_energy)

        return energy_and_derivatives(
            energy_fn,
            positions,
            batch_idx=batch_indices,
            num_graphs=num_graphs,
            compute_forces=compute_forces,
            training=self.training,
        )


_OLD_TABLE = "species_embedding."


def _rename_species_table(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    """Load weights saved under the table's former name (``species_embedding``)."""
    old = prefix + _OLD_TABLE
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[prefix + "embedding." + key[len(old) :]] = state_dict.pop(key)


class DemoModelWrapper(nn.Module, BaseModelMixin):
    """``DemoModel`` behind the model contract: energy and forces, no PBC, no neighbours.

    Args:
        model: the wrapped ``DemoModel`` (stored as ``self.model``).
    """

    def __init__(self, model: DemoModel) -> None:
        super().__init__()
        self.model = model
        self.model_config = ModelConfig(
            outputs={"energy", "forces"},
            autograd_outputs={"forces"},
            autograd_inputs={"positions"},
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.projection.weight.dtype

    @property
    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        h = self.model.hidden_dim
        return {"node_embeddings": (h,), "graph_embeddings": (h,)}

    def _check_species(self, atomic_numbers: torch.Tensor) -> None:
        """Atomic numbers must index the species table; 0 is its padding row."""
        if atomic_numbers.is_cuda and self.training:
            return  # the check syncs; keep the training step sync-free (as MACEWrapper)
        n = self.model.num_atom_types
        bad = (atomic_numbers < 1) | (atomic_numbers >= n)
        if bool(bad.any()):
            values = sorted(set(atomic_numbers[bad].tolist()))
            raise ValueError(
                f"DemoModel(num_atom_types={n}) handles atomic numbers 1..{n - 1}; got Z values "
                f"{values} (0 is the padding index). Build DemoModel(num_atom_types="
                f"{max(n, max(values) + 1)}) or remove those atoms."
            )

    def adapt_input(self, data: Any, **kwargs: Any) -> dict[str, Any]:
        inputs = super().adapt_input(data, **kwargs)
        self._check_species(inputs["atomic_numbers"])
        batch_idx, num_graphs = graph_layout(data)
        inputs["positions"] = inputs["positions"].to(self.dtype)
        inputs["batch_indices"] = batch_idx
        inputs["num_graphs"] = num_graphs
        inputs["compute_forces"] = "forces" in self.output_data()
        return inputs

    def forward(self, data: Any, **kwargs: Any):
        inputs = self.adapt_input(data, **kwargs)
        raw = self.model(
            inputs["atomic_numbers"],
            inputs["positions"],
            batch_indices=inputs["batch_indices"],
            compute_forces=inputs["compute_forces"],
            num_graphs=inputs["num_graphs"],
        )
        return self.adapt_output(raw, data)

    def adapt_output(self, model_output: Any, data: Any):
        out = super().adapt_output(model_output, data)
        missing = [k for k, v in out.items() if v is None]
        if missing:
            raise KeyError(f"DemoModel did not produce the active outputs {missing}.")
        return out

    def compute_embeddings(self, data: Any, **kwargs: Any) -> Any:
        """Write ``node_embeddings [V, H]`` and sum-pooled ``graph_embeddings [B, H]``."""
        batch_idx, num_graphs = graph_layout(data)
        positions = data["positions"].to(self.dtype)
        self._check_species(data["atomic_numbers"])
        nodes = self.model.node_features(data["atomic_numbers"], positions)
        graphs = nodes.new_zeros(num_graphs, nodes.shape[-1]).index_add(0, batch_idx, nodes)
        data["node_embeddings"] = nodes
        data["graph_embeddings"] = graphs
        return data

    def export_model(self, path: str | Path, as_state_dict: bool = False) -> None:
        """Save the inner model's weights; with ``as_state_dict=False`` also its
        constructor arguments, so :meth:`from_checkpoint` can rebuild it without pickle."""
        state = self.model.state_dict()
        if as_state_dict:
            torch.save(state, Path(path))
            return
        kwargs = {"num_atom_types": self.model.num_atom_types, "hidden_dim": self.model.hidden_dim}
        torch.save({"model_kwargs": kwargs, "state_dict": state}, Path(path))

    @classmethod
    def from_checkpoint(cls, path: str | Path, map_location: Any = "cpu") -> DemoModelWrapper:
        """Rebuild from a file written by ``export_model(path)`` (safe: ``weights_only``)."""
        payload = torch.load(Path(path), map_location=map_location, weights_only=True)
        if not isinstance(payload, dict) or "model_kwargs" not in payload:
            raise ValueError(
                f"{path} is not a DemoModelWrapper export; write it with "
                "export_model(path) (as_state_dict=False)."
            )
        model = DemoModel(**payload["model_kwargs"])
        model.load_state_dict(payload["state_dict"])
        return cls(model)
