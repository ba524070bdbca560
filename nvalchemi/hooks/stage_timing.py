"""Time spent between an engine's stages: :class:`StageTimingHook`, a profiling tool.

One hook listens at every stage it profiles and timestamps each call. The stages that fire
in execution order within one step form a *cycle*; when the cycle ends, the time between
each pair of consecutive stages of the cycle is added to :attr:`StageTimingHook.timings`
under ``"PREV->CUR"`` (and to an optional CSV file, an optional console table and NVTX
ranges for Nsight Systems).

Example:
    >>> from nvalchemi.training import TrainingStage as S
    >>> hook = StageTimingHook({S.BEFORE_FORWARD, S.AFTER_FORWARD, S.AFTER_BACKWARD})
    >>> [s.name for s in hook.profiled_stages]
    ['BEFORE_FORWARD', 'AFTER_FORWARD', 'AFTER_BACKWARD']
    >>> hook._runs_on_stage(S.AFTER_FORWARD), hook._runs_on_stage(S.AFTER_LOSS)
    (True, False)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import statistics
import time
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import IO, Any

import torch

from nvalchemi._fileio import sync_file

__all__ = ["StageTimingHook"]

_LOG = logging.getLogger(__name__)
_BACKENDS = ("auto", "perf_counter", "cuda_event")
_DYNAMICS_PRESETS = ("all", "step", "detailed")
"""Presets over the stages of a dynamics engine (``DynamicsStage``), which this package
does not include."""
_CSV_HEADER = "rank,step,stage,t_since_init_s,delta_s\n"
_NVTX_DOMAINS = {"TrainingStage": "training", "DynamicsStage": "dynamics"}


class StageTimingHook:
    """Measure the time between consecutive profiled stages of every step.

    A *cycle* is the run of profiled stages that fire in execution order within one step
    (the step counter may advance once inside it, as training's does before
    ``AFTER_BATCH``). It ends at the last profiled stage, or when a stage arrives out of
    order (the next step began, or a stage was skipped by ``frequency``); then the delta
    between each pair of consecutive stages it recorded is appended to
    ``timings["PREV->CUR"]`` in seconds. A validation pass that fires the profiled stages
    (``BEFORE_FORWARD``, ``AFTER_FORWARD``) is timed as cycles of its own.

    Timers: ``"perf_counter"`` (host clock, ``time.perf_counter_ns``) or ``"cuda_event"``
    (CUDA events on the current stream: the time the device took, including queued
    work). ``"auto"`` picks CUDA events for a cycle whose first stage sees a batch on a
    CUDA device. The CUDA timer synchronises with the device once per cycle, when it
    computes the deltas: it changes the timing of asynchronous work, as any profiler does.
    Use this hook to profile, not in production runs.

    Args:
        profiled_stages: the stages to time, any set of members of one ``Enum`` (at least
            two; e.g. ``TrainingStage``), ordered as the enum defines them (execution
            order). The presets ``"all"``, ``"step"`` and ``"detailed"`` name stages of a
            dynamics engine (``DynamicsStage``), which this package does not include, and
            raise ``ValueError``. The replacement slots ``DO_BACKWARD`` and
            ``DO_OPTIMIZER_STEP`` cannot be profiled (a hook there would replace them).
        frequency: the engine runs the hook only when its step counter is a multiple of
            ``frequency``.
        enable_nvtx: open an NVTX range ``"<domain>/<STAGE>/<step>"`` from each profiled
            stage to the next (``domain``: ``training``, ``dynamics`` or ``custom``); a
            no-op where ``torch.cuda.nvtx`` does not work (CPU-only builds).
        timer_backend: ``"auto"``, ``"perf_counter"`` or ``"cuda_event"``.
        log_path: CSV file to append rows ``rank,step,stage,t_since_init_s,delta_s`` to
            (the header is written when the file is new; ``{rank}`` in the path is
            replaced by the global rank). ``t_since_init_s``: host seconds from the hook's
            creation to the later stage of the pair.
        show_console: log a table of the last cycle (``logging``, level INFO, logger
            ``nvalchemi.hooks.stage_timing``) every ``console_frequency`` timed cycles.
        console_frequency: timed cycles between two console tables.
        stage: the stage the hook is registered at for engines that need one (default:
            the first profiled stage); dispatch uses :meth:`_runs_on_stage`.

    Attributes:
        timings: ``{"PREV->CUR": [seconds, ...]}``, one entry per timed cycle.
        backend_used: the timer of the last timed cycle (``None`` before the first).
    """

    def __init__(
        self,
        profiled_stages: str | Iterable[Enum] = "all",
        *,
        frequency: int = 1,
        enable_nvtx: bool = True,
        timer_backend: str = "auto",
        log_path: str | Path | None = None,
        show_console: bool = False,
        console_frequency: int = 1,
        stage: Enum | None = None,
    ) -> None:
        self.profiled_stages: tuple[Enum, ...] = _resolve_stages(profiled_stages)
        self._order = {s: i for i, s in enumerate(self.profiled_stages)}
        self.frequency = _positive_int("frequency", frequency)
        self.console_frequency = _positive_int("console_frequency", console_frequency)
        if timer_backend not in _BACKENDS:
            raise ValueError(
                f"StageTimingHook: timer_backend must be one of {_BACKENDS}; got {timer_backend!r}."
            )
        if timer_backend == "cuda_event" and not torch.cuda.is_available():
            raise ValueError(
                "StageTimingHook: timer_backend='cuda_event' needs a CUDA device and none is "
                "available; use 'auto' or 'perf_counter'."
            )
        if stage is not None and stage not in self._order:
            raise ValueError(
                f"StageTimingHook: stage={stage!r} is not one of the profiled stages "
                f"{[s.name for s in self.profiled_stages]}."
            )
        self.stage = stage if stage is not None else self.profiled_stages[0]
        self.timer_backend = timer_backend
        self.enable_nvtx = enable_nvtx
        self._nvtx = torch.cuda.nvtx if enable_nvtx and _nvtx_works() else None
        self.log_path = Path(log_path) if log_path is not None else None
        self.show_console = bool(show_console)
        self.timings: dict[str, list[float]] = {}
        self.backend_used: str | None = None
        self._init_ns = time.perf_counter_ns()
        self._cycle: list[tuple[Enum, int, Any]] = []  # (stage, host ns, stamp)
        self._cycle_step = 0
        self._cycle_rank = 0
        self._cycle_cuda = False
        self._last_index = -1
        self._nvtx_open = False
        self._cycles_timed = 0
        self._csv: IO[str] | None = None

    def _runs_on_stage(self, stage: Any) -> bool:
        """Whether ``stage`` is one of the profiled stages."""
        return stage in self._order

    def __call__(self, ctx: Any, stage: Enum) -> None:
        host_ns = time.perf_counter_ns()
        index = self._order.get(stage)
        if index is None:
            return
        step = getattr(ctx, "step_count", 0)
        if self._cycle and not (index > self._last_index and 0 <= step - self._cycle_step <= 1):
            self._finish_cycle()
        if not self._cycle:
            self._cycle_step = step
            self._cycle_rank = getattr(ctx, "global_rank", 0)
            self._cycle_cuda = self._wants_cuda(ctx)
        if self._cycle_cuda:
            stamp: Any = torch.cuda.Event(enable_timing=True)
            stamp.record()
        else:
            stamp = host_ns
        self._cycle.append((stage, host_ns, stamp))
        self._last_index = index
        last = index == len(self.profiled_stages) - 1
        if self._nvtx is not None:
            self._pop_nvtx()
            if not last:
                domain = _NVTX_DOMAINS.get(type(stage).__name__, "custom")
                self._nvtx.range_push(f"{domain}/{stage.name}/{step}")
                self._nvtx_open = True
        if last:
            self._finish_cycle()

    def summary(self) -> dict[str, dict[str, float | int]]:
        """``{"PREV->CUR": {mean_s, std_s, min_s, max_s, total_s, n_samples}}`` of :attr:`timings`.

        ``std_s`` is the population standard deviation (0 for one sample).
        """
        return {
            label: {
                "mean_s": statistics.fmean(values),
                "std_s": statistics.pstdev(values),
                "min_s": min(values),
                "max_s": max(values),
                "total_s": sum(values),
                "n_samples": len(values),
            }
            for label, values in self.timings.items()
            if values
        }

    def reset(self) -> None:
        """Forget every timing and the cycle in progress (the CSV file stays as written)."""
        self._pop_nvtx()
        self._cycle = []
        self._last_index = -1
        self.timings = {}
        self._cycles_timed = 0

    def close(self) -> None:
        """Time the cycle in progress, then close the CSV file (it reopens if timing goes on)."""
        self._finish_cycle()
        self._close_csv()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing sensible to do
            self._close_csv()

    # ----------------------------------------------------------------- internals
    def _wants_cuda(self, ctx: Any) -> bool:
        if self.timer_backend != "auto":
            return self.timer_backend == "cuda_event"
        device = getattr(getattr(ctx, "batch", None), "device", None)
        return getattr(device, "type", None) == "cuda"

    def _finish_cycle(self) -> None:
        cycle, self._cycle, self._last_index = self._cycle, [], -1
        self._pop_nvtx()
        if len(cycle) < 2:
            return
        if self._cycle_cuda:
            cycle[-1][2].synchronize()
            deltas = [a[2].elapsed_time(b[2]) / 1e3 for a, b in itertools.pairwise(cycle)]
        else:
            deltas = [(b[2] - a[2]) / 1e9 for a, b in itertools.pairwise(cycle)]
        self.backend_used = "cuda_event" if self._cycle_cuda else "perf_counter"
        rows = []
        for (prev, _, _), (cur, host_ns, _), delta in zip(cycle, cycle[1:], deltas):
            label = f"{prev.name}->{cur.name}"
            self.timings.setdefault(label, []).append(delta)
            rows.append((label, (host_ns - self._init_ns) / 1e9, delta))
        self._cycles_timed += 1
        if self.log_path is not None:
            self._write_rows(rows)
        if self.show_console and self._cycles_timed % self.console_frequency == 0:
            self._log_table(rows)

    def _write_rows(self, rows: list[tuple[str, float, float]]) -> None:
        if self._csv is None:
            self._csv = _open_csv(self.log_path, self._cycle_rank)
        rank, step = self._cycle_rank, self._cycle_step
        self._csv.writelines(f"{rank},{step},{s},{t:.6f},{d:.6f}\n" for s, t, d in rows)
        self._csv.flush()

    def _log_table(self, rows: list[tuple[str, float, float]]) -> None:
        width = max(len(label) for label, _, _ in rows)
        lines = [f"stage timings, rank {self._cycle_rank}, step {self._cycle_step}:"]
        for label, _, delta in rows:
            mean = statistics.fmean(self.timings[label])
            lines.append(f"  {label:<{width}}  {delta * 1e3:10.3f} ms   mean {mean * 1e3:10.3f} ms")
        _LOG.info("\n".join(lines))

    def _pop_nvtx(self) -> None:
        if self._nvtx_open:
            self._nvtx_open = False
            self._nvtx.range_pop()

    def _close_csv(self) -> None:
        csv, self._csv = self._csv, None
        if csv is not None:
            sync_file(csv)
            csv.close()


def _resolve_stages(profiled_stages: str | Iterable[Enum]) -> tuple[Enum, ...]:
    if isinstance(profiled_stages, str):
        if profiled_stages in _DYNAMICS_PRESETS:
            raise ValueError(
                f"StageTimingHook: the preset {profiled_stages!r} names stages of a dynamics "
                "engine (DynamicsStage), which this package does not include. Pass the stages "
                "to time, e.g. StageTimingHook({TrainingStage.BEFORE_FORWARD, "
                "TrainingStage.AFTER_FORWARD, TrainingStage.AFTER_BACKWARD})."
            )
        raise ValueError(
            f"StageTimingHook: unknown preset {profiled_stages!r}; presets are "
            f"{_DYNAMICS_PRESETS}, or pass a set of stage enum members."
        )
    stages = list(dict.fromkeys(profiled_stages))
    for i, stage in enumerate(stages):
        if not isinstance(stage, Enum):
            raise TypeError(
                f"StageTimingHook: profiled_stages[{i}] = {stage!r} is not an Enum member; "
                "pass stage enum members such as TrainingStage.AFTER_FORWARD."
            )
        if stage.name.startswith("DO_"):
            raise ValueError(
                f"StageTimingHook: {stage.name} is a replacement slot (a hook there replaces "
                "the step's own work); time around it with the stages before and after it."
            )
    if len({type(s) for s in stages}) > 1:
        raise ValueError(
            "StageTimingHook: profiled_stages mixes stages of several engines "
            f"({sorted({type(s).__name__ for s in stages})}); time one engine per hook."
        )
    if len(stages) < 2:
        raise ValueError(
            f"StageTimingHook: needs at least 2 distinct profiled stages to time the interval "
            f"between them; got {[s.name for s in stages]}."
        )
    order = {member: i for i, member in enumerate(type(stages[0]))}
    return tuple(sorted(stages, key=order.__getitem__))


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"StageTimingHook: {name} must be an int >= 1; got {value!r}.")
    return value


def _nvtx_works() -> bool:
    """Whether ``torch.cuda.nvtx`` can push ranges (CPU-only builds raise ``RuntimeError``)."""
    try:
        torch.cuda.nvtx.range_push("nvalchemi.StageTimingHook")
    except RuntimeError:
        return False
    torch.cuda.nvtx.range_pop()
    return True


def _open_csv(log_path: Path, rank: int) -> IO[str]:
    """Open ``log_path`` for appending; write the header if the file is new or empty."""
    path = Path(str(log_path).replace("{rank}", str(rank)))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size > 0:
        with open(path, newline="") as existing:
            header = existing.readline()
        if header != _CSV_HEADER:
            raise ValueError(
                f"StageTimingHook: {path} exists and is not a stage-timing CSV (its first line "
                f"is {header.strip()!r}); pass another log_path."
            )
        return open(path, "a", newline="")
    handle = open(path, "a", newline="")  # noqa: SIM115 (kept open across cycles)
    handle.write(_CSV_HEADER)
    return handle
