"""``TrainingStrategy``: the owner of one training job, and ``default_training_fn``.

A strategy holds the configuration (model(s), loss, optimizer configs, duration, devices,
validation, hooks) and what outlives one run (counters, optimizers and schedulers); each
``run()`` builds a private run object that owns the loop (see :mod:`nvalchemi.training._run`
for the per-batch path and the hook-frequency rules).

Example:
    >>> import torch
    >>> from nvalchemi.training import (EnergyMSELoss, OptimizerConfig, TrainingStrategy,
    ...                                 ValidationConfig)
    >>> strategy = TrainingStrategy(  # doctest: +SKIP
    ...     models=model,
    ...     optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
    ...     loss_fn=EnergyMSELoss(),
    ...     validation_config=ValidationConfig(validation_data=val_batches, every_n_epochs=1),
    ...     num_epochs=10,
    ... )
    >>> strategy.run(train_batches)  # doctest: +SKIP

What hooks and checkpoints use (all public): :meth:`runtime_state` /
:meth:`load_runtime_state`, :meth:`ensure_optimizers`, :meth:`iter_checkpointable_hooks`,
:meth:`trainable_models`, :meth:`unwrapped_models`, :meth:`check_nonfinite`,
:meth:`check_nonfinite_if_due`, :meth:`clear_unowned_gradients`, :meth:`request_stop`,
:meth:`new_context`; the optional members a hook may define are listed in
:mod:`nvalchemi.hooks.protocol`.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import importlib.util
import inspect
import sys
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from enum import Enum
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from nvalchemi._serialization import import_path
from nvalchemi.distributed.runtime import get_rank, get_world_size
from nvalchemi.hooks import protocol
from nvalchemi.hooks.context import TrainContext
from nvalchemi.hooks.registry import HookRegistryMixin
from nvalchemi.models.base import BaseModelMixin
from nvalchemi.training import loader_position, strategy_payload
from nvalchemi.training._compiled import check_compile_kwargs
from nvalchemi.training._first_batch import check_dataloader, check_first_batch
from nvalchemi.training._neighbor_lists import builders_for
from nvalchemi.training._run import (
    NONFINITE_MODES,
    Progress,
    _Run,
    annotate,
    check_nonfinite,
    default_training_fn,
    detached,
)
from nvalchemi.training.checkpoint import load as checkpoint_load
from nvalchemi.training.checkpoint import save as checkpoint_save
from nvalchemi.training.errors import NonFiniteLossError, TrainingStalledError, add_note
from nvalchemi.training.hooks.update import (
    _MULTIPLE_ORCHESTRATOR_MSG,
    TrainingUpdateOrchestrator,
    _fold_training_update_hooks,
    _hook_claims_stage,
    is_update_hook,
)
from nvalchemi.training.losses.base import BaseLossFunction
from nvalchemi.training.losses.composition import (
    ComposedLossFunction,
    assemble_loss_targets,
)
from nvalchemi.training.optimizers import (
    OptimizerConfig,
    _is_metric_scheduler_class,
    iter_qualified_named_parameters,
    setup_optimizers,
)
from nvalchemi.training.runtime import training_world_size, unwrap_model
from nvalchemi.training.spec import BaseSpec
from nvalchemi.training.stages import TrainingStage
from nvalchemi.training.validation import ValidationConfig, ValidationLoop

__all__ = ["NonFiniteLossError", "TrainingStalledError", "TrainingStrategy", "default_training_fn"]

_DO_STAGES = (TrainingStage.DO_BACKWARD, TrainingStage.DO_OPTIMIZER_STEP)

_COUNTERS = ("step_count", "global_step_count", "batch_count", "epoch_count", "epoch_step_count")


class TrainingStrategy(HookRegistryMixin, BaseModel):
    """One training job: models, loss, optimizers, duration, devices, validation, hooks, counters.

    Args:
        models: one ``nn.Module`` (called as ``training_fn(model, batch)``) or a mapping of
            names to modules (``training_fn(models, batch)``). Models without optimizer
            configs are frozen and in eval mode during training (restored afterwards).
        optimizer_configs: an :class:`OptimizerConfig`, a list of them (single model), or
            ``{model key: [OptimizerConfig, ...]}``.
        num_epochs / num_steps: exactly one. ``num_steps`` counts executed optimizer
            steps. ``num_epochs`` counts passes over the data: a budget of
            ``ceil(num_epochs * len(loader) * epoch_step_modifier)`` batches, converted to
            optimizer steps (the run's target); with ``GradientAccumulationHook(N)``, whose
            windows close at every epoch end, an epoch of ``B`` batches is ``ceil(B / N)``
            steps, so ``num_epochs=3`` still means three passes.
        loss_fn: a leaf loss or a ``ComposedLossFunction``.
        training_fn: ``fn(model_or_models, batch) -> predictions`` (default
            :func:`default_training_fn`); a dotted path is resolved.
        loss_target_assembler: builds targets (default: batch field, else prediction).
        devices: one device, or one per model; batches go to ``devices[0]``.
        hooks: hooks (update hooks are folded into one orchestrator).
        validation_config: when and how to validate.
        nonfinite_loss: ``"raise"`` (default) records losses on the device and raises
            :class:`NonFiniteLossError` at the next check naming the step. The check runs
            once ``nonfinite_check_interval`` losses are recorded, after backward and
            before that batch's optimizer step (so with ``nonfinite_check_interval=1`` a
            non-finite loss never reaches the weights; with the default 100, up to 99
            earlier steps may have used it, and the error says how many), and also before
            validation, epoch/training-end hooks, checkpoints, at the end of ``run()``,
            when a ``train_batch`` session closes, and before every ``train_batch`` step;
            ``"skip"`` reads the loss every batch and skips backward/step of
            non-finite batches (the read costs about a microsecond on CPU; on a GPU it
            waits for the forward pass every batch, and under DDP it adds one small
            all-reduce so every rank skips together); ``"ignore"`` does nothing.
        max_consecutive_skips: raise :class:`TrainingStalledError` after this many batches
            in a row without an optimizer step (skipped or vetoed; batches that only
            accumulate gradients in an open accumulation window are not counted);
            ``None`` disables.
        compile: train with the models' forward and backward compiled by
            ``torch.compile`` (``dynamic=True`` unless ``compile_kwargs`` says otherwise);
            the strategy's models stay eager for validation and checkpoints. Forces and
            stress compile with the model when they come from
            ``energy_and_derivatives`` (PaiNN, DemoModel); see
            :mod:`nvalchemi.training._compiled` for what compiles and what does not.
        compile_kwargs: keyword arguments of ``torch.compile`` (``mode``, ``backend``,
            ``dynamic``, ``fullgraph``, ``options``, ``disable``).

    A step that runs out of device memory (``torch.OutOfMemoryError``) is trained in
    pieces with the update of the whole batch, and later batches above the size that
    fitted are cut before their forward (see :mod:`nvalchemi.training._memory_split`).
    Models that declare a ``NeighborConfig`` get their neighbour lists built on the
    training device when the batches come without (see :meth:`neighbor_list_builders`).

    Counters ``step_count``, ``global_step_count``, ``batch_count``, ``epoch_count``
    (alias ``epoch``) and ``epoch_step_count`` may be given to resume.

    Hook ``frequency=N``: at the batch stages a hook fires on the batches that build
    optimizer step ``k`` (1-based) with ``k % N == 0`` (at ``AFTER_OPTIMIZER_STEP`` and
    ``AFTER_BATCH`` only if that step was taken); epoch stages count epochs the same
    way; ``SETUP``, ``BEFORE_TRAINING``, ``AFTER_TRAINING``, ``AFTER_VALIDATION``, the
    ``DO_*`` slots and validation forwards always fire.

    Optimizers and schedulers are built once and kept across ``run()``/``train_batch()``
    calls (rebuilt only when the configs or the trainable parameters change). Call
    :meth:`request_stop` (from a hook or a signal handler) to end a run cleanly.
    """

    model_config = ConfigDict(
        arbitrary_types_allowed=True,
        extra="forbid",
        validate_assignment=False,
        revalidate_instances="never",
    )
    _stage_type: ClassVar[type[Enum]] = TrainingStage

    models: dict[str, Any]
    optimizer_configs: dict[str, list[OptimizerConfig]] = Field(default_factory=dict)
    num_epochs: int | None = Field(default=None, ge=1)
    num_steps: int | None = Field(default=None, ge=1)
    epoch_step_modifier: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    hooks: list[Any] = Field(default_factory=list)
    training_fn: Any = default_training_fn
    loss_fn: Any
    loss_target_assembler: Any = Field(default=assemble_loss_targets, exclude=True)
    devices: list[Any] = Field(default_factory=lambda: [torch.device("cpu")])
    distributed_manager: Any = Field(default=None, exclude=True)
    step_count: int = Field(default=0, ge=0)
    global_step_count: int = Field(default=0, ge=0)
    batch_count: int = Field(default=0, ge=0)
    epoch_count: int = Field(default=0, ge=0)
    epoch_step_count: int = Field(default=0, ge=0)
    single_model_input: bool = False
    last_validation: Any = Field(default=None, exclude=True)
    inference_model: Any = Field(default=None, exclude=True)
    validation_config: ValidationConfig | None = Field(default=None, exclude=True)
    nonfinite_loss: Literal["raise", "skip", "ignore"] = "raise"
    nonfinite_check_interval: int = Field(default=100, ge=1)
    max_consecutive_skips: int | None = Field(default=100, ge=1)
    compile: bool = False
    compile_kwargs: dict[str, Any] = Field(default_factory=dict)

    # ------------------------------------------------------------------ construction
    @model_validator(mode="before")
    @classmethod
    def _normalize_inputs(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        models = data.get("models")
        single = isinstance(models, nn.Module) and not isinstance(models, nn.ModuleDict)
        data["single_model_input"] = single
        if single:
            data["models"] = {"main": models}
        elif isinstance(models, (Mapping, nn.ModuleDict)):
            if len(models) == 0:
                raise ValueError(
                    "models must contain at least one BaseModelMixin (or nn.Module) model; got "
                    "an empty mapping. Pass models=model or models={'name': model}."
                )
            bad = {
                str(k): type(v).__name__ for k, v in models.items() if not isinstance(v, nn.Module)
            }
            if bad:
                raise ValueError(
                    "models must map names to torch.nn.Module instances; invalid entries: "
                    f"{bad}. Wrap each model as an nn.Module."
                )
            keys = [k for k in models if not isinstance(k, str)]
            if keys:
                raise ValueError(f"models keys must be strings; got {keys}.")
            data["models"] = dict(models.items())
        elif "models" in data:
            raise ValueError(
                "models must be a torch.nn.Module or a mapping of names to modules; got "
                f"{type(models).__name__}."
            )
        data["optimizer_configs"] = _normalize_configs(data.get("optimizer_configs"), single)
        if "epoch" in data:
            epoch = data.pop("epoch")
            data.setdefault("epoch_count", epoch)
        if data.get("training_fn", default_training_fn) is None:
            data["training_fn"] = default_training_fn
        return data

    @field_validator("loss_fn", mode="before")
    @classmethod
    def _composed_loss(cls, value: Any) -> Any:
        if isinstance(value, ComposedLossFunction):
            return value
        if isinstance(value, BaseLossFunction):
            return ComposedLossFunction([value])
        raise TypeError(
            "Only loss functions that inherit `BaseLossFunction` or a composition of loss "
            f"functions is accepted; got {type(value).__name__}. Use e.g. EnergyMSELoss() or "
            "EnergyMSELoss() + ForceMSELoss()."
        )

    @field_validator("training_fn", mode="before")
    @classmethod
    def _resolve_training_fn(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = _resolve_dotted(value)
        if not callable(value):
            raise ValueError(
                f"training_fn must be callable (fn(model_or_models, batch)); got "
                f"{type(value).__name__}. Use default_training_fn or your own function."
            )
        return value

    @field_validator("hooks", mode="before")
    @classmethod
    def _fold_hooks(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise ValueError(f"hooks must be a list of hooks; got {type(value).__name__}.")
        return _fold_training_update_hooks(list(value))

    @field_validator("compile_kwargs", mode="before")
    @classmethod
    def _compile_kwargs(cls, value: Any) -> Any:
        return check_compile_kwargs(value)

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, value: Any) -> Any:
        if isinstance(value, (str, torch.device)):
            value = [value]
        try:
            return [torch.device(d) for d in value]
        except (TypeError, RuntimeError) as exc:
            raise ValueError(f"devices must be torch.device or device strings: {exc}") from None

    @model_validator(mode="after")
    def _check(self) -> TrainingStrategy:
        if (self.num_epochs is None) == (self.num_steps is None):
            raise ValueError(
                "Exactly one of num_epochs or num_steps must be set; got "
                f"num_epochs={self.num_epochs}, num_steps={self.num_steps}."
            )
        if not self.models:
            raise ValueError(
                "models must contain at least one BaseModelMixin (or nn.Module) model."
            )
        if not self.optimizer_configs:
            raise ValueError(
                "optimizer_configs must configure at least one model; got an empty mapping. "
                "Pass optimizer_configs=OptimizerConfig(torch.optim.Adam, {'lr': 1e-3})."
            )
        for key, configs in self.optimizer_configs.items():
            if key not in self.models:
                raise ValueError(
                    f"optimizer_configs key {key!r} is not present in models; available model "
                    f"keys: {sorted(self.models)}."
                )
            if not configs:
                raise ValueError(
                    f"optimizer_configs[{key!r}] must contain at least one OptimizerConfig."
                )
        if not self.devices:
            raise ValueError("devices must contain at least one torch.device.")
        if len(self.devices) not in (1, len(self.models)):
            raise ValueError(
                f"devices must have length 1 or len(models)={len(self.models)}; got "
                f"{len(self.devices)}."
            )
        _check_call_shape(self.training_fn, self.single_model_input)
        for i, weight in enumerate(self.loss_fn.weights):
            if not isinstance(weight, float):
                spec = weight.to_spec() if callable(getattr(weight, "to_spec", None)) else None
                if not isinstance(spec, BaseSpec):
                    raise ValueError(
                        f"loss_fn weights[{i}]: schedule {type(weight).__name__} must implement "
                        "to_spec() returning a BaseSpec so the strategy can be checkpointed."
                    )
        _check_unique(self.hooks)
        _check_do_claims(self.hooks)
        _validate_dependencies(self.hooks)
        if self.global_step_count == 0 and self.step_count > 0:
            self.global_step_count = self.step_count * training_world_size(self.distributed_manager)
        self._init_runtime()
        return self

    def _init_runtime(self) -> None:
        # Runs after every validation check passed, so a rejected configuration never
        # triggers a hook's on_register side effects.
        d = self.__dict__
        d["_run"] = None  # the run of the current run() or train_batch session, else the last
        d["_progress"] = Progress()  # where training stands besides the counters (resume)
        d["_context_depth"] = 0
        d["_auto_session"] = False
        d["_optimizer_signature"] = None
        d["_optimizers"] = []
        d["_lr_schedulers"] = []
        d["_unowned_params"] = ()
        d["_neighbor_builders"] = None  # (models key, builders), see neighbor_list_builders
        hooks = list(self.hooks)
        self.hooks = []
        self._rebuild_hook_table()
        for hook in hooks:
            HookRegistryMixin.register_hook(self, hook)
        self._hooks_changed()

    # ------------------------------------------------------------------ hooks
    def register_hook(self, hook: Any, stage: Enum | None = None) -> None:
        """Register ``hook`` (at ``stage`` if given), calling only its own ``on_register``.

        Update hooks join the strategy's orchestrator (created on first use); other
        hooks' registration side effects are never re-run.

        Raises:
            ValueError: ``stage=`` for an update hook, a second orchestrator, a second
                claimant of a ``DO_*`` slot, or a duplicate hook.
        """
        if is_update_hook(hook):
            if stage is not None:
                raise ValueError(
                    "stage= is not supported for TrainingUpdateHook or TrainingUpdateOrchestrator "
                    "registration. Update hooks run at the update stages through the "
                    "orchestrator; register them without stage=."
                )
            existing = self.orchestrator()
            if existing is not None:
                if isinstance(hook, TrainingUpdateOrchestrator):
                    raise ValueError(_MULTIPLE_ORCHESTRATOR_MSG)
                existing.add_hook(hook, workflow=self)
                self._hooks_changed()
                return
            if not isinstance(hook, TrainingUpdateOrchestrator):
                hook = TrainingUpdateOrchestrator(hook)
        _check_unique([*self.hooks, hook])
        _check_do_claims([*self.hooks, hook], candidate=hook, stage=stage)
        HookRegistryMixin.register_hook(self, hook, stage)
        try:
            _validate_dependencies(self.hooks)
        except BaseException:
            HookRegistryMixin.unregister_hook(self, hook)
            raise
        finally:
            self._hooks_changed()

    def unregister_hook(self, hook: Any) -> None:
        """Remove ``hook`` (by identity)."""
        HookRegistryMixin.unregister_hook(self, hook)
        self._hooks_changed()

    def refresh_hooks(self) -> None:
        """Rebuild the dispatch tables after editing ``self.hooks`` directly."""
        HookRegistryMixin.refresh_hooks(self)
        self._hooks_changed()

    def _hooks_changed(self) -> None:
        run = self.__dict__["_run"]
        if run is not None:
            run.stale = True  # it resolves the hooks of each stage again before its next batch

    def orchestrator(self) -> TrainingUpdateOrchestrator | None:
        """The update-hook orchestrator (gradient accumulation, mixed precision, ...), if any."""
        for hook in self.hooks:
            if isinstance(hook, TrainingUpdateOrchestrator):
                return hook
        return None

    def all_hooks(self) -> list[Any]:
        """Top-level hooks followed by the orchestrator's children."""
        out = list(self.hooks)
        orchestrator = self.orchestrator()
        if orchestrator is not None:
            out.extend(orchestrator.iter_hooks())
        return out

    def iter_checkpointable_hooks(self) -> Iterator[tuple[str, Any]]:
        """``(key, hook)`` for hooks with ``state_dict``/``load_state_dict``.

        Keys are class names (``#1``, ``#2`` ... for repeats). A hook holding others (the
        update orchestrator, the reporting orchestrator) appears once carrying its
        children's state, and not at all when none of its children has state.
        """
        counts: dict[str, int] = {}
        for hook in self.hooks:
            children = protocol.member(hook, "checkpointable_children")
            if not protocol.is_checkpointable(hook) or (children is not None and not children()):
                continue
            name = type(hook).__name__
            n = counts.get(name, 0)
            counts[name] = n + 1
            yield (name if n == 0 else f"{name}#{n}"), hook

    # ------------------------------------------------------------------ models and state
    @property
    def epoch(self) -> int:
        """Alias of ``epoch_count``."""
        return self.epoch_count

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.epoch_count = int(value)

    @property
    def active_dataloader(self) -> Any:
        """The loader the current (or last) run iterates (``SETUP`` hooks may replace it)."""
        run = self.__dict__["_run"]
        return None if run is None else run.loader

    @active_dataloader.setter
    def active_dataloader(self, loader: Any) -> None:
        run = self.__dict__["_run"]
        if run is None:
            raise RuntimeError(
                "active_dataloader is the loader of a run; set it from a SETUP hook (or later)."
            )
        run.loader = loader

    @property
    def accumulation_window_open(self) -> bool:
        """Whether gradients of some batches wait for a later optimizer step.

        ``True`` between the batches of a gradient-accumulation window; checkpoints are
        only exact outside one (``CheckpointHook`` defers its saves to the window's end).
        """
        orchestrator = self.orchestrator()
        return orchestrator is not None and orchestrator.window_open

    @property
    def running(self) -> bool:
        """Whether :meth:`run` is executing (``False`` during ``train_batch`` sessions)."""
        run = self.__dict__["_run"]
        return run is not None and run.running

    @property
    def stop_reason(self) -> str | None:
        """Why the last (or current) run was asked to stop, or ``None``."""
        run = self.__dict__["_run"]
        return None if run is None else run.stop_reason

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`request_stop` was called during the current run."""
        return self.stop_reason is not None

    @property
    def compiled_graphs(self) -> list[int]:
        """Graphs ``torch.compile`` built in each epoch of the last ``run()`` (``compile=True``).

        Read from ``torch._dynamo``'s counters (process-wide). The first epoch holds the
        initial compilation; with ``dynamic=True`` later epochs stay near 0 even when
        every batch has another size.
        """
        run = self.__dict__["_run"]
        return [] if run is None else list(run.compiled_graphs)

    def neighbor_list_builders(self) -> tuple[Any, ...]:
        """Builders of the neighbour lists the models need, for batches that come without.

        One per list format the models' ``NeighborConfig`` ask for, at the largest of
        their cutoffs; each is a ``BEFORE_FORWARD`` hook that builds the lists of a batch
        lacking them on the batch's device (:func:`nvalchemi.data.neighbors.compute_neighbors`).
        ``run()`` and ``train_batch`` use them when the first batch has no lists,
        validation for every batch without. Empty when no model declares a
        ``NeighborConfig``, or when a ``NeighborListHook`` is registered (then it owns
        the lists).
        """
        from nvalchemi.hooks.neighbor_list import NeighborListHook  # light

        if any(isinstance(hook, NeighborListHook) for hook in self.all_hooks()):
            return ()
        d = self.__dict__
        key = tuple(id(model) for model in self.models.values())
        cached = d["_neighbor_builders"]
        if cached is None or cached[0] != key:
            cached = d["_neighbor_builders"] = (key, builders_for(self.models.values()))
        return cached[1]

    def trainable_models(self) -> dict[str, nn.Module]:
        """The models that have optimizer configs (as stored, possibly DDP-wrapped)."""
        return {k: m for k, m in self.models.items() if k in self.optimizer_configs}

    def unwrapped_models(self) -> dict[str, nn.Module]:
        """All models with DDP/DataParallel wrappers stripped (for saving and validation)."""
        return {k: unwrap_model(m) for k, m in self.models.items()}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> TrainingStrategy:
        d = self.__dict__
        if d["_context_depth"] == 0:
            protocol.enter_hooks(self.hooks)
        d["_context_depth"] += 1
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        d = self.__dict__
        if d["_context_depth"] <= 0:
            return
        d["_context_depth"] -= 1
        if d["_context_depth"] == 0:
            d["_auto_session"] = False
            run = d["_run"]
            if run is not None and run.open:
                run.close()  # it stays the last run: its loader position, stop reason, ...
                if exc_type is None and run.record.losses:
                    # The final pending check: a NaN in the last steps is never silent.
                    try:
                        run.check_nonfinite()
                    except NonFiniteLossError as error:
                        protocol.exit_hooks(self.hooks, type(error), error, error.__traceback__)
                        raise
            protocol.exit_hooks(self.hooks, exc_type, exc, tb)

    def close(self) -> None:
        """End a ``train_batch`` session opened without ``with strategy:`` (exit hook contexts).

        Runs the final non-finite check first (``nonfinite_loss="raise"``), so a NaN in
        the session's last batches raises here at the latest.
        """
        if self.__dict__["_auto_session"]:
            self.__exit__(None, None, None)

    # ------------------------------------------------------------------ training
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
        check_dataloader(dataloader)
        self.close()
        _check_metric_schedulers(self)
        with self:
            run = self.__dict__["_run"] = _Run(self)
            run.running = True
            try:
                with self._parameter_flags():  # fine-tuning filters, undone on exit
                    run.begin(dataloader)
                    run.train()
            finally:
                run.running = False

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
            run = d["_run"]
            first = run is None or not run.open
            if first:
                default = self.training_fn is default_training_fn
                check_first_batch(batch, self.models, default_training_fn=default)
                d["_run"] = run = _Run(self, strict=True)
                run.begin(None)
            else:
                self.ensure_optimizers()
                run.refresh()
            run.set_epoch_length(None)  # no epochs here: accumulation windows stay full
            with run._modes():
                batch = run.to_device(batch)
                if first:
                    run.plan_neighbor_lists(batch)
                run.step(batch)
        ctx = run.ctx
        loss = ctx.loss if ctx is not None and ctx.loss is not None else run.last_loss
        return loss.detach() if isinstance(loss, torch.Tensor) else loss

    def validate(self, config: Any = None) -> dict[str, Any]:
        """Run one validation pass now; return (and store in ``last_validation``) the summary.

        Checks the non-finite record first, fires ``AFTER_VALIDATION`` hooks with
        ``ctx.validation`` set. Does not step metric schedulers.
        """
        if config is None and self.validation_config is None:
            raise RuntimeError("TrainingStrategy.validate() requires a validation_config.")
        self.check_nonfinite()
        loop = ValidationLoop.from_training_strategy(self, config)
        with loop:
            summary = loop.execute()
        d = self.__dict__
        d["last_validation"] = summary
        d["_progress"].validated_at = (d["step_count"], d["batch_count"])
        hooks = self.hooks_for(TrainingStage.AFTER_VALIDATION)
        if hooks:
            run = d["_run"]
            ctx = run.synced_ctx() if run is not None else None  # None: no run context
            if ctx is None:
                ctx = self.new_context()
            ctx.validation = summary
            # The last training batch's loss, never a live graph (no sync: detach only).
            if isinstance(ctx.loss, torch.Tensor):
                ctx.loss = ctx.loss.detach()
            if isinstance(ctx.losses, Mapping):
                ctx.losses = detached(ctx.losses)
            for hook in hooks:
                try:
                    hook(ctx, TrainingStage.AFTER_VALIDATION)
                except Exception as exc:
                    add_note(exc, f"raised by hook {type(hook).__name__} at stage AFTER_VALIDATION")
                    raise
        return summary

    def request_stop(self, reason: str) -> None:
        """Ask ``run()`` to stop after the current batch (idempotent; the first reason wins).

        Inside a gradient-accumulation window the run goes on until the window's
        optimizer step (or the epoch end, which closes it), so it never ends with
        accumulated gradients that a checkpoint could not hold. The run then fires
        ``AFTER_EPOCH`` only if the epoch completed, then ``AFTER_TRAINING`` and the final
        validation; counters stay consistent.
        """
        run = self.__dict__["_run"]
        if run is not None and run.stop_reason is None:
            run.stop_reason = str(reason)

    def new_context(self, batch: Any = None) -> TrainContext:
        """A ``TrainContext`` filled from the strategy (models, optimizers, counters, rank)."""
        d = self.__dict__
        return TrainContext(
            batch=batch,
            workflow=self,
            models=self.models,
            model=self.models.get("main"),
            optimizers=d["_optimizers"],
            lr_schedulers=d["_lr_schedulers"],
            global_rank=get_rank(self.distributed_manager),
            validation=d["last_validation"],
            step_count=d["step_count"],
            global_step_count=d["global_step_count"],
            batch_count=d["batch_count"],
            epoch_step_count=d["epoch_step_count"],
            epoch=d["epoch_count"],
        )

    # ------------------------------------------------------------------ non-finite losses
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
        run = self.__dict__["_run"]
        check_nonfinite(self, None if run is None else run.record)

    def check_nonfinite_if_due(self) -> None:
        """Run :meth:`check_nonfinite` if enough losses are recorded (right before a step).

        The update orchestrator calls it after its vetoes and before stepping, so a
        non-finite loss raises before its gradients reach the weights.
        """
        run = self.__dict__["_run"]
        if run is not None and run.nonfinite == NONFINITE_MODES["raise"] and run.check_due():
            try:
                run.check_nonfinite()
            except Exception as exc:
                run.annotate(exc, "the non-finite loss check before the optimizer step")
                raise

    def discard_recent_losses(self, count: int) -> None:
        """Tell the non-finite check that the last ``count`` batches' losses were discarded.

        Update hooks that veto a step AND drop its gradients (e.g. ``LossSpikeSkipHook``
        skipping a NaN window) call this, so a deliberately skipped non-finite loss does
        not raise at the next check of ``nonfinite_loss="raise"``.
        """
        run = self.__dict__["_run"]
        if run is not None:
            run.record.forget_last(int(count))

    # ------------------------------------------------------------------ optimizers
    @property
    def optimizers_built(self) -> bool:
        """Whether the optimizers exist (hooks that add parameters must come before)."""
        return bool(self.__dict__["_optimizers"])

    def ensure_optimizers(self) -> tuple[list[Any], list[Any]]:
        """Build the optimizers/schedulers if needed; return ``(optimizers, schedulers)``.

        Kept across ``run()``/``train_batch()`` calls (Adam moments and schedule position
        survive); rebuilt when the configs, the parameter filters or the set of trainable
        parameters change. Wrappers such as DDP share their module's parameters, so
        wrapping keeps them. Checkpoint loading calls this, then loads state into the
        returned lists (live: they are mutated in place when rebuilt).
        """
        d = self.__dict__
        with self._parameter_flags():  # optimizers see the flags the run trains with
            key = self._optimizer_key()
            if key == d["_optimizer_signature"]:
                return d["_optimizers"], d["_lr_schedulers"]
            allowed = d.get("_optimizer_parameter_names")
            try:
                pairs = setup_optimizers(
                    self.models, self.optimizer_configs, allowed_parameter_names=allowed
                )
            except Exception as exc:
                annotate(exc, d, "building optimizers")
                raise
            optimizers = [o for key in self.optimizer_configs for o, _ in pairs[key]]
            schedulers = [s for key in self.optimizer_configs for _, s in pairs[key]]
            d["_unowned_params"] = () if allowed is None else _unowned(self, optimizers)
        # Mutate in place: contexts and hooks hold these list objects.
        d["_optimizers"][:] = optimizers
        d["_lr_schedulers"][:] = schedulers
        d["_optimizer_signature"] = key
        if d["_run"] is not None:
            d["_run"].stale = True
        return d["_optimizers"], d["_lr_schedulers"]

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

    def clear_unowned_gradients(self) -> None:
        """Clear gradients of trainable parameters that no optimizer owns.

        Called wherever optimizers zero theirs (the loop, the update orchestrator), so a
        parameter left out by :meth:`set_optimizer_parameter_filter` never accumulates.
        """
        for param in self.__dict__["_unowned_params"]:
            param.grad = None

    def set_inference_model(self, module: nn.Module, *, model_key: str | None = None) -> None:
        """Publish an inference model (e.g. EMA weights) used by validation per ``use_ema``."""
        module.to(self.devices[0], non_blocking=True)
        if self.single_model_input or model_key is None:
            self.inference_model = module
            return
        slot = self.inference_model
        if not isinstance(slot, nn.ModuleDict):
            slot = nn.ModuleDict()
        slot[model_key] = module
        self.inference_model = slot

    def runtime_state(self) -> dict[str, Any]:
        """Counters and loop state to resume exactly (JSON-ready).

        ``loader_position`` records the random-generator states the loader drew its
        current epoch's order from, and its generators' states now (see
        :mod:`nvalchemi.training.loader_position`), so a resume reproduces the order of
        ``DataLoader(shuffle=True)`` with or without a ``generator``, ``RandomSampler``
        and friends. Under DDP it is rank 0's (shuffle with a seeded
        ``DistributedSampler`` there). Checkpoint hooks should call
        :meth:`check_nonfinite` first (on every rank), so a checkpoint never captures a
        run that already diverged; this method itself does not synchronise.
        """
        d = self.__dict__
        progress, run = d["_progress"], d["_run"]
        state: dict[str, Any] = {name: int(d[name]) for name in _COUNTERS}
        state["consecutive_skips"] = int(progress.consecutive_skips)
        validated = progress.validated_at
        state["validated_at"] = list(validated) if validated is not None else None
        record = None if run is None else run.epoch_record
        if record is not None:
            now = [g.get_state() for g in loader_position.generators(run.loader)]
            state["loader_position"] = loader_position.encode(record, now)
        elif progress.resume_loader is not None:  # restored but not run yet: keep what was saved
            resume = progress.resume_loader
            state["loader_position"] = loader_position.encode(resume, resume["generators_now"])
        return state

    def load_runtime_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`runtime_state` output (``ValueError`` for negative/malformed values)."""
        if not isinstance(state, Mapping):
            raise ValueError(f"runtime_state must be a mapping; got {type(state).__name__}.")
        d = self.__dict__
        for name in _COUNTERS:
            if name not in state:
                continue
            try:
                value = int(state[name])
            except (TypeError, ValueError):
                raise ValueError(
                    f"runtime_state[{name!r}] must be an int; got {state[name]!r}."
                ) from None
            if value < 0:
                raise ValueError(f"runtime_state[{name!r}] must be >= 0; got {value}.")
            d[name] = value
        if not state.get("global_step_count") and d["step_count"] > 0:
            d["global_step_count"] = d["step_count"] * get_world_size(self.distributed_manager)
        progress, run = d["_progress"], d["_run"]
        progress.consecutive_skips = int(state.get("consecutive_skips", 0))
        validated = state.get("validated_at")
        progress.validated_at = tuple(int(v) for v in validated) if validated else None
        if run is not None:
            run.record.forget_last(len(run.record.losses))
            run.epoch_record = None
        record = loader_position.decode(state.get("loader_position"))
        legacy = _decode_rng_state(state.get("epoch_rng_state"))  # written before 0.2
        if record is None and legacy is not None:
            record = {
                "epoch": d["epoch_count"],
                "torch": legacy,
                "generators": [],
                "generators_now": [],
            }
        progress.resume_loader = record

    def validation_autocast(
        self, device: torch.device, mode: str = "auto"
    ) -> tuple[Callable[[], Any], str]:
        """Autocast factory and precision label for validation (from a mixed-precision hook)."""
        if mode == "never":
            return contextlib.nullcontext, "float32"
        for hook in self.all_hooks():
            autocast = protocol.member(hook, "inference_autocast")
            if autocast is not None:
                label = protocol.member(hook, "precision_name") or "mixed"
                return functools.partial(autocast, device), label
        if mode == "always":
            raise RuntimeError(
                "ValidationConfig(use_mixed_precision='always') requires a MixedPrecisionHook "
                "(or a hook with inference_autocast(device)) registered with the strategy."
            )
        return contextlib.nullcontext, "float32"

    # ------------------------------------------------------------------ specs
    # The JSON form of a strategy has one home (nvalchemi.training.strategy_payload); these
    # are its functions, bound as methods.
    to_spec_dict = strategy_payload.to_spec_dict
    to_checkpoint_dict = strategy_payload.to_checkpoint_dict
    from_spec_dict = classmethod(strategy_payload.from_spec_dict)
    from_checkpoint_dict = classmethod(strategy_payload.from_checkpoint_dict)

    # ------------------------------------------------------------------ checkpoint files
    save_checkpoint = checkpoint_save.strategy_save_checkpoint
    restore_checkpoint = checkpoint_load.strategy_restore_checkpoint
    load_checkpoint = classmethod(checkpoint_load.strategy_load_checkpoint)

    def __repr_args__(self) -> Any:
        for name in ("num_epochs", "num_steps", "step_count", "epoch_count", "nonfinite_loss"):
            yield name, getattr(self, name)
        yield "models", {k: type(m).__name__ for k, m in self.models.items()}
        yield "hooks", [type(h).__name__ for h in self.hooks]


