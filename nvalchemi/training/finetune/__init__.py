"""Fine-tuning: a new training run that starts from pretrained weights.

The package is fine-tuning, one module per idea:

* here, :class:`FineTuningStrategy`: a :class:`~nvalchemi.training.TrainingStrategy` that
  adds readout heads, patches modules and chooses the trained parameters (see the class
  docstring), and its entry points;
* :mod:`.hooks`: the hooks it generates (new heads, module patches, parameter filters)
  and :class:`~nvalchemi.training.finetune.hooks.ForgettingHook`;
* :mod:`.weights`: a plain ``state_dict`` loaded into your model (key maps, DDP prefixes);
* :mod:`.statistics`: reference energies, scale and shift for the new data;
* :mod:`.parity`: the zero-step check (the fine-tune predicts what its source predicts);
* :mod:`.replay`: replay data against forgetting.

Guide: ``docs/finetuning.md``. The entry
points :meth:`~FineTuningStrategy.from_pretrained_checkpoint`,
:meth:`~FineTuningStrategy.from_pretrained_weights` and
:meth:`~FineTuningStrategy.from_mace` start at step 0 (``load_checkpoint`` resumes).
Their keyword arguments may also be a job file's ``strategy`` payload
(:meth:`FineTuningStrategy.to_spec_dict` shape): ``loss_fn_spec``, serialized
``optimizer_configs`` and ``module_patches`` are rehydrated (through the import
allow-list unless ``trust=True``), ``training_fn`` may be a dotted path, an empty
``model_specs`` and ``single_model_input`` are ignored.

Example:
    >>> strategy = FineTuningStrategy.from_pretrained_checkpoint(  # doctest: +SKIP
    ...     "runs/pretrain/checkpoints",
    ...     use_original_loss=True, use_original_opt_class=True, optimizer_lr=1e-5,
    ...     trainable_patterns=("main.readout.*",), num_steps=500,
    ... )
    >>> strategy.run(finetune_loader)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn

from nvalchemi._serialization import requires_trust
from nvalchemi.checkpoint_files import open_entry, read_models
from nvalchemi.training.checkpoint.load import load_result, model_entry, run_validators
from nvalchemi.training.finetune.hooks import (
    AddHeadHook,
    ForgettingHook,
    ModulePatchHook,
    TrainableParameterHook,
)
from nvalchemi.training.finetune.weights import load_plain_weights
from nvalchemi.training.optimizers import OptimizerConfig
from nvalchemi.training.strategy import TrainingStrategy
from nvalchemi.training.strategy_payload import build_loss, build_optimizer_configs, parse_spec

__all__ = ["FineTuningStrategy"]


class FineTuningStrategy(TrainingStrategy):
    """A training strategy for fine-tuning: new heads, module patches and parameter freezing.

    The fine-tuning fields are read at construction and become hooks placed before
    ``hooks`` (:class:`~nvalchemi.training.hooks.AddHeadHook`,
    :class:`~nvalchemi.training.hooks.ModulePatchHook`, then
    :class:`~nvalchemi.training.hooks.TrainableParameterHook`), so the user's hooks see
    the patched models and the filtered parameters; ``ForgettingHook`` entries of
    ``hooks`` follow them, ahead of the reporters. Parameter names never include DDP's
    ``module.`` prefix, so the patterns keep matching when ``DDPHook`` wraps the models.

    Args (besides those of :class:`~nvalchemi.training.TrainingStrategy`):
        new_heads: ``{"<head>": copy_from}`` (model ``"main"``) or
            ``{"<model key>.<head>": copy_from}``: readout heads to add, each a copy of
            head ``copy_from`` (``None``: the first); their parameters are e.g.
            ``"main.head_readouts.<head>.*"`` (PaiNN).
        module_patches: ``{"<model key>.<path>.<child>": spec_or_module}``; only
            :class:`BaseSpec` values can be written to specs and checkpoints.
        freeze_patterns / trainable_patterns / freeze_mode: which parameters train (see
            ``TrainableParameterHook``; ``"main.model.joint_mlp.*"``).

    Example:
        >>> import torch
        >>> from nvalchemi.models.demo import DemoModel, DemoModelWrapper
        >>> from nvalchemi.training import EnergyMSELoss, OptimizerConfig
        >>> strategy = FineTuningStrategy(
        ...     models=DemoModelWrapper(DemoModel(hidden_dim=8)),
        ...     optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-4}),
        ...     loss_fn=EnergyMSELoss(),
        ...     num_steps=10,
        ...     trainable_patterns=("main.model.projection.*",),
        ... )
        >>> [type(h).__name__ for h in strategy.hooks]
        ['TrainableParameterHook']
    """

    new_heads: dict[str, str | None] = Field(default_factory=dict)
    module_patches: dict[str, Any] = Field(default_factory=dict)
    freeze_patterns: tuple[str, ...] = ()
    trainable_patterns: tuple[str, ...] = ()
    freeze_mode: Literal["requires_grad", "optimizer_only"] = "requires_grad"

    @model_validator(mode="before")
    @classmethod
    def _prepend_generated_hooks(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        generated: list[Any] = []
        heads = data.get("new_heads") or {}
        if heads:
            head_hook = AddHeadHook(heads=heads)
            data["new_heads"] = dict(head_hook.heads)
            generated.append(head_hook)
        patches = data.get("module_patches") or {}
        if patches:
            patch_hook = ModulePatchHook(patches=patches)
            data["module_patches"] = dict(patch_hook.patches)
            generated.append(patch_hook)
        freeze = pattern_tuple(data.get("freeze_patterns"), "freeze_patterns")
        trainable = pattern_tuple(data.get("trainable_patterns"), "trainable_patterns")
        data["freeze_patterns"], data["trainable_patterns"] = freeze, trainable
        if freeze or trainable:
            generated.append(
                TrainableParameterHook(
                    freeze_patterns=freeze,
                    trainable_patterns=trainable,
                    freeze_mode=data.get("freeze_mode", "requires_grad"),
                )
            )
        hooks = data.get("hooks")
        if isinstance(hooks, (list, tuple)):
            # Forgetting numbers join the validation summary: before the reporters see it.
            forgetting = [h for h in hooks if isinstance(h, ForgettingHook)]
            generated += forgetting
            hooks = [h for h in hooks if not isinstance(h, ForgettingHook)]
        if generated and (hooks is None or isinstance(hooks, (list, tuple))):
            data["hooks"] = [*generated, *(hooks or [])]
        return data

    @field_validator("new_heads", "module_patches", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return {} if value is None else value

    @classmethod
    def from_pretrained_checkpoint(
        cls,
        checkpoint_dir: str | Path,
        *,
        checkpoint_index: int | str = -1,
        map_location: Any = None,
        validators: Any = None,
        use_original_loss: bool = False,
        use_original_opt_class: bool = False,
        optimizer_lr: float | None = 1e-5,
        use_ema_weights: bool = False,
        trust: bool = False,
        **strategy_kwargs: Any,
    ) -> FineTuningStrategy:
        """A NEW run (counters at 0) from the model weights of a native checkpoint.

        Models are rebuilt from their saved specs with their weights (EMA weights with
        ``use_ema_weights=True`` where saved) on ``map_location`` (``None``: the CPU, never
        the source run's device), checked by ``validators``
        (:class:`~nvalchemi.training.checkpoint.CheckpointValidator`); saved optimizer
        states, counters, hooks and validation settings are not used. One model saved as
        ``"main"`` is passed as a single model, several as a mapping (keys kept).
        ``use_original_loss=True`` uses the checkpoint's loss and
        ``use_original_opt_class=True`` its optimizer configs (classes, kwargs, schedulers,
        parameter groups) with ``lr=optimizer_lr`` (group rates scaled alike; ``None`` keeps
        the saved rates); a ``loss_fn``/``loss_fn_spec``/``optimizer_configs`` passed as well
        is ignored with a warning (so a job file's template cannot cancel a flag). Without
        the flags, ``loss_fn`` (or ``loss_fn_spec``) and ``optimizer_configs`` are required.

        Args:
            checkpoint_dir: checkpoint root written by ``save_checkpoint``/``CheckpointHook``.
            checkpoint_index: an index, ``-1``/``"latest"`` or ``"best"``.
            trust: allow specs outside the import allow-list (trusted checkpoints only).
            **strategy_kwargs: :class:`FineTuningStrategy` fields (``num_steps``,
                ``trainable_patterns``, ``hooks``, ``devices``, ...) or a job payload (see
                the module docstring); ``devices`` defaults to ``[map_location]`` if given.

        Raises:
            ValueError: ``models`` (or a non-empty ``model_specs``) or counters were
                passed; the checkpoint has no models; a reuse flag without strategy
                metadata; no loss or optimizer configs.
        """
        kwargs = dict(strategy_kwargs)
        reject_new_run_conflicts(
            kwargs,
            "from_pretrained_checkpoint",
            "from_pretrained_checkpoint loads models from checkpoint_dir; do not pass "
            "models=... (use from_pretrained_weights(model, weights) for your own model).",
        )
        files = open_entry(checkpoint_dir, checkpoint_index)
        root, entry = files.root, files.entry
        names = list(entry.models)
        if not names:
            raise ValueError(
                f"Checkpoint {entry.index} in {root} holds no models to fine-tune from."
            )
        meta = files.strategy_data()
        apply_reuse(kwargs, meta, use_original_loss, use_original_opt_class, optimizer_lr, trust)
        kwargs = rehydrate_payload(kwargs, trust, "from_pretrained_checkpoint")
        device = torch.device(map_location) if map_location is not None else torch.device("cpu")
        read = read_models(files, names, device, use_ema=use_ema_weights, trust=trust)
        loaded = {name: model for name, (model, _) in read.items()}
        if validators:
            assoc = files.manifest.associations
            entries = {
                name: model_entry(model, spec, assoc.get(name, {}))
                for name, (model, spec) in read.items()
            }
            run_validators(validators, load_result(files, entries), root)
        for model in loaded.values():
            model.train()
        single = names == ["main"] and bool((meta or {}).get("single_model_input", True))
        if map_location is not None:
            kwargs.setdefault("devices", [device])
        return cls(models=loaded["main"] if single else loaded, **kwargs)

    @classmethod
    def from_pretrained_weights(
        cls,
        model: nn.Module | Mapping[str, nn.Module],
        weights: str | os.PathLike | Mapping[str, Any],
        *,
        strict: bool = True,
        key_map: Mapping[str, str] | None = None,
        model_key: str | None = None,
        trust: bool = False,
        **strategy_kwargs: Any,
    ) -> FineTuningStrategy:
        """A new run with ``weights`` (a ``state_dict``) loaded into ``model``.

        ``weights`` is a file read with ``torch.load(weights_only=True)`` (no pickled code
        runs) or a mapping; a container holding it under ``"state_dict"``,
        ``"model_state_dict"`` or ``"model"`` is unpacked, and keys all starting with DDP's
        ``"module."`` are stripped.

        Args:
            model: the model to fine-tune, built with the weights' architecture; or a
                mapping of models, ``model_key`` naming the one that receives the weights
                (default ``"main"`` or the only one).
            strict: every model key must be loaded and every weight used (``ValueError``
                listing the differences); ``False`` loads the matching keys and warns.
            key_map: key prefixes renamed first (``{"backbone.": "model."}``; ``{"": "model."}``
                adds a prefix, an empty value removes one; the longest match wins).
            **strategy_kwargs: as for :meth:`from_pretrained_checkpoint` (a loss and
                optimizer configs are required).

        Example:
            >>> strategy = FineTuningStrategy.from_pretrained_weights(  # doctest: +SKIP
            ...     PaiNN(cutoff=5.0, hidden_channels=64), "painn_weights.pt",
            ...     loss_fn=EnergyMSELoss() + ForceMSELoss(),
            ...     optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-4}),
            ...     trainable_patterns=("main.readout.*",), num_steps=200)
        """
        reject_new_run_conflicts(
            strategy_kwargs,
            "from_pretrained_weights",
            "from_pretrained_weights takes the model as its first argument; do not also "
            "pass models=....",
        )
        load_plain_weights(model, weights, strict=strict, key_map=key_map, model_key=model_key)
        kwargs = rehydrate_payload(strategy_kwargs, trust, "from_pretrained_weights")
        return cls(models=model, **kwargs)

    @classmethod
    @requires_trust  # unpickles model files: specs may name it only with trust=True
    def from_mace(
        cls,
        source: Any,
        *,
        map_location: Any = "cpu",
        dtype: str | torch.dtype | None = None,
        atomic_energies: Mapping[int | str, float] | None = None,
        trust: bool = False,
        **strategy_kwargs: Any,
    ) -> FineTuningStrategy:
        """A new run from a mace-torch model: a model file, a MACE module or a ``MACEWrapper``.

        Model files are unpickled by :meth:`MACEWrapper.from_checkpoint
        <nvalchemi.models.mace.MACEWrapper.from_checkpoint>`: only load files you trust.
        ``atomic_energies`` overrides the reference energies ``E0`` (files only). Names start
        with ``"main.model."`` (heads: ``"main.model.readouts.*"``). A wrapper around a MACE
        module object cannot be rebuilt from a checkpoint, so its strategy checkpoints fail;
        pass the file instead.

        Example:
            >>> strategy = FineTuningStrategy.from_mace(  # doctest: +SKIP
            ...     "mace-small.model", trainable_patterns=("main.model.readouts.*",),
            ...     loss_fn=EnergyMSELoss() + ForceMSELoss(),
            ...     optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-5}),
            ...     num_steps=200)
        """
        from nvalchemi.models.mace import MACEWrapper  # optional

        reject_new_run_conflicts(
            strategy_kwargs,
            "from_mace",
            "from_mace builds the model from `source`; do not pass models=....",
        )
        if isinstance(source, (str, os.PathLike)):
            wrapper = MACEWrapper.from_checkpoint(
                source, map_location=map_location, dtype=dtype, atomic_energies=atomic_energies
            )
        elif isinstance(source, nn.Module):
            if atomic_energies:
                raise ValueError(
                    "from_mace: atomic_energies applies to model files only; set the E0 of a "
                    "model object before passing it."
                )
            wrapper = source if isinstance(source, MACEWrapper) else MACEWrapper(source)
            if dtype is not None:
                wrapper = wrapper.to(getattr(torch, str(dtype).removeprefix("torch.")))
            if map_location is not None:
                wrapper = wrapper.to(map_location)
        else:
            raise TypeError(
                "from_mace: source must be a MACE model file path, a mace-torch model or a "
                f"MACEWrapper; got {type(source).__name__}."
            )
        kwargs = rehydrate_payload(strategy_kwargs, trust, "from_mace")
        return cls(models=wrapper.train(), **kwargs)


# ---------------------------------------------------------------------------- helpers
_COUNTERS = (
    "step_count",
    "global_step_count",
    "batch_count",
    "epoch_count",
    "epoch_step_count",
    "epoch",
    "runtime_state",
)


def pattern_tuple(value: Any, field: str) -> tuple[str, ...]:
    """Patterns as a tuple (``None`` -> ``()``, one string -> 1-tuple); ``ValueError`` otherwise."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise ValueError(f"{field} must be a list of pattern strings; got {value!r}.")
    return tuple(value)


