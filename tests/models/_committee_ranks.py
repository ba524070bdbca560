"""Rank side of the committee DDP test (``python _committee_ranks.py <out_dir>``).

Both ranks train a bootstrapped committee for two SGD steps under ``DDPHook`` (each on
its shard of every batch) and save the weights; rank 0 also trains the same committee
in one process on the union batches (no DDP) as the reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from _ranks import report

STEPS = 2


def _setup():
    from _ddp_worker import CUTOFF, structures

    from nvalchemi.app.committee import committee_loss
    from nvalchemi.models import PaiNN
    from nvalchemi.models.committee import Committee
    from nvalchemi.spec import create_model_spec
    from nvalchemi.training import EnergyMSELoss, ForceMSELoss, OptimizerConfig

    member = create_model_spec(
        PaiNN,
        cutoff=CUTOFF,
        hidden_channels=8,
        num_interactions=1,
        num_rbf=4,
        elements=[13, 28, 29, 46, 47, 78, 79],
    )
    train, _ = structures()
    model = Committee([member], size=2, seed=11, bootstrap=True)
    loss = committee_loss(EnergyMSELoss() + 10.0 * ForceMSELoss(), 2)
    return model, loss, OptimizerConfig(torch.optim.SGD, {"lr": 0.05}), train[:8]


def _loader(train, batch_size):
    from nvalchemi.data.datapipes import DataLoader, InMemoryDataset

    return DataLoader(InMemoryDataset(data_list=train), batch_size=batch_size, shuffle=False)


def main(out: Path) -> None:
    import os

    from nvalchemi.training import TrainingStrategy
    from nvalchemi.training.hooks import DDPHook

    rank = int(os.environ["RANK"])
    wrapped = []

    class Probe:
        frequency = 1
        stage = None

        def _runs_on_stage(self, stage):
            from nvalchemi.training import TrainingStage

            return stage is TrainingStage.BEFORE_TRAINING

        def __call__(self, ctx, stage):
            wrapped.append(type(ctx.workflow.models["main"]).__name__)

    model, loss, optimizer, train = _setup()
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=optimizer,
        loss_fn=loss,
        num_steps=STEPS,
        hooks=[DDPHook(backend="gloo"), Probe()],
    )
    # Batches of 2 per rank from a DistributedSampler: step s trains rank r on structures
    # 4s + r and 4s + r + 2, so the union of a step is structures 4s .. 4s + 3.
    strategy.run(_loader(train, 2))
    torch.save(model.state_dict(), out / f"rank{rank}.pt")
    if rank == 0:
        single, loss, optimizer, _ = _setup()
        TrainingStrategy(
            models=single, optimizer_configs=optimizer, loss_fn=loss, num_steps=STEPS
        ).run(_loader(train, 4))
        torch.save(single.state_dict(), out / "single.pt")
    report(rank=rank, wrapped=wrapped[0] if wrapped else None)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
