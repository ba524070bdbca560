"""Rank side of the distributed non-finite policy test (run as a script, one process per rank).

Each rank trains its own copy of a one-parameter model (no DDP) under a 2-process gloo
group; only rank 1 sees a NaN loss. Reports what ``nonfinite_loss="raise"`` and
``"skip"`` did on this rank.
"""

from __future__ import annotations

import torch
from _ranks import init_group, report, teardown

from nvalchemi.data import AtomicData, Batch
from nvalchemi.training import EnergyMSELoss, OptimizerConfig, TrainingStrategy
from nvalchemi.training.errors import NonFiniteLossError


class Model(torch.nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, batch):
        energy = batch.energy * self.w
        if self.rank == 1 and batch.num_graphs == 3:
            energy = energy * float("nan")
        return {"energy": energy}


def batches() -> list[Batch]:
    out = []
    for n in (2, 2, 3, 2):
        out.append(
            Batch.from_data_list(
                [
                    AtomicData(
                        atomic_numbers=torch.ones(2, dtype=torch.long),
                        positions=torch.zeros(2, 3),
                        energy=torch.ones(1, 1),
                    )
                    for _ in range(n)
                ]
            )
        )
    return out


def strategy(rank: int, policy: str) -> TrainingStrategy:
    return TrainingStrategy(
        models=Model(rank),
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        loss_fn=EnergyMSELoss(),
        num_epochs=1,
        nonfinite_loss=policy,
    )


def main() -> None:
    rank = init_group()
    raised = None
    try:
        strategy(rank, "raise").run(batches())
    except NonFiniteLossError as exc:
        raised = {"step": exc.step, "components": exc.components}
    skipping = strategy(rank, "skip")
    skipping.run(batches())
    report(rank=rank, raised=raised, skip_counts=[skipping.step_count, skipping.batch_count])
    teardown()


if __name__ == "__main__":
    main()
