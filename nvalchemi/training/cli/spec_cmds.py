"""``spec report``, ``spec run`` and ``spec resume``."""

from __future__ import annotations

import functools
from typing import Any

import click

from nvalchemi.training.cli._app import debug_option, main, parse_checkpoint_index
from nvalchemi.training.cli._console import err_console, print_table

__all__ = ["spec"]

_TRUST_HELP = (
    "Trust the job file: resolve dotted paths outside the import allow-list and load "
    "pickled model files. Only for files you wrote or trust."
)
_ALLOW_HELP = (
    "Let the job and its checkpoints name classes and functions of this module of yours "
    "(repeatable; also `imports:` in the job file), e.g. --allow-import common."
)
allow_import_option = click.option("--allow-import", "allow_imports", multiple=True, metavar="PKG",
                                   help=_ALLOW_HELP)  # fmt: skip


@main.group()
def spec() -> None:
    """Explain, run and resume job specs."""


def _run_options(fn: Any) -> Any:
    options = [
        click.option("--batch-size", type=click.IntRange(min=1),
                     help="Override dataset.batch_size."),
        click.option("--shuffle/--no-shuffle", default=None,
                     help="Override dataset.shuffle."),
        click.option("--drop-last", is_flag=True, help="Drop the last incomplete batch."),
        click.option("--num-workers", type=click.IntRange(min=0),
                     help="Loader worker processes (override dataset.num_workers)."),
        click.option("--map-location", help="Device to load and train on, e.g. cpu or cuda:0."),
        click.option("--distributed/--no-distributed", default=None,
                     help="DDP training. Default: on when the launcher started several "
                     "ranks (torchrun: WORLD_SIZE > 1; Slurm srun: SLURM_NTASKS > 1)."),
        click.option("--ddp-backend", type=click.Choice(["nccl", "gloo"])),
        click.option("--dist-timeout", type=click.FloatRange(min=0, min_open=True),
                     metavar="SECONDS",
                     help="How long a collective waits for the other ranks before the run "
                     "fails naming the silent rank (default: the job's distributed.timeout_s, "
                     "else NVALCHEMI_DIST_TIMEOUT_S, else 600)."),
        click.option("--validation-dataset", "validation_paths", multiple=True,
                     help="Validation data file(s) (override the job's)."),
        click.option("--validation-every-epochs", type=click.IntRange(min=1)),
        click.option("--validation-every-steps", type=click.IntRange(min=1)),
        click.option("--minutes", type=click.FloatRange(min=0, min_open=True),
                     help="Stop cleanly (checkpoint, validation) after this much training."),
        click.option("--threads", type=click.IntRange(min=1),
                     help="torch CPU threads (default: torch's choice)."),
        click.option("--trust", is_flag=True, help=_TRUST_HELP),
        allow_import_option,
        debug_option,
    ]  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return functools.wraps(fn)(fn)


def _options(kwargs: dict[str, Any]) -> Any:
    from nvalchemi.training.cli.runner import RunOptions

    if kwargs.get("threads"):
        import torch

        torch.set_num_threads(kwargs["threads"])
    return RunOptions(
        batch_size=kwargs["batch_size"],
        shuffle=kwargs["shuffle"],
        drop_last=kwargs["drop_last"],
        num_workers=kwargs["num_workers"],
        map_location=kwargs["map_location"],
        distributed=kwargs["distributed"],
        ddp_backend=kwargs["ddp_backend"],
        dist_timeout_s=kwargs["dist_timeout"],
        validation_paths=tuple(kwargs["validation_paths"]),
        validation_every_epochs=kwargs["validation_every_epochs"],
        validation_every_steps=kwargs["validation_every_steps"],
        minutes=kwargs["minutes"],
        trust=kwargs["trust"],
        allow_imports=tuple(kwargs["allow_imports"]),
    )


def _last_validation(run_dir: Any) -> dict[str, Any]:
    """The last validation row of ``metrics.jsonl`` (``{}`` when there is none)."""
    from nvalchemi.hooks.reporting import read_metrics

    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    validation = [r for r in rows if r.get("kind") == "validation"]
    return validation[-1] if validation else {}


