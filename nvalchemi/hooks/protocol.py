"""Structural protocols every hook and every checkpointable hook satisfies.

A hook is any object with ``frequency``, ``stage`` and ``__call__(ctx, stage)``;
nothing needs to subclass anything. Engines also recognise these optional
members:

``_runs_on_stage(stage) -> bool``
    Multi-stage dispatch. Takes precedence over ``stage ==`` and bypasses the
    engine's stage-type check. The answer must not change after registration
    (or the engine's ``refresh_hooks()`` must be called).
``on_register(engine) -> None``
    Called exactly once, when the hook is registered.
``__enter__``/``__exit__`` or ``close()``
    Lifecycle around a run.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from nvalchemi.hooks.context import HookContext

__all__ = ["CheckpointableHook", "Hook"]


@runtime_checkable
class Hook(Protocol):
    """A callable that an engine runs at one (or several) of its stages.

    ``isinstance(obj, Hook)`` only checks that the three members exist.

    Example:
        >>> from nvalchemi.training import TrainingStage
        >>> class PrintLoss:
        ...     frequency = 10
        ...     stage = TrainingStage.AFTER_BACKWARD
        ...     def __call__(self, ctx, stage):
        ...         print(ctx.step_count, ctx.loss)
        >>> isinstance(PrintLoss(), Hook)
        True
    """

    frequency: int
    """Run only when the engine's ``step_count % frequency == 0``."""
    stage: Enum | None
    """The stage to run at; ``None`` only for hooks with ``_runs_on_stage``."""

    def __call__(self, ctx: HookContext, stage: Enum) -> None:
        """Run the hook for ``stage`` with the engine's context ``ctx``."""
        ...


@runtime_checkable
class CheckpointableHook(Protocol):
    """A hook whose state is saved in, and restored from, training checkpoints.

    Example:
        >>> class Counter:
        ...     def __init__(self):
        ...         self.calls = 0
        ...     def state_dict(self):
        ...         return {"calls": self.calls}
        ...     def load_state_dict(self, state):
        ...         self.calls = int(state["calls"])
        >>> isinstance(Counter(), CheckpointableHook)
        True
    """

    def state_dict(self) -> Mapping[str, Any]:
        """Return the state needed to resume this hook exactly."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state produced by :meth:`state_dict`."""
        ...
