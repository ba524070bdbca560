"""``MLflowReporter``: a training run as an MLflow run (extra ``trackers``).

Scalars become MLflow metrics at the completed-step count, the configuration becomes
params (flattened: ``strategy.optimizer_configs.main.0.optimizer_kwargs.lr``) and the
artifact ``config.json``, :meth:`~TrackerReporter.log_summary` metrics at the last step,
tables JSON artifacts (``{"columns": [...], "data": [[...], ...]}``, MLflow's table
layout) and plots image artifacts. Everything goes through ``MlflowClient`` (the
process-wide active run of ``mlflow.start_run`` is left alone); the tracking server is
``tracking_uri``, else ``MLFLOW_TRACKING_URI``, else MLflow's default. ``mlflow`` is
imported when the tracked run starts, on rank 0 only.

A resumed training run continues the same MLflow run (its id comes from the
checkpoint); steps that a run resumed from an earlier checkpoint repeats are logged
again (MLflow keeps both values of such a step).

Example:
    >>> from nvalchemi.hooks.reporting import MLflowReporter, ReportingOrchestrator
    >>> hook = ReportingOrchestrator(  # doctest: +SKIP
    ...     [MLflowReporter("alloys", name="painn", tracking_uri="http://mlflow:5000")],
    ...     stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"}, frequency=10)
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nvalchemi._optional import OptionalDependency
from nvalchemi.hooks.reporting.tracker import RunStatus, TrackerReporter, require_installed

__all__ = ["MLflowReporter", "flat_params"]

_DEFAULT_EXPERIMENT = "Default"
_BAD_KEY_CHARACTERS = re.compile(r"[^/\w.\- ]")
# MLflow's limits (mlflow.utils.validation), here so that flat_params needs no mlflow.
_MAX_KEY_LENGTH = 250
_MAX_PARAM_VALUE_LENGTH = 6000
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000


def _key(name: str) -> str:
    """``name`` as a valid MLflow metric or param key (odd characters become ``_``)."""
    key = posixpath.normpath(_BAD_KEY_CHARACTERS.sub("_", name)).lstrip("/")
    return key.replace("..", "_")[:_MAX_KEY_LENGTH] or "_"


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings and lists of mappings as flat MLflow params (dotted keys, text values).

    Example:
        >>> flat_params({"lr": 1e-3, "model": {"cutoff": 5.0, "elements": ["Cu", "Au"]}})
        {'lr': '0.001', 'model.cutoff': '5.0', 'model.elements': '["Cu", "Au"]'}
    """
    out: dict[str, str] = {}
    for name, value in config.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{key}."))
        elif isinstance(value, (list, tuple)) and any(
            isinstance(item, (Mapping, list, tuple)) for item in value
        ):
            out.update(flat_params({str(i): item for i, item in enumerate(value)}, f"{key}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[_key(key)] = text[:_MAX_PARAM_VALUE_LENGTH]
    return out


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class MLflowReporter(TrackerReporter):
    """Log a training run to MLflow (global rank 0).

    Args:
        experiment: the experiment's name, created if missing (default:
            ``MLFLOW_EXPERIMENT_NAME``, else MLflow's ``Default`` experiment).
        name: the run's name.
        run_id: continue this MLflow run (default: a new one; a checkpoint's id wins).
        tracking_uri: the tracking server or store (default: ``MLFLOW_TRACKING_URI``,
            else MLflow's default).
        tags: tags of a new run.
        config: logged with the strategy's spec when the MLflow run is created.
        **options: what to collect (see :class:`TrackerReporter`).

    Raises ``OptionalDependencyError`` at construction when ``mlflow`` is missing.
    """

    tracker = "MLflow"

    def __init__(
        self,
        experiment: str | None = None,
        *,
        name: str | None = None,
        run_id: str | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, str] | None = None,
        config: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        require_installed(OptionalDependency.MLFLOW, "MLflowReporter")
        super().__init__(run_id=run_id, config=config, **options)
        self.experiment = experiment
        self.name = name
        self.tracking_uri = tracking_uri
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self._client: Any = None
        self._config: dict[str, Any] = {}

    @property
    def client(self) -> Any:
        """The ``MlflowClient`` of the open run (``None`` before it starts)."""
        return self._client

    def _start(self, run_id: str | None) -> tuple[str, bool]:
        from mlflow import MlflowClient  # heavy: imported when a tracked run starts, on rank 0
        from mlflow.exceptions import MlflowException

        client = self._client = MlflowClient(self.tracking_uri)
        if run_id is not None:
            try:
                client.update_run(run_id, status="RUNNING")
            except MlflowException as exc:
                raise RuntimeError(
                    f"MLflow run {run_id!r} (of the checkpoint) is not in the tracking store "
                    f"{client.tracking_uri!r}: {exc.message}. Point MLFLOW_TRACKING_URI (or "
                    "tracking_uri) at the store the run was logged to."
                ) from exc
            return run_id, True
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or _DEFAULT_EXPERIMENT
        found = client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found else client.create_experiment(name)
        run = client.create_run(experiment_id, run_name=self.name, tags=self.tags or None)
        return run.info.run_id, False

    def _log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        logged = self._client.get_run(self.run_id).data.params  # params never change
        params = [
            Param(key, value) for key, value in flat_params(config).items() if key not in logged
        ]
        for chunk in _chunks(params, _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=chunk)
        self._config.update(json.loads(json.dumps(dict(config), default=str)))  # JSON-ready
        self._client.log_dict(self.run_id, self._config, "config.json")

    def _log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_key(key), value, now, step) for key, value in values.items()]
        for chunk in _chunks(metrics, _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=chunk)

    def _log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self._log_metrics(scalars, step)

    def _log_summary(self, values: dict[str, float], step: int) -> None:
        self._log_metrics(values, step)

    def _log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self._client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"{_key(name)}.json")

    def _log_image(self, name: str, path: Path) -> None:
        folder = posixpath.dirname(_key(name))
        self._client.log_artifact(self.run_id, str(path), artifact_path=folder or None)

    def _finish(self, status: RunStatus) -> None:
        self._client.set_terminated(self.run_id, status=status.upper())
