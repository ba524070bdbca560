"""One rank of a multi-process CLI test: run ``nvalchemi-training ARGS``, report the exit code.

Started by :func:`_ranks.run_ranks` (with launcher variables of the test's choice, e.g.
Slurm's); prints one ``RESULT {json}`` line with the rank's exit status and the size of
the process group the command trained in (0: none).
"""

from __future__ import annotations

import os
import sys

from _ranks import report

from nvalchemi.training.cli import main

if __name__ == "__main__":
    try:
        main(sys.argv[1:], prog_name="nvalchemi-training")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    import torch.distributed as dist

    group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0
    report(rank=os.environ.get("SLURM_PROCID", os.environ.get("RANK")), code=code, group=group)
    sys.exit(code)