# ---------------------------------------------------------------------------- helpers
def _check_metric_schedulers(self: Any) -> None:
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


def _unowned(strategy: Any, optimizers: list[Any]) -> tuple[Any, ...]:
    owned = {id(p) for optimizer in optimizers for g in optimizer.param_groups for p in g["params"]}
    configured = {k: m for k, m in strategy.models.items() if k in strategy.optimizer_configs}
    seen: set[int] = set()
    out = []
    for _, param in iter_qualified_named_parameters(configured):
        if param.requires_grad and id(param) not in owned and id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return tuple(out)


def _decode_rng_state(value: Any) -> torch.Tensor | None:
    """The torch RNG state of a ``runtime_state["epoch_rng_state"]`` (written before 0.2)."""
    if value is None:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (TypeError, ValueError):
        raw = b""
    if not raw:
        raise ValueError(
            "runtime_state['epoch_rng_state'] must be the base64 string runtime_state() "
            f"wrote; got {str(value)[:40]!r}. Remove the entry to resume without it."
        )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _normalize_configs(configs: Any, single: bool) -> Any:
    if configs is None:
        return {}
    if isinstance(configs, (OptimizerConfig, list, tuple)):
        if not single:
            raise ValueError(
                "Unkeyed optimizer_configs require single-model input; key them by model name, "
                "e.g. optimizer_configs={'student': [OptimizerConfig(...)]}."
            )
        configs = {"main": configs}
    if isinstance(configs, Mapping):
        out = {}
        for key, value in configs.items():
            key = "main" if key == 0 else key
            out[key] = [value] if isinstance(value, OptimizerConfig) else value
        return out
    return configs


