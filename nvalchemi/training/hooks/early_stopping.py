"""Stop training when a validation metric stops improving: :class:`EarlyStoppingHook`.

Example:
    >>> hook = EarlyStoppingHook(metric="energy_mae", patience=3, min_delta=1e-4)
    >>> hook.stage.name
    'AFTER_VALIDATION'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch

from nvalchemi.training.stages import TrainingStage

__all__ = ["EarlyStoppingHook"]


class EarlyStoppingHook:
    """Ask the strategy to stop after ``patience`` validations without improvement.

    Runs at ``AFTER_VALIDATION``. A validation improves on the best value so far when
    the metric is lower by more than ``min_delta`` (``mode="min"``) or higher by more
    than ``min_delta`` (``mode="max"``); a non-finite metric never improves. After
    ``patience`` validations in a row without improvement the hook calls
    ``ctx.workflow.request_stop(reason)``: the strategy finishes the current batch,
    runs ``AFTER_TRAINING`` and stops with consistent counters.

    Args:
        metric: key of the validation summary (``"total_loss"``, ``"energy_mae"``,
            ``"forces_rmse"``, ...).
        patience: validations without improvement before stopping (>= 1).
        min_delta: minimum change that counts as an improvement (>= 0).
        mode: ``"min"`` (lower is better) or ``"max"``.

    State (checkpointed): ``best`` and ``bad_epochs`` (validations since the last
    improvement).
    """

    frequency = 1
    stage = TrainingStage.AFTER_VALIDATION

    def __init__(
        self,
        metric: str = "total_loss",
        patience: int = 10,
        min_delta: float = 0.0,
        mode: Literal["min", "max"] = "min",
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"EarlyStoppingHook: metric must be a summary key; got {metric!r}.")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStoppingHook: patience must be an int >= 1; got {patience!r}.")
        min_delta = float(min_delta)
        if not (math.isfinite(min_delta) and min_delta >= 0.0):
            raise ValueError(
                f"EarlyStoppingHook: min_delta must be a finite number >= 0; got {min_delta!r}."
            )
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStoppingHook: mode must be 'min' or 'max'; got {mode!r}.")
        self.metric = metric
        self.patience = patience
        self.min_delta = min_delta
        self.mode = mode
        self.best: float | None = None
        self.bad_epochs = 0

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        value = self._read(ctx.validation)
        if self._improves(value):
            self.best = value
            self.bad_epochs = 0
            return
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            ctx.workflow.request_stop(
                f"early stopping: validation {self.metric!r} did not improve by more than "
                f"{self.min_delta} for {self.bad_epochs} validation(s) (best {self.best}, "
                f"last {value})"
            )

    def _read(self, summary: Mapping[str, Any] | None) -> float:
        if summary is None:
            raise RuntimeError(
                "EarlyStoppingHook ran without a validation summary (ctx.validation)."
            )
        if self.metric not in summary:
            available = sorted(k for k, v in summary.items() if _is_scalar(v))
            raise KeyError(
                f"EarlyStoppingHook: metric {self.metric!r} is not in the validation summary; "
                f"available metrics: {available}."
            )
        return float(summary[self.metric])

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        """``{"best", "bad_epochs"}`` plus the settings they refer to."""
        return {
            "best": self.best,
            "bad_epochs": self.bad_epochs,
            "metric": self.metric,
            "mode": self.mode,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (``ValueError`` if it tracked another metric)."""
        for key in ("metric", "mode"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"EarlyStoppingHook state was saved with {key}={state[key]!r} but this hook "
                    f"has {key}={getattr(self, key)!r}; use the same settings to resume."
                )
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.bad_epochs = int(state.get("bad_epochs", 0))

    def __repr__(self) -> str:
        return (
            f"EarlyStoppingHook(metric={self.metric!r}, patience={self.patience}, "
            f"min_delta={self.min_delta}, mode={self.mode!r})"
        )


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)
