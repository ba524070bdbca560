"""Rank side of the 2-process checkpoint test (run as a script, one process per rank).

Each rank trains its own tiny model under a gloo group with a rank-dependent RNG seed
and a shared ``CheckpointHook`` directory (rank 0 writes, every rank waits), then
checks that every rank reloads its own RNG state; reports what it saw.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _checkpoint_support import batches, strategy
from _ranks import init_group, report, teardown

from nvalchemi.training import TrainingStrategy
from nvalchemi.training.checkpoint import CheckpointManifest, strategy_load_checkpoint
from nvalchemi.training.hooks.checkpoint import CheckpointHook

torch.set_num_threads(1)


def main(root: str) -> None:
    rank = init_group()
    hook = CheckpointHook(root, step_interval=2)
    run = strategy(num_steps=2, hooks=[hook])
    torch.manual_seed(100 + rank)  # after building the (identical) models
    run.run(batches(2, seed=rank))
    after_run = torch.rand(3).tolist()  # the RNG state was saved at the end of the run
    manifest = CheckpointManifest.read(root)
    entry = manifest.entry("latest")
    files = sorted(p.name for p in (Path(root) / entry.path / "rng").iterdir())
    loaded = strategy_load_checkpoint(TrainingStrategy, root, map_location="cpu")
    restored = torch.rand(3).tolist()
    meta = json.loads((Path(root) / entry.path / "strategy.json").read_text())
    report(
        rank=rank,
        index=hook.last_checkpoint_index,
        entries=[e.index for e in manifest.checkpoints],
        rng_files=files,
        same_draws=after_run == restored,
        draws=after_run,
        world_size=meta["world_size"],
        step=loaded.step_count,
    )
    dist.barrier()
    teardown()


if __name__ == "__main__":
    main(sys.argv[1])
