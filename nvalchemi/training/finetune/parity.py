"""Zero-step parity: a fine-tune that has not stepped predicts what its source predicts.

Heads replaced by fresh modules, reference energies silently reset, a dtype cast or a
wrong checkpoint all show up here before any compute is spent on training.
:func:`check_zero_step_parity` runs the source model and the fine-tune-ready model on
the same structures and reports the largest differences of energy, forces and
stress; ``nvalchemi-training finetune check JOB`` prints that report for a job file.

A difference is expected, and shown, where the fine-tune changes the model on
purpose (``e0="estimated"``/``"refit"``, re-estimated scale and shift, a module patch).

Example:
    >>> report = check_zero_step_parity(source, strategy.models["main"],
    ...                                 finetune_structures[:8])  # doctest: +SKIP
    >>> print(report.format())  # doctest: +SKIP
    >>> assert report.ok(1e-10)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ParityReport", "check_zero_step_parity"]

from nvalchemi.data.batch import iter_batches
from nvalchemi.data.neighbors import compute_neighbors
from nvalchemi.training.runtime import evaluating, unwrap_model

_OUTPUTS = ("energy", "forces", "stress")
_UNITS = {"energy": "eV", "forces": "eV/Å", "stress": "eV/Å³"}


@dataclass
class ParityReport:
    """Largest absolute differences (fine-tune minus source) per output.

    ``max_abs[output]`` is over every structure (energies per structure, forces per
    component, stress per component); ``per_structure[i][output]`` is structure ``i``'s.
    """

    num_structures: int
    max_abs: dict[str, float]
    per_structure: list[dict[str, float]] = field(default_factory=list)
    head: str | int | None = None
    source_head: str | int | None = None

    def ok(self, tolerance: float = 1e-10) -> bool:
        """Whether every difference is at most ``tolerance``."""
        return all(value <= tolerance for value in self.max_abs.values())

    def format(self) -> str:
        """A small table for the terminal."""
        heads = ""
        if self.head is not None or self.source_head is not None:
            heads = f" (head {_name(self.head)} vs source head {_name(self.source_head)})"
        lines = [f"zero-step parity on {self.num_structures} structures{heads}:"]
        for output, value in self.max_abs.items():
            lines.append(f"  {output:<7} max |fine-tune - source| = {value:.3e} {_UNITS[output]}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_structures": self.num_structures,
            "max_abs": dict(self.max_abs),
            "head": self.head,
            "source_head": self.source_head,
        }


def check_zero_step_parity(
    source: torch.nn.Module,
    model: torch.nn.Module,
    structures: Iterable[Any],
    *,
    head: str | int | None = None,
    source_head: str | int | None = None,
    outputs: Sequence[str] = _OUTPUTS,
    batch_size: int = 8,
) -> ParityReport:
    """Compare ``model`` (fine-tune-ready) with ``source`` on ``structures``.

    Args:
        source: the model the fine-tune starts from.
        model: the fine-tune's model before its first step (DDP wrappers are fine).
        structures: ``AtomicData``, ``ase.Atoms`` or ``Batch`` items; neighbour lists
            are built for each model's cutoff where missing.
        head / source_head: the readout heads to compare (default: each model's first).
        outputs: which of energy, forces, stress to compare; stress only where both
            models produce it (periodic structures).
        batch_size: structures per forward pass.

    Both models run in eval mode (restored afterwards) in their own dtype and on their
    own device; differences are taken in float64.
    """
    source, model = unwrap_model(source), unwrap_model(model)
    wanted = [o for o in outputs if o in _OUTPUTS]
    unknown = sorted(set(outputs) - set(_OUTPUTS))
    if unknown:
        raise ValueError(f"outputs {unknown} are not comparable; use {list(_OUTPUTS)}.")
    per_structure: list[dict[str, float]] = []
    for batch in iter_batches(structures, batch_size, dtype=torch.float64):
        ours = _predict(model, batch, wanted, head)
        theirs = _predict(source, batch, wanted, source_head)
        per_structure.extend(_differences(ours, theirs, batch))
    if not per_structure:
        raise ValueError("check_zero_step_parity got no structures.")
    max_abs = {}
    for output in wanted:
        values = [row[output] for row in per_structure if output in row]
        if values:
            max_abs[output] = max(values)
    return ParityReport(len(per_structure), max_abs, per_structure, head, source_head)


def _name(head: str | int | None) -> str:
    if head is None:
        return "default"
    return f"#{head}" if isinstance(head, int) else head


def _predict(model: Any, batch: Any, outputs: list[str], head: str | None) -> dict[str, Any]:
    config = model.model_config
    batch = batch.clone()
    if config.neighbor_config is not None:
        compute_neighbors(batch, config=config.neighbor_config)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    active = set(outputs) & set(config.outputs)
    grad = torch.enable_grad() if active & {"forces", "stress"} else torch.no_grad()
    with evaluating(model, active), grad:
        batch = batch.to(device)
        out = model(batch) if head is None else model(batch, head=head)
    return {k: v.detach().double().cpu() for k, v in out.items() if isinstance(v, torch.Tensor)}


def _differences(ours: dict, theirs: dict, batch: Any) -> list[dict[str, float]]:
    counts = batch.num_nodes_per_graph.cpu().tolist()
    rows: list[dict[str, float]] = [{} for _ in counts]
    for output in ("energy", "stress"):  # one value (energy) or 3x3 (stress) per structure
        if output in ours and output in theirs:
            diff = (ours[output] - theirs[output]).abs().reshape(len(counts), -1).amax(-1)
            for row, value in zip(rows, diff.tolist()):
                row[output] = value
    if "forces" in ours and "forces" in theirs:
        diff = (ours["forces"] - theirs["forces"]).abs().amax(-1)
        for row, part in zip(rows, diff.split(counts)):
            row["forces"] = float(part.max()) if part.numel() else 0.0
    return rows
