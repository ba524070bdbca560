"""Framework overhead of ``TrainingStrategy`` against a hand-written PyTorch loop.

Both train the same model (same initial weights) with Adam on the same pre-built
batches. The hand-written loop is what a user writes in plain PyTorch: ``zero_grad``,
forward, ``F.mse_loss`` on the energy (plus ``F.mse_loss`` on the forces), backward,
``step``; it uses none of our loss modules. The strategy trains with
``EnergyMSELoss()`` (``+ ForceMSELoss()``), its default training function and hooks-free
hot path, so the ratio is everything the framework adds (the loss modules, target
assembly, counters, the device-side non-finite record); both sides make the same public torch
calls (``zero_grad(set_to_none=True)``, ``optimizer.step()``, module calls). Each round times one block of
steps on each side (which side goes first alternates); ``ratio`` is the median over
rounds of bare time / strategy time, next to the median steps/s of each side.

Workloads:

* ``mlp``: 4 atoms per structure, batch 8, hidden 32, energy loss;
* ``forces``: 16 atoms, batch 32, hidden 32, energy + force loss with autograd forces; the
  strategy's loss is the hand loop's objective ``mse(E) + mse(F)``:
  ``ComposedLossFunction([EnergyMSELoss(), ForceMSELoss(normalize_by_atom_count=False)],
  normalize_weights=False)`` (a mean over all force components, weights 1 and 1);
* ``forces_balanced``: what a user writes first, ``EnergyMSELoss() + ForceMSELoss()``: weights
  normalised to 0.5 and 0.5 (one multiply more than the hand loop) and the default force mean
  over structures of per-structure means (more work than ``F.mse_loss``; the same value
  here, where every structure has 16 atoms);
* ``null``: a one-weight model on the ``mlp`` batches, so ``overhead_us_per_step`` is
  close to the loop's own cost per step;
* ``painn``: a real model, the one the framework is for: ``PaiNN()`` defaults (cutoff 5 Å,
  64 channels, 3 blocks) on bulk32-like cells (rattled fcc Cu/Au, 32 atoms, neighbour lists
  precomputed), batch 8, energy + forces + stress (autograd, ``create_graph=True``); the
  strategy's loss is the hand loop's ``mse(E) + mse(F) + mse(S)``. ``framework_share`` is
  ``1 - bare time / strategy time``, the framework's part of a step (aim: under 2 %);
* ``public``: not a ratio but the steps/s of the public-API loop a user writes first:
  ``TrainingStrategy.run`` over a ``torch.utils.data.DataLoader`` of ``AtomicData`` with
  ``collate_fn=Batch.from_data_list`` (collation in the loop, batch 8 of 4-atom
  structures, the ``mlp`` model), one epoch of 64 batches per round.

Also prints the wall time and peak RSS of ``python -c "import torch"``,
``python -c "import nvalchemi.training"`` and
``python -c "from nvalchemi.training import TrainingStrategy"``.

On CPU the clock is the process's CPU time (``time.process_time``, one torch thread by
default), which other jobs on a shared machine do not inflate; on CUDA it is wall time
with synchronisation.

Output: one JSON line per measurement. Usage::

    python benchmarks/overhead.py [--rounds 21] [--steps 200] [--threads 1] [--device cpu]

(``painn`` runs ``--painn-steps`` steps per round, default 5: a step takes tens of ms on CPU.)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from nvalchemi.data import AtomicData, Batch
from nvalchemi.training import (
    ComposedLossFunction,
    EnergyMSELoss,
    ForceMSELoss,
    OptimizerConfig,
    StressMSELoss,
    TrainingStrategy,
)

NUM_TYPES = 4


class SmallMLP(nn.Module):
    """Per-atom MLP on (species embedding, positions), energies summed per structure."""

    def __init__(self, hidden: int = 32, forces: bool = False) -> None:
        super().__init__()
        self.hidden = hidden
        self.forces = forces
        self.embedding = nn.Embedding(NUM_TYPES + 1, 8)
        self.mlp = nn.Sequential(
            nn.Linear(11, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        positions = batch.positions
        if self.forces:
            positions = positions.detach().requires_grad_(True)
        features = torch.cat([self.embedding(batch.atomic_numbers), positions], dim=-1)
        atom_energy = self.mlp(features).squeeze(-1)
        energy = atom_energy.new_zeros(batch.num_graphs).index_add(0, batch.batch_idx, atom_energy)
        out = {"energy": energy.unsqueeze(-1)}
        if self.forces:
            (grad,) = torch.autograd.grad(
                energy.sum(), positions, create_graph=self.training, retain_graph=self.training
            )
            out["forces"] = -grad
        return out


class ScaleLabels(nn.Module):
    """Near-free model (energy label times one weight): the step cost is the loop's own."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"energy": batch.energy * self.w}


