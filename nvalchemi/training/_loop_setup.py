"""Setup half of the training loop: the per-run plan, optimizers, counters, contexts.

:class:`_Plan` holds everything the per-batch path of :mod:`nvalchemi.training._loop`
reads, resolved once per ``run()`` (or per ``train_batch`` session) and rebuilt when
hooks, optimizers, models or settings change. :class:`_LoopSetup` builds it and owns
the other once-per-run work: ``prepare_strategy`` hooks, device placement, ``SETUP``
hooks, optimizer (re)building, restart positioning and validation checkpoints.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from nvalchemi.hooks.context import TrainContext
from nvalchemi.training._nonfinite import _NONFINITE_MODES
from nvalchemi.training.errors import add_note
from nvalchemi.training.optimizers import (
    _is_metric_scheduler_class,
    is_metric_scheduler,
    iter_qualified_named_parameters,
    setup_optimizers,
    step_metric_schedulers,
)
from nvalchemi.training.runtime import (
    freeze_unconfigured_models,
    move_to_devices,
    rehome_optimizer_state,
    train_configured_models,
    training_world_size,
)
from nvalchemi.training.stages import TrainingStage as S

__all__: list[str] = []


class _Plan:
    """What one batch needs, resolved once per run (or per batch-session)."""

    __slots__ = (
        "after_backward",
        "after_batch",
        "after_epoch",
        "after_forward",
        "after_loss",
        "after_optimizer_step",
        "after_training",
        "after_validation",
        "assembler",
        "before_backward",
        "before_batch",
        "before_epoch",
        "before_forward",
        "before_loss",
        "before_optimizer_step",
        "before_training",
        "ctx",
        "device",
        "do_backward",
        "do_step",
        "fn",
        "hooks_version",
        "key",
        "lean",
        "loss_fn",
        "model_arg",
        "nonfinite",
        "nonfinite_capacity",
        "optimizers",
        "orchestrator",
        "publish_detached",
        "target_keys",
        "time_schedulers",
        "val_every_epochs",
        "val_every_steps",
        "world_size",
        "zero_filtered",
    )


class _LoopSetup:
    """Mixin: everything a run does once, before and around the batches."""

    # ------------------------------------------------------------------ setup
    def _begin(self, dataloader: Any) -> Any:
        """prepare_strategy hooks, device placement, SETUP hooks, optimizers; return the loader."""
        d = self.__dict__
        for hook in self._all_hooks():
            prepare = getattr(hook, "prepare_strategy", None)
            if callable(prepare):
                prepare(self)
        move_to_devices(self.models, self.devices)
        for optimizer in self._optimizers:
            rehome_optimizer_state(optimizer)
        d["_active_dataloader"] = dataloader
        setup_hooks = self.hooks_for(S.SETUP)
        orchestrator = self._orchestrator()
        if orchestrator is not None and orchestrator not in setup_hooks:
            setup_hooks = (*setup_hooks, orchestrator)
        if setup_hooks:
            ctx = self._context()
            self._refresh_ctx(ctx)
            self._sync_ctx(ctx)
            ctx.batch = None
            ctx.clear_step_outputs()
            try:
                _fire(S.SETUP, setup_hooks, ctx, 0)
            except Exception as exc:
                self._annotate(exc, S.SETUP)
                raise
        self._ensure_optimizers()
        return d["_active_dataloader"]

    def _ensure_optimizers(self) -> None:
        """Build optimizers/schedulers unless the trainable parameters are unchanged.

        Kept across ``run()``/``train_batch()`` calls (Adam moments and schedule position
        survive); rebuilt when the configs, the parameter filters or the set of trainable
        parameters change. Wrappers such as DDP share their module's parameters, so
        wrapping keeps them.
        """
        d = self.__dict__
        with self._parameter_flags():  # optimizers see the flags the run trains with
            key = self._optimizer_key()
            if key == d["_optimizer_signature"]:
                return
            allowed = d.get("_optimizer_parameter_names")
            try:
                pairs = setup_optimizers(
                    self.models, self.optimizer_configs, allowed_parameter_names=allowed
                )
            except Exception as exc:
                self._annotate(exc, "building optimizers")
                raise
            optimizers, schedulers, records = [], [], []
            for model_key, configs in self.optimizer_configs.items():
                for i, (config, (optimizer, scheduler)) in enumerate(
                    zip(configs, pairs[model_key])
                ):
                    optimizers.append(optimizer)
                    schedulers.append(scheduler)
                    label = f"optimizer_configs[{model_key!r}][{i}]"
                    records.append((optimizer, scheduler, config.scheduler_metric_adapter, label))
            d["_filtered_grad_params"] = (
                () if allowed is None else _unoptimized_trainable(self, optimizers)
            )
        # Mutate in place: contexts and hooks hold these list objects.
        self._optimizers[:] = optimizers
        self._lr_schedulers[:] = schedulers
        d["_runtime_optimizers"] = records
        d["_optimizer_signature"] = key
        d["_optimizer_version"] += 1

    def _optimizer_key(self) -> tuple[Any, ...]:
        d = self.__dict__
        parts: list[Any] = [
            id(d.get(name))
            for name in (
                "_optimizer_parameter_names",
                "_trainable_parameter_names",
                "_force_trainable_parameter_names",
            )
        ]
        for key, configs in self.optimizer_configs.items():
            model = self.models.get(key)
            params = () if model is None else model.parameters()
            parts.append(
                (key, tuple(map(id, configs)), tuple(id(p) for p in params if p.requires_grad))
            )
        return tuple(parts)

    # ------------------------------------------------------------------ parameter filters
    def set_optimizer_parameter_filter(self, names: Iterable[str] | None) -> None:
        """Let only these parameters enter optimizers (``None``: no filter).

        Names are qualified ``"<model key>.<parameter name>"`` without wrapper prefixes
        (``"main.model.projection.weight"``), so a filter set before ``DDPHook`` wraps
        a model still matches afterwards. Optimizers are rebuilt at their next use.
        Trainable parameters left out still receive gradients (unless also frozen by
        :meth:`set_trainable_parameter_filter`); those are cleared at every zeroing
        point so they never accumulate.
        """
        self.__dict__["_optimizer_parameter_names"] = _name_set(names, "optimizer")

    def set_trainable_parameter_filter(self, names: Iterable[str] | None) -> None:
        """During ``run``/``train_batch`` set ``requires_grad=False`` on every other parameter.

        Applied before ``prepare_strategy`` and ``SETUP`` hooks (so DDP registers only
        the trainable parameters) and undone when the call returns, also after an error.
        """
        self.__dict__["_trainable_parameter_names"] = _name_set(names, "trainable")

    def set_force_trainable_parameter_filter(self, names: Iterable[str] | None) -> None:
        """During ``run``/``train_batch`` set ``requires_grad=True`` on these parameters.

        Wins over the trainable filter and over a model's own frozen flags; undone when
        the call returns.
        """
        self.__dict__["_force_trainable_parameter_names"] = _name_set(names, "force-trainable")

    def _parameter_flags(self) -> Any:
        """Context applying the trainable/force filters to ``requires_grad`` (then restoring)."""
        d = self.__dict__
        trainable = d.get("_trainable_parameter_names")
        force = d.get("_force_trainable_parameter_names")
        if trainable is None and force is None:
            return contextlib.nullcontext()
        return _filtered_requires_grad(self.models, trainable, force)

    def _zero_optimizer_filtered_gradients(self, optimizers: Any = None) -> None:
        """Clear gradients of trainable parameters that no optimizer owns (zeroing seam)."""
        for param in self.__dict__.get("_filtered_grad_params", ()):
            param.grad = None

    def _mode_context(self) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(train_configured_models(self.models, self.optimizer_configs))
        stack.enter_context(freeze_unconfigured_models(self.models, self.optimizer_configs))
        return stack

    def _target_steps(self, per_epoch: int | None) -> int:
        """The run's target ``step_count`` (optimizer steps).

        ``num_epochs`` means passes over the data: a budget of ``ceil(num_epochs *
        len(loader) * epoch_step_modifier)`` batches, converted to optimizer steps with
        gradient accumulation over ``N`` batches whose windows close at each epoch end:
        ``full_epochs * ceil(len(loader) / N) + ceil(remaining_batches / N)``.
        """
        if self.num_steps is not None:
            return self.num_steps
        if per_epoch is None:
            raise ValueError(
                "num_epochs requires a sized dataloader so epochs can be converted to a target "
                "step count. Pass a loader with __len__ (a list or DataLoader), or use num_steps."
            )
        if per_epoch == 0:
            raise ValueError(
                "dataloader must contain at least one batch when num_epochs is configured."
            )
        budget = math.ceil(self.num_epochs * per_epoch * self.epoch_step_modifier)
        orchestrator = self._orchestrator()
        n = orchestrator.batches_per_step if orchestrator is not None else 1
        if n <= 1:
            return budget
        full_epochs, remaining = divmod(budget, per_epoch)
        return full_epochs * math.ceil(per_epoch / n) + math.ceil(remaining / n)

    def _check_metric_schedulers(self) -> None:
        """A metric-driven scheduler needs validation summaries, or it would never step."""
        if self.validation_config is not None:
            return
        for key, configs in self.optimizer_configs.items():
            for i, config in enumerate(configs):
                if _is_metric_scheduler_class(config.scheduler_cls):
                    name = getattr(config.scheduler_cls, "__name__", config.scheduler_cls)
                    raise ValueError(
                        f"optimizer_configs[{key!r}][{i}] uses the metric-driven scheduler "
                        f"{name}, which steps on validation summaries, but the strategy has no "
                        "validation_config, so it would never step. Add "
                        "validation_config=ValidationConfig(validation_data=..., "
                        "every_n_epochs=1) (or every_n_steps=...), or use a time-based "
                        "scheduler (e.g. StepLR, CosineAnnealingLR)."
                    )

    def _position_counters(self, per_epoch: int | None) -> None:
        """Make restart counters consistent with the loader (spec 2.5 step 9)."""
        if not per_epoch:
            return
        d = self.__dict__
        if d["epoch_step_count"] >= per_epoch:
            d["epoch_count"] += d["epoch_step_count"] // per_epoch
            d["epoch_step_count"] %= per_epoch
        completed = d["epoch_count"] * per_epoch
        raw = d["batch_count"] or d["step_count"]
        if d["epoch_step_count"] > 0:
            expected = completed + d["epoch_step_count"]
            if raw and raw != expected:
                raise ValueError(
                    f"restart counters are inconsistent: batch_count/step_count={raw} does not "
                    f"match epoch_count * len(dataloader) + epoch_step_count = {d['epoch_count']} "
                    f"* {per_epoch} + {d['epoch_step_count']} = {expected}. Resume with the "
                    "dataloader of the saved run, or fix the counters."
                )
            d["batch_count"] = max(d["batch_count"], expected)
            return
        if raw < completed:
            raise ValueError(
                f"restart counters are inconsistent: batch_count/step_count={raw} is smaller "
                f"than epoch_count * len(dataloader) = {d['epoch_count']} * {per_epoch}. Resume "
                "with the dataloader of the saved run, or fix the counters."
            )
        d["epoch_count"] += (raw - completed) // per_epoch
        d["epoch_step_count"] = (raw - completed) % per_epoch
        d["batch_count"] = max(d["batch_count"], raw)

    def _seek(self, loader: Any) -> int:
        """Position the loader at ``epoch_step_count``; return how many batches to skip."""
        position = self.__dict__["epoch_step_count"]
        if position <= 0:
            return 0
        seek = getattr(loader, "set_epoch_step", None)
        if callable(seek):
            seek(position)
            return 0
        return position

    # ------------------------------------------------------------------ plan and context
    def _current_plan(self) -> _Plan:
        d = self.__dict__
        key = (
            d["_hooks_version"],
            d["_optimizer_version"],
            tuple(map(id, self.models.values())),
            id(self.training_fn),
            id(self.loss_fn),
            id(self.loss_target_assembler),
            self.nonfinite_loss,
            self.nonfinite_check_interval,
            id(self.validation_config),
            tuple(map(id, self.devices)),
            id(d.get("_active_dataloader")),
        )
        plan = d["_plan"]
        if plan is not None and plan.key == key:
            return plan
        plan = self._make_plan()
        plan.key = key
        d["_plan"] = plan
        return plan

    def _make_plan(self) -> _Plan:
        d = self.__dict__
        p = _Plan()
        at = self.hooks_for
        p.hooks_version = d["_hooks_version"]
        p.before_training, p.before_epoch = at(S.BEFORE_TRAINING), at(S.BEFORE_EPOCH)
        p.before_batch, p.before_forward = at(S.BEFORE_BATCH), at(S.BEFORE_FORWARD)
        p.after_forward, p.before_loss = at(S.AFTER_FORWARD), at(S.BEFORE_LOSS)
        p.after_loss, p.before_backward = at(S.AFTER_LOSS), at(S.BEFORE_BACKWARD)
        p.after_backward = at(S.AFTER_BACKWARD)
        p.before_optimizer_step = at(S.BEFORE_OPTIMIZER_STEP)
        p.after_optimizer_step, p.after_batch = at(S.AFTER_OPTIMIZER_STEP), at(S.AFTER_BATCH)
        p.after_epoch, p.after_training = at(S.AFTER_EPOCH), at(S.AFTER_TRAINING)
        p.after_validation = at(S.AFTER_VALIDATION)
        do_backward, do_step = at(S.DO_BACKWARD), at(S.DO_OPTIMIZER_STEP)
        p.do_backward = do_backward[0] if do_backward else None
        p.do_step = do_step[0] if do_step else None
        p.orchestrator = self._orchestrator()
        p.publish_detached = bool(
            p.do_step
            or p.after_backward
            or p.before_optimizer_step
            or p.after_optimizer_step
            or p.after_batch
            or p.after_epoch
        )
        p.ctx = None
        if self.hooks:
            p.ctx = self._context()
            self._refresh_ctx(p.ctx)
        p.fn = self.training_fn
        p.model_arg = self.models["main"] if self.single_model_input else self.models
        p.loss_fn = self.loss_fn
        p.assembler = self.loss_target_assembler
        p.target_keys = d["_target_keys"]
        p.optimizers = self._optimizers
        p.time_schedulers = [
            s for s in self._lr_schedulers if s is not None and not is_metric_scheduler(s)
        ]
        p.nonfinite = _NONFINITE_MODES[self.nonfinite_loss]
        p.nonfinite_capacity = self.nonfinite_check_interval
        config = self.validation_config
        p.val_every_steps = (config.every_n_steps or 0) if config is not None else 0
        p.val_every_epochs = (config.every_n_epochs or 0) if config is not None else 0
        p.device = self.devices[0]
        p.world_size = training_world_size(self.distributed_manager)
        # Gradients of trainable parameters that no optimizer owns (optimizer filter
        # without freezing) are cleared where optimizers zero theirs; the orchestrator
        # calls the same method when it zeroes.
        p.zero_filtered = (
            self._zero_optimizer_filtered_gradients if d.get("_filtered_grad_params") else None
        )
        p.lean = p.ctx is None and p.orchestrator is None and not (p.do_backward or p.do_step)
        return p

    def _context(self) -> TrainContext:
        """The strategy's one ``TrainContext`` (built on first use, then updated in place)."""
        d = self.__dict__
        ctx = d["_ctx"]
        if ctx is None:
            ctx = TrainContext(batch=None, workflow=self)
            d["_ctx"] = ctx
            self._refresh_ctx(ctx)
        return ctx

    def _refresh_ctx(self, ctx: TrainContext) -> None:
        from nvalchemi.distributed.runtime import get_rank

        ctx.models = self.models
        ctx.model = self.models.get("main")
        ctx.optimizers = self._optimizers
        ctx.lr_schedulers = self._lr_schedulers
        ctx.global_rank = get_rank(self.distributed_manager)
        ctx.validation = self.last_validation
        ctx.epoch_length = self.__dict__["_epoch_length"]

    def _sync_ctx(self, ctx: TrainContext) -> None:
        d = self.__dict__
        for name in ("step_count", "global_step_count", "batch_count", "epoch_step_count"):
            setattr(ctx, name, d[name])
        ctx.epoch = d["epoch_count"]
        ctx.validation = d["last_validation"]

    def _validation_context(self) -> TrainContext:
        """A separate context for hooks around validation forwards (one per pass)."""
        ctx = TrainContext(batch=None, workflow=self)
        self._refresh_ctx(ctx)
        self._sync_ctx(ctx)
        return ctx

    # ------------------------------------------------------------------ validation helpers
    def _validation_checkpoint(self) -> None:
        try:
            self.validate()
            self._step_metric_schedulers()
        except Exception as exc:
            self._annotate(exc, "validation / metric schedulers")
            raise

    def _step_metric_schedulers(self) -> None:
        d = self.__dict__
        summary = d["last_validation"]
        records = [r for r in d["_runtime_optimizers"] if is_metric_scheduler(r[1])]
        if summary is None or not records:
            return
        # Called right after each validation only, so a summary never steps twice; unlike
        # the reference, ``last_validation`` stays readable afterwards.
        for _, scheduler, adapter, label in records:
            try:
                step_metric_schedulers([scheduler], [adapter], summary)
            except Exception as exc:
                add_note(
                    exc,
                    f"raised while stepping the {type(scheduler).__name__} of {label} "
                    f"(scheduler_metric_adapter={adapter!r}); set scheduler_metric_adapter to a "
                    "key of the validation summary or a callable(summary) -> float.",
                )
                raise


