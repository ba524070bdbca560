"""Data-parallel scaling of PaiNN training on the CPU: 1 rank against 2 gloo ranks.

Both configurations train the built-in ``PaiNN`` (defaults: cutoff 5 Å, 64 channels,
3 blocks; ``--model painn-small``: 32 channels, 2 blocks) with ``TrainingStrategy``
(energy + force + stress loss, AdamW) on the bundled EMT training split, 16 structures
per rank per step, one torch thread per rank. The 2-rank run goes through the real
path: ``DDPHook`` wraps the model and gives each rank every second structure of the
same sequence. Both runs time the same structures: the 1-rank run takes two steps
for each step of the 2-rank run. Neighbour lists are precomputed (not timed).

Each round starts a fresh 1-rank process and a fresh 2-rank group (alternating which
goes first). Printed, one JSON line each:

* per run: ``structures_per_s`` (timed structures over the slowest rank's wall time)
  and ``cpu_ms_per_structure`` (CPU time of all ranks per structure, which other jobs
  on a shared machine barely inflate);
* a summary: medians over rounds, ``efficiency`` = ``structures_per_s(2) / (2 *
  structures_per_s(1))`` (target >= 0.8), ``cpu_efficiency`` = ``cpu per structure
  (1) / cpu per structure (2)`` (what DDP itself costs), and the load average.

On a machine shared with other jobs the wall-clock ``efficiency`` mostly measures how
many cores the others left free (see ``cpu_share_per_rank``). ``idle_core_efficiency``
estimates the idle-machine value from per-step CPU times: a step of the 2-rank run
takes as long as its slower rank computes (load imbalance between the shards is
included; communication latency, about a millisecond on one host, is not), and
``balance_2_ranks`` how much of it is lost to shards of different sizes (structures of
4 to 128 atoms, dealt out round-robin, 16 per rank: about 0.9).

``--sharding balanced`` replaces the round-robin shards by a distributed batch sampler
(``nvalchemi.data.datapipes.SizeBalancedBatchSampler``, which ``DDPHook`` keeps) that gives
every rank the same number of structures and about the same number of atoms per step.

Usage: ``python benchmarks/ddp_scaling.py [--rounds 3] [--steps 20] [--warmup 3]
[--model painn|painn-small] [--sharding round-robin|balanced]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCH_PER_RANK = 16
MODELS = {
    "painn": {},
    "painn-small": {"hidden_channels": 32, "num_interactions": 2, "num_rbf": 16},
}
ELEMENTS = [13, 28, 29, 46, 47, 78, 79]  # Al Ni Cu Pd Ag Pt Au: all of the bundled set


# --------------------------------------------------------------------------- one rank
def run_rank(args: argparse.Namespace) -> dict:
    import torch

    from nvalchemi.data import ASEReader, bundled_split_path
    from nvalchemi.data.datapipes import DataLoader, InMemoryDataset, SizeBalancedBatchSampler
    from nvalchemi.data.neighbors import NeighborListTransform
    from nvalchemi.distributed import DistributedManager
    from nvalchemi.models import PaiNN
    from nvalchemi.training import (
        EnergyMSELoss,
        ForceMSELoss,
        OptimizerConfig,
        StressMSELoss,
        TrainingStage,
        TrainingStrategy,
    )
    from nvalchemi.training.hooks import DDPHook

    torch.set_num_threads(1)
    DistributedManager.initialize(backend="gloo")
    manager = DistributedManager()
    world = manager.world_size
    # the same global sequence for both configurations: 2 ranks split each pair of
    # 1-rank steps; 2 * (warmup + steps) batches of 16 in all
    total = 2 * BATCH_PER_RANK * (args.warmup + args.steps)
    reader = ASEReader(bundled_split_path("train"))
    order = torch.randperm(len(reader), generator=torch.Generator().manual_seed(0))[:total]
    structures = [reader.read_data(int(i)) for i in order]
    dataset = InMemoryDataset(data_list=structures, transforms=[NeighborListTransform(5.0)])
    if args.sharding == "balanced" and world > 1:
        sizes = [data.num_nodes for data in structures]
        shards = SizeBalancedBatchSampler(
            sizes, BATCH_PER_RANK, num_replicas=world, rank=manager.rank, shuffle=False
        )
        loader = DataLoader(dataset, batch_sampler=shards)  # distributed: DDPHook keeps it
    else:
        loader = DataLoader(dataset, batch_size=BATCH_PER_RANK, shuffle=False)

    torch.manual_seed(0)
    model = PaiNN(elements=ELEMENTS, scale=0.3, **MODELS[args.model])
    model.set_config("active_outputs", {"energy", "forces", "stress"})
    steps_per_rank = (2 // world) * (args.warmup + args.steps)
    warmup = (2 // world) * args.warmup

    class Clock:
        frequency = 1
        stage = TrainingStage.AFTER_BATCH

        def __init__(self) -> None:
            self.marks: list[tuple[float, float]] = []

        def __call__(self, ctx, stage) -> None:
            self.marks.append((time.perf_counter(), time.process_time()))

    clock = Clock()
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(torch.optim.AdamW, {"lr": 1e-3}),
        loss_fn=EnergyMSELoss(per_atom=True) + 10.0 * ForceMSELoss() + 100.0 * StressMSELoss(),
        num_steps=steps_per_rank,
        distributed_manager=manager,
        hooks=[DDPHook(), clock],
    )
    strategy.run(loader)
    (wall0, cpu0), (wall1, cpu1) = clock.marks[warmup - 1], clock.marks[-1]
    cpu_marks = [cpu for _, cpu in clock.marks[warmup - 1 :]]
    result = {
        "step_cpu_s": [b - a for a, b in itertools.pairwise(cpu_marks)],
        "rank": manager.rank,
        "world_size": world,
        "wall_s": wall1 - wall0,
        "cpu_s": cpu1 - cpu0,
        "timed_steps": len(clock.marks) - warmup,
        "params": sum(p.numel() for p in model.parameters()),
        "mean_atoms": sum(s.num_nodes for s in structures) / len(structures),
    }
    DistributedManager.cleanup()
    return result


# --------------------------------------------------------------------------- parent
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(world: int, args: argparse.Namespace) -> dict:
    """Run one configuration in fresh processes; return its JSON record."""
    port = str(_free_port())
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    repo = str(Path(__file__).resolve().parents[1])
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, base.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--worker", "--model", args.model]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--sharding", args.sharding]
    procs = []
    for rank in range(world):
        env = dict(base)
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NVALCHEMI_DIST_TIMEOUT_S="300")
        procs.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    ranks = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(err.decode()[-3000:])
        ranks.append(json.loads(out.decode().strip().splitlines()[-1]))
    structures = 2 * BATCH_PER_RANK * args.steps
    wall = max(r["wall_s"] for r in ranks)  # every rank waits for the slowest one
    cpu = sum(r["cpu_s"] for r in ranks)
    # On idle cores a step takes as long as its slowest rank computes: the wall time
    # this run would need on a quiet machine (load imbalance included, latency not).
    steps = list(zip(*(r["step_cpu_s"] for r in ranks)))
    idle_wall = sum(max(step) for step in steps)
    return {
        "benchmark": "ddp_scaling",
        "model": args.model,
        "sharding": args.sharding if world > 1 else "none",
        "ranks": world,
        "threads_per_rank": 1,
        "backend": "gloo" if world > 1 else "none",
        "batch_per_rank": BATCH_PER_RANK,
        "timed_structures": structures,
        "mean_atoms": round(ranks[0]["mean_atoms"], 1),
        "params": ranks[0]["params"],
        "structures_per_s": round(structures / wall, 2),
        "cpu_ms_per_structure": round(1000 * cpu / structures, 2),
        "wall_s": round(wall, 2),
        # CPU time each rank got per second of wall time (< 1: cores shared with others)
        "cpu_share_per_rank": round(cpu / (world * wall), 2),
        "idle_core_structures_per_s": round(structures / idle_wall, 2),
        # mean over max of the ranks' per-step work (1: perfectly balanced shards)
        "balance": round(sum(sum(step) / len(step) for step in steps) / idle_wall, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of the 2-rank run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model", choices=sorted(MODELS), default="painn")
    parser.add_argument(
        "--sharding",
        choices=("round-robin", "balanced"),
        default="balanced",
        help="balanced (default, what `nvalchemi-training spec run` uses): "
        "SizeBalancedBatchSampler, equal atoms per rank and step; round-robin: what DDPHook "
        "installs into a loader without a distributed sampler",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_rank(args)), flush=True)
        return
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for round_index in range(args.rounds):
        for world in (1, 2) if round_index % 2 == 0 else (2, 1):
            record = launch(world, args)
            runs[world].append(record)
            print(json.dumps({**record, "round": round_index}), flush=True)
    rate = {w: statistics.median(r["structures_per_s"] for r in runs[w]) for w in runs}
    cpu = {w: statistics.median(r["cpu_ms_per_structure"] for r in runs[w]) for w in runs}
    efficiency = rate[2] / (2 * rate[1])
    idle = {w: statistics.median(r["idle_core_structures_per_s"] for r in runs[w]) for w in runs}
    print(
        json.dumps(
            {
                "benchmark": "ddp_scaling",
                "summary": True,
                "model": args.model,
                "sharding": args.sharding,
                "rounds": args.rounds,
                "structures_per_s_1_rank": rate[1],
                "structures_per_s_2_ranks": rate[2],
                "efficiency": round(efficiency, 3),
                "cpu_ms_per_structure_1_rank": cpu[1],
                "cpu_ms_per_structure_2_ranks": cpu[2],
                "cpu_efficiency": round(cpu[1] / cpu[2], 3),
                # from per-step CPU times: the efficiency on idle cores (imbalance included)
                "idle_core_efficiency": round(idle[2] / (2 * idle[1]), 3),
                "balance_2_ranks": statistics.median(r["balance"] for r in runs[2]),
                "target": 0.8,
                "meets_target": {
                    "wall": efficiency >= 0.8,
                    "idle_core": idle[2] / (2 * idle[1]) >= 0.8,
                },
                "cpu_count": os.cpu_count(),
                "load_average_1min": round(os.getloadavg()[0], 2),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
