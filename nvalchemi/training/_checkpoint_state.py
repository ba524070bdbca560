"""What goes into a checkpoint and back: snapshots of strategies and components, and restore.

:func:`capture_strategy` takes, on the training thread, a CPU copy of everything a run
needs to continue exactly (weights, optimizer and scheduler states, counters,
checkpointable hook states such as EMA weights and GradScaler state, per-rank RNG states,
the loader position, the strategy recipe) into a :class:`Snapshot` that a background
thread can write. :func:`restore_strategy` loads a checkpoint entry into a live strategy.

Component names of strategy checkpoints: the model keys, ``<model>_optimizer`` and
``<model>_scheduler`` (``_<i>`` suffixes when a model has several optimizer configs).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvalchemi._serialization import encode_value
from nvalchemi.training._checkpoint_files import (
    SnapshotBuffers,
    cpu_snapshot,
    read_json,
    safe_component_name,
    safe_torch_load,
)
from nvalchemi.training._checkpoint_manifest import (
    KINDS,
    CheckpointEntry,
    ComponentPaths,
    format_differences,
    spec_differences,
    unapproved,
    utc_now,
)
from nvalchemi.training._checkpoint_rng import capture_rng, preserved_rng, restore_rng
from nvalchemi.training.spec import BaseSpec, create_model_spec, create_model_spec_from_json

__all__ = [
    "Snapshot",
    "capture_components",
    "capture_strategy",
    "checkpoint_state_of",
    "load_spec",
    "optimizer_names",
    "restore_strategy",
]

_COUNTERS = ("step_count", "global_step_count", "batch_count", "epoch_count", "epoch_step_count")
_STATE_KEY = "_nvalchemi_checkpoint"


@dataclass
class Snapshot:
    """One checkpoint held in memory (CPU tensors and JSON), ready to be written."""

    kind: str
    json_files: dict[str, Any]
    tensor_files: dict[str, Any]
    specs: dict[str, dict[str, Any]]
    names: dict[str, list[str]]
    associations: dict[str, Any]
    counters: dict[str, int] = field(default_factory=dict)
    reason: str = "manual"
    metric: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    approved: tuple[str, ...] = ()
    index: int | None = None


def checkpoint_state_of(strategy: Any) -> dict[str, Any]:
    """Per-strategy checkpoint bookkeeping (approved spec changes, pending history, loader)."""
    return strategy.__dict__.setdefault(_STATE_KEY, {"approved": [], "history": []})


# ---------------------------------------------------------------------------- names
def optimizer_names(strategy: Any) -> list[tuple[str, str | None, str, Any]]:
    """``(optimizer name, scheduler name | None, model key, config)`` in optimizer order."""
    out = []
    for key, configs in strategy.optimizer_configs.items():
        several = len(configs) > 1
        for i, config in enumerate(configs):
            suffix = f"_{i}" if several else ""
            scheduler = f"{key}_scheduler{suffix}" if config.scheduler_cls is not None else None
            out.append((f"{key}_optimizer{suffix}", scheduler, key, config))
    return out


def _optimizer_spec(config: Any) -> dict[str, Any]:
    return create_model_spec(config.optimizer_cls, **config.optimizer_kwargs).model_dump()


def _scheduler_spec(config: Any) -> dict[str, Any]:
    return create_model_spec(config.scheduler_cls, **config.scheduler_kwargs).model_dump()


# ---------------------------------------------------------------------------- capture
def capture_strategy(
    strategy: Any,
    *,
    reason: str = "manual",
    metric: dict[str, Any] | None = None,
    rng_states: list[dict[str, Any]] | None = None,
    buffers: SnapshotBuffers | None = None,
) -> Snapshot:
    """A :class:`Snapshot` of ``strategy`` (raises ``NonFiniteLossError`` for a diverged run).

    Runs on the training thread; the RNG states are left untouched. ``buffers`` are
    reused CPU buffers (see :class:`SnapshotBuffers`); device copies are complete on return.
    """
    with preserved_rng():
        snapshot = _capture_strategy(strategy, reason, metric, rng_states, buffers)
    if buffers is not None:
        buffers.finish()
    return snapshot


def _capture_strategy(strategy, reason, metric, rng_states, buffers) -> Snapshot:
    _reject_sharded(strategy.models)
    meta = strategy.to_checkpoint_dict()  # checks the non-finite record first
    models = strategy.unwrapped_models()
    missing = sorted(k for k in models if k not in meta.get("model_specs", {}))
    if missing:
        raise ValueError(
            "Cannot save strategy checkpoint because model spec generation failed for "
            f"model(s) {missing}; store constructor arguments as attributes or define "
            "checkpoint_spec() on the model (see the warnings above)."
        )
    optimizers, schedulers = strategy.ensure_optimizers()
    records = optimizer_names(strategy)
    if len(records) != len(optimizers):
        raise RuntimeError(
            f"The strategy has {len(optimizers)} optimizers for {len(records)} optimizer "
            "configs; cannot name them for the checkpoint."
        )
    json_files: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    specs: dict[str, dict[str, Any]] = {}
    for name, model in models.items():
        safe_component_name(name, "model")
        specs[f"models/{name}"] = meta["model_specs"][name]
        tensors[f"models/{name}/weights.pt"] = cpu_snapshot(
            model.state_dict(), f"model {name!r} state_dict", buffers
        )
    param_names = {id(p): f"{k}.{n}" for k, m in models.items() for n, p in m.named_parameters()}
    associations: dict[str, Any] = {k: {"optimizers": [], "schedulers": []} for k in models}
    names: dict[str, list[str]] = {"models": sorted(models), "optimizers": [], "schedulers": []}
    for (opt_name, sched_name, key, config), optimizer, scheduler in zip(
        records, optimizers, schedulers
    ):
        assoc = associations[key]
        names["optimizers"].append(opt_name)
        assoc["optimizers"].append(opt_name)
        specs[f"optimizers/{opt_name}"] = _optimizer_spec(config)
        tensors[f"optimizers/{opt_name}/state.pt"] = cpu_snapshot(
            optimizer.state_dict(), f"optimizer {opt_name!r} state_dict", buffers
        )
        groups = [
            [param_names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups
        ]
        assoc.setdefault("optimizer_parameter_names", {})[opt_name] = [n for g in groups for n in g]
        if len(groups) > 1:
            assoc.setdefault("optimizer_param_groups", {})[opt_name] = groups
        if sched_name is not None and scheduler is not None:
            names["schedulers"].append(sched_name)
            assoc["schedulers"].append(sched_name)
            assoc.setdefault("scheduler_optimizers", {})[sched_name] = opt_name
            specs[f"schedulers/{sched_name}"] = _scheduler_spec(config)
            tensors[f"schedulers/{sched_name}/state.pt"] = cpu_snapshot(
                scheduler.state_dict(), f"scheduler {sched_name!r} state_dict", buffers
            )
    hooks = {
        key: cpu_snapshot(hook.state_dict(), f"hook {key!r} state_dict", buffers)
        for key, hook in strategy.iter_checkpointable_hooks()
    }
    if hooks:
        tensors["hooks.pt"] = hooks
    for rank, state in enumerate(rng_states if rng_states is not None else [capture_rng()]):
        tensors[f"rng/rank_{rank}.pt"] = state
    loader_state = _loader_state(strategy.active_dataloader)
    if loader_state is not None:
        meta["dataloader_state"] = loader_state
    meta["world_size"] = len(rng_states) if rng_states else 1
    # Hooks and the validation config are runtime objects (not saved); recording what the
    # run had lets the loader warn when a resume would silently drop them.
    meta["hook_types"] = hook_types(strategy.hooks)
    meta["validation_configured"] = strategy.validation_config is not None
    json_files["strategy.json"] = meta
    json_files["associations.json"] = associations
    book = checkpoint_state_of(strategy)
    return Snapshot(
        kind="strategy",
        json_files=json_files,
        tensor_files=tensors,
        specs=specs,
        names=names,
        associations=associations,
        counters={k: int(meta["runtime_state"].get(k, 0)) for k in _COUNTERS},
        reason=reason,
        metric=metric,
        history=list(book["history"]),
        approved=tuple(book["approved"]),
    )


def hook_types(hooks: list[Any]) -> list[str]:
    out = []
    for hook in hooks:
        children = getattr(hook, "iter_hooks", None)
        out.extend(type(h).__name__ for h in (children() if callable(children) else [hook]))
    return out


def _loader_state(loader: Any) -> dict[str, Any] | None:
    state_dict = getattr(loader, "state_dict", None)
    if not callable(state_dict):
        return None
    try:
        state = dict(state_dict())
    except Exception:
        return None
    try:
        return encode_value(state)
    except TypeError:
        return None


def _reject_sharded(models: Mapping[str, nn.Module]) -> None:
    for key, model in models.items():
        name = type(model).__name__
        if "FullyShardedDataParallel" in name or "FSDP" in name:
            raise NotImplementedError(
                f"Model {key!r} is sharded ({name}); save it with torch.distributed.checkpoint "
                "instead of nvalchemi checkpoints."
            )


def capture_components(
    models: Mapping[str, Any],
    optimizers: Mapping[str, Any] | None,
    schedulers: Mapping[str, Any] | None,
    associations: Mapping[str, Any] | None,
) -> Snapshot:
    """A :class:`Snapshot` of ``{name: (object, spec)}`` components (no strategy)."""
    tensors: dict[str, Any] = {}
    specs: dict[str, dict[str, Any]] = {}
    objects: dict[str, dict[str, Any]] = {}
    for kind, mapping in (
        ("models", models),
        ("optimizers", optimizers),
        ("schedulers", schedulers),
    ):
        objects[kind] = {}
        for name, value in (mapping or {}).items():
            safe_component_name(name, kind[:-1])
            obj, spec = _object_and_spec(kind, name, value)
            objects[kind][name] = obj
            specs[f"{kind}/{name}"] = spec
            if kind == "models":
                from nvalchemi.training.runtime import unwrap_model

                obj = unwrap_model(obj)
            stem = "weights.pt" if kind == "models" else "state.pt"
            tensors[f"{kind}/{name}/{stem}"] = cpu_snapshot(
                obj.state_dict(), f"{kind[:-1]} {name!r} state_dict"
            )
    assoc = _associations(objects, associations)
    return Snapshot(
        kind="components",
        json_files={"associations.json": assoc},
        tensor_files=tensors,
        specs=specs,
        names={kind: sorted(objects[kind]) for kind in KINDS},
        associations=assoc,
    )


def _object_and_spec(kind: str, name: str, value: Any) -> tuple[Any, dict[str, Any]]:
    if isinstance(value, tuple) and len(value) == 2:
        obj, spec = value
    else:
        obj, spec = value, None
    if spec is None and kind == "models":
        from nvalchemi.training.model_spec import model_spec_for

        spec = model_spec_for(obj, strict=True)
    if spec is None and kind == "optimizers":
        spec = create_model_spec(type(obj), **obj.defaults)
    if spec is None:
        raise ValueError(
            f"{kind[:-1]} {name!r} needs a spec to be rebuilt; pass ({name!r}: (object, spec)) "
            "with spec=create_model_spec(cls, **kwargs)."
        )
    if isinstance(spec, BaseSpec):
        spec = spec.model_dump()
    if not isinstance(spec, Mapping) or "cls_path" not in spec:
        raise TypeError(f"{kind[:-1]} {name!r}: spec must be a BaseSpec or its JSON dict.")
    return obj, dict(spec)


def _associations(objects: dict[str, dict[str, Any]], given: Mapping[str, Any] | None) -> dict:
    models, optimizers, schedulers = objects["models"], objects["optimizers"], objects["schedulers"]
    out: dict[str, Any] = {}
    if given is not None:
        for key, value in given.items():
            out[key] = {
                k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in value.items()
            }
    else:
        pointers = {
            key: {p.data_ptr() for p in model.parameters()} for key, model in models.items()
        }
        for key in models:
            owned = [
                n
                for n, opt in optimizers.items()
                if any(p.data_ptr() in pointers[key] for g in opt.param_groups for p in g["params"])
            ]
            out[key] = {"optimizers": owned, "schedulers": []}
    for sched_name, scheduler in schedulers.items():
        opt_name = next(
            (n for n, o in optimizers.items() if getattr(scheduler, "optimizer", None) is o), None
        )
        for assoc in out.values():
            if opt_name is not None and opt_name in assoc.get("optimizers", []):
                if given is None and sched_name not in assoc["schedulers"]:
                    assoc["schedulers"].append(sched_name)
                assoc.setdefault("scheduler_optimizers", {})[sched_name] = opt_name
    return out


# ---------------------------------------------------------------------------- loading
def load_spec(path: Path, *, trust: bool, expect: type | tuple[type, ...] | None) -> BaseSpec:
    """Read and rehydrate a ``spec.json``; refuse targets of the wrong kind unless trusted.

    Besides the import allow-list, an untrusted model spec must name an ``nn.Module``
    subclass (or a classmethod factory of one), an optimizer spec an optimizer class,
    and nested specs must name classes: so a checkpoint cannot make the loader call an
    arbitrary allow-listed function.
    """
    data = read_json(path, "spec file")
    if not isinstance(data, Mapping):
        raise ValueError(f"{path} must hold a JSON object (a BaseSpec dump).")
    spec = create_model_spec_from_json(data, trust=trust)
    if not trust:
        _check_targets(spec, expect, path)
    return spec


# Allow-listed factories that unpickle files: never callable from an untrusted spec.
_REQUIRES_TRUST = {"nvalchemi.models.mace.MACEWrapper.from_checkpoint"}


def _check_targets(spec: BaseSpec, expect: Any, path: Path, top: bool = True) -> None:
    target = spec.target()
    if spec.cls_path in _REQUIRES_TRUST or getattr(target, "__nvalchemi_requires_trust__", False):
        raise ValueError(
            f"{path}: cls_path {spec.cls_path!r} loads pickled files, which can run code; "
            "pass trust=True only if you trust this checkpoint and the files it names."
        )
    owner = getattr(target, "__self__", None)  # classmethod factories
    cls = target if isinstance(target, type) else owner if isinstance(owner, type) else None
    if cls is None or (top and expect is not None and not issubclass(cls, expect)):
        wanted = "a class" if expect is None or not top else f"a subclass of {_names(expect)}"
        raise ValueError(
            f"{path}: cls_path {spec.cls_path!r} is not {wanted}; an untrusted checkpoint may "
            "only name such classes. Pass trust=True if you trust this checkpoint."
        )
    for value in spec.kwargs.values():
        for nested in _nested_specs(value):
            _check_targets(nested, None, path, top=False)


def _nested_specs(value: Any) -> list[BaseSpec]:
    if isinstance(value, BaseSpec):
        return [value]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _nested_specs(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _nested_specs(v)]
    return []


def _names(expect: Any) -> str:
    items = expect if isinstance(expect, tuple) else (expect,)
    return " or ".join(t.__name__ for t in items)


SCHEDULER_BASES: tuple[type, ...] = (
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
)


def restore_strategy(
    strategy: Any,
    paths: ComponentPaths,
    *,
    map_location: Any,
    trust: bool,
    allow_spec_changes: bool,
    approved: tuple[str, ...] = (),
    rank: int = 0,
) -> dict[str, Any]:
    """Load checkpoint ``paths.entry`` into ``strategy`` in place; return what was loaded.

    Spec differences between the checkpoint and the live strategy (models, optimizer
    and scheduler classes and kwargs) raise ``ValueError`` naming the fields unless
    they match ``approved`` patterns or ``allow_spec_changes``; approved changes keep
    the live settings (e.g. a new learning rate) after the saved state is loaded and
    are recorded in the manifest history at the next save.
    """
    from nvalchemi.training.model_spec import model_spec_for
    from nvalchemi.training.runtime import move_to_devices

    entry = paths.entry
    live = strategy.unwrapped_models()
    unknown = sorted(set(entry.models) - set(live))
    if unknown:
        raise KeyError(
            f"Checkpoint models {unknown} are not in the strategy (models: {sorted(live)}); "
            "build the strategy with the same model keys."
        )
    records = optimizer_names(strategy)
    live_specs: dict[str, dict[str, Any]] = {}
    for name in entry.models:
        spec = model_spec_for(live[name])
        if spec is not None:
            live_specs[f"models/{name}"] = spec.model_dump()
    for opt_name, sched_name, _, config in records:
        live_specs[f"optimizers/{opt_name}"] = _optimizer_spec(config)
        if sched_name is not None:
            live_specs[f"schedulers/{sched_name}"] = _scheduler_spec(config)
    saved_specs = {
        f"{kind}/{name}": read_json(paths.spec(kind, name), "spec file")
        for kind in KINDS
        for name in getattr(entry, kind)
    }
    diffs = [
        d
        for key in sorted(set(saved_specs) & set(live_specs))
        for d in spec_differences(saved_specs[key], live_specs[key], key)
    ]
    patterns = ("*",) if allow_spec_changes else tuple(approved)
    refused = unapproved(diffs, patterns)
    if refused:
        raise ValueError(
            f"Checkpoint {entry.index} in {paths.root} was saved with other settings than this "
            f"strategy. Differing fields: {format_differences(refused)}. To change them on "
            "resume pass overrides={'optimizer_kwargs': {...}} to "
            "TrainingStrategy.load_checkpoint, or allow_spec_changes=True (recorded in the "
            "manifest history)."
        )
    for name in entry.models:
        state = safe_torch_load(paths.state("models", name), map_location)
        live[name].load_state_dict(state, strict=True)
    move_to_devices(strategy.models, strategy.devices)
    optimizers, schedulers = strategy.ensure_optimizers()
    by_name = {}
    for (opt_name, sched_name, _, config), opt, sched in zip(records, optimizers, schedulers):
        by_name[opt_name] = (opt, config, None)
        if sched_name is not None:
            by_name[sched_name] = (sched, config, opt)
    for kind in ("optimizers", "schedulers"):
        for name in getattr(entry, kind):
            if name not in by_name:
                raise KeyError(
                    f"Checkpoint {kind[:-1]} {name!r} has no counterpart in the strategy (live: "
                    f"{sorted(by_name)}); configure the same optimizers and schedulers."
                )
            obj, config, _ = by_name[name]
            obj.load_state_dict(safe_torch_load(paths.state(kind, name), map_location))
    for opt_name, sched_name, _, config in records:
        key = f"optimizers/{opt_name}"
        if key in saved_specs:
            sched = by_name[sched_name][0] if sched_name is not None else None
            _keep_live_optimizer_settings(
                by_name[opt_name][0], sched, config, saved_specs[key], live_specs[key]
            )
        if sched_name is not None and f"schedulers/{sched_name}" in saved_specs:
            _keep_live_scheduler_settings(
                by_name[sched_name][0],
                saved_specs[f"schedulers/{sched_name}"],
                live_specs[f"schedulers/{sched_name}"],
            )
    meta = None
    meta_path = paths.strategy()
    if meta_path is not None:
        meta = read_json(meta_path, "strategy metadata")
        strategy.load_runtime_state(meta.get("runtime_state") or {})
    _load_hook_states(strategy, paths, map_location)
    rng_file = paths.rng(rank)
    if entry.layout == 2 and rng_file.is_file():
        restore_rng(safe_torch_load(rng_file, "cpu"))
    book = checkpoint_state_of(strategy)
    if diffs:
        book["approved"] = sorted(set(book["approved"]) | set(patterns))
    if meta is not None and meta.get("dataloader_state") is not None:
        book["dataloader_state"] = meta["dataloader_state"]
    book["loaded_from"] = {"root": str(paths.root), "index": entry.index}
    return {"metadata": meta, "spec_changes": diffs}


def _keep_live_optimizer_settings(
    optimizer: Any, scheduler: Any, config: Any, saved: dict, live: dict
) -> None:
    """After ``load_state_dict`` (which restores saved hyperparameters) re-apply live ones."""
    changed = {
        k: v
        for k, v in config.optimizer_kwargs.items()
        if encode_value(v) != saved.get(k, object())
    }
    if not changed:
        return
    explicit = list(config.param_groups or [])
    for i, group in enumerate(optimizer.param_groups):
        own = explicit[i] if i < len(explicit) else {}
        for key, value in changed.items():
            if key in own:
                continue
            if key == "lr" and "initial_lr" in group:
                ratio = group["lr"] / group["initial_lr"] if group["initial_lr"] else 1.0
                group["initial_lr"] = value
                group["lr"] = value * ratio
            elif isinstance(group.get(key), tuple):
                group[key] = tuple(value)
            else:
                group[key] = value
    if scheduler is not None and "lr" in changed and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _keep_live_scheduler_settings(scheduler: Any, saved: dict, live: dict) -> None:
    for key, value in live.items():
        if key in ("cls_path", "timestamp") or saved.get(key, object()) == value:
            continue
        if hasattr(scheduler, key):
            current = getattr(scheduler, key)
            setattr(scheduler, key, tuple(value) if isinstance(current, tuple) else value)


def _load_hook_states(strategy: Any, paths: ComponentPaths, map_location: Any) -> None:
    path = paths.hooks()
    if not path.is_file():
        return
    saved = safe_torch_load(path, map_location)
    if paths.entry.layout == 1:
        saved = _v1_hook_keys(saved)
    live = dict(strategy.iter_checkpointable_hooks())
    children: dict[str, Any] = {}
    for hook in live.values():
        lister = getattr(hook, "checkpointable_children", None)
        if callable(lister):
            children.update(dict(lister()))
    dropped = []
    for key, state in saved.items():
        hook = live.get(key)
        if hook is not None:
            _load_one(hook, state)
        elif key in children:
            children[key].load_state_dict(state)
        else:
            dropped.append(key)
    if dropped:
        warnings.warn(
            f"Checkpoint {paths.entry.index} holds state for hooks {dropped} that are not "
            "registered; that state (e.g. EMA weights) was not restored. Pass the same hooks "
            "(hooks=[...]) to resume exactly.",
            UserWarning,
            stacklevel=4,
        )


def _load_one(hook: Any, state: Any) -> None:
    lister = getattr(hook, "checkpointable_children", None)
    if callable(lister) and isinstance(state, Mapping):
        children = dict(lister())
        dropped = sorted(set(state) - set(children))
        if dropped:
            warnings.warn(
                f"Checkpoint update-hook state for {dropped} has no registered hook; not "
                "restored. Register the same update hooks (e.g. EMAHook) to resume exactly.",
                UserWarning,
                stacklevel=5,
            )
        for key, child in children.items():
            if key in state:
                child.load_state_dict(state[key])
        return
    hook.load_state_dict(state)


def _v1_hook_keys(saved: Mapping[str, Any]) -> dict[str, Any]:
    """``"module.QualName:k"`` (reference) -> ``"QualName"`` / ``"QualName#k"``."""
    out = {}
    for key, state in saved.items():
        path, _, occurrence = str(key).rpartition(":")
        name = (path or str(key)).rsplit(".", 1)[-1]
        n = int(occurrence) if occurrence.isdigit() else 0
        out[name if n == 0 else f"{name}#{n}"] = state
    return out


def build_model(spec: BaseSpec, device: Any) -> nn.Module:
    """Build a model from ``spec`` (on ``device`` if the factory takes one)."""
    if device is not None and spec.accepts_kwarg("device"):
        model = spec.build(device=device)
    else:
        model = spec.build()
    if not isinstance(model, nn.Module):
        raise RuntimeError(
            f"Spec {spec.cls_path} built {type(model).__name__}; expected nn.Module."
        )
    return model.to(device) if device is not None else model


def history_event(event: str, **fields: Any) -> dict[str, Any]:
    """A manifest history record."""
    return {"event": event, "time": utc_now(), **encode_value(fields)}


def entry_from_snapshot(snapshot: Snapshot, index: int, path: str, files: dict) -> CheckpointEntry:
    """The manifest entry for a written snapshot."""
    return CheckpointEntry(
        index=index,
        path=path,
        layout=2,
        kind=snapshot.kind,
        models=snapshot.names["models"],
        optimizers=snapshot.names["optimizers"],
        schedulers=snapshot.names["schedulers"],
        created=utc_now(),
        metric=snapshot.metric,
        reason=snapshot.reason,
        files=files,
        **snapshot.counters,
    )