# ---------------------------------------------------------------------------- helpers
def _name_set(names: Iterable[str] | None, what: str) -> frozenset[str] | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(
            f"The {what} parameter filter takes an iterable of qualified names, not one string "
            f"({names!r}); wrap it in a list."
        )
    values = frozenset(names)
    bad = sorted(repr(n) for n in values if not isinstance(n, str))
    if bad:
        raise TypeError(f"The {what} parameter filter must contain str names; got {bad[:5]}.")
    return values


@contextlib.contextmanager
def _filtered_requires_grad(
    models: Mapping[str, Any], trainable: frozenset[str] | None, force: frozenset[str] | None
) -> Iterator[None]:
    changed: list[tuple[Any, bool]] = []
    try:
        for name, param in iter_qualified_named_parameters(models):
            wanted = param.requires_grad
            if trainable is not None and name not in trainable:
                wanted = False
            if force is not None and name in force:
                wanted = True
            if wanted != param.requires_grad:
                changed.append((param, param.requires_grad))
                param.requires_grad_(wanted)
        yield
    finally:
        for param, flag in reversed(changed):
            param.requires_grad_(flag)


def _unoptimized_trainable(strategy: Any, optimizers: list[Any]) -> tuple[Any, ...]:
    owned = {id(p) for optimizer in optimizers for g in optimizer.param_groups for p in g["params"]}
    configured = {k: m for k, m in strategy.models.items() if k in strategy.optimizer_configs}
    seen: set[int] = set()
    out = []
    for _, param in iter_qualified_named_parameters(configured):
        if param.requires_grad and id(param) not in owned and id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return tuple(out)


def _sized(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader, else the first of its samplers that has it."""
    candidates = [loader]
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates += [sampler, batch_sampler, getattr(batch_sampler, "sampler", None)]
    seen: set[int] = set()
    for candidate in candidates:
        if candidate is None or id(candidate) in seen:
            continue
        seen.add(id(candidate))
        set_epoch = getattr(candidate, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            return


def _fire(stage: S, hooks: tuple[Any, ...], ctx: Any, gate: int) -> None:
    """Run ``hooks`` at ``stage``; a hook fires when ``frequency == 1`` or ``gate % frequency == 0``."""
    for hook in hooks:
        frequency = hook.frequency
        if frequency == 1 or gate % frequency == 0:
            try:
                hook(ctx, stage)
            except Exception as exc:
                add_note(exc, f"raised by hook {type(hook).__name__} at stage {stage.name}")
                raise
