"""The experiment trackers of a job: ``output.loggers`` / ``--logger``, and what reaches them.

``loggers`` names the trackers (``tensorboard``, ``wandb``, ``mlflow``); ``--logger``
replaces the job's list; without either a run writes TensorBoard events when TensorBoard
is installed (``output.tensorboard``). :func:`tracker_reporters` builds the W&B and MLflow
reporters (TensorBoard is :func:`~nvalchemi.hooks.reporting.run_reporting`'s), which get
the job as their configuration; :func:`open_trackers` keeps their tracked runs open from
training to the end of the final evaluation, and :func:`log_evaluation` sends the
final model's errors (summary numbers with units in their names, the tables of
``final_evaluation.json``) and the run's plots.

Settings come from the trackers' own environment: W&B's ``WANDB_PROJECT`` (default
``nvalchemi``), ``WANDB_ENTITY``, ``WANDB_MODE``, ``WANDB_DIR`` (default: the run
directory); MLflow's ``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_NAME`` (default
``nvalchemi``). The tracked run is named after the job (``quickstart`` for the quickstart).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError
from nvalchemi._optional import OptionalDependencyError
from nvalchemi.hooks.reporting.mlflow import MLflowReporter
from nvalchemi.hooks.reporting.units import metric_key
from nvalchemi.hooks.reporting.wandb import WandbReporter

__all__ = [
    "DEFAULT_PROJECT",
    "chosen_loggers",
    "log_evaluation",
    "open_trackers",
    "tensorboard_switch",
    "tracker_reporters",
]

DEFAULT_PROJECT = "nvalchemi"
"""W&B project and MLflow experiment of a job's runs when the environment names none."""

_FIELD = "output.loggers (--logger)"
_TABLES = ("by_group", "by_source", "per_element")
_SETTINGS = {
    "W&B": "log in (wandb login, or WANDB_API_KEY), or set WANDB_MODE=offline",
    "MLflow": "point MLFLOW_TRACKING_URI at a reachable server or database",
}


def chosen_loggers(job: Any, cli: Sequence[str] = ()) -> list[str] | None:
    """The trackers of a run: ``--logger`` values, else ``output.loggers`` (``None``: unset)."""
    names = list(cli) if cli else job.output.loggers
    return None if names is None else list(dict.fromkeys(names))


def tensorboard_switch(job: Any, loggers: list[str] | None) -> bool | None:
    """``run_reporting``'s ``tensorboard``: from ``loggers`` when set, else ``output.tensorboard``."""
    return job.output.tensorboard if loggers is None else "tensorboard" in loggers


def tracker_reporters(
    loggers: Sequence[str] | None, run_dir: Path, *, name: str, config: Mapping[str, Any]
) -> list[Any]:
    """A ``WandbReporter`` and/or ``MLflowReporter`` for ``loggers``: the run named ``name``,
    ``config`` (the job) as its configuration."""
    reporters = []
    try:
        for tracker in [t for t in loggers or () if t in ("wandb", "mlflow")]:
            if tracker == "wandb":
                reporters.append(
                    WandbReporter(
                        os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                        name=name,
                        dir=None if os.environ.get("WANDB_DIR") else run_dir,
                        config=config,
                    )
                )
            else:
                experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
                reporters.append(MLflowReporter(experiment, name=name, config=config))
    except OptionalDependencyError as exc:
        raise FieldError(
            f"{tracker} is not installed",
            field=_FIELD,
            fix="pip install 'nvalchemi-training[trackers]', or leave the tracker out",
        ) from exc
    return reporters


@contextlib.contextmanager
def open_trackers(trackers: Sequence[Any]) -> Iterator[None]:
    """Keep the trackers' runs open inside (training, then the final evaluation).

    The runs end when the block does: finished, failed (an error) or killed (a signal). A
    tracker that cannot start its run (no login, an unreachable store) stops the job here,
    before training, with its settings named.
    """
    with contextlib.ExitStack() as stack:
        for tracker in trackers:
            try:
                stack.enter_context(tracker)
            except Exception as exc:
                raise FieldError(
                    f"{tracker.tracker} could not start its run: {type(exc).__name__}: {exc}",
                    field=_FIELD,
                    fix=_SETTINGS[tracker.tracker],
                ) from exc
        yield


def log_evaluation(
    trackers: Sequence[Any],
    evaluation: Any,
    *,
    prefix: str = "final",
    plots: Sequence[Path] = (),
    md_check: Any = None,
) -> None:
    """An :class:`~nvalchemi.app.evaluation.Evaluation` (its errors and tables), an MD check
    and plots, sent to every tracker.

    Summary numbers are ``<prefix>/<quantity>_<mae|rmse>_<unit>`` (``final/forces_mae_eV_per_A``)
    and ``<prefix>/md/<number>``; tables are ``<prefix>/by_group``, ``by_source``,
    ``per_element`` and ``force_bins``, one row per group (columns named with units too).
    """
    summary: dict[str, float] = {}
    tables: dict[str, list[dict[str, Any]]] = {}
    if evaluation is not None:
        report = evaluation.report()
        summary.update({f"{prefix}/{metric_key(k)}": v for k, v in report["metrics"].items()})
        for name in _TABLES:
            label = "element" if name == "per_element" else name.removeprefix("by_")
            tables[f"{prefix}/{name}"] = [
                {label: key, **{metric_key(k): v for k, v in row.items()}}
                for key, row in report[name].items()
            ]
        tables[f"{prefix}/force_bins"] = [
            {f"{k}_eV_per_A" if k in ("low", "high") else metric_key(k): v for k, v in row.items()}
            for row in report["force_bins"]
        ]
    if md_check is not None:
        summary.update({f"{prefix}/md/{k}": v for k, v in md_check.scalars().items()})
    for tracker in trackers:
        if summary:
            tracker.log_summary(summary)
        for name, rows in tables.items():
            if rows:
                tracker.log_table(name, rows)
        for plot in plots:
            tracker.log_image(plot)
