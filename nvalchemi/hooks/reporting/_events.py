"""Stage names and the counters of one reporting event.

Reporting never imports an engine's stage enum: it matches stages by their
``name`` so that the same reporters serve training (``TrainingStage``) and
simulation engines (``DynamicsStage``) without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EventPosition", "event_position", "is_validation_stage", "stage_name"]

# At AFTER_OPTIMIZER_STEP the strategy has stepped but not yet advanced its
# counters (they move at AFTER_BATCH), so the batch being reported is not
# counted yet.
_PRE_INCREMENT_STAGES = frozenset({"AFTER_OPTIMIZER_STEP"})
VALIDATION_STAGE = "AFTER_VALIDATION"


def stage_name(stage: Any) -> str:
    """``stage.name`` for enum members, the string itself for strings.

    Example:
        >>> from enum import Enum
        >>> stage_name(Enum("S", "AFTER_STEP").AFTER_STEP), stage_name("AFTER_EPOCH")
        ('AFTER_STEP', 'AFTER_EPOCH')
    """
    if isinstance(stage, str):
        return stage
    name = getattr(stage, "name", None)
    return name if isinstance(name, str) else repr(stage)


def is_validation_stage(stage: Any) -> bool:
    """Whether ``stage`` is the end of a validation pass (``AFTER_VALIDATION``)."""
    return stage_name(stage) == VALIDATION_STAGE


@dataclass(frozen=True, slots=True)
class EventPosition:
    """Where a run stands at one event, in *completed* units.

    ``step`` counts optimizer steps done including the one just reported, so
    the first step is 1 and training rows and the validation that follows
    them share one x axis (the strategy's ``step_count`` is still the
    pre-step value at ``AFTER_OPTIMIZER_STEP``).
    """

    step: int
    batch: int
    epoch_step: int
    epoch: int


def _int_attr(obj: Any, name: str) -> int:
    value = getattr(obj, name, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def event_position(ctx: Any, stage: Any) -> EventPosition:
    """Completed step, batch, in-epoch batch and epoch counts of ``ctx`` at ``stage``.

    Example:
        >>> from types import SimpleNamespace
        >>> ctx = SimpleNamespace(step_count=9, batch_count=9, epoch_step_count=4, epoch=1)
        >>> event_position(ctx, "AFTER_OPTIMIZER_STEP")
        EventPosition(step=10, batch=10, epoch_step=5, epoch=1)
    """
    offset = 1 if stage_name(stage) in _PRE_INCREMENT_STAGES else 0
    step = _int_attr(ctx, "step_count")
    has_batches = hasattr(ctx, "batch_count")
    batch = _int_attr(ctx, "batch_count") if has_batches else step
    return EventPosition(
        step=step + offset,
        batch=batch + offset,
        epoch_step=_int_attr(ctx, "epoch_step_count") + (offset if has_batches else 0),
        epoch=_int_attr(ctx, "epoch"),
    )
