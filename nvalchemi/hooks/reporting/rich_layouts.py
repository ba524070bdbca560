"""What the Rich dashboard draws: the training and dynamics views, and plain log lines.

A layout turns a :class:`RichView` (an immutable copy of what the reporter
knows) into a Rich renderable, and into one plain text line for consoles that
are not terminals (CI, Slurm logs, pipes). Layouts never touch the context or
tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Protocol, runtime_checkable

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from nvalchemi.hooks.reporting._charts import braille_chart, sparkline
from nvalchemi.hooks.reporting.scalars import ScalarSnapshot
from nvalchemi.hooks.reporting.state import ReporterMessage
from nvalchemi.hooks.reporting.units import TOTAL_LOSS_LABEL, display

__all__ = [
    "BaseRichLayout",
    "DynamicsRichLayout",
    "ProgressView",
    "RichLayout",
    "RichView",
    "TrainingRichLayout",
    "ValidationView",
    "format_duration",
    "resolve_rich_layout",
]

History = Mapping[str, Sequence[tuple[int, float]]]
_SIDE_PREFIXES = ("training/", "throughput/", "validation/", "memory/", "dynamics/")


# --------------------------------------------------------------------------- view data
@dataclass(frozen=True)
class ProgressView:
    """Where the run stands: epoch and overall progress, rates (``None`` = unknown)."""

    epoch: int
    epochs_total: int | None
    epoch_done: int
    epoch_total: int | None
    steps_done: int
    steps_total: int | None
    steps_per_s: float | None = None
    batches_per_s: float | None = None
    structures_per_s: float | None = None
    atoms_per_s: float | None = None
    remaining_s: float | None = None
    """Time left of a time budget (``None`` without one)."""
    budget_s: float | None = None

    @property
    def epoch_eta_s(self) -> float | None:
        """Seconds to the end of the epoch at the current batch rate."""
        if self.epoch_total is None or not self.batches_per_s:
            return None
        return max(self.epoch_total - self.epoch_done, 0) / self.batches_per_s

    @property
    def eta_s(self) -> float | None:
        """Seconds to the end of the run: the budget's time left, else at the step rate."""
        if self.remaining_s is not None:
            return self.remaining_s
        if self.steps_total is None or not self.steps_per_s:
            return None
        return max(self.steps_total - self.steps_done, 0) / self.steps_per_s

    def eta_text(self) -> str:
        """``"eta 00:45"``, or ``"03:20 left of 05:00"`` with a time budget."""
        if self.remaining_s is not None and self.budget_s is not None:
            return f"{format_duration(self.remaining_s)} left of {format_duration(self.budget_s)}"
        return f"eta {format_duration(self.eta_s)}"


@dataclass(frozen=True)
class ValidationView:
    """The latest validation summary, the one before it and the best values seen."""

    step: int
    epoch: int
    values: dict[str, float]
    previous: dict[str, float] = field(default_factory=dict)
    best: dict[str, tuple[float, int]] = field(default_factory=dict)
    """``metric -> (best value, step)``."""


@dataclass(frozen=True)
class RichView:
    """Everything a layout may draw, copied out of the reporter at render time."""

    title: str
    snapshot: ScalarSnapshot | None
    history: History
    progress: ProgressView | None = None
    validation: ValidationView | None = None
    messages: tuple[ReporterMessage, ...] = ()
    elapsed_s: float = 0.0
    precision: int = 6
    max_scalars: int | None = None
    plot_keys: tuple[str, ...] | None = None
    max_plots: int = 3
    plot_height: int = 8
    loss_units: Mapping[str, str] = field(default_factory=dict)
    """Unit of each loss component's value (``{"ForceMSELoss": "(eV/Å)²"}``)."""


@runtime_checkable
class RichLayout(Protocol):
    """A dashboard design: ``render(view)`` for terminals, ``plain_line(view)`` for logs."""

    name: str

    def render(self, view: RichView) -> RenderableType:
        """The live dashboard for ``view``."""
        ...

    def plain_line(self, view: RichView) -> str:
        """One log line (no markup, no escape codes) for ``view``."""
        ...


