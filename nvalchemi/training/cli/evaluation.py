"""Evaluate a model on a data set: predictions, metrics, per-element errors, parity plots.

:func:`predict` runs a model over a loader and keeps per-structure energies per atom,
per-atom forces and stresses with their references (missing labels are NaN);
:class:`Evaluation` turns them into metrics (MAE/RMSE of energy per atom, forces and
stress; forces per element) and parity PNGs.

Units: energies in eV, forces in eV/Å, stress in eV/Å³ (the tables show meV).

Example:
    >>> import numpy as np
    >>> ev = Evaluation(energy_per_atom_pred=np.array([1.0, 2.0]),
    ...                 energy_per_atom_ref=np.array([1.5, 2.0]))
    >>> ev.metrics()["energy_per_atom_mae"]
    0.25
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Evaluation", "predict"]


def _mae_rmse(pred: np.ndarray | None, ref: np.ndarray | None) -> tuple[float, float, int]:
    if pred is None or ref is None or pred.size == 0:
        return math.nan, math.nan, 0
    error = (pred - ref).reshape(-1)
    error = error[np.isfinite(error)]
    if error.size == 0:
        return math.nan, math.nan, 0
    return float(np.abs(error).mean()), float(np.sqrt((error**2).mean())), int(error.size)


@dataclass
class Evaluation:
    """Predictions and references of one evaluation pass (NumPy, float64)."""

    energy_per_atom_pred: np.ndarray = field(default_factory=lambda: np.zeros(0))
    energy_per_atom_ref: np.ndarray = field(default_factory=lambda: np.zeros(0))
    forces_pred: np.ndarray | None = None
    forces_ref: np.ndarray | None = None
    stress_pred: np.ndarray | None = None
    stress_ref: np.ndarray | None = None
    species: np.ndarray | None = None
    num_atoms: int = 0

    @property
    def num_structures(self) -> int:
        return int(self.energy_per_atom_ref.size)

    def metrics(self) -> dict[str, float]:
        """MAE/RMSE of energy per atom (eV/atom), forces (eV/Å) and stress (eV/Å³)."""
        out: dict[str, float] = {"num_structures": self.num_structures, "num_atoms": self.num_atoms}
        for name, pred, ref in (
            ("energy_per_atom", self.energy_per_atom_pred, self.energy_per_atom_ref),
            ("forces", self.forces_pred, self.forces_ref),
            ("stress", self.stress_pred, self.stress_ref),
        ):
            mae, rmse, count = _mae_rmse(pred, ref)
            if count:
                out[f"{name}_mae"] = mae
                out[f"{name}_rmse"] = rmse
        return out

    def per_element(self) -> dict[str, dict[str, float]]:
        """Force MAE/RMSE (eV/Å) per element: ``{symbol: {"atoms", "forces_mae", "forces_rmse"}}``."""
        from ase.data import chemical_symbols

        if self.species is None or self.forces_pred is None or self.forces_ref is None:
            return {}
        out = {}
        for z in np.unique(self.species):
            mask = self.species == z
            mae, rmse, count = _mae_rmse(self.forces_pred[mask], self.forces_ref[mask])
            if count:
                out[chemical_symbols[int(z)]] = {
                    "atoms": int(mask.sum()),
                    "forces_mae": mae,
                    "forces_rmse": rmse,
                }
        return out

    def parity_plots(self, out_dir: str | Path) -> list[Path]:
        """``parity_energy_per_atom.png`` and ``parity_forces.png`` in ``out_dir``."""
        from nvalchemi.hooks.reporting import parity_plots

        has_forces = self.forces_pred is not None and self.forces_ref is not None
        return parity_plots(
            self.energy_per_atom_pred,
            self.energy_per_atom_ref,
            self.forces_pred if has_forces else None,
            self.forces_ref if has_forces else None,
            out_dir,
        )


def _stress_outputs(model: Any) -> bool:
    config = getattr(model, "model_config", None)
    return config is not None and "stress" in getattr(config, "outputs", ())


def predict(
    model: Any, loader: Any, *, device: Any = "cpu", stress: bool = True, head: str | None = None
) -> Evaluation:
    """Run ``model`` (eval mode) over ``loader``; collect predictions and references.

    ``head`` picks the readout head of a multi-head model (default: its default head).
    """
    import torch

    device = torch.device(device)
    config = getattr(model, "model_config", None)
    previous = None if config is None else config.active_outputs
    if config is not None:
        wanted = {"energy", "forces"} & set(config.outputs)
        if stress and _stress_outputs(model):
            wanted.add("stress")
        config.active_outputs = wanted
    was_training = model.training
    model.eval()
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("ep", "er", "fp", "fr", "sp", "sr", "z")}
    atoms = 0
    try:
        for batch in loader:
            batch = batch.to(device)
            out = model(batch) if head is None else model(batch, head=head)
            counts = batch.num_nodes_per_graph.double().reshape(-1, 1)
            parts["ep"].append(
                (out["energy"].detach().double().reshape(-1, 1) / counts).cpu().numpy()
            )
            parts["er"].append((batch.energy.double().reshape(-1, 1) / counts).cpu().numpy())
            parts["z"].append(batch.atomic_numbers.cpu().numpy())
            atoms += int(batch.num_nodes)
            if out.get("forces") is not None and "forces" in batch:
                parts["fp"].append(out["forces"].detach().double().cpu().numpy())
                parts["fr"].append(batch.forces.double().cpu().numpy())
            if out.get("stress") is not None and "stress" in batch:
                parts["sp"].append(out["stress"].detach().double().cpu().numpy().reshape(-1, 9))
                parts["sr"].append(batch.stress.double().cpu().numpy().reshape(-1, 9))
    finally:
        model.train(was_training)
        if config is not None:
            config.active_outputs = previous

    def cat(key: str) -> np.ndarray | None:
        return np.concatenate(parts[key]) if parts[key] else None

    return Evaluation(
        energy_per_atom_pred=cat("ep").reshape(-1) if parts["ep"] else np.zeros(0),
        energy_per_atom_ref=cat("er").reshape(-1) if parts["er"] else np.zeros(0),
        forces_pred=cat("fp"),
        forces_ref=cat("fr"),
        stress_pred=cat("sp"),
        stress_ref=cat("sr"),
        species=cat("z"),
        num_atoms=atoms,
    )


def metrics_rows(metrics: dict[str, float]) -> list[tuple[str, str, str, str]]:
    """``(quantity, MAE, RMSE, unit)`` rows in meV for the terminal table."""
    rows = []
    for key, label, unit in (
        ("energy_per_atom", "energy per atom", "meV/atom"),
        ("forces", "forces (components)", "meV/Å"),
        ("stress", "stress (components)", "meV/Å³"),
    ):
        if f"{key}_mae" in metrics:
            rows.append(
                (
                    label,
                    f"{1000 * metrics[f'{key}_mae']:.2f}",
                    f"{1000 * metrics[f'{key}_rmse']:.2f}",
                    unit,
                )
            )
    return rows
