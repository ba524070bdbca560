"""Checkpoint and exit cleanly when a cluster is about to preempt the job.

Slurm (``#SBATCH --signal=USR1@120`` or ``scancel --signal``), Kubernetes and most
schedulers send ``SIGTERM`` or ``SIGUSR1`` some time before they kill a job.
:class:`PreemptionHandler` turns that signal into a clean stop:

1. the handler only records the signal (nothing else happens inside it);
2. after the current optimizer step (never inside a gradient-accumulation window) every
   rank agrees to stop (``all_agree``), and the strategy is asked to stop
   (:meth:`~nvalchemi.training.TrainingStrategy.request_stop`);
3. when training ends, a checkpoint is written through the registered
   :class:`~nvalchemi.training.hooks.CheckpointHook` (or into ``preemption_dir``) and
   flushed, all ranks wait, and the process exits with :data:`PREEMPTION_EXIT_CODE`
   (75, ``EX_TEMPFAIL``) so a job script can requeue itself.

Resuming with ``TrainingStrategy.load_checkpoint(dir)`` continues exactly.

Example:
    >>> handler = PreemptionHandler()
    >>> handler.exit_code
    75
    >>> strategy = TrainingStrategy(..., hooks=[CheckpointHook("ckpt", step_interval=100),
    ...                                         handler])  # doctest: +SKIP

Signal handlers are installed when the strategy's run starts (main thread only) and
the previous handlers are restored when it ends.
"""

from __future__ import annotations

import signal
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nvalchemi.distributed.runtime import all_agree, barrier, get_world_size
from nvalchemi.training.checkpoint import save_checkpoint
from nvalchemi.training.hooks.checkpoint import CheckpointHook
from nvalchemi.training.stages import TrainingStage

__all__ = ["PREEMPTION_EXIT_CODE", "PreemptionHandler", "PreemptionHook"]

PREEMPTION_EXIT_CODE = 75
"""Exit status after a preemption checkpoint (``EX_TEMPFAIL``: try again later)."""

_S = TrainingStage
_DEFAULT_SIGNALS = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None
)


class PreemptionHandler:
    """Stop after the current step on ``SIGTERM``/``SIGUSR1``, checkpoint, and exit.

    Args:
        preemption_dir: checkpoint root for the preemption checkpoint; default: the
            directory of the strategy's ``CheckpointHook`` (one of them is required).
        signals: signals that mean "about to be preempted".
        exit_code: process exit status after the checkpoint (``None`` or ``exit=False``:
            return from ``run()`` normally; check :attr:`preempted`).
        exit: raise ``SystemExit(exit_code)`` after the checkpoint.
        check_interval: under ``torch.distributed``, agree on the signal every this many
            optimizer steps (one tiny all-reduce each); a single process checks every step.
    """

    frequency = 1
    stage = None

    def __init__(
        self,
        preemption_dir: str | Path | None = None,
        *,
        signals: Sequence[int] = _DEFAULT_SIGNALS,
        exit_code: int = PREEMPTION_EXIT_CODE,
        exit: bool = True,
        check_interval: int = 1,
    ) -> None:
        if (
            isinstance(check_interval, bool)
            or not isinstance(check_interval, int)
            or check_interval < 1
        ):
            raise ValueError(f"check_interval must be an int >= 1; got {check_interval!r}.")
        if not signals:
            raise ValueError("signals must name at least one signal (e.g. signal.SIGTERM).")
        self.preemption_dir = None if preemption_dir is None else Path(preemption_dir)
        self.signals = tuple(int(s) for s in signals)
        self.exit_code = int(exit_code)
        self.exit = bool(exit)
        self.check_interval = check_interval
        self.preempted = False
        self.checkpoint_index: int | None = None
        self._received: int | None = None
        self._stopping = False
        self._previous: dict[int, Any] = {}
        self._last_step = -1
        self._world_size = 1

    # ------------------------------------------------------------------ signals
    @property
    def signal_received(self) -> int | None:
        """The signal number received during the current run, or ``None``."""
        return self._received

    def trigger(self, signum: int = signal.SIGTERM) -> None:
        """Act as if ``signum`` was received (e.g. from a custom time-limit check)."""
        self._received = int(signum)

    def _handle(self, signum: int, frame: Any) -> None:
        self._received = int(signum)

    def __enter__(self) -> PreemptionHandler:
        self._received = None
        self._stopping = False
        self.preempted = False
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "PreemptionHandler: the strategy runs outside the main thread, where signal "
                "handlers cannot be installed; call trigger() to stop it instead.",
                UserWarning,
                stacklevel=2,
            )
            return self
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    # ------------------------------------------------------------------ stages
    def _runs_on_stage(self, stage: Any) -> bool:
        return stage in (_S.SETUP, _S.AFTER_BATCH, _S.AFTER_VALIDATION, _S.AFTER_TRAINING)

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        strategy = ctx.workflow
        if stage is _S.AFTER_BATCH:
            step = ctx.step_count
            if step > self._last_step:  # only at optimizer-step boundaries
                self._last_step = step
                if self._world_size > 1 and step % self.check_interval:
                    return
                self._maybe_stop(strategy)
        elif stage is _S.AFTER_VALIDATION:
            if not self._stopping:
                self._maybe_stop(strategy)
        elif stage is _S.AFTER_TRAINING:
            self._finish(strategy)
        elif stage is _S.SETUP:
            self._last_step = strategy.step_count
            self._world_size = get_world_size(strategy.distributed_manager)
            self._checkpoint_hook(strategy)  # fail early without a destination

    def _maybe_stop(self, strategy: Any) -> None:
        received = self._received is not None
        if self._world_size > 1:
            received = all_agree(received, strategy.distributed_manager)
        if received:
            self._stopping = True
            name = _signal_name(self._received)
            strategy.request_stop(f"preemption: received {name}; checkpointing and exiting")

    def _finish(self, strategy: Any) -> None:
        if not (
            self._stopping or all_agree(self._received is not None, strategy.distributed_manager)
        ):
            return
        hook = self._checkpoint_hook(strategy)
        if hook is not None:
            hook.save(strategy, reason="preemption")
            self.checkpoint_index = hook.flush()
        else:
            self.checkpoint_index = save_checkpoint(
                self.preemption_dir, strategy=strategy, reason="preemption"
            )
        barrier(strategy.distributed_manager)
        self.preempted = True
        if self.exit and self._stopping:
            raise SystemExit(self.exit_code)

    def _checkpoint_hook(self, strategy: Any) -> Any:
        if self.preemption_dir is not None:
            return None

        for hook in strategy.hooks:
            if isinstance(hook, CheckpointHook):
                return hook
        raise ValueError(
            "PreemptionHandler needs somewhere to write its checkpoint: register a "
            "CheckpointHook with the strategy or pass PreemptionHandler(preemption_dir=...)."
        )

    def __repr__(self) -> str:
        names = [_signal_name(s) for s in self.signals]
        return f"PreemptionHandler(preemption_dir={self.preemption_dir}, signals={names})"


PreemptionHook = PreemptionHandler
"""Alias: the handler is registered as a hook."""


def _signal_name(signum: int | None) -> str:
    if signum is None:
        return "a preemption request"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