def make_structures(n: int, atoms: int, generator: torch.Generator) -> list[AtomicData]:
    return [
        AtomicData(
            atomic_numbers=torch.randint(1, NUM_TYPES + 1, (atoms,), generator=generator),
            positions=torch.randn(atoms, 3, generator=generator),
            energy=torch.randn(1, 1, generator=generator),
            forces=torch.randn(atoms, 3, generator=generator),
        )
        for _ in range(n)
    ]


def make_batches(n: int, atoms: int, size: int, device: torch.device) -> list[Batch]:
    generator = torch.Generator().manual_seed(0)
    return [
        Batch.from_data_list(make_structures(size, atoms, generator)).to(device) for _ in range(n)
    ]


def hand_loss(model, batch: Batch, with_forces: bool, with_stress: bool = False) -> torch.Tensor:
    """Forward pass and the loss a user writes by hand: ``F.mse_loss`` (no loss module)."""
    out = model(batch)
    loss = F.mse_loss(out["energy"], batch.energy)
    if with_forces:
        loss = loss + F.mse_loss(out["forces"], batch.forces)
    if with_stress:
        loss = loss + F.mse_loss(out["stress"], batch.stress)
    return loss


def bare_loop(model, optimizer, batches, steps, with_forces, with_stress=False) -> None:
    """The hand-written loop: zero_grad, forward, ``F.mse_loss``, backward, step."""
    n = len(batches)
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        hand_loss(model, batches[i % n], with_forces, with_stress).backward()
        optimizer.step()


