"""The one save routine: :func:`save_strategy`, used by ``save_checkpoint``,
``TrainingStrategy.save_checkpoint``, ``CheckpointHook`` and the preemption handler.

A save is collective under ``torch.distributed`` (call it on every rank at the same point):

1. every rank checks its non-finite loss record and all agree, so a diverged run never
   overwrites good checkpoints;
2. every rank's RNG state is gathered;
3. the writing rank (global rank 0, or every rank with ``rank_zero_only=False``) copies
   the state to CPU memory (:func:`~nvalchemi.training.checkpoint.parts.capture_strategy`)
   and checks its specs against the latest checkpoint of the root;
4. the store writes it, inline or on a :class:`BackgroundWriter` thread while training
   goes on; an error on the writing rank is raised on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nvalchemi.distributed.runtime import all_agree, broadcast_object, get_rank
from nvalchemi.training.checkpoint.parts import (
    Snapshot,
    SnapshotBuffers,
    capture_components,
    capture_strategy,
    checkpoint_record,
    history_event,
)
from nvalchemi.training.checkpoint.rng import gather_rng
from nvalchemi.training.checkpoint.store import (
    CheckpointStore,
    EntryFiles,
    Retention,
    format_differences,
    read_json,
    spec_differences,
    unapproved,
)

__all__ = ["BackgroundWriter", "save_checkpoint", "save_strategy", "strategy_save_checkpoint"]


def save_strategy(
    root: str | Path,
    strategy: Any,
    *,
    reason: str = "manual",
    metric: Mapping[str, Any] | None = None,
    retention: Retention | None = None,
    index: int | None = None,
    allow_spec_changes: bool = False,
    rank_zero_only: bool = True,
    writer: BackgroundWriter | None = None,
    buffers: SnapshotBuffers | None = None,
    on_written: Callable[[int], None] | None = None,
) -> int | None:
    """Save a restartable checkpoint of ``strategy`` into ``root`` (collective; see above).

    Returns the index written, or ``None`` when ``writer`` writes it in the background
    (``on_written(index)`` is called when it is done).
    """
    manager = strategy.distributed_manager
    _agree_finite(strategy)
    states = gather_rng(manager)
    store = CheckpointStore(root)
    result, error = None, None
    if get_rank(manager) == 0 or not rank_zero_only:
        try:
            if writer is not None:
                writer.wait()  # the previous write first: indices stay ordered, buffers free
            snapshot = capture_strategy(
                strategy,
                reason=reason,
                metric=dict(metric) if metric else None,
                rng_states=states,
                buffers=buffers,
            )
            if allow_spec_changes:
                snapshot.approved = (*snapshot.approved, "*")
            check_spec_changes(store, snapshot)
            checkpoint_record(strategy)["history"] = []
            if writer is not None:
                writer.submit(_write, store, snapshot, retention, index, on_done=on_written)
            else:
                result = _write(store, snapshot, retention, index)
                if on_written is not None:
                    on_written(result)
        except BaseException as exc:
            error = exc
    if all_agree(error is not None, manager):
        if error is not None:
            raise error
        raise RuntimeError("Saving the checkpoint failed on the writing rank; see its error.")
    if writer is None and rank_zero_only:
        return broadcast_object(result, 0, manager)
    return result


def _write(store: CheckpointStore, snapshot: Snapshot, retention: Any, index: int | None) -> int:
    return store.write(
        snapshot.files,
        entry=snapshot.entry,
        top=snapshot.top,
        retention=retention,
        index=index,
        history=snapshot.history,
    )


def _agree_finite(strategy: Any) -> None:
    """``strategy.check_nonfinite()`` on every rank; raise everywhere if any rank diverged."""
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


def check_spec_changes(store: CheckpointStore, snapshot: Snapshot) -> None:
    """Compare ``snapshot``'s specs with the latest checkpoint of ``store``.

    Unapproved differences raise ``ValueError`` naming the fields; approved ones are
    recorded as a ``spec_change`` event in the snapshot's history.
    """
    manifest = store.manifest()
    if manifest is None or not manifest.checkpoints:
        return
    latest = manifest.entry("latest")
    files = EntryFiles(store.root, latest)
    diffs = []
    for key, spec in snapshot.specs().items():
        kind, name = key.split("/", 1)
        path = files.spec(kind, name)
        if name in getattr(latest, kind, []) and path.is_file():
            diffs.extend(spec_differences(read_json(path, "spec file"), spec, key))
    if not diffs:
        return
    refused = unapproved(diffs, snapshot.approved)
    if refused:
        raise ValueError(
            f"The specs being saved disagree with checkpoint {latest.index} in {store.root}. "
            f"Differing fields: {format_differences(refused)}. Resume with TrainingStrategy."
            "load_checkpoint(..., overrides={'optimizer_kwargs': {...}}) or "
            "allow_spec_changes=True to change settings (recorded in the manifest history), or "
            "use a new checkpoint directory."
        )
    snapshot.history.append(
        history_event(
            "spec_change",
            previous_index=latest.index,
            step_count=snapshot.entry.get("step_count"),
            changes=[{"field": p, "old": a, "new": b} for p, a, b in diffs],
        )
    )


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
          (specs may be omitted for models that ``model_spec_for`` can describe).

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
        CheckpointWriteError / CheckpointLockError / CheckpointRootError: see the store.
    """
    if _is_strategy(models):
        models, strategy = None, models
    if (
        isinstance(checkpoint_index, bool)
        or not isinstance(checkpoint_index, int)
        or checkpoint_index < -1
    ):
        raise ValueError(f"checkpoint_index must be -1 or an int >= 0; got {checkpoint_index!r}.")
    index = None if checkpoint_index == -1 else checkpoint_index
    retention = Retention(keep_last, keep_best, best_metric, best_mode)
    if isinstance(metric, Mapping):
        metric = {
            "name": str(metric.get("name", best_metric)),
            "value": float(metric["value"]),
            "mode": best_mode,
        }
    elif metric is not None:
        metric = {"name": best_metric, "value": float(metric), "mode": best_mode}
    if strategy is not None:
        if not _is_strategy(strategy):
            raise TypeError(
                f"save_checkpoint(strategy=...) expects a TrainingStrategy; got {type(strategy).__name__}."
            )
        if models is not None or optimizers or schedulers:
            raise ValueError("save_checkpoint: pass either strategy=... or models=..., not both.")
        return save_strategy(
            root_folder,
            strategy,
            reason=reason,
            metric=metric,
            retention=retention,
            index=index,
            allow_spec_changes=allow_spec_changes,
            rank_zero_only=rank_zero_only,
        )
    if models is None:
        raise ValueError("save_checkpoint requires models=... or strategy=....")
    snapshot = capture_components(models, optimizers, schedulers, associations)
    snapshot.entry.update(reason=reason, metric=metric)
    if allow_spec_changes:
        snapshot.approved = ("*",)
    store = CheckpointStore(root_folder)
    check_spec_changes(store, snapshot)
    return _write(store, snapshot, retention, index)


