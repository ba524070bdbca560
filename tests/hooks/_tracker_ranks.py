"""One rank of the two-rank tracker test: tiny DDP training with a W&B and an MLflow reporter.

Reports the tracked-run ids this rank's reporters hold and whether it imported a tracker.
"""

from __future__ import annotations

import gc
import sys

import torch
from _ranks import report

if __name__ == "__main__":
    import _checkpoint_support as C

    from nvalchemi.distributed import DistributedManager
    from nvalchemi.hooks.reporting import MLflowReporter, ReportingOrchestrator, WandbReporter
    from nvalchemi.training.hooks import DDPHook

    out = sys.argv[1]
    DistributedManager.initialize(backend="gloo")
    rank = DistributedManager().rank
    trackers = [
        WandbReporter("ranks", dir=out),
        MLflowReporter("ranks", tracking_uri=f"file:{out}/mlruns"),
    ]
    strategy = C.strategy(
        num_steps=3,
        devices=[torch.device("cpu")],
        distributed_manager=DistributedManager(),
        hooks=[DDPHook(backend="gloo"), ReportingOrchestrator(trackers)],
    )
    strategy.run(C.batches(3, seed=rank))
    imported = sorted(name for name in ("wandb", "mlflow") if name in sys.modules)
    report(rank=rank, run_ids=[t.run_id for t in trackers], imported=imported)
    del strategy  # no DDP reducer may outlive the process group
    gc.collect()
    DistributedManager.cleanup()
