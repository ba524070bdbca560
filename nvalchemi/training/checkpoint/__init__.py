"""Checkpoints: save a run, resume it exactly, load its models to use.

A checkpoint root is self-describing (manifest, per-model spec and weights, optimizer and
scheduler states, the strategy recipe and counters, hook states, RNG states). Guarantees:

* **Exact resume**: a strategy checkpoint holds everything the run needs to continue as if
  never stopped (weights and EMA weights, optimizer/scheduler states, counters, hence the
  loss-weight schedule position and the loader position, per-rank RNG states, early
  stopping, update-hook and GradScaler states).
* **Crash safety and nothing deleted that is not ours**: see
  :mod:`~nvalchemi.training.checkpoint.store` (one writer per root, atomic commits,
  errors naming the checkpoint and the path, retention that deletes only its own folders).
* **Safe loading**: tensors are read with ``torch.load(weights_only=True)`` only, and every
  dotted path in a spec goes through the trust rule of :mod:`nvalchemi._serialization`
  (your own already-imported code loads; ``trust=True`` lifts the rule).
* **Explicit changes**: changing e.g. the learning rate when resuming needs
  ``overrides=...`` or ``allow_spec_changes=True`` and is recorded in the manifest.

The package: :mod:`.store` (the on-disk store, which knows nothing of training; its read
side, with the models a checkpoint holds, is :mod:`nvalchemi.checkpoint_files`),
:mod:`.parts` (what a strategy checkpoint is made of, read both ways), :mod:`.save` (the
one save routine), :mod:`.load` (the one load routine), :mod:`.rng` (RNG states).

Example:
    >>> strategy.save_checkpoint("runs/x/checkpoints")  # doctest: +SKIP
    >>> strategy = TrainingStrategy.load_checkpoint(  # doctest: +SKIP
    ...     "runs/x/checkpoints", map_location="cuda",
    ...     overrides={"optimizer_kwargs": {"lr": 1e-4}})
    >>> model = load_model_from_checkpoint("runs/x/checkpoints", use_ema=True)  # doctest: +SKIP

Distributed runs: the strategy form of :func:`save_checkpoint` is collective (call it on
every rank; rank 0 writes, every rank waits); load on every rank with its ``map_location``.
"""

from nvalchemi._lazy import lazy_exports

_STORE = "nvalchemi.training.checkpoint.store"
_LOAD = "nvalchemi.training.checkpoint.load"
_EXPORTS = {
    "CURRENT_SCHEMA_VERSION": _STORE,
    "CheckpointEntry": _STORE,
    "CheckpointLockError": _STORE,
    "CheckpointManifest": _STORE,
    "CheckpointRootError": _STORE,
    "CheckpointStore": _STORE,
    "CheckpointWriteError": _STORE,
    "UnsafeCheckpointError": _STORE,
    "load_model_from_checkpoint": "nvalchemi.checkpoint_files",
    "load_models_from_checkpoint": "nvalchemi.checkpoint_files",
    "CheckpointValidator": _LOAD,
    "check_finite_weights": _LOAD,
    "load_checkpoint": _LOAD,
    "read_strategy_metadata": _LOAD,
    "strategy_load_checkpoint": _LOAD,
    "strategy_restore_checkpoint": _LOAD,
    "save_checkpoint": "nvalchemi.training.checkpoint.save",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
