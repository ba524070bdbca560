"""Periodic, crash-safe, asynchronous training checkpoints: :class:`CheckpointHook`.

Example:
    >>> hook = CheckpointHook("runs/example/checkpoints", epoch_interval=1, keep_last=3)
    >>> hook.async_save, hook.rank_zero_only
    (True, True)
"""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from nvalchemi.distributed.runtime import all_agree, broadcast_object, get_rank
from nvalchemi.training.checkpoint.parts import SnapshotBuffers, checkpoint_record
from nvalchemi.training.checkpoint.save import BackgroundWriter, save_strategy
from nvalchemi.training.checkpoint.store import CheckpointStore, Retention
from nvalchemi.training.stages import TrainingStage

__all__ = ["CheckpointHook"]

_S = TrainingStage
_MISSING: Any = object()


class CheckpointHook(BaseModel):
    """Save restartable strategy checkpoints every N steps or epochs.

    A save is due when an optimizer step actually taken brings ``step_count`` to a
    multiple of ``step_interval`` (vetoed or accumulating batches never re-trigger it),
    or an epoch count reaches a multiple of ``epoch_interval``. Inside ``run()`` it is
    written at the next batch boundary, so it also holds the epoch end, validation,
    metric-driven schedulers and early stopping: resuming continues exactly like the
    uninterrupted run (``train_batch()`` outside ``run()`` saves right after the batch).
    Never inside a gradient-accumulation window, whose partial gradients are not saved:
    a due save waits for the window's optimizer step, the train-end save is skipped with
    a warning, an explicit :meth:`save` warns.

    After each validation the ``best_metric`` value is recorded on that step's
    checkpoint; with ``keep_best`` a validation among the best ``keep_best`` triggers a
    save. Load them with ``checkpoint_index="latest"``/``"best"``.

    Saves go through :func:`~nvalchemi.training.checkpoint.save.save_strategy`: the ranks
    agree that the loss is finite, the writing rank copies the state into CPU buffers
    kept between saves and, with ``async_save``, a background thread writes it (at most
    one write in flight). The writing rank holds the root's writer lock for the whole
    run, so a second process writing the same root stops with an error naming this one.
    Pending writes are flushed when the run ends, also on errors.

    Args:
        checkpoint_dir: the checkpoint root.
        step_interval / epoch_interval: exactly one, > 0.
        keep_last / keep_best: retention of other / best checkpoints (``None``:
            unlimited / no best tracking).
        best_metric / best_mode: validation summary key and ``"min"``/``"max"``.
        save_on_train_end: also save when training ends (incl. a requested stop).
        async_save: write on a background thread.
        rank_zero_only: only global rank 0 writes (``False``: every rank, e.g. to
            node-local directories).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    frequency: ClassVar[int] = 1
    stage: ClassVar[Any] = None

    checkpoint_dir: Path
    step_interval: int | None = Field(default=None, gt=0)
    epoch_interval: int | None = Field(default=None, gt=0)
    keep_last: int | None = Field(default=None, ge=1)
    keep_best: int | None = Field(default=None, ge=1)
    best_metric: str = Field(default="total_loss", min_length=1)
    best_mode: Literal["min", "max"] = "min"
    save_on_train_end: bool = True
    async_save: bool = True
    rank_zero_only: bool = True
    last_checkpoint_index: int | None = Field(default=None, ge=0, exclude=True)

    _writer: Any = PrivateAttr(default=None)
    _buffers: Any = PrivateAttr(default=None)
    _lock: Any = PrivateAttr(default=None)
    _strategy: Any = PrivateAttr(default=None)
    _pending: tuple[str, Any] | None = PrivateAttr(default=None)
    _saved_at: tuple[int, int] | None = PrivateAttr(default=None)
    _last_step: int = PrivateAttr(default=-1)
    _scores: list[float] = PrivateAttr(default_factory=list)

    def __init__(self, checkpoint_dir: Any = _MISSING, **data: Any) -> None:
        if checkpoint_dir is not _MISSING:
            data["checkpoint_dir"] = checkpoint_dir
        super().__init__(**data)

    @model_validator(mode="after")
    def _one_interval(self) -> CheckpointHook:
        if (self.step_interval is None) == (self.epoch_interval is None):
            raise ValueError(
                "CheckpointHook requires exactly one of step_interval or epoch_interval; got "
                f"step_interval={self.step_interval}, epoch_interval={self.epoch_interval}."
            )
        return self

    def _runs_on_stage(self, stage: Any) -> bool:
        if stage is _S.AFTER_EPOCH:
            return self.epoch_interval is not None
        return stage in (
            _S.SETUP,
            _S.BEFORE_EPOCH,
            _S.BEFORE_BATCH,
            _S.AFTER_BATCH,
            _S.AFTER_VALIDATION,
            _S.AFTER_TRAINING,
        )

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        strategy = ctx.workflow
        if stage is _S.BEFORE_BATCH or stage is _S.BEFORE_EPOCH:
            if self._pending is not None and not strategy.accumulation_window_open:
                self._save(strategy)
        elif stage is _S.AFTER_BATCH:
            step = ctx.step_count
            if step > self._last_step:  # an optimizer step was taken in this batch
                self._last_step = step
                if self.step_interval is not None and step % self.step_interval == 0:
                    self._request("step")
            if (
                self._pending is not None
                and not strategy.running
                and not strategy.accumulation_window_open
            ):
                self._save(strategy)  # train_batch() outside run(): no later boundary to wait for
        elif stage is _S.AFTER_EPOCH:
            if ctx.epoch > 0 and ctx.epoch % self.epoch_interval == 0:
                self._request("epoch")
        elif stage is _S.AFTER_VALIDATION:
            self._on_validation(ctx)
        elif stage is _S.AFTER_TRAINING:
            wanted = self._pending is not None or (
                self.save_on_train_end and not self._is_saved(strategy)
            )
            if wanted and strategy.accumulation_window_open:
                self._pending = None
                _warn_window("the train-end checkpoint was not written", strategy)
            elif wanted:
                self._save(strategy, None if self._pending is not None else "train_end")
        elif stage is _S.SETUP:
            self._setup(strategy)

    def save(self, strategy: Any, *, reason: str = "manual") -> None:
        """Save ``strategy`` now unless its state is already saved (collective; warns in a window)."""
        if self._pending is not None or not self._is_saved(strategy):
            if strategy.accumulation_window_open:
                _warn_window("this checkpoint will not resume exactly", strategy)
            self._save(strategy, reason)

    def flush(self) -> int | None:
        """Wait for the in-flight write; return the latest checkpoint index written."""
        if self._writer is not None:
            self._writer.wait()
        return self.last_checkpoint_index

    def close(self) -> None:
        """Flush, stop the background writer, release the root's lock and the buffers."""
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.close()
        finally:
            self._buffers = None
            lock, self._lock = self._lock, None
            if lock is not None:
                lock.close()

    def __enter__(self) -> CheckpointHook:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        error: BaseException | None = None
        strategy = self._strategy
        try:
            if exc_type is None and self._pending is not None and strategy is not None:
                if strategy.accumulation_window_open:
                    self._pending = None
                    _warn_window("a pending checkpoint was not written", strategy)
                else:
                    self._save(strategy)
        except Exception as caught:
            error = caught
        try:
            self.close()  # always finish the in-flight write, also when the run failed
        except Exception as caught:
            error = error or caught
        if exc_type is not None:
            return  # the run's own error wins; other ranks may be gone: no collectives
        # Also the barrier: no rank goes on (e.g. reads the checkpoint) before the write ends.
        failed = strategy is not None and all_agree(error is not None, strategy.distributed_manager)
        if failed and error is None:
            raise RuntimeError("CheckpointHook: the final checkpoint write failed on another rank.")
        if error is not None:
            raise error

    def _writes_here(self, strategy: Any) -> bool:
        return not self.rank_zero_only or get_rank(strategy.distributed_manager) == 0

    def _setup(self, strategy: Any) -> None:

        self._strategy = strategy
        self._last_step = strategy.step_count
        self._pending = None
        store = CheckpointStore(self.checkpoint_dir)
        if self._writes_here(strategy) and self._lock is None:
            self._lock = contextlib.ExitStack()
            self._lock.enter_context(store.lock())  # fail now, not at the first save
        record = checkpoint_record(strategy)
        loaded = record.get("loaded_from") or {}
        if (
            loaded.get("root")
            and Path(loaded["root"]).resolve() == Path(self.checkpoint_dir).resolve()
        ):
            self._saved_at = (strategy.step_count, strategy.batch_count)
            self.last_checkpoint_index = loaded.get("index")
        with contextlib.suppress(Exception):  # a broken root is reported by the first save
            manifest = store.manifest()
            self._scores = [
                e.metric["value"]
                for e in (manifest.checkpoints if manifest else [])
                if (e.metric or {}).get("name") == self.best_metric
                and isinstance(e.metric.get("value"), float)
            ]
        _check_loader_seed(record.get("dataloader_state"), strategy.active_dataloader)

    def _request(self, reason: str) -> None:
        if self._pending is None:
            self._pending = (reason, None)

    def _is_saved(self, strategy: Any) -> bool:
        return self._saved_at == (strategy.step_count, strategy.batch_count)

    def _save(self, strategy: Any, reason: str | None = None) -> None:

        pending_reason, metric = self._pending or ("manual", None)
        self._pending = None
        self._strategy = strategy
        if self._writer is None:
            self._writer = BackgroundWriter(self.async_save)
            self._buffers = SnapshotBuffers()
        save_strategy(
            self.checkpoint_dir,
            strategy,
            reason=reason or pending_reason,
            metric=metric,
            retention=Retention(self.keep_last, self.keep_best, self.best_metric, self.best_mode),
            rank_zero_only=self.rank_zero_only,
            writer=self._writer,
            buffers=self._buffers,
            on_written=self._written,
        )
        self._saved_at = (strategy.step_count, strategy.batch_count)
        if metric is not None:
            self._scores.append(metric["value"])

    def _written(self, index: int) -> None:
        self.last_checkpoint_index = index

    def _on_validation(self, ctx: Any) -> None:
        strategy = ctx.workflow
        summary = ctx.validation or {}
        if self.best_metric not in summary:
            if self.keep_best:
                raise KeyError(
                    f"CheckpointHook(best_metric={self.best_metric!r}) is not in the validation "
                    f"summary; available: {sorted(k for k in summary if isinstance(k, str))}."
                )
            return
        value = float(summary[self.best_metric])
        metric = {"name": self.best_metric, "value": value, "mode": self.best_mode}
        if self._pending is not None:
            self._pending = (self._pending[0], metric)
        elif self._is_saved(strategy):
            self._attach(strategy, metric)
        elif self.keep_best and self._qualifies(value, strategy):
            self._pending = ("best", metric)

    def _attach(self, strategy: Any, metric: dict[str, Any]) -> None:
        self._scores.append(metric["value"])
        if not self._writes_here(strategy) or self._writer is None:
            return
        self._writer.wait()  # collects the index of the save this metric belongs to
        if self.last_checkpoint_index is not None:
            retention = Retention(self.keep_last, self.keep_best, self.best_metric, self.best_mode)
            store = CheckpointStore(self.checkpoint_dir)
            self._writer.submit(store.attach_metric, self.last_checkpoint_index, metric, retention)

    def _qualifies(self, value: float, strategy: Any) -> bool:
        if not math.isfinite(value):
            return False
        scores = sorted(self._scores, reverse=self.best_mode == "max")
        n = self.keep_best
        good = len(scores) < n or (
            value < scores[n - 1] if self.best_mode == "min" else value > scores[n - 1]
        )
        return bool(broadcast_object(good, 0, strategy.distributed_manager))


def _warn_window(what: str, strategy: Any) -> None:
    warnings.warn(
        f"CheckpointHook: training is inside a gradient-accumulation window (step "
        f"{strategy.step_count}, batch {strategy.batch_count}), whose partial gradients a "
        f"checkpoint cannot hold; {what}. End runs at optimizer-step boundaries (the "
        "strategy's request_stop() waits for the window to close).",
        RuntimeWarning,
        stacklevel=3,
    )


def _check_loader_seed(saved: Any, loader: Any) -> None:
    """A resumed run must shuffle like the saved one: compare the loader seeds."""
    if (
        not isinstance(saved, dict)
        or "seed" not in saved
        or not callable(getattr(loader, "state_dict", None))
    ):
        return
    try:
        current = loader.state_dict()
    except Exception:
        return
    if isinstance(current, dict) and "seed" in current and current["seed"] != saved["seed"]:
        raise ValueError(
            f"The checkpoint was saved with a data loader seeded {saved['seed']} but this run's "
            f"loader has seed={current['seed']}; build it with seed={saved['seed']} to resume "
            "with the same batch order."
        )