def _forgetting_rows(forgetting: Any) -> list[tuple[str, Any]]:
    """Held-out replay errors before -> after a fine-tune (meV), when the job had replay."""
    if not forgetting:
        return []
    rows = []
    for key, label in (
        ("energy_per_atom_mae", "forgetting: held-out replay energy MAE (meV/atom)"),
        ("forces_mae", "forgetting: held-out replay force MAE (meV/Å)"),
    ):
        before, after = forgetting["before"].get(key), forgetting["after"].get(key)
        if before is not None and after is not None:
            rows.append((label, f"{1000 * before:.2f} -> {1000 * after:.2f}"))
    return rows


def _summary(result: Any, console: Any) -> None:
    if not result.is_main:
        return
    strategy = result.strategy
    last = _last_validation(result.run_dir)
    rows: list[tuple[str, Any]] = [
        ("optimizer steps", strategy.step_count),
        ("epochs", strategy.epoch_count),
    ]
    if strategy.stop_reason:
        rows.append(("stopped", strategy.stop_reason))
    for key, label, scale in (
        ("energy_per_atom_mae", "validation energy MAE (meV/atom)", 1000),
        ("energy_per_atom_rmse", "validation energy RMSE (meV/atom)", 1000),
        ("forces_mae", "validation force MAE (meV/Å)", 1000),
        ("forces_rmse", "validation force RMSE (meV/Å)", 1000),
        ("loss/total", "validation loss", 1),
    ):
        value = last.get(f"validation/{key}")
        if isinstance(value, (int, float)):
            rows.append((label, float(value) * scale))
    rows += _forgetting_rows(result.forgetting)
    print_table(console, "Run summary", ["", "value"], rows)
    console.print(f"run directory: {result.run_dir}")
    if result.checkpoint_dir is not None:
        console.print(f"checkpoints:   {result.checkpoint_dir}")
    if result.final_weights is not None and result.final_metrics:
        weights = "EMA" if result.final_weights == "ema" else "final"
        console.print(
            f"parity plots:  {weights} weights on the {result.num_validation:,} validation "
            "structures (MAE/RMSE in the legends)"
        )
    for plot in result.plots:
        console.print(f"plot:          {plot}")


@spec.command("report")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True,
              help="Also print the normalized job as JSON on stdout.")  # fmt: skip
@click.option("--trust", is_flag=True, help=_TRUST_HELP)
@allow_import_option
@debug_option
def spec_report(path: str, as_json: bool, trust: bool, allow_imports: tuple[str, ...]) -> None:
    """Render a job as tables and warnings (loads no model weights and no data)."""
    from nvalchemi.training.cli._load import load_job
    from nvalchemi.training.cli.job_spec import dump_job
    from nvalchemi.training.cli.report import render_report

    job, resolved = load_job(path, trust=trust, allow_imports=allow_imports)
    render_report(job, resolved, err_console())
    if as_json:
        click.echo(dump_job(job), nl=False)


@spec.command("run")
@click.argument("path", type=click.Path(dir_okay=False))
@_run_options
@click.option(
    "--num-steps",
    type=click.IntRange(min=1),
    help="Train this many steps instead of the job's duration (e.g. a smoke test).",
)
@click.option(
    "--max-structures",
    type=click.IntRange(min=1),
    help="Use only the first N structures of each data file.",
)
@click.option("--report/--no-report", default=True, show_default=True,
              help="Render the spec report before training.")  # fmt: skip
def spec_run(
    path: str, num_steps: int | None, max_structures: int | None, report: bool, **kwargs: Any
) -> None:
    """Train a job spec."""
    from nvalchemi.training.cli._load import load_job
    from nvalchemi.training.cli.report import render_report
    from nvalchemi.training.cli.runner import launch_env, run_job
    from nvalchemi.training.cli.schedule_checks import check_horizons

    options = _options(kwargs)
    job, resolved = load_job(path, trust=options.trust, allow_imports=options.allow_imports)
    is_main = launch_env().rank == 0
    if num_steps is not None:
        configs = job.strategy.get("optimizer_configs") or {}
        job.strategy = {**job.strategy, "num_steps": num_steps, "num_epochs": None}
    if max_structures is not None:
        job.dataset.max_structures = max_structures
    console = err_console()
    if report and is_main:
        render_report(job, resolved, console)
    if num_steps is not None:
        check_horizons(configs, num_steps, warn=is_main)
    result = run_job(job, resolved, options, console=console)
    _summary(result, console)