# --------------------------------------------------------------------------- formatting
def format_duration(seconds: float | None) -> str:
    """``45 -> '00:45'``, ``3723 -> '1:02:03'``, ``None -> '--:--'``.

    Example:
        >>> format_duration(45), format_duration(3723), format_duration(90061)
        ('00:45', '1:02:03', '1d 01:01:01')
    """
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "--:--"
    total = round(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes:02d}:{secs:02d}"


def _rate(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    if value >= 1e4:
        return f"{value / 1e3:.0f}k"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def _num(value: float, precision: int) -> str:
    return f"{value:.{precision}g}" if math.isfinite(value) else str(value)


def _sci(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}e}" if math.isfinite(value) else str(value)


def _count(done: int, total: int | None) -> str:
    return f"{done:,}" if total is None else f"{done:,}/{total:,}"


def _pick_lr(scalars: Mapping[str, float]) -> float | None:
    for key in ("scheduler/lr", "optimizer/lr"):
        if key in scalars:
            return scalars[key]
    lrs = sorted(k for k in scalars if k.endswith("/lr"))
    return scalars[lrs[0]] if lrs else None


def _components(scalars: Mapping[str, float], prefix: str = "loss/") -> list[tuple[str, float]]:
    out = []
    for key in sorted(scalars):
        if key.startswith(prefix) and key.endswith("/unweighted"):
            out.append((key[len(prefix) : -len("/unweighted")], scalars[key]))
    return out


def order_keys(keys: Sequence[str], preferred: Sequence[str]) -> list[str]:
    """``keys`` with those matching the ``preferred`` patterns first (in pattern order).

    Example:
        >>> order_keys(["b", "loss/F/unweighted", "loss/total", "a"], ["loss/total", "loss/*/unweighted"])
        ['loss/total', 'loss/F/unweighted', 'a', 'b']
    """
    remaining = sorted(keys)
    ordered: list[str] = []
    for pattern in preferred:
        for key in remaining:
            if key not in ordered and fnmatchcase(key, pattern):
                ordered.append(key)
    return ordered + [k for k in remaining if k not in ordered]


def choose_plot_keys(
    keys: Sequence[str], plot_keys: Sequence[str] | None, preferred: Sequence[str], max_plots: int
) -> list[str]:
    """The keys to chart: ``plot_keys`` (names or patterns) if given, else preferred then alphabetical."""
    if max_plots <= 0:
        return []
    if plot_keys:
        chosen = order_keys(
            [k for k in keys if any(fnmatchcase(k, p) for p in plot_keys)], plot_keys
        )
    else:
        candidates = [k for k in keys if not k.startswith(_SIDE_PREFIXES)]
        if "scheduler/lr" in candidates and "optimizer/lr" in candidates:
            candidates.remove("optimizer/lr")  # the same curve twice
        chosen = order_keys(candidates, preferred)
    return chosen[:max_plots]


def short_label(key: str) -> str:
    """Display name of a scalar key: the ``/unweighted`` of component losses is implied.

    Example:
        >>> short_label("loss/EnergyMSELoss/unweighted"), short_label("optimizer/lr")
        ('loss/EnergyMSELoss', 'optimizer/lr')
    """
    return key[: -len("/unweighted")] if key.endswith("/unweighted") else key


def _is_log_key(key: str) -> bool:
    return "loss" in key or key.endswith(("lr", "_mae", "_rmse", "grad_norm"))


# --------------------------------------------------------------------------- renderables
class _Chart:
    """A braille line chart that fills the width it is given."""

    def __init__(self, values: Sequence[float], height: int, log: bool) -> None:
        self.values, self.height, self.log = values, height, log

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = braille_chart(
            self.values, width=options.max_width, height=self.height, log=self.log
        )
        yield Text("\n".join(lines), style="cyan", no_wrap=True)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(8, options.max_width)


def _charts(view: RichView, preferred: Sequence[str]) -> RenderableType | None:
    keys = [k for k, points in view.history.items() if points]
    chosen = choose_plot_keys(keys, view.plot_keys, preferred, view.max_plots)
    if not chosen:
        return None
    grid = Table.grid(expand=True, padding=(0, 1))
    for _ in chosen:
        grid.add_column(ratio=1)
    cells = []
    for key in chosen:
        points = view.history[key]
        values = [v for _, v in points]
        log = _is_log_key(key) and all(v > 0 for v in values if math.isfinite(v))
        title = f"{short_label(key)} (log)" if log else short_label(key)
        subtitle = f"steps {points[0][0]}-{points[-1][0]} · last {_num(values[-1], 4)}"
        cells.append(
            Panel(
                _Chart(values, view.plot_height, log),
                title=title,
                subtitle=subtitle,
                box=box.ROUNDED,
                padding=(0, 0),
            )
        )
    grid.add_row(*cells)
    return grid


