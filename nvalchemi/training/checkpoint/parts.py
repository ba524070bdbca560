"""What a strategy checkpoint is made of: one table, read both ways.

:data:`PARTS` lists every kind of state a run needs to continue exactly, each with how to
*capture* it (on the training thread, into CPU memory that a background thread can write)
and how to *restore* it into a live strategy:

====================  ================================  =======================================
part                  files                             holds
====================  ================================  =======================================
recipe and counters   ``strategy.json``                 the recipe (``to_checkpoint_dict()``),
                                                        counters, the loader position
models                ``models/<name>/...``             spec and weights of every model
optimizers            ``optimizers/<name>/...``,        specs and states of optimizers and
                      ``schedulers/<name>/...``,        schedulers, which parameters they own
                      ``associations.json``
hook states           ``hooks.pt``                      ``state_dict()`` of checkpointable hooks
                                                        (EMA weights, GradScaler, early stop)
random generators     ``rng/rank_<r>.pt``               every rank's torch/CUDA/numpy/Python RNG
====================  ================================  =======================================

Component names: the model keys, ``<model>_optimizer`` and ``<model>_scheduler`` (``_<i>``
suffixes when a model has several optimizer configs).
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nvalchemi._serialization import encode_value
from nvalchemi.hooks import protocol
from nvalchemi.training.checkpoint.rng import capture_rng, preserved_rng, restore_rng
from nvalchemi.training.checkpoint.store import (
    EntryFiles,
    format_differences,
    safe_component_name,
    safe_torch_load,
    spec_differences,
    unapproved,
    utc_now,
)
from nvalchemi.training.model_spec import model_spec_for
from nvalchemi.training.runtime import move_to_devices, unwrap_model
from nvalchemi.training.spec import BaseSpec, create_model_spec

__all__ = [
    "PARTS",
    "RUN_RECORD",
    "Snapshot",
    "SnapshotBuffers",
    "capture_components",
    "capture_strategy",
    "checkpoint_record",
    "cpu_snapshot",
    "history_event",
    "hook_types",
    "restore_strategy",
]

_COUNTERS = ("step_count", "global_step_count", "batch_count", "epoch_count", "epoch_step_count")
RUN_RECORD = ("world_size", "hook_types", "validation_configured", "dataloader_state")
"""What ``strategy.json`` holds besides ``to_checkpoint_dict()``: a record of the run."""


@dataclass
class Snapshot:
    """One checkpoint held in memory (CPU tensors and JSON), ready for the store."""

    files: dict[str, Any] = field(default_factory=dict)
    entry: dict[str, Any] = field(default_factory=dict)  # CheckpointEntry fields
    top: dict[str, Any] = field(default_factory=dict)  # manifest fields
    history: list[dict[str, Any]] = field(default_factory=list)
    approved: tuple[str, ...] = ()

    def specs(self) -> dict[str, dict[str, Any]]:
        """``{"models/<name>": spec dump}`` of every component in the snapshot."""
        return {
            k.removesuffix("/spec.json"): v
            for k, v in self.files.items()
            if k.endswith("/spec.json")
        }


def checkpoint_record(strategy: Any) -> dict[str, Any]:
    """A strategy's checkpoint bookkeeping: approved spec changes, pending history, origin."""
    return strategy.__dict__.setdefault("_nvalchemi_checkpoint", {"approved": [], "history": []})


def history_event(event: str, **fields: Any) -> dict[str, Any]:
    """A manifest history record."""
    return {"event": event, "time": utc_now(), **encode_value(fields)}


