"""Small fine-tuning sources for the CLI tests: a PaiNN checkpoint saved without training
(its loss and outputs as a run records them) and relabelled copies of the bundled data."""

from __future__ import annotations

from pathlib import Path

import torch

from ._support import TRAIN

ELEMENTS = [13, 28, 29, 46, 78, 79]  # those of the bundled data
WEIGHTS = [2.0, 3.0, 50.0]  # not the quickstart's: kept weights are the source's own
POLICY = "prediction_to_target"  # not the default either


def painn_source(root: Path, *, stress: bool) -> Path:
    """A checkpoint of a tiny PaiNN whose run trained energy, forces (and stress)."""
    from nvalchemi.models.painn import PaiNN
    from nvalchemi.training import OptimizerConfig, TrainingStrategy
    from nvalchemi.training.losses import (
        ComposedLossFunction,
        EnergyMSELoss,
        ForceMSELoss,
        StressMSELoss,
    )

    outputs = ["energy", "forces", "stress"] if stress else ["energy", "forces"]
    terms = [EnergyMSELoss(per_atom=True), ForceMSELoss()] + ([StressMSELoss()] if stress else [])
    model = PaiNN(
        cutoff=4.0,
        hidden_channels=8,
        num_interactions=1,
        num_rbf=4,
        elements=ELEMENTS,
        active_outputs=outputs,
    )
    strategy = TrainingStrategy(
        models=model,
        loss_fn=ComposedLossFunction(
            terms, weights=WEIGHTS[: len(terms)], normalize_weights=False, dtype_policy=POLICY
        ),
        optimizer_configs=OptimizerConfig(torch.optim.AdamW, {"lr": 1e-3}),
        num_steps=1,
        devices=["cpu"],
    )
    strategy.save_checkpoint(root)
    return root


def relabelled(
    path: Path, count: int, *, energy: bool = True, forces: bool = True, stress: bool = True
) -> Path:
    """The first ``count`` bundled structures at ``path`` with only the labels asked for."""
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator

    out = []
    for atoms in ase.io.read(TRAIN, f":{count}"):
        labels = {
            "energy": atoms.get_potential_energy() if energy else None,
            "forces": atoms.get_forces() if forces else None,
            "stress": atoms.get_stress() if stress else None,
        }
        atoms = atoms.copy()
        atoms.calc = SinglePointCalculator(
            atoms, **{k: v for k, v in labels.items() if v is not None}
        )
        out.append(atoms)
    ase.io.write(path, out)
    return path
