"""Time of one composed-loss forward+backward (EnergyMSE + ForceMSE + StressMSE).

64 structures of 24-40 atoms each, built from plain tensors. Prints one JSON line per device
with the median time per step of

* ``composed``: ``EnergyMSELoss() + ForceMSELoss() + StressMSELoss()``, nothing missing (the
  default ``ForceMSELoss`` averages per structure first);
* ``composed_plain_forces``: the same with ``ForceMSELoss(normalize_by_atom_count=False)``,
  the objective of the hand-written line;
* ``composed_missing``: the default composition with a quarter of the structures missing
  their stress and energy labels (``missing_labels=``, the masked path);
* ``bare``: what a user writes by hand, ``F.mse_loss`` on each of the three (no loss module).

On CPU the clock is the process CPU time (robust on a shared machine), else wall time with
synchronisation.

    python benchmarks/loss_step.py [--structures 64] [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

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


def time_it(fn, repeats: int, device: torch.device, block: int = 20) -> float:
    """Median seconds per call over blocks of ``block`` calls (CPU time on CPU, else wall)."""
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    for _ in range(10):
        fn()
    samples = []
    for _ in range(max(repeats // block, 1)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        for _ in range(block):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((clock() - start) / block)
    return statistics.median(samples)


def bench_device(device: torch.device, num_structures: int, repeats: int) -> dict:
    default = EnergyMSELoss() + ForceMSELoss() + StressMSELoss()
    plain = EnergyMSELoss() + ForceMSELoss(normalize_by_atom_count=False) + StressMSELoss()
    preds, targets, meta = make_inputs(num_structures, device)
    lacking = torch.arange(num_structures, device=device) % 4 == 0
    missing = {"energy": lacking, "stress": lacking}
    # as collation fills them: NaN values, and the missing-label mask
    targets_missing = dict(targets)
    for key in missing:
        targets_missing[key] = targets[key].clone()
        targets_missing[key][lacking] = float("nan")

    def clear_grads():
        for p in preds.values():
            p.grad = None

    def composed(loss_fn, labels=targets, **extra):
        def step():
            loss_fn(preds, labels, step=0, epoch=0, **meta, **extra)["total_loss"].backward()
            clear_grads()

        return step

    def bare():
        loss = sum(F.mse_loss(preds[f"predicted_{k}"], t) for k, t in targets.items())
        loss.backward()
        clear_grads()

    times = {
        "composed": time_it(composed(default), repeats, device),
        "composed_plain_forces": time_it(composed(plain), repeats, device),
        "composed_missing": time_it(
            composed(default, targets_missing, missing_labels=missing), repeats, device
        ),
        "bare": time_it(bare, repeats, device),
    }
    row = {
        "benchmark": "loss_step",
        "device": str(device),
        "structures": num_structures,
        "atoms": int(meta["num_nodes_per_graph"].sum()),
    }
    for name, seconds in times.items():
        row[f"{name}_forward_backward_ms"] = round(seconds * 1e3, 4)
    for name in ("composed", "composed_plain_forces", "composed_missing"):
        row[f"{name}_over_bare"] = round(times[name] / times["bare"], 2)
    return row


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