def load_patches(value: Any, trust: bool) -> dict[str, Any]:
    """``module_patches`` with spec JSON dicts rehydrated (allow-listed unless ``trust``)."""
    if not value:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"'module_patches' must map targets to module specs; got {type(value).__name__}."
        )
    return {
        target: parse_spec(patch, f"module_patches.{target}", trust)
        if isinstance(patch, Mapping)
        else patch
        for target, patch in value.items()
    }


def reject_new_run_conflicts(kwargs: Mapping[str, Any], who: str, models_error: str) -> None:
    """``ValueError`` for ``models``, counters or a non-empty ``model_specs`` in a new run's kwargs."""
    if "models" in kwargs:
        raise ValueError(models_error)
    counters = sorted(k for k in _COUNTERS if k in kwargs)
    if counters:
        raise ValueError(
            f"{who} starts a new run at step 0; got {counters}. To continue a run use "
            "FineTuningStrategy.load_checkpoint(...) / TrainingStrategy.load_checkpoint(...)."
        )
    if kwargs.get("model_specs"):
        raise ValueError(
            f"{who} supplies the models itself; remove 'model_specs' from the strategy payload "
            f"(got {sorted(kwargs['model_specs'])})."
        )


def apply_reuse(
    kwargs: dict[str, Any],
    meta: Mapping[str, Any] | None,
    use_loss: bool,
    use_opt: bool,
    lr: float | None,
    trust: bool,
) -> None:
    """Fill ``loss_fn``/``optimizer_configs`` from the checkpoint's recipe (flags win)."""
    wanted = [
        name for name, flag in (("loss_fn", use_loss), ("optimizer_configs", use_opt)) if flag
    ]
    if not wanted:
        return
    if meta is None:
        raise ValueError(
            f"Cannot reuse original {', '.join(wanted)} because checkpoint has no strategy "
            "metadata."
        )
    if use_loss:
        _drop_overridden(kwargs, ("loss_fn", "loss_fn_spec"), "use_original_loss")
        if "loss_fn_spec" not in meta:
            raise ValueError(
                "Cannot reuse original loss_fn: the checkpoint's strategy metadata has no "
                "loss_fn_spec. Pass loss_fn=... instead."
            )
        kwargs["loss_fn"] = build_loss(meta["loss_fn_spec"], "checkpoint loss_fn_spec", trust)
    if use_opt:
        _drop_overridden(kwargs, ("optimizer_configs",), "use_original_opt_class")
        configs = build_optimizer_configs(
            meta.get("optimizer_configs") or {}, trust, "checkpoint optimizer_configs"
        )
        if not configs:
            raise ValueError(
                "Cannot reuse original optimizer_configs: the checkpoint's strategy metadata "
                "has none. Pass optimizer_configs=... instead."
            )
        if lr is not None:
            configs = {k: [_with_lr(c, float(lr)) for c in v] for k, v in configs.items()}
        kwargs["optimizer_configs"] = configs