def _latest_table(view: RichView, preferred: Sequence[str], title: str) -> Table | None:
    snapshot = view.snapshot
    if snapshot is None:
        return None
    keys = order_keys([k for k in snapshot.scalars if not k.startswith(_SIDE_PREFIXES)], preferred)
    if not keys:
        return None
    table = Table(title=title, box=box.SIMPLE_HEAD, expand=True, title_justify="left")
    table.add_column("metric", style="bold", no_wrap=True, overflow="ellipsis")
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("trend", no_wrap=True, style="cyan")
    limit = view.max_scalars or len(keys)
    for key in keys[:limit]:
        values = [v for _, v in view.history.get(key, ())]
        trend = sparkline(values, width=10, log=_is_log_key(key)) if len(values) > 1 else ""
        component = key.split("/")[-2] if key.endswith("/unweighted") else None
        unit = view.loss_units.get(component or "", TOTAL_LOSS_LABEL if key == "loss/total" else "")
        label = short_label(key) + (f" [{unit}]" if unit else "")
        table.add_row(label, _num(snapshot.scalars[key], view.precision), trend)
    if len(keys) > limit:
        table.add_row(Text(f"... {len(keys) - limit} omitted", style="dim"), "", "")
    table.caption = f"rank {snapshot.global_rank} · event {snapshot.event_count}"
    return table


def _validation_rows(values: Mapping[str, float]) -> list[str]:
    loss = [k for k in ("loss",) if k in values]
    components = sorted(k for k in values if k.startswith("loss:"))
    others = sorted(
        (k for k in values if k != "loss" and not k.startswith(("loss:", "ema/"))),
        key=_metric_order,
    )
    return loss + components + others


_QUANTITY_ORDER = ("energy_per_atom", "forces", "stress", "energy_")


