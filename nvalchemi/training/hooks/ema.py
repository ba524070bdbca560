"""``EMAHook``: an exponential moving average of a model's weights, used for validation.

After every executed optimizer step ``k`` (1-based) with ``k >= start_step`` and
``k % update_every == 0`` the shadow weights are updated as
``ema = decay * ema + (1 - decay) * weights`` (the first update copies the weights);
until then the shadow tracks the live weights, so validation, checkpoints and
``load_model_from_checkpoint(use_ema=True)`` never see untrained initial weights.
The average is a ``torch.optim.swa_utils.AveragedModel`` of the unwrapped model,
published as the strategy's inference model (``ValidationConfig(use_ema=...)``),
updated by one sync-free ``torch._foreach_lerp_``. Skipped or vetoed steps are never
averaged. :class:`EMAValidationHook` adds the other model's metrics to every
validation summary (``ema/<key>`` or ``live/<key>``).

Example:
    >>> hook = EMAHook(decay=0.99, update_every=2, start_step=10)
    >>> hook.num_updates
    0
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from nvalchemi.training.hooks.gradients import _check_config
from nvalchemi.training.hooks.update import TrainingUpdateHook
from nvalchemi.training.runtime import unwrap_model
from nvalchemi.training.stages import TrainingStage
from nvalchemi.training.validation import ValidationLoop

__all__ = ["EMAHook", "EMAValidationHook"]

_SETUP = TrainingStage.SETUP
_AFTER_OPTIMIZER_STEP = TrainingStage.AFTER_OPTIMIZER_STEP
_CONFIG_FIELDS = ("model_key", "decay", "update_every", "start_step", "use_buffers")
_FAST_MARK = "_nvalchemi_fast_ema"


@dataclass(slots=True)
class _Runtime:
    averaged: AveragedModel | None = None
    fast: bool = False
    pending: dict[str, Any] | None = None
    plan: _UpdatePlan | None = None
    synced_updates: int = -1  # num_updates last written into averaged.n_averaged


class _UpdatePlan:
    """Tensor lists of one (shadow, source) pair: ``lerp`` pairs averaged, ``copy`` pairs copied."""

    __slots__ = ("copy_dst", "copy_src", "lerp_dst", "lerp_src", "source_id")

    def __init__(self, shadow: nn.Module, source: nn.Module, use_buffers: bool) -> None:
        self.source_id = id(source)
        self.lerp_dst: list[torch.Tensor] = []
        self.lerp_src: list[torch.Tensor] = []
        self.copy_dst: list[torch.Tensor] = []
        self.copy_src: list[torch.Tensor] = []
        averaged = list(shadow.parameters())
        sources = list(source.parameters())
        if use_buffers:
            averaged += list(shadow.buffers())
            sources += list(source.buffers())
        else:
            self.copy_dst += list(shadow.buffers())
            self.copy_src += list(source.buffers())
        if len(averaged) != len(sources):
            raise RuntimeError(
                "EMAHook: the averaged model and the source model have different numbers of "
                f"tensors ({len(averaged)} vs {len(sources)}); the model's structure changed "
                "after the average was built. Reset the EMA (load_state_dict without "
                "'averaged_model_state') after changing the model."
            )
        for dst, src in zip(averaged, sources):
            if dst.is_floating_point():
                self.lerp_dst.append(dst)
                self.lerp_src.append(src)
            else:
                self.copy_dst.append(dst)
                self.copy_src.append(src)


class EMAHook(BaseModel, TrainingUpdateHook):
    """Keep an exponential moving average of ``models[model_key]`` and validate with it.

    Priority 50. :meth:`get_averaged_model` returns the ``AveragedModel``; its
    ``.module`` is what validation runs. The copy is built at ``SETUP``; when it defines
    ``modify_ema_methods()`` the hook calls it once, before pending checkpoint weights
    are loaded (for runtime-patched methods that do not survive ``deepcopy``; it must
    change only the copy). The tensors to average are collected at each ``SETUP``:
    replacing a model's parameter objects mid-run is not seen until the next one.
    :meth:`state_dict` / :meth:`load_state_dict` restore the shadow weights and the
    update count bit for bit, also before the averaged model exists.

    Args:
        model_key: which of the strategy's models to average (``"main"`` for one model).
        decay: ``0 <= decay < 1``; weight of the old average per update.
        update_every: update on optimizer steps that are multiples of this.
        start_step: first optimizer step (1-based count of executed steps) that updates.
            The modulo is global: ``start_step=5, update_every=10`` updates at 10, 20, ...
        use_buffers: also average floating buffers (else buffers are copied from the model).
        num_updates: updates done so far (restored from checkpoints).

    Example:
        >>> from nvalchemi.training import TrainingStrategy, ValidationConfig
        >>> strategy = TrainingStrategy(  # doctest: +SKIP
        ...     ..., hooks=[EMAHook(decay=0.999)],
        ...     validation_config=ValidationConfig(validation_data=val, use_ema="auto"))
    """

    model_config = ConfigDict(extra="forbid")
    priority: ClassVar[int] = 50

    model_key: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)] = "main"
    decay: float = Field(default=0.999, ge=0.0, lt=1.0)
    update_every: int = Field(default=1, gt=0)
    start_step: int = Field(default=0, ge=0)
    use_buffers: bool = True
    num_updates: int = Field(default=0, ge=0)

    _rt: _Runtime = PrivateAttr(default_factory=_Runtime)

    @property
    def _runtime(self) -> _Runtime:
        # Direct slot access: pydantic's __getattr__ for private attributes costs ~3 us.
        return self.__pydantic_private__["_rt"]

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool = False) -> tuple[bool, Any]:
        if stage is _AFTER_OPTIMIZER_STEP:
            if not will_skip:
                completed = ctx.step_count + 1  # the strategy advances step_count afterwards
                if completed >= self.start_step and completed % self.update_every == 0:
                    self._update(ctx)
                elif self.num_updates == 0:
                    self._track(ctx)
        elif stage is _SETUP:
            averaged = self._ensure_initialized(ctx)
            source = self._source(ctx)
            _align(averaged.module, source)
            self._publish(ctx, force=True)
            if self.num_updates == 0:
                self._track(ctx)
            self._runtime.plan = None  # devices may have changed: rebuild the tensor lists
        return True, ctx.loss

    def _source(self, ctx: Any) -> nn.Module:
        models = ctx.models
        if models is None or self.model_key not in models:
            available = sorted(models) if models is not None else []
            raise KeyError(
                f"EMAHook could not resolve model_key={self.model_key!r}; available keys in "
                f"TrainContext.models: {available}. Pass EMAHook(model_key=...) naming one of them."
            )
        return _unwrap(models[self.model_key])

    def _build_averaged_model(self, source: nn.Module) -> AveragedModel:
        """The averaged copy of ``source`` (override to customise; an override's model is
        updated with its own ``update_parameters``, the default by a sync-free fused path).
        """
        averaged = AveragedModel(
            source, multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=self.use_buffers
        )
        object.__setattr__(averaged, _FAST_MARK, True)
        return averaged

    def _ensure_initialized(self, ctx: Any) -> AveragedModel:
        rt = self._runtime
        if rt.averaged is not None:
            return rt.averaged
        source = self._source(ctx)
        averaged = self._build_averaged_model(source)
        repair = getattr(averaged.module, "modify_ema_methods", None)
        if callable(repair):
            # Runtime methods a model installs (e.g. fused kernels) do not survive deepcopy;
            # the model repairs its copy before any checkpointed weights are loaded into it.
            repair()
        for param in averaged.parameters():
            param.requires_grad_(False)
        _align(averaged.module, source)
        if rt.pending is not None:
            averaged.load_state_dict(rt.pending)
            rt.pending = None
            _align(averaged.module, source)
        rt.averaged = averaged
        rt.fast = bool(getattr(averaged, _FAST_MARK, False))
        rt.plan = None
        rt.synced_updates = int(averaged.n_averaged) if rt.fast else -1
        return averaged

    @torch.no_grad()
    def _update(self, ctx: Any) -> None:
        averaged = self._ensure_initialized(ctx)
        source = self._source(ctx)
        if self._runtime.fast:
            self._fused_update(averaged, source)
        else:
            averaged.update_parameters(source)
            self._runtime.synced_updates = self.num_updates + 1
        self.__dict__["num_updates"] += 1
        self._publish(ctx)

    @torch.no_grad()
    def _track(self, ctx: Any) -> None:
        """Copy the live weights into the shadow (before the first update; not an update)."""
        averaged = self._ensure_initialized(ctx)
        plan = self._plan(averaged, self._source(ctx))
        _copy(plan.lerp_dst, plan.lerp_src)
        if plan.copy_dst:
            _copy(plan.copy_dst, plan.copy_src)

    def _plan(self, averaged: AveragedModel, source: nn.Module) -> _UpdatePlan:
        rt = self._runtime
        plan = rt.plan
        if plan is None or plan.source_id != id(source):
            plan = rt.plan = _UpdatePlan(averaged.module, source, self.use_buffers)
        return plan

    def _fused_update(self, averaged: AveragedModel, source: nn.Module) -> None:
        """``AveragedModel.update_parameters`` with the EMA rule, without its syncs (``n_averaged`` lags)."""
        plan = self._plan(averaged, source)
        if self.num_updates == 0:  # the first update copies
            _copy(plan.lerp_dst, plan.lerp_src)
        elif plan.lerp_dst:
            try:
                torch._foreach_lerp_(plan.lerp_dst, plan.lerp_src, 1.0 - self.decay)
            except RuntimeError:  # tensors on different devices (e.g. slot moved)
                for dst, src in zip(plan.lerp_dst, plan.lerp_src):
                    dst.lerp_(src.to(dst.device), 1.0 - self.decay)
        if plan.copy_dst:
            _copy(plan.copy_dst, plan.copy_src)

    def _sync_count(self, averaged: AveragedModel) -> None:
        rt = self._runtime
        if rt.fast and rt.synced_updates != self.num_updates:
            averaged.n_averaged.fill_(self.num_updates)
            rt.synced_updates = self.num_updates

    def _publish(self, ctx: Any, force: bool = False) -> None:
        workflow = ctx.workflow
        setter = getattr(workflow, "set_inference_model", None)
        if not callable(setter):
            return
        module = self._runtime.averaged.module
        if not force:
            slot = getattr(workflow, "inference_model", None)
            if slot is module or (
                isinstance(slot, nn.ModuleDict)
                and self.model_key in slot
                and slot[self.model_key] is module
            ):
                return
        setter(module, model_key=self.model_key)
        self._runtime.plan = None  # publishing may move the module (new buffer tensors)

    def get_averaged_model(self) -> AveragedModel:
        """The ``AveragedModel`` (``.module`` holds the averaged weights)."""
        averaged = self._runtime.averaged
        if averaged is None:
            raise RuntimeError(
                "EMAHook has not initialized an averaged model yet. It is built at the "
                "strategy's SETUP stage (run() or train_batch()) or at the first update."
            )
        self._sync_count(averaged)
        return averaged

    def state_dict(self) -> dict[str, Any]:
        """The six fields plus ``"averaged_model_state"`` when available (references, not copies)."""
        state: dict[str, Any] = self.model_dump()
        rt = self._runtime
        if rt.averaged is not None:
            self._sync_count(rt.averaged)
            state["averaged_model_state"] = {
                k: v.detach() for k, v in rt.averaged.state_dict().items()
            }
        elif rt.pending is not None:
            state["averaged_model_state"] = dict(rt.pending)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``num_updates`` and the averaged weights (pending until the model exists).

        Raises:
            ValueError: a saved configuration field differs from this hook's.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"EMAHook.load_state_dict expects a mapping; got {type(state)}.")
        _check_config(
            self,
            state,
            _CONFIG_FIELDS,
            "to resume, use the checkpoint's settings; or start a fresh average",
        )
        if "num_updates" in state:
            value = state["num_updates"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"EMAHook state num_updates must be an int >= 0; got {value!r}.")
            self.__dict__["num_updates"] = value
        rt = self._runtime
        averaged_state = state.get("averaged_model_state")
        if averaged_state is None:
            rt.averaged, rt.pending, rt.fast, rt.plan = None, None, False, None
            return
        if rt.averaged is None:
            rt.pending = dict(averaged_state)
            return
        rt.averaged.load_state_dict(averaged_state)
        rt.synced_updates = int(rt.averaged.n_averaged) if rt.fast else -1

    def __repr_args__(self) -> Iterator[tuple[str, Any]]:
        for name in (*_CONFIG_FIELDS, "num_updates"):
            yield name, getattr(self, name)


class EMAValidationHook:
    """After each validation, run the other model (live or EMA) and add its metrics.

    Register it next to an :class:`EMAHook`. When the summary came from the EMA model
    (``model_source == "ema"``), the live model is validated too and its numbers are
    added as ``live/<key>``; when it came from the live model and an EMA model is
    published, the EMA numbers are added as ``ema/<key>``. Keys added: ``total_loss``,
    ``per_component_unweighted``, ``per_component_sample`` and every ``*_mae``/``*_rmse``
    metric. Metric schedulers and early stopping keep reading the unprefixed keys.

    Example:
        >>> hooks = [EMAHook(decay=0.999), EMAValidationHook()]  # doctest: +SKIP
    """

    frequency = 1
    stage = TrainingStage.AFTER_VALIDATION

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        summary = ctx.validation
        strategy = ctx.workflow
        if not isinstance(summary, dict) or strategy is None:
            return
        source = summary.get("model_source")
        if source == "ema":
            use_ema, prefix = "never", "live/"
        elif source == "live" and getattr(strategy, "inference_model", None) is not None:
            use_ema, prefix = "always", "ema/"
        else:
            return

        config = strategy.validation_config
        if config is None:
            return
        other = config.model_copy(update={"use_ema": use_ema})
        loop = ValidationLoop.from_training_strategy(strategy, other)
        with loop:
            extra = loop.execute()
        for key, value in extra.items():
            if key in ("total_loss", "per_component_unweighted", "per_component_sample") or (
                key.endswith(("_mae", "_rmse"))
            ):
                summary[prefix + key] = value


def _unwrap(module: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel and ``torch.compile`` wrappers."""
    while True:
        inner = unwrap_model(module)
        inner = getattr(inner, "_orig_mod", inner)
        if inner is module:
            return module
        module = inner


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    try:
        torch._foreach_copy_(dst, src)
    except RuntimeError:  # mixed devices: copy one by one
        for d, s in zip(dst, src):
            d.copy_(s)


def _align(shadow: nn.Module, source: nn.Module) -> None:
    """Move each shadow tensor to its source tensor's device (and floating dtype)."""
    pairs = zip(
        [*shadow.parameters(), *shadow.buffers()], [*source.parameters(), *source.buffers()]
    )
    for p_avg, p_src in pairs:
        dtype = p_src.dtype if p_avg.is_floating_point() and p_src.is_floating_point() else None
        if p_avg.device != p_src.device or (dtype is not None and p_avg.dtype != dtype):
            p_avg.data = p_avg.data.to(device=p_src.device, dtype=dtype or p_avg.dtype)
