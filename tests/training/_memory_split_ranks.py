"""Rank side of the DDP out-of-memory test (run as a script, one process per rank).

Two gloo ranks train a DDP-wrapped copy of one model on their own batches, twice: once
with a model that never runs out and once where rank 1's model runs out of memory
above 6 atoms. Both runs must end with the same weights on every rank.
"""

from __future__ import annotations

import copy
import warnings

import torch
from _ranks import init_group, report, teardown
from test_memory_split import ALL_REDUCTIONS, Limited, batches

from nvalchemi.training import DDPHook, OptimizerConfig, TrainingStrategy


def train(model, rank):
    data = batches(((3, 2, 5), (2, 6, 3), (4, 4, 1))) if rank == 0 else batches()
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
        loss_fn=copy.deepcopy(ALL_REDUCTIONS),
        num_epochs=1,
        hooks=[DDPHook(backend="gloo")],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.run(data)
    message = " ".join(str(w.message) for w in caught if "pieces" in str(w.message))
    return strategy, [p.detach().clone() for p in model.parameters()], message


def main() -> None:
    rank = init_group()
    torch.manual_seed(0)
    base = Limited(stress=True).double()
    reference, ref_weights, _ = train(copy.deepcopy(base), rank)
    model = copy.deepcopy(base)
    if rank == 1:
        model.limit = 6
    split, weights, message = train(model, rank)
    difference = max(float((a - b).abs().max()) for a, b in zip(ref_weights, weights))
    report(
        rank=rank,
        difference=difference,
        steps=[reference.step_count, split.step_count],
        weights=torch.cat([w.reshape(-1) for w in weights])[:16].tolist(),
        message=message,
        calls=list(zip(model.sizes, model.structures)),
    )
    teardown()


if __name__ == "__main__":
    main()
