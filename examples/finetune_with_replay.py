"""Fine-tune with and without replay, and measure what the model forgets.

On the bundled EMT data set:

1. *Pretraining*: a small PaiNN learns the structures made only of Cu, Ni, Pd and Pt
   (its reference energies are fitted on them; Al, Ag and Au have none yet).
2. *A shifted task*: structures made only of Al, Ag and Au, labelled at "another level
   of theory" (EMT plus a per-element energy offset).
3. Two fine-tunes of every parameter start from the pretraining checkpoint, with
   ``e0="estimated"`` (the offset of the new labels from the source model is fitted
   before the first step):

   * without replay: only the new task;
   * with replay: every batch also holds ``--replay-ratio`` structures of the
     pretraining domain, labelled once by the source model (``pseudo_label``).

   A zero-step check confirms each fine-tune starts from the source's forces.
4. Forgetting: the error on held-out pretraining-domain structures (validation split,
   true EMT labels) before and after each fine-tune (``ForgettingHook``).

Usage::

    python examples/finetune_with_replay.py
    python examples/finetune_with_replay.py --finetune-steps 50 --hidden 8   # quick

Every option has an environment-variable twin, e.g.
``NVALCHEMI_EXAMPLE_FINETUNE_STEPS=10``. The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
from pathlib import Path

import torch
from ase.data import atomic_numbers

from nvalchemi.data import ASEReader, bundled_split_path
from nvalchemi.data.datapipes import DataLoader, InMemoryDataset
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
from nvalchemi.training.finetune_parity import check_zero_step_parity
from nvalchemi.training.finetune_statistics import prepare_finetune_model
from nvalchemi.training.hooks import ForgettingHook
from nvalchemi.training.replay import mix_replay, pseudo_label

CUTOFF = 5.0  # Å
PRETRAIN_ELEMENTS = ("Cu", "Ni", "Pd", "Pt")
NEW_ELEMENTS = ("Al", "Ag", "Au")
OFFSETS = {"Al": 0.35, "Ag": -0.25, "Au": 0.15}  # eV per atom: the "other level of theory"


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
    option("pretrain-steps", 800, int, "optimizer steps of the pretraining run")
    option("finetune-steps", 400, int, "optimizer steps of each fine-tune")
    option("pretrain-size", 600, int, "pretraining structures (Cu/Ni/Pd/Pt)")
    option("finetune-size", 300, int, "fine-tuning structures (Al/Ag/Au)")
    option("replay-size", 200, int, "pretraining-domain structures labelled for replay")
    option("holdout-size", 100, int, "held-out pretraining-domain structures (forgetting)")
    option("replay-ratio", 0.3, float, "replay share of every fine-tuning batch")
    option("batch-size", 8, int, "structures per batch")
    option("lr", 3e-3, float, "pretraining learning rate")
    option("finetune-lr", 1e-3, float, "fine-tuning learning rate")
    option("hidden", 32, int, "PaiNN feature width")
    option("interactions", 2, int, "PaiNN message-passing blocks")
    option("out", "runs/finetune_replay_example", str, "run directory")
    return parser.parse_args()


def structures(split: str, elements: tuple[str, ...], size: int, shift: bool = False) -> list:
    """The first ``size`` structures of a bundled split made only of ``elements``."""
    reader = ASEReader(bundled_split_path(split))
    wanted = {atomic_numbers[e] for e in elements}
    out = []
    for i in range(len(reader)):
        data = reader.read_data(i)
        if not set(data.atomic_numbers.tolist()) <= wanted:
            continue
        if shift:  # the new level of theory: a per-element energy offset
            offset = sum(
                OFFSETS[e] * int((data.atomic_numbers == atomic_numbers[e]).sum()) for e in OFFSETS
            )
            data["energy"] = data["energy"] + offset
        out.append(data)
        if len(out) == size:
            break
    reader.close()
    return out


def dataset(data: list) -> InMemoryDataset:
    return InMemoryDataset(data_list=data, transforms=[NeighborListTransform(CUTOFF)])


def errors(summary: dict) -> dict[str, float]:
    return {
        "energy_per_atom_mae_meV": 1000 * float(summary["energy_per_atom_mae"]),
        "forces_mae_meV_per_A": 1000 * float(summary["forces_mae"]),
    }


def finetune(args, checkpoints, task, task_val, holdout, replay) -> dict:
    """One fine-tune from the checkpoint; ``replay`` (a dataset) or ``None``."""
    torch.manual_seed(1)
    forgetting = ForgettingHook(DataLoader(holdout, batch_size=args.batch_size))
    strategy = FineTuningStrategy.from_pretrained_checkpoint(
        checkpoints,
        use_original_loss=True,
        use_original_opt_class=True,
        optimizer_lr=args.finetune_lr,
        num_steps=args.finetune_steps,
        hooks=[forgetting],
        validation_config=ValidationConfig(
            validation_data=DataLoader(task_val, batch_size=args.batch_size)
        ),
    )
    model = strategy.models["main"]
    source = copy.deepcopy(model)
    stats = prepare_finetune_model(model, task, e0="estimated")
    parity = check_zero_step_parity(source, model, [task[i] for i in range(4)])
    if replay is None:
        loader = DataLoader(task, batch_size=args.batch_size, shuffle=True, seed=0)
    else:
        mixed = mix_replay(task, replay, batch_size=args.batch_size, ratio=args.replay_ratio)
        loader = mixed.loader()
    strategy.run(loader)
    result = forgetting.result
    return {
        "new_elements": stats.new_elements,
        "fitted_offsets_eV": {
            e: stats.atomic_energies[e] - stats.source_atomic_energies[e] for e in NEW_ELEMENTS
        },
        "zero_step_force_difference": parity.max_abs["forces"],
        "forgetting_before": errors(result["before"]),
        "forgetting_after": errors(result["after"]),
        "task_after": errors(strategy.last_validation),
        "steps": strategy.step_count,
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    out = Path(args.out)
    checkpoints = out / "pretrain_checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)  # this script's own output of a past run

    pretrain_data = structures("train", PRETRAIN_ELEMENTS, args.pretrain_size)
    holdout = dataset(structures("val", PRETRAIN_ELEMENTS, args.holdout_size))
    task = dataset(structures("train", NEW_ELEMENTS, args.finetune_size, shift=True))
    task_val = dataset(structures("val", NEW_ELEMENTS, args.holdout_size, shift=True))

    # 1. pretraining on Cu/Ni/Pd/Pt; the model has embedding rows for every element
    torch.manual_seed(0)
    model = PaiNN.from_data(
        pretrain_data,
        elements=[atomic_numbers[e] for e in ELEMENTS],
        cutoff=CUTOFF,
        hidden_channels=args.hidden,
        num_interactions=args.interactions,
    )
    pretrain = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(
            torch.optim.AdamW,
            {"lr": args.lr},
            scheduler_cls=torch.optim.lr_scheduler.CosineAnnealingLR,
            scheduler_kwargs={"T_max": args.pretrain_steps, "eta_min": args.lr * 0.05},
        ),
        loss_fn=EnergyMSELoss(per_atom=True) + 10.0 * ForceMSELoss(),
        num_steps=args.pretrain_steps,
        validation_config=ValidationConfig(
            validation_data=DataLoader(holdout, batch_size=args.batch_size)
        ),
    )
    pretrain.run(DataLoader(dataset(pretrain_data), batch_size=args.batch_size, shuffle=True))
    pretrain.save_checkpoint(checkpoints)
    source = pretrain.models["main"]
    print(f"pretrained: held-out {errors(pretrain.last_validation)}", flush=True)

    # 2. replay: pretraining-domain structures labelled once by the source model
    replay = pseudo_label(source, pretrain_data[: args.replay_size])

    # 3. the two fine-tunes
    runs = {}
    for name, replay_data in (("no_replay", None), ("replay", replay)):
        runs[name] = finetune(args, checkpoints, task, task_val, holdout, replay_data)
        run = runs[name]
        print(
            f"{name:<10} forgetting E/atom MAE {run['forgetting_before']['energy_per_atom_mae_meV']:6.2f}"
            f" -> {run['forgetting_after']['energy_per_atom_mae_meV']:6.2f} meV, "
            f"F MAE {run['forgetting_before']['forces_mae_meV_per_A']:6.1f}"
            f" -> {run['forgetting_after']['forces_mae_meV_per_A']:6.1f} meV/Å; "
            f"new task E/atom MAE {run['task_after']['energy_per_atom_mae_meV']:6.2f} meV, "
            f"F MAE {run['task_after']['forces_mae_meV_per_A']:6.1f} meV/Å",
            flush=True,
        )
    summary = {"pretrain_steps": pretrain.step_count, **runs}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
