"""``TrainingStrategy``: the owner of one training job, and ``default_training_fn``.

A strategy holds the model(s), the loss, optimizer configs, the duration, devices,
validation, hooks and the runtime counters, and runs the loop (see
:mod:`nvalchemi.training._loop` for the per-batch path and the hook-frequency rules).

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

Extension seams used by checkpointing and DDP hooks: :meth:`runtime_state` /
:meth:`load_runtime_state`, :meth:`ensure_optimizers` with the ``_optimizers`` and
``_lr_schedulers`` lists, :meth:`iter_checkpointable_hooks`, :meth:`trainable_models`,
:meth:`unwrapped_models`, :meth:`check_nonfinite`, :meth:`request_stop`, and
``prepare_strategy(strategy)`` on hooks (called before device placement).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from nvalchemi.hooks.registry import HookRegistryMixin
from nvalchemi.training._loop import _TrainingLoop, unwrapped
from nvalchemi.training._nonfinite import _NonFiniteRecord
from nvalchemi.training._strategy_checks import (
    _check_call_shape,
    _check_do_claims,
    _check_unique,
    _decode_rng_state,
    _normalize_configs,
    _resolve_dotted,
    _validate_dependencies,
)
from nvalchemi.training.errors import NonFiniteLossError, TrainingStalledError
from nvalchemi.training.hooks.update import (
    _MULTIPLE_ORCHESTRATOR_MSG,
    TrainingUpdateOrchestrator,
    _fold_training_update_hooks,
    is_update_hook,
)
from nvalchemi.training.losses.base import BaseLossFunction
from nvalchemi.training.losses.composition import (
    ComposedLossFunction,
    assemble_loss_targets,
    loss_target_keys,
)
from nvalchemi.training.optimizers import OptimizerConfig
from nvalchemi.training.spec import BaseSpec
from nvalchemi.training.stages import TrainingStage
from nvalchemi.training.validation import ValidationConfig

__all__ = ["NonFiniteLossError", "TrainingStalledError", "TrainingStrategy", "default_training_fn"]

_COUNTERS = ("step_count", "global_step_count", "batch_count", "epoch_count", "epoch_step_count")


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
    return {
        (k if k.startswith("predicted_") else f"predicted_{k}"): v
        for k, v in outputs.items()
        if v is not None
    }


class TrainingStrategy(_TrainingLoop, HookRegistryMixin, BaseModel):
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
            from nvalchemi.training.runtime import training_world_size

            self.global_step_count = self.step_count * training_world_size(self.distributed_manager)
        self._init_runtime()
        return self

    def _init_runtime(self) -> None:
        # Runs after every validation check passed, so a rejected configuration never
        # triggers a hook's on_register side effects.
        d = self.__dict__
        d["_context_depth"] = 0
        d["_auto_session"] = False
        d["_batch_session_ready"] = False
        d["_hooks_version"] = 0
        d["_optimizer_version"] = 0
        d["_optimizer_signature"] = None
        d["_optimizers"] = []
        d["_lr_schedulers"] = []
        d["_runtime_optimizers"] = []
        d["_ctx"] = None
        d["_plan"] = None
        d["_last_batch"] = None
        d["_last_loss"] = None
        d["_active_dataloader"] = None
        d["_stop_reason"] = None
        d["_running"] = False
        d["_validated_at"] = None
        d["_consecutive_skips"] = 0
        d["_nonfinite_record"] = _NonFiniteRecord(self.nonfinite_check_interval)
        d["_epoch_length"] = None  # batches per epoch of the running loader (sized loaders)
        d["_epoch_record"] = None  # generator states the open epoch's order was drawn from
        d["_resume_loader"] = None  # a restored loader position, applied at the next epoch
        d["_target_keys"] = loss_target_keys(self.loss_fn)
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
            existing = self._orchestrator()
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
        self.__dict__["_hooks_version"] += 1

    def _orchestrator(self) -> TrainingUpdateOrchestrator | None:
        for hook in self.hooks:
            if isinstance(hook, TrainingUpdateOrchestrator):
                return hook
        return None

    def _all_hooks(self) -> list[Any]:
        """Top-level hooks followed by the orchestrator's children."""
        out = list(self.hooks)
        orchestrator = self._orchestrator()
        if orchestrator is not None:
            out.extend(orchestrator.iter_hooks())
        return out

    def iter_checkpointable_hooks(self) -> Iterator[tuple[str, Any]]:
        """``(key, hook)`` for hooks with ``state_dict``/``load_state_dict``.

        Keys are class names (``#1``, ``#2`` ... for repeats); the update orchestrator
        appears once (key ``"TrainingUpdateOrchestrator"``) carrying its children's state.
        """
        counts: dict[str, int] = {}
        for hook in self.hooks:
            if isinstance(hook, TrainingUpdateOrchestrator):
                if not hook.checkpointable_children():
                    continue
            elif not (
                callable(getattr(hook, "state_dict", None))
                and callable(getattr(hook, "load_state_dict", None))
            ):
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
        """The loader the current run iterates (``SETUP`` hooks may replace it)."""
        return self.__dict__["_active_dataloader"]

    @active_dataloader.setter
    def active_dataloader(self, loader: Any) -> None:
        self.__dict__["_active_dataloader"] = loader

    @property
    def accumulation_window_open(self) -> bool:
        """Whether gradients of some batches wait for a later optimizer step.

        ``True`` between the batches of a gradient-accumulation window; checkpoints are
        only exact outside one (``CheckpointHook`` defers its saves to the window's end).
        """
        orchestrator = self._orchestrator()
        return orchestrator is not None and orchestrator.window_open

    @property
    def running(self) -> bool:
        """Whether :meth:`run` is executing (``False`` during ``train_batch`` sessions)."""
        return self.__dict__["_running"]

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`request_stop` was called during the current run."""
        return self.__dict__["_stop_reason"] is not None

    def trainable_models(self) -> dict[str, nn.Module]:
        """The models that have optimizer configs (as stored, possibly DDP-wrapped)."""
        return {k: m for k, m in self.models.items() if k in self.optimizer_configs}

    def unwrapped_models(self) -> dict[str, nn.Module]:
        """All models with DDP/DataParallel wrappers stripped (for saving and validation)."""
        return unwrapped(self.models)

    def ensure_optimizers(self) -> tuple[list[Any], list[Any]]:
        """Build the optimizers/schedulers if needed; return ``(_optimizers, _lr_schedulers)``.

        Checkpoint loading calls this, then loads state into the returned objects;
        later runs keep them while the trainable parameters stay the same.
        """
        self._ensure_optimizers()
        return self._optimizers, self._lr_schedulers

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
        from nvalchemi.training import loader_position

        d = self.__dict__
        state: dict[str, Any] = {name: int(d[name]) for name in _COUNTERS}
        state["consecutive_skips"] = int(d["_consecutive_skips"])
        validated = d["_validated_at"]
        state["validated_at"] = list(validated) if validated is not None else None
        record = d["_epoch_record"]
        if record is not None:
            now = [g.get_state() for g in loader_position.generators(d["_active_dataloader"])]
            state["loader_position"] = loader_position.encode(record, now)
        elif d["_resume_loader"] is not None:  # restored but not run yet: keep what was saved
            resume = d["_resume_loader"]
            state["loader_position"] = loader_position.encode(resume, resume["generators_now"])
        return state

    def load_runtime_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`runtime_state` output (``ValueError`` for negative/malformed values)."""
        from nvalchemi.training import loader_position

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
            from nvalchemi.distributed.runtime import get_world_size

            d["global_step_count"] = d["step_count"] * get_world_size(self.distributed_manager)
        d["_consecutive_skips"] = int(state.get("consecutive_skips", 0))
        validated = state.get("validated_at")
        d["_validated_at"] = tuple(int(v) for v in validated) if validated else None
        d["_nonfinite_record"] = _NonFiniteRecord(self.nonfinite_check_interval)
        record = loader_position.decode(state.get("loader_position"))
        legacy = _decode_rng_state(state.get("epoch_rng_state"))  # written before 0.2
        if record is None and legacy is not None:
            record = {
                "epoch": d["epoch_count"],
                "torch": legacy,
                "generators": [],
                "generators_now": [],
            }
        d["_resume_loader"], d["_epoch_record"] = record, None

    def _inference_autocast(
        self, device: torch.device, mode: str = "auto"
    ) -> tuple[Callable[[], Any], str]:
        """Autocast factory and precision label for validation (from a mixed-precision hook)."""
        import contextlib

        if mode == "never":
            return contextlib.nullcontext, "float32"
        for hook in self._all_hooks():
            autocast = getattr(hook, "inference_autocast", None)
            if callable(autocast):
                label = getattr(hook, "precision_name", None) or str(
                    getattr(hook, "dtype", "mixed")
                ).replace("torch.", "")
                return functools.partial(autocast, device), label
        if mode == "always":
            raise RuntimeError(
                "ValidationConfig(use_mixed_precision='always') requires a MixedPrecisionHook "
                "(or a hook with inference_autocast(device)) registered with the strategy."
            )
        return contextlib.nullcontext, "float32"

    # ------------------------------------------------------------------ specs
    def to_spec_dict(self) -> dict[str, Any]:
        """JSON-ready spec (optimizers, duration, devices, loss, model specs, training_fn)."""
        from nvalchemi.training import _strategy_spec

        return _strategy_spec.to_spec_dict(self)

    def to_checkpoint_dict(self) -> dict[str, Any]:
        """:meth:`to_spec_dict` + ``strategy_cls`` + ``runtime_state`` (no file I/O)."""
        from nvalchemi.training import _strategy_spec

        return _strategy_spec.to_checkpoint_dict(self)

    @classmethod
    def from_spec_dict(
        cls,
        spec: Mapping[str, Any],
        *,
        models: Any = None,
        hooks: list[Any] | None = None,
        training_fn: Any = None,
        trust: bool = False,
        **overrides: Any,
    ) -> TrainingStrategy:
        """Rebuild a strategy from :meth:`to_spec_dict`; ``models``/``hooks``/``training_fn`` override."""
        from nvalchemi.training import _strategy_spec

        return _strategy_spec.from_spec_dict(
            cls, spec, models=models, hooks=hooks, training_fn=training_fn, trust=trust, **overrides
        )

    @classmethod
    def from_checkpoint_dict(
        cls,
        spec: Mapping[str, Any],
        *,
        models: Any = None,
        hooks: list[Any] | None = None,
        training_fn: Any = None,
        trust: bool = False,
        **overrides: Any,
    ) -> TrainingStrategy:
        """Rebuild the saved strategy class from :meth:`to_checkpoint_dict` and its counters."""
        from nvalchemi.training import _strategy_spec

        return _strategy_spec.from_checkpoint_dict(
            cls, spec, models=models, hooks=hooks, training_fn=training_fn, trust=trust, **overrides
        )

    # ------------------------------------------------------------------ checkpoint files
    def save_checkpoint(
        self, root_folder: Any, *, checkpoint_index: int = -1, **kwargs: Any
    ) -> int:
        """Write a restartable checkpoint (see :mod:`nvalchemi.training.checkpoint`)."""
        from nvalchemi.training.checkpoint.save import save_checkpoint

        return save_checkpoint(
            root_folder, strategy=self, checkpoint_index=checkpoint_index, **kwargs
        )

    def restore_checkpoint(
        self, root_folder: Any, checkpoint_index: Any = -1, map_location: Any = None, **kwargs: Any
    ) -> Mapping[str, Any]:
        """Load a checkpoint into this strategy in place."""
        from nvalchemi.training.checkpoint.load import strategy_restore_checkpoint

        return strategy_restore_checkpoint(
            self, root_folder, checkpoint_index, map_location, **kwargs
        )

    @classmethod
    def load_checkpoint(
        cls, root_folder: Any, checkpoint_index: Any = -1, map_location: Any = None, **kwargs: Any
    ) -> TrainingStrategy:
        """Rebuild a strategy from a checkpoint and restore its state (resume)."""
        from nvalchemi.training.checkpoint.load import strategy_load_checkpoint

        return strategy_load_checkpoint(cls, root_folder, checkpoint_index, map_location, **kwargs)

    def __repr_args__(self) -> Any:
        for name in ("num_epochs", "num_steps", "step_count", "epoch_count", "nonfinite_loss"):
            yield name, getattr(self, name)
        yield "models", {k: type(m).__name__ for k, m in self.models.items()}
        yield "hooks", [type(h).__name__ for h in self.hooks]
