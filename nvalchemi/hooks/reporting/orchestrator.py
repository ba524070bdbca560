"""``ReportingOrchestrator``: one hook that fans reporting events out to reporters.

Reporters are plain objects with ``report(ctx, stage, state)``. The
orchestrator decides *when* they run (stages matched by name, the engine's
``frequency`` gate, rank gating), handles their failures per
:class:`ReportingErrorPolicy`, and owns their lifecycle (enter once, close in
reverse order exactly once). Reporters with ``state_dict``/``load_state_dict`` (an
experiment tracker's run id) are checkpointed through it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from enum import Enum
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from nvalchemi.distributed.runtime import get_rank
from nvalchemi.hooks.protocol import is_checkpointable
from nvalchemi.hooks.reporting._events import stage_name
from nvalchemi.hooks.reporting.state import ReportingState

__all__ = [
    "DEFAULT_REPORT_STAGES",
    "Reporter",
    "ReportingErrorPolicy",
    "ReportingOrchestrator",
]

DEFAULT_REPORT_STAGES: frozenset[str] = frozenset({"AFTER_OPTIMIZER_STEP", "AFTER_STEP"})
"""Once per training step (``AFTER_OPTIMIZER_STEP``) or simulation step (``AFTER_STEP``)."""


class ReportingErrorPolicy(str, Enum):
    """What a reporter failure does (it is always recorded as an ``"error"`` message)."""

    RAISE = "raise"
    """Re-raise: a broken reporter stops the run."""
    WARN = "warn"
    """Emit a ``UserWarning`` and carry on."""
    IGNORE = "ignore"
    """Carry on silently."""


@runtime_checkable
class Reporter(Protocol):
    """A reporting sink: ``report(ctx, stage, state)`` reads the context and shows/writes it.

    Optional members: ``rank_zero_only`` (skip on non-zero ranks),
    ``requires_all_ranks`` (run on every rank, e.g. for a collective
    reduction; wins over rank-zero gating), ``__enter__``/``__exit__`` and
    ``close()``.

    Example:
        >>> class Printer:
        ...     def report(self, ctx, stage, state):
        ...         print(stage.name, ctx.step_count)
        >>> isinstance(Printer(), Reporter)
        True
    """

    def report(self, ctx: Any, stage: Enum, state: ReportingState) -> None:
        """Handle one reporting event."""
        ...


class ReportingOrchestrator:
    """A hook that sends the selected engine events to a list of reporters.

    Args:
        reporters: the reporters, called in order at each event.
        frequency: the engine's gate: events fire when ``step_count % frequency == 0``.
        stages: stage members and/or stage names to report at (default
            :data:`DEFAULT_REPORT_STAGES`). Add ``"AFTER_VALIDATION"`` to see
            validation summaries.
        rank_zero_only: skip every reporter on non-zero ranks (except those that
            set ``requires_all_ranks``).
        error_policy: ``"raise"``, ``"warn"`` or ``"ignore"`` (see :class:`ReportingErrorPolicy`).
        state: shared :class:`ReportingState` (a new one by default).

    Example:
        >>> from types import SimpleNamespace
        >>> class Printer:
        ...     def report(self, ctx, stage, state):
        ...         print(f"event {state.event_count} at step {ctx.step_count}")
        >>> hook = ReportingOrchestrator([Printer()], stages={"AFTER_OPTIMIZER_STEP"})
        >>> hook(SimpleNamespace(step_count=0, global_rank=0), "AFTER_OPTIMIZER_STEP")
        event 1 at step 0
    """

    stage: Enum | None = None

    def __init__(
        self,
        reporters: Iterable[Any],
        *,
        frequency: int = 1,
        stages: Iterable[Enum | str] | Enum | str | None = None,
        rank_zero_only: bool = False,
        error_policy: ReportingErrorPolicy | str = "raise",
        state: ReportingState | None = None,
    ) -> None:
        self.reporters = _check_reporters(reporters)
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(
                f"ReportingOrchestrator frequency must be an int >= 1; got {frequency!r}."
            )
        self.frequency = frequency
        self._default_stages = stages is None
        self.stages = _stage_names(DEFAULT_REPORT_STAGES if stages is None else stages)
        self.rank_zero_only = bool(rank_zero_only)
        try:
            self.error_policy = ReportingErrorPolicy(error_policy)
        except ValueError:
            choices = [p.value for p in ReportingErrorPolicy]
            raise ValueError(
                f"Unknown error_policy {error_policy!r}; use one of {choices}."
            ) from None
        if state is not None and not isinstance(state, ReportingState):
            raise TypeError(f"state must be a ReportingState; got {type(state).__name__}.")
        self.state = state if state is not None else ReportingState()
        self._depth = 0
        self._entered: list[Any] = []
        self._disabled: set[int] = set()
        self._closed = False

    # ----------------------------------------------------------------- hook protocol
    def _runs_on_stage(self, stage: Any) -> bool:
        return stage_name(stage) in self.stages

    def on_register(self, engine: Any) -> None:
        """Check the stage names against the engine's stage enum (typos raise ``ValueError``)."""
        declared = getattr(engine, "_stage_type", None)
        types = declared if isinstance(declared, tuple) else (declared,)
        known = {
            member.name
            for stage_type in types
            if isinstance(stage_type, type) and issubclass(stage_type, Enum)
            for member in stage_type
        }
        if not known:
            return
        unknown = sorted(self.stages - known)
        if (self._default_stages and self.stages & known) or not unknown:
            return
        raise ValueError(
            f"ReportingOrchestrator stages {unknown} are not stages of "
            f"{type(engine).__name__}; valid names: {sorted(known)}."
        )

    def __call__(self, ctx: Any, stage: Any) -> None:
        """Run every active reporter for this event, in order."""
        active = self._active_reporters()
        if not active:
            return
        self.state.mark_event(ctx, stage)
        for reporter in active:
            try:
                reporter.report(ctx, stage, self.state)
            except Exception as exc:
                self._failed(reporter, "report", exc, ctx=ctx, stage=stage)

    # ----------------------------------------------------------------- ranks
    @property
    def global_rank(self) -> int:
        """This process's rank (``torch.distributed``, else the launcher's, else 0)."""
        return get_rank()

    @property
    def is_rank_zero(self) -> bool:
        """Whether this process is global rank 0."""
        return self.global_rank == 0

    def _skipped_here(self, reporter: Any, rank: int) -> bool:
        if rank == 0 or getattr(reporter, "requires_all_ranks", False):
            return False
        return self.rank_zero_only or bool(getattr(reporter, "rank_zero_only", False))

    def _active_reporters(self) -> list[Any]:
        rank = self.global_rank
        return [
            reporter
            for reporter in self.reporters
            if id(reporter) not in self._disabled and not self._skipped_here(reporter, rank)
        ]

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> ReportingOrchestrator:
        self._depth += 1
        if self._depth > 1:
            return self
        self._closed = False
        self._disabled.clear()
        self._entered = []
        for reporter in self._active_reporters():
            enter = getattr(reporter, "__enter__", None)
            if not callable(enter):
                continue
            try:
                enter()
            except Exception as exc:
                self._disabled.add(id(reporter))
                if self.error_policy is ReportingErrorPolicy.RAISE:
                    self._record(reporter, "enter", exc)
                    self._unwind(exc)
                    self._depth = 0
                    raise
                self._failed(reporter, "enter", exc)
            else:
                self._entered.append(reporter)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self._close_all(exc_type, exc, tb)

    def close(self) -> None:
        """Close every reporter now (reverse order, once); later exits do nothing."""
        self._close_all(None, None, None)

    def _unwind(self, exc: BaseException) -> None:
        for reporter in reversed(self._entered):
            try:
                reporter.__exit__(type(exc), exc, exc.__traceback__)
            except Exception as close_exc:
                self._record(reporter, "exit", close_exc)
                warnings.warn(self._message(reporter, "exit", close_exc), UserWarning, stacklevel=3)
        self._entered = []
        self._closed = True

    def _close_all(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._closed:
            return
        self._closed = True
        entered = {id(r) for r in self._entered}
        first_error: Exception | None = None
        for reporter in reversed(self.reporters):
            is_entered = id(reporter) in entered
            exit_ = getattr(reporter, "__exit__", None) if is_entered else None
            close = getattr(reporter, "close", None)
            if not callable(exit_) and not callable(close):
                continue
            op = "exit" if callable(exit_) else "close"
            try:
                if callable(exit_):
                    exit_(exc_type, exc, tb)
                else:
                    close()
            except Exception as close_exc:
                if exc is not None:  # never replace the workflow's own exception
                    self._record(reporter, op, close_exc)
                    warnings.warn(self._message(reporter, op, close_exc), UserWarning, stacklevel=3)
                    continue
                try:
                    self._failed(reporter, op, close_exc)
                except Exception as raised:
                    first_error = first_error or raised
        self._entered = []
        if first_error is not None:
            raise first_error

    # ----------------------------------------------------------------- checkpoints
    def checkpointable_children(self) -> list[tuple[str, Any]]:
        """``[(class name, reporter)]`` of the reporters with ``state_dict`` (``#1``... for
        repeats), e.g. a tracker's run id: saved in checkpoints, so a resumed run continues."""
        counts: dict[str, int] = {}
        children = []
        for reporter in self.reporters:
            if is_checkpointable(reporter):
                name = type(reporter).__name__
                n = counts[name] = counts.get(name, -1) + 1
                children.append((name if n == 0 else f"{name}#{n}", reporter))
        return children

    def state_dict(self) -> dict[str, Any]:
        """The states of the checkpointable reporters, by their keys."""
        return {key: reporter.state_dict() for key, reporter in self.checkpointable_children()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the reporters that :meth:`state_dict` saved (others keep theirs)."""
        for key, reporter in self.checkpointable_children():
            if key in state:
                reporter.load_state_dict(state[key])

    # ----------------------------------------------------------------- errors
    @staticmethod
    def _message(reporter: Any, op: str, exc: BaseException) -> str:
        return f"{type(reporter).__name__} failed during {op}: {type(exc).__name__}: {exc}"

    def _record(self, reporter: Any, op: str, exc: BaseException, **where: Any) -> str:
        message = self._message(reporter, op, exc)
        self.state.add_message("error", message, reporter=reporter, **where)
        return message

    def _failed(self, reporter: Any, op: str, exc: Exception, **where: Any) -> None:
        """Record ``exc`` and apply the error policy (call from inside ``except``)."""
        message = self._record(reporter, op, exc, **where)
        if self.error_policy is ReportingErrorPolicy.RAISE:
            raise exc
        if self.error_policy is ReportingErrorPolicy.WARN:
            warnings.warn(message, UserWarning, stacklevel=3)


def _check_reporters(reporters: Any) -> list[Any]:
    if callable(getattr(reporters, "report", None)):
        reporters = [reporters]
    if isinstance(reporters, (str, bytes)) or not isinstance(reporters, Iterable):
        raise TypeError(
            "reporters must be a list of objects with report(ctx, stage, state); got "
            f"{type(reporters).__name__}."
        )
    checked = list(reporters)
    for index, reporter in enumerate(checked):
        if not callable(getattr(reporter, "report", None)):
            raise TypeError(
                f"reporters[{index}] ({type(reporter).__name__}) has no report(ctx, stage, "
                "state) method."
            )
    return checked


def _stage_names(stages: Any) -> frozenset[str]:
    if isinstance(stages, (str, Enum)):
        stages = [stages]
    if not isinstance(stages, Iterable):
        raise TypeError(f"stages must be stage members or names; got {type(stages).__name__}.")
    names = set()
    for stage in stages:
        if isinstance(stage, Enum):
            names.add(stage.name)
        elif isinstance(stage, str) and stage.strip():
            names.add(stage.strip().upper())
        else:
            raise TypeError(
                f"stages must contain stage members or stage names (e.g. 'AFTER_VALIDATION'); "
                f"got {stage!r}."
            )
    if not names:
        raise ValueError("stages must name at least one stage (e.g. {'AFTER_OPTIMIZER_STEP'}).")
    return frozenset(names)