def _metric_order(key: str) -> tuple[int, str]:
    """Per-atom energy, forces and stress errors first, total energy after, then the rest."""
    rank = next(
        (i for i, q in enumerate(_QUANTITY_ORDER) if key.startswith(q)), len(_QUANTITY_ORDER)
    )
    return rank, key


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of ``metric`` is an improvement (R², accuracy, correlation)."""
    name = metric.lower()
    return any(tag in name for tag in ("r2", "accuracy", "corr", "pearson", "spearman"))


def _validation_table(view: RichView) -> Table | None:
    validation = view.validation
    if validation is None or not validation.values:
        return None
    table = Table(
        title=f"Validation · epoch {validation.epoch} · step {validation.step:,}",
        box=box.SIMPLE_HEAD,
        expand=True,
        title_justify="left",
    )
    table.add_column("metric", style="bold", no_wrap=True, overflow="ellipsis")
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("change", justify="right", no_wrap=True)
    table.add_column("best", justify="right", no_wrap=True)
    for key in _validation_rows(validation.values)[: view.max_scalars or None]:
        value = validation.values[key]
        previous = validation.previous.get(key)
        change = Text("")
        if previous is not None and math.isfinite(value) and math.isfinite(previous):
            delta = value - previous
            if previous != 0:
                improved = (delta > 0) == higher_is_better(key) and delta != 0
                arrow = "▲" if delta > 0 else "▼" if delta < 0 else "="
                style = "green" if improved else "red" if delta != 0 else "dim"
                change = Text(f"{arrow} {abs(delta / previous) * 100:.1f}%", style=style)
        best_value, best_step = validation.best.get(key, (value, validation.step))
        shown = display(key, value)
        if best_step == validation.step:
            best = Text("★ now", style="yellow")
        else:
            best_shown = display(key, best_value)
            best = Text(best_shown[1] if best_shown else _num(best_value, 4))
            best.append(f" @{best_step:,}", style="dim")
        if shown is not None:
            label, text = shown
        else:
            component = key.split(":", 1)[1] if key.startswith("loss:") else None
            unit = view.loss_units.get(component or "", TOTAL_LOSS_LABEL if key == "loss" else "")
            label = key.replace("loss:", "loss/", 1) + (f" [{unit}]" if unit else "")
            text = _num(value, view.precision)
        table.add_row(label, text, change, best)
    note = ema_note(validation.values)
    if note:
        table.caption = note
    return table


def _messages_panel(view: RichView) -> Panel | None:
    if not view.messages:
        return None
    styles = {"info": "cyan", "warning": "yellow", "error": "bold red"}
    text = Text()
    for message in view.messages[-3:]:
        if text:
            text.append("\n")
        text.append(f"[{message.level}] ", style=styles.get(message.level, ""))
        if message.reporter:
            text.append(f"{message.reporter}: ", style="dim")
        text.append(message.message)
    return Panel(text, title="Messages", box=box.ROUNDED)


def _side_by_side(*renderables: RenderableType | None) -> RenderableType | None:
    present = [r for r in renderables if r is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    grid = Table.grid(expand=True, padding=(0, 2))
    for _ in present:
        grid.add_column(ratio=1)
    grid.add_row(*present)
    return grid


# --------------------------------------------------------------------------- layouts
class BaseRichLayout:
    """A generic dashboard: header, latest values, validation table, charts, messages.

    Subclass it (or pass the arguments) to change the name, the keys shown
    first and charted (``fnmatch`` patterns) and the table title.

    Example:
        >>> layout = BaseRichLayout(name="md", preferred_plot_keys=("energy", "fmax"))
        >>> layout.name, layout.preferred_keys
        ('md', ('energy', 'fmax'))
    """

    name = "base"
    preferred_keys: tuple[str, ...] = ()
    latest_title = "Latest"

    def __init__(
        self,
        *,
        name: str | None = None,
        preferred_plot_keys: Sequence[str] | None = None,
        latest_title: str | None = None,
    ) -> None:
        if name is not None:
            self.name = name
        if preferred_plot_keys is not None:
            self.preferred_keys = tuple(preferred_plot_keys)
        if latest_title is not None:
            self.latest_title = latest_title

    def _header(self, view: RichView) -> Text:
        text = Text(view.title, style="bold")
        snapshot = view.snapshot
        parts = [self.name]
        if snapshot is not None:
            parts += [snapshot.stage, f"step {snapshot.step:,}"]
        parts.append(f"elapsed {format_duration(view.elapsed_s)}")
        text.append("  " + " · ".join(parts), style="dim")
        return text

    def _body(self, view: RichView) -> list[RenderableType | None]:
        return [
            _side_by_side(
                _latest_table(view, self.preferred_keys, self.latest_title),
                _validation_table(view),
            ),
            _charts(view, self.preferred_keys),
            _messages_panel(view),
        ]

    def render(self, view: RichView) -> RenderableType:
        """The dashboard: header, latest values, charts and messages."""
        if view.snapshot is None and view.validation is None:
            return Text(f"{view.title}: waiting for the first report…", style="dim")
        parts = [self._header(view), *self._body(view)]
        return Group(*(p for p in parts if p is not None))

    def plain_line(self, view: RichView) -> str:
        """``step 120 energy -1.23e+01 fmax 3.10e-02 ...`` (preferred keys first)."""
        snapshot = view.snapshot
        if snapshot is None:
            return ""
        parts = [f"step {snapshot.step}"]
        keys = [k for k in snapshot.scalars if not k.startswith(_SIDE_PREFIXES)]
        for key in order_keys(keys, self.preferred_keys)[: view.max_scalars or 8]:
            parts.append(f"{key} {_sci(snapshot.scalars[key])}")
        return " ".join(parts)


class TrainingRichLayout(BaseRichLayout):
    """Training dashboard: epoch and run progress bars with ETA, rates, latest values,
    validation table, loss/learning-rate charts, messages.

    Preferred chart keys are patterns, so component keys such as
    ``loss/EnergyMSELoss/unweighted`` are charted (the reference's
    ``loss/energy/unweighted`` never matched anything).
    """

    name = "training"
    preferred_keys = (
        "loss/total",
        "loss/*/unweighted",
        "scheduler/lr",
        "optimizer/lr",
        "grad_norm",
    )

    def _progress(self, view: RichView) -> RenderableType | None:
        progress = view.progress
        if progress is None:
            return None
        grid = Table.grid(padding=(0, 1), expand=True)
        grid.add_column(no_wrap=True, style="bold")
        grid.add_column(ratio=1)
        grid.add_column(justify="right", no_wrap=True)
        grid.add_column(justify="right", no_wrap=True, style="cyan")
        epochs = "" if progress.epochs_total is None else f"/{progress.epochs_total}"
        grid.add_row(
            f"Epoch {progress.epoch}{epochs}",
            ProgressBar(total=progress.epoch_total, completed=progress.epoch_done),
            _count(progress.epoch_done, progress.epoch_total),
            f"eta {format_duration(progress.epoch_eta_s)}",
        )
        if progress.steps_total is not None or progress.remaining_s is not None:
            total = progress.steps_total
            if total is None:  # a budget still timing its first steps: show the time
                total, done = (
                    progress.budget_s or 1.0,
                    (progress.budget_s or 1.0) - progress.remaining_s,
                )
            else:
                done = progress.steps_done
            grid.add_row(
                "Run",
                ProgressBar(total=total, completed=done),
                _count(progress.steps_done, progress.steps_total),
                progress.eta_text(),
            )
        return Panel(Group(grid, self._rates(view)), box=box.ROUNDED, padding=(0, 1))

    def _rates(self, view: RichView) -> Text:
        progress, snapshot = view.progress, view.snapshot
        items: list[str] = []
        if progress is not None:
            if progress.structures_per_s is not None:
                items.append(f"{_rate(progress.structures_per_s)} structures/s")
            if progress.atoms_per_s is not None:
                items.append(f"{_rate(progress.atoms_per_s)} atoms/s")
            if progress.steps_per_s is not None:
                items.append(f"{_rate(progress.steps_per_s)} steps/s")
        if snapshot is not None:
            lr = _pick_lr(snapshot.scalars)
            if lr is not None:
                items.append(f"lr {_sci(lr, 2)}")
            memory = snapshot.scalars.get(
                "memory/cuda_max_allocated_mib", snapshot.scalars.get("memory/rss_peak_mib")
            )
            if memory is not None:
                items.append(f"peak mem {memory / 1024:.2f} GiB")
        return Text(" · ".join(items) if items else "measuring throughput…", style="dim")

    def _body(self, view: RichView) -> list[RenderableType | None]:
        return [self._progress(view), *super()._body(view)]

    def plain_line(self, view: RichView) -> str:
        """``epoch 3/10 batch 120/400 step 1,200/4,000 loss 1.23e-02 [...] lr 1.0e-03 412 structures/s eta 00:45``."""
        parts: list[str] = []
        progress, snapshot = view.progress, view.snapshot
        if progress is not None:
            epochs = "" if progress.epochs_total is None else f"/{progress.epochs_total}"
            parts.append(f"epoch {progress.epoch}{epochs}")
            if progress.epoch_total is not None:
                parts.append(f"batch {progress.epoch_done}/{progress.epoch_total}")
            parts.append(f"step {_count(progress.steps_done, progress.steps_total)}")
        elif snapshot is not None:
            parts.append(f"step {snapshot.step}")
        if snapshot is not None:
            scalars = snapshot.scalars
            if "loss/total" in scalars:
                parts.append(f"loss {_sci(scalars['loss/total'])} ({TOTAL_LOSS_LABEL})")
            components = _components(scalars)
            if components:
                parts.append(_component_text(components, view.loss_units))
            lr = _pick_lr(scalars)
            if lr is not None:
                parts.append(f"lr {_sci(lr, 1)}")
            if "grad_norm" in scalars:
                parts.append(f"grad_norm {_sci(scalars['grad_norm'])}")
        if progress is not None:
            if progress.structures_per_s is not None:
                parts.append(f"{_rate(progress.structures_per_s)} structures/s")
            if progress.atoms_per_s is not None:
                parts.append(f"{_rate(progress.atoms_per_s)} atoms/s")
            if progress.eta_s is not None:
                parts.append(progress.eta_text())
        return " ".join(parts)


class DynamicsRichLayout(BaseRichLayout):
    """Simulation dashboard: energy, fmax, convergence, latest values and charts."""

    name = "dynamics"
    preferred_keys = (
        "energy",
        "fmax",
        "temperature",
        "energy_drift",
        "converged_fraction",
        "active_fraction",
    )


def _component_text(components: Sequence[tuple[str, float]], units: Mapping[str, str]) -> str:
    """``[EnergyMSELoss 1.10e-02 (eV/atom)², ForceMSELoss 3.2e-02 (eV/Å)²]``."""
    items = [f"{c} {_sci(v)}" + (f" {units[c]}" if c in units else "") for c, v in components]
    return "[" + ", ".join(items) + "]"


def ema_note(values: Mapping[str, float]) -> str | None:
    """``"EMA weights, warming up: 120 updates, 55% still the initial weights"`` (or ``None``)."""
    share = values.get("ema/initial_share")
    if share is None:
        return None
    updates = int(values.get("ema/updates", 0))
    if share > EMA_WARM_SHARE:
        return (
            f"EMA weights, warming up: {updates:,} updates, {share:.0%} of the average "
            "is still the initial weights"
        )
    return f"EMA weights, {updates:,} updates"


EMA_WARM_SHARE = 0.05
"""The EMA counts as warmed up once the initial weights have less than this share."""


def validation_plain_line(view: RichView) -> str:
    """``validation epoch 3 step 1200 (EMA weights, ...) loss 1.20e-02 (weighted sum) [...]
    energy/atom MAE 12.3 meV/atom ... forces MAE 34.1 meV/Å ...``."""
    validation = view.validation
    if validation is None:
        return ""
    values = validation.values
    parts = [f"validation epoch {validation.epoch} step {validation.step}"]
    note = ema_note(values)
    if note:
        parts.append(f"({note})")
    rows = _validation_rows(values)
    if "loss" in values:
        parts.append(f"loss {_sci(values['loss'])} ({TOTAL_LOSS_LABEL})")
    components = [(k.split(":", 1)[1], values[k]) for k in rows if k.startswith("loss:")]
    if components:
        parts.append(_component_text(components, view.loss_units))
    for key in rows:
        if key == "loss" or key.startswith("loss:"):
            continue
        shown = display(key, values[key])
        parts.append(f"{shown[0]} {shown[1]}" if shown else f"{key} {_sci(values[key])}")
    return " ".join(parts)


def validation_display_values(scalars: Mapping[str, float]) -> dict[str, float]:
    """Map ``validation/...`` scalar keys to table rows: ``loss``, ``loss:<Component>``, metrics.

    Weights, per-sample means and batch counts are bookkeeping, not results, and are left out.

    Example:
        >>> validation_display_values({"validation/loss/total": 1.0,
        ...     "validation/loss/EnergyMSELoss/unweighted": 0.5,
        ...     "validation/loss/EnergyMSELoss/weight": 1.0, "validation/forces_mae": 0.1})
        {'loss': 1.0, 'loss:EnergyMSELoss': 0.5, 'forces_mae': 0.1}
    """
    out: dict[str, float] = {}
    for key, value in scalars.items():
        if not key.startswith("validation/"):
            continue
        name = key[len("validation/") :]
        if name == "loss/total":
            out["loss"] = value
        elif name.startswith("loss/"):
            if name.endswith("/unweighted"):
                out["loss:" + name[len("loss/") : -len("/unweighted")]] = value
        elif not name.startswith(("num_", "budget/")):  # pass sizes, the time budget
            out[name] = value
    return out


def resolve_rich_layout(layout: Any) -> RichLayout | None:
    """``None``/``"auto"`` -> ``None`` (decided at the first event); names -> layouts; objects as-is."""
    if layout is None or (isinstance(layout, str) and layout.lower() == "auto"):
        return None
    if isinstance(layout, str):
        layouts = {"training": TrainingRichLayout, "dynamics": DynamicsRichLayout}
        try:
            return layouts[layout.lower()]()
        except KeyError:
            raise ValueError(
                f"Unknown RichReporter layout {layout!r}; use 'auto', 'training', 'dynamics' or "
                "an object with render(view) and plain_line(view)."
            ) from None
    missing = [m for m in ("render", "plain_line") if not callable(getattr(layout, m, None))]
    if missing:
        raise TypeError(
            f"RichReporter layout {type(layout).__name__} lacks {missing}; a layout needs "
            "render(view) -> renderable and plain_line(view) -> str."
        )
    return layout
