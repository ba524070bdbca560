"""The training loop behind :class:`~nvalchemi.training.TrainingStrategy` (``run``/``train_batch``).

Kept apart from the strategy's fields and validation so the hot path can be read at
once. Everything per batch goes through :meth:`_TrainingLoop._train_step`, which

* reads counters from and writes them to the instance ``__dict__`` (no pydantic
  ``__setattr__``), and everything else from a :class:`_Plan` resolved once per
  ``run()`` (hooks per stage, optimizers, the one ``TrainContext``);
* dispatches only to stages that have hooks, and builds no context without hooks;
* never synchronises with the device, except ``nonfinite_loss="skip"`` (one scalar read
  per batch) and the periodic check of the non-finite record, which runs after backward
  and before the optimizer step of the batch that makes it due, so the loss that makes
  it raise never reaches the weights.

Hook frequency (fix of the reference's pre-increment gating): a hook with
``frequency=N`` fires on the batches that contribute to optimizer step ``k`` (1-based)
when ``k % N == 0``; at ``AFTER_OPTIMIZER_STEP`` and ``AFTER_BATCH`` only if that step
was actually taken, so a vetoed or accumulating batch never re-fires it. Epoch stages
gate on the 1-based epoch number; ``SETUP``, ``BEFORE_TRAINING``, ``AFTER_TRAINING``,
``AFTER_VALIDATION``, the ``DO_*`` slots and validation forwards ignore ``frequency``.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from nvalchemi.training import loader_position
from nvalchemi.training._loop_setup import (
    _fire,
    _LoopSetup,
    _Plan,
    _set_sampler_epoch,
    _sized,
)
from nvalchemi.training._nonfinite import _RAISE, _SKIP, _NonFiniteGuard
from nvalchemi.training.errors import NonFiniteLossError, TrainingStalledError, add_note
from nvalchemi.training.losses.composition import compute_supervised_loss
from nvalchemi.training.optimizers import step_optimizers, zero_gradients
from nvalchemi.training.runtime import unwrap_model
from nvalchemi.training.stages import TrainingStage as S

__all__: list[str] = []


class _TrainingLoop(_NonFiniteGuard, _LoopSetup):
    """Mixin with ``run``, ``train_batch``, ``validate`` and the per-batch hot path."""

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Any:
        d = self.__dict__
        if d["_context_depth"] == 0:
            entered: list[Any] = []
            try:
                for hook in self.hooks:
                    enter = getattr(hook, "__enter__", None)
                    if callable(enter):
                        enter()
                        entered.append(hook)
            except BaseException as exc:
                _exit_hooks(entered, type(exc), exc, exc.__traceback__)
                raise
        d["_context_depth"] += 1
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        d = self.__dict__
        if d["_context_depth"] <= 0:
            return
        d["_context_depth"] -= 1
        if d["_context_depth"] == 0:
            d["_auto_session"] = False
            d["_batch_session_ready"] = False
            if exc_type is None and d["_nonfinite_record"].losses:
                # The final pending check: a NaN in the last steps is never silent.
                try:
                    self.check_nonfinite()
                except NonFiniteLossError as error:
                    _exit_hooks(list(self.hooks), type(error), error, error.__traceback__)
                    raise
            _exit_hooks(list(self.hooks), exc_type, exc, tb)

    def close(self) -> None:
        """End a ``train_batch`` session opened without ``with strategy:`` (exit hook contexts).

        Runs the final non-finite check first (``nonfinite_loss="raise"``), so a NaN in
        the session's last batches raises here at the latest.
        """
        if self.__dict__["_auto_session"]:
            self.__exit__(None, None, None)

    # ------------------------------------------------------------------ public entry points
    def run(self, dataloader: Any) -> None:
        """Train until ``num_steps`` optimizer steps (or ``num_epochs`` epochs) are done.

        ``dataloader`` is any re-iterable of batches (a sized one for ``num_epochs``).
        Lifecycle: ``SETUP`` → ``BEFORE_TRAINING`` → per epoch ``BEFORE_EPOCH``, the batch
        stages, ``AFTER_EPOCH`` (+ scheduled validation) → ``AFTER_TRAINING`` → a final
        validation unless one just ran at the final step. A :meth:`request_stop` ends the
        run after the current batch, or after the current gradient-accumulation window
        (``AFTER_EPOCH`` only if the epoch completed).

        Raises:
            ValueError: a metric-driven scheduler (``ReduceLROnPlateau``) without a
                ``validation_config`` (it would never step).
        """
        d = self.__dict__
        self.close()
        d["_stop_reason"] = None
        with self:
            d["_running"] = True
            try:
                with self._parameter_flags():  # fine-tuning filters, undone on exit
                    self._train_run(dataloader)
            finally:
                d["_running"] = False
                d["_batch_session_ready"] = False

    def train_batch(self, batch: Any) -> torch.Tensor:
        """Train on one batch (all per-batch stages, counters advance); return the detached loss.

        Setup (``prepare_strategy``, device placement, ``SETUP`` hooks, optimizers) runs
        once per session: the first call opens one that later calls reuse, so hooks such
        as DDP wrap the model once. Inside ``with strategy:`` the session ends with the
        block; otherwise call :meth:`close` when done. Does not fire epoch/training
        stages, check targets or validate. Under ``nonfinite_loss="raise"`` every call
        checks its loss before the optimizer step (one device sync per call) and raises
        :class:`NonFiniteLossError` for a non-finite one, leaving the weights untouched.
        """
        d = self.__dict__
        if d["_context_depth"] == 0:
            self.__enter__()
            d["_auto_session"] = True
        with self._parameter_flags():  # fine-tuning filters, undone on return
            if not d["_batch_session_ready"]:
                self._begin(None)
                d["_batch_session_ready"] = True
            else:
                self._ensure_optimizers()
            d["_epoch_length"] = None  # no epochs here: accumulation windows stay full
            plan = self._current_plan()
            if plan.ctx is not None:
                plan.ctx.epoch_length = None
            batch = _to_device(batch, plan.device)
            d["_last_batch"] = batch
            capacity = plan.nonfinite_capacity
            plan.nonfinite_capacity = 1  # strict: check this batch before its step
            try:
                with self._mode_context():
                    (self._train_step_lean if plan.lean else self._train_step)(batch, plan)
            finally:
                plan.nonfinite_capacity = capacity
        ctx = plan.ctx
        loss = ctx.loss if ctx is not None and ctx.loss is not None else d["_last_loss"]
        return loss.detach() if isinstance(loss, torch.Tensor) else loss

    def validate(self, config: Any = None) -> dict[str, Any]:
        """Run one validation pass now; return (and store in ``last_validation``) the summary.

        Checks the non-finite record first, fires ``AFTER_VALIDATION`` hooks with
        ``ctx.validation`` set. Does not step metric schedulers.
        """
        from nvalchemi.training.validation import ValidationLoop

        if config is None and self.validation_config is None:
            raise RuntimeError("TrainingStrategy.validate() requires a validation_config.")
        self.check_nonfinite()
        loop = ValidationLoop.from_training_strategy(self, config)
        with loop:
            summary = loop.execute()
        d = self.__dict__
        d["last_validation"] = summary
        d["_validated_at"] = (d["step_count"], d["batch_count"])
        hooks = self.hooks_for(S.AFTER_VALIDATION)
        if hooks:
            ctx = self._context()
            self._sync_ctx(ctx)
            ctx.validation = summary
            # The last training batch's loss, never a live graph (no sync: detach only).
            if isinstance(ctx.loss, torch.Tensor):
                ctx.loss = ctx.loss.detach()
            if isinstance(ctx.losses, Mapping):
                ctx.losses = _detached(ctx.losses)
            _fire(S.AFTER_VALIDATION, hooks, ctx, 0)
        return summary

    def request_stop(self, reason: str) -> None:
        """Ask ``run()`` to stop after the current batch (idempotent; the first reason wins).

        Inside a gradient-accumulation window the run goes on until the window's
        optimizer step (or the epoch end, which closes it), so it never ends with
        accumulated gradients that a checkpoint could not hold. The run then fires
        ``AFTER_EPOCH`` only if the epoch completed, then ``AFTER_TRAINING`` and the final
        validation; counters stay consistent.
        """
        d = self.__dict__
        if d["_stop_reason"] is None:
            d["_stop_reason"] = str(reason)

    @property
    def stop_reason(self) -> str | None:
        """Why the last (or current) run was asked to stop, or ``None``."""
        return self.__dict__["_stop_reason"]

    # ------------------------------------------------------------------ run
    def _train_run(self, dataloader: Any) -> None:
        d = self.__dict__
        self._check_metric_schedulers()
        loader = self._begin(dataloader)
        batches_per_epoch = _sized(loader)
        target = self._target_steps(batches_per_epoch)
        if d["step_count"] >= target:
            return
        self._position_counters(batches_per_epoch)
        plan = self._current_plan()
        trained = False
        with self._mode_context():
            try:
                trained = self._epoch_loop(loader, batches_per_epoch, target, plan)
            except Exception as exc:
                self._annotate(exc, "the training loop")
                raise
            finally:
                d["_epoch_length"] = None
            if not trained:
                return
            self.check_nonfinite()
            plan = self._current_plan()
            ctx = plan.ctx
            if ctx is not None:
                self._sync_ctx(ctx)
                ctx.clear_step_outputs()
            if plan.after_training:
                _fire(S.AFTER_TRAINING, plan.after_training, ctx, 0)
            if self.validation_config is not None and d["_validated_at"] != (
                d["step_count"],
                d["batch_count"],
            ):
                self._validation_checkpoint()

    def _epoch_loop(self, loader: Any, per_epoch: int | None, target: int, plan: _Plan) -> bool:
        d = self.__dict__
        started = False
        train_step = self._train_step_lean if plan.lean else self._train_step
        d["_epoch_length"] = per_epoch
        if plan.ctx is not None:
            plan.ctx.epoch_length = per_epoch
        while True:
            _set_sampler_epoch(loader, d["epoch_count"])
            skip = self._seek(loader)
            processed = 0
            iterator, finished = self._open_epoch(loader, skip)
            while not finished:
                try:
                    batch = next(iterator)
                except StopIteration:
                    finished = True
                    break
                except Exception as exc:
                    self._annotate(exc, "loading the next batch from the dataloader")
                    raise
                if d["_hooks_version"] != plan.hooks_version:
                    plan = self._current_plan()
                    train_step = self._train_step_lean if plan.lean else self._train_step
                current = getattr(batch, "device", None)
                if current is None or current != plan.device:
                    batch = _to_device(batch, plan.device)
                d["_last_batch"] = batch
                if not started:
                    started = True
                    if plan.before_training:
                        self._sync_ctx(plan.ctx)
                        plan.ctx.clear_step_outputs()
                        plan.ctx.batch = batch
                        _fire(S.BEFORE_TRAINING, plan.before_training, plan.ctx, 0)
                if d["epoch_step_count"] == 0 and plan.before_epoch:
                    self._sync_ctx(plan.ctx)
                    plan.ctx.clear_step_outputs()  # no stale loss/predictions of the last epoch
                    plan.ctx.batch = batch
                    _fire(S.BEFORE_EPOCH, plan.before_epoch, plan.ctx, d["epoch_count"] + 1)
                ran = train_step(batch, plan)
                processed += 1
                every = plan.val_every_steps
                if every and ran and d["step_count"] % every == 0:
                    self._validation_checkpoint()
                if per_epoch is not None and d["epoch_step_count"] >= per_epoch:
                    finished = True
                    break
                if d["step_count"] >= target or (
                    d["_stop_reason"] is not None and self._at_step_boundary(plan)
                ):
                    break
            if processed == 0 and d["step_count"] < target and d["_stop_reason"] is None:
                raise ValueError(
                    "dataloader produced no batches before reaching the target step count; "
                    "ensure the dataloader is non-empty, re-iterable, and compatible with the "
                    f"restored epoch_step_count ({d['epoch_step_count']})."
                )
            if finished and processed:
                self._end_epoch(plan)
            if d["step_count"] >= target or (
                d["_stop_reason"] is not None and (processed == 0 or self._at_step_boundary(plan))
            ):
                return started

    def _open_epoch(self, loader: Any, skip: int) -> tuple[Any, bool]:
        """``iter(loader)`` past ``skip`` consumed batches; return ``(iterator, exhausted)``.

        The generator states the epoch's order is drawn from are recorded first (saved in
        ``runtime_state``); the first epoch after a resume replays the saved record, so the
        interrupted epoch gets the same order (see :mod:`nvalchemi.training.loader_position`).
        CPU RNG states only: no device sync, once per epoch.
        """
        d = self.__dict__
        resume, d["_resume_loader"] = d["_resume_loader"], None
        replaying = resume is not None and resume["epoch"] == d["epoch_count"]
        if resume is not None and not replaying:
            loader_position.restore_generators(loader, resume["generators_now"])
        if replaying and (skip or d["epoch_step_count"]):
            problem = loader_position.order_problem(loader)
            if problem is not None:
                warnings.warn(
                    f"Resuming in the middle of epoch {d['epoch_count'] + 1}: the batch order of "
                    f"the dataloader ({type(loader).__name__}) may differ from the interrupted "
                    f"run's, because {problem}. The run continues from the checkpoint's weights "
                    "and counters, but not bitwise like the uninterrupted run.",
                    UserWarning,
                    stacklevel=4,
                )
        scope = loader_position.replay(loader, resume) if replaying else contextlib.nullcontext()
        try:
            with scope:
                d["_epoch_record"] = (
                    resume if replaying else loader_position.capture(loader, d["epoch_count"])
                )
                iterator = iter(loader)
                for _ in range(skip):  # materialized but not trained
                    next(iterator)
                if replaying:  # samplers may draw their order lazily, at the first batch
                    iterator = itertools.chain([next(iterator)], iterator)
        except StopIteration:
            return iterator, True
        except Exception as exc:
            self._annotate(exc, "loading the next batch from the dataloader")
            raise
        return iterator, False

    @staticmethod
    def _at_step_boundary(plan: _Plan) -> bool:
        """Whether no gradient-accumulation window is open (a requested stop waits for it)."""
        orchestrator = plan.orchestrator
        return orchestrator is None or not orchestrator.window_open

    def _end_epoch(self, plan: _Plan) -> None:
        d = self.__dict__
        d["epoch_count"] += 1
        d["epoch_step_count"] = 0
        if plan.after_epoch:
            self.check_nonfinite()
            self._sync_ctx(plan.ctx)
            _fire(S.AFTER_EPOCH, plan.after_epoch, plan.ctx, d["epoch_count"])
        every = plan.val_every_epochs
        if every and d["epoch_count"] % every == 0:
            self._validation_checkpoint()

    # ------------------------------------------------------------------ the hot path
    def _train_step_lean(self, batch: Any, p: _Plan) -> bool:
        """:meth:`_train_step` for a strategy without hooks: no context, no update hooks.

        The same work with none of the hook bookkeeping; kept in step with
        :meth:`_train_step` (the tests run both paths).
        """
        d = self.__dict__
        stage = "zeroing gradients"
        try:
            optimizers = p.optimizers
            zero_gradients(optimizers)
            if p.zero_filtered is not None:
                p.zero_filtered(optimizers)
            stage = "the forward pass (training_fn)"
            predictions = p.fn(p.model_arg, batch)
            stage = "the loss computation"
            step = d["step_count"]
            out = compute_supervised_loss(
                p.loss_fn,
                predictions,
                batch,
                step=step,
                epoch=d["epoch_count"],
                workflow=self,
                target_assembler=p.assembler,
                target_keys=p.target_keys,
            )
            loss = out["total_loss"]
            detached = loss.detach()
            d["_last_loss"] = detached  # not the graph: it would live on into the next step
            mode = p.nonfinite
            if mode == _RAISE:  # inline _record_loss
                record = d["_nonfinite_record"]
                record.losses.append(detached)
                components = out["per_component_unweighted"]
                record.meta.append(
                    (
                        step,
                        d["epoch_count"],
                        d["epoch_step_count"],
                        d["batch_count"],
                        [(k, v.detach()) for k, v in components.items()],
                    )
                )
            elif mode == _SKIP and self._skip_nonfinite(loss, p):
                return self._skip_batch(p, out)
            stage = "the backward pass"
            loss.backward()
            if mode == _RAISE and len(record.losses) >= p.nonfinite_capacity:
                # Due now: check before the step, so a non-finite loss never lands.
                stage = "the non-finite loss check before the optimizer step"
                self.check_nonfinite()
            stage = "the optimizer step"
            step_optimizers(optimizers)
            for scheduler in p.time_schedulers:
                scheduler.step()
            d["batch_count"] += 1
            d["epoch_step_count"] += 1
            d["step_count"] = step + 1
            d["global_step_count"] += p.world_size
            d["_consecutive_skips"] = 0
            return True
        except Exception as exc:
            self._annotate(exc, stage)
            raise

    def _train_step(self, batch: Any, p: _Plan) -> bool:
        """One batch: forward, loss, backward, optimizer step, counters. Returns whether it stepped."""
        d = self.__dict__
        ctx = p.ctx
        gate = d["step_count"] + 1
        stage: Any = S.BEFORE_BATCH
        try:
            if ctx is not None:
                ctx.clear_step_outputs()
                ctx.batch = batch
                ctx.step_count = d["step_count"]
                ctx.global_step_count = d["global_step_count"]
                ctx.batch_count = d["batch_count"]
                ctx.epoch_step_count = d["epoch_step_count"]
                ctx.epoch = d["epoch_count"]
            if p.before_batch:
                _fire(stage, p.before_batch, ctx, gate)
            if p.orchestrator is None:
                stage = "zeroing gradients"
                zero_gradients(p.optimizers)
                if p.zero_filtered is not None:
                    p.zero_filtered(p.optimizers)
            stage = S.BEFORE_FORWARD
            if p.before_forward:
                _fire(stage, p.before_forward, ctx, gate)
            stage = "the forward pass (training_fn)"
            predictions = p.fn(p.model_arg, batch)
            if ctx is not None:
                ctx.predictions = predictions
            stage = S.AFTER_FORWARD
            if p.after_forward:
                _fire(stage, p.after_forward, ctx, gate)
            stage = S.BEFORE_LOSS
            if p.before_loss:
                _fire(stage, p.before_loss, ctx, gate)
            stage = "the loss computation"
            out = compute_supervised_loss(
                p.loss_fn,
                predictions,
                batch,
                step=d["step_count"],
                epoch=d["epoch_count"],
                workflow=self,
                target_assembler=p.assembler,
                target_keys=p.target_keys,
            )
            loss = out["total_loss"]
            d["_last_loss"] = loss
            if ctx is not None:
                ctx.loss = loss
                ctx.losses = out
            stage = S.AFTER_LOSS
            if p.after_loss:
                _fire(stage, p.after_loss, ctx, gate)
                if ctx.loss is not None:
                    loss = ctx.loss
            mode = p.nonfinite
            if mode == _RAISE:
                self._record_loss(loss, out)
            elif mode == _SKIP and self._skip_nonfinite(loss, p):
                return self._skip_batch(p, out)
            stage = S.BEFORE_BACKWARD
            if p.before_backward:
                _fire(stage, p.before_backward, ctx, gate)
            stage = S.DO_BACKWARD
            if p.do_backward is not None:
                p.do_backward(ctx, stage)
            elif ctx is not None and ctx.loss is not None:
                ctx.loss.backward()
            else:
                loss.backward()
            if p.publish_detached:
                ctx.loss = ctx.loss.detach() if ctx.loss is not None else None
                ctx.losses = _detached(out)
            stage = S.AFTER_BACKWARD
            if p.after_backward:
                _fire(stage, p.after_backward, ctx, gate)
            stage = S.BEFORE_OPTIMIZER_STEP
            if p.before_optimizer_step:
                _fire(stage, p.before_optimizer_step, ctx, gate)
            # A due non-finite check runs before the step (the orchestrator runs it itself,
            # after its vetoes, so a window its hooks skip is never reported).
            if (
                mode == _RAISE
                and p.orchestrator is None
                and len(d["_nonfinite_record"].losses) >= p.nonfinite_capacity
            ):
                stage = "the non-finite loss check before the optimizer step"
                self.check_nonfinite()
            stage = S.DO_OPTIMIZER_STEP
            if p.do_step is not None:
                p.do_step(ctx, stage)
                ran = p.orchestrator is None or not p.orchestrator.optimizer_step_skipped
            else:
                step_optimizers(p.optimizers)
                for scheduler in p.time_schedulers:
                    scheduler.step()
                ran = True
            stage = S.AFTER_OPTIMIZER_STEP
            if p.after_optimizer_step:
                _fire(stage, p.after_optimizer_step, ctx, gate if ran else -1)
            stage = "advancing counters"
            if ran and ctx is None:  # the common case, inlined
                d["batch_count"] += 1
                d["epoch_step_count"] += 1
                d["step_count"] += 1
                d["global_step_count"] += p.world_size
                d["_consecutive_skips"] = 0
            else:
                self._advance(ran, p)
            stage = S.AFTER_BATCH
            if p.after_batch:
                _fire(stage, p.after_batch, ctx, gate if ran else -1)
            if mode == _RAISE and len(d["_nonfinite_record"].losses) >= p.nonfinite_capacity:
                # Still due: the step was vetoed or postponed, so no weights changed yet.
                stage = "the periodic non-finite loss check"
                self.check_nonfinite()
            return ran
        except Exception as exc:
            self._annotate(exc, stage)
            raise

    def _skip_batch(self, p: _Plan, out: Mapping[str, Any]) -> bool:
        ctx = p.ctx
        if ctx is not None:
            ctx.loss = ctx.loss.detach() if ctx.loss is not None else None
            ctx.losses = _detached(out)
        self._advance(False, p, skipped_nonfinite=True)
        if p.after_batch:
            _fire(S.AFTER_BATCH, p.after_batch, ctx, -1)
        return False

    def _advance(self, ran: bool, p: _Plan, skipped_nonfinite: bool = False) -> None:
        d = self.__dict__
        d["batch_count"] += 1
        d["epoch_step_count"] += 1
        if ran:
            d["step_count"] += 1
            d["global_step_count"] += p.world_size
            d["_consecutive_skips"] = 0
        elif skipped_nonfinite or p.orchestrator is None or not p.orchestrator.step_deferred:
            # A step postponed by an open accumulation window is not a skip.
            d["_consecutive_skips"] += 1
            limit = self.max_consecutive_skips
            if limit is not None and d["_consecutive_skips"] >= limit:
                self._stalled(skipped_nonfinite)
        ctx = p.ctx
        if ctx is not None:
            ctx.step_count = d["step_count"]
            ctx.global_step_count = d["global_step_count"]
            ctx.batch_count = d["batch_count"]
            ctx.epoch_step_count = d["epoch_step_count"]
            ctx.epoch = d["epoch_count"]

    def _stalled(self, nonfinite: bool) -> None:
        n = self.__dict__["_consecutive_skips"]
        why = (
            "the loss was non-finite (nonfinite_loss='skip')"
            if nonfinite
            else "update hooks vetoed the optimizer step or a GradScaler skipped it"
        )
        raise TrainingStalledError(
            f"{n} consecutive batches made no optimizer step (latest: {why}); stopping instead "
            f"of looping forever at step {self.step_count}. Check the data and learning rate, "
            "the update hooks' veto conditions, or raise max_consecutive_skips (None disables "
            "the guard; batches that only accumulate gradients are not counted)."
        )

    # ------------------------------------------------------------------ errors
    def _annotate(self, exc: BaseException, stage: Any) -> None:
        if getattr(exc, "_nvalchemi_annotated", False):
            return
        d = self.__dict__
        where = getattr(stage, "name", stage)
        add_note(
            exc,
            f"raised during training at stage {where} (step {d['step_count']}, epoch "
            f"{d['epoch_count']}, batch {d['epoch_step_count']} of the epoch, batch_count "
            f"{d['batch_count']})",
        )
        with contextlib.suppress(AttributeError, TypeError):
            exc._nvalchemi_annotated = True


# ---------------------------------------------------------------------------- helpers
def _exit_hooks(hooks: list[Any], exc_type: Any, exc: Any, tb: Any) -> None:
    first_error: BaseException | None = None
    for hook in reversed(hooks):
        try:
            exit_ = getattr(hook, "__exit__", None)
            if callable(exit_):
                exit_(exc_type, exc, tb)
            else:
                close = getattr(hook, "close", None)
                if callable(close):
                    close()
        except Exception as error:  # exit every hook; report the first failure
            first_error = first_error or error
    if first_error is not None and exc is None:
        raise first_error


def _detached(out: Mapping[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in out.items():
        if key == "per_component_sample":
            pass  # detached by the loss already, and computed only when first read
        elif isinstance(value, torch.Tensor):
            value = value.detach()
        elif isinstance(value, dict):
            value = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
        result[key] = value
    return result


def _to_device(batch: Any, device: torch.device) -> Any:
    current = getattr(batch, "device", None)
    if current is not None:
        if current != device:
            return batch.to(device, non_blocking=True)
        return batch
    if isinstance(batch, Mapping):
        return {
            k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
        }
    return batch


def unwrapped(models: Mapping[str, Any]) -> dict[str, Any]:
    """``{key: model}`` with DDP/DataParallel wrappers stripped."""
    return {k: unwrap_model(m) for k, m in models.items()}
