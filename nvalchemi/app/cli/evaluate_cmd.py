"""``evaluate``: a checkpoint on data -> error tables (overall, per structure type, element,
file, force magnitude) and parity plots; :func:`print_evaluation` prints them (also for
``spec run`` and ``quickstart``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from nvalchemi.app.cli._app import debug_option, main, parse_checkpoint_index
from nvalchemi.app.cli._console import err_console, print_table

__all__ = ["evaluate", "print_evaluation"]

_ERROR_COLUMNS = ["E MAE", "E RMSE", "F MAE", "F RMSE", "S MAE", "S RMSE"]
UNITS_NOTE = (
    "E: energy per atom (meV/atom), F: force components (meV/Å), S: stress components (meV/Å³)"
)


def _overall_rows(metrics: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    from nvalchemi.app.evaluation import DISPLAY, QUANTITIES

    labels = {
        "energy_per_atom": "energy per atom",
        "forces": "forces (components)",
        "stress": "stress (components)",
    }
    return [
        (
            labels[q],
            f"{1000 * metrics[f'{q}_mae']:.2f}",
            f"{1000 * metrics[f'{q}_rmse']:.2f}",
            DISPLAY[q],
        )
        for q in QUANTITIES
        if f"{q}_mae" in metrics
    ]


def _breakdown(console: Any, title: str, first: str, rows: dict[str, dict[str, Any]]) -> None:
    from nvalchemi.app.evaluation import error_rows

    if not rows or (len(rows) < 2 and first == "file"):
        return  # one file is the overall table again
    body = [
        (name, f"{v.get('structures', 0):,}", f"{v.get('atoms', 0):,}", *error_rows(v))
        for name, v in rows.items()
    ]
    print_table(console, title, [first, "structures", "atoms", *_ERROR_COLUMNS], body)


def _force_bins(console: Any, bins: list[dict[str, float]]) -> None:
    if not bins:
        return
    rows = []
    for b in bins:
        high = "∞" if math.isinf(b["high"]) else f"{b['high']:g}"
        rows.append(
            (
                f"{b['low']:g} - {high}",
                f"{b['atoms']:,}",
                f"{1000 * b['forces_mae']:.2f}",
                f"{1000 * b['forces_rmse']:.2f}",
                f"{100 * b['relative_mae']:.1f}%",
            )
        )
    print_table(
        console,
        "Force errors by reference force magnitude |F| (eV/Å)",
        ["|F| eV/Å", "atoms", "MAE meV/Å", "RMSE meV/Å", "MAE / mean |F|"],
        rows,
    )


def print_evaluation(console: Any, evaluation: Any, title: str, grouping: str = "") -> dict:
    """Print every error table of ``evaluation``; return its JSON-ready report."""
    report = evaluation.report()
    metrics = report["metrics"]
    print_table(
        console,
        f"{title}: {metrics['num_structures']:,} structures, {metrics['num_atoms']:,} atoms",
        ["quantity", "MAE", "RMSE", "unit"],
        _overall_rows(metrics),
    )
    by = {"config_type": "config_type", "atoms": "atom count", "": "group"}.get(grouping, grouping)
    _breakdown(console, f"Errors per structure type ({by})", by, report["by_group"])
    _breakdown(
        console,
        "Errors per element (forces: its atoms; E, S: structures with it)",
        "element",
        report["per_element"],
    )
    _breakdown(console, "Errors per input file", "file", report["by_source"])
    _force_bins(console, evaluation.force_bins())
    console.print(UNITS_NOTE)
    if "uncertainty" in report:
        _uncertainty(console, report["uncertainty"], by)
    return {"grouping": grouping, **report}


def _uncertainty_rows(block: dict[str, Any], first: str) -> tuple[str, ...]:
    def fraction(key: str) -> str:
        return f"{block[key]:.2f}" if key in block else "-"

    spearman = block.get("spearman", math.nan)
    return (
        first,
        f"{block['count']:,}",
        "-" if math.isnan(spearman) else f"{spearman:.2f}",
        *(fraction(f"within_{k}_sigma") for k in (1, 2, 3)),
        *(fraction(f"uncalibrated_within_{k}_sigma") for k in (1, 2, 3)),
    )


def _uncertainty(console: Any, report: dict[str, Any], by: str) -> None:
    """The committee's spread against its errors: rank correlation and sigma coverage."""
    columns = ["count", "Spearman", "≤1 sd", "≤2 sd", "≤3 sd", "raw ≤1", "raw ≤2", "raw ≤3"]
    factors = report["calibration_factors"]
    rows = [
        _uncertainty_rows(block, f"{quantity} (x{factors[quantity]:.2f})")
        for quantity, block in report["overall"].items()
    ]
    print_table(console, "Uncertainty (committee spread vs error)", ["quantity", *columns], rows)
    rows = [
        _uncertainty_rows(blocks["forces"], name)
        for name, blocks in report["by_group"].items()
        if "forces" in blocks
    ]
    if len(rows) > 1:
        print_table(
            console, f"Force uncertainty per {by or 'group'}", [by or "group", *columns], rows
        )
    console.print(
        "Spearman: rank correlation of uncertainty and error (forces per atom, energy and "
        "stress per structure); ≤k sd: fraction of errors within k calibrated sigmas (Gaussian: "
        "0.68, 0.95, 1.00); raw: before the calibration factors (x...)"
    )


