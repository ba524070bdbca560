"""``TrackerReporter``: a training run mirrored to one run of an experiment tracker.

The base of :class:`~nvalchemi.hooks.reporting.wandb.WandbReporter` and
:class:`~nvalchemi.hooks.reporting.mlflow.MLflowReporter`. What reaches the tracked run:

* the scalars of every reporting event, named as in TensorBoard and ``metrics.jsonl``
  (``loss/total``, ``optimizer/lr``, ``validation/forces_mae_eV_per_A``: error metrics
  carry their unit), at the number of completed optimizer steps;
* the configuration, once, when the reporter creates the tracked run: ``config=`` and the
  strategy's spec (``strategy``: optimizers, loss, models, duration);
* what the caller adds: :meth:`~TrackerReporter.log_summary` (final numbers),
  :meth:`~TrackerReporter.log_table` (e.g. errors per structure type) and
  :meth:`~TrackerReporter.log_image` (plots).

Only global rank 0 talks to the tracker. The tracked run starts when the reporter is
entered (a ``ReportingOrchestrator`` enters its reporters when training starts) or at the
first thing logged, and ends when the outermost ``with`` exits or at :meth:`close`:
``with reporter:`` around training and a final evaluation keeps one tracked run open
for both. Its id is the reporter's ``state_dict``; the ``ReportingOrchestrator`` saves it
in training checkpoints, so a resumed run continues the same tracked run.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from nvalchemi._optional import OptionalDependency
from nvalchemi.distributed.runtime import get_rank
from nvalchemi.hooks.reporting._base import ScalarReporterBase
from nvalchemi.hooks.reporting.scalars import ScalarCallback
from nvalchemi.hooks.reporting.state import ReportingState

__all__ = ["RunStatus", "TrackerReporter", "require_installed"]

RunStatus = Literal["finished", "failed", "killed"]
"""How a tracked run ended: normally, by an error, or by a signal/interrupt (preemption)."""


def require_installed(dependency: OptionalDependency, feature: str) -> None:
    """Raise the installation hint when ``dependency`` is missing, without importing it."""
    if not dependency.is_available():
        dependency.require(feature)  # raises OptionalDependencyError naming the extra


def _status(exc_type: type[BaseException] | None) -> RunStatus:
    if exc_type is None:
        return "finished"
    if issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
        return "killed"
    return "failed"


class TrackerReporter(ScalarReporterBase):
    """Send a run's scalars, configuration, tables and plots to an experiment tracker.

    Subclasses connect one tracker (``_start``, ``_log_*``, ``_finish``); see the module
    docstring for what is sent and when.

    Args:
        run_id: continue this tracked run (default: a new one; a checkpoint's id wins).
        config: logged with the strategy's spec when the reporter creates the tracked run.
        custom_scalars / include_losses / include_optimizer_lrs / include_throughput /
            include_memory: what to collect (as for ``TensorBoardReporter``).
        rank_reduction: reduce scalars over ranks before rank 0 sends them.
    """

    tracker = "tracker"
    """The tracker's name in messages."""

    def __init__(
        self,
        *,
        run_id: str | None = None,
        config: Mapping[str, Any] | None = None,
        custom_scalars: Mapping[str, ScalarCallback] | None = None,
        include_losses: bool = True,
        include_optimizer_lrs: bool = True,
        rank_reduction: Any = None,
        include_throughput: bool = True,
        include_memory: bool = True,
    ) -> None:
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError(
                f"{type(self).__name__} run_id must be a non-empty string; got {run_id!r}."
            )
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(
                f"{type(self).__name__} config must be a mapping; got {type(config).__name__}."
            )
        self._init_scalar_options(
            custom_scalars=custom_scalars,
            include_losses=include_losses,
            include_optimizer_lrs=include_optimizer_lrs,
            rank_reduction=rank_reduction,
            rank_zero_only=True,
            include_throughput=include_throughput,
            include_memory=include_memory,
        )
        self.run_id = run_id
        self.config = dict(config or {})
        self._open = False
        self._created = False  # this reporter created the tracked run: it logs the config
        self._spec_logged = False
        self._depth = 0
        self._last_step = 0

    # ------------------------------------------------------------------ what subclasses do
    def _start(self, run_id: str | None) -> tuple[str, bool]:
        """Open the tracked run ``run_id`` (``None``: a new one); return ``(id, continued)``."""
        raise NotImplementedError

    def _log_config(self, config: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _log_scalars(self, scalars: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def _log_summary(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def _log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        raise NotImplementedError

    def _log_image(self, name: str, path: Path) -> None:
        raise NotImplementedError

    def _finish(self, status: RunStatus) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ reporting
    def report(self, ctx: Any, stage: Any, state: ReportingState) -> None:
        """Send the scalars of this event at the completed-step count (rank 0)."""
        snapshot = self._collect(ctx, stage, state)
        if not self._writes_for(ctx):
            return
        self._ensure_open()
        if self._created and not self._spec_logged:
            self._spec_logged = True
            self._log_strategy_spec(getattr(ctx, "workflow", None), state)
        if not snapshot.scalars:
            return
        step = snapshot.step if snapshot.step > 0 else snapshot.event_count
        self._last_step = max(self._last_step, step)
        self._log_scalars(dict(snapshot.scalars), step)

    def _log_strategy_spec(self, workflow: Any, state: ReportingState) -> None:
        to_spec = getattr(workflow, "to_spec_dict", None)
        if not callable(to_spec):
            return
        try:
            with warnings.catch_warnings():  # e.g. a training_fn that cannot be re-imported
                warnings.simplefilter("ignore")
                spec = to_spec()
        except Exception as exc:  # the configuration is a courtesy: never stop training
            state.add_message(
                "warning",
                f"{type(self).__name__}: the strategy's spec was not logged ({exc})",
                reporter=self,
            )
            return
        self._log_config({"strategy": spec})

    # ------------------------------------------------------------------ what callers add
    def log_config(self, config: Mapping[str, Any]) -> None:
        """Add ``config`` to the tracked run's configuration (rank 0; starts the run if needed)."""
        if self._writes_here():
            self._ensure_open()
            self._log_config(dict(config))

    def log_summary(self, values: Mapping[str, float]) -> None:
        """Final numbers of the run (e.g. ``final/forces_mae_eV_per_A``), at its last step."""
        if self._writes_here():
            self._ensure_open()
            self._log_summary({str(k): float(v) for k, v in values.items()}, self._last_step)

    def log_table(self, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """A table of ``rows`` (columns: their keys, in order of appearance) named ``name``.

        Example:
            >>> reporter.log_table("final/by_group", [  # doctest: +SKIP
            ...     {"group": "bulk", "forces_mae_eV_per_A": 0.03},
            ...     {"group": "slab", "forces_mae_eV_per_A": 0.08}])
        """
        if not self._writes_here():
            return
        columns: list[str] = []
        for row in rows:
            columns += [str(key) for key in row if str(key) not in columns]
        cells = [[_cell(row.get(column)) for column in columns] for row in rows]
        self._ensure_open()
        self._log_table(name, columns, cells)

    def log_image(self, path: str | Path, name: str | None = None) -> None:
        """A picture file (PNG) under ``name`` (default: ``plots/<file stem>``)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{type(self).__name__}.log_image: no file at {path}.")
        if self._writes_here():
            self._ensure_open()
            self._log_image(name or f"plots/{path.stem}", path)

    # ------------------------------------------------------------------ lifecycle
    def _writes_here(self) -> bool:
        return get_rank() == 0

    def _ensure_open(self) -> None:
        if self._open:
            return
        self.run_id, continued = self._start(self.run_id)
        self._open = True
        self._created = not continued
        self._spec_logged = False
        if self._created and self.config:
            self._log_config(self.config)

    def __enter__(self) -> TrackerReporter:
        self._depth += 1
        if self._depth == 1 and self._writes_here():
            self._ensure_open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self._end(_status(exc_type))

    def close(self) -> None:
        """End the tracked run now (a later event continues it: same id)."""
        self._depth = 0
        self._end("finished")

    def _end(self, status: RunStatus) -> None:
        if self._open:
            self._open = False
            self._finish(status)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"run_id": ...}``: the tracked run a resumed training run continues."""
        return {"run_id": self.run_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the tracked run of a checkpoint (load it before the run starts)."""
        if not isinstance(state, Mapping):
            raise TypeError(
                f"{type(self).__name__} state must be a mapping with 'run_id'; got "
                f"{type(state).__name__}."
            )
        run_id = state.get("run_id")
        if run_id is not None and not isinstance(run_id, str):
            raise ValueError(
                f"{type(self).__name__} state has run_id {run_id!r}; expected a string or None."
            )
        if self._open and run_id != self.run_id:
            raise RuntimeError(
                f"{type(self).__name__} is already logging to {self.tracker} run "
                f"{self.run_id!r}; load the checkpoint (run {run_id!r}) before training starts."
            )
        self.run_id = run_id


def _cell(value: Any) -> Any:
    """A table cell: numbers, strings, booleans and ``None`` as they are, else ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
