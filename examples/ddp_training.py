"""Data-parallel training of PaiNN on the bundled EMT data set (one script, any launch).

The same file runs as one process or as many::

    python examples/ddp_training.py --steps 20
    torchrun --standalone --nproc_per_node=2 examples/ddp_training.py --steps 20
    torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d \\
        --rdzv_endpoint host:29500 examples/ddp_training.py
    srun python examples/ddp_training.py          # inside a Slurm allocation

``DistributedManager.initialize()`` reads torchrun's or Slurm's variables (a single
process otherwise) and ``DDPHook`` wraps the model in ``DistributedDataParallel``
and gives every rank its own shard of the training set. Validation runs on a
different slice on each rank; the strategy all-reduces its sums, so every rank
reports the metrics of the whole validation set. ``CheckpointHook`` is registered on
every rank (saving is collective) and writes from rank 0 only. On ``SIGTERM``/
``SIGUSR1`` (a scheduler about to preempt the job) training stops after the current
step, checkpoints and exits with status 75; ``--resume`` continues from the latest
checkpoint exactly (see ``docs/distributed.md`` for an sbatch script that requeues).

Sizes are small by default (a few minutes on two CPU cores); every option has an
environment-variable twin, e.g. ``NVALCHEMI_EXAMPLE_STEPS=20``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from ase.data import atomic_numbers

from nvalchemi.data import ASEReader, bundled_split_path
from nvalchemi.data.datapipes import DataLoader, Dataset
from nvalchemi.data.emt_generator import ELEMENTS
from nvalchemi.data.neighbors import NeighborListTransform
from nvalchemi.distributed import DistributedManager
from nvalchemi.models import PaiNN
from nvalchemi.training import (
    CheckpointHook,
    EnergyMSELoss,
    ForceMSELoss,
    OptimizerConfig,
    StressMSELoss,
    TrainingStage,
    TrainingStrategy,
    ValidationConfig,
)
from nvalchemi.training.hooks import DDPHook
from nvalchemi.training.preemption import PreemptionHandler

OUTPUTS = {"energy", "forces", "stress"}
CUTOFF = 5.0  # Å


def parse_args() -> argparse.Namespace:
    def option(name: str, default: object, kind: type, help: str) -> None:
        env = "NVALCHEMI_EXAMPLE_" + name.upper().replace("-", "_")
        parser.add_argument(
            f"--{name}",
            type=kind,
            default=kind(os.environ.get(env, default)),
            help=f"{help} (env {env}; default {default})",
        )

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    option("steps", 200, int, "optimizer steps")
    option("batch-size", 16, int, "structures per batch on each rank")
    option("lr", 2e-3, float, "learning rate")
    option("train-size", 0, int, "use the first N training structures (0: all 2400)")
    option("val-size", 64, int, "validation structures (shared out across ranks)")
    option("val-every", 50, int, "validate every N steps")
    option("fit-size", 200, int, "structures used to fit reference energies and scale")
    option("hidden", 32, int, "PaiNN feature width")
    option("interactions", 2, int, "PaiNN message-passing blocks")
    option("out", "runs/ddp_example", str, "run directory (checkpoints)")
    option("checkpoint-every", 100, int, "checkpoint every N steps")
    option("backend", "", str, "process-group backend (default: nccl on GPUs, gloo on CPU)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    return parser.parse_args()


def datasets(args: argparse.Namespace, manager: DistributedManager):
    """Training set (sharded by DDPHook) and this rank's slice of the validation set."""
    neighbors = NeighborListTransform(CUTOFF, cache=True)  # built once per structure
    train_index = f":{args.train_size}" if args.train_size else ":"
    train = Dataset(
        ASEReader(bundled_split_path("train"), index=train_index), transforms=[neighbors]
    )
    val = Dataset(
        ASEReader(bundled_split_path("val"), index=f":{args.val_size}"),
        transforms=[NeighborListTransform(CUTOFF)],
    )
    # Each rank validates every world_size-th structure: disjoint slices, all-reduced metrics.
    mine = torch.utils.data.Subset(val, range(manager.rank, len(val), manager.world_size))
    return train, mine


def build_model(args: argparse.Namespace) -> PaiNN:
    fit = ASEReader(bundled_split_path("train"), index=f":{args.fit_size}")
    structures = [fit.read_data(i) for i in range(len(fit))]
    torch.manual_seed(0)  # every rank builds the same model (DDP also broadcasts rank 0's)
    model = PaiNN.from_data(
        structures,
        elements=[atomic_numbers[symbol] for symbol in ELEMENTS],  # all of the data set
        cutoff=CUTOFF,
        hidden_channels=args.hidden,
        num_interactions=args.interactions,
    )
    model.set_config("active_outputs", OUTPUTS)
    return model


class PrintValidation:
    """Print validation metrics on rank 0 (every rank holds the same all-reduced values)."""

    frequency = 1
    stage = TrainingStage.AFTER_VALIDATION

    def __call__(self, ctx, stage) -> None:
        if ctx.global_rank == 0:
            v = ctx.validation
            print(
                f"step {ctx.step_count:5d}  val loss {float(v['total_loss']):.4f}  "
                f"E/atom MAE {1000 * float(v['energy_per_atom_mae']):.1f} meV  "
                f"F MAE {1000 * float(v['forces_mae']):.1f} meV/Å  "
                f"({int(v['num_structures'])} structures)",
                flush=True,
            )


def main() -> None:
    args = parse_args()
    DistributedManager.initialize(backend=args.backend or None)  # also a single process
    manager = DistributedManager()
    checkpoints = Path(args.out) / "checkpoints"
    # Hook order matters at teardown (reverse order): DDPHook first, so it goes last.
    hooks = [
        DDPHook(),
        CheckpointHook(checkpoints, step_interval=args.checkpoint_every, keep_last=2),
        PreemptionHandler(),
        PrintValidation(),
    ]
    train, val = datasets(args, manager)
    validation = ValidationConfig(
        validation_data=DataLoader(val, batch_size=args.batch_size), every_n_steps=args.val_every
    )
    if args.resume and (checkpoints / "manifest.json").exists():
        strategy = TrainingStrategy.load_checkpoint(
            checkpoints,
            map_location=manager.device,
            hooks=hooks,
            overrides={
                "num_steps": args.steps,
                "distributed_manager": manager,
                "validation_config": validation,
            },
        )
        strategy.models["main"].set_config("active_outputs", OUTPUTS)  # a runtime setting
    else:
        strategy = TrainingStrategy(
            models=build_model(args),
            optimizer_configs=OptimizerConfig(torch.optim.AdamW, {"lr": args.lr}),
            loss_fn=EnergyMSELoss(per_atom=True) + 10.0 * ForceMSELoss() + 100.0 * StressMSELoss(),
            num_steps=args.steps,
            validation_config=validation,
            devices=[manager.device],
            distributed_manager=manager,
            hooks=hooks,
        )
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, seed=0)
    if manager.rank == 0:
        print(
            f"training PaiNN on {len(train)} structures, {manager.world_size} rank(s) "
            f"({manager.backend or 'single process'}), {args.batch_size} per rank per step, "
            f"from step {strategy.step_count} to {args.steps}",
            flush=True,
        )
    strategy.run(loader)
    if manager.rank == 0:
        print(f"done: {strategy.step_count} steps; checkpoints in {checkpoints}", flush=True)
    DistributedManager.cleanup()


if __name__ == "__main__":
    main()
