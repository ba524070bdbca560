"""Bookkeeping shared by all reporters of one orchestrator.

:class:`ReportingState` counts events, keeps a bounded list of
:class:`ReporterMessage` (warnings and errors that reporters or user code want
to surface) and measures throughput between events (:class:`RateMeter`). It
reads only Python counters from the context, never tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from nvalchemi.hooks.reporting._events import event_position, stage_name

__all__ = ["MessageLevel", "RateMeter", "ReporterMessage", "ReportingState"]

MessageLevel = Literal["info", "warning", "error"]
_LEVELS = ("info", "warning", "error")


@dataclass(frozen=True, kw_only=True)
class ReporterMessage:
    """One message shown by reporters (e.g. the dashboard's message panel).

    Example:
        >>> ReporterMessage(level="info", message="checkpoint saved").level
        'info'
    """

    level: MessageLevel
    message: str
    reporter: str | None = None
    """Class name of the reporter that raised it (``None`` for user messages)."""
    stage: str | None = None
    step_count: int | None = None
    global_rank: int | None = None
    timestamp_s: float = field(default_factory=time.time)
    """Wall-clock time (``time.time()``)."""


@dataclass(kw_only=True)
class RateMeter:
    """Steps, batches, structures and atoms per second between reporting events.

    Each event that advanced the batch counter closes a window; the rate of
    the window is blended into the running value with weight ``smoothing``.
    An event that did not advance it (a validation pass, an epoch boundary)
    restarts the window, so time spent validating does not count as slow
    training. Structures and atoms per batch are taken from the batch seen at
    the event (``num_graphs``/``num_nodes``) and are per process.
    """

    smoothing: float = 0.3
    steps_per_s: float | None = None
    batches_per_s: float | None = None
    structures_per_s: float | None = None
    atoms_per_s: float | None = None
    _mark: tuple[float, int, int] | None = field(default=None, repr=False)

    def observe(
        self,
        now: float,
        *,
        batches: int,
        steps: int,
        structures_per_batch: int | None = None,
        atoms_per_batch: int | None = None,
    ) -> None:
        """Record an event at monotonic time ``now`` with the completed counters."""
        mark = self._mark
        self._mark = (now, batches, steps)
        if mark is None:
            return
        then, previous_batches, previous_steps = mark
        elapsed = now - then
        new_batches = batches - previous_batches
        if new_batches <= 0 or elapsed <= 0.0:
            return
        per_batch = new_batches / elapsed
        self.batches_per_s = self._blend(self.batches_per_s, per_batch)
        self.steps_per_s = self._blend(self.steps_per_s, max(steps - previous_steps, 0) / elapsed)
        if structures_per_batch is not None:
            self.structures_per_s = self._blend(
                self.structures_per_s, per_batch * structures_per_batch
            )
        if atoms_per_batch is not None:
            self.atoms_per_s = self._blend(self.atoms_per_s, per_batch * atoms_per_batch)

    def _blend(self, current: float | None, new: float) -> float:
        return new if current is None else current + self.smoothing * (new - current)


def _batch_size(batch: Any, name: str) -> int | None:
    try:
        value = getattr(batch, name, None)
    except Exception:  # a property that cannot answer just means "unknown"
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(kw_only=True)
class ReportingState:
    """Shared state of one :class:`ReportingOrchestrator` (and its reporters).

    Example:
        >>> state = ReportingState(max_messages=2)
        >>> for text in ("a", "b", "c"):
        ...     _ = state.add_message("info", text)
        >>> [m.message for m in state.messages], state.message_count
        (['b', 'c'], 3)
    """

    max_messages: int = 100
    started_at_s: float = field(default_factory=time.monotonic)
    event_count: int = 0
    last_event_at_s: float | None = None
    last_stage: str | None = None
    last_step_count: int | None = None
    last_global_rank: int | None = None
    messages: list[ReporterMessage] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    message_count: int = 0
    """Messages ever added (``messages`` keeps only the last ``max_messages``)."""
    rates: RateMeter = field(default_factory=RateMeter)

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_messages, bool)
            or not isinstance(self.max_messages, int)
            or self.max_messages < 1
        ):
            raise ValueError(
                f"ReportingState.max_messages must be an int >= 1; got {self.max_messages!r}."
            )

    @property
    def elapsed_s(self) -> float:
        """Seconds since the state was created."""
        return time.monotonic() - self.started_at_s

    def mark_event(self, ctx: Any, stage: Any) -> None:
        """Count one event of ``stage`` and update the throughput meter."""
        now = time.monotonic()
        self.event_count += 1
        self.last_event_at_s = now
        self.last_stage = stage_name(stage)
        step = getattr(ctx, "step_count", None)
        self.last_step_count = step if isinstance(step, int) else None
        rank = getattr(ctx, "global_rank", None)
        self.last_global_rank = rank if isinstance(rank, int) else None
        position = event_position(ctx, stage)
        batch = getattr(ctx, "batch", None)
        self.rates.observe(
            now,
            batches=position.batch,
            steps=position.step,
            structures_per_batch=_batch_size(batch, "num_graphs"),
            atoms_per_batch=_batch_size(batch, "num_nodes"),
        )

    def add_message(
        self,
        level: MessageLevel,
        message: str,
        *,
        reporter: Any = None,
        ctx: Any = None,
        stage: Any = None,
    ) -> ReporterMessage:
        """Append a message (dropping the oldest beyond ``max_messages``) and return it."""
        if level not in _LEVELS:
            raise ValueError(f"Message level must be one of {_LEVELS}; got {level!r}.")
        if reporter is not None and not isinstance(reporter, str):
            reporter = type(reporter).__name__
        step = getattr(ctx, "step_count", None)
        rank = getattr(ctx, "global_rank", None)
        entry = ReporterMessage(
            level=level,
            message=str(message),
            reporter=reporter,
            stage=None if stage is None else stage_name(stage),
            step_count=step if isinstance(step, int) else None,
            global_rank=rank if isinstance(rank, int) else None,
        )
        self.messages.append(entry)
        self.message_count += 1
        overflow = len(self.messages) - self.max_messages
        if overflow > 0:
            del self.messages[:overflow]
        return entry
