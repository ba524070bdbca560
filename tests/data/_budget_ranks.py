"""Rank side of the budget-sampler DDP test (``python _budget_ranks.py``, two gloo ranks).

Each rank trains one epoch with ``DDPHook`` over nvalchemi's ``DataLoader`` built with
a ``BudgetBatchSampler`` for one process; the hook must install the sampler's copy for
its rank. Every structure's energy label is its index / 1000, so a rank reports exactly which
structures it saw, and the atoms of each of its steps.
"""

from __future__ import annotations

import os

import torch
from _ranks import report
from torch import nn

MAX_ATOMS = 600


def sizes() -> list[int]:
    """Atom counts: a spread of small cells and a few 200-500-atom slabs (fixed)."""
    small = [4, 8, 12, 16, 20, 27, 32, 36, 48, 55] * 12
    slabs = [216, 288, 360, 432, 500, 240]
    return small + slabs


def structures() -> list:
    from nvalchemi.data import AtomicData

    return [
        AtomicData(
            atomic_numbers=torch.full((n,), 1 + i % 3),
            positions=torch.zeros(n, 3),
            energy=torch.full((1, 1), i / 1000.0),
        )
        for i, n in enumerate(sizes())
    ]


class Energy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, batch):
        atom = self.head(self.embedding(batch.atomic_numbers)).squeeze(-1)
        energy = atom.new_zeros(batch.num_graphs).index_add(0, batch.batch_idx, atom)
        return {"energy": energy.unsqueeze(-1)}


class Seen:
    """Records the structures (energy labels) and atoms of every batch this rank trains on."""

    frequency = 1

    def __init__(self) -> None:
        from nvalchemi.training import TrainingStage

        self.stage = TrainingStage.BEFORE_FORWARD
        self.labels: list[int] = []
        self.atoms: list[int] = []
        self.sampler = None

    def __call__(self, ctx, stage) -> None:
        self.labels.extend(round(1000 * e) for e in ctx.batch.energy.reshape(-1).tolist())
        self.atoms.append(int(ctx.batch.num_nodes))
        self.sampler = ctx.workflow.active_dataloader.batch_sampler


def main() -> None:
    from nvalchemi.data.datapipes import BudgetBatchSampler, DataLoader, InMemoryDataset
    from nvalchemi.training import EnergyMSELoss, OptimizerConfig, TrainingStrategy
    from nvalchemi.training.hooks import DDPHook

    rank = int(os.environ["RANK"])
    dataset = InMemoryDataset(data_list=structures())
    loader = DataLoader(dataset, batch_sampler=BudgetBatchSampler(dataset, max_atoms=MAX_ATOMS))
    seen = Seen()
    strategy = TrainingStrategy(
        models=Energy(),
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 1e-6}),
        loss_fn=EnergyMSELoss(),
        num_epochs=1,
        hooks=[DDPHook(backend="gloo"), seen],
    )
    strategy.run(loader)
    report(
        rank=rank,
        labels=seen.labels,
        atoms=seen.atoms,
        sampler_rank=seen.sampler.rank,
        sampler_replicas=seen.sampler.num_replicas,
        batches=len(seen.atoms),
    )


if __name__ == "__main__":
    main()
