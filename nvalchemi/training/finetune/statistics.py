"""Reference energies, scale and shift for a fine-tune: computed once, on every rank the same.

A fine-tune usually changes the level of theory: the new labels differ from the
source model's by a per-element offset plus a small, structure-dependent part that
training learns. How the fine-tuned head's reference energies ``E0`` are chosen
(``e0=``):

* ``"keep"``: the source model's; elements without a source ``E0`` (0) get a fitted
  one (least squares of the source model's residual on the new data);
* ``"refit"``: least squares of the new energies on element counts (as from scratch);
* ``"estimated"``: the source's plus the least-squares per-element offset of the new
  labels from the source model's predictions;
* ``"fixed"``: the values given in ``atomic_energies`` (other elements as ``"keep"``).

``scale_shift="refit"`` re-estimates ``scale`` (force RMS) and ``shift`` (mean per-atom
energy after ``E0``) on the new data; ``"keep"`` (default) leaves the source's. The
models need the reference-energy protocol of :class:`~nvalchemi.models.PaiNN` and
:class:`~nvalchemi.models.mace.MACEWrapper` (``get_reference_energies``,
``set_reference_energies``, ``get_scale_shift``, ``set_scale_shift``, per head).

Example:
    >>> stats = prepare_finetune_model(model, finetune_data, e0="estimated",
    ...                                run_dir="runs/ft")  # doctest: +SKIP
    >>> stats.atomic_energies  # doctest: +SKIP
    {'Cu': -3.61, 'Au': -3.12}
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from nvalchemi._fileio import write_atomic
from nvalchemi.checkpoint_files import read_json

__all__ = [
    "STATISTICS_FILENAME",
    "E0Mode",
    "FineTuneStatistics",
    "ScaleShiftMode",
    "compute_finetune_statistics",
    "prepare_finetune_model",
    "read_finetune_statistics",
]

from nvalchemi.data.batch import iter_batches
from nvalchemi.data.neighbors import compute_neighbors
from nvalchemi.distributed.runtime import (
    broadcast_object,
    get_rank,
    get_world_size,
    is_distributed_initialized,
)
from nvalchemi.models.statistics import (
    atomic_number,
    element_counts,
    mean_num_neighbors,
    solve_atomic_energies,
)
from nvalchemi.training.runtime import evaluating

E0Mode = Literal["keep", "refit", "estimated", "fixed"]
ScaleShiftMode = Literal["keep", "refit"]
STATISTICS_FILENAME = "finetune_statistics.json"
_PROTOCOL = ("get_reference_energies", "set_reference_energies", "get_scale_shift")


@dataclass
class FineTuneStatistics:
    """What :func:`compute_finetune_statistics` chose, JSON-friendly (energies in eV).

    ``atomic_energies`` / ``source_atomic_energies`` are keyed by chemical symbol and
    cover the elements of the fine-tuning data; ``new_elements`` are those the source
    had no ``E0`` for.
    """

    e0_mode: str
    scale_shift_mode: str
    head: str | None
    atomic_energies: dict[str, float]
    source_atomic_energies: dict[str, float]
    new_elements: list[str]
    scale: float
    shift: float
    source_scale: float
    source_shift: float
    mean_num_neighbors: float | None
    num_structures: int
    num_atoms: int
    residual_rmse_per_atom: float | None = None
    """Per-atom energy RMSE (eV) of the source model on the data, before the new ``E0``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> FineTuneStatistics:
        return cls(**dict(values))

    def apply(self, model: Any) -> None:
        """Set these ``E0``, scale and shift on ``model``'s head (on every rank alike)."""
        _check_protocol(model)
        model.set_reference_energies(self.atomic_energies, head=self.head)
        if self.scale_shift_mode != "keep":
            model.set_scale_shift(self.scale, self.shift, head=self.head)


