"""Shared fixtures-as-functions for the strategy, validation and update-hook tests.

Import as ``from _training_support import ...`` (pytest puts this directory on the path).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nvalchemi.data import AtomicData, Batch
from nvalchemi.training import (
    EnergyMSELoss,
    ForceMSELoss,
    OptimizerConfig,
    TrainingStage,
    TrainingStrategy,
)

ALL_STAGES = tuple(TrainingStage)


def make_batch(
    num_structures: int = 2,
    atoms: int = 3,
    *,
    seed: int = 0,
    energy_dtype: torch.dtype = torch.float32,
    stress: bool = False,
) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    structures = []
    for _ in range(num_structures):
        fields: dict[str, Any] = {
            "atomic_numbers": torch.randint(1, 5, (atoms,), generator=generator),
            "positions": torch.randn(atoms, 3, generator=generator),
            "energy": torch.randn(1, 1, generator=generator).to(energy_dtype),
            "forces": torch.randn(atoms, 3, generator=generator),
        }
        if stress:
            fields["cell"] = 5.0 * torch.eye(3).unsqueeze(0)
            fields["pbc"] = torch.ones(1, 3, dtype=torch.bool)
            fields["stress"] = torch.randn(1, 3, 3, generator=generator)
        structures.append(AtomicData(**fields))
    return Batch.from_data_list(structures)


def make_batches(n: int = 3, **kwargs: Any) -> list[Batch]:
    return [make_batch(seed=i, **kwargs) for i in range(n)]


class TinyModel(nn.Module):
    """Energy from a per-atom MLP, forces by autograd; optional stress head."""

    def __init__(self, hidden: int = 8, stress: bool = False) -> None:
        super().__init__()
        self.hidden = hidden
        self.stress = stress
        self.embedding = nn.Embedding(8, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden + 3, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        if stress:
            self.stress_head = nn.Parameter(torch.zeros(3, 3))

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        with torch.enable_grad():  # forces need autograd even under no_grad (validation)
            positions = batch.positions.detach().requires_grad_(True)
            features = torch.cat([self.embedding(batch.atomic_numbers), positions], dim=-1)
            atom_energy = self.mlp(features).squeeze(-1)
            energy = atom_energy.new_zeros(batch.num_graphs).index_add(
                0, batch.batch_idx, atom_energy
            )
            (grad,) = torch.autograd.grad(energy.sum(), positions, create_graph=self.training)
        out = {"energy": energy.unsqueeze(-1), "forces": -grad}
        if self.stress:
            out["stress"] = (energy.reshape(-1, 1, 1) * self.stress_head).expand(-1, 3, 3)
        return out


class Recorder:
    """Hook recording ``(stage name, step_count, ...)`` at every stage except the DO slots."""

    frequency = 1
    stage = None

    def __init__(self, stages: tuple[TrainingStage, ...] | None = None) -> None:
        self.stages = stages
        self.events: list[tuple[str, int]] = []
        self.snapshots: list[dict[str, Any]] = []

    def _runs_on_stage(self, stage: TrainingStage) -> bool:
        if stage in (TrainingStage.DO_BACKWARD, TrainingStage.DO_OPTIMIZER_STEP):
            return False
        return self.stages is None or stage in self.stages

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        self.events.append((stage.name, ctx.step_count))
        self.snapshots.append(
            {
                "stage": stage.name,
                "step": ctx.step_count,
                "batch_count": ctx.batch_count,
                "epoch": ctx.epoch,
                "epoch_step": ctx.epoch_step_count,
                "loss": ctx.loss,
                "loss_requires_grad": None if ctx.loss is None else ctx.loss.requires_grad,
                "predictions": ctx.predictions,
                "validation": ctx.validation,
            }
        )

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


class StageHook:
    """A hook at one stage that calls ``fn(ctx)``."""

    def __init__(self, stage: TrainingStage, fn=None, frequency: int = 1) -> None:
        self.stage = stage
        self.frequency = frequency
        self.fn = fn
        self.calls: list[int] = []

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        self.calls.append(ctx.step_count)
        if self.fn is not None:
            self.fn(ctx)


def adam(lr: float = 1e-2, **kwargs: Any) -> OptimizerConfig:
    return OptimizerConfig(torch.optim.Adam, {"lr": lr}, **kwargs)


def strategy(model: nn.Module | None = None, **overrides: Any) -> TrainingStrategy:
    kwargs: dict[str, Any] = {
        "models": model if model is not None else TinyModel(),
        "optimizer_configs": adam(),
        "loss_fn": EnergyMSELoss() + ForceMSELoss(),
        "num_epochs": 1,
    }
    kwargs.update(overrides)
    if "num_steps" in overrides and "num_epochs" not in overrides:
        kwargs["num_epochs"] = None
    return TrainingStrategy(**kwargs)


def energy_training_fn(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """Module-level (importable) training function used by spec round-trip tests."""
    return {"predicted_energy": model(batch)["energy"]}
