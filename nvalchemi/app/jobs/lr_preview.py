"""Learning-rate preview: run the job's real scheduler on a dummy optimizer.

The optimizer and scheduler of an ``OptimizerConfig`` are built on one dummy parameter and
stepped as training steps them, so any scheduler (yours too) previews correctly; metric
schedulers (``ReduceLROnPlateau``) preview as their flat starting value with a note.

Example:
    >>> import torch
    >>> from nvalchemi.training import OptimizerConfig
    >>> config = OptimizerConfig(torch.optim.SGD, {"lr": 1.0},
    ...                          torch.optim.lr_scheduler.StepLR, {"step_size": 2, "gamma": 0.5})
    >>> preview = lr_preview(config, num_steps=5)
    >>> [round(lr, 3) for lr in preview.lrs]
    [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LRPreview", "lr_preview", "preview_steps"]

MAX_PREVIEW_STEPS = 20_000
DEFAULT_PREVIEW_STEPS = 100


@dataclass
class LRPreview:
    """Learning rate before step 0 and after each of ``num_steps`` optimizer steps."""

    optimizer: str
    scheduler: str | None
    lrs: list[float] = field(default_factory=list)
    note: str | None = None

    @property
    def num_steps(self) -> int:
        return max(len(self.lrs) - 1, 0)

    def samples(self, count: int = 6) -> list[tuple[int, float]]:
        """``count`` evenly spaced ``(step, lr)`` points, first and last included."""
        if not self.lrs:
            return []
        last = len(self.lrs) - 1
        points = sorted({round(i * last / max(count - 1, 1)) for i in range(count)})
        return [(s, self.lrs[s]) for s in points]


def preview_steps(
    num_steps: int | None, config: Any, *, budget: bool = False
) -> tuple[int, str | None]:
    """How many steps to preview, and a note when it is a guess (``num_steps``: the job's
    fixed length, else ``None``; ``budget``: the length is fitted to a time budget)."""
    if num_steps:
        steps, note = int(num_steps), None
    else:
        kwargs = config.scheduler_kwargs or {}
        length = kwargs.get("total_steps") or kwargs.get("T_max") or kwargs.get("total_iters")
        kind = "time-budget job" if budget else "num_epochs job"
        if isinstance(length, int) and length > 0:
            steps = length
            note = f"{kind}: shown over the scheduler's own length"
            note += (
                " (fitted to the budget at run time: the shape is kept)"
                if budget
                else " (steps per epoch depend on the data)"
            )
        else:
            steps = DEFAULT_PREVIEW_STEPS
            note = f"{kind}: first {steps} steps shown (the run's length depends on the data)"
    if steps > MAX_PREVIEW_STEPS:
        note = f"first {MAX_PREVIEW_STEPS:,} of {steps:,} steps shown"
        steps = MAX_PREVIEW_STEPS
    return steps, note


def lr_preview(config: Any, num_steps: int) -> LRPreview:
    """Step ``config``'s real optimizer and scheduler ``num_steps`` times on a dummy parameter."""
    import torch

    from nvalchemi.training.optimizers import is_metric_scheduler

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer, scheduler = config.build([param])
    preview = LRPreview(
        optimizer=config.optimizer_cls.__name__,
        scheduler=None if scheduler is None else type(scheduler).__name__,
    )
    lrs = [float(optimizer.param_groups[0]["lr"])]
    if scheduler is None or is_metric_scheduler(scheduler):
        preview.lrs = lrs * (num_steps + 1)
        if scheduler is not None:
            preview.note = "changes only when the validation metric plateaus; starting value shown"
        return preview
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(num_steps):
            optimizer.step()  # no gradients: a no-op that keeps the scheduler's order check quiet
            try:
                scheduler.step()
            except (ValueError, IndexError, ZeroDivisionError) as exc:
                preview.note = (
                    f"the scheduler fails at step {step + 1} ({' '.join(str(exc).split())}); "
                    "training would stop there: make the schedule at least as long as the run"
                )
                break
            lrs.append(float(optimizer.param_groups[0]["lr"]))
    preview.lrs = [v for v in lrs if math.isfinite(v)]
    return preview
