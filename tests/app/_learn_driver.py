"""Run a learn job (``python _learn_driver.py JOB [PAUSE MARKER]``) for the kill tests.

``PAUSE`` is ``iteration:phase:done``: when the loop reports that progress, the driver
writes ``MARKER`` and sleeps, so the test can SIGKILL it inside that phase.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from nvalchemi.app.learn import run_learning


def main() -> None:
    torch.set_num_threads(1)
    job = sys.argv[1]
    pause = sys.argv[2] if len(sys.argv) > 2 else ""
    marker = Path(sys.argv[3]) if len(sys.argv) > 3 else None

    def progress(iteration: int, phase: str, done: int, total: int) -> None:
        if f"{iteration}:{phase}:{done}" == pause:
            marker.write_text(phase)
            time.sleep(600)

    run_learning(job, progress=progress)
    print("RESULT done", flush=True)


if __name__ == "__main__":
    main()
