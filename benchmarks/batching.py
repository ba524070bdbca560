"""Fixed ``batch_size`` versus ``BudgetBatchSampler``: memory per batch and throughput.

Data: 1,200 bundled EMT training structures (4-55 atoms) plus 24 rattled fcc(111)
slabs of 200-500 atoms with EMT labels, shuffled together. Model: PaiNN (hidden 32, two
interactions, 5 Å cutoff) trained on energies and forces (Adam), neighbour lists
built per batch. Both samplers see the same data and the same mean number of atoms
per batch: the fixed ``batch_size`` is the atom budget divided by the mean atom count.
The budget bounds atoms and neighbour pairs (``max_edges`` = ``max_atoms`` times the
mean pairs per atom): the model's memory grows with both, and dense bulk cells carry
more pairs per atom than slabs.

Prints one JSON line per sampler (peak memory per batch: max, min and their ratio;
atoms per batch: max and min; structures/s over the epoch) and one for
``probe_batch_budget`` (the budget it chooses on this device and how long it takes).
``--plot PATH`` draws the atoms per batch of both samplers (the figure in
``docs/batching.md``).

Memory is the peak of each training step: on CUDA ``torch.cuda.max_memory_allocated``;
on the CPU the peak resident set size (freed heap returned and the peak reset before
each step), which includes the interpreter and libraries (~0.4 GB), so the max/min
ratio understates the spread of the model's own memory there.

Usage: ``python benchmarks/batching.py [--device cuda] [--budget 1024] [--quick]
[--plot docs/images/batching_atoms_per_batch.png]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

CUTOFF = 5.0


def slabs(count: int, seed: int = 0) -> list:
    """Rattled Cu/Ni/Pd fcc(111) slabs of 200-500 atoms with vacuum and EMT labels."""
    from ase.build import fcc111
    from ase.calculators.emt import EMT

    from nvalchemi.data import AtomicData

    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        metal, a = [("Cu", 3.61), ("Ni", 3.52), ("Pd", 3.89)][k % 3]
        layers = int(rng.integers(4, 7))
        side = round((float(rng.integers(200, 501)) / layers) ** 0.5)
        atoms = fcc111(metal, size=(side, side, layers), a=a, vacuum=6.0)
        atoms.rattle(0.05, seed=int(rng.integers(1 << 31)))
        atoms.calc = EMT()
        atoms.get_potential_energy()
        out.append(AtomicData.from_atoms(atoms))
    return out


def dataset(quick: bool):
    from nvalchemi.data.bundled import bundled_split_path
    from nvalchemi.data.io.ase import ASEReader

    reader = ASEReader(bundled_split_path("train"))
    count = 300 if quick else 1200
    items = [reader.read_data(i) for i in range(count)]
    items += slabs(6 if quick else 24)
    return items


def model_and_optimizer(device):
    from nvalchemi.models.painn import PaiNN

    torch.manual_seed(0)
    model = PaiNN(cutoff=CUTOFF, hidden_channels=32, num_interactions=2, num_rbf=16)
    model.to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _meter(device):
    from nvalchemi.training.memory_probe import _Meter

    return _Meter(device)


def run_epoch(items, batches, device) -> dict:
    """One epoch over ``batches`` (index lists): per-batch peak memory, atoms, time."""
    from nvalchemi.data import Batch
    from nvalchemi.data.neighbors import compute_neighbors

    model, optimizer = model_and_optimizer(device)
    meter = _meter(device)
    peaks, atoms, edges = [], [], []
    start = time.perf_counter()
    for indices in batches:
        batch = Batch.from_data_list([items[i] for i in indices]).to(device)
        meter.start()
        compute_neighbors(batch, CUTOFF)
        optimizer.zero_grad(set_to_none=True)
        out = model(batch)
        loss = torch.nn.functional.mse_loss(out["energy"].reshape(-1), batch.energy.reshape(-1))
        loss = loss + torch.nn.functional.mse_loss(out["forces"], batch.forces)
        loss.backward()
        optimizer.step()
        peaks.append(meter.peak())
        atoms.append(batch.num_nodes)
        edges.append(batch.num_edges)
    seconds = time.perf_counter() - start
    return {
        "peaks": peaks,
        "atoms": atoms,
        "edges": edges,
        "seconds": seconds,
        "structures": sum(len(b) for b in batches),
    }


def summary(name: str, result: dict, extra: dict) -> dict:
    peaks = np.asarray(result["peaks"], dtype=float) / 2**20
    return {
        "bench": "batching",
        "sampler": name,
        **extra,
        "batches": len(result["atoms"]),
        "atoms_per_batch_max": int(max(result["atoms"])),
        "atoms_per_batch_min": int(min(result["atoms"])),
        "atoms_per_batch_mean": round(statistics.mean(result["atoms"]), 1),
        "edges_per_batch_max": int(max(result["edges"])),
        "edges_per_batch_min": int(min(result["edges"])),
        "peak_mib_max": round(float(peaks.max()), 1),
        "peak_mib_min": round(float(peaks.min()), 1),
        "peak_max_over_min": round(float(peaks.max() / peaks.min()), 2),
        "structures_per_s": round(result["structures"] / result["seconds"], 1),
    }


def plot(path: str, fixed: dict, budget: dict, batch_size: int, limits: dict) -> None:
    """Atoms and neighbour pairs per batch of both samplers over the epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(7.5, 4.6), dpi=110, sharex=True)
    label = f"BudgetBatchSampler(max_atoms={limits['max_atoms']}, max_edges={limits['max_edges']})"
    for ax, key, limit in zip(axes, ("atoms", "edges"), (limits["max_atoms"], limits["max_edges"])):
        ax.plot(fixed[key], lw=0.9, color="#c44e52", label=f"fixed batch_size={batch_size}")
        ax.plot(budget[key], lw=0.9, color="#4c72b0", label=label)
        ax.axhline(limit, color="#4c72b0", lw=0.6, ls="--")
        ax.set_ylabel(f"{key} in the batch")
    axes[0].set_title("Bundled EMT cells + 200-500-atom slabs, one epoch")
    axes[0].legend(loc="upper right", fontsize=7, frameon=False)
    axes[1].set_xlabel("batch of the epoch")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)


