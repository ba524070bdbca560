"""Loading a checkpoint entry into a live strategy, and building models from untrusted specs.

:func:`restore_strategy` loads weights, optimizer and scheduler states, counters, hook
states and this rank's RNG state into a live strategy, after checking that the
strategy's specs match the checkpoint's (or that the differences were approved).
:func:`load_spec` rehydrates a ``spec.json`` through the import allow-list and, unless
trusted, only lets it call classes of the right kind and factories marked safe, judged on
the resolved objects; :func:`build_model` builds inside
:func:`~nvalchemi._serialization.untrusted_build`, so factories that unpickle files refuse
to run unless the spec was trusted.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvalchemi._serialization import (
    UnsafeImportError,
    check_spec_target,
    encode_value,
    import_path,
    untrusted_build,
)
from nvalchemi.training._checkpoint_files import read_json, safe_torch_load
from nvalchemi.training._checkpoint_manifest import (
    KINDS,
    ComponentPaths,
    format_differences,
    spec_differences,
    unapproved,
)
from nvalchemi.training._checkpoint_rng import restore_rng
from nvalchemi.training._checkpoint_state import (
    checkpoint_state_of,
    optimizer_names,
    optimizer_spec,
    scheduler_spec,
)
from nvalchemi.training.spec import BaseSpec, create_model_spec_from_json

__all__ = ["SCHEDULER_BASES", "build_model", "load_spec", "restore_strategy"]


def load_spec(path: Path, *, trust: bool, expect: type | tuple[type, ...] | None) -> BaseSpec:
    """Read and rehydrate a ``spec.json``; without trust, refuse what it may not call.

    Every object the spec resolves is judged as resolved, not by its path string (so
    re-exports such as ``nvalchemi.models.MACEWrapper`` change nothing), before anything is
    built: each ``cls_path`` (top-level or nested) must be a class or a callable marked
    :func:`~nvalchemi._serialization.spec_factory`, never one marked
    :func:`~nvalchemi._serialization.requires_trust` (factories that unpickle files); the
    top-level one a subclass of ``expect``; and ``{"__type__": ...}`` values and class
    arguments must not be ``requires_trust`` objects. Refusals raise
    :class:`~nvalchemi._serialization.UnsafeImportError` naming the file and the key.
    """
    data = read_json(path, "spec file")
    if not isinstance(data, Mapping):
        raise ValueError(f"{path} must hold a JSON object (a BaseSpec dump).")
    if not trust:
        _check_json(data, path, "", expect)
    try:
        spec = create_model_spec_from_json(data, trust=trust)
    except UnsafeImportError as exc:
        raise UnsafeImportError(f"{path}: {exc}") from None
    if not trust:
        _check_decoded(data, spec, path, "")
    return spec


def _key(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _resolve(path: str, where: str) -> Any:
    try:
        return import_path(path)
    except UnsafeImportError as exc:
        raise UnsafeImportError(f"{where}: {exc}") from None
    except (ValueError, ImportError, TypeError) as exc:
        raise ValueError(f"{where}: cannot resolve {path!r}: {exc}") from exc


def _check_json(value: Any, file: Path, key: str, expect: Any) -> None:
    """Check every ``cls_path`` and ``__type__`` in the raw JSON (nothing built yet)."""
    if isinstance(value, Mapping):
        target = value.get("cls_path")
        if isinstance(target, str):
            where = f"{file}, key {_key(key, 'cls_path')!r}"
            check_spec_target(_resolve(target, where), path=target, where=where, expect=expect)
        elif set(value) == {"__type__"} and isinstance(value["__type__"], str):
            _resolve(value["__type__"], f"{file}, key {_key(key, '__type__')!r}")
        for name, item in value.items():
            if name not in ("cls_path", "timestamp"):
                _check_json(item, file, _key(key, str(name)), None)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, file, f"{key}[{i}]", None)


def _check_decoded(raw: Any, decoded: Any, file: Path, key: str) -> None:
    """Strings rehydrated into callables (``type``-annotated arguments) must be classes."""
    if isinstance(decoded, BaseSpec) and isinstance(raw, Mapping):
        for name, value in decoded.kwargs.items():
            _check_decoded(raw.get(name), value, file, _key(key, name))
    elif isinstance(raw, str) and callable(decoded):
        check_spec_target(decoded, path=raw, where=f"{file}, key {key!r}")
    elif isinstance(raw, list) and isinstance(decoded, (list, tuple)):
        for i, (r, d) in enumerate(zip(raw, decoded)):
            _check_decoded(r, d, file, f"{key}[{i}]")
    elif isinstance(raw, Mapping) and isinstance(decoded, Mapping):
        for name, value in decoded.items():
            _check_decoded(raw.get(name), value, file, _key(key, str(name)))


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
        live_specs[f"optimizers/{opt_name}"] = optimizer_spec(config)
        if sched_name is not None:
            live_specs[f"schedulers/{sched_name}"] = scheduler_spec(config)
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
    """Build a model from ``spec`` (on ``device`` if the factory takes one).

    The build runs in :func:`~nvalchemi._serialization.untrusted_build`: a spec rehydrated
    with ``trust=True`` lifts that while its target runs; any other spec cannot reach a
    ``requires_trust`` factory, not even through another factory.
    """
    with untrusted_build():
        if device is not None and spec.accepts_kwarg("device"):
            model = spec.build(device=device)
        else:
            model = spec.build()
    if not isinstance(model, nn.Module):
        raise RuntimeError(
            f"Spec {spec.cls_path} built {type(model).__name__}; expected nn.Module."
        )
    return model.to(device) if device is not None else model
