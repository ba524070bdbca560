"""A batch budget found for you: probe a model's peak training memory and pick the budget.

:func:`probe_batch_budget` runs the model's training step (forward with its active
outputs, forces and stress by autograd with a graph, then backward) on batches of
growing size built from sample structures, on the training device; measures the
peak memory of each (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the peak
resident set size, reset before each step); fits

    peak = fixed + per_atom * atoms + per_edge * edges

and picks the largest ``max_atoms`` / ``max_edges`` whose predicted peak stays under
``fraction`` (default 0.8) of the memory available when the probe starts, for
batches as dense (edges per atom) as the densest sample. The measurements, the fit
and the choice are written to ``batch_budget.json`` in the run directory. The
result feeds :class:`~nvalchemi.data.datapipes.BudgetBatchSampler`::

    budget = probe_batch_budget(model, structures[:64], "cuda", out_dir=run_dir)
    sampler = BudgetBatchSampler(dataset, max_atoms=budget.max_atoms,
                                 max_edges=budget.max_edges)

The optimizer is not stepped (the weights are untouched); its state is accounted
for as two copies of the parameters (Adam's moments) in the fixed part.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nvalchemi._fileio import write_atomic
from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.neighbors import compute_neighbors

__all__ = ["BatchBudget", "probe_batch_budget"]

BUDGET_FILE = "batch_budget.json"
_FIRST_ATOMS = 64  # atoms in the first probe batch (then doubling)
_MOST_SAMPLES = 64  # sample structures taken from a dataset
# The budget is at most this many times the largest probe batch (a longer line is a guess).
_EXTRAPOLATION = 4


@dataclass(frozen=True)
class BatchBudget:
    """The chosen budget and how it was found.

    Attributes:
        max_atoms / max_edges: the budget (``max_edges`` is ``None`` for a model without
            neighbour lists; else ``max_atoms`` times the densest sample's edges per
            atom, so the budget holds for batches of the densest structures).
        device: where the probe ran.
        available_bytes: memory available at the start (free device memory plus what
            torch already holds; on the CPU, available RAM plus this process's RSS).
        fraction: the share of ``available_bytes`` the budget may use.
        fixed_bytes, bytes_per_atom, bytes_per_edge: the fitted memory model.
        predicted_peak_bytes: its prediction for a batch at the budget.
        measurements: ``{"structures", "atoms", "edges", "peak_bytes", "seconds"}`` per
            probe batch.
        seconds: wall time of the whole probe.
        capped: the memory would allow more, but the budget was held at four times
            the largest probe batch (the fit is not trusted further): probe longer
            (``time_limit_s``) to go higher.
    """

    max_atoms: int
    max_edges: int | None
    device: str
    available_bytes: int
    fraction: float
    fixed_bytes: float
    bytes_per_atom: float
    bytes_per_edge: float
    predicted_peak_bytes: float
    measurements: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    capped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------- memory meters
def _cpu_peak_reset() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs``); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _cpu_peak_bytes() -> int:
    with open("/proc/self/status") as handle:
        match = re.search(r"VmHWM:\s+(\d+)\s+kB", handle.read())
    if match is None:
        raise RuntimeError("probe_batch_budget: /proc/self/status has no VmHWM (peak RSS).")
    return int(match.group(1)) * 1024


def _release_free_memory() -> None:
    """Give freed heap memory back to the system, so the next peak RSS is the next step's.

    glibc keeps freed blocks in its arenas, which would make every step after a large
    one look as large; ``malloc_trim(0)`` returns them (a no-op elsewhere).
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _cpu_available_bytes() -> int:
    with open("/proc/meminfo") as handle:
        info = handle.read()
    available = int(re.search(r"MemAvailable:\s+(\d+)\s+kB", info).group(1)) * 1024
    with open("/proc/self/status") as handle:
        rss = int(re.search(r"VmRSS:\s+(\d+)\s+kB", handle.read()).group(1)) * 1024
    return available + rss


class _Meter:
    """Peak memory of one step on ``device``, and what is available there."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if not self.cuda and not os.path.exists("/proc/self/status"):
            raise RuntimeError(
                "probe_batch_budget measures CPU memory from /proc (Linux); give a CUDA "
                "device, or set max_atoms/max_edges by hand on this system."
            )

    def available(self) -> int:
        if self.cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free + torch.cuda.memory_reserved(self.device))
        return _cpu_available_bytes()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        _release_free_memory()
        if not _cpu_peak_reset():
            raise RuntimeError(
                "probe_batch_budget cannot reset the peak RSS (/proc/self/clear_refs is not "
                "writable here); set max_atoms/max_edges by hand."
            )

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return _cpu_peak_bytes()


# ------------------------------------------------------------------------------ batches
def _as_structures(structures: Any, most: int = _MOST_SAMPLES) -> list[Any]:
    """Sample structures as ``AtomicData`` (at most ``most``, evenly spread over a dataset)."""
    if isinstance(structures, Batch):
        items = structures.to_data_list()
    elif isinstance(structures, AtomicData):
        items = [structures]
    elif hasattr(structures, "__len__") and hasattr(structures, "__getitem__"):
        n = len(structures)
        picks = sorted({round(k * (n - 1) / max(most - 1, 1)) for k in range(min(n, most))})
        items = [structures[i] for i in picks]
    else:
        items = list(structures)
    items = [it[0] if isinstance(it, tuple) else it for it in items][:most]
    if not items:
        raise ValueError("probe_batch_budget needs at least one sample structure.")
    return items


def _strip_edges(data: Any) -> Any:
    data = data.clone() if hasattr(data, "clone") else data
    for key in ("neighbor_list", "neighbor_list_shifts", "shifts"):
        if key in data:
            delattr(data, key)
    return data


def _batch_of(structures: Sequence[Any], atoms: int, order: Sequence[int]) -> list[Any]:
    """Structures taken cyclically in ``order`` until about ``atoms`` atoms."""
    chosen, total, k = [], 0, 0
    while total < atoms or not chosen:
        item = structures[order[k % len(order)]]
        chosen.append(item)
        total += item.num_nodes
        k += 1
    return chosen


def _training_step(model: Any, batch: Any) -> None:
    """What a training step allocates: forward (derivatives with a graph), backward."""
    outputs = model(batch)
    loss = sum(
        value.double().square().sum()
        for value in outputs.values()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    )
    loss.backward()


# ---------------------------------------------------------------------------------- fit
def _fit(rows: list[dict[str, float]]) -> tuple[float, float, float]:
    """``(fixed, per_atom, per_edge)`` by least squares, every coefficient >= 0.

    The three-term fit when its coefficients are all non-negative; else the better
    of fixed + atoms and fixed + edges.
    """
    atoms = np.array([r["atoms"] for r in rows], dtype=float)
    edges = np.array([r["edges"] for r in rows], dtype=float)
    peak = np.array([r["peak_bytes"] for r in rows], dtype=float)
    ones = np.ones_like(atoms)
    fits = []
    for mask in ((1, 1, 1), (1, 1, 0), (1, 0, 1)):
        columns = [c for c, keep in zip((ones, atoms, edges), mask) if keep]
        matrix = np.stack(columns, 1)
        if np.linalg.matrix_rank(matrix) < matrix.shape[1]:
            continue
        coef, *_ = np.linalg.lstsq(matrix, peak, rcond=None)
        if (coef < 0).any():
            continue
        full = iter(coef.tolist())
        values = tuple(next(full) if keep else 0.0 for keep in mask)
        if mask == (1, 1, 1):
            return values
        fits.append((float(np.square(matrix @ coef - peak).sum()), values))
    if fits:
        return min(fits)[1]
    # memory grows but no fit is usable: a line through the largest point
    return 0.0, float(peak.max() / max(atoms.max(), 1.0)), 0.0


# ------------------------------------------------------------------------------ the probe
def probe_batch_budget(
    model: torch.nn.Module,
    structures: Any,
    device: str | torch.device,
    out_dir: str | Path | None = None,
    *,
    fraction: float = 0.8,
    time_limit_s: float = 60.0,
    max_probes: int = 8,
    available_bytes: int | None = None,
) -> BatchBudget:
    """Measure ``model``'s peak training memory on ``device`` and choose a batch budget.

    Args:
        model: an nvalchemi model (``model(batch)`` returns its active outputs; forces
            and stress, when active, come from autograd with a graph as in training).
            It is moved to ``device`` for the probe and left there; its weights are not
            changed and its gradients are cleared afterwards.
        structures: sample structures (``AtomicData`` list, a ``Batch`` or a dataset,
            of which 64 spread over it are used). Batches cycle through them, densest
            (most edges per atom) and sparsest first alternately, so the fit can tell
            atoms from edges.
        device: the training device.
        out_dir: where ``batch_budget.json`` (measurements, fit, choice) is written.
        fraction: share of the available memory the budget may use.
        time_limit_s: stop doubling the batch after this long (at least three sizes).
        max_probes: at most this many batch sizes (64, 128, 256, ... atoms, each with
            the densest and the sparsest samples first; the
            probe also stops once the largest has grown the peak by a quarter of the
            memory left above the first one, so the fit does not extrapolate far).
        available_bytes: override the memory available (e.g. to share a GPU).

    Returns:
        the :class:`BatchBudget` (``max_atoms``, ``max_edges``, the fit, measurements).

    Raises:
        ValueError: bad ``fraction``, no structures, or not even one sample structure
            fits in the allowed memory.
    """

    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1]; got {fraction!r}.")
    started = time.perf_counter()
    device = torch.device(device)
    samples = [_strip_edges(s) for s in _as_structures(structures)]
    meter = _Meter(device)
    available = int(available_bytes) if available_bytes is not None else meter.available()
    limit = fraction * available
    model = model.to(device)
    was_training = model.training
    model.train()
    config = getattr(getattr(model, "model_config", None), "neighbor_config", None)
    optimizer_state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())

    def prepare(items: list[Any]) -> Any:
        batch = Batch.from_data_list(items).to(device)
        if config is not None:
            compute_neighbors(batch, config=config)
        return batch

    density = []
    for item in samples:
        edges = prepare([item]).num_edges if config is not None else 0
        density.append(edges / max(item.num_nodes, 1))
    dense_first = sorted(range(len(samples)), key=lambda i: -density[i])
    orders = (dense_first, dense_first[::-1])

    rows: list[dict[str, float]] = []
    atoms = _FIRST_ATOMS
    try:
        for size in range(max_probes):
            for order in orders if config is not None else orders[:1]:
                batch = prepare(_batch_of(samples, atoms, order))
                model.zero_grad(set_to_none=True)
                meter.start()
                tick = time.perf_counter()
                _training_step(model, batch)
                rows.append(
                    {
                        "structures": batch.num_graphs,
                        "atoms": batch.num_nodes,
                        "edges": batch.num_edges if config is not None else 0,
                        "peak_bytes": meter.peak() + optimizer_state,
                        "seconds": time.perf_counter() - tick,
                    }
                )
                del batch
            grown = rows[-1]["peak_bytes"] - rows[0]["peak_bytes"]
            enough = grown > 0.25 * (limit - rows[0]["peak_bytes"])
            late = time.perf_counter() - started > time_limit_s
            if size >= 2 and (enough or late):
                break
            atoms *= 2
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    fixed, per_atom, per_edge = _fit(rows)
    ratio = max(density) if config is not None else 0.0
    per_atom_at_ratio = per_atom + per_edge * ratio
    if config is not None and per_edge == 0.0:
        # the fit could not tell edges from atoms: assume the slope is all edges, so
        # batches denser than the probes still fit
        probed = sum(r["edges"] for r in rows) / max(sum(r["atoms"] for r in rows), 1)
        per_atom_at_ratio = per_atom * max(1.0, ratio / max(probed, 1e-12))
    if per_atom_at_ratio <= 0:
        per_atom_at_ratio = max(r["peak_bytes"] for r in rows) / max(r["atoms"] for r in rows)
    max_atoms = math.floor((limit - fixed) / per_atom_at_ratio)
    # never trust the line much beyond what was measured
    probed_atoms = max(r["atoms"] for r in rows)
    capped = max_atoms > _EXTRAPOLATION * probed_atoms
    max_atoms = min(max_atoms, _EXTRAPOLATION * probed_atoms)
    largest = max(s.num_nodes for s in samples)
    if max_atoms < largest:
        raise ValueError(
            f"probe_batch_budget: {fraction:.0%} of the {available / 2**30:.2f} GiB available "
            f"on {device} holds about {max(max_atoms, 0)} atoms for this model (fixed "
            f"{fixed / 2**20:.0f} MiB + {per_atom_at_ratio / 1024:.1f} KiB per atom), fewer than "
            f"the largest sample structure ({largest} atoms). Use a smaller model or a device "
            "with more memory."
        )
    max_edges = math.floor(ratio * max_atoms) if config is not None else None
    predicted = fixed + per_atom_at_ratio * max_atoms
    budget = BatchBudget(
        max_atoms=int(max_atoms),
        max_edges=None if max_edges is None else int(max_edges),
        device=str(device),
        available_bytes=available,
        fraction=fraction,
        fixed_bytes=fixed,
        bytes_per_atom=per_atom,
        bytes_per_edge=per_edge,
        predicted_peak_bytes=predicted,
        measurements=rows,
        seconds=time.perf_counter() - started,
        capped=capped,
    )
    if out_dir is not None:
        text = json.dumps(budget.to_dict(), indent=2) + "\n"
        write_atomic(Path(out_dir) / BUDGET_FILE, text.encode())
    return budget