def _resolve_dotted(path: str) -> Any:
    """A ``training_fn`` string given in Python: the caller's own code, imported as named.

    Strings read from files (job files, ``strategy.json``) are resolved under the trust
    rule by :mod:`~nvalchemi.training.strategy_payload` before they reach the constructor.
    """
    if "." not in path:
        raise ValueError(f"training_fn {path!r}: expected 'module.attribute'.")
    top = path.split(".")[0]
    if top not in sys.modules and importlib.util.find_spec(top) is None:
        raise ValueError(f"training_fn {path!r}: module {top!r} not found.")
    try:
        return import_path(path, trust=True)
    except (AttributeError, ImportError, ValueError) as exc:
        raise ValueError(
            f"training_fn {path!r} has no attribute or cannot be imported: {exc}"
        ) from None


def _check_call_shape(fn: Any, single: bool) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(object(), object())
    except TypeError:
        raise ValueError(
            "training_fn must accept exactly the two arguments (model_or_models, batch); "
            f"{getattr(fn, '__name__', fn)!r} has signature {signature}."
        ) from None
    params = list(signature.parameters.values())
    if not params or params[0].kind not in (
        params[0].POSITIONAL_ONLY,
        params[0].POSITIONAL_OR_KEYWORD,
    ):
        return
    annotation = _first_annotation(fn, params[0])
    kind = _annotation_kind(annotation)
    name = getattr(fn, "__name__", repr(fn))
    if single and kind == "mapping":
        raise ValueError(
            f"training_fn {name!r} annotates its first parameter as a mapping of models, but "
            "this is a single-model strategy (models=model passes one module). Pass "
            "models={'name': model} or annotate the parameter as a module."
        )
    if not single and kind == "module":
        raise ValueError(
            f"training_fn {name!r} annotates its first parameter as a single model, but this "
            "strategy has named models (a dict is passed). Pass models=model for single-model "
            "training, or annotate the parameter as a mapping (dict[str, nn.Module])."
        )