def _drop_overridden(kwargs: dict[str, Any], keys: tuple[str, ...], flag: str) -> None:
    given = [k for k in keys if kwargs.pop(k, None) is not None]
    if given:
        warnings.warn(
            f"{flag}=True: ignoring the {' and '.join(given)} passed as well; the checkpoint's "
            f"recipe is used. Set {flag}=False to use yours.",
            UserWarning,
            stacklevel=4,
        )


def _with_lr(config: OptimizerConfig, lr: float) -> OptimizerConfig:
    fields = {name: getattr(config, name) for name in OptimizerConfig.model_fields}
    old = config.optimizer_kwargs.get("lr")
    fields["optimizer_kwargs"] = {**config.optimizer_kwargs, "lr": lr}
    if config.param_groups:
        factor = lr / old if isinstance(old, (int, float)) and old else None
        fields["param_groups"] = [
            {**g, "lr": (g["lr"] * factor if factor is not None else lr)} if "lr" in g else dict(g)
            for g in config.param_groups
        ]
    return OptimizerConfig(**fields)


def rehydrate_payload(kwargs: Mapping[str, Any], trust: bool, who: str) -> dict[str, Any]:
    """Turn job-payload keys (spec dumps) into constructor arguments."""
    out = dict(kwargs)
    out.pop("model_specs", None)
    out.pop("single_model_input", None)  # the call mode follows the models supplied
    if "loss_fn_spec" in out:
        spec = out.pop("loss_fn_spec")
        if out.get("loss_fn") is not None:
            raise ValueError(f"{who}: pass loss_fn or loss_fn_spec, not both.")
        out["loss_fn"] = build_loss(spec, "loss_fn_spec", trust)
    configs = out.get("optimizer_configs")
    if isinstance(configs, Mapping) and any(
        isinstance(v, list) and any(isinstance(c, Mapping) for c in v) for v in configs.values()
    ):
        out["optimizer_configs"] = build_optimizer_configs(configs, trust)
    if "module_patches" in out:
        out["module_patches"] = load_patches(out["module_patches"], trust)
    missing = [k for k in ("loss_fn", "optimizer_configs") if out.get(k) is None]
    if missing:
        reuse = {"loss_fn": "use_original_loss", "optimizer_configs": "use_original_opt_class"}
        asks = [
            f"{k}=..." + (f" (or {reuse[k]}=True)" if who == "from_pretrained_checkpoint" else "")
            for k in missing
        ]
        raise ValueError(f"{who} needs {' and '.join(asks)}.")
    return out
