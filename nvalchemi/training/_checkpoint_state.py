"""What goes into a checkpoint: snapshots of strategies and of components.

:func:`capture_strategy` takes, on the training thread, a CPU copy of everything a run
needs to continue exactly (weights, optimizer and scheduler states, counters,
checkpointable hook states such as EMA weights and GradScaler state, per-rank RNG states,
the loader position, the strategy recipe) into a :class:`Snapshot` that a background
thread can write (:mod:`nvalchemi.training._checkpoint_writer`); loading is in
:mod:`nvalchemi.training._checkpoint_restore`.

Component names of strategy checkpoints: the model keys, ``<model>_optimizer`` and
``<model>_scheduler`` (``_<i>`` suffixes when a model has several optimizer configs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from nvalchemi._serialization import encode_value
from nvalchemi.training._checkpoint_files import (
    SnapshotBuffers,
    cpu_snapshot,
    safe_component_name,
)
from nvalchemi.training._checkpoint_manifest import (
    KINDS,
    CheckpointEntry,
    utc_now,
)
from nvalchemi.training._checkpoint_rng import capture_rng, preserved_rng
from nvalchemi.training.spec import BaseSpec, create_model_spec

__all__ = [
    "Snapshot",
    "capture_components",
    "capture_strategy",
    "checkpoint_state_of",
    "entry_from_snapshot",
    "history_event",
    "hook_types",
    "optimizer_names",
    "optimizer_spec",
    "scheduler_spec",
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


def optimizer_spec(config: Any) -> dict[str, Any]:
    return create_model_spec(config.optimizer_cls, **config.optimizer_kwargs).model_dump()


def scheduler_spec(config: Any) -> dict[str, Any]:
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
        specs[f"optimizers/{opt_name}"] = optimizer_spec(config)
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
            specs[f"schedulers/{sched_name}"] = scheduler_spec(config)
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