@main.command(
    "evaluate",
    epilog="""\b
Examples:
  nvalchemi-training evaluate runs/my/checkpoints --dataset data/test.extxyz
  nvalchemi-training evaluate runs/my/checkpoints --dataset test.extxyz --group-by material --json
""",
)
@click.argument("checkpoint_dir", type=click.Path(file_okay=False))
@click.option(
    "--dataset",
    "datasets",
    multiple=True,
    required=True,
    help="Data to evaluate on (extxyz / ASE db / zarr; repeatable).",
)
@click.option(
    "--checkpoint-index", default="latest", show_default=True, help="An index, 'latest' or 'best'."
)
@click.option(
    "--ema/--no-ema",
    default=True,
    show_default=True,
    help="Use the EMA weights when the checkpoint has them.",
)
@click.option(
    "--group-by",
    metavar="KEY",
    help="extxyz/db info key that groups structures (default: config_type when "
    "present, else atom-count ranges).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--max-structures",
    type=click.IntRange(min=1),
    help="Evaluate only the first N structures of each file.",
)
@click.option(
    "--out-dir",
    type=click.Path(file_okay=False),
    help="Where parity PNGs go (default: <checkpoint_dir>/../evaluation).",
)
@click.option("--plots/--no-plots", default=True, show_default=True)
@click.option("--head", help="Readout head of a multi-head model (default: its default head).")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the report as JSON on stdout (eV units)."
)
@click.option("--trust", is_flag=True, help="Allow specs outside the import allow-list.")
@click.option(
    "--allow-import",
    "allow_imports",
    multiple=True,
    metavar="PKG",
    help="Let the checkpoint name classes of this module of yours (repeatable).",
)
@debug_option
def evaluate(
    checkpoint_dir: str,
    datasets: tuple[str, ...],
    checkpoint_index: str,
    ema: bool,
    group_by: str | None,
    batch_size: int,
    device: str,
    max_structures: int | None,
    out_dir: str | None,
    plots: bool,
    head: str | None,
    as_json: bool,
    trust: bool,
    allow_imports: tuple[str, ...],
) -> None:
    """Evaluate a checkpoint: energy, force and stress errors overall, per structure type,
    element, file and force magnitude, with parity plots."""
    from nvalchemi._errors import FieldError
    from nvalchemi.app.evaluation import evaluate_readers
    from nvalchemi.app.jobs.resolve import allow_user_code
    from nvalchemi.data.sources import open_reader
    from nvalchemi.hooks.reporting.presets import PLOTS_HINT, plots_available
    from nvalchemi.training.checkpoint import load_model_from_checkpoint

    allow_user_code(list(allow_imports), ".", field="--allow-import")
    root = Path(checkpoint_dir)
    if not (root / "manifest.json").is_file():
        raise FieldError(
            f"{root} is not an nvalchemi checkpoint directory (no manifest.json)",
            field="CHECKPOINT_DIR",
            fix="give the checkpoint root a CheckpointHook wrote, e.g. runs/quickstart/checkpoints",
        )
    model = load_model_from_checkpoint(
        root,
        map_location=device,
        use_ema=ema,
        trust=trust,
        checkpoint_index=parse_checkpoint_index(checkpoint_index),
    )
    names = getattr(model, "head_names", None)
    if head is not None and (names is None or head not in names):
        raise FieldError(
            f"--head {head!r} is not a head of this model (heads: {list(names or [])})",
            field="--head",
            fix="name one of the model's heads, or drop --head",
        )
    readers = [open_reader(p, field="--dataset", max_structures=max_structures) for p in datasets]
    try:
        evaluation, grouping = evaluate_readers(
            model, readers, batch_size=batch_size, device=device, head=head, group_by=group_by
        )
    finally:
        for reader in readers:
            reader.close()
    console = err_console()
    result = print_evaluation(console, evaluation, "Evaluation", grouping)
    if plots and not plots_available():
        console.print(PLOTS_HINT)
    elif plots:
        target = Path(out_dir) if out_dir else root.resolve().parent / "evaluation"
        result["plots"] = [str(p) for p in evaluation.parity_plots(target)]
        if "uncertainty" in result:
            from nvalchemi.app.uncertainty import calibration_plot

            result["plots"].append(str(calibration_plot(evaluation, target)))
        for path in result["plots"]:
            console.print(f"plot: {path}")
    if as_json:
        click.echo(json.dumps(result, indent=2))