def compute_finetune_statistics(
    model: Any,
    data: Iterable[Any],
    *,
    e0: E0Mode = "keep",
    atomic_energies: Mapping[int | str, float] | None = None,
    scale_shift: ScaleShiftMode = "keep",
    head: str | None = None,
    batch_size: int = 32,
    distributed_manager: Any = None,
) -> FineTuneStatistics:
    """The fine-tune's ``E0``, scale and shift for ``model``'s ``head`` on ``data``.

    ``data`` is an iterable of ``AtomicData`` or ``Batch`` (a dataset, a loader, a
    list) with energy labels; structures are batched ``batch_size`` at a time and
    get neighbour lists for the model's cutoff where they have none. The model is
    run (in eval mode, without gradients) only for ``"keep"``, ``"estimated"`` and
    ``"fixed"``. Under DDP only rank 0 reads the data; the result is broadcast (an
    error on rank 0 is raised on every rank).

    Raises:
        ValueError: an unknown mode; ``atomic_energies`` without ``e0="fixed"``; no
            energy labels; elements the model does not support.
    """
    if e0 not in get_args(E0Mode):
        raise ValueError(f"e0={e0!r}; choose one of {list(get_args(E0Mode))}.")
    if scale_shift not in get_args(ScaleShiftMode):
        raise ValueError(
            f"scale_shift={scale_shift!r}; choose one of {list(get_args(ScaleShiftMode))}."
        )
    if (atomic_energies is not None) != (e0 == "fixed"):
        raise ValueError(
            "atomic_energies gives the E0 values of e0='fixed' (and only of it); "
            f"got e0={e0!r} with atomic_energies={'set' if atomic_energies else 'unset'}."
        )
    _check_protocol(model)
    args = (model, data, e0, atomic_energies, scale_shift, head, batch_size)
    manager = distributed_manager
    if get_world_size(manager) == 1 or not is_distributed_initialized(manager):
        return _compute(*args)
    outcome: Any = None
    if get_rank(manager) == 0:
        try:
            outcome = _compute(*args).to_dict()
        except Exception as exc:  # every rank must hear of it, or the others wait forever
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
    outcome = broadcast_object(outcome, src=0, manager=manager)
    if "error" in outcome:
        raise ValueError(f"fine-tune statistics failed on rank 0: {outcome['error']}")
    return FineTuneStatistics.from_dict(outcome)


def prepare_finetune_model(
    model: Any,
    data: Iterable[Any],
    *,
    run_dir: str | Path | None = None,
    distributed_manager: Any = None,
    **options: Any,
) -> FineTuneStatistics:
    """:func:`compute_finetune_statistics`, applied to ``model`` and written to ``run_dir``.

    ``options`` are those of :func:`compute_finetune_statistics`. With ``run_dir``, rank
    0 writes ``finetune_statistics.json`` there (``spec report`` shows it).
    """
    stats = compute_finetune_statistics(
        model, data, distributed_manager=distributed_manager, **options
    )
    stats.apply(model)
    if run_dir is not None and get_rank(distributed_manager) == 0:
        path = Path(run_dir) / STATISTICS_FILENAME
        write_atomic(path, (json.dumps(stats.to_dict(), indent=2) + "\n").encode())
    return stats


def read_finetune_statistics(run_dir: str | Path) -> FineTuneStatistics | None:
    """The statistics a run wrote to ``run_dir`` (``None`` when there are none)."""
    path = Path(run_dir) / STATISTICS_FILENAME
    if not os.path.lexists(path):
        return None
    try:
        return FineTuneStatistics.from_dict(read_json(path, "fine-tune statistics file"))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not a fine-tune statistics file: {exc}") from None


# ---------------------------------------------------------------------------- the pass
def _check_protocol(model: Any) -> None:
    missing = [name for name in _PROTOCOL if not callable(getattr(model, name, None))]
    if missing:
        raise TypeError(
            f"{type(model).__name__} has no {missing}: fine-tune statistics need a model "
            "with reference energies per head (nvalchemi.models.PaiNN, MACEWrapper)."
        )


@dataclass
class _Pass:
    """Per-structure sums of one pass over the data (float64, CPU)."""

    counts: list[torch.Tensor] = field(default_factory=list)  # [B, 120] element counts
    energies: list[torch.Tensor] = field(default_factory=list)  # [B] labels
    predicted: list[torch.Tensor] = field(default_factory=list)  # [B] source model
    force_sq: float = 0.0
    force_count: int = 0
    edges: int = 0
    atoms: int = 0
    neighbor_atoms: int = 0


def _run_pass(
    model: Any,
    data: Iterable[Any],
    head: str | None,
    batch_size: int,
    run_on: Any,
    supported: Iterable[int],
) -> _Pass:
    """One pass: counts, labels, force sums, neighbour counts, and the model's energies
    for the batches ``run_on(counts)`` selects (NaN elsewhere)."""

    config = model.model_config
    neighbor_config = config.neighbor_config
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    totals = _Pass()
    known = set(supported)
    with evaluating(model, {"energy"}):
        for batch in iter_batches(data, batch_size):
            if "energy" not in batch:
                continue
            energy = batch["energy"].detach().double().reshape(-1).cpu()
            keep = torch.isfinite(energy)
            counts = element_counts(batch.atomic_numbers, batch.batch_idx, batch.num_graphs)
            unknown = sorted(set(torch.nonzero(counts.sum(0)).flatten().tolist()) - known)
            if unknown:
                raise ValueError(
                    f"the fine-tuning data has elements {_symbols(unknown)} that the model "
                    f"does not support (it has {_symbols(sorted(known))}); build the source "
                    "model with those elements."
                )
            totals.counts.append(counts[keep])
            totals.energies.append(energy[keep])
            totals.atoms += int(counts[keep].sum())
            forces = batch.get("forces")
            if forces is not None:
                finite = torch.isfinite(forces)
                totals.force_sq += float((forces.double()[finite] ** 2).sum())
                totals.force_count += int(finite.sum())
            if neighbor_config is not None and "neighbor_list" not in batch:
                compute_neighbors(batch, config=neighbor_config)
            if neighbor_config is not None:
                mean = mean_num_neighbors(batch, neighbor_config.cutoff)
                if mean is not None:
                    totals.edges += round(mean * batch.num_nodes)
                    totals.neighbor_atoms += batch.num_nodes
            predicted = torch.full_like(energy, float("nan"))
            if run_on(counts[keep]):
                with torch.no_grad():
                    out = model(batch.to(device), head=head)
                predicted = out["energy"].detach().double().reshape(-1).cpu()
            totals.predicted.append(predicted[keep])
    if not totals.energies or sum(len(e) for e in totals.energies) == 0:
        raise ValueError("no structure of the fine-tuning data has an energy label.")
    return totals


