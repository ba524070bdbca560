"""Stop signals while a run is set up: a clear message and exit status 75, not a traceback.

Setting up a run can take minutes; :class:`SetupSignals` turns ``SIGTERM``/``SIGUSR1`` then
into a message that nothing was trained or saved and exit status 75, so a job script that
requeues on 75 runs the same command again. ``spec run``/``spec resume`` install it first
thing, before the job is read and checked (which imports the user's modules and torch).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SetupSignals"]


class _StoppedDuringSetup(BaseException):
    """A stop signal before the first step (a ``BaseException``: no ``except Exception`` eats it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SetupSignals:
    """``SIGTERM``/``SIGUSR1`` while a run is set up: a clear message and exit status 75.

    Once training started (:meth:`training_started`), the run's ``PreemptionHandler`` owns
    the signals (checkpoint, then 75); without one, a signal acts as without this guard.
    """

    def __init__(self, console: Any = None) -> None:
        self.console = console
        self.training = False
        self._previous: dict[int, Any] = {}

    @classmethod
    def on_main_rank(cls, console: Any = None) -> SetupSignals:
        """Handlers whose message ``console`` prints on the launch's main rank only."""
        from nvalchemi.distributed.launch import detect_launch_env

        try:
            main_rank = detect_launch_env().rank == 0
        except ValueError:
            main_rank = True  # the launch error is raised with its fix once the run starts
        return cls(console if main_rank else None)

    def __enter__(self) -> SetupSignals:
        import signal
        import threading

        from nvalchemi.training.preemption import PreemptionHandler

        if threading.current_thread() is threading.main_thread():
            for signum in PreemptionHandler().signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def training_started(self) -> None:
        self.training = True

    def _handle(self, signum: int, frame: Any) -> None:
        import os

        if not self.training:
            raise _StoppedDuringSetup(signum)
        self._restore()  # as without this guard: e.g. the default action (exit 143)
        os.kill(os.getpid(), signum)

    def _restore(self) -> None:
        import signal

        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._restore()
        if not isinstance(exc, _StoppedDuringSetup):
            return
        import signal

        from nvalchemi.training.preemption import PREEMPTION_EXIT_CODE

        if self.console is not None:
            name = signal.Signals(exc.signum).name
            self.console.print(
                f"Stopped by {name} while setting up (checking the job, reading data, "
                "statistics, neighbour lists), before the first training step: nothing was "
                "trained or saved, so "
                "nothing needs resuming; run the same command again to start. Exit status "
                f"{PREEMPTION_EXIT_CODE}.",
                markup=False,
                soft_wrap=True,
            )
        raise SystemExit(PREEMPTION_EXIT_CODE) from None
