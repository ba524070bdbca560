"""The one load routine: :func:`load_checkpoint` and the strategy loaders built on it.

``TrainingStrategy.load_checkpoint`` is :func:`strategy_load_checkpoint` and
``restore_checkpoint`` is :func:`strategy_restore_checkpoint`: a strategy is rebuilt from
its recipe (``strategy.json``, by :class:`~nvalchemi.training.strategy_payload.StrategyPayload`;
models from their specs) and then restored through the table of
:mod:`nvalchemi.training.checkpoint.parts`, which applies the counters once. Every file
is read once: the manifest opens the entry, whose
:class:`~nvalchemi.checkpoint_files.EntryFiles` keeps each JSON file it read and
each ``spec.json`` rehydrated through the trust rule of :mod:`nvalchemi.spec` (where every
dotted path a file names is checked).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from nvalchemi._serialization import encode_value
from nvalchemi.checkpoint_files import (
    CheckpointManifest,
    build_model,
    open_entry,
    read_json,
    safe_torch_load,
)
from nvalchemi.distributed.runtime import get_rank
from nvalchemi.training.checkpoint.parts import (
    RUN_RECORD,
    checkpoint_record,
    history_event,
    hook_types,
    optimizer_names,
    restore_strategy,
)
from nvalchemi.training.strategy_payload import strategy_class

__all__ = [
    "CheckpointValidator",
    "check_finite_weights",
    "load_checkpoint",
    "load_result",
    "model_entry",
    "read_strategy_metadata",
    "run_validators",
    "strategy_load_checkpoint",
    "strategy_restore_checkpoint",
]

Index = int | str
SCHEDULER_BASES: tuple[type, ...] = (
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
)


@runtime_checkable
class CheckpointValidator(Protocol):
    """Checks a model right after it was loaded: ``validator(model_name, entry, loaded)``.

    ``entry`` is ``{"model", "spec", "optimizers", "schedulers", "metadata"}`` of that model
    (``optimizers``: ``{name: {"optimizer", "spec"}}``, ``schedulers``: ``{name:
    {"scheduler", "spec"}}``), ``loaded`` the whole load result: ``{"strategy", "models",
    "manifest", "checkpoint_index", "source", ...}`` (``strategy`` is ``None`` for
    components; ``entry is loaded["models"][model_name]``). Raise to reject the checkpoint;
    the loader re-raises as ``ValueError`` naming the validator, the model and the path.
    Pass validators as a list or as ``{name: validator}``.

    Example:
        >>> def small(name, entry, loaded):
        ...     if sum(p.numel() for p in entry["model"].parameters()) > 10**9:
        ...         raise ValueError("too large")
        >>> isinstance(small, CheckpointValidator)
        True
    """

    def __call__(
        self, model_name: str, entry: Mapping[str, Any], loaded: Mapping[str, Any]
    ) -> None: ...


def check_finite_weights(
    model_name: str, entry: Mapping[str, Any], loaded: Mapping[str, Any]
) -> None:
    """A :class:`CheckpointValidator` that rejects NaN/inf parameters or buffers."""
    model = entry["model"]
    bad = [
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if bad:
        raise ValueError(f"non-finite values in {bad[:5]}")


def run_validators(validators: Any, loaded: Mapping[str, Any], root: Path) -> None:
    """Call each validator on each model entry of the load result ``loaded`` (see
    :class:`CheckpointValidator`); re-raise failures as ``ValueError``."""
    if not validators:
        return
    items = (
        list(validators.items())
        if isinstance(validators, Mapping)
        else [(getattr(v, "__name__", type(v).__name__), v) for v in validators]
    )
    for model_name, entry in loaded["models"].items():
        for label, validator in items:
            try:
                validator(model_name, entry, loaded)
            except Exception as exc:
                raise ValueError(
                    f"Checkpoint validator {label!r} failed for model {model_name!r} loaded from "
                    f"{root}: {exc}"
                ) from exc


def model_entry(model: nn.Module, spec: Any, assoc: Any) -> dict[str, Any]:
    """One model's entry of a load result (its optimizers and schedulers filled in later)."""
    return {
        "model": model,
        "spec": spec,
        "optimizers": {},
        "schedulers": {},
        "metadata": {"associations": assoc},
    }