def main() -> None:
    from nvalchemi.data.datapipes import BudgetBatchSampler, InMemoryDataset, count_edges
    from nvalchemi.training.memory_probe import probe_batch_budget

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget", type=int, default=1024, help="max_atoms of the budget")
    parser.add_argument("--quick", action="store_true", help="small data (smoke test)")
    parser.add_argument("--plot", default=None, help="write the atoms-per-batch figure here")
    parser.add_argument("--probe-time", type=float, default=60.0, help="probe time limit (s)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    print(
        json.dumps(
            {
                "bench": "batching",
                "machine": platform.processor() or platform.machine(),
                "device": str(device),
                "torch_threads": torch.get_num_threads(),
                "load_average": [round(x, 2) for x in os.getloadavg()],
            }
        ),
        flush=True,
    )

    items = dataset(args.quick)
    sizes = [d.num_nodes for d in items]
    mean = statistics.mean(sizes)
    batch_size = max(1, round(args.budget / mean))
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(0)).tolist()
    fixed_batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    edge_counts = count_edges(InMemoryDataset(data_list=items), CUTOFF)
    max_edges = round(args.budget * sum(edge_counts) / sum(sizes))
    sampler = BudgetBatchSampler(
        sizes, max_atoms=args.budget, max_edges=max_edges, edge_counts=edge_counts, seed=0
    )
    budget_batches = list(sampler)
    common = {
        "structures": len(items),
        "slabs": sum(n >= 200 for n in sizes),
        "mean_atoms": round(mean, 1),
    }

    run_epoch(items, fixed_batches[:3], device)  # warm up allocator and kernels
    fixed = run_epoch(items, fixed_batches, device)
    budget = run_epoch(items, budget_batches, device)
    print(json.dumps(summary("fixed", fixed, {**common, "batch_size": batch_size})), flush=True)
    limits = {"max_atoms": args.budget, "max_edges": max_edges}
    print(json.dumps(summary("budget", budget, {**common, **limits})), flush=True)
    if args.plot:
        plot(args.plot, fixed, budget, batch_size, limits)

    model, _ = model_and_optimizer(device)
    samples = [items[i] for i in order[:64]]
    chosen = probe_batch_budget(model, samples, device, time_limit_s=args.probe_time)
    print(
        json.dumps(
            {
                "bench": "batching_probe",
                "device": chosen.device,
                "max_atoms": chosen.max_atoms,
                "max_edges": chosen.max_edges,
                "seconds": round(chosen.seconds, 1),
                "probe_batches": len(chosen.measurements),
                "largest_probe_atoms": max(m["atoms"] for m in chosen.measurements),
                "available_gib": round(chosen.available_bytes / 2**30, 2),
                "predicted_peak_gib": round(chosen.predicted_peak_bytes / 2**30, 2),
                "kib_per_atom": round(chosen.bytes_per_atom / 1024, 1),
                "kib_per_edge": round(chosen.bytes_per_edge / 1024, 2),
                "capped_at_4x_largest_probe": chosen.capped,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