# ---------------------------------------------------------------------------- CPU copies
_LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class SnapshotBuffers:
    """CPU tensors reused from one snapshot to the next (pinned when the source is on a GPU).

    A fresh allocation per save costs page faults on every byte (often more than the copy
    itself); reusing the previous snapshot's buffers leaves just the copy. Reuse them only
    once the previous snapshot has been written (the checkpoint hook waits for that).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._streams: set[Any] = set()

    def copy(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """A CPU copy of ``tensor`` in the buffer for ``key``."""
        if tensor.layout is not torch.strided or tensor.is_quantized:
            return tensor.to("cpu", copy=True)
        on_gpu = tensor.device.type == "cuda"
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[key] = torch.empty(
                tensor.shape, dtype=tensor.dtype, pin_memory=on_gpu
            )
        buffer.copy_(tensor, non_blocking=on_gpu)
        if on_gpu:
            self._streams.add(torch.cuda.current_stream(tensor.device))
        return buffer

    def finish(self) -> None:
        """Wait for asynchronous device-to-host copies (call before handing data to a writer)."""
        for stream in self._streams:
            stream.synchronize()
        self._streams.clear()


def cpu_snapshot(value: Any, where: str, buffers: SnapshotBuffers | None = None) -> Any:
    """A copy of ``value`` with every tensor on the CPU, loadable with ``weights_only``.

    Containers are rebuilt; numpy scalars become Python numbers. Anything else raises
    ``TypeError`` naming its location, because ``torch.load(weights_only=True)`` would
    refuse it later.
    """
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if buffers is not None:
            return buffers.copy(value, where)
        return value.clone() if value.device.type == "cpu" else value.to("cpu", copy=True)
    if isinstance(value, _LEAVES):
        return value
    if isinstance(value, (dict, OrderedDict)):
        return type(value)(
            (k, cpu_snapshot(v, f"{where}[{k!r}]", buffers)) for k, v in value.items()
        )
    if type(value) in (list, tuple):
        return type(value)(cpu_snapshot(v, f"{where}[{i}]", buffers) for i, v in enumerate(value))
    if type(value) is set:
        return {cpu_snapshot(v, where) for v in value}
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and callable(item) and getattr(value, "ndim", 1) == 0:
        return item()
    raise TypeError(
        f"{where} holds a {type(value).__module__}.{type(value).__qualname__}, which a "
        "checkpoint cannot store safely (files are read with torch.load(weights_only=True)). "
        "Return tensors, numbers, strings and plain containers from state_dict()."
    )


# ---------------------------------------------------------------------------- names
def optimizer_names(strategy: Any) -> list[tuple[str, str | None, str, Any]]:
    """``(optimizer name, scheduler name | None, model key, config)`` in optimizer order."""
    out = []
    for key, configs in strategy.optimizer_configs.items():
        for i, config in enumerate(configs):
            suffix = f"_{i}" if len(configs) > 1 else ""
            scheduler = f"{key}_scheduler{suffix}" if config.scheduler_cls is not None else None
            out.append((f"{key}_optimizer{suffix}", scheduler, key, config))
    return out


def live_specs(strategy: Any, model_names: list[str]) -> dict[str, dict[str, Any]]:
    """Spec dumps of the live strategy's components, keyed like :meth:`Snapshot.specs`."""
    out = {}
    models = strategy.unwrapped_models()
    for name in model_names:
        spec = model_spec_for(models[name]) if name in models else None
        if spec is not None:
            out[f"models/{name}"] = spec.model_dump()
    for opt, sched, _, config in optimizer_names(strategy):
        out[f"optimizers/{opt}"] = create_model_spec(
            config.optimizer_cls, **config.optimizer_kwargs
        ).model_dump()
        if sched is not None:
            out[f"schedulers/{sched}"] = create_model_spec(
                config.scheduler_cls, **config.scheduler_kwargs
            ).model_dump()
    return out


# ---------------------------------------------------------------------------- the table
@dataclass
class _Capture:
    strategy: Any
    snapshot: Snapshot
    buffers: SnapshotBuffers | None
    rng_states: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)

    def tensors(self, relative: str, value: Any, what: str) -> None:
        self.snapshot.files[relative] = cpu_snapshot(value, what, self.buffers)


@dataclass
class _Restore:
    strategy: Any
    files: EntryFiles
    map_location: Any
    rank: int
    saved_specs: dict[str, dict[str, Any]]
    live_specs: dict[str, dict[str, Any]]
    meta: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Part:
    """One kind of state in a strategy checkpoint: how to capture it and how to restore it."""

    name: str
    capture: Callable[[_Capture], None]
    restore: Callable[[_Restore], None]


