"""Weight-update hooks: the hooks that own zeroing, backward and the optimizer step.

A :class:`TrainingUpdateHook` takes part in the four update stages of a batch
(``BEFORE_BATCH``, ``DO_BACKWARD``, ``DO_OPTIMIZER_STEP``, ``AFTER_OPTIMIZER_STEP``).
Update hooks are never dispatched alone: the strategy folds them into one
:class:`TrainingUpdateOrchestrator`, which runs them in ``priority`` order (lower
first) and performs the gated operation once:

=======================  ===================================  =====================================
stage                    a hook returns ``(proceed, loss)``   the orchestrator then
=======================  ===================================  =====================================
``BEFORE_BATCH``         ``proceed=False`` vetoes             zeroes gradients unless vetoed
``DO_BACKWARD``          ``loss`` (a tensor) is threaded on   calls ``backward()`` once on it,
                                                              then restores ``ctx.loss``
``DO_OPTIMIZER_STEP``    ``proceed=False`` vetoes             steps optimizers and schedulers
``AFTER_OPTIMIZER_STEP`` ignored                              (``will_skip`` says if it stepped)
=======================  ===================================  =====================================

Vetoes do not short-circuit: every hook runs and later hooks see ``will_skip=True``.
``will_skip`` is optional: a hook may be written ``__call__(self, ctx, stage)`` (it is then
called without it), and every built-in update hook can be called as ``hook(ctx, stage)``
(``will_skip=False``).
A hook whose class sets ``_veto_defers_step = True`` (gradient accumulation) only
postpones the step; when it is the only one vetoing, :attr:`~TrainingUpdateOrchestrator.step_deferred`
is set and the strategy does not count the batch as a skipped step. Just before stepping,
the orchestrator lets the strategy run its due non-finite loss check
(``workflow.check_nonfinite_if_due()``), so a non-finite loss raises before its
gradients reach the weights.
Canonical priorities: 10 gradient accumulation, 20 mixed precision, 30 clipping,
40 spike skipping, 50 default/EMA.

Example:
    >>> class HalveLoss(TrainingUpdateHook):
    ...     priority = 30
    ...     def __call__(self, ctx, stage, will_skip):
    ...         if stage is TrainingStage.DO_BACKWARD:
    ...             return True, ctx.loss * 0.5
    ...         return True, ctx.loss
    >>> orchestrator = HalveLoss() + TrainingUpdateHook()
    >>> [type(h).__name__ for h in orchestrator.iter_hooks()]
    ['HalveLoss', 'TrainingUpdateHook']
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from nvalchemi.hooks import protocol
from nvalchemi.training.optimizers import step_lr_schedulers, step_optimizers, zero_gradients
from nvalchemi.training.stages import TrainingStage

__all__ = ["TrainingUpdateHook", "TrainingUpdateOrchestrator"]

_BEFORE_BATCH = TrainingStage.BEFORE_BATCH
_DO_BACKWARD = TrainingStage.DO_BACKWARD
_DO_OPTIMIZER_STEP = TrainingStage.DO_OPTIMIZER_STEP
_AFTER_OPTIMIZER_STEP = TrainingStage.AFTER_OPTIMIZER_STEP
_SETUP = TrainingStage.SETUP
UPDATE_STAGES = (_BEFORE_BATCH, _DO_BACKWARD, _DO_OPTIMIZER_STEP, _AFTER_OPTIMIZER_STEP)

_MULTIPLE_ORCHESTRATOR_MSG = (
    "Only one TrainingUpdateOrchestrator may be registered with a strategy. Combine update "
    "hooks into one with `+` (hook_a + hook_b) or TrainingUpdateOrchestrator(*hooks), or "
    "register bare TrainingUpdateHook instances and let the strategy fold them."
)


class TrainingUpdateHook:
    """Base class of hooks that take part in the weight update (see the module docstring).

    Subclasses set the class attributes ``priority`` (lower runs first) and, for hooks
    that may appear at most once, ``_exclusive_update_key``, and override
    ``__call__(ctx, stage, will_skip) -> (proceed, loss)``. The default does nothing:
    it proceeds and passes ``ctx.loss`` on.
    """

    priority: ClassVar[int] = 50
    _exclusive_update_key: ClassVar[str | None] = None

    def _runs_on_stage(self, stage: Any) -> bool:
        return stage in UPDATE_STAGES

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool = False) -> tuple[bool, Any]:
        """Take part in ``stage``; return ``(proceed, loss)``."""
        return True, ctx.loss

    def __add__(self, other: Any) -> TrainingUpdateOrchestrator:
        if isinstance(other, (TrainingUpdateHook, TrainingUpdateOrchestrator)):
            return TrainingUpdateOrchestrator(self, other)
        return NotImplemented


def is_update_hook(hook: Any) -> bool:
    """Whether ``hook`` is a :class:`TrainingUpdateHook` or a :class:`TrainingUpdateOrchestrator`."""
    return isinstance(hook, (TrainingUpdateHook, TrainingUpdateOrchestrator))


def _hook_claims_stage(hook: Any, stage: Any) -> bool:
    """Whether ``hook`` runs at ``stage`` (``_runs_on_stage`` wins over ``stage ==``)."""
    runs_on_stage = protocol.member(hook, "_runs_on_stage")
    if runs_on_stage is not None:
        return bool(runs_on_stage(stage))
    return getattr(hook, "stage", None) == stage


def _check_veto(hook: Any, stage: TrainingStage, result: Any) -> bool:
    """The strict-bool ``proceed`` of an update hook's return value (``TypeError`` otherwise)."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        return result[0]
    got = (
        type(result[0]).__name__ if isinstance(result, tuple) and result else type(result).__name__
    )
    raise TypeError(
        f"{type(hook).__name__}.__call__(stage={stage.name}) must return "
        f"(bool, Tensor | None); proceed got {got}. Return (True, ctx.loss) to proceed "
        "or (False, ctx.loss) to veto."
    )