def _compute(
    model: Any,
    data: Iterable[Any],
    e0: str,
    given: Mapping[int | str, float] | None,
    scale_shift: str,
    head: str | None,
    batch_size: int,
) -> FineTuneStatistics:
    source = model.get_reference_energies(head)
    wanted = {atomic_number(z): float(v) for z, v in (given or {}).items()}
    bad = sorted(z for z in wanted if z not in source)
    if bad:
        raise ValueError(f"atomic_energies names elements {_symbols(bad)} the model lacks.")
    # Elements whose E0 the fit may move: every one for "estimated", else those the
    # source has none for (0) and that no fixed value covers.
    free = {z for z, e in source.items() if e == 0.0 and z not in wanted}

    def run_on(counts: torch.Tensor) -> bool:
        if e0 == "refit":
            return False  # the network's share is not part of a refit
        if e0 == "estimated":
            return True
        # A structure without a free element does not change the fitted ones.
        return bool(counts[:, sorted(free)].any()) if free else False

    totals = _run_pass(model, data, head, batch_size, run_on, source)
    counts = torch.cat(totals.counts)
    energies = torch.cat(totals.energies)
    predicted = torch.cat(totals.predicted)
    present = torch.nonzero(counts.sum(0)).flatten().tolist()
    new = [z for z in present if source[z] == 0.0]
    ran = torch.isfinite(predicted)
    residual_rmse = None
    if bool(ran.any()):
        per_atom = (energies - predicted)[ran] / counts[ran].sum(1).clamp_min(1)
        residual_rmse = float(per_atom.pow(2).mean().sqrt())
    columns = counts[:, present]
    if e0 == "refit":
        values = solve_atomic_energies(columns, energies, present)
    else:
        held = {z: wanted[z] - source[z] for z in present if z in wanted}
        if e0 != "estimated":
            held.update({z: 0.0 for z in present if z not in free and z not in held})
        offsets = {z: held.get(z, 0.0) for z in present}
        if bool(ran.any()) and len(held) < len(present):
            offsets = solve_atomic_energies(
                columns[ran], (energies - predicted)[ran], present, fixed=held
            )
        values = {z: source[z] + offsets[z] for z in present}
        values.update({z: v for z, v in wanted.items() if z not in values})
    scale, shift = model.get_scale_shift(head)
    source_scale, source_shift = scale, shift
    if scale_shift == "refit":
        reference = columns @ torch.tensor([values[z] for z in present], dtype=torch.float64)
        residual_per_atom = (energies - reference) / columns.sum(1).clamp_min(1)
        shift = float(residual_per_atom.mean())
        if totals.force_count:
            scale = math.sqrt(totals.force_sq / totals.force_count)
        elif residual_per_atom.numel() > 1:
            scale = float(residual_per_atom.std())
        scale = scale if scale > 1e-12 else 1.0
    neighbors = totals.edges / totals.neighbor_atoms if totals.neighbor_atoms else None
    return FineTuneStatistics(
        e0_mode=e0,
        scale_shift_mode=scale_shift,
        head=head,
        atomic_energies={_symbol(z): float(v) for z, v in sorted(values.items())},
        source_atomic_energies={_symbol(z): float(source[z]) for z in sorted(values)},
        new_elements=_symbols(new),
        scale=float(scale),
        shift=float(shift),
        source_scale=float(source_scale),
        source_shift=float(source_shift),
        mean_num_neighbors=neighbors,
        num_structures=int(energies.numel()),
        num_atoms=totals.atoms,
        residual_rmse_per_atom=residual_rmse,
    )


def _symbol(z: int) -> str:
    from ase.data import chemical_symbols  # light

    return chemical_symbols[z] if 0 < z < len(chemical_symbols) else str(z)


def _symbols(zs: Iterable[int]) -> list[str]:
    return [_symbol(z) for z in zs]