def load_result(files: Any, models: dict[str, Any], strategy: Any = None) -> dict[str, Any]:
    """What a native load returns (and validators receive as ``loaded``)."""
    return {
        "strategy": strategy,
        "models": models,
        "manifest": files.manifest,
        "checkpoint_index": files.entry.index,
        "source": {"format": "native", "path": str(files.root)},
    }


def _saved_spec(files: Any, kind: str, name: str, trust: bool) -> Any:
    try:
        return files.load_spec(kind, name, trust=trust)
    except ValueError:  # e.g. a class outside the trust rule restored in place: the JSON
        return dict(files.spec_data(kind, name))


# ---------------------------------------------------------------------------- the loader
def load_checkpoint(
    root_folder: str | Path,
    checkpoint_index: Index = -1,
    map_location: Any = None,
    model_names: Sequence[str] | None = None,
    *,
    adapter: str | None = None,
    adapter_kwargs: Mapping[str, Any] | None = None,
    validators: Any = None,
    hooks: list[Any] | None = None,
    training_fn: Any = None,
    strategy: Any = None,
    trust: bool = False,
    overrides: Mapping[str, Any] | None = None,
    allow_spec_changes: bool = False,
) -> Any:
    """Load a checkpoint: as a new strategy, into a live strategy, or as components.

    Args:
        checkpoint_index: an index, ``-1``/``"latest"`` or ``"best"``.
        map_location: device for every tensor (default: the strategy's recorded device).
        model_names: load only these models and their optimizers/schedulers (no strategy).
        strategy: restore in place into this live strategy (its hooks receive their state).
        hooks / training_fn: for the rebuilt strategy (hooks are not saved; pass them
            again, e.g. ``[EMAHook(), CheckpointHook(...)]``, to restore their state).
        trust: lift the trust rule for this checkpoint's dotted paths (only for
            checkpoints you trust; tensor files are always read with ``weights_only=True``).
        overrides: changes for the rebuilt strategy: ``optimizer_kwargs`` /
            ``scheduler_kwargs`` (merged into every optimizer config),
            ``optimizer_configs`` (replaced), or constructor fields such as
            ``num_steps`` or ``validation_config``. Recorded in the manifest history.
        allow_spec_changes: accept a live strategy whose specs differ from the checkpoint.
        adapter: ``"mace"`` to import a MACE model file (pickle: trusted files only).

    Returns:
        For strategy checkpoints: ``{"strategy", "models": {name: {"model", "spec",
        "optimizers", "schedulers", "metadata"}}, "manifest", "checkpoint_index",
        "source", "strategy_metadata"}``. For component-only checkpoints, and with
        ``model_names``: the :class:`CheckpointManifest` whose ``models``/``optimizers``/
        ``schedulers`` map names to ``(object, spec)`` tuples.
    """
    if adapter is not None:
        if strategy is not None:
            raise ValueError("load_checkpoint: adapter=... cannot restore into a strategy.")
        return _load_adapter(root_folder, adapter, adapter_kwargs or {}, map_location)
    files = open_entry(root_folder, checkpoint_index)
    if strategy is not None:
        if model_names is not None:
            raise ValueError("load_checkpoint: model_names cannot be combined with strategy=....")
        patterns = ("*",) if allow_spec_changes else ()
        return _restore(strategy, files, map_location, validators, patterns, trust)
    if files.strategy() is not None and model_names is None:
        return _rebuild(
            None,
            files,
            map_location,
            hooks,
            training_fn,
            validators,
            trust,
            overrides,
            allow_spec_changes,
        )
    if overrides:
        raise ValueError("load_checkpoint: overrides apply to strategy checkpoints only.")
    return _load_components(files, map_location, model_names, validators, trust)


