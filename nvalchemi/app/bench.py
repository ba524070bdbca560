"""Measure training speed on your hardware: throughput, memory, the loader's share, precisions.

:func:`benchmark` trains a strategy for ``warmup + steps`` batches and reports
structures/s, steps/s, atoms/s, the peak memory (CUDA: ``max_memory_allocated``; CPU:
the process's peak resident set size), and the share of each step spent waiting for the
data loader (above 20 % the model is starved: use loader workers, ``in_memory`` data or
stored neighbour lists). Each candidate then trains the same batches from the same
initial weights: a precision (``"bf16"``, ``"fp16"``) under a ``MixedPrecisionHook``, and
``"compile"`` with ``TrainingStrategy(compile=True)`` (its first steps, the warm-up,
compile the graphs); its loss and gradient norm are compared step by step with the
float32 eager baseline (relative errors) and its speed is reported too. Every number is in :class:`BenchResult`
(``to_dict()`` for JSON).

Example:
    >>> result = benchmark(make_strategy, loader, steps=20)  # doctest: +SKIP
    >>> result.structures_per_s, result.loader_share  # doctest: +SKIP
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["PRECISIONS", "STARVED_SHARE", "BenchResult", "CandidateResult", "benchmark"]

PRECISIONS = ("bf16", "fp16")
"""Mixed-precision candidates; ``"compile"`` is the other one."""

STARVED_SHARE = 0.2
"""A loader share of the step time above this is reported as starvation."""


@dataclass
class CandidateResult:
    """A candidate (a precision or ``"compile"``) against the float32 eager baseline."""

    name: str
    steps_per_s: float
    structures_per_s: float
    speedup: float
    loss_rel_error_max: float
    loss_rel_error_mean: float
    grad_norm_rel_error_max: float
    grad_norm_rel_error_mean: float
    nonfinite_grad_steps: int = 0
    """Timed steps with inf/NaN gradients (fp16 loss scaling skips those updates)."""


def candidate_note(candidate: CandidateResult, steps: int, device: str) -> str | None:
    """Why a candidate's errors are ``nan`` or skewed (``None``: nothing to explain)."""
    skipped = candidate.nonfinite_grad_steps
    if not skipped:
        return None
    parts = [f"{candidate.name}: {skipped} of {steps} timed steps had inf/NaN gradients"]
    if candidate.name == "fp16":
        parts.append(
            ": fp16 loss scaling (a GradScaler, starting at a scale of 65536) skips those "
            "updates and halves its scale until the gradients fit in float16"
        )
    if skipped >= steps:
        parts.append("; no step is left to compare, so the gradient-norm error is nan")
    else:
        parts.append(
            "; they are left out of the gradient-norm error, and the losses after them "
            "drift from float32's"
        )
    parts.append(". Give it more warm-up (--warmup 20) or compare bf16 (no loss scaling)")
    if str(device).startswith("cpu") and candidate.name == "fp16":
        parts.append("; on a CPU, fp16 autocast is slower than float32 (it is meant for GPUs)")
    return "".join(parts) + "."


@dataclass
class BenchResult:
    """Throughput, memory and loader share of the baseline, and the candidates."""

    name: str
    device: str
    steps: int
    warmup_steps: int
    structures: int
    atoms: int
    seconds: float
    steps_per_s: float
    structures_per_s: float
    atoms_per_s: float
    step_ms_median: float
    loader_share: float
    peak_memory_mib: float
    memory_kind: str
    """``"cuda max allocated"`` or ``"process peak RSS"``."""
    candidates: list[CandidateResult] = field(default_factory=list)

    @property
    def starved(self) -> bool:
        """Whether the loader takes more than :data:`STARVED_SHARE` of the step time."""
        return self.loader_share > STARVED_SHARE

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "starved": self.starved}


class _Recorder:
    """Keeps the gradient norm of every optimizer step (after unscaling and clipping's norm)."""

    frequency = 1

    def __init__(self) -> None:
        from nvalchemi.training.stages import TrainingStage

        self.stage = TrainingStage.AFTER_OPTIMIZER_STEP
        self.grad_norms: list[float] = []

    def __call__(self, ctx: Any, stage: Any) -> None:
        norm = getattr(ctx, "grad_norm", None)
        self.grad_norms.append(math.nan if norm is None else float(norm))


def _peak(device: Any) -> tuple[float, str]:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max allocated"
    try:
        import resource
    except ImportError:  # Windows
        return math.nan, "process peak RSS"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1.0 if sys.platform == "darwin" else 1024.0  # bytes on macOS, KiB elsewhere
    return peak * scale / 2**20, "process peak RSS"


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(strategy: Any, batches: Sequence[Any], device: Any) -> tuple[list[float], float]:
    """Losses of training ``batches`` one by one, and the seconds it took."""
    _sync(device)
    start = time.perf_counter()
    losses = [strategy.train_batch(batch) for batch in batches]
    _sync(device)
    return [float(x) for x in losses], time.perf_counter() - start


