"""Cost of one training step of a model: forward (energy + forces + stress) and backward.

Prints one JSON line per (model, cell size): a rattled periodic fcc Cu/Au cell of 32
or 256 atoms, batched 16 or 2 at a time, float32, neighbour lists precomputed (not
timed). One step is ``model(batch)`` in train mode with energy, forces and stress
active (forces and stress by autograd with ``create_graph=True``), an energy + force
+ stress MSE loss and ``loss.backward()``. Reported:

* ``ms_per_step`` / ``ms_per_structure``: median over the timed steps (``best_*``: min);
* ``peak_mem_mb``: on CPU the growth of the process's peak resident set size during
  the steps (each case runs in a fresh subprocess so the numbers do not mix); on
  CUDA ``torch.cuda.max_memory_allocated``.

Models: ``painn`` (``PaiNN()`` defaults: cutoff 5 Å, 64 channels, 3 blocks) and
``painn-small`` (the EMT quickstart recipe: 32 channels, 2 blocks).

Usage: ``python benchmarks/model_step.py [--steps 10] [--threads 2] [--device cpu]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

MODELS = {
    "painn": {},
    "painn-small": {"hidden_channels": 32, "num_interactions": 2, "num_rbf": 16},
}
CASES = ((32, 16), (256, 2))  # (atoms per cell, structures per batch)


def _rss_mb() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_case(model_name: str, atoms_per_cell: int, batch_size: int, args) -> dict:
    import numpy as np
    import torch
    from ase.build import bulk

    from nvalchemi.data import AtomicData, Batch
    from nvalchemi.data.neighbors import compute_neighbors
    from nvalchemi.models import PaiNN

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    repeat = round((atoms_per_cell / 4) ** (1 / 3))
    structures = []
    for i in range(batch_size):
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True) * (repeat, repeat, repeat)
        atoms.numbers[np.random.default_rng(i).random(len(atoms)) < 0.25] = 79
        atoms.rattle(0.05, seed=i)
        structures.append(AtomicData.from_atoms(atoms, dtype=torch.float32))
    batch = Batch.from_data_list(structures)
    model = PaiNN(elements=[29, 79], dtype=torch.float32, **MODELS[model_name]).to(device)
    compute_neighbors(batch, config=model.model_config.neighbor_config)
    batch = batch.to(device)
    model.set_config("active_outputs", {"energy", "forces", "stress"})
    model.train()
    energy_target = torch.zeros(batch.num_graphs, 1, device=device)
    forces_target = torch.zeros_like(batch.positions)
    stress_target = torch.zeros(batch.num_graphs, 3, 3, device=device)

    def step() -> None:
        out = model(batch)
        loss = (
            (out["energy"] - energy_target).pow(2).mean()
            + (out["forces"] - forces_target).pow(2).mean()
            + (out["stress"] - stress_target).pow(2).mean()
        )
        model.zero_grad(set_to_none=True)
        loss.backward()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    baseline = _rss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step()
    sync()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = _rss_mb() - baseline
    median, best = statistics.median(times), min(times)
    return {
        "benchmark": "model_step",
        "model": model_name,
        "atoms_per_structure": atoms_per_cell,
        "batch_size": batch_size,
        "edges_per_atom": round(batch.num_edges / batch.num_nodes, 1),
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "ms_per_step": round(1000 * median, 2),
        "ms_per_structure": round(1000 * median / batch_size, 2),
        "best_ms_per_structure": round(1000 * best / batch_size, 2),
        "structures_per_s": round(batch_size / median, 1),
        "peak_mem_mb": round(peak, 1),
        "platform": platform.processor() or platform.machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # "model:atoms:batch"
    args = parser.parse_args()
    if args.case:
        name, atoms, batch = args.case.split(":")
        print(json.dumps(run_case(name, int(atoms), int(batch), args)), flush=True)
        return
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"Unknown model {name!r}; choose from {sorted(MODELS)}.")
        for atoms, batch in CASES:
            command = [sys.argv[0], "--case", f"{name}:{atoms}:{batch}"]
            for flag in ("steps", "warmup", "threads", "device"):
                command += [f"--{flag}", str(getattr(args, flag))]
            result = subprocess.run(
                [sys.executable, *command], capture_output=True, text=True, env=os.environ
            )
            if result.returncode != 0:
                raise SystemExit(result.stderr)
            print(result.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
