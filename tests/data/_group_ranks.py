"""Rank side of the group-balanced sampler DDP test (two gloo ranks).

Each rank trains one epoch with ``DDPHook`` over nvalchemi's ``DataLoader`` whose sampler,
a ``GroupBalancedSampler``, was built before the process group existed: it must shard
itself over the two ranks. Every structure's energy label is its index / 1000, so a rank
reports exactly which structures it saw.
"""

from __future__ import annotations

import os

import torch
from _ranks import report
from torch import nn

GROUPS = ["bulk"] * 40 + ["slab"] * 6 + ["cluster"] * 2
ALPHA = 0.0
SEED = 3
BATCH = 4


def structures() -> list:
    from nvalchemi.data import AtomicData

    return [
        AtomicData(
            atomic_numbers=torch.full((2 + i % 3,), 1 + i % 3),
            positions=torch.zeros(2 + i % 3, 3),
            energy=torch.full((1, 1), i / 1000.0),
        )
        for i in range(len(GROUPS))
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
    frequency = 1

    def __init__(self) -> None:
        from nvalchemi.training import TrainingStage

        self.stage = TrainingStage.BEFORE_FORWARD
        self.labels: list[list[int]] = []
        self.sampler = None
        self.world = None

    def __call__(self, ctx, stage) -> None:
        self.labels.append([round(1000 * e) for e in ctx.batch.energy.reshape(-1).tolist()])
        self.sampler = ctx.workflow.active_dataloader.sampler
        self.world = (self.sampler.num_replicas, self.sampler.rank)  # while DDP runs


def main() -> None:
    from nvalchemi.data.datapipes import DataLoader, GroupBalancedSampler, InMemoryDataset
    from nvalchemi.training import EnergyMSELoss, OptimizerConfig, TrainingStrategy
    from nvalchemi.training.hooks import DDPHook

    rank = int(os.environ["RANK"])
    dataset = InMemoryDataset(data_list=structures())
    sampler = GroupBalancedSampler(GROUPS, alpha=ALPHA, seed=SEED)  # before DDP starts
    loader = DataLoader(dataset, sampler=sampler, batch_size=BATCH)
    seen = Seen()
    strategy = TrainingStrategy(
        models=Energy(),
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 1e-6}),
        loss_fn=EnergyMSELoss(),
        num_epochs=2,
        hooks=[DDPHook(backend="gloo"), seen],
    )
    strategy.run(loader)
    report(
        rank=rank,
        labels=seen.labels,
        same_sampler=seen.sampler is sampler,
        replicas=seen.world[0],
        sampler_rank=seen.world[1],
    )


if __name__ == "__main__":
    main()