def _capture_recipe(c: _Capture) -> None:
    strategy = c.strategy
    meta = c.meta = strategy.to_checkpoint_dict()  # checks the non-finite record first
    missing = sorted(k for k in strategy.unwrapped_models() if k not in meta.get("model_specs", {}))
    if missing:
        raise ValueError(
            "Cannot save strategy checkpoint because model spec generation failed for "
            f"model(s) {missing}; store constructor arguments as attributes or define "
            "checkpoint_spec() on the model (see the warnings above)."
        )
    meta["world_size"] = len(c.rng_states)
    # Hooks and the validation config are runtime objects (not saved): recording what the
    # run had lets the loader warn when a resume would silently drop them.
    meta["hook_types"] = hook_types(strategy.hooks)
    meta["validation_configured"] = strategy.validation_config is not None
    loader_state = _loader_state(strategy.active_dataloader)
    if loader_state is not None:
        meta["dataloader_state"] = loader_state
    c.snapshot.files["strategy.json"] = meta
    state = meta["runtime_state"]
    c.snapshot.entry.update(kind="strategy", **{k: int(state.get(k, 0)) for k in _COUNTERS})


def _restore_counters(r: _Restore) -> None:
    if r.meta is not None:
        r.strategy.load_runtime_state(r.meta.get("runtime_state") or {})


def _capture_models(c: _Capture) -> None:
    models = c.strategy.unwrapped_models()
    for name, model in models.items():
        safe_component_name(name, "model")
        if "FullyShardedDataParallel" in type(model).__name__ or "FSDP" in type(model).__name__:
            raise NotImplementedError(
                f"Model {name!r} is sharded ({type(model).__name__}); save it with "
                "torch.distributed.checkpoint instead of nvalchemi checkpoints."
            )
        c.snapshot.files[f"models/{name}/spec.json"] = c.meta["model_specs"][name]
        c.tensors(f"models/{name}/weights.pt", model.state_dict(), f"model {name!r} state_dict")
    c.snapshot.entry["models"] = c.snapshot.top["models"] = sorted(models)


def _restore_models(r: _Restore) -> None:
    live = r.strategy.unwrapped_models()
    unknown = sorted(set(r.files.entry.models) - set(live))
    if unknown:
        raise KeyError(
            f"Checkpoint models {unknown} are not in the strategy (models: {sorted(live)}); "
            "build the strategy with the same model keys."
        )
    for name in r.files.entry.models:
        live[name].load_state_dict(safe_torch_load(r.files.state("models", name), r.map_location))
    move_to_devices(r.strategy.models, r.strategy.devices)


