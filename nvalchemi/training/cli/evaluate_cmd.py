"""``evaluate``: a checkpoint on a data set -> metrics table, parity plots, per-element errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from nvalchemi.training.cli._app import debug_option, main, parse_checkpoint_index
from nvalchemi.training.cli._console import err_console, print_table
from nvalchemi.training.cli._errors import CLIError

__all__ = ["evaluate", "evaluate_checkpoint", "print_evaluation"]


def load_checkpoint_model(
    checkpoint_dir: str | Path, *, index: Any, device: str, use_ema: bool, trust: bool
) -> Any:
    """The model of a checkpoint root (EMA weights when saved and ``use_ema``)."""
    from nvalchemi.training.checkpoint import load_model_from_checkpoint

    root = Path(checkpoint_dir)
    if not (root / "manifest.json").is_file():
        raise CLIError(
            f"{root} is not an nvalchemi checkpoint directory (no manifest.json)",
            field="CHECKPOINT_DIR",
            fix="give the checkpoint root a CheckpointHook wrote, e.g. runs/quickstart/checkpoints",
        )
    return load_model_from_checkpoint(
        root, map_location=device, use_ema=use_ema, checkpoint_index=index, trust=trust
    )


def evaluate_checkpoint(
    model: Any,
    paths: list[str],
    *,
    batch_size: int = 16,
    device: str = "cpu",
    max_structures: int | None = None,
    head: str | None = None,
) -> Any:
    """:class:`~nvalchemi.training.cli.evaluation.Evaluation` of ``model`` on ``paths``."""
    from nvalchemi.training.cli.data_sources import (
        make_dataset,
        make_loader,
        neighbor_config_of,
        open_reader,
    )
    from nvalchemi.training.cli.evaluation import predict

    readers = [open_reader(p, field="--dataset", max_structures=max_structures) for p in paths]
    try:
        dataset = make_dataset(readers, neighbor_config=neighbor_config_of(model))
        loader = make_loader(dataset, batch_size=batch_size)
        return predict(model, loader, device=device, head=head)
    finally:
        for reader in readers:
            reader.close()


def print_evaluation(console: Any, evaluation: Any, title: str) -> dict[str, Any]:
    """Print the metrics and per-element tables; return ``{"metrics", "per_element"}``."""
    from nvalchemi.training.cli.evaluation import metrics_rows

    metrics = evaluation.metrics()
    print_table(
        console,
        f"{title}: {metrics['num_structures']:,} structures, {metrics['num_atoms']:,} atoms",
        ["quantity", "MAE", "RMSE", "unit"],
        metrics_rows(metrics),
    )
    per_element = evaluation.per_element()
    if per_element:
        print_table(
            console,
            "Force errors per element",
            ["element", "atoms", "MAE meV/Å", "RMSE meV/Å"],
            [
                (symbol, f"{v['atoms']:,}", f"{1000 * v['forces_mae']:.2f}",
                 f"{1000 * v['forces_rmse']:.2f}")
                for symbol, v in sorted(per_element.items())
            ],
        )  # fmt: skip
    return {"metrics": metrics, "per_element": per_element}


@main.command("evaluate")
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
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON on stdout.")
@click.option("--trust", is_flag=True, help="Allow specs outside the import allow-list.")
@click.option(
    "--allow-import",
    "allow_imports",
    multiple=True,
    metavar="PKG",
    help="Let the checkpoint name classes of this module of yours (repeatable).",
)
@debug_option  # fmt: skip
def evaluate(
    checkpoint_dir: str,
    datasets: tuple[str, ...],
    checkpoint_index: str,
    ema: bool,
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
    """Evaluate a checkpoint: energy/force/stress errors, per-element forces, parity plots."""
    from nvalchemi.training.cli._load import allow_user_code

    allow_user_code(list(allow_imports), ".", field="--allow-import")
    index = parse_checkpoint_index(checkpoint_index)
    model = load_checkpoint_model(checkpoint_dir, index=index, device=device, use_ema=ema,
                                  trust=trust)  # fmt: skip
    names = getattr(model, "head_names", None)
    if head is not None and (names is None or head not in names):
        raise CLIError(
            f"--head {head!r} is not a head of this model (heads: {list(names or [])})",
            field="--head",
            fix="name one of the model's heads, or drop --head",
        )
    evaluation = evaluate_checkpoint(
        model, list(datasets), batch_size=batch_size, device=device,
        max_structures=max_structures, head=head,
    )  # fmt: skip
    console = err_console()
    result = print_evaluation(console, evaluation, "Evaluation")
    from nvalchemi.training.cli.run_reporting import PLOTS_HINT, plots_available

    if plots and not plots_available():
        console.print(PLOTS_HINT)
    elif plots:
        target = Path(out_dir) if out_dir else Path(checkpoint_dir).resolve().parent / "evaluation"
        result["plots"] = [str(p) for p in evaluation.parity_plots(target)]
        for path in result["plots"]:
            console.print(f"plot: {path}")
    if as_json:
        click.echo(json.dumps(result, indent=2))
