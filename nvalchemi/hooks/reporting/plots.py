"""PNG plots of a run: learning curves from ``metrics.jsonl`` and parity plots.

matplotlib (extra ``plots``) is imported on first use, and figures are drawn
with the Agg canvas directly: nothing here touches pyplot or changes the
global matplotlib backend, so the functions are safe in notebooks and in
headless jobs. Files are written atomically (temporary file, then rename).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nvalchemi._fileio import write_atomic
from nvalchemi._optional import OptionalDependency
from nvalchemi.hooks.reporting.jsonl import metric_units, read_metrics
from nvalchemi.hooks.reporting.units import key_unit, metric_label

__all__ = ["parity_plots", "plot_learning_curves", "plot_parity"]

EV_PER_A3_IN_GPA = 160.21766208
"""1 eV/Å³ in GPa."""

_TRAIN_COLOR = "#1f77b4"
_VALIDATION_COLOR = "#d62728"


def _figure(width: float, height: float) -> Any:
    OptionalDependency.MATPLOTLIB.require("plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional
    from matplotlib.figure import Figure  # optional

    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def _save(figure: Any, out_png: str | Path) -> Path:
    out = Path(out_png)
    write_atomic(out, lambda handle: figure.savefig(handle, format="png", dpi=120))
    return out


# --------------------------------------------------------------------------- learning curves
def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        value, step = row.get(key), row.get("step")
        if isinstance(value, (int, float)) and isinstance(step, int) and math.isfinite(value):
            steps.append(step)
            values.append(float(value))
    return steps, values


def _smooth(values: Sequence[float], weight: float) -> list[float]:
    out, current = [], None
    for value in values:
        current = value if current is None else weight * current + (1 - weight) * value
        out.append(current)
    return out


def _loss_panels(
    train: list[dict[str, Any]], validation: list[dict[str, Any]]
) -> list[tuple[str, str, str]]:
    """``(title, train key, validation key)`` for the total loss and each component."""
    components = set()
    for row in train:
        components.update(
            k[5:-11] for k in row if k.startswith("loss/") and k.endswith("/unweighted")
        )
    for row in validation:
        components.update(
            k[16:-11] for k in row if k.startswith("validation/loss/") and k.endswith("/unweighted")
        )
    panels = [("total loss", "loss/total", "validation/loss/total")]
    panels += [
        (f"{c} (unweighted)", f"loss/{c}/unweighted", f"validation/loss/{c}/unweighted")
        for c in sorted(components)
    ]
    return panels


def _plot_curve(
    axes: Any, steps: list[int], values: list[float], *, color: str, label: str, marker: bool
) -> bool:
    positive = [(s, v) for s, v in zip(steps, values) if v > 0]
    if not positive:
        return False
    xs, ys = zip(*positive)
    if marker:
        axes.plot(xs, ys, "o-", color=color, label=label, markersize=4, linewidth=1.2)
    elif len(ys) > 20:
        axes.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
        axes.plot(xs, _smooth(ys, 0.8), color=color, label=f"{label} (smoothed)", linewidth=1.4)
    else:
        axes.plot(xs, ys, color=color, label=label, linewidth=1.2)
    return True


def plot_learning_curves(metrics_jsonl_path: str | Path, out_png: str | Path) -> Path:
    """Plot train and validation loss per component against the step (log scale).

    One panel for the total loss and one per loss component (train rows as a
    line, validation rows as markers; the unit of each in its title), plus one panel of
    validation metrics per unit (energy per atom, forces, stress, total energy, in meV)
    and the learning rate when the file has them. Non-positive values are left out of
    the log-scale panels.

    Example:
        >>> plot_learning_curves("runs/demo/metrics.jsonl", "runs/demo/learning_curves.png")  # doctest: +SKIP
        PosixPath('runs/demo/learning_curves.png')
    """
    rows = read_metrics(metrics_jsonl_path)
    train = [r for r in rows if r.get("kind") == "train"]
    validation = [r for r in rows if r.get("kind") == "validation"]
    panels = [
        p
        for p in _loss_panels(train, validation)
        if _series(train, p[1])[0] or _series(validation, p[2])[0]
    ]
    if not panels:
        raise ValueError(
            f"{metrics_jsonl_path} has no loss values to plot (expected 'loss/total' or "
            "'validation/loss/total' entries written by JSONLinesReporter)."
        )
    units = metric_units(rows)
    metric_keys = sorted(
        {
            k
            for row in validation
            for k in row
            if k.startswith("validation/")
            and not k.startswith("validation/loss/")
            and not k.startswith(("validation/num_", "validation/ema/"))  # not metrics
        }
    )
    groups: dict[str, list[str]] = {}
    for key in metric_keys:  # one axis per unit: never meV/atom next to meV/Å
        groups.setdefault(key_unit(key) or "", []).append(key)
    order = ["eV/atom", "eV/Å", "eV/Å³", "eV"]
    groups = dict(sorted(groups.items(), key=lambda g: order.index(g[0]) if g[0] in order else 9))
    lr_key = next((k for k in ("scheduler/lr", "optimizer/lr") if _series(train, k)[0]), None)
    count = len(panels) + len(groups) + bool(lr_key)
    columns = min(3, count)
    rows_needed = math.ceil(count / columns)
    figure = _figure(4.8 * columns, 3.4 * rows_needed)
    # Fixed margins: constrained layout costs more than the drawing on small machines.
    grid = figure.subplots(
        rows_needed,
        columns,
        squeeze=False,
        gridspec_kw={
            "wspace": 0.3,
            "hspace": 0.45,
            "left": 0.07,
            "right": 0.98,
            "bottom": 0.5 / (3.4 * rows_needed),
            "top": 1 - 0.35 / (3.4 * rows_needed),
        },
    ).ravel()
    for axes, (title, train_key, validation_key) in zip(grid, panels):
        drawn = _plot_curve(
            axes, *_series(train, train_key), color=_TRAIN_COLOR, label="train", marker=False
        )
        drawn |= _plot_curve(
            axes,
            *_series(validation, validation_key),
            color=_VALIDATION_COLOR,
            label="validation",
            marker=True,
        )
        if drawn:
            axes.set_yscale("log")
            axes.legend(fontsize="small")
        unit = units.get(train_key) or units.get(validation_key)
        axes.set_title(f"{title} [{unit}]" if unit else title)
        axes.set_xlabel("optimizer step")
        axes.grid(True, which="both", alpha=0.3)
    index = len(panels)
    cycle = [f"C{i}" for i in range(10)]
    for unit, keys in groups.items():
        axes = grid[index]
        index += 1
        scale = 1000.0 if unit else 1.0
        for i, key in enumerate(keys):
            steps, values = _series(validation, key)
            _plot_curve(
                axes,
                steps,
                [scale * v for v in values],
                color=cycle[i % 10],
                label=metric_label(key) or key[11:],
                marker=True,
            )
        axes.set_yscale("log")
        axes.set_title(f"validation errors [m{unit}]" if unit else "validation metrics")
        if unit:
            axes.set_ylabel(f"m{unit}")
        axes.set_xlabel("optimizer step")
        axes.legend(fontsize="x-small")
        axes.grid(True, which="both", alpha=0.3)
    if lr_key:
        axes = grid[index]
        index += 1
        axes.plot(*_series(train, lr_key), color="#2ca02c")
        axes.set_title("learning rate")
        axes.set_xlabel("optimizer step")
        axes.grid(True, alpha=0.3)
    for axes in grid[index:]:
        axes.set_visible(False)
    return _save(figure, out_png)


# --------------------------------------------------------------------------- parity
def _as_array(values: Any, name: str) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().double().numpy()
    try:
        return np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be numbers (a tensor, array or sequence); {exc}") from None


def plot_parity(
    pred: Any,
    ref: Any,
    out_png: str | Path,
    *,
    title: str = "Parity",
    unit: str = "",
) -> Path:
    """Scatter predicted against reference values with the ``y = x`` line; MAE/RMSE in the legend.

    ``pred`` and ``ref`` are tensors, arrays or sequences of the same size
    (flattened, so force components can be passed as ``(N, 3)``). Pairs with a
    non-finite value are left out (and counted in the legend).

    Example:
        >>> plot_parity([1.0, 2.0], [1.1, 1.9], "parity.png", title="Energy", unit="eV")  # doctest: +SKIP
        PosixPath('parity.png')
    """
    predicted, reference = _as_array(pred, "pred"), _as_array(ref, "ref")
    if predicted.shape != reference.shape:
        raise ValueError(
            f"plot_parity: pred has {predicted.size} values but ref has {reference.size}; "
            "pass predictions and references for the same structures/atoms."
        )
    finite = np.isfinite(predicted) & np.isfinite(reference)
    dropped = int(predicted.size - finite.sum())
    predicted, reference = predicted[finite], reference[finite]
    if predicted.size == 0:
        raise ValueError(f"plot_parity ({title}): no finite (pred, ref) pairs to plot.")
    error = predicted - reference
    mae = float(np.mean(np.abs(error)))
    rmse = float(np.sqrt(np.mean(error**2)))
    suffix = f" {unit}" if unit else ""
    label = f"MAE {mae:.3g}{suffix}\nRMSE {rmse:.3g}{suffix}\nn = {predicted.size:,}"
    if dropped:
        label += f" ({dropped:,} non-finite left out)"
    figure = _figure(4.8, 4.6)
    axes = figure.subplots(gridspec_kw={"left": 0.16, "right": 0.96, "bottom": 0.12, "top": 0.92})
    low = float(min(predicted.min(), reference.min()))
    high = float(max(predicted.max(), reference.max()))
    pad = 0.05 * (high - low) if high > low else max(abs(high), 1.0) * 0.05
    low, high = low - pad, high + pad
    if predicted.size > 50_000:
        axes.hexbin(
            reference,
            predicted,
            gridsize=120,
            bins="log",
            cmap="viridis",
            mincnt=1,
            extent=(low, high, low, high),
        )
        axes.plot([], [], "s", color="#440154", label=label)
    else:
        axes.scatter(
            reference,
            predicted,
            s=6,
            alpha=0.5,
            color=_TRAIN_COLOR,
            label=label,
            rasterized=True,
            edgecolors="none",
        )
    axes.plot([low, high], [low, high], "--", color="0.4", linewidth=1)
    axes.set_xlim(low, high)
    axes.set_ylim(low, high)
    axes.set_aspect("equal")
    unit_label = f" [{unit}]" if unit else ""
    axes.set_xlabel(f"reference{unit_label}")
    axes.set_ylabel(f"predicted{unit_label}")
    axes.set_title(title)
    axes.legend(loc="upper left", fontsize="small", handlelength=0, handletextpad=0, markerscale=0)
    axes.grid(True, alpha=0.3)
    return _save(figure, out_png)


def parity_plots(
    energy_per_atom_pred: Any,
    energy_per_atom_ref: Any,
    forces_pred: Any,
    forces_ref: Any,
    out_dir: str | Path,
    *,
    stress_pred: Any = None,
    stress_ref: Any = None,
) -> list[Path]:
    """Write ``parity_energy_per_atom.png``, ``parity_forces.png`` (force components) and,
    with stress, ``parity_stress.png`` (components, in GPa) to ``out_dir``.

    Values are in eV/atom, eV/Å and eV/Å³. Pass ``None`` for both values of a quantity
    the model does not predict. Returns the paths written.
    """
    out_dir = Path(out_dir)
    written = []
    to_gpa = (
        None if stress_pred is None else _as_array(stress_pred, "stress_pred") * EV_PER_A3_IN_GPA
    )
    ref_gpa = None if stress_ref is None else _as_array(stress_ref, "stress_ref") * EV_PER_A3_IN_GPA
    plots = (
        (
            "energy per atom",
            energy_per_atom_pred,
            energy_per_atom_ref,
            "Energy per atom",
            "eV/atom",
            "parity_energy_per_atom.png",
        ),
        ("forces", forces_pred, forces_ref, "Force components", "eV/Å", "parity_forces.png"),
        ("stress", to_gpa, ref_gpa, "Stress components", "GPa", "parity_stress.png"),
    )
    for name, pred, ref, title, unit, filename in plots:
        if pred is None and ref is None:
            continue
        if pred is None or ref is None:
            raise ValueError(
                f"parity_plots: {name} has {'predictions' if ref is None else 'references'} "
                "but not the other; pass both or neither."
            )
        written.append(plot_parity(pred, ref, out_dir / filename, title=title, unit=unit))
    return written
