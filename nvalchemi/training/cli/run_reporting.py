"""Live reporting for CLI runs: terminal progress, ``metrics.jsonl``, TensorBoard, plots.

:func:`reporting_hook` returns one ``ReportingOrchestrator`` with a ``RichReporter``
(live dashboard in a terminal, plain lines elsewhere), a ``JSONLinesReporter`` writing
``<run_dir>/metrics.jsonl`` and, when TensorBoard is installed (or asked for), a
``TensorBoardReporter`` writing ``<run_dir>/tensorboard``. :func:`learning_curves`
draws ``learning_curves.png`` from the metrics file at the end. :class:`TimeBudgetHook`
(``--minutes``) lives in :mod:`nvalchemi.training.cli.time_budget`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nvalchemi.training.cli.time_budget import TimeBudgetHook

__all__ = ["PLOTS_HINT", "TimeBudgetHook", "learning_curves", "plots_available", "reporting_hook"]

REPORT_STAGES = frozenset({"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"})
PLOTS_HINT = "plots skipped: matplotlib is missing (pip install 'nvalchemi-training[plots]')"


def plots_available() -> bool:
    """Whether matplotlib (extra ``plots``) is installed."""
    from nvalchemi._optional import OptionalDependency

    return OptionalDependency.MATPLOTLIB.is_available()


def reporting_hook(
    run_dir: str | Path,
    *,
    log_every: int,
    tensorboard: bool | None = None,
    title: str = "nvalchemi training",
    console: Any = None,
) -> Any:
    """A ``ReportingOrchestrator`` for ``run_dir`` (rank 0 only)."""
    from nvalchemi._optional import OptionalDependency
    from nvalchemi.hooks.reporting import (
        JSONLinesReporter,
        ReportingOrchestrator,
        RichReporter,
        TensorBoardReporter,
    )

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    reporters: list[Any] = [
        RichReporter(title=title, console=console),
        JSONLinesReporter(run_dir),
    ]
    if tensorboard is None:
        tensorboard = OptionalDependency.TENSORBOARD.is_available()
    if tensorboard:
        reporters.append(TensorBoardReporter(run_dir / "tensorboard"))
    return ReportingOrchestrator(
        reporters, stages=REPORT_STAGES, frequency=int(log_every), rank_zero_only=True
    )


def learning_curves(run_dir: str | Path) -> Path | None:
    """``<run_dir>/learning_curves.png`` from ``metrics.jsonl`` (``None`` without metrics)."""
    from nvalchemi.hooks.reporting import plot_learning_curves

    metrics = Path(run_dir) / "metrics.jsonl"
    if not plots_available() or not metrics.is_file() or metrics.stat().st_size == 0:
        return None
    return plot_learning_curves(metrics, Path(run_dir) / "learning_curves.png")
