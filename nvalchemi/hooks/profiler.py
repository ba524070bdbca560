"""Profile training or simulation steps with ``torch.profiler``: :class:`TorchProfilerHook`.

The hook starts a ``torch.profiler.profile`` at the first batch (or step), marks the end
of each batch with ``profiler.step()`` so that a ``schedule`` can pick the batches to
record, and stops it at ``AFTER_TRAINING`` or when the engine closes its hooks. Each
recorded window becomes a Chrome trace (open it in Perfetto, ``chrome://tracing`` or
TensorBoard's profiler plugin) in a folder per rank.

Example:
    >>> import torch
    >>> hook = TorchProfilerHook("runs/profile", activities=("cpu",),
    ...                          schedule=torch.profiler.schedule(wait=1, warmup=1, active=2))
    >>> hook.activities, hook.stage
    ((<ProfilerActivity.CPU: 0>,), None)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from nvalchemi._fileio import atomic_path, write_atomic
from nvalchemi.distributed.runtime import get_world_size

__all__ = ["TorchProfilerHook"]

_START_STAGES = frozenset({"BEFORE_TRAINING", "BEFORE_BATCH", "BEFORE_STEP"})
_STEP_STAGES = frozenset({"AFTER_BATCH", "AFTER_STEP"})
_END_STAGE = "AFTER_TRAINING"
_STAGES = _START_STAGES | _STEP_STAGES | {_END_STAGE}

_running: TorchProfilerHook | None = None
"""The hook whose profiler runs in this process (torch profiles one session at a time)."""


class TorchProfilerHook:
    """Record ``torch.profiler`` traces of a run, one folder per rank.

    Runs at the stages named ``BEFORE_TRAINING``, ``BEFORE_BATCH``, ``AFTER_BATCH`` and
    ``AFTER_TRAINING`` (training) and ``BEFORE_STEP``/``AFTER_STEP`` (simulation engines).
    The profiler starts at the first of them that fires, so model setup is not profiled;
    ``AFTER_BATCH``/``AFTER_STEP`` call ``profiler.step()``; ``AFTER_TRAINING``,
    :meth:`close` or leaving ``with hook:`` stop it and write the last trace. A profiler
    runs once: starting this hook again after it stopped, or while another torch profiler
    runs in the process, raises ``RuntimeError``.

    Cost: while the schedule waits (or between ``frequency`` steps, when the engine does
    not call the hook) nothing is recorded; while it records, every operator is.

    Args:
        output_dir: traces go to ``output_dir/rank_<r>/<name>.<time_ns>.pt.trace.json``.
        activities: ``"cpu"``, ``"cuda"`` or ``torch.profiler.ProfilerActivity`` members
            (default: CPU, plus CUDA when a CUDA device is available).
        schedule: a ``torch.profiler.schedule(wait=..., warmup=..., active=...)``; each
            batch is one profiler step. Default: record every batch into one trace.
        record_shapes, profile_memory, with_flops, with_stack: as in
            ``torch.profiler.profile``.
        on_trace_ready_path: also copy each trace to ``on_trace_ready_path/rank_<r>``
            (a TensorBoard log directory for the profiler plugin).
        frequency: the engine calls the hook only when its step counter is a multiple of
            ``frequency`` (so one profiler step spans ``frequency`` batches).
        name: the trace file prefix (TensorBoard's worker name).
        rank_subdirs: ``False`` writes into ``output_dir`` itself in a single process;
            with several processes each rank always gets its own folder.

    Attributes:
        trace_files: the trace files written so far, in order.
    """

    stage = None

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        activities: Iterable[str | ProfilerActivity] | None = None,
        schedule: Callable[[int], Any] | None = None,
        record_shapes: bool = True,
        profile_memory: bool = True,
        with_flops: bool = True,
        with_stack: bool = False,
        on_trace_ready_path: str | os.PathLike | None = None,
        frequency: int = 1,
        name: str = "torch",
        rank_subdirs: bool = True,
    ) -> None:
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(
                f"TorchProfilerHook: frequency must be an int >= 1; got {frequency!r}."
            )
        if schedule is not None and not callable(schedule):
            raise TypeError(
                "TorchProfilerHook: schedule must be callable (step -> ProfilerAction), e.g. "
                f"torch.profiler.schedule(wait=1, warmup=1, active=2); got {schedule!r}."
            )
        if not isinstance(name, str) or not name or any(c in name for c in "/\\."):
            raise ValueError(
                f"TorchProfilerHook: name is a file-name prefix (no '/', '\\\\' or '.'); got "
                f"{name!r}."
            )
        self.output_dir = Path(output_dir)
        self.activities = _activities(activities)
        self.schedule = schedule
        self.record_shapes = bool(record_shapes)
        self.profile_memory = bool(profile_memory)
        self.with_flops = bool(with_flops)
        self.with_stack = bool(with_stack)
        self.on_trace_ready_path = (
            Path(on_trace_ready_path) if on_trace_ready_path is not None else None
        )
        self.frequency = frequency
        self.name = name
        self.rank_subdirs = bool(rank_subdirs)
        self.trace_files: list[Path] = []
        self._profiler: Any = None
        self._finished = False
        self._subdir: str | None = None

    def _runs_on_stage(self, stage: Any) -> bool:
        """Whether ``stage`` is one the hook starts, steps or stops the profiler at."""
        return getattr(stage, "name", None) in _STAGES

    def __call__(self, ctx: Any, stage: Any) -> None:
        name = stage.name
        if name == _END_STAGE:
            self.close()
            return
        if self._profiler is None:
            self._start(ctx)
        if name in _STEP_STAGES:
            self._profiler.step()

    def __enter__(self) -> TorchProfilerHook:
        return self  # the profiler starts at the first batch, not with the run's setup

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the profiler and write its last trace (nothing to do if it is not running)."""
        global _running
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        self._finished = True
        try:
            profiler.stop()
        finally:
            if _running is self:
                _running = None

    # ----------------------------------------------------------------- internals
    def _start(self, ctx: Any) -> None:
        global _running
        if self._finished:
            raise RuntimeError(
                f"TorchProfilerHook(name={self.name!r}) already stopped its profiler; a "
                "profiler runs once. Create a new TorchProfilerHook to profile another run."
            )
        if _running is not None or _profiler_active():
            raise RuntimeError(
                f"TorchProfilerHook(name={self.name!r}) cannot start: another torch profiler "
                "is already running in this process (another TorchProfilerHook, or a "
                "torch.profiler.profile block). Only one can record at a time; remove one."
            )
        rank = getattr(ctx, "global_rank", 0)
        world = get_world_size(getattr(getattr(ctx, "workflow", None), "distributed_manager", None))
        self._subdir = f"rank_{rank}" if self.rank_subdirs or world > 1 else None
        activities = self.activities
        if activities is None:
            activities = (ProfilerActivity.CPU,) + (
                (ProfilerActivity.CUDA,) if torch.cuda.is_available() else ()
            )
        profiler = torch.profiler.profile(
            activities=list(activities),
            schedule=self.schedule,
            on_trace_ready=self._write_trace,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_flops=self.with_flops,
            with_stack=self.with_stack,
        )
        profiler.start()
        self._profiler = profiler
        _running = self

    def _folder(self, root: Path) -> Path:
        return root / self._subdir if self._subdir is not None else root

    def _write_trace(self, profiler: Any) -> None:
        file_name = f"{self.name}.{time.time_ns()}.pt.trace.json"
        target = self._folder(self.output_dir) / file_name
        with atomic_path(target) as tmp:
            profiler.export_chrome_trace(str(tmp))
        self.trace_files.append(target)
        if self.on_trace_ready_path is not None:
            write_atomic(self._folder(self.on_trace_ready_path) / file_name, target.read_bytes())


def _activities(
    value: Iterable[str | ProfilerActivity] | None,
) -> tuple[ProfilerActivity, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, ProfilerActivity)):
        value = (value,)
    parsed = []
    for i, item in enumerate(value):
        if isinstance(item, ProfilerActivity):
            parsed.append(item)
        elif isinstance(item, str) and item.lower() in ("cpu", "cuda"):
            parsed.append(getattr(ProfilerActivity, item.upper()))
        else:
            raise ValueError(
                f"TorchProfilerHook: activities[{i}] = {item!r} is not a profiler activity; use "
                "'cpu', 'cuda' or torch.profiler.ProfilerActivity members."
            )
    if not parsed:
        raise ValueError("TorchProfilerHook: activities is empty; pass 'cpu' and/or 'cuda'.")
    return tuple(dict.fromkeys(parsed))


def _profiler_active() -> bool:
    # torch has no public query: this is the flag its own profile() sets while it records
    # (torch's compiler reads it too); a torch without it reports no profiler.
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))
