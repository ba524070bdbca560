"""One training run, read top to bottom: the plan, the epochs, the step.

:meth:`TrainingStrategy.run <nvalchemi.training.TrainingStrategy.run>` builds a
:class:`_Run`, calls :meth:`_Run.begin` and :meth:`_Run.train`; a ``train_batch`` session
keeps one and calls :meth:`_Run.step` per batch. The strategy holds the configuration, the
counters, the optimizers and its :class:`Progress` (what a resume needs besides the
counters); the run holds everything else: the hooks of each stage, the one
``TrainContext``, the non-finite loss record, the loader and its epoch's position, the
last loss, the stop request. A finished run stays the strategy's last run (closed, its
context released), so its loader position and stop reason can still be read.

The step (:meth:`_Run.step`) is the hot path. It reads counters from and writes them to
the strategy's ``__dict__`` (no pydantic ``__setattr__``), dispatches only to stages that
have hooks, builds no context without hooks, and never synchronises with the device
except for ``nonfinite_loss="skip"`` (one scalar read per batch) and the periodic check of
the non-finite record, which runs after backward and before the optimizer step of the
batch that makes it due, so the loss that makes it raise never reaches the weights.

Hook frequency: a hook with ``frequency=N`` fires on the batches that contribute to
optimizer step ``k`` (1-based) when ``k % N == 0``; at ``AFTER_OPTIMIZER_STEP`` and
``AFTER_BATCH`` only if that step was actually taken, so a vetoed or accumulating batch
never re-fires it. Epoch stages gate on the 1-based epoch number; ``SETUP``,
``BEFORE_TRAINING``, ``AFTER_TRAINING``, ``AFTER_VALIDATION``, the ``DO_*`` slots and
validation forwards ignore ``frequency``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nvalchemi.distributed.runtime import (
    all_agree,
    explain_collective_failure,
    get_world_size,
    is_distributed_initialized,
)
from nvalchemi.hooks import protocol
from nvalchemi.training import _memory_split as split
from nvalchemi.training import loader_position
from nvalchemi.training._compiled import CompiledModels, compiled_graph_count
from nvalchemi.training._first_batch import check_first_batch, dtype_error, loader_error
from nvalchemi.training._memory_split import DistributedVote, MemoryBudget
from nvalchemi.training.errors import NonFiniteLossError, TrainingStalledError, add_note
from nvalchemi.training.losses.composition import compute_supervised_loss, loss_target_keys
from nvalchemi.training.optimizers import (
    is_metric_scheduler,
    step_metric_schedulers,
    step_optimizers,
    zero_gradients,
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

_IGNORE, _RAISE, _SKIP = 0, 1, 2
# The stages every step names, as module constants (an enum member lookup costs a microsecond
# in the hot path; a global is free).
_BEFORE_BATCH, _DO_BACKWARD = S.BEFORE_BATCH, S.DO_BACKWARD
_AFTER_BACKWARD, _DO_OPTIMIZER_STEP = S.AFTER_BACKWARD, S.DO_OPTIMIZER_STEP
NONFINITE_MODES = {"ignore": _IGNORE, "raise": _RAISE, "skip": _SKIP}

# Where a step can run out of memory and still be trained in pieces (see split_step):
# after BEFORE_BATCH and the zeroing, up to and including the backward.
_SPLITTABLE_STAGES = frozenset(
    {
        S.BEFORE_FORWARD,
        "the forward pass (training_fn)",
        S.AFTER_FORWARD,
        S.BEFORE_LOSS,
        "the loss computation",
        S.AFTER_LOSS,
        S.BEFORE_BACKWARD,
        S.DO_BACKWARD,
    }
)
_FORWARD_STAGES = _SPLITTABLE_STAGES | {S.BEFORE_BATCH, "zeroing gradients"}
# A failed attempt recorded its loss and may have accumulated gradients from here on.
_BACKWARD_STAGES = frozenset({S.BEFORE_BACKWARD, S.DO_BACKWARD})


class _PiecesAgreed(Exception):
    """Raised inside a step when the ranks voted to train this step in pieces."""


class NonFiniteRecord:
    """Losses of the steps since the last check, kept on the device (no sync per step)."""

    __slots__ = ("losses", "meta")

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        # (step, epoch, epoch_step, batch_count, [(component, detached value)])
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
        return meta[int((~finite).nonzero()[0, 0])]


@dataclass(slots=True)
class Progress:
    """Where training stands besides the counters: what ``runtime_state`` saves with them.

    The strategy keeps one across runs; its runs update it.
    """

    consecutive_skips: int = 0  # batches in a row without an optimizer step
    validated_at: tuple[int, int] | None = None  # (step_count, batch_count) of the last one
    resume_loader: dict[str, Any] | None = None  # a restored loader position, for the next epoch


class _Run:
    """What one ``run()`` (or one ``train_batch`` session) needs, and the loop itself."""

    def __init__(self, strategy: Any, *, strict: bool = False) -> None:
        self.strategy = strategy
        self.d = strategy.__dict__  # the counters, written without pydantic's __setattr__
        self.progress: Progress = strategy._progress
        self.record = NonFiniteRecord()
        self.strict_nonfinite = strict  # train_batch: check every loss before its step
        self.open, self.running, self.stale = True, False, True
        self.loader: Any = None  # the loader this run iterates (SETUP hooks may replace it)
        self.epoch_record: dict[str, Any] | None = None  # the open epoch's generator states
        self.epoch_length: int | None = None
        self.first_batch = False
        self.last_loss: torch.Tensor | None = None
        self.stop_reason: str | None = None
        self.compiled_graphs: list[int] = []  # per epoch (compile=True)
        self.compiled: CompiledModels | None = None
        self.ctx: Any = None
        self.neighbor_builders: tuple[Any, ...] = ()  # decided at the first batch
        self.budget: MemoryBudget | None = None  # after the first out-of-memory error
        self.oom_reported = False
        self._piece_gate = 0
        self.vote: DistributedVote | None = None
        self.stage: Any = None  # where the current step is (for errors, out-of-memory retries)
        self.voted = False  # whether the current step took part in the out-of-memory vote

    # ------------------------------------------------------------------ setup
    def begin(self, loader: Any) -> None:
        """prepare_strategy hooks, device placement, ``SETUP`` hooks, optimizers, the plan."""
        s = self.strategy
        self.first_batch = loader is not None
        self.loader = loader
        for hook in s.all_hooks():
            prepare = protocol.member(hook, "prepare_strategy")
            if prepare is not None:
                prepare(s)
        move_to_devices(s.models, s.devices)
        for optimizer in s._optimizers:
            rehome_optimizer_state(optimizer)
        setup = s.hooks_for(S.SETUP)
        orchestrator = s.orchestrator()
        if orchestrator is not None and orchestrator not in setup:
            setup = (*setup, orchestrator)
        if setup:
            ctx = s.new_context()
            try:
                _fire(S.SETUP, setup, ctx, 0)
            except Exception as exc:
                self.annotate(exc, S.SETUP)
                raise
        s.ensure_optimizers()
        if s.compile:
            self.compiled = CompiledModels(s.trainable_models(), s.compile_kwargs)
        self._resolve()
        if self.world_size > 1 and _distributed(s) and torch.distributed.is_initialized():
            # a collective on every rank; a manager without a torch process group has no vote
            self.vote = DistributedVote(s.distributed_manager)

    def close(self) -> None:
        """End the run; keep what the strategy reads of its last run, release the rest."""
        self.open = False
        self.ctx = self.compiled = self.model_arg = self.budget = self.vote = None

    def _resolve(self) -> None:
        """Resolve the hooks of each stage and everything else a step reads, once."""
        s = self.strategy
        at = s.hooks_for
        self.stale = False
        self.before_training, self.before_epoch = at(S.BEFORE_TRAINING), at(S.BEFORE_EPOCH)
        self.before_batch, self.before_forward = at(S.BEFORE_BATCH), at(S.BEFORE_FORWARD)
        self.after_forward, self.before_loss = at(S.AFTER_FORWARD), at(S.BEFORE_LOSS)
        self.after_loss, self.before_backward = at(S.AFTER_LOSS), at(S.BEFORE_BACKWARD)
        self.after_backward = at(S.AFTER_BACKWARD)
        self.before_optimizer_step = at(S.BEFORE_OPTIMIZER_STEP)
        self.after_optimizer_step, self.after_batch = at(S.AFTER_OPTIMIZER_STEP), at(S.AFTER_BATCH)
        self.after_epoch, self.after_training = at(S.AFTER_EPOCH), at(S.AFTER_TRAINING)
        do_backward, do_step = at(S.DO_BACKWARD), at(S.DO_OPTIMIZER_STEP)
        self.do_backward = do_backward[0] if do_backward else None
        self.do_step = do_step[0] if do_step else None
        self.orchestrator = s.orchestrator()
        # Hooks after backward see detached losses: a live graph would outlive the step.
        self.publish_detached = bool(
            self.do_step
            or self.after_backward
            or self.before_optimizer_step
            or self.after_optimizer_step
            or self.after_batch
            or self.after_epoch
        )
        if self.neighbor_builders:  # before the user's hooks: they see the lists
            self.before_forward = (*self.neighbor_builders, *self.before_forward)
        self.ctx = s.new_context() if (s.hooks or self.neighbor_builders) else None
        if self.ctx is not None:
            self.ctx.epoch_length = self.epoch_length
        self.fn = s.training_fn
        models = s.models
        if self.compiled is not None:
            models = self.compiled.models(models, s.optimizer_configs)
        self.model_arg = models["main"] if s.single_model_input else models
        self.loss_fn, self.assembler = s.loss_fn, s.loss_target_assembler
        self.target_keys = loss_target_keys(s.loss_fn)
        self.optimizers = s._optimizers
        self.time_schedulers = [
            x for x in s._lr_schedulers if x is not None and not is_metric_scheduler(x)
        ]
        self.nonfinite = NONFINITE_MODES[s.nonfinite_loss]
        self._capacity = 1 if self.strict_nonfinite else s.nonfinite_check_interval
        config = s.validation_config
        self.val_every_steps = (config.every_n_steps or 0) if config is not None else 0
        self.val_every_epochs = (config.every_n_epochs or 0) if config is not None else 0
        self.device = s.devices[0]
        self.world_size = training_world_size(s.distributed_manager)
        self.clear_unowned = s.clear_unowned_gradients if s._unowned_params else None

    def refresh(self) -> None:
        """Re-resolve after hooks or optimizers changed (the strategy marks the run stale)."""
        if self.stale:
            self._resolve()

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        """Train until the target step count; then ``AFTER_TRAINING`` and a final validation."""
        s, d = self.strategy, self.d
        loader = self.loader
        per_epoch = _sized(loader)
        target = self._target_steps(per_epoch)
        if d["step_count"] >= target:
            return
        self._position_counters(per_epoch)
        with self._modes():
            try:
                trained = self._epochs(loader, per_epoch, target)
            except Exception as exc:
                self.annotate(exc, "the training loop")
                raise
            finally:
                self.set_epoch_length(None)
            if not trained:
                return
            self.check_nonfinite()
            self.refresh()
            ctx = self.synced_ctx()
            if ctx is not None:
                ctx.clear_step_outputs()
            if self.after_training:
                _fire(S.AFTER_TRAINING, self.after_training, ctx, 0)
            if s.validation_config is not None and self.progress.validated_at != (
                d["step_count"],
                d["batch_count"],
            ):
                self.validate()

    def _epochs(self, loader: Any, per_epoch: int | None, target: int) -> bool:
        d = self.d
        started = False
        self.set_epoch_length(per_epoch)
        while True:
            _set_sampler_epoch(loader, d["epoch_count"])
            if self.compiled is not None:
                self._graphs_mark = compiled_graph_count()
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
                    self.annotate(exc, "loading the next batch from the dataloader")
                    clearer = loader_error(exc, loader)
                    if clearer is not None:
                        raise clearer from exc
                    raise
                self.refresh()
                batch = self.to_device(batch)
                if self.first_batch:
                    self.first_batch = False
                    self.check_first_batch(loader, batch)
                if not started:
                    started = True
                    if self.before_training:
                        self._fire_around(S.BEFORE_TRAINING, self.before_training, batch, 0)
                if d["epoch_step_count"] == 0 and self.before_epoch:
                    self._fire_around(
                        S.BEFORE_EPOCH, self.before_epoch, batch, d["epoch_count"] + 1
                    )
                ran = self.step(batch)
                processed += 1
                if self.val_every_steps and ran and d["step_count"] % self.val_every_steps == 0:
                    self.validate()
                if per_epoch is not None and d["epoch_step_count"] >= per_epoch:
                    finished = True
                    break
                if d["step_count"] >= target or (
                    self.stop_reason is not None and self._at_step_boundary()
                ):
                    break
            if processed == 0 and d["step_count"] < target and self.stop_reason is None:
                raise ValueError(
                    "dataloader produced no batches before reaching the target step count; "
                    "ensure the dataloader is non-empty, re-iterable, and compatible with the "
                    f"restored epoch_step_count ({d['epoch_step_count']})."
                )
            if finished and processed:
                self._end_epoch()
            if d["step_count"] >= target or (
                self.stop_reason is not None and (processed == 0 or self._at_step_boundary())
            ):
                return started

    def _open_epoch(self, loader: Any, skip: int) -> tuple[Any, bool]:
        """``iter(loader)`` past ``skip`` consumed batches; return ``(iterator, exhausted)``.

        The generator states the epoch's order is drawn from are recorded first (saved in
        ``runtime_state``); the first epoch after a resume replays the saved record, so
        the interrupted epoch gets the same order (see
        :mod:`nvalchemi.training.loader_position`). CPU RNG states only: no device sync.
        """
        d, progress = self.d, self.progress
        resume, progress.resume_loader = progress.resume_loader, None
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
                    stacklevel=5,
                )
        scope = loader_position.replay(loader, resume) if replaying else contextlib.nullcontext()
        try:
            with scope:
                self.epoch_record = (
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
            self.annotate(exc, "loading the next batch from the dataloader")
            clearer = loader_error(exc, loader)
            if clearer is not None:
                raise clearer from exc
            raise
        return iterator, False

    def _end_epoch(self) -> None:
        d = self.d
        d["epoch_count"] += 1
        d["epoch_step_count"] = 0
        if self.compiled is not None:
            self.compiled_graphs.append(
                self.compiled.report_epoch(d["epoch_count"], self._graphs_mark)
            )
        if self.after_epoch:
            self.check_nonfinite()
            _fire(S.AFTER_EPOCH, self.after_epoch, self.synced_ctx(), d["epoch_count"])
        if self.val_every_epochs and d["epoch_count"] % self.val_every_epochs == 0:
            self.validate()

    def _at_step_boundary(self) -> bool:
        """Whether no gradient-accumulation window is open (a requested stop waits for it)."""
        return self.orchestrator is None or not self.orchestrator.window_open

    # ------------------------------------------------------------------ one step
    def step(self, batch: Any) -> bool:
        """One batch: forward, loss, backward, optimizer step, counters. Returns whether it stepped.

        A batch that runs out of memory (or, after that, exceeds the learned budget) is
        trained in pieces by :meth:`split_step` with the same update.
        """
        d, ctx = self.d, self.ctx
        gate = d["step_count"] + 1
        if self.budget is not None and not self.budget.fits(batch):
            return self.split_step(batch, gate, begun=False)
        self.stage, self.voted = _BEFORE_BATCH, False
        try:
            if ctx is not None:
                ctx.clear_step_outputs()
                ctx.batch = batch
                self._sync(ctx)
            if self.before_batch:
                _fire(_BEFORE_BATCH, self.before_batch, ctx, gate)
            if self.orchestrator is None:
                self.stage = "zeroing gradients"
                zero_gradients(self.optimizers)
                if self.clear_unowned is not None:
                    self.clear_unowned()
            if self.before_forward:
                self.stage = S.BEFORE_FORWARD
                _fire(S.BEFORE_FORWARD, self.before_forward, ctx, gate)
            self.stage = "the forward pass (training_fn)"
            predictions = self.fn(self.model_arg, batch)
            if ctx is not None:
                ctx.predictions = predictions
            if self.after_forward:
                self.stage = S.AFTER_FORWARD
                _fire(S.AFTER_FORWARD, self.after_forward, ctx, gate)
            if self.before_loss:
                self.stage = S.BEFORE_LOSS
                _fire(S.BEFORE_LOSS, self.before_loss, ctx, gate)
            self.stage = "the loss computation"
            out = self.compute_loss(predictions, batch)
            backpropagated = self.through_backward(out, gate, vote=self.vote is not None)
        except torch.OutOfMemoryError as exc:
            ran_out_at = self._splittable(exc, self.stage, batch, self.voted)
        except _PiecesAgreed:
            ran_out_at = None
        except Exception as exc:
            self.annotate(exc, self.stage)
            self._explain_compile(exc)
            self._explain_dtype(exc, batch)
            raise
        else:
            if backpropagated is None:  # a skipped non-finite batch
                return False
            return self.finish(out, *backpropagated, gate)
        predictions = out = backpropagated = None  # free this attempt's graph first
        return self.split_step(batch, gate, ran_out_at=ran_out_at, voted=self.voted)

    def through_backward(
        self, out: Mapping[str, Any], gate: int, *, vote: bool
    ) -> tuple[torch.Tensor, int] | None:
        """From a step's loss output to its gradients; ``(loss, mode)``, or ``None`` if skipped.

        ``AFTER_LOSS`` (its hooks may replace ``ctx.loss``), the out-of-memory vote of a
        distributed step (``vote``), the non-finite record (``nonfinite_loss="skip"`` may
        skip the batch here), ``BEFORE_BACKWARD`` and ``DO_BACKWARD``; ``self.stage`` says
        where it is.
        """
        ctx = self.ctx
        loss = out["total_loss"]
        if ctx is not None:
            ctx.loss, ctx.losses = loss, out
            if self.after_loss:
                self.stage = S.AFTER_LOSS
                _fire(S.AFTER_LOSS, self.after_loss, ctx, gate)
                if ctx.loss is not None:
                    loss = ctx.loss
        if vote:  # DDP: did a rank run out in its forward? (one all-reduce)
            self.stage, self.voted = "the out-of-memory vote", True
            if self.vote(False):
                raise _PiecesAgreed
        mode = self.record_loss(loss, out)
        if mode == _SKIP and self._skip_nonfinite(loss):
            self._skip_batch(out)
            return None
        if self.before_backward:
            self.stage = S.BEFORE_BACKWARD
            _fire(S.BEFORE_BACKWARD, self.before_backward, ctx, gate)
        self.stage = _DO_BACKWARD
        self.backward(loss)
        return loss, mode

    def compute_loss(self, predictions: Any, batch: Any) -> Any:
        """The loss output of ``predictions`` against ``batch`` at the current counters."""
        d = self.d
        return compute_supervised_loss(
            self.loss_fn,
            predictions,
            batch,
            step=d["step_count"],
            epoch=d["epoch_count"],
            workflow=self.strategy,
            target_assembler=self.assembler,
            target_keys=self.target_keys,
        )

    def record_loss(self, loss: torch.Tensor, out: Mapping[str, Any]) -> int:
        """Publish the detached loss and record it for the non-finite check; return the mode."""
        d = self.d
        self.last_loss = detached_loss = loss.detach()  # the graph would outlive the step
        mode = self.nonfinite
        if mode == _RAISE:  # detached aliases only: no kernel, no sync
            self.record.losses.append(detached_loss)
            detached_components = []
            for name, value in out["per_component_unweighted"].items():
                # a single term of weight 1 is the total itself: one alias serves both
                detached = detached_loss if value is loss else value.detach()
                detached_components.append((name, detached))
            self.record.meta.append(
                (
                    d["step_count"],
                    d["epoch_count"],
                    d["epoch_step_count"],
                    d["batch_count"],
                    detached_components,
                )
            )
        return mode

    def backward(self, loss: torch.Tensor) -> None:
        """``DO_BACKWARD``: the claiming hook (update orchestrator), else ``loss.backward()``."""
        ctx = self.ctx
        if self.do_backward is not None:
            self.do_backward(ctx, S.DO_BACKWARD)
        elif ctx is not None and ctx.loss is not None:
            ctx.loss.backward()  # a BEFORE_BACKWARD hook may have replaced it
        else:
            loss.backward()

    def finish(self, out: Mapping[str, Any], loss: torch.Tensor, mode: int, gate: int) -> bool:
        """From ``AFTER_BACKWARD`` to ``AFTER_BATCH``: the optimizer step and the counters."""
        d, ctx = self.d, self.ctx
        stage: Any = _AFTER_BACKWARD
        try:
            if ctx is not None and self.publish_detached:
                ctx.loss = ctx.loss.detach() if ctx.loss is not None else None
                ctx.losses = _detached(out)
            if self.after_backward:
                _fire(stage, self.after_backward, ctx, gate)
            if self.before_optimizer_step:
                stage = S.BEFORE_OPTIMIZER_STEP
                _fire(stage, self.before_optimizer_step, ctx, gate)
            # A due non-finite check runs before the step (the orchestrator runs it itself,
            # after its vetoes, so a window its hooks skip is never reported).
            if (
                mode == _RAISE
                and self.orchestrator is None
                and len(self.record.losses) >= self._capacity
            ):
                stage = "the non-finite loss check before the optimizer step"
                self.check_nonfinite()
            stage = _DO_OPTIMIZER_STEP
            if self.do_step is not None:
                self.do_step(ctx, stage)
                ran = self.orchestrator is None or not self.orchestrator.optimizer_step_skipped
            else:
                step_optimizers(self.optimizers)
                for scheduler in self.time_schedulers:
                    scheduler.step()
                ran = True
            if self.after_optimizer_step:
                stage = S.AFTER_OPTIMIZER_STEP
                _fire(stage, self.after_optimizer_step, ctx, gate if ran else -1)
            stage = "advancing counters"
            if ran:  # the common case, inlined
                d["batch_count"] += 1
                d["epoch_step_count"] += 1
                d["step_count"] += 1
                d["global_step_count"] += self.world_size
                self.progress.consecutive_skips = 0
            else:
                self._not_stepped(skipped_nonfinite=False)
            if self.after_batch:
                stage = S.AFTER_BATCH
                self._sync(ctx)
                _fire(stage, self.after_batch, ctx, gate if ran else -1)
            if not ran and mode == _RAISE and len(self.record.losses) >= self._capacity:
                # Still due: the step was vetoed or postponed, so no weights changed yet.
                stage = "the periodic non-finite loss check"
                self.check_nonfinite()
            return ran
        except Exception as exc:
            self.annotate(exc, stage)
            if isinstance(exc, torch.OutOfMemoryError):
                _not_split(
                    exc, "the gradients were already complete; cutting the batch would not help"
                )
            raise

    # ------------------------------------------------------------------ out of memory
    def _splittable(self, exc: torch.OutOfMemoryError, stage: Any, batch: Any, voted: bool) -> Any:
        """The stage a step ran out of memory at, if the batch can be trained in pieces;
        else annotate and re-raise ``exc`` (see :mod:`nvalchemi.training._memory_split`)."""
        from nvalchemi.data import Batch  # light

        reason = None
        if not isinstance(batch, Batch):
            reason = f"the batch is a {type(batch).__name__}, not a Batch that can be cut"
        elif stage not in _SPLITTABLE_STAGES:
            reason = (
                "the gradients were already complete; cutting the batch would not help"
                if stage not in _FORWARD_STAGES
                else "it ran out inside a BEFORE_BATCH hook or while zeroing gradients"
            )
        elif voted:  # under DDP, in the backward: the other ranks' all-reduce is under way
            reason = (
                "under DDP a rank that runs out in its backward cannot be matched: the "
                "other ranks' gradient all-reduce is already under way"
            )
        if reason is None:
            return stage
        self.annotate(exc, stage)
        _not_split(exc, reason)
        raise exc

    def split_step(
        self,
        batch: Any,
        gate: int,
        *,
        ran_out_at: Any = None,
        voted: bool = False,
        begun: bool = True,
    ) -> bool:
        """Train ``batch`` in pieces, with the update (and the hooks' view) of one step.

        ``ran_out_at``: the stage where the whole batch ran out (``None``: it exceeds the
        learned budget, or another rank ran out). ``begun``: ``BEFORE_BATCH`` already
        fired. The stages up to the one that ran out saw the failed attempt; the retry
        fires ``BEFORE_FORWARD``, ``AFTER_FORWARD`` and ``BEFORE_LOSS`` for every piece
        (``ctx.batch`` and ``ctx.predictions`` are the piece's), and ``AFTER_LOSS`` and
        every later stage once, for the whole batch: ``ctx.predictions`` holds the pieces'
        predictions concatenated, ``ctx.loss`` a leaf holding the whole batch's loss
        (the pieces' gradients are added scaled by its gradient, so hooks that scale or
        extend the loss act as in one step), ``ctx.losses`` the whole batch's parts.
        """
        ctx = self.ctx
        self.stage = "training the batch in pieces"
        try:
            if not begun:
                if ctx is not None:
                    ctx.clear_step_outputs()
                    ctx.batch = batch
                    self._sync(ctx)
                if self.before_batch:
                    self.stage = S.BEFORE_BATCH
                    _fire(S.BEFORE_BATCH, self.before_batch, ctx, gate)
            if self.vote is not None and not voted:
                self.stage = "the out-of-memory vote"
                self.vote(True)
            self.stage = "training the batch in pieces"
            if ctx is not None:
                ctx.clear_step_outputs()  # the failed attempt's graph
            if ran_out_at is not None:
                split.release_memory(batch)
            self._clear_attempt(ran_out_at, begun)
            if self.budget is None:
                self.budget = split.MemoryBudget()
            params = self.trained_parameters()
            shares = split.LossShares(self.loss_fn, batch)
            scale = self._loss_scale()
            self._piece_gate = gate
            with self._without_gradient_sync():
                pieces = split.train_in_pieces(
                    batch,
                    self._run_piece,
                    params,
                    shares,
                    self.budget,
                    ran_out=ran_out_at is not None,
                    scale=scale,
                    where=f" on {self.device}",
                )
            if self.vote is not None:
                split.average_gradients(pieces.grads, params, self.vote.gradient_group)
            self._report_split(batch, ran_out_at, pieces)
            proxy = pieces.total.detach().clone().requires_grad_(True)
            out = pieces.out
            out["total_loss"] = proxy
            if ctx is not None:
                ctx.batch, ctx.predictions = batch, pieces.predictions
            backpropagated = self.through_backward(out, gate, vote=False)
            if backpropagated is None:  # a skipped non-finite batch
                return False
            if proxy.grad is not None:  # d(what was backpropagated) / d(loss)
                split.add_gradients(params, pieces.grads, proxy.grad / scale)
        except Exception as exc:
            self.annotate(exc, self.stage)
            self._explain_compile(exc)
            raise
        return self.finish(out, *backpropagated, gate)

    def _run_piece(self, piece: Any) -> tuple[Any, Any]:
        """Forward and loss of one piece, with its per-forward stages."""
        ctx, gate = self.ctx, self._piece_gate
        try:
            if ctx is not None:
                ctx.batch, ctx.predictions, ctx.loss, ctx.losses = piece, None, None, None
                if self.before_forward:
                    _fire(S.BEFORE_FORWARD, self.before_forward, ctx, gate)
            predictions = self.fn(self.model_arg, piece)
            if ctx is not None:
                ctx.predictions = predictions
                if self.after_forward:
                    _fire(S.AFTER_FORWARD, self.after_forward, ctx, gate)
                if self.before_loss:
                    _fire(S.BEFORE_LOSS, self.before_loss, ctx, gate)
            out = self.compute_loss(predictions, piece)
            return predictions, out
        finally:
            if ctx is not None:
                ctx.predictions = None  # the piece's graph goes with its gradients

    def _clear_attempt(self, ran_out_at: Any, begun: bool) -> None:
        """Zero what a failed backward may have accumulated (and, when ``BEFORE_BATCH`` did
        not run, the previous step's gradients)."""
        if ran_out_at in _BACKWARD_STAGES and self.nonfinite == _RAISE:
            self.record.forget_last(1)  # the failed attempt's loss; the retry records its own
        orchestrator = self.orchestrator
        if orchestrator is None:
            if not begun or ran_out_at in _BACKWARD_STAGES:
                zero_gradients(self.optimizers)
                if self.clear_unowned is not None:
                    self.clear_unowned()
            return
        if ran_out_at not in _BACKWARD_STAGES:
            return
        if orchestrator.window_open:
            warnings.warn(
                "A batch ran out of memory in its backward inside a gradient-accumulation "
                "window: the gradients accumulated from the window's earlier batches were "
                "partly overwritten and are dropped, so this optimizer step uses this batch "
                "and the window's later ones only.",
                UserWarning,
                stacklevel=4,
            )
        zero_gradients(self.optimizers)
        if self.clear_unowned is not None:
            self.clear_unowned()

    def trained_parameters(self) -> list[torch.Tensor]:
        """Every parameter that receives gradients in a step (each once, in model order)."""
        seen: set[int] = set()
        out = []
        for model in self.strategy.models.values():
            for param in model.parameters():
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    out.append(param)
        return out

    def _loss_scale(self) -> float:
        """The fp16 loss scale (pieces backpropagate a loss scaled like the step's), else 1."""
        scaler = getattr(self.ctx, "grad_scaler", None) if self.ctx is not None else None
        if scaler is None or not scaler.is_enabled():
            return 1.0
        return float(scaler.get_scale())

    def _without_gradient_sync(self) -> contextlib.ExitStack:
        """DDP's ``no_sync`` on every wrapped model (the pieces' gradients are averaged once)."""
        stack = contextlib.ExitStack()
        for model in self.strategy.models.values():
            if isinstance(model, nn.parallel.DistributedDataParallel):
                stack.enter_context(model.no_sync())
        return stack

    def _report_split(self, batch: Any, ran_out_at: Any, pieces: Any) -> None:
        """Say once per run that a batch was trained in pieces, and the budget from now on."""
        if self.oom_reported:
            return
        self.oom_reported = True
        budget = self.budget
        if ran_out_at is None and not pieces.ran_out:
            what = "another rank ran out of memory"
        else:
            where = getattr(ran_out_at, "name", ran_out_at) or "a piece"
            what = f"it ran out of memory ({where}) on {self.device}"
        limit = f"{budget.max_atoms} atoms" if budget.max_atoms is not None else "no limit"
        if budget.max_edges is not None:
            limit += f" or {budget.max_edges} edges"
        warnings.warn(
            f"Step {self.d['step_count'] + 1}: {what} with a batch of {batch.num_nodes} atoms "
            f"in {batch.num_graphs} structures; trained it in {len(pieces.pieces)} pieces "
            f"with the update of the whole batch. From now on batches above {limit} are cut "
            "before their forward (the loader is unchanged).",
            UserWarning,
            stacklevel=4,
        )

    def _explain_compile(self, exc: BaseException) -> None:
        compiled = self.compiled
        if compiled is not None:
            clearer = compiled.explain(exc)
            if clearer is not None:
                raise clearer from exc

    def _explain_dtype(self, exc: BaseException, batch: Any) -> None:
        if self.stage in ("the forward pass (training_fn)", "the loss computation"):
            clearer = dtype_error(exc, batch, self.strategy.models, self.stage)
            if clearer is not None:
                self.annotate(clearer, self.stage)
                raise clearer from exc

    def _skip_batch(self, out: Mapping[str, Any]) -> bool:
        ctx = self.ctx
        if ctx is not None:
            ctx.loss = ctx.loss.detach() if ctx.loss is not None else None
            ctx.losses = _detached(out)
        self._not_stepped(skipped_nonfinite=True)
        if self.after_batch:
            self._sync(ctx)
            _fire(S.AFTER_BATCH, self.after_batch, ctx, -1)
        return False

    def _not_stepped(self, skipped_nonfinite: bool) -> None:
        d, progress = self.d, self.progress
        d["batch_count"] += 1
        d["epoch_step_count"] += 1
        orchestrator = self.orchestrator
        if skipped_nonfinite or orchestrator is None or not orchestrator.step_deferred:
            # A step postponed by an open accumulation window is not a skip.
            progress.consecutive_skips += 1
            limit = self.strategy.max_consecutive_skips
            if limit is not None and progress.consecutive_skips >= limit:
                why = (
                    "the loss was non-finite (nonfinite_loss='skip')"
                    if skipped_nonfinite
                    else "update hooks vetoed the optimizer step or a GradScaler skipped it"
                )
                raise TrainingStalledError(
                    f"{progress.consecutive_skips} consecutive batches made no optimizer step "
                    f"(latest: {why}); stopping instead of looping forever at step "
                    f"{d['step_count']}. Check the data and learning rate, the update hooks' "
                    "veto conditions, or raise max_consecutive_skips (None disables the "
                    "guard; batches that only accumulate gradients are not counted)."
                )

    # ------------------------------------------------------------------ non-finite losses
    def check_due(self) -> bool:
        """Whether the record holds enough losses for the periodic check."""
        return len(self.record.losses) >= self._capacity

    def check_nonfinite(self) -> None:
        """Raise :class:`NonFiniteLossError` for a NaN/inf loss since the last check."""
        check_nonfinite(self.strategy, self.record)

    def _skip_nonfinite(self, loss: torch.Tensor) -> bool:
        """Whether to skip this batch: one sync, agreed across ranks (DDP must skip together)."""
        bad = not math.isfinite(float(loss.detach()))
        if self.world_size > 1 and _distributed(self.strategy):
            bad = all_agree(bad, self.strategy.distributed_manager)
        return bad

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """A scheduled validation, then the metric-driven schedulers step on its summary."""
        s, d = self.strategy, self.d
        configs = [
            (f"optimizer_configs[{key!r}][{i}]", config.scheduler_metric_adapter)
            for key, configs in s.optimizer_configs.items()
            for i, config in enumerate(configs)
        ]
        try:
            s.validate()
            summary = d["last_validation"]
            for (label, adapter), scheduler in zip(configs, s._lr_schedulers):
                if summary is None or not is_metric_scheduler(scheduler):
                    continue
                try:
                    step_metric_schedulers([scheduler], [adapter], summary)
                except Exception as exc:
                    add_note(
                        exc,
                        f"raised while stepping the {type(scheduler).__name__} of {label} "
                        f"(scheduler_metric_adapter={adapter!r}); set scheduler_metric_adapter "
                        "to a key of the validation summary or a callable(summary) -> float.",
                    )
                    raise
        except Exception as exc:
            self.annotate(exc, "validation / metric schedulers")
            raise

    # ------------------------------------------------------------------ positions
    def _target_steps(self, per_epoch: int | None) -> int:
        """The run's target ``step_count``: ``num_steps``, or ``num_epochs`` passes as steps.

        ``num_epochs`` means passes over the data: a budget of ``ceil(num_epochs *
        len(loader) * epoch_step_modifier)`` batches, converted to optimizer steps with
        gradient accumulation over ``N`` batches whose windows close at each epoch end:
        ``full_epochs * ceil(len(loader) / N) + ceil(remaining_batches / N)``.
        """
        s = self.strategy
        if s.num_steps is not None:
            return s.num_steps
        if per_epoch is None:
            raise ValueError(
                "num_epochs requires a sized dataloader so epochs can be converted to a target "
                "step count. Pass a loader with __len__ (a list or DataLoader), or use num_steps."
            )
        if per_epoch == 0:
            raise ValueError(
                "dataloader must contain at least one batch when num_epochs is configured."
            )
        budget = math.ceil(s.num_epochs * per_epoch * s.epoch_step_modifier)
        n = self.orchestrator.batches_per_step if self.orchestrator is not None else 1
        if n <= 1:
            return budget
        full_epochs, remaining = divmod(budget, per_epoch)
        return full_epochs * math.ceil(per_epoch / n) + math.ceil(remaining / n)

    def _position_counters(self, per_epoch: int | None) -> None:
        """Make restart counters consistent with the loader."""
        if not per_epoch:
            return
        d = self.d
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
        position = self.d["epoch_step_count"]
        if position <= 0:
            return 0
        seek = getattr(loader, "set_epoch_step", None)
        if callable(seek):
            seek(position)
            return 0
        return position

    # ------------------------------------------------------------------ context and helpers
    def set_epoch_length(self, length: int | None) -> None:
        self.epoch_length = length
        if self.ctx is not None:
            self.ctx.epoch_length = length

    def _sync(self, ctx: Any) -> None:
        d = self.d
        ctx.step_count, ctx.global_step_count = d["step_count"], d["global_step_count"]
        ctx.batch_count, ctx.epoch_step_count = d["batch_count"], d["epoch_step_count"]
        ctx.epoch = d["epoch_count"]

    def synced_ctx(self) -> Any:
        ctx = self.ctx
        if ctx is not None:
            self._sync(ctx)
            ctx.validation = self.d["last_validation"]
        return ctx

    def _fire_around(self, stage: S, hooks: tuple[Any, ...], batch: Any, gate: int) -> None:
        """Fire a stage outside the step (no stale loss or predictions of a previous batch)."""
        ctx = self.synced_ctx()
        ctx.clear_step_outputs()
        ctx.batch = batch
        _fire(stage, hooks, ctx, gate)

    def _modes(self) -> contextlib.ExitStack:
        s = self.strategy
        stack = contextlib.ExitStack()
        stack.enter_context(train_configured_models(s.models, s.optimizer_configs))
        stack.enter_context(freeze_unconfigured_models(s.models, s.optimizer_configs))
        return stack

    def to_device(self, batch: Any) -> Any:
        """``batch`` on the training device (``non_blocking``; mappings of tensors too)."""
        return _to_device(batch, self.device)

    def check_first_batch(self, loader: Any, batch: Any) -> None:
        """Once per run, before the first forward: is this a batch the models can take?"""
        s = self.strategy
        default = s.training_fn is default_training_fn
        check_first_batch(batch, s.models, default_training_fn=default, dataloader=loader)
        self.plan_neighbor_lists(batch)

    def plan_neighbor_lists(self, batch: Any) -> None:
        """Build the models' neighbour lists in every step if the first batch has none.

        Decided once (see :mod:`nvalchemi.training._neighbor_lists`): batches that carry
        lists cost nothing per step.
        """
        builders = tuple(b for b in self.strategy.neighbor_list_builders() if b.missing(batch))
        if builders:
            self.neighbor_builders = builders
            self._resolve()

    def annotate(self, exc: BaseException, stage: Any) -> None:
        """Add a note naming where training was (once per exception)."""
        annotate(exc, self.d, stage)


# ---------------------------------------------------------------------------- helpers
def default_training_fn(model: Any, batch: Any) -> dict[str, torch.Tensor]:
    """Call ``model(batch)`` and return ``{"predicted_<key>": value}`` for every non-``None`` output.

    ``model`` is one module, or a mapping holding ``"main"`` (or a single model).
    Keys that already start with ``predicted_`` are kept as they are.

    Example:
        >>> import torch
        >>> class Energy(torch.nn.Module):
        ...     def forward(self, batch):
        ...         return {"energy": batch["x"].sum().reshape(1, 1), "forces": None}
        >>> default_training_fn(Energy(), {"x": torch.ones(2)})
        {'predicted_energy': tensor([[2.]])}
    """
    if not isinstance(model, nn.Module) and isinstance(model, Mapping):
        model = model["main"] if "main" in model or len(model) != 1 else next(iter(model.values()))
    outputs = model(batch)
    if type(outputs) is not dict and not isinstance(outputs, Mapping):
        raise TypeError(
            f"default_training_fn expects {type(model).__name__} to return a mapping of outputs "
            f"(e.g. {{'energy': ...}}); got {type(outputs).__name__}. Write a training_fn that "
            "returns {'predicted_energy': ...}."
        )
    names = _PREDICTED_NAMES
    predictions = {}
    for key, value in outputs.items():
        if value is not None:
            name = names.get(key)
            if name is None:
                name = key if key.startswith("predicted_") else f"predicted_{key}"
                if len(names) < 1024:
                    names[key] = name
            predictions[name] = value
    return predictions


_PREDICTED_NAMES: dict[str, str] = {}  # output key -> prediction key, as computed above


def annotate(exc: BaseException, counters: Mapping[str, Any], stage: Any) -> None:
    """Add a note to ``exc`` naming the stage and the counters (once per exception)."""
    if getattr(exc, "_nvalchemi_annotated", False):
        return
    d, where = counters, getattr(stage, "name", stage)
    add_note(
        exc,
        f"raised during training at stage {where} (step {d['step_count']}, epoch "
        f"{d['epoch_count']}, batch {d['epoch_step_count']} of the epoch, batch_count "
        f"{d['batch_count']})",
    )
    explain_collective_failure(exc)  # a timed-out collective: which one, which rank
    with contextlib.suppress(AttributeError, TypeError):
        exc._nvalchemi_annotated = True


def check_nonfinite(strategy: Any, record: NonFiniteRecord | None) -> None:
    """Raise :class:`NonFiniteLossError` for a NaN/inf loss in ``record`` (see the strategy's
    ``check_nonfinite``); with no record (no run) the process still takes part in the vote
    of a distributed run."""
    d = strategy.__dict__
    bad = None if record is None else record.first_bad()
    # Every rank votes (a collective), also one that found nothing.
    voted = _distributed(strategy) and all_agree(bad is not None, strategy.distributed_manager)
    if voted and bad is None:
        raise NonFiniteLossError(
            step=d["step_count"],
            epoch=d["epoch_count"],
            epoch_step=d["epoch_step_count"],
            batch_count=d["batch_count"],
            components=[],
            detail="Another rank reported a non-finite loss since the last check. "
            + _advice(strategy, None),
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
        detail=_advice(strategy, step),
    )


def _advice(strategy: Any, step: int | None) -> str:
    """How far a non-finite loss found now may have reached the weights."""
    now = strategy.step_count
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
        f"{strategy.nonfinite_check_interval} recorded losses, before validation, "
        "epoch-end and training-end hooks, checkpoints and at the end of run()) after "
        f"optimizer steps {step}..{now - 1} had already used its gradients: the weights "
        f"and optimizer state of the last {taken} step(s) may be non-finite; resume from a "
        f"checkpoint with step_count <= {step}. {strict}"
    )


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


def _not_split(exc: BaseException, reason: str) -> None:
    add_note(
        exc,
        f"The batch was not trained in pieces: {reason}. Lower the batch size or the budget "
        "(BudgetBatchSampler(max_atoms=...)), or use a smaller model.",
    )


def _distributed(strategy: Any) -> bool:
    manager = strategy.distributed_manager
    return is_distributed_initialized(manager) and get_world_size(manager) > 1


def detached(out: Mapping[str, Any]) -> dict[str, Any]:
    """A loss output with every tensor detached (per-sample values are lazy and detached)."""
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


_detached = detached


def _to_device(batch: Any, device: torch.device) -> Any:
    current = getattr(batch, "device", None)
    if current is not None:
        return batch.to(device, non_blocking=True) if current != device else batch
    if isinstance(batch, Mapping):
        return {
            k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
        }
    return batch


def _sized(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader, else the first of its samplers that has it."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = [
        loader,
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
    ]
    seen: set[int] = set()
    for sampler in candidates:
        if sampler is None or id(sampler) in seen:
            continue
        seen.add(id(sampler))
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            return
