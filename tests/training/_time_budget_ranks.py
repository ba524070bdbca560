"""One rank of the skewed time-budget test: tiny DDP training with this rank's own budget.

Rank 1's budget is spent at once, rank 0's never: every rank must still stop at the
same optimizer step (the first agreement, step ``CHECK``) and leave ``run()`` normally.
"""

from __future__ import annotations

import gc

import torch
from _ranks import report

CHECK = 3

if __name__ == "__main__":
    from nvalchemi.data import ASEReader, bundled_split_path
    from nvalchemi.data.datapipes import DataLoader
    from nvalchemi.data.datapipes.dataset import InMemoryDataset
    from nvalchemi.data.neighbors import NeighborListTransform
    from nvalchemi.distributed import DistributedManager
    from nvalchemi.models.painn import PaiNN
    from nvalchemi.training import EnergyMSELoss, OptimizerConfig, TrainingStrategy
    from nvalchemi.training.hooks import DDPHook
    from nvalchemi.training.time_budget import TimeBudgetHook

    DistributedManager.initialize(backend="gloo")  # as spec run does, from RANK/WORLD_SIZE
    rank = DistributedManager().rank
    torch.manual_seed(0)
    data = InMemoryDataset(
        reader=ASEReader(bundled_split_path("train"), index=slice(0, 16)),
        transforms=[NeighborListTransform(4.0)],
    )
    model = PaiNN(
        cutoff=4.0,
        hidden_channels=8,
        num_interactions=1,
        num_rbf=4,
        elements=[13, 28, 29, 46, 47, 78, 79],
    )
    budget = 1e-9 if rank == 1 else 1e9  # seconds: rank 1 is over budget at its first step
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
        loss_fn=EnergyMSELoss(),
        num_steps=1000,
        devices=[torch.device("cpu")],
        distributed_manager=DistributedManager(),
        hooks=[DDPHook(backend="gloo"), TimeBudgetHook(budget, check_interval=CHECK)],
    )
    strategy.run(DataLoader(data, batch_size=2, shuffle=True, seed=0))
    report(rank=rank, step=strategy.step_count, reason=strategy.stop_reason)
    del strategy, model  # no DDP reducer may outlive the process group
    gc.collect()
    DistributedManager.cleanup()  # barrier, then destroy the group
