"""Pretrain a small PaiNN, checkpoint it, then fine-tune only its readout on new data.

Two stages on the bundled EMT data set:

1. *Pretraining*: a ``TrainingStrategy`` trains every parameter of a small PaiNN on
   the first ``--pretrain-size`` training structures and writes a checkpoint.
2. *Fine-tuning*: ``FineTuningStrategy.from_pretrained_checkpoint`` starts a new run
   (step 0) from the checkpointed weights, reusing the pretraining loss and optimizer
   class with a smaller learning rate, and trains only the readout MLP
   (``trainable_patterns=("main.readout.*",)``) on the next ``--finetune-size``
   structures. The message-passing body stays bitwise unchanged, which the script
   checks.

Usage::

    python examples/finetune_from_checkpoint.py
    python examples/finetune_from_checkpoint.py --pretrain-steps 300 --hidden 32

Every option has an environment-variable twin, e.g.
``NVALCHEMI_EXAMPLE_PRETRAIN_STEPS=10``. The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from ase.data import atomic_numbers

from nvalchemi.data import ASEReader, bundled_split_path
from nvalchemi.data.datapipes import DataLoader, Dataset
from nvalchemi.data.emt_generator import ELEMENTS
from nvalchemi.data.neighbors import NeighborListTransform
from nvalchemi.models import PaiNN
from nvalchemi.training import (
    EnergyMSELoss,
    FineTuningStrategy,
    ForceMSELoss,
    OptimizerConfig,
    TrainingStrategy,
    ValidationConfig,
)

CUTOFF = 5.0  # Å
READOUT = "main.readout.*"  # qualified names: "<model key>.<parameter name>"


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
    option("pretrain-steps", 60, int, "optimizer steps of the pretraining run")
    option("finetune-steps", 30, int, "optimizer steps of the fine-tuning run")
    option("pretrain-size", 128, int, "pretraining structures (the first N of the train split)")
    option("finetune-size", 64, int, "fine-tuning structures (the next N)")
    option("val-size", 32, int, "validation structures (from the val split)")
    option("batch-size", 8, int, "structures per batch")
    option("lr", 3e-3, float, "pretraining learning rate")
    option("finetune-lr", 1e-3, float, "fine-tuning learning rate")
    option("hidden", 16, int, "PaiNN feature width")
    option("interactions", 2, int, "PaiNN message-passing blocks")
    option("out", "runs/finetune_example", str, "run directory (checkpoints)")
    return parser.parse_args()


def loader(split: str, start: int, size: int, batch_size: int, shuffle: bool) -> DataLoader:
    """Structures ``start:start+size`` of a bundled split, with cached neighbour lists."""
    reader = ASEReader(bundled_split_path(split), index=f"{start}:{start + size}")
    dataset = Dataset(reader, transforms=[NeighborListTransform(CUTOFF, cache=True)])
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, seed=0)


def build_model(args: argparse.Namespace) -> PaiNN:
    fit = ASEReader(bundled_split_path("train"), index=f":{args.pretrain_size}")
    torch.manual_seed(0)
    return PaiNN.from_data(
        [fit.read_data(i) for i in range(len(fit))],
        elements=[atomic_numbers[symbol] for symbol in ELEMENTS],  # all elements of the data
        cutoff=CUTOFF,
        hidden_channels=args.hidden,
        num_interactions=args.interactions,
    )


def report(stage: str, summary: dict) -> dict[str, float]:
    metrics = {
        "energy_per_atom_mae_meV": 1000 * float(summary["energy_per_atom_mae"]),
        "forces_mae_meV_per_A": 1000 * float(summary["forces_mae"]),
    }
    print(
        f"{stage:<22} E/atom MAE {metrics['energy_per_atom_mae_meV']:7.1f} meV   "
        f"F MAE {metrics['forces_mae_meV_per_A']:7.1f} meV/Å",
        flush=True,
    )
    return metrics


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    checkpoints = Path(args.out) / "pretrain_checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)  # this script's own output of a past run
    validation = ValidationConfig(
        validation_data=loader("val", 0, args.val_size, args.batch_size, shuffle=False)
    )

    # 1. pretraining: every parameter trains
    pretrain = TrainingStrategy(
        models=build_model(args),
        optimizer_configs=OptimizerConfig(torch.optim.AdamW, {"lr": args.lr}),
        loss_fn=EnergyMSELoss(per_atom=True) + 10.0 * ForceMSELoss(),
        num_steps=args.pretrain_steps,
        validation_config=validation,
    )
    pretrain.run(loader("train", 0, args.pretrain_size, args.batch_size, shuffle=True))
    report("pretrained", pretrain.last_validation or pretrain.validate())
    pretrain.save_checkpoint(checkpoints)
    pretrained = {n: p.detach().clone() for n, p in pretrain.models["main"].named_parameters()}

    # 2. fine-tuning: a new run from the checkpoint; only the readout trains
    finetune = FineTuningStrategy.from_pretrained_checkpoint(
        checkpoints,
        use_original_loss=True,  # the pretraining loss
        use_original_opt_class=True,  # AdamW and its kwargs, with lr=optimizer_lr
        optimizer_lr=args.finetune_lr,
        trainable_patterns=(READOUT,),
        num_steps=args.finetune_steps,
        validation_config=validation,
    )
    new_data = loader("train", args.pretrain_size, args.finetune_size, args.batch_size, True)
    before = report("before fine-tuning", finetune.validate())
    finetune.run(new_data)
    after = report("after fine-tuning", finetune.last_validation or finetune.validate())

    model = finetune.models["main"]
    moved = sorted(
        n for n, p in model.named_parameters() if not torch.equal(p.detach(), pretrained[n])
    )
    body_unchanged = all(n.startswith("readout.") for n in moved)
    print(f"parameters changed by fine-tuning: {moved}", flush=True)
    summary = {
        "pretrain_steps": pretrain.step_count,
        "finetune_steps": finetune.step_count,
        "readout_changed": bool(moved),
        "body_unchanged": body_unchanged,
        "before": before,
        "after": after,
        "checkpoint": str(checkpoints),
    }
    print(json.dumps(summary), flush=True)
    if not (body_unchanged and moved):
        raise SystemExit("fine-tuning changed the frozen body or did not train the readout")


if __name__ == "__main__":
    main()