def _rebuild(
    cls,
    files,
    map_location,
    hooks,
    training_fn,
    validators,
    trust,
    overrides,
    allow_spec_changes,
) -> dict[str, Any]:
    """Build the saved strategy class (``cls`` or a subclass) from its recipe, then restore it."""
    meta = files.strategy_data()
    saved = strategy_class(meta.get("strategy_cls") or DEFAULT_STRATEGY, trust)
    if cls is None:
        cls = saved
    elif not issubclass(saved, cls):
        fresh = (
            f", or start a new run from its weights with {cls.__name__}"
            ".from_pretrained_checkpoint(...)"
            if callable(getattr(cls, "from_pretrained_checkpoint", None))
            else ""
        )
        raise TypeError(
            f"Loaded strategy has type {saved.__name__}, expected {cls.__name__}: "
            f"{cls.__name__}.load_checkpoint: checkpoint {files.entry.index} in {files.root} was "
            f"saved by {meta.get('strategy_cls')}, not a {cls.__name__}. Resume it with that "
            f"class{fresh}."
        )
    meta, approved, kwargs, record = _apply_overrides(dict(meta), overrides)
    devices = meta.get("devices") or ["cpu"]
    device = torch.device(map_location if map_location is not None else devices[0])
    if map_location is None and device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"Checkpoint {files.entry.index} in {files.root} was saved on {device}, which is not "
            "available here; pass map_location='cpu' (or another device)."
        )
    if map_location is not None:
        meta["devices"] = [str(map_location)]
    models = {
        name: build_model(files.load_spec("models", name, trust=trust, expect=nn.Module), device)
        for name in files.entry.models
    }
    single = bool(meta.get("single_model_input")) and set(models) == {"main"}
    recipe = {k: v for k, v in meta.items() if k not in (*RUN_RECORD, *_NOT_RECIPE)}
    strategy = cls.from_spec_dict(  # the counters are restored with the rest, below
        {**recipe, "model_specs": {}},
        models=models["main"] if single else models,
        hooks=hooks,
        training_fn=training_fn,
        trust=trust,
        **kwargs,
    )
    if record:
        checkpoint_record(strategy)["history"].append(
            history_event("resume_overrides", from_index=files.entry.index, overrides=record)
        )
    _warn_missing_runtime_parts(meta, strategy)
    patterns = ("*",) if allow_spec_changes else approved
    return _restore(strategy, files, map_location, validators, patterns, trust)


_NOT_RECIPE = ("strategy_cls", "runtime_state")
DEFAULT_STRATEGY = "nvalchemi.training.strategy.TrainingStrategy"  # checkpoints without a class


def _restore(strategy, files, map_location, validators, patterns, trust) -> dict[str, Any]:
    rank = get_rank(strategy.distributed_manager)
    info = restore_strategy(
        strategy, files, map_location=map_location, approved=patterns, rank=rank
    )
    models = strategy.unwrapped_models()
    assoc = files.manifest.associations if files.manifest is not None else {}
    loaded = {
        name: model_entry(
            models[name], _saved_spec(files, "models", name, trust), assoc.get(name, {})
        )
        for name in files.entry.models
    }
    optimizers, schedulers = strategy.ensure_optimizers()
    saved = set(files.entry.optimizers) | set(files.entry.schedulers)
    for (opt, sched, key, _), optimizer, scheduler in zip(
        optimizer_names(strategy), optimizers, schedulers
    ):
        if key in loaded and opt in saved:
            spec = _saved_spec(files, "optimizers", opt, trust)
            loaded[key]["optimizers"][opt] = {"optimizer": optimizer, "spec": spec}
        if key in loaded and sched in saved:
            spec = _saved_spec(files, "schedulers", sched, trust)
            loaded[key]["schedulers"][sched] = {"scheduler": scheduler, "spec": spec}
    result = load_result(files, loaded, strategy)
    result.update(strategy_metadata=info["metadata"], spec_changes=info["spec_changes"])
    run_validators(validators, result, files.root)
    return result