@spec.command("resume")
@click.argument("checkpoint_dir", type=click.Path(file_okay=False))
@click.option("--spec", "spec_path", required=True, type=click.Path(dir_okay=False),
              help="The job spec the run was started with.")  # fmt: skip
@click.option("--checkpoint-index", default="latest", show_default=True,
              help="An index, 'latest' or 'best'.")  # fmt: skip
@_run_options
@click.option(
    "--num-steps",
    type=click.IntRange(min=1),
    help="Train until this total step count instead of the saved run's duration (e.g. to "
    "extend a finished run).",
)
@click.option(
    "--lr",
    type=click.FloatRange(min=0.0, min_open=True),
    help="Continue with this learning rate for every optimizer (recorded in the checkpoint "
    "history; the resume is then no longer exact).",
)
def spec_resume(
    checkpoint_dir: str,
    spec_path: str,
    checkpoint_index: str,
    num_steps: int | None,
    lr: float | None,
    **kwargs: Any,
) -> None:
    """Continue a run exactly from one of its checkpoints (extend it with --num-steps,
    change the learning rate with --lr)."""
    from nvalchemi.training.cli._errors import CLIError
    from nvalchemi.training.cli._load import load_job
    from nvalchemi.training.cli.runner import (
        distributed_enabled,
        launch_env,
        run_job,
        saved_progress,
    )
    from nvalchemi.training.cli.schedule_checks import check_horizons

    index = parse_checkpoint_index(checkpoint_index)
    options = _options(kwargs)
    options.num_steps = num_steps
    options.lr = lr
    job, resolved = load_job(spec_path, trust=options.trust, allow_imports=options.allow_imports)
    console = err_console()
    is_main = launch_env().rank == 0
    progress = saved_progress(checkpoint_dir, index)
    extend = (
        f"`nvalchemi-training spec resume {checkpoint_dir} --spec {spec_path} --num-steps N` "
        f"with N > {progress.step_count:,}"
    )
    if num_steps is not None and num_steps <= progress.step_count:
        raise CLIError(
            f"{num_steps:,} steps are not beyond the {progress.step_count:,} the checkpoint "
            "already trained (--num-steps is the total, not the number of extra steps)",
            field="--num-steps",
            fix=f"give more than {progress.step_count:,}",
        )
    if num_steps is None and progress.complete:
        if is_main:
            console.print(
                f"The run in {checkpoint_dir} is already complete ({progress.describe()}); "
                f"nothing to train. To train longer: {extend}.",
                markup=False,
                soft_wrap=True,
            )
        return
    ranks = launch_env().world_size if distributed_enabled(options.distributed) else 1
    if ranks != progress.world_size:
        launcher = f"torchrun --nproc_per_node={progress.world_size} -m nvalchemi.training.cli"
        raise CLIError(
            f"the checkpoint was trained on {progress.world_size} rank(s) and this resume "
            f"runs on {ranks}; an exact resume needs the same number (the data order and "
            "loader position are per rank)",
            field="launch (world size)",
            fix=f"resume with {progress.world_size} rank(s), e.g. `{launcher} spec resume ...` "
            "(or srun with as many tasks); to continue on another number of ranks, fine-tune "
            "from the checkpoint (`finetune init checkpoint`)"
            if progress.world_size > 1
            else "resume in one process (--no-distributed), or fine-tune from the checkpoint "
            "(`finetune init checkpoint`) to train on more ranks",
        )
    if num_steps is not None:
        check_horizons(progress.optimizer_configs, num_steps, warn=is_main, resume=True)
    result = run_job(
        job, resolved, options, resume_from=checkpoint_dir, checkpoint_index=index, console=console
    )
    if result.strategy.step_count == progress.step_count and num_steps is None:
        if is_main:
            console.print(
                f"The run in {checkpoint_dir} was already complete ({progress.describe()}); "
                f"nothing was trained. To train longer: {extend}.",
                markup=False,
                soft_wrap=True,
            )
        return
    _summary(result, console)
