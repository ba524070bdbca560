"""``--minutes``: stop training cleanly once a time budget is spent, on every rank together.

Each rank has its own clock, and ranks start (and run) at slightly different times. If
each decided alone, one rank could leave the loop while another waits in the next
gradient all-reduce -- a collective mismatch that hangs or crashes DDP. So under
``torch.distributed`` the ranks compare their verdicts every ``check_interval``
optimizer steps with one tiny all-reduce (:func:`~nvalchemi.distributed.runtime.all_agree`)
and all stop at the same step as soon as one of them is over budget. A single process
checks its clock after every step (no synchronisation).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["DEFAULT_CHECK_INTERVAL", "TimeBudgetHook"]

DEFAULT_CHECK_INTERVAL = 10
"""Optimizer steps between the ranks' budget agreements under DDP."""


class TimeBudgetHook:
    """Ask the strategy to stop once ``seconds`` of training have passed.

    The clock starts at ``BEFORE_TRAINING`` of each ``run()`` (a resumed run gets a new
    budget). The stop goes through ``strategy.request_stop``: the current step finishes,
    ``AFTER_TRAINING`` hooks run (a ``CheckpointHook`` saves) and the final validation
    happens, so the run ends as cleanly as a finished one.

    Args:
        seconds: the budget (``> 0``).
        check_interval: under ``torch.distributed``, agree on the budget every this many
            optimizer steps (all ranks stop at the same step); a single process checks
            after every step.

    Example:
        >>> hook = TimeBudgetHook(90)
        >>> hook.seconds, hook.check_interval
        (90.0, 10)
    """

    frequency = 1
    stage = None

    def __init__(self, seconds: float, *, check_interval: int = DEFAULT_CHECK_INTERVAL) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"TimeBudgetHook needs a positive number of seconds; got {seconds!r}.")
        if (
            isinstance(check_interval, bool)
            or not isinstance(check_interval, int)
            or check_interval < 1
        ):
            raise ValueError(f"check_interval must be an int >= 1; got {check_interval!r}.")
        self.seconds = float(seconds)
        self.check_interval = check_interval
        self.started: float | None = None
        self.expired = False
        self._last_step = -1
        self._world_size = 1

    def _runs_on_stage(self, stage: Any) -> bool:
        return getattr(stage, "name", None) in ("BEFORE_TRAINING", "AFTER_BATCH")

    def __call__(self, ctx: Any, stage: Any) -> None:
        strategy = ctx.workflow
        if stage.name == "BEFORE_TRAINING" or self.started is None:
            from nvalchemi.distributed.runtime import get_world_size

            self.started = time.monotonic()
            self.expired = False
            self._last_step = int(strategy.step_count)
            self._world_size = get_world_size(strategy.distributed_manager)
            return
        step = int(ctx.step_count)
        if self.expired or step <= self._last_step:
            return  # already stopping, or not at an optimizer-step boundary
        self._last_step = step
        if self._world_size > 1 and step % self.check_interval:
            return
        mine = time.monotonic() - self.started >= self.seconds
        over = mine
        if self._world_size > 1:
            from nvalchemi.distributed.runtime import all_agree

            over = all_agree(mine, strategy.distributed_manager)  # same verdict on every rank
        if over:
            self.expired = True
            budget = f"time budget of {self.seconds / 60:.3g} min"
            strategy.request_stop(
                f"{budget} reached" if mine else f"{budget} reached on another rank"
            )
