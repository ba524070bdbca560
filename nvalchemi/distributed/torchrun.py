"""``torchrun`` for preemptible jobs: ``python -m nvalchemi.distributed.torchrun``.

Plain ``torchrun`` breaks the two things a requeueing job script relies on:

* A scheduler's warning signal reaches the launcher, not (only) the workers: Slurm's
  ``#SBATCH --signal=USR1@180`` signals every task of the step, i.e. the launcher,
  and torchrun's agent has no ``SIGUSR1`` handler, so it dies (exit 138) while its
  workers train on, orphaned, without a checkpoint. On ``SIGTERM`` it stops the
  workers itself and exits with 1.
* When its workers fail, torchrun exits with 1 whatever their exit statuses were.
  After a preemption every rank checkpoints and exits with
  :data:`~nvalchemi.training.preemption.PREEMPTION_EXIT_CODE` (75), so
  ``[ $? -eq 75 ] && scontrol requeue`` never fires.

This launcher takes exactly torchrun's arguments and runs it in the same process. It
forwards ``SIGUSR1`` and ``SIGTERM`` to the workers (its child processes) and keeps
watching them: they stop after their current step, checkpoint and exit with 75. When
the workers that failed exited with 75 (see :func:`exit_status`), it exits with 75 too
(otherwise as torchrun: 0 or 1). A signal that comes while no worker runs (before they
start) ends the launcher with 75 at once: nothing was trained, a requeue runs the same
command again::

    srun python -m nvalchemi.distributed.torchrun --nnodes 2 --nproc_per_node 4 \\
        --rdzv_backend c10d --rdzv_endpoint "$head:29500" --rdzv_id "$SLURM_JOB_ID" \\
        -m nvalchemi.training.cli spec run job.yaml
    [ $? -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"

Forwarding ``SIGTERM`` needs torch >= 2.9 (``--signals-to-handle``; older torchrun
takes ``SIGTERM`` over when it starts the workers) and Linux (``/proc`` lists the
workers); ``SIGUSR1`` is forwarded with any torch. Other signals (``SIGINT``,
``SIGHUP``, ``SIGQUIT``) stop the workers as torchrun does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["FORWARDED_SIGNALS", "PREEMPTED", "exit_status", "main", "worker_pids"]

PREEMPTED = 75
"""The workers' preemption exit status (``PREEMPTION_EXIT_CODE``, ``EX_TEMPFAIL``)."""

FORWARDED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name)
)
"""Signals passed on to the workers (the ones ``PreemptionHandler`` turns into a checkpoint)."""

_PREFIX = "nvalchemi.distributed.torchrun: "


def exit_status(worker_codes: Sequence[int]) -> int:
    """This launcher's status for the exit statuses of the workers that failed.

    75 when some worker exited with 75 and every other failed worker was ended by a
    signal (negative status): torchrun stops the remaining workers with ``SIGTERM`` as
    soon as the first one has exited, which can catch a rank on its way out of the same
    preemption (its checkpoint is complete: the ranks wait for it before exiting).
    Any other exit status (an error) makes it 1.

    >>> exit_status([75, 75]), exit_status([75, -15]), exit_status([75, 1]), exit_status([-15])
    (75, 75, 1, 1)
    """
    codes = set(worker_codes)
    if PREEMPTED in codes and all(code == PREEMPTED or code < 0 for code in codes):
        return PREEMPTED
    return 1


def worker_pids(parent: int | None = None) -> list[int] | None:
    """The process ids of ``parent``'s children (default: this process), from ``/proc``.

    torchrun starts each worker as a direct child of its agent. ``None`` where there is
    no ``/proc`` (not Linux).

    >>> os.getpid() in worker_pids(os.getppid())
    True
    """
    parent = os.getpid() if parent is None else int(parent)
    try:
        entries = os.scandir("/proc")
    except OSError:
        return None
    pids = []
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 1 and fields[1] == str(parent):
                pids.append(int(entry.name))
    return pids


def _say(text: str) -> None:
    # os.write, not print: a signal handler may interrupt a write to sys.stderr.
    with contextlib.suppress(OSError):
        os.write(2, f"{_PREFIX}{text}\n".encode())


class _Forwarder:
    """The launcher's handler of :data:`FORWARDED_SIGNALS`: pass them on to the workers."""

    def __init__(self) -> None:
        self.stopped_by: int | None = None  # a signal that came while no worker ran
        self.signal_exception: type[BaseException] | None = None  # torch's, once imported

    def __call__(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        pids = worker_pids()
        if pids:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            _say(
                f"received {name}; passed it on to the workers (pids "
                f"{', '.join(map(str, pids))}): they stop after the current step, "
                f"checkpoint and exit with {PREEMPTED}"
            )
            return
        if self.signal_exception is None:  # torch is still being imported: nothing started
            _say(f"received {name} before starting the workers; exiting with {PREEMPTED}")
            raise SystemExit(PREEMPTED)
        if pids is not None:
            self.stopped_by = signum
        # torchrun's own way out: its agent stops whatever it started, then re-raises
        raise self.signal_exception(f"{_PREFIX}received {name}", sigval=signal.Signals(signum))

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Forwarder]:
        previous = {signum: signal.signal(signum, self) for signum in FORWARDED_SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _leave_forwarded_signals_to_us(args: Any) -> None:
    """Drop :data:`FORWARDED_SIGNALS` from torchrun's ``--signals-to-handle`` (torch >= 2.9).

    torchrun installs its handlers for that list when it starts the workers, over ours.
    """
    if not hasattr(args, "signals_to_handle"):
        return
    ours = {s.name for s in FORWARDED_SIGNALS}
    names = [n.strip() for n in str(args.signals_to_handle).split(",") if n.strip()]
    kept = [n for n in names if n not in ours]
    args.signals_to_handle = ",".join(kept or ["SIGINT"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: this process's arguments); return the status."""
    forwarder = _Forwarder()
    with forwarder.installed():
        # imported here, after the handlers: importing torch takes seconds
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
        from torch.distributed.run import parse_args, run

        forwarder.signal_exception = SignalException
        try:
            args = parse_args(list(sys.argv[1:] if argv is None else argv))
            _leave_forwarded_signals_to_us(args)
            record(run)(args)
        except ChildFailedError as exc:
            codes = [failure.exitcode for failure in exc.failures.values()]
            status = exit_status(codes)
            if status == PREEMPTED:
                _say(
                    f"the workers exited with {PREEMPTED} (preempted after a checkpoint); "
                    "exiting with it so the job can requeue"
                )
            else:
                print(str(exc), file=sys.stderr)
            return status
        except SignalException:
            if forwarder.stopped_by is None:
                raise
            name = signal.Signals(forwarder.stopped_by).name
            _say(
                f"received {name} while no worker was running: nothing to checkpoint; "
                f"exiting with {PREEMPTED} so the job can requeue"
            )
            return PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
