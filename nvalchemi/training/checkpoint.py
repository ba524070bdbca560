"""Checkpoints: :func:`save_checkpoint`, :func:`load_checkpoint`, and loading a model to use.

A checkpoint root is self-describing (manifest, per-model spec and weights, optimizer
and scheduler states, the strategy recipe and counters, hook states, RNG states; see
:mod:`nvalchemi.training._checkpoint_manifest` for the layout). Guarantees:

* **Exact resume**: a strategy checkpoint holds everything the run needs to continue
  as if never stopped (weights and EMA weights, optimizer/scheduler states, counters,
  hence the loss-weight schedule position and the loader position, per-rank RNG
  states, early-stopping, update-hook and GradScaler states).
* **Crash safety**: a checkpoint is written into a temporary directory, ``fsync``-ed,
  renamed into place, and only then named by the atomically replaced manifest; a kill
  at any moment leaves the previous checkpoint loadable.
* **Safe loading**: tensors are read with ``torch.load(weights_only=True)`` only, and
  every dotted path in a spec goes through the import allow-list (``trust=True`` opts
  out); a crafted checkpoint cannot run code.
* **Retention**: ``keep_last`` recent and ``keep_best`` best checkpoints; ``"latest"``
  and ``"best"`` are valid ``checkpoint_index`` values.
* **Explicit changes**: changing e.g. the learning rate when resuming needs
  ``overrides=...`` or ``allow_spec_changes=True`` and is recorded in the manifest.

Example:
    >>> strategy.save_checkpoint("runs/x/checkpoints")  # doctest: +SKIP
    >>> strategy = TrainingStrategy.load_checkpoint(  # doctest: +SKIP
    ...     "runs/x/checkpoints", map_location="cuda",
    ...     overrides={"optimizer_kwargs": {"lr": 1e-4}})
    >>> model = load_model_from_checkpoint("runs/x/checkpoints", use_ema=True)  # doctest: +SKIP

Distributed runs: the strategy form of :func:`save_checkpoint` is collective (call it
on every rank; rank 0 writes, every rank waits); load on every rank with its
``map_location``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from nvalchemi.training._checkpoint_files import UnsafeCheckpointError, read_json, safe_torch_load
from nvalchemi.training._checkpoint_load import (
    build_strategy,
    ema_weights,
    load_adapter,
    load_components,
    restore_into,
)
from nvalchemi.training._checkpoint_manifest import (
    CURRENT_SCHEMA_VERSION,
    CheckpointEntry,
    CheckpointManifest,
    ComponentPaths,
)
from nvalchemi.training._checkpoint_restore import build_model, load_spec
from nvalchemi.training._checkpoint_rng import gather_rng
from nvalchemi.training._checkpoint_state import (
    capture_components,
    capture_strategy,
    checkpoint_state_of,
)
from nvalchemi.training._checkpoint_writer import Retention, check_spec_changes, write_snapshot

__all__ = [
    "CURRENT_SCHEMA_VERSION",
    "CheckpointEntry",
    "CheckpointManifest",
    "CheckpointValidator",
    "UnsafeCheckpointError",
    "check_finite_weights",
    "load_checkpoint",
    "load_model_from_checkpoint",
    "load_models_from_checkpoint",
    "read_strategy_metadata",
    "save_checkpoint",
    "strategy_load_checkpoint",
    "strategy_restore_checkpoint",
    "strategy_save_checkpoint",
]

Index = int | str


@runtime_checkable
class CheckpointValidator(Protocol):
    """Checks a model right after it was loaded: ``validator(model_name, entry, model)``.

    ``entry`` is ``{"model", "spec", "optimizers", "schedulers", "metadata"}`` for that
    model. Raise to reject the checkpoint; the loader re-raises as ``ValueError`` naming
    the validator, the model and the path. Pass validators as a list or as
    ``{name: validator}``.

    Example:
        >>> def small(name, entry, model):
        ...     if sum(p.numel() for p in model.parameters()) > 10**9:
        ...         raise ValueError("too large")
        >>> isinstance(small, CheckpointValidator)
        True
    """

    def __call__(self, model_name: str, entry: Mapping[str, Any], model: nn.Module) -> None: ...


def check_finite_weights(model_name: str, entry: Mapping[str, Any], model: nn.Module) -> None:
    """A :class:`CheckpointValidator` that rejects NaN/inf parameters or buffers."""
    bad = [
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if bad:
        raise ValueError(f"non-finite values in {bad[:5]}")


# ---------------------------------------------------------------------------- saving
def save_checkpoint(
    root_folder: str | Path,
    models: Any = None,
    optimizers: Mapping[str, Any] | None = None,
    schedulers: Mapping[str, Any] | None = None,
    associations: Mapping[str, Any] | None = None,
    checkpoint_index: int = -1,
    strategy: Any = None,
    *,
    keep_last: int | None = None,
    keep_best: int | None = None,
    best_metric: str = "total_loss",
    best_mode: str = "min",
    metric: float | Mapping[str, Any] | None = None,
    allow_spec_changes: bool = False,
    reason: str = "manual",
    rank_zero_only: bool = True,
) -> int:
    """Write a checkpoint into ``root_folder``; return its index.

    Forms:
        * ``save_checkpoint(root, strategy)`` / ``save_checkpoint(root, strategy=s)``: a
          restartable strategy checkpoint. Collective under ``torch.distributed``: call it
          on every rank; rank 0 writes (every rank with ``rank_zero_only=False``).
        * ``save_checkpoint(root, models={name: (module, spec)}, optimizers={name:
          (optimizer, spec)}, schedulers={name: (scheduler, spec)})``: components only
          (specs may be omitted for models that :func:`model_spec_for` can describe).

    Args:
        checkpoint_index: ``-1`` for the next index (latest + 1, or 0), else that index
            (an existing checkpoint with that index is replaced atomically).
        keep_last / keep_best: retention (``None`` keeps every checkpoint); the best are
            ranked by ``best_metric`` (``best_mode`` ``"min"``/``"max"``).
        metric: validation value of this state (a float for ``best_metric``, or
            ``{"name", "value"}``), used by ``keep_best`` and ``checkpoint_index="best"``.
        allow_spec_changes: allow specs that differ from the latest checkpoint of this
            root (recorded in the manifest history); otherwise ``ValueError`` naming them.

    Raises:
        TypeError: ``strategy`` is not a ``TrainingStrategy``.
        ValueError: neither models nor a strategy; a spec differing from the latest
            checkpoint; a model whose spec cannot be generated.
        NonFiniteLossError: the strategy's loss became NaN/inf since the last check.
    """
    from nvalchemi.training.strategy import TrainingStrategy

    if isinstance(models, TrainingStrategy):
        models, strategy = None, models
    index = None if checkpoint_index == -1 else _check_index(checkpoint_index)
    retention = Retention(keep_last, keep_best, best_metric, best_mode)
    metric = _metric(metric, best_metric, best_mode)
    root = Path(root_folder)
    if strategy is not None:
        if not isinstance(strategy, TrainingStrategy):
            raise TypeError(
                f"save_checkpoint(strategy=...) expects a TrainingStrategy; got "
                f"{type(strategy).__name__}."
            )
        if models is not None or optimizers or schedulers:
            raise ValueError("save_checkpoint: pass either strategy=... or models=..., not both.")
        return _save_strategy(
            root, strategy, index, retention, metric, allow_spec_changes, reason, rank_zero_only
        )
    if models is None:
        raise ValueError("save_checkpoint requires models=... or strategy=....")
    snapshot = capture_components(models, optimizers, schedulers, associations)
    snapshot.index, snapshot.metric, snapshot.reason = index, metric, reason
    if allow_spec_changes:
        snapshot.approved = ("*",)
    check_spec_changes(root, snapshot)
    return write_snapshot(root, snapshot, retention)


def _save_strategy(root, strategy, index, retention, metric, allow, reason, rank_zero_only) -> int:
    from nvalchemi.distributed.runtime import all_agree, broadcast_object, get_rank

    manager = strategy.distributed_manager
    agree_finite(strategy)
    states = gather_rng(manager)
    rank = get_rank(manager)
    result, error = None, None
    if rank == 0 or not rank_zero_only:
        try:
            snapshot = prepare_strategy_snapshot(
                root, strategy, reason=reason, metric=metric, rng_states=states, allow=allow
            )
            snapshot.index = index
            result = write_snapshot(root, snapshot, retention)
        except BaseException as exc:
            error = exc
    if all_agree(error is not None, manager):
        if error is not None:
            raise error
        raise RuntimeError("save_checkpoint failed on rank 0; see its error.")
    return broadcast_object(result, 0, manager) if rank_zero_only else result


def agree_finite(strategy: Any) -> None:
    """``strategy.check_nonfinite()`` on every rank; raise everywhere if any rank diverged."""
    from nvalchemi.distributed.runtime import all_agree

    error = None
    try:
        strategy.check_nonfinite()
    except ValueError as exc:
        error = exc
    if all_agree(error is not None, strategy.distributed_manager):
        if error is not None:
            raise error
        raise RuntimeError(
            "Another rank detected a non-finite training loss; no checkpoint was written "
            "(the previous checkpoints are kept)."
        )


def prepare_strategy_snapshot(
    root: Path,
    strategy: Any,
    *,
    reason: str,
    metric: Mapping[str, Any] | None,
    rng_states: list[dict[str, Any]] | None,
    allow: bool = False,
    buffers: Any = None,
) -> Any:
    """Capture ``strategy`` and check it against the root's latest specs (training thread)."""
    snapshot = capture_strategy(
        strategy, reason=reason, metric=metric, rng_states=rng_states, buffers=buffers
    )
    if allow:
        snapshot.approved = (*snapshot.approved, "*")
    check_spec_changes(root, snapshot)
    checkpoint_state_of(strategy)["history"] = []
    return snapshot