def make_painn_batches(n: int, size: int, device: torch.device) -> tuple[nn.Module, list[Batch]]:
    """``PaiNN()`` and ``n`` batches of ``size`` bulk32-like cells (lists precomputed)."""
    import numpy as np
    from ase.build import bulk

    from nvalchemi.data.neighbors import compute_neighbors
    from nvalchemi.models import PaiNN

    torch.manual_seed(0)
    model = PaiNN(elements=[29, 79], dtype=torch.float32).to(device)
    model.set_config("active_outputs", {"energy", "forces", "stress"})
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(n):
        structures = []
        for _ in range(size):
            atoms = bulk("Cu", "fcc", a=3.61, cubic=True) * (2, 2, 2)
            atoms.numbers[rng.random(len(atoms)) < 0.25] = 79
            atoms.rattle(0.05, seed=int(rng.integers(1 << 30)))
            cell = AtomicData.from_atoms(atoms, dtype=torch.float32)
            labels = {
                "energy": torch.randn(1, 1),
                "forces": 0.1 * torch.randn(len(atoms), 3),
                "stress": 0.01 * torch.randn(1, 3, 3),
            }
            structures.append(AtomicData(**dict(cell.items()), **labels))
        batch = Batch.from_data_list(structures)
        compute_neighbors(batch, config=model.model_config.neighbor_config)
        batches.append(batch.to(device))
    return model, batches


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device):
    """CPU time of this process on CPU (robust to other load on a shared machine), else wall."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def measure(workload: str, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    painn = workload == "painn"
    forces = workload.startswith("forces") or painn
    atoms, size = (32, 8) if painn else (16, 32) if forces else (4, 8)
    if painn:
        model_s, batches = make_painn_batches(4, size, device)
    else:
        batches = make_batches(16, atoms, size, device)
        torch.manual_seed(0)
        model_s = (ScaleLabels() if workload == "null" else SmallMLP(32, forces)).to(device)
    model_b = copy.deepcopy(model_s)
    model_b.train()
    if painn:
        loss_s = ComposedLossFunction(
            [EnergyMSELoss(), ForceMSELoss(normalize_by_atom_count=False), StressMSELoss()],
            normalize_weights=False,
        )
    elif workload == "forces_balanced":
        loss_s = EnergyMSELoss() + ForceMSELoss()
    elif forces:
        loss_s = ComposedLossFunction(
            [EnergyMSELoss(), ForceMSELoss(normalize_by_atom_count=False)],
            normalize_weights=False,
        )
    else:
        loss_s = EnergyMSELoss()
    strategy = TrainingStrategy(
        models=model_s,
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
        loss_fn=loss_s,
        num_steps=1,
        devices=[device],
    )
    optimizer = torch.optim.Adam(model_b.parameters(), lr=1e-3)
    steps = args.painn_steps if painn else args.steps
    now = clock(device)
    strategy_rates, bare_rates, ratios = [], [], []

    def run_strategy() -> float:
        strategy.num_steps += steps
        sync(device)
        start = now()
        strategy.run(batches)
        sync(device)
        return now() - start

    def run_bare() -> float:
        start = now()
        bare_loop(model_b, optimizer, batches, steps, forces, painn)
        sync(device)
        return now() - start

    strategy.num_steps = 0
    run_strategy(), run_bare()  # warm-up round
    for round_index in range(args.rounds):
        # Alternate which side goes first so slow drifts and order effects cancel.
        if round_index % 2:
            t_bare, t_strategy = run_bare(), run_strategy()
        else:
            t_strategy, t_bare = run_strategy(), run_bare()
        strategy_rates.append(steps / t_strategy)
        bare_rates.append(steps / t_bare)
        ratios.append(t_bare / t_strategy)
    s, b = statistics.median(strategy_rates), statistics.median(bare_rates)
    ratio = statistics.median(ratios)
    return {
        "benchmark": "overhead",
        "workload": workload,
        "atoms_per_structure": atoms,
        "batch_size": size,
        "hidden": 0 if workload == "null" else 64 if painn else 32,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "clock": "process_time" if device.type == "cpu" else "wall",
        "rounds": args.rounds,
        "steps_per_round": steps,
        "strategy_steps_per_s": round(s, 1),
        "bare_steps_per_s": round(b, 1),
        "ratio": round(ratio, 4),
        "overhead_us_per_step": round((1 / s - 1 / b) * 1e6, 2),
        "framework_share": round(1 - ratio, 4),
    }


def measure_public(args: argparse.Namespace) -> dict:
    """Steps/s of ``strategy.run`` over a torch DataLoader that collates in the loop."""
    device = torch.device(args.device)
    structures = make_structures(512, 4, torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(
        structures, batch_size=8, shuffle=True, collate_fn=Batch.from_data_list
    )
    torch.manual_seed(0)
    strategy = TrainingStrategy(
        models=SmallMLP(32).to(device),
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
        loss_fn=EnergyMSELoss(),
        num_epochs=1,
        devices=[device],
    )
    now = clock(device)
    rates = []
    for round_index in range(args.rounds + 1):  # round 0 warms up
        strategy.num_epochs = round_index + 1
        sync(device)
        start = now()
        strategy.run(loader)
        sync(device)
        if round_index:
            rates.append(len(loader) / (now() - start))
    return {
        "benchmark": "overhead",
        "workload": "public",
        "atoms_per_structure": 4,
        "batch_size": 8,
        "hidden": 32,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "clock": "process_time" if device.type == "cpu" else "wall",
        "rounds": args.rounds,
        "steps_per_round": len(loader),
        "strategy_steps_per_s": round(statistics.median(rates), 1),
    }


# VmHWM (peak RSS of this process image) rather than ru_maxrss: the latter survives exec and
# would report the parent's (torch-loaded) peak. torch is imported first and timed apart,
# so "over torch" is measured inside one process (robust to a busy machine).
_PROBE = (
    "import time; t0 = time.perf_counter(); c0 = time.process_time(); import torch; "
    "t1 = time.perf_counter(); c1 = time.process_time(); {stmt}; "
    "t2 = time.perf_counter(); c2 = time.process_time(); "
    "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]; "
    "print(t1 - t0, c1 - c0, t2 - t1, c2 - c1, hwm)"
)


def import_cost(stmt: str, repeats: int) -> dict:
    rows = []
    for _ in range(repeats + 1):  # the first run warms the file cache
        out = subprocess.run(
            [sys.executable, "-c", _PROBE.format(stmt=stmt)],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append([float(x) for x in out.stdout.split()])
    med = [statistics.median(col) for col in zip(*rows[1:])]
    return {
        "benchmark": "import",
        "statement": stmt,
        "torch_wall_s": round(med[0], 3),
        "wall_s_over_torch": round(med[2], 3),
        "cpu_s_over_torch": round(med[3], 3),
        "peak_rss_mb": round(med[4] / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--painn-steps", type=int, default=5)
    parser.add_argument("--workloads", default="mlp,forces,forces_balanced,null,public,painn")
    parser.add_argument("--import-repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for workload in filter(None, args.workloads.split(",")):
        row = measure_public(args) if workload == "public" else measure(workload, args)
        print(json.dumps(row), flush=True)
    if args.import_repeats:
        base = import_cost("pass", args.import_repeats)
        base["statement"] = "import torch"
        print(json.dumps(base), flush=True)
        for stmt in (
            "import nvalchemi.training",
            "from nvalchemi.training import TrainingStrategy",
        ):
            row = import_cost(stmt, args.import_repeats)
            row["peak_rss_mb_over_torch"] = round(row["peak_rss_mb"] - base["peak_rss_mb"], 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