def strategy_save_checkpoint(
    strategy: Any, root_folder: str | Path, *, checkpoint_index: int = -1, **kwargs: Any
) -> int:
    """``TrainingStrategy.save_checkpoint``: a restartable checkpoint of ``strategy``.

    Collective under ``torch.distributed``; the keyword arguments are those of
    :func:`save_checkpoint` (``keep_last``, ``metric``, ``allow_spec_changes``, ...).
    """
    return save_checkpoint(
        root_folder, strategy=strategy, checkpoint_index=checkpoint_index, **kwargs
    )


def _is_strategy(value: Any) -> bool:
    """A ``TrainingStrategy`` (or subclass), told by its checkpoint methods (no import cycle)."""
    return callable(getattr(value, "to_checkpoint_dict", None)) and hasattr(
        value, "optimizer_configs"
    )


class BackgroundWriter:
    """Runs checkpoint writes one at a time, on a thread (``asynchronous``) or inline.

    :meth:`submit` waits for the previous write first (indices stay ordered) and re-raises
    its error; :meth:`wait` collects the last one; :meth:`close` waits and stops the thread.
    """

    def __init__(self, asynchronous: bool = True) -> None:
        self.asynchronous = asynchronous
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._on_done: Callable[[Any], None] | None = None

    def submit(
        self, fn: Callable[..., Any], *args: Any, on_done: Callable[[Any], None] | None = None
    ) -> None:
        """Run ``fn(*args)`` after the previous write; ``on_done(result)`` when it finishes."""
        self.wait()
        if not self.asynchronous:
            result = fn(*args)
            if on_done is not None:
                on_done(result)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="nvalchemi-checkpoint")
        self._future, self._on_done = self._executor.submit(fn, *args), on_done

    def wait(self) -> None:
        """Block until the in-flight write (if any) finished; re-raise its error."""
        future, self._future = self._future, None
        if future is None:
            return
        result = future.result()
        if self._on_done is not None:
            self._on_done(result)

    def close(self) -> None:
        """Wait for the in-flight write and stop the thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
