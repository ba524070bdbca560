"""The loading half of :mod:`nvalchemi.training.checkpoint`: strategies, components, adapters.

* :func:`build_strategy` rebuilds the saved strategy class from its recipe (models from
  their spec files, overrides applied), :func:`restore_into` loads the checkpoint into it;
* :func:`load_components` rebuilds models, optimizers and schedulers without a strategy;
* :func:`load_adapter` imports foreign model files (MACE);
* :func:`ema_weights` finds an ``EMAHook``'s averaged weights in saved hook states.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvalchemi._serialization import UnsafeImportError
from nvalchemi.training._checkpoint_files import read_json, safe_torch_load
from nvalchemi.training._checkpoint_restore import (
    SCHEDULER_BASES,
    build_model,
    load_spec,
    restore_strategy,
)
from nvalchemi.training._checkpoint_state import checkpoint_state_of, history_event, hook_types

__all__ = ["build_strategy", "ema_weights", "load_adapter", "load_components", "restore_into"]


def restore_into(strategy, paths, manifest, map_location, validators, trust, allow, approved):
    from nvalchemi.distributed.runtime import get_rank

    info = restore_strategy(
        strategy,
        paths,
        map_location=map_location,
        trust=trust,
        allow_spec_changes=allow,
        approved=approved,
        rank=get_rank(strategy.distributed_manager),
    )
    models = strategy.unwrapped_models()
    out_models = {}
    for name in paths.entry.models:
        try:
            spec: Any = load_spec(paths.spec("models", name), trust=trust, expect=None)
        except UnsafeImportError:  # a user model outside the allow-list: report the JSON
            spec = read_json(paths.spec("models", name), "spec file")
        out_models[name] = {
            "model": models[name],
            "spec": spec,
            "optimizers": {},
            "schedulers": {},
            "metadata": {"associations": manifest.associations.get(name, {})},
        }
    run_validators(validators, out_models, paths.root)
    return {
        "strategy": strategy,
        "models": out_models,
        "manifest": manifest,
        "checkpoint_index": paths.entry.index,
        "source": {"format": "native", "path": str(paths.root)},
        "strategy_metadata": info["metadata"],
        "spec_changes": info["spec_changes"],
    }


def build_strategy(cls, paths, meta, map_location, hooks, training_fn, trust, overrides):
    """Rebuild the saved strategy (models from their spec files, no weights yet)."""
    if not isinstance(meta, Mapping):
        raise ValueError(f"strategy metadata of checkpoint {paths.entry.index} must be an object.")
    meta, approved, kwargs, record = _apply_overrides(dict(meta), overrides)
    devices = meta.get("devices") or ["cpu"]
    device = torch.device(map_location) if map_location is not None else torch.device(devices[0])
    if map_location is None and device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"Checkpoint {paths.entry.index} in {paths.root} was saved on {device}, which is not "
            "available here; pass map_location='cpu' (or another device)."
        )
    if map_location is not None:
        meta["devices"] = [str(map_location)]
    models = {}
    for name in paths.entry.models:
        spec = load_spec(paths.spec("models", name), trust=trust, expect=nn.Module)
        models[name] = build_model(spec, device)
    single = bool(meta.get("single_model_input")) and set(models) == {"main"}
    strategy = cls.from_checkpoint_dict(
        {**meta, "model_specs": {}},
        models=models["main"] if single else models,
        hooks=hooks,
        training_fn=training_fn,
        trust=trust,
        **kwargs,
    )
    if not isinstance(strategy, cls):
        raise TypeError(
            f"Loaded strategy has type {type(strategy).__name__}, expected {cls.__name__}."
        )
    if record:
        checkpoint_state_of(strategy)["history"].append(
            history_event("resume_overrides", from_index=paths.entry.index, overrides=record)
        )
    _warn_missing_runtime_parts(meta, strategy)
    return strategy, approved


def _warn_missing_runtime_parts(meta: Mapping[str, Any], strategy: Any) -> None:
    """Hooks and the validation config are not saved: say so when a resume lacks them."""
    missing = sorted(set(meta.get("hook_types") or []) - set(hook_types(strategy.hooks)))
    if missing:
        warnings.warn(
            f"The saved run used hooks {missing} that were not passed to the resumed strategy "
            "(hooks are not stored in checkpoints); pass them with hooks=[...] to keep e.g. "
            "checkpointing, EMA and early stopping going.",
            UserWarning,
            stacklevel=4,
        )
    if meta.get("validation_configured") and strategy.validation_config is None:
        warnings.warn(
            "The saved run validated but the resumed strategy has no validation_config (it is "
            "not stored in checkpoints); pass overrides={'validation_config': "
            "ValidationConfig(...)} to validate (and step metric schedulers) as before.",
            UserWarning,
            stacklevel=4,
        )


def _apply_overrides(meta: dict, overrides: Mapping[str, Any] | None):
    """Merge ``overrides`` into the saved recipe; return (meta, approved patterns, kwargs, record)."""
    from nvalchemi._serialization import encode_value

    overrides = dict(overrides or {})
    approved: list[str] = []
    record: dict[str, Any] = {}
    for key, kind in (("optimizer_kwargs", "optimizers"), ("scheduler_kwargs", "schedulers")):
        values = overrides.pop(key, None)
        if not values:
            continue
        if not isinstance(values, Mapping):
            raise TypeError(f"overrides[{key!r}] must be a mapping of keyword arguments.")
        encoded = encode_value(dict(values))
        configs = {k: [dict(c) for c in v] for k, v in meta["optimizer_configs"].items()}
        for entries in configs.values():
            for config in entries:
                if kind == "schedulers" and not config.get("scheduler_cls"):
                    continue
                config[key] = {**(config.get(key) or {}), **encoded}
        meta["optimizer_configs"] = configs
        record[key] = encoded
        for name in values:
            approved += [f"{kind}/*.{name}", f"{kind}/*.{name}[[]*", f"{kind}/*.{name}.*"]
    if "optimizer_configs" in overrides:
        approved += ["optimizers/*", "schedulers/*"]
        record["optimizer_configs"] = "replaced"
    for key, value in overrides.items():
        try:
            record.setdefault(key, encode_value(value))
        except TypeError:
            record.setdefault(key, f"<{type(value).__name__}>")
    return meta, tuple(approved), overrides, record


def load_components(paths, manifest, map_location, model_names, trust, validators, has_metadata):
    entry = paths.entry
    names = list(entry.models) if model_names is None else list(model_names)
    unknown = sorted(set(names) - set(entry.models))
    if unknown:
        raise KeyError(f"Unknown model(s) {unknown}. Available: {sorted(entry.models)}")
    associations = manifest.associations
    if paths.associations().is_file():
        associations = read_json(paths.associations(), "associations.json")
    models: dict[str, tuple[nn.Module, Any]] = {}
    for name in names:
        spec = load_spec(paths.spec("models", name), trust=trust, expect=nn.Module)
        model = build_model(spec, map_location)
        model.load_state_dict(safe_torch_load(paths.state("models", name), map_location))
        models[name] = (model, spec)
    wanted = set(entry.optimizers)
    wanted_s = set(entry.schedulers)
    if model_names is not None:
        wanted = {o for n in names for o in associations.get(n, {}).get("optimizers", [])}
        wanted_s = {s for n in names for s in associations.get(n, {}).get("schedulers", [])}
    optimizers: dict[str, tuple[Any, Any]] = {}
    for opt in sorted(wanted & set(entry.optimizers)):
        spec = load_spec(paths.spec("optimizers", opt), trust=trust, expect=torch.optim.Optimizer)
        optimizer = spec.build(_optimizer_params(opt, associations, models))
        optimizer.load_state_dict(safe_torch_load(paths.state("optimizers", opt), map_location))
        optimizers[opt] = (optimizer, spec)
    schedulers: dict[str, tuple[Any, Any]] = {}
    for sched in sorted(wanted_s & set(entry.schedulers)):
        spec = load_spec(paths.spec("schedulers", sched), trust=trust, expect=SCHEDULER_BASES)
        optimizer = _scheduler_optimizer(sched, associations, optimizers)
        scheduler = spec.build(optimizer)
        scheduler.load_state_dict(safe_torch_load(paths.state("schedulers", sched), map_location))
        schedulers[sched] = (scheduler, spec)
    per_model = {}
    for name, (model, spec) in models.items():
        assoc = associations.get(name, {})
        per_model[name] = {
            "model": model,
            "spec": spec,
            "optimizers": {
                o: {"optimizer": optimizers[o][0], "spec": optimizers[o][1]}
                for o in assoc.get("optimizers", [])
                if o in optimizers
            },
            "schedulers": {
                s: {"scheduler": schedulers[s][0], "spec": schedulers[s][1]}
                for s in assoc.get("schedulers", [])
                if s in schedulers
            },
            "metadata": {"associations": assoc},
        }
    run_validators(validators, per_model, paths.root)
    if not has_metadata and model_names is None:
        return manifest.model_copy(
            update={"models": models, "optimizers": optimizers, "schedulers": schedulers}
        )
    return {
        "strategy": None,
        "models": per_model,
        "manifest": manifest,
        "checkpoint_index": entry.index,
        "source": {"format": "native", "path": str(paths.root)},
        "strategy_metadata": read_json(paths.strategy(), "strategy metadata")
        if has_metadata
        else None,
    }


def _optimizer_params(name: str, associations: Mapping[str, Any], models: Mapping[str, Any]) -> Any:
    named = {f"{k}.{n}": p for k, (m, _) in models.items() for n, p in m.named_parameters()}
    for assoc in associations.values():
        groups = (assoc.get("optimizer_param_groups") or {}).get(name)
        flat = (assoc.get("optimizer_parameter_names") or {}).get(name)
        if groups is None and flat is not None:
            groups = [flat]
        if groups is not None:
            missing = sorted({n for g in groups for n in g} - set(named))
            if missing:
                raise ValueError(
                    f"Optimizer {name!r} references missing parameter(s) {missing[:5]}; load the "
                    "models it optimizes (model_names=...)."
                )
            return [{"params": [named[n] for n in g]} for g in groups]
    owners = [k for k, a in associations.items() if name in a.get("optimizers", []) and k in models]
    if not owners and len(models) == 1:
        owners = list(models)
    if not owners:
        raise ValueError(
            f"Cannot determine which model's parameters to use for optimizer {name!r}; record "
            "associations={model: {'optimizers': [...]}} when saving."
        )
    return [p for k in owners for p in models[k][0].parameters()]


def _scheduler_optimizer(name: str, associations: Mapping[str, Any], optimizers: Mapping[str, Any]):
    for assoc in associations.values():
        opt = (assoc.get("scheduler_optimizers") or {}).get(name)
        if opt is not None and opt in optimizers:
            return optimizers[opt][0]
        if name in assoc.get("schedulers", []):
            position = assoc["schedulers"].index(name)
            opts = assoc.get("optimizers", [])
            if position < len(opts) and opts[position] in optimizers:
                return optimizers[opts[position]][0]
    if len(optimizers) == 1:
        return next(iter(optimizers.values()))[0]
    raise ValueError(f"Cannot determine the optimizer of scheduler {name!r}.")


def run_validators(validators: Any, per_model: Mapping[str, Any], root: Path) -> None:
    """Call each checkpoint validator on each loaded model; re-raise as ``ValueError``."""
    if not validators:
        return
    items = (
        list(validators.items())
        if isinstance(validators, Mapping)
        else [(getattr(v, "__name__", type(v).__name__), v) for v in validators]
    )
    for model_name, entry in per_model.items():
        for label, validator in items:
            try:
                validator(model_name, entry, entry["model"])
            except Exception as exc:
                raise ValueError(
                    f"Checkpoint validator {label!r} failed for model {model_name!r} loaded from "
                    f"{root}: {exc}"
                ) from exc


_MACE_KEYS = {
    "model_name": "main",
    "dtype": None,
    "enable_cueq": False,
    "compile_model": False,
    "compile_kwargs": {},
}


def load_adapter(path: Any, adapter: str, kwargs: Mapping[str, Any], map_location: Any) -> dict:
    if adapter != "mace":
        raise ValueError(f"Unsupported checkpoint adapter {adapter!r}; supported: ['mace']")
    unknown = sorted(set(kwargs) - set(_MACE_KEYS))
    if unknown:
        raise ValueError(
            f"Unknown adapter_kwargs {unknown} for adapter 'mace'; allowed: {sorted(_MACE_KEYS)}"
        )
    options = {**_MACE_KEYS, **kwargs}
    if not isinstance(options["compile_kwargs"], Mapping):
        raise TypeError("adapter_kwargs['compile_kwargs'] must be a mapping.")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"MACE model file {file} does not exist.")
    from nvalchemi.models.mace import MACEWrapper

    model = MACEWrapper.from_checkpoint(
        file, map_location=map_location or "cpu", dtype=options["dtype"]
    )
    name = options["model_name"]
    return {
        "strategy": None,
        "models": {
            name: {"model": model, "spec": None, "optimizers": {}, "schedulers": {}, "metadata": {}}
        },
        "manifest": None,
        "checkpoint_index": None,
        "source": {"format": "mace", "path": str(file)},
        "metadata": {"adapter": "mace"},
        "spec": None,
    }


def ema_weights(states: Any, model_key: str) -> dict[str, torch.Tensor] | None:
    """The averaged weights of ``model_key`` from saved hook states (EMAHook format).

    ``None`` (use the trained weights) when no average is saved, or when it has had no
    update yet: such a shadow is not an average (checkpoints written before the shadow
    tracked the live weights hold the untrained initial weights there).
    """
    if isinstance(states, Mapping):
        averaged = states.get("averaged_model_state")
        if (
            isinstance(averaged, Mapping)
            and states.get("model_key", "main") == model_key
            and _ema_updates(states, averaged) != 0
        ):
            return {k.removeprefix("module."): v for k, v in averaged.items() if k != "n_averaged"}
        for value in states.values():
            found = ema_weights(value, model_key)
            if found is not None:
                return found
    return None


def _ema_updates(states: Mapping[str, Any], averaged: Mapping[str, Any]) -> int | None:
    """The saved EMA update count (``num_updates``, else ``n_averaged``); ``None`` if unknown."""
    count = states.get("num_updates")
    if count is None:
        count = averaged.get("n_averaged")
    if isinstance(count, torch.Tensor) and count.numel() == 1:
        return int(count)
    return count if isinstance(count, int) and not isinstance(count, bool) else None
