"""Evaluate a model on data: predictions, errors overall and per structure type, parity plots.

:func:`predict` runs a model over a loader and keeps, per structure, the energy per
atom, the atom count and the stress, and, per atom, the forces and the element, each
with its reference (a missing label is NaN). :class:`Evaluation` turns them into

* :meth:`~Evaluation.metrics`: MAE/RMSE of energy per atom, force components and
  stress components over everything;
* :meth:`~Evaluation.by_group` / :meth:`~Evaluation.by_source`: the same per structure
  type (``config_type`` of extxyz files, any ``--group-by`` info key, else atom-count
  ranges) and per input file -- slabs that are five times worse than bulk are invisible
  in the overall numbers;
* :meth:`~Evaluation.per_element`: force errors of each element's atoms, energy and
  stress errors of the structures that contain it;
* :meth:`~Evaluation.force_bins`: force errors binned by the reference force magnitude;
* :meth:`~Evaluation.parity_plots`: energy, force and stress parity PNGs.

:func:`evaluate_readers` does all of it for readers (files) and a model;
:func:`evaluate_final_model` for the final model of a training run (its EMA weights
when the run kept them). Units: energies eV (per atom: eV/atom), forces eV/Å, stress
eV/Å³; :data:`UNITS` names them and :func:`error_rows` gives printable rows in meV.

Example:
    >>> import numpy as np
    >>> ev = Evaluation(energy_per_atom_pred=np.array([1.0, 2.0]),
    ...                 energy_per_atom_ref=np.array([1.5, 2.0]),
    ...                 groups=np.array(["bulk", "slab"]))
    >>> ev.metrics()["energy_per_atom_mae"], ev.by_group()["slab"]["energy_per_atom_mae"]
    (0.25, 0.0)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FORCE_BINS",
    "QUANTITIES",
    "UNITS",
    "Evaluation",
    "calibrate",
    "error_rows",
    "evaluate_final_model",
    "evaluate_readers",
    "final_model",
    "predict",
    "store_calibration",
    "structure_groups",
]

QUANTITIES = ("energy_per_atom", "forces", "stress")
"""The compared quantities, in the order tables show them."""

UNITS = {"energy_per_atom": "eV/atom", "forces": "eV/Å", "stress": "eV/Å³"}
"""Units of the metric values (:meth:`Evaluation.metrics` and friends)."""

DISPLAY = {"energy_per_atom": "meV/atom", "forces": "meV/Å", "stress": "meV/Å³"}
"""Units of the printed numbers (1000 times the metric values)."""

FORCE_BINS = (0.0, 0.1, 0.3, 1.0, 3.0, math.inf)
"""Edges (eV/Å) of the reference force-magnitude bins of :meth:`Evaluation.force_bins`."""

_ATOM_RANGES = (1, 8, 16, 32, 64, 128, 256, 512, 1024)


def _mae_rmse(pred: np.ndarray | None, ref: np.ndarray | None) -> tuple[float, float, int]:
    """MAE, RMSE and count by validation's :func:`~nvalchemi.training.validation.error_sums`
    (a NaN reference is missing; a NaN prediction shows)."""
    import torch  # light: torch and the engine load when a report computes metrics

    from nvalchemi.training.validation import error_sums, mae_rmse

    if pred is None or ref is None or pred.size == 0:
        return math.nan, math.nan, 0
    sums = error_sums(
        torch.from_numpy(np.asarray(pred, float)), torch.from_numpy(np.asarray(ref, float))
    )
    count = int(sums[2])
    if count == 0:
        return math.nan, math.nan, 0
    mae, rmse = mae_rmse(sums)
    return float(mae), float(rmse), count


@dataclass
class Evaluation:
    """Predictions and references of one evaluation pass (NumPy, float64).

    Per structure: ``energy_per_atom_*`` ``(S,)``, ``atoms_per_structure`` ``(S,)``,
    ``stress_*`` ``(S, 9)``, ``groups`` and ``sources`` ``(S,)`` labels. Per atom:
    ``forces_*`` ``(N, 3)``, ``species`` ``(N,)``. Missing references are NaN.
    """

    energy_per_atom_pred: np.ndarray = field(default_factory=lambda: np.zeros(0))
    energy_per_atom_ref: np.ndarray = field(default_factory=lambda: np.zeros(0))
    forces_pred: np.ndarray | None = None
    forces_ref: np.ndarray | None = None
    stress_pred: np.ndarray | None = None
    stress_ref: np.ndarray | None = None
    species: np.ndarray | None = None
    num_atoms: int = 0
    atoms_per_structure: np.ndarray | None = None
    groups: np.ndarray | None = None
    """Structure type of each structure (see :func:`structure_groups`)."""
    sources: np.ndarray | None = None
    """Input file of each structure."""
    energy_std: np.ndarray | None = None
    """A committee's spreads (see :mod:`nvalchemi.app.uncertainty`): energy std ``(S,)``
    (eV, per structure), ``forces_std`` ``(N, 3)``, ``stress_std`` ``(S, 9)``."""
    forces_std: np.ndarray | None = None
    stress_std: np.ndarray | None = None
    uncertainty_scale: dict[str, float] | None = None
    """The calibration factors the spreads were evaluated with."""

    @property
    def num_structures(self) -> int:
        return int(self.energy_per_atom_ref.size)

    def _atom_owner(self) -> np.ndarray | None:
        """Structure index of every atom (``None`` without atom counts)."""
        if self.atoms_per_structure is None or self.forces_ref is None:
            return None
        return np.repeat(np.arange(self.num_structures), self.atoms_per_structure)

    def _errors(self, structures: np.ndarray, atoms: np.ndarray | None) -> dict[str, float]:
        """Metrics over the selected structures (bool mask) and atoms (bool mask)."""
        out: dict[str, float] = {"structures": int(structures.sum())}
        if atoms is not None:
            out["atoms"] = int(atoms.sum())
        pairs = {
            "energy_per_atom": (self.energy_per_atom_pred, self.energy_per_atom_ref, structures),
            "forces": (self.forces_pred, self.forces_ref, atoms),
            "stress": (self.stress_pred, self.stress_ref, structures),
        }
        for name, (pred, ref, mask) in pairs.items():
            if pred is None or ref is None or mask is None:
                continue
            mae, rmse, count = _mae_rmse(pred[mask], ref[mask])
            if count:
                out[f"{name}_mae"], out[f"{name}_rmse"] = mae, rmse
        return out

    def metrics(self) -> dict[str, float]:
        """MAE/RMSE of energy per atom (eV/atom), forces (eV/Å) and stress (eV/Å³)."""
        out: dict[str, float] = {"num_structures": self.num_structures, "num_atoms": self.num_atoms}
        every = np.ones(self.num_structures, dtype=bool)
        atoms = None if self.forces_ref is None else np.ones(len(self.forces_ref), dtype=bool)
        found = self._errors(every, atoms)
        out.update({k: v for k, v in found.items() if k not in ("structures", "atoms")})
        return out

    def _by_label(self, labels: np.ndarray | None) -> dict[str, dict[str, float]]:
        if labels is None:
            return {}
        owner = self._atom_owner()
        out = {}
        for label in sorted(set(labels.tolist()), key=_natural):
            mask = labels == label
            out[str(label)] = self._errors(mask, None if owner is None else mask[owner])
        return out

    def by_group(self) -> dict[str, dict[str, float]]:
        """Errors per structure type: ``{group: {"structures", "atoms", "<q>_mae", ...}}``."""
        return self._by_label(self.groups)

    def by_source(self) -> dict[str, dict[str, float]]:
        """Errors per input file (same keys as :meth:`by_group`)."""
        return self._by_label(self.sources)

    def per_element(self) -> dict[str, dict[str, float]]:
        """Per element: force errors of its atoms; energy and stress of structures with it.

        ``{symbol: {"atoms", "structures", "forces_mae", "forces_rmse",
        "energy_per_atom_mae", ...}}``.
        """
        from ase.data import chemical_symbols

        if self.species is None:
            return {}
        owner = self._atom_owner()
        out = {}
        for z in np.unique(self.species):
            atoms = self.species == z
            structures = np.zeros(self.num_structures, dtype=bool)
            if owner is not None:
                structures[owner[atoms]] = True
            found = self._errors(structures, atoms if self.forces_ref is not None else None)
            found["atoms"] = int(atoms.sum())
            if owner is None:
                found = {k: v for k, v in found.items() if not k.startswith(("energy", "stress"))}
                found.pop("structures", None)
            if len(found) > 1:
                out[chemical_symbols[int(z)]] = found
        return out

    def force_bins(self, edges: Sequence[float] = FORCE_BINS) -> list[dict[str, float]]:
        """Force errors binned by the reference force magnitude ``|F|`` (eV/Å).

        One row per non-empty bin: ``{"low", "high", "atoms", "forces_mae",
        "forces_rmse", "relative_mae"}`` (``relative_mae``: MAE over the mean ``|F|``).
        """
        if self.forces_pred is None or self.forces_ref is None:
            return []
        magnitude = np.linalg.norm(self.forces_ref, axis=1)
        rows = []
        for low, high in itertools.pairwise(edges):
            mask = (magnitude >= low) & (magnitude < high)
            mae, rmse, count = _mae_rmse(self.forces_pred[mask], self.forces_ref[mask])
            if count:
                mean = float(np.nanmean(magnitude[mask]))
                rows.append(
                    {
                        "low": float(low),
                        "high": float(high),
                        "atoms": int(mask.sum()),
                        "forces_mae": mae,
                        "forces_rmse": rmse,
                        "relative_mae": mae / mean if mean > 0 else math.nan,
                    }
                )
        return rows

    def report(self) -> dict[str, Any]:
        """Every breakdown as one JSON-ready dict (units under ``"units"``); with a
        committee's spreads also ``"uncertainty"`` (:func:`~nvalchemi.app.uncertainty.
        uncertainty_report`)."""
        from nvalchemi.app.uncertainty import has_spreads, uncertainty_report

        extra = {"uncertainty": uncertainty_report(self)} if has_spreads(self) else {}
        return {
            "units": dict(UNITS),
            "metrics": self.metrics(),
            "by_group": self.by_group(),
            "by_source": self.by_source(),
            "per_element": self.per_element(),
            "force_bins": [
                {**row, "high": None if math.isinf(row["high"]) else row["high"]}
                for row in self.force_bins()
            ],
            **extra,
        }

    def parity_plots(self, out_dir: str | Path) -> list[Path]:
        """``parity_energy_per_atom.png``, ``parity_forces.png``, ``parity_stress.png``."""
        from nvalchemi.hooks.reporting import parity_plots

        def both(pred: Any, ref: Any) -> tuple[Any, Any]:
            if pred is None or ref is None or not np.isfinite(ref).any():
                return None, None
            return pred, ref

        stress_pred, stress_ref = both(self.stress_pred, self.stress_ref)
        return parity_plots(
            self.energy_per_atom_pred,
            self.energy_per_atom_ref,
            *both(self.forces_pred, self.forces_ref),
            out_dir,
            stress_pred=stress_pred,
            stress_ref=stress_ref,
        )


def _natural(label: Any) -> tuple:
    """Sort key: atom-count ranges by their first number, other labels alphabetically."""
    text = str(label)
    head = text.split("-")[0].split(" ")[0]
    return (0, int(head), text) if head.isdigit() else (1, 0, text)


def error_rows(errors: dict[str, float]) -> list[str]:
    """``[MAE, RMSE]`` cells in meV for energy per atom, forces and stress ("-" if absent)."""
    cells = []
    for name in QUANTITIES:
        for stat in ("mae", "rmse"):
            value = errors.get(f"{name}_{stat}")
            cells.append("-" if value is None else f"{1000 * value:.2f}")
    return cells


def predict(
    model: Any, loader: Any, *, device: Any = "cpu", stress: bool = True, head: str | None = None
) -> Evaluation:
    """Run ``model`` (eval mode) over ``loader``; collect predictions and references.

    ``stress`` computes the stress where the model can; ``head`` picks the readout head
    of a multi-head model (default: its default head). The loader's order is kept.
    """
    import torch

    from nvalchemi.training.runtime import evaluating

    device = torch.device(device)
    config = getattr(model, "model_config", None)
    spreads = set() if config is None else set(config.outputs)
    wanted = None
    if config is not None:
        wanted = {"energy", "forces"} & set(config.outputs)
        if stress and "stress" in config.outputs:
            wanted.add("stress")
    parts: dict[str, list[np.ndarray]] = {
        k: [] for k in ("ep", "er", "n", "fp", "fr", "sp", "sr", "z", "es", "fs", "ss")
    }
    with evaluating(model, wanted):
        for batch in loader:
            batch = batch.to(device)
            out = model(batch) if head is None else model(batch, head=head)
            counts = batch.num_nodes_per_graph.double().reshape(-1)
            graphs, atoms = len(counts), int(batch.num_nodes)
            parts["n"].append(counts.cpu().numpy().astype(np.int64))
            parts["ep"].append((out["energy"].detach().double().reshape(-1) / counts).cpu().numpy())
            parts["er"].append(
                _rows(_label(batch, "energy"), graphs, 1).reshape(-1) / parts["n"][-1]
            )
            parts["z"].append(batch.atomic_numbers.cpu().numpy())
            # Every batch adds rows for every structure and atom (NaN where a model output
            # is absent, e.g. no stress for a batch of molecules), so rows stay aligned.
            parts["fp"].append(_rows(out.get("forces"), atoms, 3))
            parts["fr"].append(_rows(_label(batch, "forces"), atoms, 3))
            parts["sp"].append(_rows(out.get("stress"), graphs, 9))
            parts["sr"].append(_rows(_label(batch, "stress"), graphs, 9))
            for key, name, rows, width in (
                ("es", "energy_std", graphs, 1),
                ("fs", "forces_std", atoms, 3),
                ("ss", "stress_std", graphs, 9),
            ):
                if name in spreads:  # a committee's (NaN rows where a batch has none)
                    parts[key].append(_rows(out.get(name), rows, width))

    def cat(key: str) -> np.ndarray | None:
        if not parts[key]:
            return None
        values = np.concatenate(parts[key])
        optional = key not in ("ep", "er", "n", "z")  # forces, stress, spreads
        return None if optional and np.isnan(values).all() else values

    sizes = cat("n")
    scale = getattr(model, "uncertainty_scale", None)
    energy_std = cat("es")
    return Evaluation(
        energy_std=None if energy_std is None else energy_std.reshape(-1),
        forces_std=cat("fs"),
        stress_std=cat("ss"),
        uncertainty_scale=None
        if scale is None
        else dict(zip(("energy", "forces", "stress"), scale.detach().cpu().tolist())),
        energy_per_atom_pred=cat("ep") if parts["ep"] else np.zeros(0),
        energy_per_atom_ref=cat("er") if parts["er"] else np.zeros(0),
        forces_pred=cat("fp"),
        forces_ref=cat("fr"),
        stress_pred=cat("sp"),
        stress_ref=cat("sr"),
        species=cat("z"),
        num_atoms=0 if sizes is None else int(sizes.sum()),
        atoms_per_structure=sizes,
    )


def _rows(value: Any, rows: int, width: int) -> np.ndarray:
    """An output or label as float64 ``(rows, width)``; NaN when it is absent."""
    if value is None:
        return np.full((rows, width), np.nan)
    return value.detach().double().cpu().numpy().reshape(rows, width)


def _label(batch: Any, name: str) -> Any:
    return getattr(batch, name) if name in batch else None


# ---------------------------------------------------------------------- structure labels
def _innermost(reader: Any, index: int) -> tuple[Any, int]:
    """The reader that stores structure ``index`` of ``reader`` (through subsets)."""
    while hasattr(reader, "indices") and hasattr(reader, "reader"):
        index, reader = reader.indices[index], reader.reader
    return reader, index


def reader_name(reader: Any) -> str:
    """The file or store a reader reads (its name only)."""
    inner, _ = _innermost(reader, 0) if len(reader) else (reader, 0)
    paths = getattr(inner, "paths", None) or [getattr(inner, "store", None) or inner]
    names = [Path(str(p)).name for p in paths]
    return names[0] if len(names) == 1 else ", ".join(names)


def _atom_range(count: int) -> str:
    low = 1
    for high in _ATOM_RANGES[1:]:
        if count <= high:
            return f"{low}-{high} atoms"
        low = high + 1
    return f"{low}+ atoms"


def structure_groups(readers: Sequence[Any], group_by: str | None = None) -> tuple[np.ndarray, str]:
    """The group of every structure of ``readers`` (in order) and what grouped them.

    The group is the structure's ``group_by`` entry of its extxyz/db ``info`` (default
    ``config_type``); where no structure has it, structures are grouped by atom-count
    range (``"17-32 atoms"``). Returns ``(labels, "config_type" | group_by | "atoms")``.
    """
    key = group_by or "config_type"
    labels: list[Any] = []
    sizes: list[int] = []
    for reader in readers:
        for i in range(len(reader)):
            inner, index = _innermost(reader, i)
            get_atoms = getattr(inner, "get_atoms", None)
            atoms = get_atoms(index) if callable(get_atoms) else None
            labels.append(None if atoms is None else atoms.info.get(key))
            sizes.append(len(atoms) if atoms is not None else int(inner.read_data(index).num_nodes))
    if any(label is not None for label in labels):
        return np.array(["(none)" if v is None else str(v) for v in labels]), key
    return np.array([_atom_range(n) for n in sizes]), "atoms"


def evaluate_readers(
    model: Any,
    readers: Sequence[Any],
    *,
    batch_size: int = 16,
    device: Any = "cpu",
    head: str | None = None,
    group_by: str | None = None,
    n_threads: int | None = None,
) -> tuple[Evaluation, str]:
    """:class:`Evaluation` of ``model`` on the structures of ``readers``, with groups.

    Returns ``(evaluation, grouping)`` where ``grouping`` says what the groups are
    (see :func:`structure_groups`); ``evaluation.sources`` names each structure's file.
    ``n_threads``: neighbour-list builder threads.
    """
    from nvalchemi.data.sources import make_dataset, make_loader, neighbor_config_of

    dataset = make_dataset(readers, neighbor_config=neighbor_config_of(model), n_threads=n_threads)
    evaluation = predict(
        model, make_loader(dataset, batch_size=batch_size), device=device, head=head
    )
    evaluation.groups, grouping = structure_groups(readers, group_by)
    evaluation.sources = np.array([reader_name(r) for r in readers for _ in range(len(r))])
    return evaluation, grouping


# ---------------------------------------------------------------------- end of a run
def final_model(strategy: Any, use_ema: str = "auto") -> tuple[Any, str]:
    """``(model, "ema" | "live")`` of the strategy's ``main`` model (``None`` if it has none).

    ``use_ema`` follows ``ValidationConfig.use_ema``: ``"auto"`` and ``"always"`` take the
    EMA weights when an ``EMAHook`` filled the ``inference_model`` slot, ``"never"`` the
    live weights.
    """
    from torch import nn

    models = strategy.unwrapped_models()
    if "main" not in models:
        return None, "live"
    slot = None if use_ema == "never" else strategy.inference_model
    if isinstance(slot, nn.ModuleDict):
        slot = dict(slot.items()).get("main")
    if isinstance(slot, nn.Module):
        return slot, "ema"
    return models["main"], "live"


def evaluate_final_model(
    strategy: Any,
    readers: Sequence[Any],
    *,
    batch_size: int,
    use_ema: str = "auto",
    group_by: str | None = None,
    n_threads: int | None = None,
) -> tuple[Evaluation | None, str, str]:
    """The final model of a run (see :func:`final_model`) on ``readers`` (e.g. validation).

    Returns ``(evaluation, weights, grouping)``; ``evaluation`` is ``None`` when the
    strategy has no ``main`` model. Runs in one process over every structure (no
    collectives), so call it on rank 0 only.
    """
    model, weights = final_model(strategy, use_ema)
    if model is None:
        return None, weights, ""
    evaluation, grouping = evaluate_readers(
        model,
        readers,
        batch_size=batch_size,
        device=strategy.devices[0],
        group_by=group_by,
        n_threads=n_threads,
    )
    return evaluation, weights, grouping


# ---------------------------------------------------------------------- calibration
def calibrate(
    model: Any,
    readers: Sequence[Any],
    *,
    batch_size: int = 16,
    device: Any = "cpu",
    group_by: str | None = None,
) -> tuple[dict[str, float], Evaluation]:
    """Fit a committee's calibration factors on ``readers`` (validation data) and set them.

    Returns ``(factors, evaluation)``; the evaluation's spreads are rescaled to the new
    factors (see :mod:`nvalchemi.app.uncertainty`). Example::

        factors, _ = calibrate(committee, [open_reader("valid.extxyz")])
    """
    from nvalchemi.app.uncertainty import apply_calibration, fit_calibration, set_calibration

    evaluation, _ = evaluate_readers(
        model, readers, batch_size=batch_size, device=device, group_by=group_by
    )
    factors = fit_calibration(evaluation)
    set_calibration(model, factors)
    apply_calibration(evaluation, factors)
    return factors, evaluation


def store_calibration(
    strategy: Any, factors: dict[str, float] | None, checkpoint_dir: str | Path
) -> int | None:
    """Give the strategy's main model (live and EMA weights) ``factors`` and save a
    checkpoint into ``checkpoint_dir`` (collective: call it on every rank with rank 0's
    factors). Returns the checkpoint index, or ``None`` when there was nothing to store."""
    from nvalchemi.app.uncertainty import set_calibration

    models = [final_model(strategy, use_ema)[0] for use_ema in ("never", "always")]
    if not factors or not any([set_calibration(m, factors) for m in models if m is not None]):
        return None
    return strategy.save_checkpoint(checkpoint_dir)
