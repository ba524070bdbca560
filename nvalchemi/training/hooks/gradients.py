"""Gradient update hooks: accumulation, clipping and loss-spike skipping.

All three are :class:`~nvalchemi.training.hooks.update.TrainingUpdateHook` s, run by the
strategy's update orchestrator in priority order:

* :class:`GradientAccumulationHook` (10) sums the gradients of ``steps`` batches into one
  optimizer step (``N`` batches of ``b`` structures = one batch of ``N*b``);
* ``MixedPrecisionHook`` (20) unscales fp16 gradients;
* :class:`GradientClipHook` (30) publishes the pre-clip norm to ``ctx.grad_norm`` and
  clips by norm and/or value;
* :class:`LossSpikeSkipHook` (40) vetoes the step when the loss spikes or the gradients
  are non-finite.

A vetoed step leaves ``step_count`` unchanged; frequency-gated hooks, step-cadence
validation and checkpoints fire only when the step actually ran.

Example:
    >>> hooks = [GradientAccumulationHook(4), GradientClipHook(max_norm=10.0),
    ...          LossSpikeSkipHook(factor=5.0)]
    >>> [h.priority for h in hooks]
    [10, 30, 40]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from nvalchemi.distributed.runtime import all_agree
from nvalchemi.training.hooks.update import TrainingUpdateHook
from nvalchemi.training.stages import TrainingStage

__all__ = ["GradientAccumulationHook", "GradientClipHook", "LossSpikeSkipHook"]

_BEFORE_BATCH = TrainingStage.BEFORE_BATCH
_DO_BACKWARD = TrainingStage.DO_BACKWARD
_DO_OPTIMIZER_STEP = TrainingStage.DO_OPTIMIZER_STEP
_AFTER_OPTIMIZER_STEP = TrainingStage.AFTER_OPTIMIZER_STEP


def _check_config(
    hook: BaseModel, state: Mapping[str, Any], fields: tuple[str, ...], fix: str = ""
) -> None:
    conflicts = [
        f"{name}={state[name]!r} vs constructor {name}={getattr(hook, name)!r}"
        for name in fields
        if name in state and state[name] != getattr(hook, name)
    ]
    if conflicts:
        name = type(hook).__name__
        fix = fix or "to resume, use the checkpoint's settings"
        raise ValueError(
            f"{name} checkpoint conflict: " + "; ".join(conflicts) + "; construct the hook with "
            f"matching config or load into a fresh instance ({fix})."
        )


def _grad_params(optimizers: list[Any]) -> list[torch.Tensor]:
    """Parameters with gradients, each once (several optimizers may share parameters)."""
    seen: set[int] = set()
    out = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None and id(param) not in seen:
                    seen.add(id(param))
                    out.append(param)
    return out


def _same_device_and_dtype(tensors: list[torch.Tensor]) -> bool:
    if not tensors:
        return False
    first = tensors[0]
    device, dtype = first.device, first.dtype
    return all(t.device == device and t.dtype == dtype and not t.is_sparse for t in tensors)


def _total_norm(params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Total ``norm_type``-norm of the gradients of ``params`` (a device tensor; no sync)."""
    grads = [p.grad for p in params]
    if _same_device_and_dtype(grads):  # the common case: skip torch's per-call grouping
        return torch.linalg.vector_norm(
            torch.stack(torch._foreach_norm(grads, norm_type)), norm_type
        )
    return torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite=False)


def _clip_with_norm(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    grads = [p.grad for p in params]
    if _same_device_and_dtype(grads) and norm.device == grads[0].device:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grads[0].dtype)
        torch._foreach_mul_(grads, coef)
    elif params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


# ---------------------------------------------------------------------------- accumulation
@dataclass(slots=True)
class _AccumulationState:
    micro_step: int = 0


