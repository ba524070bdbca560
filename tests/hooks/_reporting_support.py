"""Hand-built training contexts for the reporting tests (the training loop is not needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from nvalchemi.hooks.context import TrainContext


class FakeBatch:
    """Only what reporting reads from a batch: its size."""

    def __init__(self, num_graphs: int = 4, atoms_per_graph: int = 8) -> None:
        self.num_graphs = num_graphs
        self.num_nodes = num_graphs * atoms_per_graph


def composed_losses(energy: float, forces: float, *, weights=(1.0, 10.0)) -> dict[str, Any]:
    """A ComposedLossOutput-like mapping with two components named like the loss classes."""
    e, f = torch.tensor(energy), torch.tensor(forces)
    return {
        "total_loss": weights[0] * e + weights[1] * f,
        "per_component_unweighted": {"EnergyMSELoss": e, "ForceMSELoss": f},
        "per_component_weight": {"EnergyMSELoss": weights[0], "ForceMSELoss": weights[1]},
        "per_component_raw_weight": {"EnergyMSELoss": weights[0], "ForceMSELoss": weights[1]},
        "per_component_sample": {
            "EnergyMSELoss": torch.full((4,), energy),
            "ForceMSELoss": torch.full((4,), forces),
        },
    }


def make_optimizer(lr: float = 1e-3, *, scheduler: bool = True):
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=lr)
    sched = (
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5) if scheduler else None
    )
    return optimizer, sched


def make_ctx(
    *,
    step: int = 0,
    epoch: int = 0,
    batches_per_epoch: int = 4,
    num_epochs: int | None = 2,
    num_steps: int | None = None,
    energy: float = 0.5,
    forces: float = 0.1,
    global_rank: int = 0,
    with_scheduler: bool = True,
) -> TrainContext:
    """A context as the strategy shows it at AFTER_OPTIMIZER_STEP (counters pre-increment)."""
    optimizer, scheduler = make_optimizer(scheduler=with_scheduler)
    workflow = SimpleNamespace(
        active_dataloader=list(range(batches_per_epoch)),
        num_epochs=num_epochs,
        num_steps=num_steps,
    )
    losses = composed_losses(energy, forces)
    return TrainContext(
        batch=FakeBatch(),
        step_count=step,
        global_step_count=step,
        batch_count=step,
        epoch_step_count=step % batches_per_epoch,
        epoch=epoch,
        loss=losses["total_loss"],
        losses=losses,
        optimizers=[optimizer],
        lr_schedulers=[scheduler],
        workflow=workflow,
        global_rank=global_rank,
    )


def advance(ctx: TrainContext, *, batches_per_epoch: int = 4, energy=None, forces=None) -> None:
    """Move ``ctx`` to the next batch (as the strategy's AFTER_BATCH counter update does)."""
    ctx.step_count += 1
    ctx.global_step_count += 1
    ctx.batch_count += 1
    ctx.epoch_step_count += 1
    if ctx.epoch_step_count >= batches_per_epoch:
        ctx.epoch += 1
        ctx.epoch_step_count = 0
    if energy is not None:
        ctx.losses = composed_losses(energy, forces if forces is not None else 0.1)
        ctx.loss = ctx.losses["total_loss"]


def validation_summary(loss: float = 0.4, forces_mae: float = 0.05) -> dict[str, Any]:
    """A validation summary shaped like the strategy's ``last_validation``."""
    return {
        "name": "validation",
        "total_loss": torch.tensor(loss, dtype=torch.float64),
        "per_component_unweighted": {
            "EnergyMSELoss": torch.tensor(loss / 2, dtype=torch.float64),
            "ForceMSELoss": torch.tensor(loss / 20, dtype=torch.float64),
        },
        "per_component_weight": {"EnergyMSELoss": 1.0, "ForceMSELoss": 10.0},
        "num_batches": 3,
        "per_component_sample_count": {"EnergyMSELoss": 12, "ForceMSELoss": 12},
        "model_source": "live",
        "ema_model_keys": [],
        "precision": "float32",
        "distributed_reduced": False,
        "energy_mae_per_atom": 0.002,
        "forces_mae": forces_mae,
        "forces_rmse": forces_mae * 1.3,
    }