def _warn_missing_runtime_parts(meta: Mapping[str, Any], strategy: Any) -> None:
    """Hooks and the validation config are not saved: say so when a resume lacks them."""
    missing = sorted(set(meta.get("hook_types") or []) - set(hook_types(strategy.hooks)))
    if missing:
        warnings.warn(
            f"The saved run used hooks {missing} that were not passed to the resumed strategy "
            "(hooks are not stored in checkpoints); pass them with hooks=[...] to keep e.g. "
            "checkpointing, EMA and early stopping going.",
            UserWarning,
            stacklevel=5,
        )
    if meta.get("validation_configured") and strategy.validation_config is None:
        warnings.warn(
            "The saved run validated but the resumed strategy has no validation_config (it is "
            "not stored in checkpoints); pass overrides={'validation_config': "
            "ValidationConfig(...)} to validate (and step metric schedulers) as before.",
            UserWarning,
            stacklevel=5,
        )


def _apply_overrides(meta: dict, overrides: Mapping[str, Any] | None):
    """Merge ``overrides`` into the saved recipe; return (meta, approved patterns, kwargs, record)."""
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
        for config in (c for entries in configs.values() for c in entries):
            if kind == "optimizers" or config.get("scheduler_cls"):
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


def _load_components(files, map_location, model_names, validators, trust) -> CheckpointManifest:
    entry = files.entry
    names = list(entry.models) if model_names is None else list(model_names)
    unknown = sorted(set(names) - set(entry.models))
    if unknown:
        raise KeyError(f"Unknown model(s) {unknown}. Available: {sorted(entry.models)}")
    associations = files.manifest.associations
    if os.path.lexists(files.associations()):
        associations = read_json(files.associations(), "associations.json")
    models = {}
    for name in names:
        spec = files.load_spec("models", name, trust=trust, expect=nn.Module)
        model = build_model(spec, map_location)
        model.load_state_dict(safe_torch_load(files.state("models", name), map_location))
        models[name] = (model, spec)
    wanted = {o for n in names for o in associations.get(n, {}).get("optimizers", [])}
    wanted_s = {s for n in names for s in associations.get(n, {}).get("schedulers", [])}
    if model_names is None:
        wanted, wanted_s = set(entry.optimizers), set(entry.schedulers)
    optimizers = {}
    for opt in sorted(wanted & set(entry.optimizers)):
        spec = files.load_spec("optimizers", opt, trust=trust, expect=torch.optim.Optimizer)
        optimizer = spec.build(_optimizer_params(opt, associations, models))
        optimizer.load_state_dict(safe_torch_load(files.state("optimizers", opt), map_location))
        optimizers[opt] = (optimizer, spec)
    schedulers = {}
    for sched in sorted(wanted_s & set(entry.schedulers)):
        spec = files.load_spec("schedulers", sched, trust=trust, expect=SCHEDULER_BASES)
        scheduler = spec.build(_scheduler_optimizer(sched, associations, optimizers))
        scheduler.load_state_dict(safe_torch_load(files.state("schedulers", sched), map_location))
        schedulers[sched] = (scheduler, spec)
    loaded = {}
    for name, (model, spec) in models.items():
        assoc = associations.get(name, {})
        loaded[name] = model_entry(model, spec, assoc)
        loaded[name]["optimizers"] = {
            o: {"optimizer": optimizers[o][0], "spec": optimizers[o][1]}
            for o in assoc.get("optimizers", [])
            if o in optimizers
        }
        loaded[name]["schedulers"] = {
            s: {"scheduler": schedulers[s][0], "spec": schedulers[s][1]}
            for s in assoc.get("schedulers", [])
            if s in schedulers
        }
    run_validators(validators, load_result(files, loaded), files.root)
    return files.manifest.model_copy(
        update={"models": models, "optimizers": optimizers, "schedulers": schedulers}
    )