def _relative(values: list[float], reference: list[float]) -> tuple[float, float]:
    errors = [abs(v - r) / max(abs(r), 1e-30) for v, r in zip(values, reference)]
    errors = [e for e in errors if math.isfinite(e)]
    return (max(errors), sum(errors) / len(errors)) if errors else (math.nan, math.nan)


def benchmark(
    make_strategy: Callable[[list[Any]], Any],
    loader: Any,
    *,
    steps: int = 50,
    warmup: int = 5,
    candidates: Sequence[str] = (),
    name: str = "",
) -> BenchResult:
    """Train ``warmup + steps`` batches of ``loader``; time them; compare candidates.

    Args:
        make_strategy: ``hooks -> strategy``: a fresh strategy with the same initial
            weights every call (candidates start where the baseline started), with
            ``hooks`` added to its own.
        loader: the training batches (iterated once, for ``warmup + steps`` batches).
        steps: timed steps; ``warmup``: untimed steps before them.
        candidates: ``"bf16"``, ``"fp16"`` (``MixedPrecisionHook``) or ``"compile"``
            (``TrainingStrategy(compile=True)``).

    Raises:
        ValueError: the loader has fewer than ``warmup + steps`` batches, or a candidate
            is unknown.
    """
    import torch

    for candidate in candidates:
        if candidate not in (*PRECISIONS, "compile"):
            raise ValueError(
                f"unknown candidate {candidate!r}: use one of {(*PRECISIONS, 'compile')}"
            )

    strategy = make_strategy([])
    device = torch.device(strategy.devices[0])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batches, step_s, wait_s = [], [], 0.0
    iterator = iter(loader)
    for i in range(warmup + steps):
        start = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            raise ValueError(
                f"the loader gave {i} batches; the benchmark needs warmup + steps = "
                f"{warmup + steps} (use fewer --steps or more data)"
            ) from None
        loaded = time.perf_counter()
        strategy.train_batch(batch)
        _sync(device)
        done = time.perf_counter()
        batches.append(batch)
        if i >= warmup:
            wait_s += loaded - start
            step_s.append(done - start)
    strategy.close()
    timed = batches[warmup:]
    total = sum(step_s)
    structures = sum(int(b.num_graphs) for b in timed)
    atoms = sum(int(b.num_nodes) for b in timed)
    peak, kind = _peak(device)
    result = BenchResult(
        name=name,
        device=str(device),
        steps=steps,
        warmup_steps=warmup,
        structures=structures,
        atoms=atoms,
        seconds=total,
        steps_per_s=steps / total,
        structures_per_s=structures / total,
        atoms_per_s=atoms / total,
        step_ms_median=1000 * sorted(step_s)[len(step_s) // 2],
        loader_share=wait_s / total,
        peak_memory_mib=peak,
        memory_kind=kind,
    )
    if not candidates:
        return result
    reference, losses_s = _replay(make_strategy, None, batches, warmup, device)
    for candidate in candidates:
        trial, trial_s = _replay(make_strategy, candidate, batches, warmup, device)
        loss_max, loss_mean = _relative(trial[0], reference[0])
        grad_max, grad_mean = _relative(trial[1], reference[1])
        result.candidates.append(
            CandidateResult(
                name=candidate,
                steps_per_s=steps / trial_s,
                structures_per_s=structures / trial_s,
                speedup=losses_s / trial_s,
                loss_rel_error_max=loss_max,
                loss_rel_error_mean=loss_mean,
                grad_norm_rel_error_max=grad_max,
                grad_norm_rel_error_mean=grad_mean,
                nonfinite_grad_steps=sum(not math.isfinite(n) for n in trial[1]),
            )
        )
    return result


def _replay(
    make: Callable[[list[Any]], Any],
    candidate: str | None,
    batches: list[Any],
    warmup: int,
    device: Any,
) -> tuple[tuple[list[float], list[float]], float]:
    """``((losses, grad norms) of the timed steps, their seconds)`` from fresh weights."""
    from nvalchemi.training.hooks import GradientClipHook, MixedPrecisionHook

    recorder = _Recorder()
    hooks = [MixedPrecisionHook(candidate)] if candidate in PRECISIONS else []
    # A clip that never clips: it computes the gradient norm (after fp16 unscaling).
    strategy = make([*hooks, GradientClipHook(max_norm=1e30), recorder])
    if candidate == "compile":
        strategy.compile = True  # read when the first batch builds the run
    try:
        _train(strategy, batches[:warmup], device)
        losses, seconds = _train(strategy, batches[warmup:], device)
    finally:
        strategy.close()
    return (losses, recorder.grad_norms[warmup:]), seconds