def _first_annotation(fn: Any, param: inspect.Parameter) -> Any:
    try:
        hints = typing.get_type_hints(fn)
        if param.name in hints:
            return hints[param.name]
    except Exception:
        pass
    return param.annotation


def _annotation_kind(annotation: Any) -> str | None:
    if annotation is inspect.Parameter.empty or annotation is Any or isinstance(annotation, str):
        return None
    origin = typing.get_origin(annotation)
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        kinds = {_annotation_kind(a) for a in typing.get_args(annotation) if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    target = origin or annotation
    if not isinstance(target, type):
        return None
    if issubclass(target, (Mapping, nn.ModuleDict)) or target is dict:
        return "mapping"
    if issubclass(target, nn.Module) or _is_model_mixin(target):
        return "module"
    return None


def _is_model_mixin(target: type) -> bool:
    """Whether ``target`` is ``BaseModelMixin`` or a subclass (a model type, not a mapping)."""
    return issubclass(target, BaseModelMixin)


def _check_unique(hooks: list[Any]) -> None:
    seen: set[int] = set()
    duplicates = []
    for hook in hooks:
        if id(hook) in seen:
            duplicates.append(type(hook).__name__)
        seen.add(id(hook))
    if duplicates:
        raise ValueError(
            f"hooks must not contain duplicate hook instances; repeated: {duplicates}. Create "
            "a separate instance for each registration."
        )


def _check_do_claims(hooks: list[Any], candidate: Any = None, stage: Any = None) -> None:
    for do_stage in _DO_STAGES:
        claimants = [
            h
            for h in hooks
            if (h is candidate and stage is not None and stage == do_stage)
            or _hook_claims_stage(h, do_stage)
        ]
        if len(claimants) > 1:
            names = ", ".join(type(h).__name__ for h in claimants)
            hint = (
                " Implement the plain hook as a TrainingUpdateHook so the orchestrator runs it."
                if any(isinstance(h, TrainingUpdateOrchestrator) for h in claimants)
                else " Keep one replacement hook per slot."
            )
            raise ValueError(
                f"At most one hook may claim {do_stage.name}; got {len(claimants)}: {names}.{hint}"
            )


def _validate_dependencies(hooks: list[Any]) -> None:
    for hook in hooks:
        check = protocol.member(hook, "_validate_registered_hooks")
        if check is not None:
            check(list(hooks))