def _check_index(index: Any) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"checkpoint_index must be -1 or an int >= 0; got {index!r}.")
    return index


def _metric(metric: Any, name: str, mode: str) -> dict[str, Any] | None:
    if metric is None:
        return None
    if isinstance(metric, Mapping):
        value = metric.get("value")
        return {"name": str(metric.get("name", name)), "value": float(value), "mode": mode}
    return {"name": name, "value": float(metric), "mode": mode}


# ---------------------------------------------------------------------------- loading
def _open_checkpoint(
    root_folder: str | Path, checkpoint_index: Index = -1
) -> tuple[CheckpointManifest, ComponentPaths]:
    """The manifest of ``root_folder`` and the file paths of one of its checkpoints."""
    root = Path(root_folder)
    manifest = CheckpointManifest.read(root)
    return manifest, ComponentPaths(root, manifest.entry(checkpoint_index))


def _rebuild(cls, paths, manifest, map_location, hooks, training_fn, validators, trust,
             overrides, allow_spec_changes) -> dict[str, Any]:  # fmt: skip
    """Build the saved strategy as ``cls``, then restore its state; the loader's result."""
    meta = read_json(paths.strategy(), "strategy metadata")
    strategy, approved = build_strategy(
        cls, paths, meta, map_location, hooks, training_fn, trust, overrides
    )
    return restore_into(
        strategy, paths, manifest, map_location, validators, trust, allow_spec_changes, approved
    )


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
    """Load a checkpoint: into a live strategy, as a new strategy, or as components.

    Args:
        checkpoint_index: an index, ``-1``/``"latest"`` or ``"best"``.
        map_location: device for every tensor (default: the strategy's recorded device).
        model_names: load only these models (component form, no strategy).
        strategy: restore in place into this live strategy (its hooks receive their state).
        hooks / training_fn: for the rebuilt strategy (hooks are not saved; pass them
            again, e.g. ``[EMAHook(), CheckpointHook(...)]``, to restore their state).
        trust: allow spec paths outside the import allow-list (only for checkpoints you
            trust; tensor files are always read with ``weights_only=True``).
        overrides: changes for the rebuilt strategy: ``optimizer_kwargs`` /
            ``scheduler_kwargs`` (merged into every optimizer config),
            ``optimizer_configs`` (replaced), or constructor fields such as
            ``num_steps`` or ``validation_config``. Recorded in the manifest history.
        allow_spec_changes: accept a live strategy whose specs differ from the checkpoint.
        adapter: ``"mace"`` to import a MACE model file (pickle: trusted files only).

    Returns:
        For strategy checkpoints (or ``model_names``): ``{"strategy", "models": {name:
        {"model", "spec", "optimizers", "schedulers", "metadata"}}, "manifest",
        "checkpoint_index", "source", "strategy_metadata"}``. For component-only
        checkpoints: the :class:`CheckpointManifest` with ``(object, spec)`` tuples.
    """
    if adapter is not None:
        if strategy is not None:
            raise ValueError("load_checkpoint: adapter=... cannot restore into a strategy.")
        return load_adapter(root_folder, adapter, adapter_kwargs or {}, map_location)
    manifest, paths = _open_checkpoint(root_folder, checkpoint_index)
    meta_path = paths.strategy()
    if strategy is not None:
        if model_names is not None:
            raise ValueError("load_checkpoint: model_names cannot be combined with strategy=....")
        return restore_into(
            strategy, paths, manifest, map_location, validators, trust, allow_spec_changes, ()
        )
    if meta_path is not None and model_names is None:
        from nvalchemi.training.strategy import TrainingStrategy

        return _rebuild(
            TrainingStrategy, paths, manifest, map_location, hooks, training_fn, validators,
            trust, overrides, allow_spec_changes,
        )  # fmt: skip
    if overrides:
        raise ValueError("load_checkpoint: overrides apply to strategy checkpoints only.")
    return load_components(
        paths,
        manifest,
        map_location,
        model_names,
        trust,
        validators,
        has_metadata=meta_path is not None,
    )


