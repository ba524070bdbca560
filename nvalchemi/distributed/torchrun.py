"""``torchrun`` that keeps the preemption exit status: ``python -m nvalchemi.distributed.torchrun``.

When its workers fail, ``torchrun`` exits with 1 whatever their exit statuses were.
After a preemption every rank checkpoints and exits with
:data:`~nvalchemi.training.preemption.PREEMPTION_EXIT_CODE` (75), so a job script
that requeues itself on 75 never does under plain ``torchrun``. This launcher takes
exactly torchrun's arguments and runs it in the same process; when the workers that
failed exited with 75 (see :func:`exit_status`), it exits with 75 too (otherwise as
torchrun: 0 or 1)::

    srun python -m nvalchemi.distributed.torchrun --nnodes 2 --nproc_per_node 4 \\
        --rdzv_backend c10d --rdzv_endpoint "$head:29500" --rdzv_id "$SLURM_JOB_ID" \\
        -m nvalchemi.training.cli spec run job.yaml
    [ $? -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"

"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["PREEMPTED", "exit_status", "main"]

PREEMPTED = 75
"""The workers' preemption exit status (``PREEMPTION_EXIT_CODE``, ``EX_TEMPFAIL``)."""


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``torch.distributed.run`` with ``argv`` (default: this process's arguments)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(list(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as exc:
        codes = [failure.exitcode for failure in exc.failures.values()]
        status = exit_status(codes)
        if status == PREEMPTED:
            print(
                f"nvalchemi.distributed.torchrun: the workers exited with {PREEMPTED} "
                "(preempted after a checkpoint); exiting with it so the job can requeue",
                file=sys.stderr,
            )
        else:
            print(str(exc), file=sys.stderr)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