def _hook_label(hook: Any) -> str:
    return type(hook).__name__


def _takes_will_skip(hook: Any) -> bool:
    """Whether ``hook`` is called ``hook(ctx, stage, will_skip)`` (else ``hook(ctx, stage)``)."""
    try:
        signature = inspect.signature(type(hook).__call__)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(hook, None, None, False)
    except TypeError:
        return False
    return True


class TrainingUpdateOrchestrator:
    """Runs update hooks in priority order and owns zeroing, backward and stepping.

    Args:
        *hooks: update hooks or orchestrators (flattened into their children). Pass
            them unpacked: ``TrainingUpdateOrchestrator(*hooks)``.

    Raises:
        TypeError: an argument is neither an update hook nor an orchestrator.
        ValueError: two hooks share an ``_exclusive_update_key``.

    Attributes:
        optimizer_step_skipped: whether the last ``DO_OPTIMIZER_STEP`` did not step
            (vetoed, or skipped by a ``GradScaler`` after an overflow).
        step_deferred: whether that was only a postponement by gradient accumulation.
    """

    frequency = 1
    stage = None

    def __init__(self, *hooks: Any) -> None:
        children: list[Any] = []
        for index, hook in enumerate(hooks):
            if isinstance(hook, TrainingUpdateOrchestrator):
                children.extend(hook._hooks)
            elif isinstance(hook, TrainingUpdateHook):
                children.append(hook)
            else:
                raise TypeError(
                    f"argument {index} must be TrainingUpdateHook or TrainingUpdateOrchestrator; "
                    f"got {type(hook).__name__}. If you have an iterable, call "
                    "TrainingUpdateOrchestrator(*hooks)."
                )
        _check_exclusive(children)
        self._set_hooks(_by_priority(children))
        self._optimizer_step_skipped = False
        self._step_deferred = False
        self._veto_deferred = False

    # ----------------------------------------------------------------- membership
    def _set_hooks(self, hooks: list[Any]) -> None:
        self._hooks: list[Any] = hooks
        # (hook, whether it takes will_skip), decided once: two-argument hooks work too
        self._calls = [(hook, _takes_will_skip(hook)) for hook in hooks]

    @property
    def optimizer_step_skipped(self) -> bool:
        """Whether the last ``DO_OPTIMIZER_STEP`` dispatch did not step the optimizers."""
        return self._optimizer_step_skipped

    @property
    def step_deferred(self) -> bool:
        """Whether the last ``DO_OPTIMIZER_STEP`` was only postponed (an open accumulation window).

        ``True`` when every hook that vetoed it sets ``_veto_defers_step``; a genuine skip
        (spike, overflow, any other veto) leaves it ``False``.
        """
        return self._step_deferred

    @property
    def window_open(self) -> bool:
        """Whether a child holds accumulated gradients that wait for a later optimizer step."""
        return any(protocol.member(hook, "window_open", False) for hook in self._hooks)

    @property
    def batches_per_step(self) -> int:
        """Batches per optimizer step of a full accumulation window (1 without accumulation)."""
        return max((int(protocol.member(h, "batches_per_step", 1)) for h in self._hooks), default=1)

    def iter_hooks(self) -> Iterator[Any]:
        """The child hooks in dispatch (priority) order."""
        return iter(tuple(self._hooks))

    def add_hook(self, hook: TrainingUpdateHook, workflow: Any = None) -> None:
        """Add a child late; only ``hook.on_register(workflow)`` runs (others are untouched)."""
        if not isinstance(hook, TrainingUpdateHook):
            raise TypeError(f"add_hook expects a TrainingUpdateHook; got {type(hook).__name__}.")
        if any(existing is hook for existing in self._hooks):
            raise ValueError(f"{_hook_label(hook)} is already part of this orchestrator.")
        candidate = [*self._hooks, hook]
        _check_exclusive(candidate)
        if workflow is not None:
            _call_on_register(hook, workflow)
        self._set_hooks(_by_priority(candidate))

    def on_register(self, workflow: Any) -> None:
        """Forward registration to every child that defines ``on_register``."""
        for hook in self._hooks:
            _call_on_register(hook, workflow)

    def _validate_registered_hooks(self, hooks: list[Any]) -> None:
        for child in self._hooks:
            check = protocol.member(child, "_validate_registered_hooks")
            if check is not None:
                check(hooks)

    def _runs_on_stage(self, stage: Any) -> bool:
        return stage in UPDATE_STAGES

    # ----------------------------------------------------------------- dispatch
    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        if stage is _DO_BACKWARD:
            self._backward(ctx)
        elif stage is _BEFORE_BATCH:
            if self._run_gated(ctx, stage):
                zero_gradients(ctx.optimizers)
                clear = getattr(ctx.workflow, "clear_unowned_gradients", None)
                if clear is not None:
                    clear()
        elif stage is _DO_OPTIMIZER_STEP:
            proceed = self._run_gated(ctx, stage)
            self._step_deferred = not proceed and self._veto_deferred
            if proceed:
                check = getattr(ctx.workflow, "check_nonfinite_if_due", None)
                if check is not None:
                    check()  # a due non-finite check raises before the step, not after
            ran = proceed and self._step_optimizers_with_context(ctx)
            self._optimizer_step_skipped = not ran
        elif stage is _AFTER_OPTIMIZER_STEP:
            skipped = self._optimizer_step_skipped
            for hook, takes_skip in self._calls:
                hook(ctx, stage, skipped) if takes_skip else hook(ctx, stage)
        elif stage is _SETUP:
            for hook, takes_skip in self._calls:
                hook(ctx, stage, False) if takes_skip else hook(ctx, stage)

    def _run_gated(self, ctx: Any, stage: TrainingStage) -> bool:
        will_skip = False
        deferred = True  # every veto so far only postpones the step
        for hook, takes_skip in self._calls:
            result = hook(ctx, stage, will_skip) if takes_skip else hook(ctx, stage)
            if not _check_veto(hook, stage, result):
                will_skip = True
                if deferred and not protocol.member(hook, "_veto_defers_step", False):
                    deferred = False
        self._veto_deferred = will_skip and deferred
        return not will_skip

    def _backward(self, ctx: Any) -> None:
        # Hooks thread a loss for backward only (scaled for accumulation or fp16); hooks
        # after backward, reporters and train_batch() see the loss that came in.
        original = ctx.loss
        for hook, takes_skip in self._calls:
            result = hook(ctx, _DO_BACKWARD, False) if takes_skip else hook(ctx, _DO_BACKWARD)
            loss = result[1] if isinstance(result, tuple) and len(result) == 2 else None
            if not isinstance(loss, torch.Tensor):
                raise TypeError(
                    f"{_hook_label(hook)} did not provide a Tensor loss for DO_BACKWARD; got "
                    f"{type(loss).__name__}. Return (True, ctx.loss) to pass the loss on."
                )
            ctx.loss = loss
        try:
            ctx.loss.backward()
        finally:
            ctx.loss = original

    def _step_optimizers_with_context(self, ctx: Any) -> bool:
        """Step optimizers and time-based schedulers; return whether the step ran.

        With ``ctx.grad_scaler`` the scaler steps each optimizer; a step whose
        gradients overflowed is skipped by the scaler, and its scheduler is not stepped.
        """
        scaler = ctx.grad_scaler
        if scaler is None:
            step_optimizers(ctx.optimizers)
            step_lr_schedulers(ctx.lr_schedulers)
            return True
        optimizers = ctx.optimizers
        schedulers = ctx.lr_schedulers
        if not any(s is not None for s in schedulers):
            before = _scale_of(scaler)
            for optimizer in optimizers:
                scaler.step(optimizer)
            scaler.update()
            after = _scale_of(scaler)
            return before is None or after is None or not after < before
        for optimizer in optimizers:
            scaler.step(optimizer)
        overflow = [_found_inf(scaler, optimizer) for optimizer in optimizers]
        before = _scale_of(scaler)
        scaler.update()
        if any(flag is None for flag in overflow):
            after = _scale_of(scaler)
            decreased = before is not None and after is not None and after < before
            overflow = [decreased if flag is None else flag for flag in overflow]
        if not any(overflow):
            step_lr_schedulers(schedulers)
            return True
        step_lr_schedulers(s for s, bad in zip(schedulers, overflow) if not bad)
        return False

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> TrainingUpdateOrchestrator:
        protocol.enter_hooks(self._hooks)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        protocol.exit_hooks(self._hooks, exc_type, exc, tb)

    def close(self) -> None:
        """Close every child (reverse order) that defines ``close()``."""
        for hook in reversed(self._hooks):
            close = protocol.member(hook, "close")
            if close is not None:
                close()

    # ----------------------------------------------------------------- checkpoints
    def checkpointable_children(self) -> list[tuple[str, Any]]:
        """``(key, hook)`` for children with ``state_dict``/``load_state_dict``.

        Keys are class names, suffixed ``#1``, ``#2`` ... for repeated classes, so a
        checkpoint survives a change of priorities or of unrelated children.
        """
        return _stable_keys(h for h in self._hooks if _is_checkpointable(h))

    def state_dict(self) -> dict[str, Any]:
        """``{child key: child.state_dict()}`` for every checkpointable child."""
        return {key: hook.state_dict() for key, hook in self.checkpointable_children()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore the children saved by :meth:`state_dict`.

        With ``strict`` (default) a saved key without a matching child, or a
        checkpointable child missing from ``state``, raises ``ValueError``.
        """
        children = dict(self.checkpointable_children())
        unknown = sorted(set(state) - set(children))
        missing = sorted(set(children) - set(state))
        if strict and (unknown or missing):
            raise ValueError(
                "TrainingUpdateOrchestrator.load_state_dict: saved update-hook state does not "
                f"match the registered hooks (saved only: {unknown}; registered only: {missing})."
                " Register the same update hooks as the saved run, or pass strict=False."
            )
        for key, hook in children.items():
            if key in state:
                hook.load_state_dict(state[key])

    def __add__(self, other: Any) -> TrainingUpdateOrchestrator:
        if isinstance(other, (TrainingUpdateHook, TrainingUpdateOrchestrator)):
            return TrainingUpdateOrchestrator(self, other)
        return NotImplemented

    def __radd__(self, other: Any) -> TrainingUpdateOrchestrator:
        if isinstance(other, TrainingUpdateHook):
            return TrainingUpdateOrchestrator(other, self)
        return NotImplemented

    def __repr__(self) -> str:
        return f"TrainingUpdateOrchestrator({', '.join(map(_hook_label, self._hooks))})"


def _by_priority(hooks: Iterable[Any]) -> list[Any]:
    return sorted(
        hooks, key=lambda h: protocol.member(h, "priority", 50)
    )  # stable: ties keep order


def _check_exclusive(hooks: list[Any]) -> None:
    seen: dict[str, Any] = {}
    for hook in hooks:
        key = protocol.member(hook, "_exclusive_update_key")
        if key is None:
            continue
        if key in seen:
            raise ValueError(
                f"Only one update hook with exclusive key {key!r} may be registered; got "
                f"{_hook_label(seen[key])} and {_hook_label(hook)}."
            )
        seen[key] = hook


def _call_on_register(hook: Any, workflow: Any) -> None:
    on_register = getattr(hook, "on_register", None)
    if on_register is None:
        return
    if not callable(on_register):
        raise TypeError(f"{_hook_label(hook)}.on_register must be callable (on_register(engine)).")
    on_register(workflow)


def _is_checkpointable(hook: Any) -> bool:
    return protocol.is_checkpointable(hook)


def _stable_keys(hooks: Iterable[Any]) -> list[tuple[str, Any]]:
    counts: dict[str, int] = {}
    out = []
    for hook in hooks:
        name = _hook_label(hook)
        n = counts.get(name, 0)
        counts[name] = n + 1
        out.append((name if n == 0 else f"{name}#{n}", hook))
    return out


def _scale_of(scaler: Any) -> float | None:
    try:
        return float(scaler.get_scale())
    except Exception:
        return None


def _found_inf(scaler: Any, optimizer: Any) -> bool | None:
    """Whether the scaler found inf/NaN gradients for ``optimizer`` (``None``: unknown)."""
    try:
        found = scaler._found_inf_per_device(optimizer)
        return any(bool(v.item()) for v in found.values())
    except Exception:
        return None


def _fold_training_update_hooks(hooks: Iterable[Any]) -> list[Any]:
    """Merge the update hooks of ``hooks`` into one orchestrator.

    Other hooks keep their order; the orchestrator takes the position of the first
    update hook. A lone orchestrator is kept as is (same object); two raise
    ``ValueError``.
    """
    hooks = list(hooks)
    orchestrators = [h for h in hooks if isinstance(h, TrainingUpdateOrchestrator)]
    if len(orchestrators) > 1:
        raise ValueError(_MULTIPLE_ORCHESTRATOR_MSG)
    if not any(isinstance(h, TrainingUpdateHook) for h in hooks):
        return hooks
    folded = TrainingUpdateOrchestrator(*(h for h in hooks if is_update_hook(h)))
    out: list[Any] = []
    placed = False
    for hook in hooks:
        if is_update_hook(hook):
            if not placed:
                out.append(folded)
                placed = True
        else:
            out.append(hook)
    return out
