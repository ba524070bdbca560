"""Small models, batches and recording hooks shared by the update-hook tests.

Load by path (not a test module)::

    support = load_support()
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
from nvalchemi.training.hooks.update import TrainingUpdateHook


def make_structures(n: int, atoms: int = 3, *, seed: int = 0, scale: float = 1.0) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [
        AtomicData(
            atomic_numbers=torch.randint(1, 5, (atoms,), generator=generator),
            positions=torch.randn(atoms, 3, generator=generator),
            energy=scale * torch.randn(1, 1, generator=generator),
            forces=torch.randn(atoms, 3, generator=generator),
        )
        for _ in range(n)
    ]


def make_batches(n: int = 4, size: int = 2, atoms: int = 3, *, seed: int = 0) -> list[Batch]:
    return [Batch.from_data_list(make_structures(size, atoms, seed=seed + i)) for i in range(n)]


class ForceMLP(nn.Module):
    """Per-atom MLP energy summed per structure; forces = -dE/dr by autograd."""

    def __init__(self, hidden: int = 16, norm: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(8, hidden)
        layers: list[nn.Module] = [nn.Linear(hidden + 3, hidden), nn.SiLU()]
        if norm:
            layers.append(nn.LayerNorm(hidden))
        layers += [nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1)]
        self.mlp = nn.Sequential(*layers)

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        positions = batch.positions.detach().requires_grad_(True)
        with torch.enable_grad():
            features = torch.cat([self.embedding(batch.atomic_numbers), positions], dim=-1)
            atom_energy = self.mlp(features).squeeze(-1)
            energy = atom_energy.new_zeros(batch.num_graphs).index_add(
                0, batch.batch_idx, atom_energy
            )
            (grad,) = torch.autograd.grad(energy.sum(), positions, create_graph=self.training)
        return {"energy": energy.unsqueeze(-1), "forces": -grad}


def sgd(lr: float = 0.05) -> OptimizerConfig:
    return OptimizerConfig(torch.optim.SGD, {"lr": lr})


def adam(lr: float = 1e-2) -> OptimizerConfig:
    return OptimizerConfig(torch.optim.Adam, {"lr": lr})


def make_strategy(model: nn.Module | None = None, **overrides: Any) -> TrainingStrategy:
    kwargs: dict[str, Any] = {
        "models": model if model is not None else ForceMLP(),
        "optimizer_configs": sgd(),
        "loss_fn": EnergyMSELoss() + ForceMSELoss(),
        "num_steps": 4,
    }
    kwargs.update(overrides)
    if "num_epochs" in overrides:
        kwargs["num_steps"] = None
    return TrainingStrategy(**kwargs)


class StageHook:
    """A plain hook calling ``fn(ctx)`` at one stage."""

    def __init__(self, stage: TrainingStage, fn: Any, frequency: int = 1) -> None:
        self.stage, self.fn, self.frequency = stage, fn, frequency

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        self.fn(ctx)


class Veto(TrainingUpdateHook):
    """Update hook vetoing ``DO_OPTIMIZER_STEP`` on the given 0-based batch indices."""

    def __init__(self, batches: set[int], priority: int = 45) -> None:
        self.batches = set(batches)
        self.priority = priority
        self.seen = 0

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, Any]:
        if stage is TrainingStage.DO_OPTIMIZER_STEP:
            veto = self.seen in self.batches
            self.seen += 1
            return not veto, ctx.loss
        return True, ctx.loss


class GradProbe(TrainingUpdateHook):
    """Snapshot gradients (and ``ctx.grad_norm``) at ``DO_OPTIMIZER_STEP`` when not vetoed."""

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.grads: list[list[torch.Tensor]] = []
        self.norms: list[Any] = []

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, Any]:
        if stage is TrainingStage.DO_OPTIMIZER_STEP and not will_skip:
            params = [p for o in ctx.optimizers for g in o.param_groups for p in g["params"]]
            self.grads.append([p.grad.detach().clone() for p in params])
            self.norms.append(ctx.grad_norm)
        return True, ctx.loss


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]
