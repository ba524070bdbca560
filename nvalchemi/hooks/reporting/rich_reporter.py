"""``RichReporter``: a live training dashboard in the terminal, plain log lines elsewhere.

In a terminal the reporter keeps a ``rich.live.Live`` display (progress bars
per epoch and for the run with ETAs, throughput, latest losses and learning
rate, a validation table, charts, messages) that redraws itself
``refresh_per_second`` times a second from a background thread; a report only
records numbers, so frequent reporting stays cheap. When the console is not a
terminal (CI, Slurm logs, pipes) it prints one plain line per report instead,
with no escape codes::

    epoch 3/10 batch 120/400 step 920/4,000 loss 1.23e-02 [EnergyMSELoss 1.10e-02] lr 1.0e-03 412 structures/s eta 00:45
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from nvalchemi.distributed.runtime import get_rank
from nvalchemi.hooks.context import DynamicsContext, TrainContext
from nvalchemi.hooks.reporting._base import ScalarReporterBase
from nvalchemi.hooks.reporting._events import (
    EventPosition,
    event_position,
    is_validation_stage,
    stage_name,
)
from nvalchemi.hooks.reporting.rich_layouts import (
    DynamicsRichLayout,
    ProgressView,
    RichLayout,
    RichView,
    TrainingRichLayout,
    ValidationView,
    higher_is_better,
    resolve_rich_layout,
    validation_display_values,
    validation_plain_line,
)
from nvalchemi.hooks.reporting.scalars import ScalarCallback, ScalarSnapshot, training_plan
from nvalchemi.hooks.reporting.state import ReportingState
from nvalchemi.hooks.reporting.units import loss_units

__all__ = ["RichReporter", "display_epoch"]


def display_epoch(position: EventPosition) -> int:
    """The 1-based epoch a person expects to read at this event.

    Inside an epoch the strategy's ``epoch`` counts completed epochs (0 in the
    first); right after an epoch ends (``epoch_step == 0``) it already counts
    the finished one.
    """
    if position.epoch_step == 0 and position.epoch > 0:
        return position.epoch
    return position.epoch + 1


class RichReporter(ScalarReporterBase):
    """Live terminal dashboard (or plain log lines) for training and simulation runs.

    Args:
        custom_scalars: ``{name: callback(ctx, stage)}`` extra scalars.
        include_losses / include_optimizer_lrs: collect loss and learning-rate scalars.
        include_dynamics_scalars: collect energy/fmax/convergence (default: with the dynamics layout).
        rank_reduction: ``"mean"``, ``"sum"``, ``"min"``, ``"max"`` or a ``ReduceOp`` to reduce
            scalars over ranks (every rank must report; rank 0 renders).
        title: dashboard title.
        precision: significant digits in tables (``>= 0``).
        max_scalars: at most this many rows in the tables (``>= 1``, default all).
        history_size: points kept per scalar for charts (``>= 1``).
        layout: ``None``/``"auto"`` (chosen at the first event), ``"training"``,
            ``"dynamics"`` or an object with ``render(view)`` and ``plain_line(view)``.
        plot_keys: keys or ``fnmatch`` patterns to chart (default: total loss,
            per-component losses, learning rate).
        max_plots: number of charts (``>= 0``).
        plot_height: chart height in text rows (``>= 4``).
        refresh_per_second: live redraw rate (``> 0``).
        console: a ``rich.console.Console`` (default: a new one on stderr).
        screen / transient: ``rich.live.Live`` options (full screen; erase on exit).
        rank_zero_only: render only on global rank 0.
        strict_layout: raise ``ValueError`` when ``layout="auto"`` cannot tell the run type.
        include_throughput / include_memory: show structures/atoms per second and peak memory.

    Example:
        >>> import io, torch
        >>> from rich.console import Console
        >>> from nvalchemi.hooks.context import TrainContext
        >>> reporter = RichReporter(console=Console(file=io.StringIO()))
        >>> reporter.report(TrainContext(batch=None, loss=torch.tensor(0.5)), "AFTER_OPTIMIZER_STEP",
        ...                 ReportingState())
        >>> reporter.console.file.getvalue()
        'epoch 1 step 1 loss 5.00e-01\\n'
    """

    def __init__(
        self,
        *,
        custom_scalars: Mapping[str, ScalarCallback] | None = None,
        include_losses: bool = True,
        include_optimizer_lrs: bool = True,
        include_dynamics_scalars: bool | None = None,
        rank_reduction: Any = None,
        title: str = "nvalchemi report",
        precision: int = 6,
        max_scalars: int | None = None,
        history_size: int = 200,
        layout: Any = None,
        plot_keys: Sequence[str] | None = None,
        max_plots: int = 3,
        plot_height: int = 8,
        refresh_per_second: float = 2.0,
        console: Console | None = None,
        screen: bool = False,
        transient: bool = False,
        rank_zero_only: bool = True,
        strict_layout: bool = False,
        include_throughput: bool = True,
        include_memory: bool = True,
    ) -> None:
        _check_int("precision", precision, 0)
        if max_scalars is not None:
            _check_int("max_scalars", max_scalars, 1)
        _check_int("history_size", history_size, 1)
        _check_int("max_plots", max_plots, 0)
        _check_int("plot_height", plot_height, 4)
        if (
            isinstance(refresh_per_second, bool)
            or not isinstance(refresh_per_second, (int, float))
            or not refresh_per_second > 0
        ):
            raise ValueError(
                f"RichReporter refresh_per_second must be > 0; got {refresh_per_second!r}."
            )
        if console is not None and not isinstance(console, Console):
            raise TypeError(
                f"console must be a rich.console.Console; got {type(console).__name__}."
            )
        if isinstance(plot_keys, str):
            plot_keys = (plot_keys,)
        self._init_scalar_options(
            custom_scalars=custom_scalars,
            include_losses=include_losses,
            include_optimizer_lrs=include_optimizer_lrs,
            rank_reduction=rank_reduction,
            rank_zero_only=rank_zero_only,
            include_throughput=include_throughput,
            include_memory=include_memory,
        )
        self.include_dynamics_scalars = include_dynamics_scalars
        self.title = str(title)
        self.precision = precision
        self.max_scalars = max_scalars
        self.history_size = history_size
        self.plot_keys = None if plot_keys is None else tuple(plot_keys)
        self.max_plots = max_plots
        self.plot_height = plot_height
        self.refresh_per_second = float(refresh_per_second)
        self.console = console if console is not None else Console(stderr=True)
        self.screen = bool(screen)
        self.transient = bool(transient)
        self.strict_layout = bool(strict_layout)
        self._layout: RichLayout | None = resolve_rich_layout(layout)
        self._lock = threading.Lock()
        self._history: dict[str, deque[tuple[int, float]]] = {}
        self._latest: ScalarSnapshot | None = None
        self._progress: ProgressView | None = None
        self._validation: ValidationView | None = None
        self._loss_units: dict[str, str] | None = None
        self._messages: tuple[Any, ...] = ()
        self._messages_printed = 0
        self._started_at = time.monotonic()
        self._elapsed_s: float | None = None
        self._live: Live | None = None

    # ----------------------------------------------------------------- properties
    @property
    def layout(self) -> RichLayout | None:
        """The layout in use (``None`` until an ``"auto"`` reporter sees its first event)."""
        return self._layout

    @property
    def history(self) -> dict[str, list[tuple[int, float]]]:
        """``{key: [(step, value), ...]}``, the last ``history_size`` points per key."""
        with self._lock:
            return {key: list(points) for key, points in self._history.items()}

    @property
    def plain(self) -> bool:
        """Whether output is plain lines (the console is not an interactive terminal)."""
        return not self.console.is_terminal or self.console.is_dumb_terminal

    # ----------------------------------------------------------------- reporting
    def report(self, ctx: Any, stage: Any, state: ReportingState) -> None:
        """Record the scalars of this event and show them (a line, or via the live display)."""
        layout = self._resolve_layout(ctx, stage)
        if layout is None:
            return
        dynamics = self.include_dynamics_scalars
        if dynamics is None:
            dynamics = isinstance(layout, DynamicsRichLayout)
        snapshot = self._collect(
            ctx, stage, state, include_dynamics=dynamics, include_progress=True
        )
        if not self._writes_for(ctx):
            return
        validating = is_validation_stage(stage)
        position = event_position(ctx, stage)
        if self._loss_units is None:
            self._loss_units = loss_units(getattr(getattr(ctx, "workflow", None), "loss_fn", None))
        with self._lock:
            self._record(snapshot, validating, position)
            if not validating and isinstance(layout, TrainingRichLayout):
                self._progress = self._progress_view(ctx, position, state, snapshot)
            if state is not None:
                self._messages = tuple(state.messages[-3:])
                self._elapsed_s = state.elapsed_s
        self._show(layout, validating, state)

    def _resolve_layout(self, ctx: Any, stage: Any) -> RichLayout | None:
        if self._layout is not None:
            return self._layout
        name = stage_name(stage)
        if isinstance(ctx, DynamicsContext) or name == "AFTER_STEP":
            self._layout = DynamicsRichLayout()
        elif (
            isinstance(ctx, TrainContext)
            or name in ("AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION")
            or any(hasattr(ctx, a) for a in ("loss", "optimizers", "batch_count"))
        ):
            self._layout = TrainingRichLayout()
        elif self.strict_layout:
            raise ValueError(
                f"RichReporter cannot pick a layout for {type(ctx).__name__} at stage {name}; "
                "pass layout='training' or layout='dynamics'."
            )
        return self._layout

    def _record(self, snapshot: ScalarSnapshot, validating: bool, position: EventPosition) -> None:
        step = snapshot.step if snapshot.step > 0 else snapshot.event_count
        for key, value in snapshot.scalars.items():
            points = self._history.get(key)
            if points is None:
                points = self._history[key] = deque(maxlen=self.history_size)
            points.append((step, value))
        if not validating:
            self._latest = snapshot
            return
        values = validation_display_values(snapshot.scalars)
        old = self._validation
        best = dict(old.best) if old is not None else {}
        for key, value in values.items():
            if not math.isfinite(value):
                continue
            current = best.get(key)
            better = current is None or (
                value > current[0] if higher_is_better(key) else value < current[0]
            )
            if better:
                best[key] = (value, snapshot.step)
        self._validation = ValidationView(
            step=snapshot.step,
            epoch=display_epoch(position),
            values=values,
            previous=dict(old.values) if old is not None else {},
            best=best,
        )

    @staticmethod
    def _progress_view(
        ctx: Any, position: EventPosition, state: ReportingState | None, snapshot: Any = None
    ) -> ProgressView:
        plan = training_plan(getattr(ctx, "workflow", None))
        scalars = snapshot.scalars if snapshot is not None else {}
        epoch = display_epoch(position)
        done = position.epoch_step
        if position.epoch_step == 0 and position.epoch > 0 and plan.batches_per_epoch:
            done = plan.batches_per_epoch
        rates = state.rates if state is not None else None
        return ProgressView(
            epoch=epoch,
            epochs_total=plan.target_epochs,
            epoch_done=done,
            epoch_total=plan.batches_per_epoch,
            steps_done=position.step,
            steps_total=_planned(scalars, plan.target_steps),
            remaining_s=scalars.get("budget/remaining_s"),
            budget_s=scalars.get("budget/seconds"),
            steps_per_s=rates.steps_per_s if rates else None,
            batches_per_s=rates.batches_per_s if rates else None,
            structures_per_s=rates.structures_per_s if rates else None,
            atoms_per_s=rates.atoms_per_s if rates else None,
        )

    def _show(self, layout: RichLayout, validating: bool, state: ReportingState | None) -> None:
        if self._live is not None:
            return  # the live display redraws on its own thread
        if not self.plain:
            self.console.print(self.renderable())
            return
        for message in self._new_messages(state):
            self._print_line(
                f"[{message.level}] {message.reporter or 'message'}: {message.message}"
            )
        view = self._view()
        line = validation_plain_line(view) if validating else layout.plain_line(view)
        if line:
            self._print_line(line)

    def _new_messages(self, state: ReportingState | None) -> list[Any]:
        if state is None:
            return []
        new = state.message_count - self._messages_printed
        self._messages_printed = state.message_count
        return list(state.messages[-new:]) if new > 0 else []

    def _print_line(self, line: str) -> None:
        self.console.print(
            Text(line), markup=False, highlight=False, emoji=False, soft_wrap=True, crop=False
        )

    # ----------------------------------------------------------------- rendering
    def _view(self) -> RichView:
        with self._lock:
            return RichView(
                title=self.title,
                snapshot=self._latest,
                history={key: tuple(points) for key, points in self._history.items()},
                progress=self._progress,
                validation=self._validation,
                messages=self._messages,
                elapsed_s=(
                    self._elapsed_s
                    if self._elapsed_s is not None
                    else time.monotonic() - self._started_at
                ),
                precision=self.precision,
                max_scalars=self.max_scalars,
                plot_keys=self.plot_keys,
                max_plots=self.max_plots,
                plot_height=self.plot_height,
                loss_units=dict(self._loss_units or {}),
            )

    def renderable(self) -> RenderableType:
        """The dashboard as a Rich renderable (training layout until one is chosen)."""
        layout = self._layout or TrainingRichLayout()
        return layout.render(self._view())

    def _render_live(self) -> RenderableType:
        try:
            return self.renderable()
        except Exception as exc:  # a drawing bug must not kill the refresh thread
            return Text(f"{self.title}: cannot draw the dashboard ({type(exc).__name__}: {exc})")

    # ----------------------------------------------------------------- history seeding
    def seed_history(
        self,
        history: Mapping[str, Sequence[float] | Sequence[tuple[int, float]]],
        *,
        steps: Sequence[int] | None = None,
        stage: str = "AFTER_OPTIMIZER_STEP",
        step_count: int | None = None,
        epoch: int | None = None,
        batch_count: int | None = None,
        global_rank: int = 0,
    ) -> None:
        """Load earlier values (e.g. from ``metrics.jsonl`` of a resumed run) into the charts.

        ``history`` maps keys to values (at ``steps``, default ``0, 1, ...``) or
        to ``(step, value)`` pairs. The last values become the latest snapshot.
        """
        latest: dict[str, float] = {}
        last_step = 0
        with self._lock:
            for key, series in history.items():
                points = []
                for index, item in enumerate(series):
                    if isinstance(item, tuple):
                        step, value = int(item[0]), float(item[1])
                    else:
                        step = int(steps[index]) if steps is not None else index
                        value = float(item)
                    points.append((step, value))
                self._history[key] = deque(points, maxlen=self.history_size)
                if points:
                    latest[key] = points[-1][1]
                    last_step = max(last_step, points[-1][0])
            count = last_step if step_count is None else step_count
            self._latest = ScalarSnapshot(
                stage=stage,
                scalars=latest,
                timestamp_s=time.time(),
                elapsed_s=0.0,
                event_count=0,
                step_count=count,
                batch_count=count if batch_count is None else batch_count,
                epoch_step_count=0,
                epoch=0 if epoch is None else epoch,
                global_rank=global_rank,
                step=count,
            )

    @classmethod
    def preview(
        cls, *, steps: int = 120, console: Console | None = None, **kwargs: Any
    ) -> RichReporter:
        """Print a dashboard filled with synthetic training data and return the reporter.

        Example:
            >>> import io
            >>> from rich.console import Console
            >>> _ = RichReporter.preview(console=Console(file=io.StringIO(), width=100))
        """
        kwargs.setdefault("layout", "training")
        reporter = cls(console=console, **kwargs)
        grid = range(1, steps + 1)
        energy = [0.5 * math.exp(-s / 30) + 0.01 for s in grid]
        forces = [0.8 * math.exp(-s / 45) + 0.03 for s in grid]
        lr = [1e-3 * 0.5 * (1 + math.cos(math.pi * s / steps)) + 1e-5 for s in grid]
        reporter.seed_history(
            {
                "loss/total": [e + 10 * f for e, f in zip(energy, forces)],
                "loss/EnergyMSELoss/unweighted": energy,
                "loss/ForceMSELoss/unweighted": forces,
                "scheduler/lr": lr,
            },
            steps=list(grid),
        )
        with reporter._lock:
            reporter._progress = ProgressView(
                epoch=math.ceil(steps / 40),
                epochs_total=10,
                epoch_done=steps % 40 or 40,
                epoch_total=40,
                steps_done=steps,
                steps_total=400,
                steps_per_s=12.5,
                batches_per_s=12.5,
                structures_per_s=400.0,
                atoms_per_s=9600.0,
            )
            reporter._validation = ValidationView(
                step=steps,
                epoch=math.ceil(steps / 40),
                values={
                    "loss": 0.41,
                    "loss:EnergyMSELoss": 0.02,
                    "energy_mae_per_atom": 0.004,
                    "forces_mae": 0.061,
                    "forces_rmse": 0.089,
                },
                previous={
                    "loss": 0.47,
                    "loss:EnergyMSELoss": 0.025,
                    "energy_mae_per_atom": 0.005,
                    "forces_mae": 0.066,
                    "forces_rmse": 0.087,
                },
                best={"forces_rmse": (0.085, steps - 40)},
            )
        layout = reporter._layout or TrainingRichLayout()
        if reporter.plain:
            reporter._print_line(layout.plain_line(reporter._view()))
        else:
            reporter.console.print(reporter.renderable())
        return reporter

    # ----------------------------------------------------------------- lifecycle
    def _renders_here(self) -> bool:
        return not ((self.rank_zero_only or self.requires_all_ranks) and get_rank() != 0)

    def __enter__(self) -> RichReporter:
        if self._live is None and not self.plain and self._renders_here():
            live = Live(
                console=self.console,
                get_renderable=self._render_live,
                refresh_per_second=self.refresh_per_second,
                screen=self.screen,
                transient=self.transient,
            )
            live.start()
            self._live = live
        return self

    def close(self) -> None:
        """Stop the live display (drawing the final frame unless ``transient``)."""
        live, self._live = self._live, None
        if live is not None:
            live.stop()


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"RichReporter {name} must be an int >= {minimum}; got {value!r}.")


def _planned(scalars: Any, target: int | None) -> int | None:
    """The run's end: a time budget's planned step when there is one (else the target)."""
    planned = scalars.get("budget/planned_steps")
    if planned is None:
        # A budget without a plan yet: the strategy's own target is only a cap.
        return None if "budget/seconds" in scalars else target
    return int(planned)
