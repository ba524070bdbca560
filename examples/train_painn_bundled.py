"""Train PaiNN on the bundled EMT data set with the Python API.

This is what ``nvalchemi-training quickstart`` does, written out: the bundled
train/val/test splits with neighbour lists built once, a PaiNN whose reference
energies and scale/shift are fitted to the training data, AdamW with warm-up and
cosine decay, per-atom energy + force loss, EMA weights, gradient clipping,
validation and a checkpoint every epoch, live progress and ``metrics.jsonl``. At the
end it evaluates the EMA weights on the test split, plots the learning curves and
runs the checkpoint as an ASE calculator.

Usage::

    python examples/train_painn_bundled.py                 # ~10 epochs, a few minutes
    python examples/train_painn_bundled.py --epochs 2 --max-train 64 --hidden 8

Every option has an environment-variable twin, e.g. ``NVALCHEMI_EXAMPLE_EPOCHS=2``.
The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from ase.build import bulk
from ase.data import atomic_numbers

from nvalchemi.data import ASEReader, bundled_split_path
from nvalchemi.data.datapipes import DataLoader, InMemoryDataset
from nvalchemi.data.emt_generator import ELEMENTS
from nvalchemi.data.neighbors import NeighborListTransform
from nvalchemi.hooks.reporting import (
    JSONLinesReporter,
    ReportingOrchestrator,
    RichReporter,
    plot_learning_curves,
)
from nvalchemi.models import NvalchemiCalculator, PaiNN
from nvalchemi.training import (
    CheckpointHook,
    ComposedLossFunction,
    EMAHook,
    EnergyMSELoss,
    ForceMSELoss,
    OptimizerConfig,
    TrainingStrategy,
    ValidationConfig,
)
from nvalchemi.training.checkpoint import load_model_from_checkpoint
from nvalchemi.training.hooks import GradientClipHook


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])

    def option(name: str, default: object, kind: type, help: str) -> None:
        env = "NVALCHEMI_EXAMPLE_" + name.upper().replace("-", "_")
        value = os.environ.get(env)
        parser.add_argument(
            f"--{name}",
            type=kind,
            help=f"{help} (env {env})",
            default=default if value is None else kind(value),
        )

    option("epochs", 10, int, "training epochs")
    option("max-train", 0, int, "use only the first N training structures (0: all 2400)")
    option("max-eval", 0, int, "use only the first N validation/test structures (0: all)")
    option("batch-size", 8, int, "structures per batch")
    option("hidden", 32, int, "PaiNN feature width")
    option("cutoff", 5.0, float, "neighbour cutoff in Å")
    option("lr", 3e-3, float, "peak learning rate")
    option("out", "runs/train_painn_bundled", str, "run directory")
    return parser.parse_args()


def split(name: str, limit: int, cutoff: float) -> InMemoryDataset:
    """A bundled split in memory, its neighbour lists computed once."""
    reader = ASEReader(bundled_split_path(name), index=f":{limit}" if limit else ":")
    return InMemoryDataset(reader=reader, transforms=[NeighborListTransform(cutoff)])


def test_mae(model: PaiNN, loader: DataLoader) -> tuple[float, float]:
    """Energy-per-atom MAE (meV/atom) and force-component MAE (meV/Å)."""
    energy_error, force_error, structures, components = 0.0, 0.0, 0, 0
    for batch in loader:
        out = model(batch)  # forces come from autograd, so no torch.no_grad() here
        atoms = batch.num_nodes_per_graph.unsqueeze(-1)
        energy_error += float(((out["energy"].detach() - batch.energy) / atoms).abs().sum())
        force_error += float((out["forces"].detach() - batch.forces).abs().sum())
        structures, components = structures + batch.num_graphs, components + batch.forces.numel()
    return 1000 * energy_error / structures, 1000 * force_error / components


def main() -> None:
    args = parse_args()
    run = Path(args.out)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # this script's own earlier output
    (run / "metrics.jsonl").unlink(missing_ok=True)
    torch.manual_seed(0)

    train = DataLoader(
        split("train", args.max_train, args.cutoff),
        batch_size=args.batch_size,
        shuffle=True,
        seed=0,
    )
    val = DataLoader(split("val", args.max_eval, args.cutoff), batch_size=16)
    test = DataLoader(split("test", args.max_eval, args.cutoff), batch_size=16)

    # Elements, reference energies E0 and the energy scale/shift come from the data.
    model = PaiNN.from_data(
        train,
        elements=[atomic_numbers[s] for s in ELEMENTS],  # every element of the data set
        cutoff=args.cutoff,
        hidden_channels=args.hidden,
        num_interactions=2,
        num_rbf=16,
    )
    steps = args.epochs * len(train)
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(
            torch.optim.AdamW,
            {"lr": args.lr, "weight_decay": 0.0},
            torch.optim.lr_scheduler.OneCycleLR,  # 3 % linear warm-up, cosine to 1 % of peak
            {
                "max_lr": args.lr,
                "total_steps": steps + 1,
                "pct_start": 0.03,
                "div_factor": 25.0,
                "final_div_factor": 4.0,
                "cycle_momentum": False,
            },
        ),
        loss_fn=ComposedLossFunction(
            [EnergyMSELoss(per_atom=True), ForceMSELoss()],
            weights=[10.0, 1.0],
            normalize_weights=False,
        ),
        validation_config=ValidationConfig(validation_data=val, every_n_epochs=1),
        hooks=[
            EMAHook(decay=0.995),
            GradientClipHook(10.0),
            CheckpointHook(run / "checkpoints", epoch_interval=1, keep_last=3, keep_best=1),
            ReportingOrchestrator(
                [RichReporter(), JSONLinesReporter(run)],
                stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"},
                frequency=20,
            ),
        ],
        num_epochs=args.epochs,
    )
    strategy.run(train)

    # Test metrics of the EMA weights of the final checkpoint.
    final = load_model_from_checkpoint(run / "checkpoints", use_ema=True)
    energy, forces = test_mae(final, test)
    print(f"test MAE: energy {energy:.2f} meV/atom, forces {forces:.1f} meV/Å", flush=True)
    curves = plot_learning_curves(run / "metrics.jsonl", run / "learning_curves.png")

    # The checkpoint as an ASE calculator (EMA weights of the latest checkpoint).
    atoms = bulk("Cu", "fcc", cubic=True) * (2, 2, 2)
    atoms.rattle(stdev=0.05, seed=1)
    atoms.calc = NvalchemiCalculator.from_checkpoint(run / "checkpoints")
    print(f"rattled Cu supercell: {atoms.get_potential_energy():.4f} eV", flush=True)

    summary = {
        "steps": strategy.step_count,
        "epochs": strategy.epoch_count,
        "test_energy_per_atom_mae_meV": energy,
        "test_forces_mae_meV_per_A": forces,
        "checkpoints": str(run / "checkpoints"),
        "learning_curves": str(curves),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
