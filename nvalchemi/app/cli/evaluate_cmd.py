"""``evaluate``: a checkpoint on data -> error tables (overall, per structure type, element,
file, force magnitude) and parity plots, and with ``--md`` the MD check
(:mod:`nvalchemi.app.md_check`); :func:`print_evaluation` and :func:`print_md_check` print
them (also for ``spec run`` and ``quickstart``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from nvalchemi.app.cli._app import debug_option, main
from nvalchemi.app.cli._console import err_console, print_table
from nvalchemi.app.cli._options import (
    checkpoint_options,
    json_option,
    max_structures_option,
    threads_option,
    trust_options,
)

__all__ = ["evaluate", "md_settings_from_options", "print_evaluation", "print_md_check"]

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


def print_md_check(console: Any, report: dict[str, Any]) -> None:
    """Print an MD check report (:meth:`~nvalchemi.app.md_check.MDCheckResult.report`)."""
    from nvalchemi.app.md_check import iter_table_rows

    settings = report["settings"]
    temperatures = ", ".join(f"{t:g}" for t in settings["temperatures_K"])
    print_table(
        console,
        f"MD check ({report['engine']}; {temperatures} K; {settings['nvt_ps']:g} ps NVT then "
        f"{settings['nve_ps']:g} ps NVE at {settings['timestep_fs']:g} fs; "
        f"{report['seconds']:.0f} s): runs that stayed physical, per structure type",
        [
            "group",
            "runs",
            "stable",
            "first failure ps",
            "NVE drift meV/atom/ps",
            "closest pair Å",
            "failures",
        ],
        iter_table_rows(report),
    )
    if report["data_min_distance_A"] is None:
        close = "(no close-pair bound: the data has no pair within 6 Å)"
    else:
        close = (
            f"on a pair closer than {report['min_distance_bound_A']:.2f} Å "
            f"({settings['min_distance_factor']:g} x the data's smallest distance, "
            f"{report['data_min_distance_A']:.2f} Å)"
        )
    console.print(
        f"A run fails {close}, an energy runaway "
        f"(> {settings['energy_window_eV_per_atom']:g} eV/atom), a lost atom (no neighbour "
        f"within {report['lost_atom_distance_A']:.1f} Å) or a model error. NVE drift: mean "
        "|slope| of the total energy per atom over the stable runs."
    )


def md_settings_from_options(
    base: Any = None, *, group_by: str | None = None, **options: Any
) -> Any:
    """:class:`~nvalchemi.app.md_check.MDCheckSettings` from ``--md-*`` options (``None``:
    keep ``base``'s value); a bad value raises :class:`FieldError` naming the option."""
    from pydantic import ValidationError

    from nvalchemi._errors import FieldError
    from nvalchemi.app.md_check import MDCheckSettings

    values = (base or MDCheckSettings()).model_dump()
    names = {
        "temperatures": "temperatures_K",
        "nvt_ps": "nvt_ps",
        "nve_ps": "nve_ps",
        "structures": "structures_per_group",
        "timestep_fs": "timestep_fs",
        "engine": "engine",
    }
    for option, value in options.items():
        if value is None:
            continue
        if option == "temperatures":
            try:
                value = [float(t) for t in str(value).replace(",", " ").split()]
            except ValueError:
                raise FieldError(
                    f"{value!r} is not a list of temperatures",
                    field="--md-temperatures",
                    fix="give kelvins separated by commas, e.g. --md-temperatures 300,900",
                ) from None
        values[names[option]] = value
    if group_by is not None:
        values["group_by"] = group_by
    try:
        return MDCheckSettings.model_validate(values)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = next((o for o, n in names.items() if n == error["loc"][0]), "md")
        raise FieldError(
            error["msg"], field=f"--md-{field.replace('_', '-')}", fix="see --help"
        ) from None


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
  nvalchemi-training evaluate runs/my/checkpoints --dataset test.extxyz --md --md-temperatures 600
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
@checkpoint_options
@click.option(
    "--group-by",
    metavar="KEY",
    help="extxyz/db info key that groups structures (default: config_type when "
    "present, else atom-count ranges).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@threads_option()
@max_structures_option("Evaluate only the first N structures of each file.")
@click.option(
    "--out-dir",
    type=click.Path(file_okay=False),
    help="Where parity PNGs go (default: <checkpoint_dir>/../evaluation).",
)
@click.option("--plots/--no-plots", default=True, show_default=True)
@json_option("the report (eV units)")
@click.option(
    "--md",
    "run_md",
    is_flag=True,
    help="Also run the MD check: Langevin NVT then NVE on structures drawn per structure "
    "type; reports runs that stayed physical, time to the first failure and NVE drift.",
)
@click.option("--md-temperatures", metavar="K[,K...]", help="NVT temperatures [300,900].")
@click.option("--md-nvt-ps", type=click.FloatRange(min=0), help="NVT time per run [0.4].")
@click.option("--md-nve-ps", type=click.FloatRange(min=0), help="NVE time after NVT [0.2].")
@click.option(
    "--md-structures", type=click.IntRange(min=1), help="Structures per structure type [1]."
)
@click.option(
    "--md-timestep-fs", type=click.FloatRange(min=0, min_open=True), help="Time step [2]."
)
@click.option(
    "--md-engine",
    type=click.Choice(["auto", "torch-sim", "ase"]),
    help="auto: torch-sim (batched) when installed, else ASE [auto].",
)
@trust_options
@debug_option
def evaluate(
    checkpoint_dir: str,
    datasets: tuple[str, ...],
    checkpoint_index: int | str,
    ema: bool,
    head: str | None,
    model_key: str,
    group_by: str | None,
    batch_size: int,
    device: str,
    threads: int,
    max_structures: int | None,
    out_dir: str | None,
    plots: bool,
    as_json: bool,
    run_md: bool,
    md_temperatures: str | None,
    md_nvt_ps: float | None,
    md_nve_ps: float | None,
    md_structures: int | None,
    md_timestep_fs: float | None,
    md_engine: str | None,
    trust: bool,
    allow_imports: tuple[str, ...],
) -> None:
    """Evaluate a checkpoint: energy, force and stress errors overall, per structure type,
    element, file and force magnitude, with parity plots; with --md, the MD check."""
    import torch

    from nvalchemi._errors import FieldError
    from nvalchemi.app.evaluation import evaluate_readers
    from nvalchemi.app.jobs.resolve import allow_user_code
    from nvalchemi.data.sources import open_reader
    from nvalchemi.hooks.reporting.presets import PLOTS_HINT, plots_available
    from nvalchemi.training.checkpoint import load_model_from_checkpoint

    torch.set_num_threads(threads)
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
        model_key=model_key,
        use_ema=ema,
        trust=trust,
        checkpoint_index=checkpoint_index,
    )
    names = getattr(model, "head_names", None)
    if head is not None and (names is None or head not in names):
        raise FieldError(
            f"--head {head!r} is not a head of this model (heads: {list(names or [])})",
            field="--head",
            fix="name one of the model's heads, or drop --head",
        )
    settings = None
    if run_md:
        settings = md_settings_from_options(
            group_by=group_by,
            temperatures=md_temperatures,
            nvt_ps=md_nvt_ps,
            nve_ps=md_nve_ps,
            structures=md_structures,
            timestep_fs=md_timestep_fs,
            engine=md_engine,
        )
    readers = [open_reader(p, field="--dataset", max_structures=max_structures) for p in datasets]
    md_result = None
    try:
        evaluation, grouping = evaluate_readers(
            model, readers, batch_size=batch_size, device=device, head=head, group_by=group_by
        )
        if settings is not None:
            from nvalchemi.app.md_check import md_check

            md_result = md_check(model, readers, settings, device=device, head=head)
    finally:
        for reader in readers:
            reader.close()
    console = err_console()
    result = print_evaluation(console, evaluation, "Evaluation", grouping)
    if md_result is not None:
        result["md"] = md_result.report()
        print_md_check(console, result["md"])
    if plots and not plots_available():
        console.print(PLOTS_HINT)
    elif plots:
        target = Path(out_dir) if out_dir else root.resolve().parent / "evaluation"
        result["plots"] = [str(p) for p in evaluation.parity_plots(target)]
        if md_result is not None:
            result["plots"].append(str(md_result.plot(target / "md_check.png")))
        if "uncertainty" in result:
            from nvalchemi.app.uncertainty import calibration_plot

            result["plots"].append(str(calibration_plot(evaluation, target)))
        for path in result["plots"]:
            console.print(f"plot: {path}")
    if as_json:
        click.echo(json.dumps(result, indent=2))
