"""The reporting of a training run in one call: progress, ``metrics.jsonl``, trackers, plots.

:func:`run_reporting` returns one ``ReportingOrchestrator`` with a ``RichReporter``
(live dashboard in a terminal, plain lines elsewhere), a ``JSONLinesReporter`` writing
``<run_dir>/metrics.jsonl`` and, when TensorBoard is installed (or asked for), a
``TensorBoardReporter`` writing ``<run_dir>/tensorboard``, then the experiment trackers
given (``WandbReporter``, ``MLflowReporter``). With a time budget (any
object with ``progress() -> {"remaining_s", "planned_steps"}``, such as a
``TimeBudgetHook``) progress shows the time left and the planned end. :func:`learning_curves`
draws ``learning_curves.png`` from the metrics file at the end.

Example:
    >>> hook = run_reporting("runs/demo", log_every=20)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nvalchemi._optional import OptionalDependency

__all__ = ["PLOTS_HINT", "REPORT_STAGES", "learning_curves", "plots_available", "run_reporting"]

REPORT_STAGES = frozenset({"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"})
PLOTS_HINT = "plots skipped: matplotlib is missing (pip install 'nvalchemi-training[plots]')"


def plots_available() -> bool:
    """Whether matplotlib (extra ``plots``) is installed."""
    return OptionalDependency.MATPLOTLIB.is_available()


def _budget_scalars(budget: Any) -> Any:
    def scalars(ctx: Any, stage: Any) -> dict[str, float]:
        return dict(budget.progress())

    return scalars


def run_reporting(
    run_dir: str | Path,
    *,
    log_every: int,
    tensorboard: bool | None = None,
    title: str = "nvalchemi training",
    console: Any = None,
    budget: Any = None,
    trackers: Sequence[Any] = (),
) -> Any:
    """A ``ReportingOrchestrator`` for ``run_dir`` (rank 0 reports).

    ``trackers`` (``WandbReporter``, ``MLflowReporter``, ...) are added after the built-in
    reporters; they see the same scalars, the budget's included.

    ``budget`` (a ``TimeBudgetHook``) adds ``budget/remaining_s``, ``budget/seconds`` and
    ``budget/planned_steps`` to every report, which progress lines and the dashboard
    show as the time left and the run's planned end.
    """
    from nvalchemi.hooks.reporting.jsonl import JSONLinesReporter  # light
    from nvalchemi.hooks.reporting.orchestrator import ReportingOrchestrator  # light
    from nvalchemi.hooks.reporting.rich_reporter import RichReporter  # light
    from nvalchemi.hooks.reporting.tensorboard import TensorBoardReporter  # light

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    custom = None if budget is None else {"budget": _budget_scalars(budget)}
    reporters: list[Any] = [
        RichReporter(title=title, console=console, custom_scalars=custom),
        JSONLinesReporter(run_dir, custom_scalars=custom),
    ]
    if tensorboard is None:
        tensorboard = OptionalDependency.TENSORBOARD.is_available()
    if tensorboard:
        reporters.append(TensorBoardReporter(run_dir / "tensorboard", custom_scalars=custom))
    for tracker in trackers:
        if custom is not None:
            tracker.custom_scalars = {**custom, **tracker.custom_scalars}
        reporters.append(tracker)
    return ReportingOrchestrator(
        reporters, stages=REPORT_STAGES, frequency=int(log_every), rank_zero_only=True
    )


def learning_curves(run_dir: str | Path) -> Path | None:
    """``<run_dir>/learning_curves.png`` from ``metrics.jsonl`` (``None`` without metrics)."""
    from nvalchemi.hooks.reporting.plots import plot_learning_curves  # optional

    metrics = Path(run_dir) / "metrics.jsonl"
    if not plots_available() or not metrics.is_file() or metrics.stat().st_size == 0:
        return None
    return plot_learning_curves(metrics, Path(run_dir) / "learning_curves.png")
