"""Fit a training run to a time budget: its length and its learning-rate schedule.

:class:`TimeBudgetHook` measures the time of the first training steps, sets the run's
length to the number of steps that fill the budget (validation passes and the final
validation included), fits every fittable learning-rate schedule
(:class:`WarmupCosineLR`) to that length so that its warm-up and its anneal both end
inside the budget, re-fits once when the measured speed drifts (the first
validations and checkpoints show what they really cost), and stops the run at the
fitted step -- or, whatever happens, when the budget is spent.

A run with a fixed length of its own (``num_steps``/``num_epochs`` chosen by you)
keeps it (``fit=False``): the budget is then only a cap, and the hook warns once the
first steps show that the budget is shorter than the run.

Under ``torch.distributed`` the ranks train in lockstep (the gradient all-reduce waits
for the slowest), so rank 0's plan is broadcast and every rank stops at the same step;
the cap is agreed every ``check_interval`` steps (:func:`~nvalchemi.distributed.runtime.all_agree`).

Example:
    >>> import torch
    >>> from nvalchemi.training import OptimizerConfig
    >>> config = OptimizerConfig(torch.optim.AdamW, {"lr": 1e-3}, WarmupCosineLR,
    ...                          {"total_steps": 1000})
    >>> hook = TimeBudgetHook(5 * 60)  # TrainingStrategy(..., hooks=[hook], num_steps=...)
    >>> hook.seconds, hook.fit
    (300.0, True)
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from torch.optim.lr_scheduler import LRScheduler

from nvalchemi.distributed.runtime import all_agree, broadcast_object, get_world_size

__all__ = ["DEFAULT_CHECK_INTERVAL", "BudgetPlan", "TimeBudgetHook", "WarmupCosineLR"]

DEFAULT_CHECK_INTERVAL = 10
"""Optimizer steps between the ranks' budget agreements under DDP."""

_MIN_CHECK_STEPS = 10  # no guard check closer than this to the end

VALIDATION_COST = 0.6
"""A validation batch (forward with forces) costs about this share of a training step."""


def _cosine(start: float, end: float, fraction: float) -> float:
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * fraction))


class WarmupCosineLR(LRScheduler):
    """Warm-up then cosine decay over ``total_steps``, a length that can be fitted later.

    The learning rate rises from ``initial_fraction * lr`` to the optimizer's ``lr``
    over the first ``warmup_fraction`` of the run and falls to ``final_fraction * lr``
    at its end, both halves along a cosine (the shape of ``OneCycleLR`` with
    ``anneal_strategy="cos"``); after ``total_steps`` it stays at the final value.
    :meth:`fit_total_steps` changes the length mid-run without a jump: the rest of the
    schedule is stretched or squeezed into the new remaining steps. The fitted length
    is part of ``state_dict()``, so a resumed run keeps it.

    Args:
        optimizer: the optimizer (its groups' ``lr`` are the peaks).
        total_steps: optimizer steps of the schedule (fitted by :class:`TimeBudgetHook`).
        warmup_fraction: share of the run spent warming up.
        initial_fraction: the first learning rate, relative to the peak.
        final_fraction: the last learning rate, relative to the peak.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> s = WarmupCosineLR(opt, total_steps=10, warmup_fraction=0.2)
        >>> lrs = [opt.param_groups[0]["lr"]] + [(opt.step(), s.step(), s.get_last_lr()[0])[2]
        ...                                      for _ in range(10)]
        >>> round(lrs[0], 3), round(lrs[2], 3), round(lrs[10], 3)
        (0.04, 1.0, 0.01)
    """

    def __init__(
        self,
        optimizer: Any,
        total_steps: int,
        warmup_fraction: float = 0.03,
        initial_fraction: float = 0.04,
        final_fraction: float = 0.01,
        last_epoch: int = -1,
    ) -> None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(
                f"WarmupCosineLR: total_steps must be an int >= 1; got {total_steps!r}."
            )
        if not 0.0 <= warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1); got {warmup_fraction!r}.")
        for name, value in (
            ("initial_fraction", initial_fraction),
            ("final_fraction", final_fraction),
        ):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]; got {value!r}.")
        self.total_steps = int(total_steps)
        self.warmup_fraction = float(warmup_fraction)
        self.initial_fraction = float(initial_fraction)
        self.final_fraction = float(final_fraction)
        self.anchor_step = 0
        self.anchor_progress = 0.0
        super().__init__(optimizer, last_epoch)

    def progress(self, step: int) -> float:
        """How far along the schedule the learning rate of ``step`` is (0 to 1)."""
        span = self.total_steps - self.anchor_step
        if span <= 0:
            return 1.0
        done = (
            self.anchor_progress + (1.0 - self.anchor_progress) * (step - self.anchor_step) / span
        )
        return min(max(done, 0.0), 1.0)

    def factor(self, step: int) -> float:
        """The learning rate of ``step`` relative to the peak."""
        p, w = self.progress(step), self.warmup_fraction
        if p < w:
            return _cosine(self.initial_fraction, 1.0, p / w)
        return _cosine(1.0, self.final_fraction, (p - w) / (1.0 - w))

    def get_lr(self) -> list[float]:
        factor = self.factor(self.last_epoch)
        return [base * factor for base in self.base_lrs]

    def fit_total_steps(self, total_steps: int) -> None:
        """End the schedule at ``total_steps`` from here on, keeping the current rate."""
        step = max(self.last_epoch, 0)
        self.anchor_progress = self.progress(step)
        self.anchor_step = step
        self.total_steps = max(int(total_steps), step + 1)


