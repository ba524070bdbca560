"""``WandbReporter``: a training run as a Weights & Biases run (extra ``trackers``).

Scalars go to the run's history at the completed-step count (W&B's ``step``), the
configuration to ``run.config``, :meth:`~TrackerReporter.log_summary` to ``run.summary``,
tables as ``wandb.Table`` and plots as ``wandb.Image`` in the history row of the last step. W&B reads its usual environment
(``WANDB_API_KEY``, ``WANDB_ENTITY``, ``WANDB_PROJECT``, ``WANDB_MODE=offline``,
``WANDB_DIR``); ``wandb`` is imported when the tracked run starts, on rank 0 only.

A resumed training run continues the same W&B run (``resume="allow"`` with the id from
the checkpoint). Steps that a run resumed from an earlier checkpoint repeats keep the
values W&B already has (W&B's history only moves forward).

Example:
    >>> from nvalchemi.hooks.reporting import ReportingOrchestrator, WandbReporter
    >>> hook = ReportingOrchestrator(  # doctest: +SKIP
    ...     [WandbReporter("my-project", name="painn-alloys")],
    ...     stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"}, frequency=10)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nvalchemi._optional import OptionalDependency
from nvalchemi.hooks.reporting.tracker import RunStatus, TrackerReporter, require_installed

__all__ = ["WandbReporter"]

_SET_BY_REPORTER = frozenset({"project", "name", "id", "dir", "config", "resume", "reinit"})


class WandbReporter(TrackerReporter):
    """Log a training run to Weights & Biases (global rank 0).

    Args:
        project: the W&B project (default: ``WANDB_PROJECT``, else W&B's default).
        name: the run's display name.
        run_id: continue this W&B run (default: a new one; a checkpoint's id wins).
        dir: where W&B keeps its local files (default: ``WANDB_DIR``, else the current
            directory); created if missing.
        config: logged with the strategy's spec when the W&B run is created.
        init_kwargs: more ``wandb.init`` arguments (``entity``, ``group``, ``tags``,
            ``mode``, ``settings``, ...).
        **options: what to collect (see :class:`TrackerReporter`).

    Raises ``OptionalDependencyError`` at construction when ``wandb`` is missing.
    """

    tracker = "W&B"

    def __init__(
        self,
        project: str | None = None,
        *,
        name: str | None = None,
        run_id: str | None = None,
        dir: str | Path | None = None,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        require_installed(OptionalDependency.WANDB, "WandbReporter")
        clash = sorted(_SET_BY_REPORTER & set(init_kwargs or {}))
        if clash:
            raise ValueError(
                f"WandbReporter sets {clash} of wandb.init itself; pass project/name/run_id/"
                "dir/config as its own arguments."
            )
        super().__init__(run_id=run_id, config=config, **options)
        self.project = project
        self.name = name
        self.dir = None if dir is None else Path(dir)
        self.init_kwargs = dict(init_kwargs or {})
        self._run: Any = None

    @property
    def run(self) -> Any:
        """The open ``wandb`` run (``None`` before it starts and after it ends)."""
        return self._run

    def _start(self, run_id: str | None) -> tuple[str, bool]:
        import wandb  # heavy: imported when a tracked run starts, on rank 0

        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.project,
            name=self.name,
            id=run_id,
            dir=None if self.dir is None else str(self.dir),
            resume="allow",
            reinit="create_new",  # leave the user's own wandb.run alone
            **self.init_kwargs,
        )
        return self._run.id, bool(self._run.resumed)

    def _log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def _log_scalars(self, scalars: dict[str, float], step: int) -> None:
        if step < self._run.step:  # a resumed run repeating steps W&B already holds
            return
        self._run.log(scalars, step=step)

    def _log_summary(self, values: dict[str, float], step: int) -> None:
        self._run.summary.update(values)

    def _log_table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        import wandb

        self._run.log({name: wandb.Table(columns=columns, data=rows)}, commit=False)

    def _log_image(self, name: str, path: Path) -> None:
        import wandb

        self._run.log({name: wandb.Image(str(path))}, commit=False)

    def _finish(self, status: RunStatus) -> None:
        run, self._run = self._run, None
        if status == "killed":
            run.mark_preempting()
        run.finish(exit_code=0 if status == "finished" else 1)