def _capture_optimizers(c: _Capture) -> None:
    strategy = c.strategy
    models = strategy.unwrapped_models()
    optimizers, schedulers = strategy.ensure_optimizers()
    records = optimizer_names(strategy)
    if len(records) != len(optimizers):
        raise RuntimeError(
            f"The strategy has {len(optimizers)} optimizers for {len(records)} optimizer "
            "configs; cannot name them for the checkpoint."
        )
    param_names = {id(p): f"{k}.{n}" for k, m in models.items() for n, p in m.named_parameters()}
    associations: dict[str, Any] = {k: {"optimizers": [], "schedulers": []} for k in models}
    names: dict[str, list[str]] = {"optimizers": [], "schedulers": []}
    specs = live_specs(strategy, [])
    for (opt, sched, key, _), optimizer, scheduler in zip(records, optimizers, schedulers):
        assoc = associations[key]
        names["optimizers"].append(opt)
        assoc["optimizers"].append(opt)
        c.snapshot.files[f"optimizers/{opt}/spec.json"] = specs[f"optimizers/{opt}"]
        c.tensors(
            f"optimizers/{opt}/state.pt", optimizer.state_dict(), f"optimizer {opt!r} state_dict"
        )
        groups = [
            [param_names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups
        ]
        assoc.setdefault("optimizer_parameter_names", {})[opt] = [n for g in groups for n in g]
        if len(groups) > 1:
            assoc.setdefault("optimizer_param_groups", {})[opt] = groups
        if sched is not None and scheduler is not None:
            names["schedulers"].append(sched)
            assoc["schedulers"].append(sched)
            assoc.setdefault("scheduler_optimizers", {})[sched] = opt
            c.snapshot.files[f"schedulers/{sched}/spec.json"] = specs[f"schedulers/{sched}"]
            c.tensors(
                f"schedulers/{sched}/state.pt",
                scheduler.state_dict(),
                f"scheduler {sched!r} state_dict",
            )
    c.snapshot.files["associations.json"] = associations
    c.snapshot.entry.update(names)
    c.snapshot.top.update(names, associations=associations)


def _restore_optimizers(r: _Restore) -> None:
    optimizers, schedulers = r.strategy.ensure_optimizers()
    live: dict[str, tuple[Any, Any]] = {}
    pairs = []
    for (opt, sched, _, config), optimizer, scheduler in zip(
        optimizer_names(r.strategy), optimizers, schedulers
    ):
        live[opt] = (optimizer, config)
        if sched is not None:
            live[sched] = (scheduler, config)
        pairs.append((opt, sched, optimizer, scheduler, config))
    for kind in ("optimizers", "schedulers"):
        for name in getattr(r.files.entry, kind):
            if name not in live:
                raise KeyError(
                    f"Checkpoint {kind[:-1]} {name!r} has no counterpart in the strategy (live: "
                    f"{sorted(live)}); configure the same optimizers and schedulers."
                )
            live[name][0].load_state_dict(
                safe_torch_load(r.files.state(kind, name), r.map_location)
            )
    for opt, sched, optimizer, scheduler, config in pairs:  # approved changes win over the saved
        saved = r.saved_specs.get(f"optimizers/{opt}")
        if saved is not None:
            _keep_live_optimizer_settings(optimizer, scheduler, config, saved)
        saved = r.saved_specs.get(f"schedulers/{sched}")
        if saved is not None:
            _keep_live_scheduler_settings(scheduler, saved, r.live_specs[f"schedulers/{sched}"])


def _keep_live_optimizer_settings(optimizer: Any, scheduler: Any, config: Any, saved: dict) -> None:
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
                group["initial_lr"], group["lr"] = value, value * ratio
            else:
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    if scheduler is not None and "lr" in changed and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _keep_live_scheduler_settings(scheduler: Any, saved: dict, live: dict) -> None:
    for key, value in live.items():
        if key in ("cls_path", "timestamp") or saved.get(key, object()) == value:
            continue
        if hasattr(scheduler, key):
            old = getattr(scheduler, key)
            setattr(scheduler, key, tuple(value) if isinstance(old, tuple) else value)


def _capture_hooks(c: _Capture) -> None:
    states = {
        key: cpu_snapshot(hook.state_dict(), f"hook {key!r} state_dict", c.buffers)
        for key, hook in c.strategy.iter_checkpointable_hooks()
    }
    if states:
        c.snapshot.files["hooks.pt"] = states


def _restore_hooks(r: _Restore) -> None:
    path = r.files.hooks()
    if not os.path.lexists(path):  # a crafted non-file is refused by the read, not skipped
        return
    saved = safe_torch_load(path, r.map_location)
    if r.files.entry.layout == 1:
        saved = _reference_hook_keys(saved)
    live = dict(r.strategy.iter_checkpointable_hooks())
    children: dict[str, Any] = {}
    for hook in live.values():
        lister = protocol.member(hook, "checkpointable_children")
        if lister is not None:
            children.update(dict(lister()))
    dropped = []
    for key, state in saved.items():
        if key in live:
            dropped += _load_hook(live[key], state)
        elif key in children:
            children[key].load_state_dict(state)
        elif not (isinstance(state, Mapping) and not state):  # an empty state loses nothing
            dropped.append(key)
    if dropped:
        warnings.warn(
            f"Checkpoint {r.files.entry.index} holds state for hooks {dropped} that are not "
            "registered; that state (e.g. EMA weights) was not restored. Pass the same hooks "
            "(hooks=[...]) to resume exactly.",
            UserWarning,
            stacklevel=5,
        )


def _reference_hook_keys(saved: Mapping[str, Any]) -> dict[str, Any]:
    """``"module.QualName:k"`` (reference layout) -> ``"QualName"`` / ``"QualName#k"``."""
    out = {}
    for key, state in saved.items():
        path, _, occurrence = str(key).rpartition(":")
        name = (path or str(key)).rsplit(".", 1)[-1]
        n = int(occurrence) if occurrence.isdigit() else 0
        out[name if n == 0 else f"{name}#{n}"] = state
    return out


def _load_hook(hook: Any, state: Any) -> list[str]:
    """Load ``state`` into ``hook`` (an orchestrator: into its children); return what was dropped."""
    lister = protocol.member(hook, "checkpointable_children")
    if not (lister is not None and isinstance(state, Mapping)):
        hook.load_state_dict(state)
        return []
    children = dict(lister())
    for key, child in children.items():
        if key in state:
            child.load_state_dict(state[key])
    return sorted(set(state) - set(children))


def _capture_rng(c: _Capture) -> None:
    for rank, state in enumerate(c.rng_states):
        c.snapshot.files[f"rng/rank_{rank}.pt"] = state


def _restore_rng(r: _Restore) -> None:
    path = r.files.rng(r.rank)
    if r.files.entry.layout == 2 and os.path.lexists(path):
        restore_rng(safe_torch_load(path, "cpu"))


PARTS: tuple[Part, ...] = (
    Part("recipe and counters", _capture_recipe, _restore_counters),
    Part("models", _capture_models, _restore_models),
    Part("optimizers and schedulers", _capture_optimizers, _restore_optimizers),
    Part("hook states", _capture_hooks, _restore_hooks),
    Part("random generators", _capture_rng, _restore_rng),
)
"""The parts of a strategy checkpoint, in capture and restore order."""


# ---------------------------------------------------------------------------- both ways
def capture_strategy(
    strategy: Any,
    *,
    reason: str = "manual",
    metric: dict[str, Any] | None = None,
    rng_states: list[dict[str, Any]] | None = None,
    buffers: SnapshotBuffers | None = None,
) -> Snapshot:
    """A :class:`Snapshot` of ``strategy`` (raises ``NonFiniteLossError`` for a diverged run).

    Runs on the training thread and leaves the RNG states untouched; device copies are
    complete on return.
    """
    record = checkpoint_record(strategy)
    snapshot = Snapshot(history=list(record["history"]), approved=tuple(record["approved"]))
    snapshot.entry.update(reason=reason, metric=metric)
    capture = _Capture(strategy, snapshot, buffers, rng_states or [capture_rng()])
    with preserved_rng():
        for part in PARTS:
            part.capture(capture)
    if buffers is not None:
        buffers.finish()
    return snapshot


def restore_strategy(
    strategy: Any,
    files: EntryFiles,
    *,
    map_location: Any,
    approved: tuple[str, ...] = (),
    rank: int = 0,
) -> dict[str, Any]:
    """Load checkpoint ``files`` into ``strategy`` in place; return ``{"metadata", "spec_changes"}``.

    Spec differences between the checkpoint and the live strategy (models, optimizer and
    scheduler classes and kwargs) raise ``ValueError`` naming the fields unless they match
    the ``approved`` patterns (``("*",)`` approves all); approved changes keep the live
    settings (e.g. a new learning rate) after the saved state is loaded, and are recorded
    in the manifest history at the next save.
    """
    entry = files.entry
    saved = {
        f"{kind}/{name}": dict(files.spec_data(kind, name))
        for kind in ("models", "optimizers", "schedulers")
        for name in getattr(entry, kind)
    }
    live = live_specs(strategy, list(entry.models))
    diffs = [
        d
        for key in sorted(set(saved) & set(live))
        for d in spec_differences(saved[key], live[key], key)
    ]
    refused = unapproved(diffs, approved)
    if refused:
        raise ValueError(
            f"Checkpoint {entry.index} in {files.root} was saved with other settings than this "
            f"strategy. Differing fields: {format_differences(refused)}. To change them on "
            "resume pass overrides={'optimizer_kwargs': {...}} to "
            "TrainingStrategy.load_checkpoint, or allow_spec_changes=True (recorded in the "
            "manifest history)."
        )
    meta = files.strategy_data()
    restore = _Restore(strategy, files, map_location, rank, saved, live, meta)
    for part in PARTS:
        part.restore(restore)
    record = checkpoint_record(strategy)
    if diffs:
        record["approved"] = sorted(set(record["approved"]) | set(approved))
    if meta is not None and meta.get("dataloader_state") is not None:
        record["dataloader_state"] = meta["dataloader_state"]
    record["loaded_from"] = {"root": str(files.root), "index": entry.index}
    return {"metadata": meta, "spec_changes": diffs}


def hook_types(hooks: list[Any]) -> list[str]:
    """Class names of ``hooks`` and of an orchestrator's children."""
    out = []
    for hook in hooks:
        children = protocol.member(hook, "iter_hooks")
        out.extend(type(h).__name__ for h in (children() if children is not None else [hook]))
    return out


def _loader_state(loader: Any) -> dict[str, Any] | None:
    state_dict = getattr(loader, "state_dict", None)
    if not callable(state_dict):
        return None
    try:
        return encode_value(dict(state_dict()))
    except Exception:
        return None


# ---------------------------------------------------------------------------- components
def capture_components(
    models: Mapping[str, Any],
    optimizers: Mapping[str, Any] | None,
    schedulers: Mapping[str, Any] | None,
    associations: Mapping[str, Any] | None,
) -> Snapshot:
    """A :class:`Snapshot` of ``{name: (object, spec)}`` components (no strategy)."""
    snapshot = Snapshot()
    objects: dict[str, dict[str, Any]] = {}
    for kind, mapping in (
        ("models", models),
        ("optimizers", optimizers),
        ("schedulers", schedulers),
    ):
        objects[kind] = {}
        for name, value in (mapping or {}).items():
            safe_component_name(name, kind[:-1])
            obj, spec = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
            if kind == "models":
                obj = unwrap_model(obj)
            objects[kind][name] = obj
            snapshot.files[f"{kind}/{name}/spec.json"] = _component_spec(kind, name, obj, spec)
            stem = "weights.pt" if kind == "models" else "state.pt"
            snapshot.files[f"{kind}/{name}/{stem}"] = cpu_snapshot(
                obj.state_dict(), f"{kind[:-1]} {name!r} state_dict"
            )
    assoc = _associations(objects, associations)
    snapshot.files["associations.json"] = assoc
    names = {kind: sorted(objects[kind]) for kind in objects}
    snapshot.entry.update(kind="components", **names)
    snapshot.top.update(associations=assoc, **names)
    return snapshot


def _component_spec(kind: str, name: str, obj: Any, spec: Any) -> dict[str, Any]:
    if spec is None and kind == "models":
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
    return dict(spec)


def _associations(objects: dict[str, dict[str, Any]], given: Mapping[str, Any] | None) -> dict:
    models, optimizers, schedulers = objects["models"], objects["optimizers"], objects["schedulers"]
    if given is not None:
        out = {
            key: {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in value.items()}
            for key, value in given.items()
        }
    else:
        pointers = {key: {p.data_ptr() for p in m.parameters()} for key, m in models.items()}
        out = {
            key: {
                "optimizers": [
                    n
                    for n, opt in optimizers.items()
                    if any(
                        p.data_ptr() in pointers[key] for g in opt.param_groups for p in g["params"]
                    )
                ],
                "schedulers": [],
            }
            for key in models
        }
    for sched, scheduler in schedulers.items():
        opt = next(
            (n for n, o in optimizers.items() if getattr(scheduler, "optimizer", None) is o), None
        )
        for assoc in out.values():
            if opt is not None and opt in assoc.get("optimizers", []):
                if given is None and sched not in assoc["schedulers"]:
                    assoc["schedulers"].append(sched)
                assoc.setdefault("scheduler_optimizers", {})[sched] = opt
    return out
