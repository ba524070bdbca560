"""The hook protocol: what every hook has, and every optional member an engine may use.

A hook is any object with ``frequency``, ``stage`` and ``__call__(ctx, stage)``; nothing
needs to subclass anything. Everything else is optional; the engines (the training
strategy, its run loop, checkpoints, validation) look a member up only through
:func:`member`, which accepts only the names listed in :data:`OPTIONAL_MEMBERS`. That
table is the whole contract between engines and hooks:

===============================  ==========================================================
member                           meaning, and when it is used
===============================  ==========================================================
``_runs_on_stage(stage)``        multi-stage dispatch: whether the hook runs at ``stage``
                                 (wins over ``stage ==``; asked when hooks are registered)
``on_register(engine)``          called once, when the hook is registered
``_validate_registered_hooks``   ``(hooks)``: raise if a hook it depends on is missing or
                                 conflicts; called at construction and each registration
``prepare_strategy(strategy)``   called once per run before models move to their devices
                                 and before ``SETUP`` (DDP wraps models here)
``__enter__()`` / ``__exit__``   around a run (or a ``train_batch`` session), outermost
                                 first in, last out; ``close()`` when there is no ``__exit__``
``close()``                      release resources at the end of a run
``state_dict()``                 with ``load_state_dict``: the hook is checkpointed
``load_state_dict(state)``       (see :class:`CheckpointableHook`)
``checkpointable_children()``    ``[(key, hook)]`` of hooks inside this one (the update
                                 orchestrator), saved and restored under their own keys
``iter_hooks()``                 the hooks inside this one, in dispatch order
``inference_autocast(device)``   a context manager for validation forwards (mixed precision)
``precision_name``               label of that precision (``"bf16"``) for reports
===============================  ==========================================================

Update hooks (:mod:`nvalchemi.training.hooks.update`) may also define, and the update
orchestrator reads of its children: ``priority`` (dispatch order, lower first),
``_exclusive_update_key`` (at most one hook per key), ``_veto_defers_step`` (a veto that
only postpones the step: gradient accumulation), ``window_open`` (gradients wait for a
later step) and ``batches_per_step`` (batches per optimizer step of a full window).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from nvalchemi.hooks.context import HookContext

__all__ = [
    "OPTIONAL_MEMBERS",
    "CheckpointableHook",
    "Hook",
    "enter_hooks",
    "exit_hooks",
    "is_checkpointable",
    "member",
    "runs_at",
]

_DATA_MEMBERS = frozenset(
    {
        "precision_name",
        "priority",
        "_exclusive_update_key",
        "_veto_defers_step",
        "window_open",
        "batches_per_step",
    }
)
OPTIONAL_MEMBERS: frozenset[str] = _DATA_MEMBERS | {
    "_runs_on_stage",
    "on_register",
    "_validate_registered_hooks",
    "prepare_strategy",
    "__enter__",
    "__exit__",
    "close",
    "state_dict",
    "load_state_dict",
    "checkpointable_children",
    "iter_hooks",
    "inference_autocast",
}
"""Every optional member an engine may look up on a hook (see the module docstring)."""


def runs_at(fixed: Enum | None, stage: Enum, default_names: frozenset[str]) -> bool:
    """``_runs_on_stage`` of a hook with an optional fixed stage: that stage, else every stage
    named in ``default_names`` (the training loop's and a dynamics engine's names for one
    point of a step, e.g. ``{"BEFORE_FORWARD", "BEFORE_COMPUTE"}``)."""
    if fixed is not None:
        return stage == fixed
    return getattr(stage, "name", None) in default_names


def member(hook: Any, name: str, default: Any = None) -> Any:
    """``hook.<name>`` if the hook defines that optional member (a method only if callable),
    else ``default``.

    ``name`` must be one of :data:`OPTIONAL_MEMBERS`: engines reach hooks only through the
    declared protocol.

    >>> class Closing:
    ...     def close(self): return "closed"
    >>> member(Closing(), "close")()
    'closed'
    >>> member(Closing(), "prepare_strategy") is None
    True
    """
    if name not in OPTIONAL_MEMBERS:
        raise ValueError(f"{name!r} is not an optional hook member of nvalchemi.hooks.protocol.")
    value = getattr(hook, name, default)
    if name in _DATA_MEMBERS:
        return value
    return value if callable(value) else default


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


def is_checkpointable(hook: Any) -> bool:
    """Whether ``hook`` has ``state_dict`` and ``load_state_dict`` (its state is checkpointed)."""
    return member(hook, "state_dict") is not None and member(hook, "load_state_dict") is not None


def enter_hooks(hooks: Iterable[Any]) -> None:
    """``__enter__()`` every hook that has one, in order; if one fails, exit those already
    entered (:func:`exit_hooks`) and re-raise."""
    entered: list[Any] = []
    try:
        for hook in hooks:
            enter = member(hook, "__enter__")
            if enter is not None:
                enter()
                entered.append(hook)
    except BaseException as exc:
        exit_hooks(entered, type(exc), exc, exc.__traceback__)
        raise


def exit_hooks(hooks: Iterable[Any], exc_type: Any, exc: Any, tb: Any) -> None:
    """``__exit__(...)`` (else ``close()``) every hook, last first; all run even if one fails.

    The first failure is raised once all ran, unless ``exc`` (an exception already on its
    way out) is set.
    """
    first_error: BaseException | None = None
    for hook in reversed(list(hooks)):  # a copy: an exiting hook may unregister itself
        try:
            exit_ = member(hook, "__exit__")
            if exit_ is not None:
                exit_(exc_type, exc, tb)
            else:
                close = member(hook, "close")
                if close is not None:
                    close()
        except Exception as error:  # exit every hook; report the first failure
            first_error = first_error or error
    if first_error is not None and exc is None:
        raise first_error