class GradientAccumulationHook(BaseModel, TrainingUpdateHook):
    """Accumulate the gradients of ``steps`` batches into one optimizer step.

    Within a window the hook vetoes the optimizer step until the window's last batch and
    the gradient zeroing after its first; each batch's loss is scaled by ``1/window
    length``, so with mean-reduced losses ``N`` batches of ``b`` structures give the
    gradients of one batch of ``N*b``. A window never spans an epoch boundary when the
    epoch length is known (a sized loader in ``run()``): the epoch's last batch closes a
    shorter window, which averages over its own batches, so an epoch of ``B`` batches
    takes ``ceil(B / steps)`` optimizer steps and epoch-end checkpoints are never inside
    a window. With an unsized loader (or ``train_batch``) windows are always ``steps``
    long. ``step_count`` counts optimizer steps, ``batch_count`` batches; the vetoes are
    not "skips" for the strategy's ``max_consecutive_skips`` guard.

    Args:
        steps: batches per optimizer step (``>= 1``; 1 is a no-op).

    Example:
        >>> GradientAccumulationHook(4).steps
        4
    """

    model_config = ConfigDict(extra="forbid")
    priority: ClassVar[int] = 10
    _exclusive_update_key: ClassVar[str | None] = "GradientAccumulationHook"
    # A veto of this hook postpones the optimizer step (the window is open); it is not a skip.
    _veto_defers_step: ClassVar[bool] = True

    steps: int = Field(ge=1)

    _rt: _AccumulationState = PrivateAttr(default_factory=_AccumulationState)

    @property
    def _runtime(self) -> _AccumulationState:
        # Direct slot access: pydantic's __getattr__ for private attributes costs ~3 us.
        return self.__pydantic_private__["_rt"]

    def __init__(self, steps: int | None = None, **data: Any) -> None:
        if steps is not None:
            data["steps"] = steps
        super().__init__(**data)

    @property
    def micro_step(self) -> int:
        """Batches already accumulated in the current window (``0 .. steps - 1``)."""
        return self._runtime.micro_step

    @property
    def batches_per_step(self) -> int:
        """Batches per optimizer step in a full window (``steps``)."""
        return self.steps

    @property
    def window_open(self) -> bool:
        """Whether gradients of some batches wait for the window's optimizer step."""
        return self._runtime.micro_step != 0

    def _window_length(self, ctx: Any, micro: int) -> int:
        """Length of the current window: ``steps``, or less at the end of a known epoch."""
        length = getattr(ctx, "epoch_length", None)
        if length is None:
            return self.steps
        remaining = length - ctx.epoch_step_count  # batches left in the epoch, this one included
        if remaining <= 0:  # past the known end (counters from elsewhere): plain windows
            return self.steps
        return min(self.steps, micro + remaining)

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool = False) -> tuple[bool, Any]:
        n = self.steps
        if n == 1:
            return True, ctx.loss
        state = self._runtime
        if stage is _DO_BACKWARD:
            return True, ctx.loss * (1.0 / self._window_length(ctx, state.micro_step))
        if stage is _BEFORE_BATCH:
            return state.micro_step == 0, ctx.loss
        if stage is _DO_OPTIMIZER_STEP:
            micro = state.micro_step
            return micro + 1 >= self._window_length(ctx, micro), ctx.loss
        if stage is _AFTER_OPTIMIZER_STEP:
            micro = state.micro_step
            # Counters are still those of this batch here, so the window is recomputed
            # exactly as at DO_OPTIMIZER_STEP.
            closed = micro + 1 >= self._window_length(ctx, micro)
            state.micro_step = 0 if closed else micro + 1
        return True, ctx.loss

    def state_dict(self) -> dict[str, Any]:
        """``{"steps", "micro_step"}``; a partial window's gradients are not saved."""
        return {"steps": self.steps, "micro_step": self._runtime.micro_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position in the window (``ValueError`` if ``steps`` differs)."""
        _check_config(self, state, ("steps",))
        micro = int(state.get("micro_step", 0))
        if not 0 <= micro < self.steps:
            raise ValueError(
                f"GradientAccumulationHook micro_step must be in [0, {self.steps}); got {micro}."
            )
        self._runtime.micro_step = micro


# ---------------------------------------------------------------------------- clipping
class GradientClipHook(BaseModel, TrainingUpdateHook):
    """Clip gradients before the optimizer step; publish the pre-clip norm.

    Runs at ``DO_OPTIMIZER_STEP`` after the fp16 unscale (priority 30) unless the step
    is already vetoed. ``ctx.grad_norm`` receives the total ``norm_type``-norm of all
    gradients before clipping as a device tensor (no sync; read it when reporting).
    With neither ``max_norm`` nor ``max_value`` the hook only reports the norm.

    Args:
        max_norm: rescale all gradients so their total norm is at most this.
        max_value: clamp every gradient element to ``[-max_value, max_value]`` (applied
            before the norm clipping when both are set).
        norm_type: the norm's order (``2.0``; ``float("inf")`` for the max norm).

    Example:
        >>> GradientClipHook(1.0).max_norm
        1.0
    """

    model_config = ConfigDict(extra="forbid")
    priority: ClassVar[int] = 30
    _exclusive_update_key: ClassVar[str | None] = "GradientClipHook"

    max_norm: float | None = Field(default=None, gt=0)
    max_value: float | None = Field(default=None, gt=0)
    norm_type: float = Field(default=2.0, gt=0)

    def __init__(self, max_norm: float | None = None, **data: Any) -> None:
        if max_norm is not None:
            data["max_norm"] = max_norm
        super().__init__(**data)

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool = False) -> tuple[bool, Any]:
        if stage is _DO_OPTIMIZER_STEP and not will_skip:
            params = _grad_params(ctx.optimizers)
            norm = _total_norm(params, self.norm_type)
            ctx.grad_norm = norm
            if self.max_value is not None:
                torch.nn.utils.clip_grad_value_(params, self.max_value)
                if self.max_norm is not None:
                    norm = _total_norm(params, self.norm_type)
            if self.max_norm is not None:
                _clip_with_norm(params, self.max_norm, norm)
        return True, ctx.loss


# ---------------------------------------------------------------------------- spike skipping
@dataclass(slots=True)
class _SpikeState:
    loss_sum: torch.Tensor | None = None
    loss_count: int = 0
    history: torch.Tensor | None = None  # ring buffer of accepted losses
    grad_history: torch.Tensor | None = None
    ema: torch.Tensor | None = None
    grad_ema: torch.Tensor | None = None
    index: int = 0
    accepted: int = 0
    skipped: int = 0
    last_skipped: bool = False


class LossSpikeSkipHook(BaseModel, TrainingUpdateHook):
    """Skip the optimizer step when the loss spikes or the gradients blow up.

    The step of a window (one batch, or a gradient-accumulation window) is vetoed when
    its mean loss is non-finite; with ``skip_nonfinite_grads`` when the gradient norm is;
    when the norm exceeds ``max_grad_norm`` or ``grad_norm_factor`` times its running
    statistic; or, after ``warmup_steps`` accepted steps, when the loss exceeds
    ``factor`` times the running statistic of the last ``window`` accepted losses (their
    median, or an EMA with ``alpha = 2 / (window + 1)``). The loss is
    ``ctx.losses["total_loss"]`` (before loss scaling by other update hooks); the norm is
    ``ctx.grad_norm`` from a :class:`GradientClipHook` (pre-clip), else computed here.
    One device sync per optimizer step; under DDP the ranks agree
    (:func:`nvalchemi.distributed.runtime.all_agree`). Spikes do not enter the
    statistics, and a skipped window's losses leave the strategy's non-finite record
    (``nonfinite_loss="raise"`` does not raise for a NaN this hook skipped).

    Args:
        factor: spike threshold relative to the running statistic (``> 1``).
        window: number of recent accepted losses the statistic covers.
        warmup_steps: accepted steps before spike detection starts (``>= 1``).
        skip_nonfinite_grads: veto steps whose gradient norm is NaN/inf.
        statistic: ``"median"`` or ``"ema"``.
        max_grad_norm: absolute gradient-norm threshold (``None``: off).
        grad_norm_factor: gradient-norm threshold relative to its running statistic.

    Example:
        >>> hook = LossSpikeSkipHook(factor=4.0, window=50, warmup_steps=20)
        >>> hook.num_skipped
        0
    """

    model_config = ConfigDict(extra="forbid")
    priority: ClassVar[int] = 40
    _exclusive_update_key: ClassVar[str | None] = "LossSpikeSkipHook"

    factor: float = Field(default=3.0, gt=1.0)
    window: int = Field(default=50, ge=1)
    warmup_steps: int = Field(default=10, ge=1)
    skip_nonfinite_grads: bool = True
    statistic: Literal["median", "ema"] = "median"
    max_grad_norm: float | None = Field(default=None, gt=0)
    grad_norm_factor: float | None = Field(default=None, gt=1.0)

    _rt: _SpikeState = PrivateAttr(default_factory=_SpikeState)

    @property
    def _runtime(self) -> _SpikeState:
        # Direct slot access: pydantic's __getattr__ for private attributes costs ~3 us.
        return self.__pydantic_private__["_rt"]

    def __init__(self, factor: float | None = None, **data: Any) -> None:
        if factor is not None:
            data["factor"] = factor
        super().__init__(**data)

    @model_validator(mode="after")
    def _window_covers_warmup(self) -> LossSpikeSkipHook:
        if self.statistic == "median" and self.warmup_steps > self.window:
            raise ValueError(
                f"LossSpikeSkipHook: warmup_steps={self.warmup_steps} exceeds window="
                f"{self.window}; the median can cover at most `window` losses. Lower "
                "warmup_steps or raise window."
            )
        return self

    @property
    def num_skipped(self) -> int:
        """Optimizer steps this hook has vetoed."""
        return self._runtime.skipped

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent decision vetoed the step."""
        return self._runtime.last_skipped

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool = False) -> tuple[bool, Any]:
        state = self._runtime
        if stage is _DO_BACKWARD:
            loss = _supervised_loss(ctx).detach()
            if state.loss_count == 0:
                state.loss_sum = loss.to(torch.float32) if loss.dtype != torch.float64 else loss
            else:
                state.loss_sum = state.loss_sum + loss
            state.loss_count += 1
        elif stage is _BEFORE_BATCH:
            if not will_skip:  # gradients are zeroed: a new window starts
                state.loss_sum, state.loss_count = None, 0
        elif stage is _DO_OPTIMIZER_STEP and not will_skip and state.loss_count:
            return not self._decide(ctx), ctx.loss
        return True, ctx.loss

    def _decide(self, ctx: Any) -> bool:
        state = self._runtime
        window = state.loss_count
        loss = state.loss_sum / window
        state.loss_sum, state.loss_count = None, 0
        loss = loss.reshape(())
        bad = ~torch.isfinite(loss)
        need_norm = (
            self.skip_nonfinite_grads
            or self.max_grad_norm is not None
            or self.grad_norm_factor is not None
        )
        norm = None
        if need_norm:
            norm = ctx.grad_norm
            if norm is None:
                norm = _total_norm(_grad_params(ctx.optimizers), 2.0)
            norm = norm.detach().reshape(()).to(device=loss.device, dtype=loss.dtype)
            if self.skip_nonfinite_grads:
                bad = bad | ~torch.isfinite(norm)
            if self.max_grad_norm is not None:
                bad = bad | (norm > self.max_grad_norm)
        warmed = state.accepted >= self.warmup_steps
        if warmed:
            bad = bad | (loss > self.factor * self._statistic(loss, grad=False))
            if self.grad_norm_factor is not None and norm is not None:
                bad = bad | (norm > self.grad_norm_factor * self._statistic(norm, grad=True))
        manager = getattr(ctx.workflow, "distributed_manager", None)
        skip = all_agree(bad, manager)  # the one sync of this hook
        state.last_skipped = skip
        if skip:
            state.skipped += 1
            discard = getattr(ctx.workflow, "discard_recent_losses", None)
            if callable(discard):
                discard(window)
        else:
            self._record(loss, norm)
        return skip

    def _statistic(self, value: torch.Tensor, *, grad: bool) -> torch.Tensor:
        state = self._runtime
        if self.statistic == "ema":
            ema = state.grad_ema if grad else state.ema
            return ema.to(value.device)
        history = state.grad_history if grad else state.history
        return torch.nanmedian(history.to(value.device))

    def _record(self, loss: torch.Tensor, norm: torch.Tensor | None) -> None:
        state = self._runtime
        if self.statistic == "ema":
            alpha = 2.0 / (self.window + 1)
            state.ema = _ema(state.ema, loss, alpha)
            if norm is not None:
                state.grad_ema = _ema(state.grad_ema, norm, alpha)
        else:
            state.history = _ring_put(state.history, loss, state.index, self.window)
            if norm is not None:
                state.grad_history = _ring_put(state.grad_history, norm, state.index, self.window)
            state.index = (state.index + 1) % self.window
        state.accepted += 1

    def state_dict(self) -> dict[str, Any]:
        """Configuration, counters and the running statistics (CPU tensors)."""
        state = self._runtime

        def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to("cpu", copy=True)

        return {
            "window": self.window,
            "statistic": self.statistic,
            "accepted": state.accepted,
            "skipped": state.skipped,
            "index": state.index,
            "history": cpu(state.history),
            "grad_history": cpu(state.grad_history),
            "ema": cpu(state.ema),
            "grad_ema": cpu(state.grad_ema),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the statistics (``ValueError`` if ``window``/``statistic`` differ)."""
        _check_config(self, state, ("window", "statistic"))
        rt = self._runtime
        rt.accepted = int(state.get("accepted", 0))
        rt.skipped = int(state.get("skipped", 0))
        rt.index = int(state.get("index", 0)) % self.window
        for name in ("history", "grad_history", "ema", "grad_ema"):
            value = state.get(name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise ValueError(f"LossSpikeSkipHook state {name!r} must be a tensor or None.")
            setattr(rt, name, None if value is None else value.clone())
        rt.loss_sum, rt.loss_count, rt.last_skipped = None, 0, False


def _supervised_loss(ctx: Any) -> torch.Tensor:
    losses = ctx.losses
    if isinstance(losses, Mapping):
        total = losses.get("total_loss")
        if isinstance(total, torch.Tensor):
            return total
    if not isinstance(ctx.loss, torch.Tensor):
        raise TypeError(
            "LossSpikeSkipHook needs the batch loss at DO_BACKWARD (ctx.losses['total_loss'] "
            f"or ctx.loss); got {type(ctx.loss).__name__}."
        )
    return ctx.loss


def _ema(ema: torch.Tensor | None, value: torch.Tensor, alpha: float) -> torch.Tensor:
    if ema is None:
        return value.detach().clone()
    ema = ema.to(value.device)
    return ema.lerp_(value, alpha)


def _ring_put(
    buffer: torch.Tensor | None, value: torch.Tensor, index: int, size: int
) -> torch.Tensor:
    if buffer is None:
        buffer = torch.full((size,), float("nan"), dtype=value.dtype, device=value.device)
    elif buffer.device != value.device or buffer.dtype != value.dtype:
        buffer = buffer.to(device=value.device, dtype=value.dtype)
    buffer[index] = value  # device-side copy; no sync
    return buffer