def _optimizer_params(name: str, associations: Mapping[str, Any], models: Mapping[str, Any]) -> Any:
    named = {f"{k}.{n}": p for k, (m, _) in models.items() for n, p in m.named_parameters()}
    for assoc in associations.values():
        groups = (assoc.get("optimizer_param_groups") or {}).get(name)
        flat = (assoc.get("optimizer_parameter_names") or {}).get(name)
        groups = groups if groups is not None else ([flat] if flat is not None else None)
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


_MACE_KEYS = {
    "model_name": "main",
    "dtype": None,
    "enable_cueq": False,
    "compile_model": False,
    "compile_kwargs": {},
}


def _load_adapter(path: Any, adapter: str, kwargs: Mapping[str, Any], map_location: Any) -> dict:
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
    warnings.warn(
        f"load_checkpoint(adapter='mace') reads {file} with mace-torch's pickle loader, which "
        "runs code stored in the file: load only trusted MACE model files.",
        UserWarning,
        stacklevel=3,
    )
    from nvalchemi.models.mace import MACEWrapper  # optional

    model = MACEWrapper.from_checkpoint(
        file,
        device=map_location or "cpu",
        dtype=options["dtype"],
        enable_cueq=options["enable_cueq"],
        compile_model=options["compile_model"],
        **options["compile_kwargs"],
    )
    return {
        "strategy": None,
        "models": {options["model_name"]: model_entry(model, None, {})},
        "manifest": None,
        "checkpoint_index": None,
        "source": {"format": "mace", "path": str(file)},
        "metadata": {"adapter": "mace"},
        "spec": None,
    }


# ---------------------------------------------------------------------------- strategy methods
def read_strategy_metadata(
    root_folder: str | Path, checkpoint_index: Index = "latest"
) -> dict | None:
    """The saved strategy recipe (``to_checkpoint_dict()`` output) or ``None``; loads no tensors."""
    meta = open_entry(root_folder, checkpoint_index).strategy_data()
    return None if meta is None else dict(meta)


def strategy_restore_checkpoint(
    strategy: Any,
    root_folder: str | Path,
    checkpoint_index: Index = -1,
    map_location: Any = None,
    *,
    validators: Any = None,
    trust: bool = False,
    allow_spec_changes: bool = False,
) -> Mapping[str, Any]:
    """``TrainingStrategy.restore_checkpoint``: load a checkpoint into ``strategy`` in place."""
    return load_checkpoint(
        root_folder,
        checkpoint_index,
        map_location,
        strategy=strategy,
        validators=validators,
        trust=trust,
        allow_spec_changes=allow_spec_changes,
    )


def strategy_load_checkpoint(
    cls: type,
    root_folder: str | Path,
    checkpoint_index: Index = -1,
    map_location: Any = None,
    *,
    hooks: list[Any] | None = None,
    training_fn: Any = None,
    validators: Any = None,
    trust: bool = False,
    overrides: Mapping[str, Any] | None = None,
    allow_spec_changes: bool = False,
) -> Any:
    """``TrainingStrategy.load_checkpoint``: rebuild the saved strategy and restore its state.

    See :func:`load_checkpoint` for the arguments; hooks are not saved, so pass the same
    hooks again (e.g. ``EMAHook``) to restore their state.
    """
    files = open_entry(root_folder, checkpoint_index)
    if files.strategy() is None:
        raise ValueError(
            f"{cls.__name__}.load_checkpoint requires a checkpoint saved from a TrainingStrategy "
            f"(checkpoint {files.entry.index} in {files.root} holds components only); use "
            "load_checkpoint(...) or load_model_from_checkpoint(...)."
        )
    return _rebuild(
        cls,
        files,
        map_location,
        hooks,
        training_fn,
        validators,
        trust,
        overrides,
        allow_spec_changes,
    )["strategy"]