# ---------------------------------------------------------------------------- models to use
def load_models_from_checkpoint(
    root_folder: str | Path,
    checkpoint_index: Index = "latest",
    map_location: Any = None,
    model_names: Sequence[str] | None = None,
    *,
    use_ema: bool = False,
    trust: bool = False,
) -> dict[str, nn.Module]:
    """Rebuild models from their specs and load their weights only (no strategy state).

    ``use_ema=True`` loads the EMA (averaged) weights where an ``EMAHook`` state for
    that model is stored, else the trained weights. The fine-tuning entry point and
    evaluation use this.
    """
    _, paths = _open_checkpoint(root_folder, checkpoint_index)
    entry = paths.entry
    names = list(entry.models) if model_names is None else list(model_names)
    unknown = sorted(set(names) - set(entry.models))
    if unknown:
        raise KeyError(f"Unknown model(s) {unknown}. Available: {sorted(entry.models)}")
    hook_states = None
    if use_ema and paths.hooks().is_file():
        hook_states = safe_torch_load(paths.hooks(), map_location)
    out = {}
    for name in names:
        spec = load_spec(paths.spec("models", name), trust=trust, expect=nn.Module)
        model = build_model(spec, map_location)
        state = ema_weights(hook_states, name) if hook_states is not None else None
        if state is None:
            state = safe_torch_load(paths.state("models", name), map_location)
        model.load_state_dict(state, strict=True)
        out[name] = model.eval()
    return out


