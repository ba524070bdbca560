"""What an experiment tracker costs a run: start-up and one reporting event, offline.

For each tracker (W&B offline files, MLflow ``file:`` store) prints one JSON line with the
seconds to import it, to start the tracked run (``wandb.init`` / ``create_run``), the median
milliseconds of one reporting event (the ~20 scalars of a training step, through
``ReportingOrchestrator``) and the seconds to end the run. Each tracker runs in its own
process, so the import is cold. Needs the ``trackers`` extra.

Usage: ``python benchmarks/trackers.py [--events N] [--tracker wandb|mlflow]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRACKERS = ("wandb", "mlflow")


def measure(tracker: str, events: int, folder: Path) -> dict:
    """Run one tracker for ``events`` training-step events in this process."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "hooks"))
    import _reporting_support as support

    from nvalchemi.hooks.reporting import ReportingOrchestrator
    from nvalchemi.training.stages import TrainingStage

    started = time.perf_counter()
    if tracker == "wandb":
        import wandb  # noqa: F401 (the cold import is what is measured)

        from nvalchemi.hooks.reporting import WandbReporter

        reporter = WandbReporter("bench", dir=folder)
    else:
        from mlflow import MlflowClient  # noqa: F401 (the cold import is what is measured)

        from nvalchemi.hooks.reporting import MLflowReporter

        reporter = MLflowReporter("bench", tracking_uri=f"file:{folder / 'mlruns'}")
    imported = time.perf_counter()
    hook = ReportingOrchestrator([reporter])
    ctx = support.make_ctx()
    times = []
    with hook:
        opened = time.perf_counter()
        for _ in range(events):
            begin = time.perf_counter()
            hook(ctx, TrainingStage.AFTER_OPTIMIZER_STEP)
            times.append(time.perf_counter() - begin)
            support.advance(ctx, energy=0.25)
        closing = time.perf_counter()
    ended = time.perf_counter()
    return {
        "tracker": tracker,
        "import_s": round(imported - started, 3),
        "start_s": round(opened - imported, 3),
        "event_ms_median": round(1000 * statistics.median(times), 3),
        "event_ms_max": round(1000 * max(times), 3),
        "end_s": round(ended - closing, 3),
        "events": events,
        "python": platform.python_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--tracker", choices=TRACKERS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(measure(args.tracker, args.events, Path(folder))), flush=True)
        return
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    for tracker in [args.tracker] if args.tracker else TRACKERS:
        command = [sys.executable, __file__, "--child", "--tracker", tracker]
        result = subprocess.run(
            [*command, "--events", str(args.events)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        print(
            lines[-1] if lines else json.dumps({"tracker": tracker, "error": result.stderr[-500:]})
        )


if __name__ == "__main__":
    main()
