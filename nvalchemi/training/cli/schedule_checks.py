"""Does a learning-rate schedule with a fixed horizon cover the steps a run will train?

``--num-steps N`` changes how long a run trains but not the job's scheduler settings: a
``CosineAnnealingLR(T_max=1000)`` trained for 5000 steps climbs back to the initial
learning rate after step 1000, and ``OneCycleLR(total_steps=1000)`` raises an error at
step 1001. :func:`check_horizons` warns (or, for ``OneCycleLR``, refuses) before training.

Example:
    >>> configs = {"main": [{"scheduler_cls": "torch.optim.lr_scheduler.CosineAnnealingLR",
    ...                      "scheduler_kwargs": {"T_max": 10}}]}
    >>> [h.steps for h in scheduler_horizons(configs)]
    [10]
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nvalchemi.training.cli._errors import CLIError

__all__ = ["Horizon", "check_horizons", "scheduler_horizons"]

_KEYS = ("T_max", "total_steps", "total_iters")
_AFTER = {
    "CosineAnnealingLR": "the learning rate climbs back up along the cosine",
    "LinearLR": "the learning rate stays at its end value",
    "ConstantLR": "the learning rate stays at its end value",
    "PolynomialLR": "the learning rate stays at its end value",
}


@dataclass(frozen=True)
class Horizon:
    """A scheduler that ends after ``steps`` scheduler steps (``key`` in its kwargs)."""

    where: str
    scheduler: str
    key: str
    steps: int


def _name(cls: Any) -> str:
    if isinstance(cls, str):
        return cls.rsplit(".", 1)[-1]
    return getattr(cls, "__name__", str(cls))


def scheduler_horizons(optimizer_configs: Mapping[str, Any]) -> list[Horizon]:
    """Fixed horizons of the schedulers in ``optimizer_configs`` (job payload or saved recipe)."""
    out = []
    for key, entries in (optimizer_configs or {}).items():
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            if not isinstance(entry, Mapping) or not entry.get("scheduler_cls"):
                continue
            kwargs = entry.get("scheduler_kwargs") or {}
            where = f"strategy.optimizer_configs.{key}[{i}].scheduler_kwargs"
            name = _name(entry["scheduler_cls"])
            for horizon_key in _KEYS:
                value = kwargs.get(horizon_key)
                if isinstance(value, int) and not isinstance(value, bool):
                    out.append(Horizon(where, name, horizon_key, value))
                    break
            else:
                epochs, per_epoch = kwargs.get("epochs"), kwargs.get("steps_per_epoch")
                if isinstance(epochs, int) and isinstance(per_epoch, int):
                    out.append(Horizon(where, name, "epochs * steps_per_epoch", epochs * per_epoch))
    return out


def check_horizons(
    optimizer_configs: Mapping[str, Any],
    num_steps: int,
    *,
    warn: bool = True,
    resume: bool = False,
) -> list[str]:
    """Warn (if ``warn``) about schedules shorter than ``num_steps``; returns the texts.

    ``resume``: the configs are a checkpoint's (the schedule's state is restored from it,
    so the fix is a new run or fine-tune rather than an edit of the job).

    A ``OneCycleLR`` shorter than ``num_steps`` is a :class:`CLIError` (torch would stop
    the run with an error once the schedule is used up).
    """
    messages = []
    for h in scheduler_horizons(optimizer_configs):
        if h.steps >= num_steps:
            continue
        field = f"{h.where}.{h.key.split(' ')[0]}"
        fix = f"set {field} to {num_steps} in the job"
        if resume:
            fix = (
                f"start a new run (or `finetune init checkpoint`) with {field} = {num_steps}: "
                "a resumed run keeps the schedule saved in its checkpoint"
            )
        if h.scheduler == "OneCycleLR":
            raise CLIError(
                f"the OneCycleLR schedule ends after {h.key} = {h.steps} steps but the run "
                f"trains {num_steps} (--num-steps); torch fails at step {h.steps + 1}",
                field=field,
                fix=f"{fix}, or train at most {h.steps} steps",
            )
        after = _AFTER.get(h.scheduler, "the schedule is used up")
        text = (
            f"{h.where}: the {h.scheduler} schedule ends at step {h.steps} ({h.key} = "
            f"{h.steps}) but the run trains {num_steps} steps (--num-steps {num_steps}); "
            f"after step {h.steps} {after}. For a complete schedule, {fix}."
        )
        if warn:
            warnings.warn(text, UserWarning, stacklevel=2)
        messages.append(text)
    return messages