def load_model_from_checkpoint(
    path: str | Path,
    map_location: Any = None,
    model_key: str = "main",
    *,
    use_ema: bool = True,
    checkpoint_index: Index = "latest",
    trust: bool = False,
) -> nn.Module:
    """One model, in eval mode, from a checkpoint root (EMA weights by default if saved).

    Example:
        >>> model = load_model_from_checkpoint("runs/x/checkpoints", map_location="cpu")  # doctest: +SKIP
    """
    return load_models_from_checkpoint(
        path, checkpoint_index, map_location, [model_key], use_ema=use_ema, trust=trust
    )[model_key]


def read_strategy_metadata(
    root_folder: str | Path, checkpoint_index: Index = "latest"
) -> dict | None:
    """The saved strategy recipe (``to_checkpoint_dict()`` output) or ``None``; loads no tensors."""
    meta = _open_checkpoint(root_folder, checkpoint_index)[1].strategy()
    return None if meta is None else read_json(meta, "strategy metadata")


# ---------------------------------------------------------------------------- strategy methods
def strategy_save_checkpoint(
    strategy: Any, root_folder: str | Path, *, checkpoint_index: int = -1, **kwargs: Any
) -> int:
    """``TrainingStrategy.save_checkpoint``: a restartable checkpoint of ``strategy``."""
    return save_checkpoint(
        root_folder, strategy=strategy, checkpoint_index=checkpoint_index, **kwargs
    )


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
    result = load_checkpoint(
        root_folder,
        checkpoint_index,
        map_location,
        strategy=strategy,
        validators=validators,
        trust=trust,
        allow_spec_changes=allow_spec_changes,
    )
    if result.get("strategy") is not strategy:
        raise ValueError("restore_checkpoint: the loader did not restore into this strategy.")
    return result


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
    manifest, paths = _open_checkpoint(root_folder, checkpoint_index)
    if paths.strategy() is None:
        raise ValueError(
            f"{cls.__name__}.load_checkpoint requires a checkpoint saved from a TrainingStrategy "
            f"(checkpoint {paths.entry.index} in {paths.root} holds components only); use "
            "load_checkpoint(...) or load_model_from_checkpoint(...)."
        )
    return _rebuild(
        cls, paths, manifest, map_location, hooks, training_fn, validators, trust, overrides,
        allow_spec_changes,
    )["strategy"]  # fmt: skip
