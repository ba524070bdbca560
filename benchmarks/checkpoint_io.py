"""Checkpoint save/load time and size, and the training-thread stall of an asynchronous save.

For the default PaiNN (~0.16 M parameters) and a 10 M-parameter PaiNN (hidden 384, 6
interactions), each with Adam state (after one training step) and EMA weights, prints one
JSON line per model and device:

* ``save_s``: synchronous strategy checkpoint (snapshot + write + fsync + manifest);
* ``load_s``: ``TrainingStrategy.load_checkpoint`` (rebuild, load every state);
* ``load_model_s``: ``load_model_from_checkpoint`` (weights only, for inference);
* ``size_mb``: bytes on disk of one checkpoint;
* ``async_stall_s``: time the training thread spends in an asynchronous
  ``CheckpointHook`` save (checks, CPU snapshot, submit) -- the only stall;
* ``copy_state_s``: time to copy the same tensors (weights, Adam moments, EMA) into the
  reused CPU buffers the hook keeps, the floor of that stall; ``copy_weights_s``: the
  weights alone; ``copy_state_fresh_s``: the same copy into freshly allocated memory;
* ``async_write_s``: time the background write then takes.

Usage: ``python benchmarks/checkpoint_io.py [--repeats 3] [--device cpu|cuda|all]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nvalchemi.data import AtomicData, Batch
from nvalchemi.models.painn import PaiNN
from nvalchemi.training import EnergyMSELoss, ForceMSELoss, OptimizerConfig, TrainingStrategy
from nvalchemi.training.checkpoint import load_model_from_checkpoint, save_checkpoint
from nvalchemi.training.checkpoint.parts import SnapshotBuffers, cpu_snapshot
from nvalchemi.training.hooks.checkpoint import CheckpointHook
from nvalchemi.training.hooks.ema import EMAHook

MODELS = {
    "painn-default": {},
    "painn-10M": {"hidden_channels": 384, "num_interactions": 6},
}


def batch(device: torch.device) -> Batch:
    generator = torch.Generator().manual_seed(0)
    structures = []
    for _ in range(4):
        n = 8
        pairs = torch.tensor([[a, b] for a in range(n) for b in range(n) if a != b])
        structures.append(
            AtomicData(
                atomic_numbers=torch.randint(1, 9, (n,), generator=generator),
                positions=2.0 * torch.randn(n, 3, generator=generator),
                energy=torch.randn(1, 1, generator=generator),
                forces=torch.randn(n, 3, generator=generator),
                neighbor_list=pairs,
                neighbor_list_shifts=torch.zeros(len(pairs), 3, dtype=torch.long),
            )
        )
    return Batch.from_data_list(structures).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(name: str, kwargs: dict, device: torch.device, repeats: int, scratch: Path) -> dict:
    torch.manual_seed(0)
    model = PaiNN(**kwargs)
    ema = EMAHook(decay=0.99)
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-4}),
        loss_fn=EnergyMSELoss() + ForceMSELoss(),
        num_steps=10**6,
        devices=[device],
        hooks=[ema],
    )
    strategy.train_batch(batch(device))  # Adam moments and EMA weights exist now
    params = sum(p.numel() for p in model.parameters())

    root = scratch / f"{name}-{device.type}"
    save_checkpoint(root, strategy)  # warm-up: spec verification, imports
    save_s, _ = timed(lambda: save_checkpoint(root, strategy, keep_last=1), device, repeats)
    latest = root / "checkpoints" / str(save_checkpoint(root, strategy, keep_last=1))
    size = dir_size(latest)
    load_s, _ = timed(
        lambda: TrainingStrategy.load_checkpoint(
            root, map_location=device, hooks=[EMAHook(decay=0.99)]
        ),
        device,
        repeats,
    )
    load_model_s, _ = timed(
        lambda: load_model_from_checkpoint(root, map_location=device), device, repeats
    )

    state = {
        "model": model.state_dict(),
        "optimizer": strategy._optimizers[0].state_dict(),
        "ema": ema.get_averaged_model().state_dict(),
    }
    buffers = SnapshotBuffers()

    def copy_into_buffers(value: dict, where: str) -> None:
        cpu_snapshot(value, where, buffers)
        buffers.finish()

    copy_into_buffers(state, "state")  # allocate once, as the hook does on its first save
    copy_weights_s, _ = timed(
        lambda: copy_into_buffers(model.state_dict(), "model"), device, repeats
    )
    copy_state_s, _ = timed(lambda: copy_into_buffers(state, "state"), device, repeats)
    fresh_copy_s, _ = timed(lambda: cpu_snapshot(state, "state"), device, repeats)

    hook = CheckpointHook(scratch / f"{name}-{device.type}-async", step_interval=1, keep_last=1)
    stalls, writes = [], []
    for _ in range(repeats + 1):
        strategy.train_batch(batch(device))  # a new state to save
        sync(device)
        start = time.perf_counter()
        hook.save(strategy, reason="benchmark")
        stalls.append(time.perf_counter() - start)
        start = time.perf_counter()
        hook.flush()
        writes.append(time.perf_counter() - start)
    hook.close()
    strategy.close()
    return {
        "model": name,
        "device": str(device),
        "parameters": params,
        "size_mb": round(size / 2**20, 3),
        "save_s": round(save_s, 4),
        "load_s": round(load_s, 4),
        "load_model_s": round(load_model_s, 4),
        "async_stall_s": round(statistics.median(stalls[1:]), 4),
        "copy_state_s": round(copy_state_s, 4),
        "copy_state_fresh_s": round(fresh_copy_s, 4),
        "copy_weights_s": round(copy_weights_s, 4),
        "async_write_s": round(statistics.median(writes[1:]), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    args = parser.parse_args()
    devices = []
    if args.device in ("cpu", "all"):
        devices.append(torch.device("cpu"))
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        devices.append(torch.device("cuda", 0))
    scratch = Path(tempfile.mkdtemp(prefix="nvalchemi-ckpt-bench-"))
    try:
        for device in devices:
            for name, kwargs in MODELS.items():
                print(json.dumps(measure(name, kwargs, device, args.repeats, scratch)), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
