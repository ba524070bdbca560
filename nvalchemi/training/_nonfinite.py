"""The non-finite loss policy of the training loop, kept on the device between checks.

``nonfinite_loss="raise"`` records each step's (detached) loss without a device sync
and checks the record in one sync every ``nonfinite_check_interval`` losses (before
that batch's optimizer step), before validation, epoch-end and training-end hooks,
checkpoints and at the end of ``run()``; ``"skip"`` reads every loss (one sync per
batch) and skips the non-finite ones. Under DDP both verdicts are agreed by all ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi.training.errors import NonFiniteLossError

if TYPE_CHECKING:
    from nvalchemi.training._loop_setup import _Plan

__all__: list[str] = []

_IGNORE, _RAISE, _SKIP = 0, 1, 2
_NONFINITE_MODES = {"ignore": _IGNORE, "raise": _RAISE, "skip": _SKIP}


class _NonFiniteRecord:
    """Losses of the steps since the last check, kept on the device (no sync per step)."""

    __slots__ = ("capacity", "losses", "meta")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.losses: list[torch.Tensor] = []
        # (step, epoch, epoch_step, batch_count, [(component, detached value)] | None)
        self.meta: list[tuple[int, int, int, int, Any]] = []

    def forget_last(self, count: int) -> None:
        """Drop the ``count`` most recent losses (their gradients never reached the weights)."""
        if count > 0:
            del self.losses[-count:], self.meta[-count:]

    def first_bad(self) -> tuple[int, int, int, int, Any] | None:
        """Metadata of the first non-finite loss since the last check (one sync), then clear."""
        if not self.losses:
            return None
        losses, meta = self.losses, self.meta
        self.losses, self.meta = [], []
        try:
            stacked = torch.stack(losses)
        except RuntimeError:  # mixed dtypes/devices
            stacked = torch.stack([t.to(device="cpu", dtype=torch.float64) for t in losses])
        finite = torch.isfinite(stacked)
        if bool(finite.all()):
            return None
        index = int((~finite).nonzero()[0, 0])
        return meta[index]


class _NonFiniteGuard:
    """Mixin of the training loop: record, check and skip non-finite losses."""

    def discard_recent_losses(self, count: int) -> None:
        """Tell the non-finite check that the last ``count`` batches' losses were discarded.

        Update hooks that veto a step AND drop its gradients (e.g. ``LossSpikeSkipHook``
        skipping a NaN window) call this, so a deliberately skipped non-finite loss does
        not raise at the next check of ``nonfinite_loss="raise"``.
        """
        self.__dict__["_nonfinite_record"].forget_last(int(count))

    def check_nonfinite(self) -> None:
        """Raise :class:`NonFiniteLossError` if a loss since the last check was NaN/inf.

        One device sync. The loop calls it once ``nonfinite_check_interval`` losses are
        recorded (after backward, before that batch's optimizer step), before validation,
        before ``AFTER_EPOCH``/``AFTER_TRAINING`` hooks, at the end of ``run()`` and when a
        ``train_batch`` session closes; ``train_batch`` calls it before every step;
        checkpoint hooks call it before saving. With the default interval, optimizer steps
        taken between the non-finite loss and the check have already used its gradients;
        the error says how many. Under ``torch.distributed`` (more than one process) the
        verdict is agreed across ranks, so every rank raises together: call it on every
        rank at the same point.
        """
        d = self.__dict__
        record = d["_nonfinite_record"]
        bad = record.first_bad()
        if self._distributed():
            from nvalchemi.distributed.runtime import all_agree

            if all_agree(bad is not None, self.distributed_manager) and bad is None:
                raise NonFiniteLossError(
                    step=d["step_count"],
                    epoch=d["epoch_count"],
                    epoch_step=d["epoch_step_count"],
                    batch_count=d["batch_count"],
                    components=[],
                    detail="Another rank reported a non-finite loss since the last check. "
                    + self._nonfinite_advice(None),
                )
        if bad is None:
            return
        step, epoch, epoch_step, batch_count, components = bad
        names = [n for n, v in components if not bool(torch.isfinite(v))] if components else []
        raise NonFiniteLossError(
            step=step,
            epoch=epoch,
            epoch_step=epoch_step,
            batch_count=batch_count,
            components=names or ["total_loss"],
            detail=self._nonfinite_advice(step),
        )

    def _nonfinite_advice(self, step: int | None) -> str:
        """How far a non-finite loss found now may have reached the weights."""
        now = self.__dict__["step_count"]
        strict = (
            "Set TrainingStrategy(nonfinite_check_interval=1) to check every batch before its "
            "optimizer step (strict; one device sync per step), or nonfinite_loss='skip' to "
            "skip such batches."
        )
        if step is None:
            return (
                "Optimizer steps taken since the previous check may have used non-finite "
                f"gradients (weights and optimizer state). {strict}"
            )
        taken = now - step
        if taken <= 0:
            return (
                "Found before the optimizer step of that batch: no optimizer step used it, the "
                "weights are unaffected."
            )
        return (
            f"Found at a non-finite check (every nonfinite_check_interval="
            f"{self.nonfinite_check_interval} recorded losses, before validation, epoch-end "
            "and training-end hooks, checkpoints and at the end of run()) after optimizer "
            f"steps {step}..{now - 1} had already used its gradients: the weights and "
            f"optimizer state of the last {taken} step(s) may be non-finite; resume from a "
            f"checkpoint with step_count <= {step}. {strict}"
        )

    def _check_nonfinite_before_step(self) -> None:
        """Run the non-finite check if it is due (called right before an optimizer step)."""
        d = self.__dict__
        p = d["_plan"]
        if (
            p is not None
            and p.nonfinite == _RAISE
            and len(d["_nonfinite_record"].losses) >= p.nonfinite_capacity
        ):
            try:
                self.check_nonfinite()
            except Exception as exc:
                self._annotate(exc, "the non-finite loss check before the optimizer step")
                raise

    def _distributed(self) -> bool:
        from nvalchemi.distributed.runtime import get_world_size, is_distributed_initialized

        manager = self.distributed_manager
        return is_distributed_initialized(manager) and get_world_size(manager) > 1

    def _skip_nonfinite(self, loss: torch.Tensor, p: _Plan) -> bool:
        """Whether to skip this batch (``nonfinite_loss="skip"``): one sync, agreed across ranks.

        Every rank must skip together, or DDP's gradient all-reduce would wait forever.
        """
        bad = not math.isfinite(float(loss.detach()))
        if p.world_size > 1 and self._distributed():
            from nvalchemi.distributed.runtime import all_agree

            bad = all_agree(bad, self.distributed_manager)
        return bad

    def _record_loss(self, loss: torch.Tensor, out: Mapping[str, Any]) -> None:
        # Detached aliases only (no kernel, no sync): references to live tensors would keep
        # every step's autograd graph alive until the next check.
        d = self.__dict__
        record = d["_nonfinite_record"]
        record.losses.append(loss.detach())
        components = out.get("per_component_unweighted")
        record.meta.append(
            (
                d["step_count"],
                d["epoch_count"],
                d["epoch_step_count"],
                d["batch_count"],
                [(k, v.detach()) for k, v in components.items()] if components else None,
            )
        )