@dataclass
class BudgetPlan:
    """What :class:`TimeBudgetHook` decided (shown by the reporters, saved in checkpoints).

    Attributes:
        seconds: the budget.
        spent_s: seconds of it used so far (before this ``run()`` when resumed).
        step_s: measured seconds per training step (validations and checkpoints included
            after the re-fit).
        planned_steps: the step the run ends at (``None`` until fitted, or the run's own
            length when it is fixed).
        fitted_at: the step the plan was made (``None`` before).
        refitted: whether the re-fit at a quarter of the plan changed it.
        shortened: whether a guard check (from three quarters on) shortened the run.
        next_check: the step of the next check (``None``: no more checks).
        fixed_length: the run kept a length of its own (no fitting).
    """

    seconds: float
    spent_s: float = 0.0
    step_s: float | None = None
    planned_steps: int | None = None
    fitted_at: int | None = None
    refitted: bool = False
    shortened: bool = False
    next_check: int | None = None
    checks_done: int = 0
    fixed_length: bool = False

    @property
    def remaining_s(self) -> float:
        return max(self.seconds - self.spent_s, 0.0)


class TimeBudgetHook:
    """Fit the run to ``seconds`` of training, and stop it when they are spent.

    After ``warmup_steps + probe_steps`` optimizer steps the hook knows the step time;
    it plans the run's end, fits the schedules that have ``fit_total_steps`` (see
    :class:`WarmupCosineLR`) and stops the run there (``strategy.request_stop``: the
    step finishes, ``AFTER_TRAINING`` hooks run, e.g. a ``CheckpointHook`` saves, and
    the final validation happens). At a quarter of the plan it measures again, with
    the validations and checkpoints done so far, and re-fits once if the end would
    miss the budget by more than ``tolerance``. After that it only guards: at three
    quarters, and then each time half of the remaining steps are done, it shortens the
    run (squeezing the rest of the schedule, without a jump) if the machine has become
    slower, so the anneal still ends inside the budget. The budget is a hard cap either way.

    Args:
        seconds: the budget (``> 0``).
        fit: plan the run's length (``False``: keep the strategy's own ``num_steps`` /
            ``num_epochs`` and only cap it; a warning says when the budget is shorter).
        warmup_steps: steps not timed (allocator and autograd warm-up).
        probe_steps: steps timed before the plan is made.
        tolerance: re-fit when the predicted end misses the budget by more than this
            share of it.
        reserve: share of the budget kept free at the end (the final checkpoint,
            evaluation that follows the run).
        check_interval: under ``torch.distributed``, agree on the cap every this many
            steps (a single process checks after every step).
        clock: seconds (``time.monotonic``; tests pass a fake clock).

    The plan (:class:`BudgetPlan`, :attr:`plan`) is checkpointed: a resumed run keeps
    its planned end and the budget it has left. Progress reporters show the time left
    (:meth:`progress`).
    """

    frequency = 1
    stage = None

    def __init__(
        self,
        seconds: float,
        *,
        fit: bool = True,
        warmup_steps: int = 3,
        probe_steps: int = 12,
        tolerance: float = 0.03,
        reserve: float = 0.01,
        check_interval: int = DEFAULT_CHECK_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"TimeBudgetHook needs a positive number of seconds; got {seconds!r}.")
        for name, value in (
            ("warmup_steps", warmup_steps),
            ("probe_steps", probe_steps),
            ("check_interval", check_interval),
        ):
            minimum = 0 if name == "warmup_steps" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}.")
        self.seconds = float(seconds)
        self.fit = bool(fit)
        self.warmup_steps = warmup_steps
        self.probe_steps = probe_steps
        self.tolerance = float(tolerance)
        self.reserve = float(reserve)
        self.check_interval = check_interval
        self.clock = clock
        self.plan = BudgetPlan(self.seconds, fixed_length=not self.fit)
        self.expired = False
        self._started: float | None = None
        self._run_start_step = 0
        self._marks: dict[str, tuple[float, int]] = {}
        self._last_step = -1
        self._world_size = 1
        self._strategy: Any = None

    # ------------------------------------------------------------------ hook protocol
    def _runs_on_stage(self, stage: Any) -> bool:
        return getattr(stage, "name", None) in ("BEFORE_TRAINING", "AFTER_BATCH")

    def state_dict(self) -> dict[str, Any]:
        return asdict(self._current_plan())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        plan = BudgetPlan(**{**asdict(self.plan), **dict(state)})
        if plan.seconds != self.seconds:  # a new budget for the resumed run: start afresh
            plan = BudgetPlan(self.seconds, fixed_length=not self.fit)
        self.plan = plan

    def _current_plan(self) -> BudgetPlan:
        if self._started is not None:
            self.plan.spent_s = self.clock() - self._started
        return self.plan

    def progress(self) -> dict[str, float]:
        """``{"seconds", "remaining_s", "planned_steps"}`` for progress reporters."""
        plan = self._current_plan()
        out = {"seconds": plan.seconds, "remaining_s": plan.remaining_s}
        if plan.planned_steps is not None:
            out["planned_steps"] = float(plan.planned_steps)
        return out

    def __call__(self, ctx: Any, stage: Any) -> None:
        strategy = ctx.workflow
        if stage.name == "BEFORE_TRAINING" or self._started is None:
            self._begin(strategy)
            return
        step = int(ctx.step_count)
        if self.expired or step <= self._last_step:
            return  # already stopping, or not at an optimizer-step boundary
        self._last_step = step
        now = self.clock()
        done = step - self._run_start_step
        if done == self.warmup_steps:
            self._marks["probe"] = (now, step)
        if self.plan.fitted_at is None and done == self.warmup_steps + self.probe_steps:
            self._make_plan(ctx, now, step)
        elif step == self.plan.next_check and "check" in self._marks:
            self._check(ctx, now, step)
        planned = self.plan.planned_steps
        if not self.plan.fixed_length and planned is not None and step >= planned:
            self.expired = True
            self._current_plan()
            strategy.request_stop(
                f"end of the run fitted to the {_minutes(self.seconds)} budget (step {planned:,})"
            )
            return
        self._check_cap(strategy, now, step)

    # ------------------------------------------------------------------ planning
    def _begin(self, strategy: Any) -> None:
        self._strategy = strategy
        self._started = self.clock() - self.plan.spent_s
        self.expired = False
        self._run_start_step = int(strategy.step_count)
        self._last_step = self._run_start_step
        self._world_size = get_world_size(strategy.distributed_manager)
        self._marks = {}
        if self.plan.fitted_at is not None:  # resumed: measure from here on
            self._marks["check"] = (self._started + self.plan.spent_s, self._run_start_step)

    def _validation_s_per_step(self, strategy: Any, step_s: float) -> tuple[float, float]:
        """Estimated ``(validation seconds per training step, one final validation)``."""
        config = getattr(strategy, "validation_config", None)
        one = VALIDATION_COST * step_s * (_length(getattr(config, "validation_data", None)) or 0)
        every = getattr(config, "every_n_steps", None)
        if not every and getattr(config, "every_n_epochs", None):
            every = config.every_n_epochs * max(_batches_per_epoch(strategy) or 0, 1)
        return (one / every if every else 0.0), one

    def _steps_that_fit(self, now: float, step_s: float, per_val: float, final: float) -> int:
        left = self.seconds * (1.0 - self.reserve) - (now - self._started) - final
        return max(int(left / (step_s + per_val)), 0)

    def _make_plan(self, ctx: Any, now: float, step: int) -> None:
        strategy = ctx.workflow
        start, at = self._marks.get("probe", (self._started, self._run_start_step))
        step_s = (now - start) / max(step - at, 1)
        per_val, final = self._validation_s_per_step(strategy, step_s)
        planned = step + self._steps_that_fit(now, step_s, per_val, final)
        planned = self._agree(planned)
        self.plan.step_s, self.plan.fitted_at = step_s, step
        self._marks["check"] = (now, step)
        own = _own_length(strategy)
        if self.plan.fixed_length:
            self.plan.planned_steps = own
            if own is not None and planned < own:
                warnings.warn(
                    f"The time budget of {_minutes(self.seconds)} fits about {planned:,} of the "
                    f"run's {own:,} steps ({1000 * step_s:.0f} ms per step): the run stops at "
                    "the budget before its learning-rate schedule ends. Leave num_steps / "
                    "num_epochs unset to fit the run (and its schedule) to the budget, or give "
                    "more time.",
                    UserWarning,
                    stacklevel=2,
                )
            return
        if own is not None and own < planned:
            planned = own  # the strategy ends earlier by itself
        self.plan.planned_steps = planned
        self.plan.next_check = step + max((planned - step) // 4, 1)
        self._fit_schedules(ctx, planned)

    def _check(self, ctx: Any, now: float, step: int) -> None:
        """Measure since the last check; re-fit (the first check) or shorten (guards) if off."""
        strategy, plan = ctx.workflow, self.plan
        first = plan.checks_done == 0
        since, at = self._marks["check"]
        step_s = (now - since) / max(step - at, 1)  # validations and checkpoints included
        _, final = self._validation_s_per_step(strategy, plan.step_s or step_s)
        predicted = (now - self._started) + (plan.planned_steps - step) * step_s + final
        miss = predicted - self.seconds * (1.0 - self.reserve)
        # The first check re-fits either way; the guards only shorten a run that would overrun.
        off = (abs(miss) if first else miss) > self.tolerance * self.seconds
        candidate = step + self._steps_that_fit(now, step_s, 0.0, final) if off else None
        candidate = self._agree(candidate)  # rank 0 decides for every rank
        self._marks["check"] = (now, step)
        if candidate is not None:
            own = _own_length(strategy)
            plan.step_s = step_s
            plan.planned_steps = candidate if own is None else min(candidate, own)
            self._fit_schedules(ctx, plan.planned_steps)
        plan.checks_done += 1
        if first:
            plan.refitted = candidate is not None
            left = 2 * (plan.planned_steps - step) // 3  # the first guard at three quarters
        else:
            plan.shortened = plan.shortened or candidate is not None
            left = (plan.planned_steps - step) // 2  # then halfway to the end, again and again
        plan.next_check = step + left if left >= _MIN_CHECK_STEPS else None

    def _agree(self, planned: int | None) -> int | None:
        if self._world_size <= 1:
            return planned

        value = broadcast_object(planned, src=0, manager=self._strategy.distributed_manager)
        return None if value is None else int(value)

    def _fit_schedules(self, ctx: Any, planned: int) -> None:
        fitted, fixed = 0, []
        for scheduler in getattr(ctx, "lr_schedulers", None) or []:
            fit = getattr(scheduler, "fit_total_steps", None)
            if callable(fit):
                fit(planned)
                fitted += 1
            elif scheduler is not None and _has_horizon(scheduler):
                fixed.append(type(scheduler).__name__)
        if fixed:
            warnings.warn(
                f"The learning-rate schedule(s) {fixed} have a fixed length and are not fitted "
                f"to the {_minutes(self.seconds)} budget (the run ends at step {planned:,}); use "
                "nvalchemi.training.time_budget.WarmupCosineLR to have warm-up and decay end "
                "inside the budget.",
                UserWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ the cap
    def _check_cap(self, strategy: Any, now: float, step: int) -> None:
        if self._world_size > 1 and step % self.check_interval:
            return
        mine = now - self._started >= self.seconds
        over = mine
        if self._world_size > 1:
            over = all_agree(mine, strategy.distributed_manager)  # same verdict on every rank
        if over:
            self.expired = True
            self._current_plan()
            budget = f"time budget of {_minutes(self.seconds)}"
            strategy.request_stop(
                f"{budget} reached" if mine else f"{budget} reached on another rank"
            )


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.3g} min"


def _length(values: Any) -> int | None:
    try:
        return len(values) if values is not None else None
    except TypeError:
        return None


def _batches_per_epoch(strategy: Any) -> int | None:
    return _length(getattr(strategy, "active_dataloader", None))


def _own_length(strategy: Any) -> int | None:
    """The step count the strategy ends at by itself, when it has a length of its own."""
    if getattr(strategy, "num_steps", None) is not None:
        return int(strategy.num_steps)
    epochs, per_epoch = getattr(strategy, "num_epochs", None), _batches_per_epoch(strategy)
    if epochs is None or per_epoch is None:
        return None
    return math.ceil(epochs * per_epoch * getattr(strategy, "epoch_step_modifier", 1.0))


def _has_horizon(scheduler: Any) -> bool:
    return any(hasattr(scheduler, k) for k in ("total_steps", "T_max", "total_iters"))
