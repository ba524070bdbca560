"""Time of one composed-loss forward+backward (EnergyMSE + ForceMSE + StressMSE).

64 structures of ~32 atoms each, built from plain tensors. Prints one JSON line per device
with the median time per step, next to a bare ``((pred - target) ** 2).mean()`` over the same
tensors for scale.

    python benchmarks/loss_step.py [--structures 64] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nvalchemi.training.losses import EnergyMSELoss, ForceMSELoss, StressMSELoss


def make_inputs(
    num_structures: int, device: torch.device, seed: int = 0
) -> tuple[dict, dict, dict]:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(24, 41, (num_structures,), generator=g)
    batch_idx = torch.repeat_interleave(torch.arange(num_structures), counts)
    num_atoms = int(counts.sum())

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    preds = {
        "predicted_energy": rand(num_structures, 1).requires_grad_(),
        "predicted_forces": rand(num_atoms, 3).requires_grad_(),
        "predicted_stress": rand(num_structures, 3, 3).requires_grad_(),
    }
    targets = {
        "energy": rand(num_structures, 1),
        "forces": rand(num_atoms, 3),
        "stress": rand(num_structures, 3, 3),
    }
    meta = {
        "batch_idx": batch_idx.to(device),
        "num_graphs": num_structures,
        "num_nodes_per_graph": counts.to(device),
    }
    return preds, targets, meta


def time_it(fn, repeats: int, device: torch.device) -> float:
    for _ in range(10):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_device(device: torch.device, num_structures: int, repeats: int) -> dict:
    loss_fn = EnergyMSELoss() + ForceMSELoss() + StressMSELoss()
    preds, targets, meta = make_inputs(num_structures, device)

    def clear_grads():
        for p in preds.values():
            p.grad = None

    def composed():
        loss_fn(preds, targets, step=0, epoch=0, **meta)["total_loss"].backward()
        clear_grads()

    def bare():
        sum(((preds[f"predicted_{k}"] - t) ** 2).mean() for k, t in targets.items()).backward()
        clear_grads()

    step_s, bare_s = time_it(composed, repeats, device), time_it(bare, repeats, device)
    return {
        "benchmark": "loss_step",
        "device": str(device),
        "structures": num_structures,
        "atoms": int(meta["num_nodes_per_graph"].sum()),
        "composed_forward_backward_ms": round(step_s * 1e3, 4),
        "bare_mse_forward_backward_ms": round(bare_s * 1e3, 4),
        "overhead_ratio": round(step_s / bare_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structures", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        print(json.dumps(bench_device(device, args.structures, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
