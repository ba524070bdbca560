"""``spec report``, ``spec run`` and ``spec resume``."""

from __future__ import annotations

from typing import Any

import click

from nvalchemi.app.cli._app import debug_option, main
from nvalchemi.app.cli._console import err_console, print_table
from nvalchemi.app.cli._options import (
    MINUTES,
    batch_size_value,
    checkpoint_index_option,
    json_option,
    max_structures_option,
    option_group,
    threads_option,
    trust_options,
)

__all__ = ["spec"]


@main.group()
def spec() -> None:
    """Explain, run and resume job specs."""


_run_options = option_group(
    click.option(
        "--batch-size",
        callback=batch_size_value,
        help="Override dataset.batch_size (an int, or auto: an atom budget found "
        "by probing the model's memory).",
    ),
    click.option(
        "--max-atoms",
        type=click.IntRange(min=1),
        help="Batches of at most this many atoms (override dataset.max_atoms).",
    ),
    click.option(
        "--max-edges",
        type=click.IntRange(min=1),
        help="Batches of at most this many neighbour pairs.",
    ),
    click.option("--shuffle/--no-shuffle", default=None, help="Override dataset.shuffle."),
    click.option("--drop-last", is_flag=True, help="Drop the last incomplete batch."),
    click.option(
        "--num-workers",
        type=click.IntRange(min=0),
        help="Loader worker processes (override dataset.num_workers).",
    ),
    click.option("--map-location", help="Device to load and train on, e.g. cpu or cuda:0."),
    click.option(
        "--distributed/--no-distributed",
        default=None,
        help="DDP training. Default: on when the launcher started several "
        "ranks (torchrun: WORLD_SIZE > 1; Slurm srun: SLURM_NTASKS > 1).",
    ),
    click.option("--ddp-backend", type=click.Choice(["nccl", "gloo"])),
    click.option(
        "--dist-timeout",
        "dist_timeout_s",
        type=click.FloatRange(min=0, min_open=True),
        metavar="SECONDS",
        help="How long a collective waits for the other ranks before the run "
        "fails naming the silent rank (default: the job's distributed.timeout_s, "
        "else NVALCHEMI_DIST_TIMEOUT_S, else 600).",
    ),
    click.option(
        "--validation-dataset",
        "validation_paths",
        multiple=True,
        help="Validation data file(s) (override the job's).",
    ),
    click.option("--validation-every-epochs", type=click.IntRange(min=1)),
    click.option("--validation-every-steps", type=click.IntRange(min=1)),
    click.option(
        "--minutes",
        type=MINUTES,
        help="Time budget (override the job's minutes): the run's length and "
        "schedule are fitted to it; with a fixed num_steps/num_epochs it caps.",
    ),
    threads_option("Also the neighbour lists' threads."),
    click.option(
        "--group-by",
        metavar="KEY",
        help="info key the final evaluation groups structures by (default: "
        "output.group_by, else config_type, else atom count).",
    ),
    click.option(
        "--logger",
        "loggers",
        multiple=True,
        type=click.Choice(["tensorboard", "wandb", "mlflow"]),
        help="Log to this experiment tracker (repeatable; replaces the job's output.loggers). "
        "wandb and mlflow need the trackers extra and read their usual environment "
        "(WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, ...).",
    ),
    trust_options,
    debug_option,
)


def _options(kwargs: dict[str, Any]) -> Any:
    """The :class:`RunOptions` of the command line (the click names are its fields)."""
    import torch

    from nvalchemi.app.jobs.run import RunOptions

    torch.set_num_threads(kwargs["threads"])
    return RunOptions(**kwargs)


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
    from nvalchemi.app.cli.evaluate_cmd import print_evaluation, print_md_check

    if not result.is_main:
        return
    strategy = result.strategy
    rows: list[tuple[str, Any]] = [
        ("optimizer steps", strategy.step_count),
        ("epochs", strategy.epoch_count),
    ]
    if result.budget is not None:
        plan = result.budget
        rows.append(
            ("time budget (min)", f"{plan.seconds / 60:.3g} ({plan.spent_s / 60:.3g} used)")
        )
        if plan.step_s is not None:
            rows.append(("measured step time (ms)", f"{1000 * plan.step_s:.0f}"))
    if strategy.stop_reason:
        rows.append(("stopped", strategy.stop_reason))
    rows += _forgetting_rows(result.forgetting)
    print_table(console, "Run summary", ["", "value"], rows)
    if result.evaluation is not None:
        weights = "EMA" if result.final_weights == "ema" else "final"
        print_evaluation(
            console,
            result.evaluation,
            f"Final model ({weights} weights) on the validation data",
            result.grouping,
        )
    if result.md_check is not None:
        print_md_check(console, result.md_check.report())
    console.print(f"run directory: {result.run_dir}")
    if result.checkpoint_dir is not None:
        console.print(
            f"checkpoints:   {result.checkpoint_dir} (manifest.json + checkpoints/<index>/;"
            " load it with evaluate or NvalchemiCalculator.from_checkpoint)"
        )
    for plot in result.plots:
        console.print(f"plot:          {plot}")
    for tracker in result.trackers:
        console.print(f"{tracker.tracker + ' run:':<15}{tracker.run_id}")


@spec.command(
    "report",
    epilog="""\b
Examples:
  nvalchemi-training spec report job.yaml
  nvalchemi-training spec report job.yaml --json > normalized.json
""",
)
@click.argument("path", type=click.Path(dir_okay=False))
@json_option("the normalized job too")
@trust_options
@debug_option
def spec_report(path: str, as_json: bool, trust: bool, allow_imports: tuple[str, ...]) -> None:
    """Render a job as tables and warnings (loads no model weights; reads atom counts only
    for an atom budget)."""
    from nvalchemi.app.cli.report import render_report
    from nvalchemi.app.jobs.resolve import load_job
    from nvalchemi.app.jobs.spec import dump_job

    job, resolved = load_job(path, trust=trust, allow_imports=allow_imports)
    render_report(job, resolved, err_console())
    if as_json:
        click.echo(dump_job(job), nl=False)


@spec.command(
    "run",
    epilog="""\b
Examples:
  nvalchemi-training spec run job.yaml --minutes 10
  nvalchemi-training spec run job.yaml --num-steps 30 --max-structures 64 --no-report
""",
)
@click.argument("path", type=click.Path(dir_okay=False))
@_run_options
@click.option(
    "--num-steps",
    type=click.IntRange(min=1),
    help="Train this many steps instead of the job's duration (e.g. a smoke test).",
)
@max_structures_option("Use only the first N structures of each data file.")
@click.option(
    "--report/--no-report",
    default=True,
    show_default=True,
    help="Render the spec report before training.",
)
def spec_run(path: str, max_structures: int | None, report: bool, **kwargs: Any) -> None:
    """Train a job spec."""
    from nvalchemi.app.jobs.signals import SetupSignals

    # first: a stop signal while the job is read and checked gets its message and 75 too
    with SetupSignals.on_main_rank(err_console()) as signals:
        _spec_run(path, max_structures, report, signals, **kwargs)


def _spec_run(
    path: str, max_structures: int | None, report: bool, signals: Any, **kwargs: Any
) -> None:
    from nvalchemi.app.cli.report import render_report
    from nvalchemi.app.jobs.checks import check_horizons
    from nvalchemi.app.jobs.resolve import load_job
    from nvalchemi.app.jobs.run import launch_env, run_job

    options = _options(kwargs)
    job, resolved = load_job(
        path, trust=options.trust, allow_imports=options.allow_imports, minutes=options.minutes
    )
    is_main = launch_env().rank == 0
    if max_structures is not None:
        job.dataset.max_structures = max_structures
    console = err_console()
    if report and is_main:
        render_report(job, resolved, console)
    if options.num_steps is not None:
        check_horizons(
            job.strategy.model_dump()["optimizer_configs"] or {}, options.num_steps, warn=is_main
        )
    result = run_job(job, resolved, options, console=console, signals=signals)
    _summary(result, console)


@spec.command(
    "resume",
    epilog="""\b
Examples:
  nvalchemi-training spec resume runs/my/checkpoints --spec job.yaml
  nvalchemi-training spec resume runs/my/checkpoints --spec job.yaml --num-steps 20000
""",
)
@click.argument("checkpoint_dir", type=click.Path(file_okay=False))
@click.option(
    "--spec",
    "spec_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="The job spec the run was started with.",
)
@checkpoint_index_option
@_run_options
@click.option(
    "--num-steps",
    type=click.IntRange(min=1),
    help="Train until this total step count instead of the saved run's duration "
    "(e.g. to extend a finished run).",
)
@click.option(
    "--lr",
    type=click.FloatRange(min=0.0, min_open=True),
    help="Continue with this learning rate for every optimizer (recorded in the "
    "checkpoint history; the resume is then no longer exact).",
)
def spec_resume(
    checkpoint_dir: str,
    spec_path: str,
    checkpoint_index: int | str,
    **kwargs: Any,
) -> None:
    """Continue a run exactly from one of its checkpoints (extend it with --num-steps,
    change the learning rate with --lr)."""
    from nvalchemi.app.jobs.signals import SetupSignals

    # first: a stop signal while the job is read and checked gets its message and 75 too
    with SetupSignals.on_main_rank(err_console()) as signals:
        _spec_resume(checkpoint_dir, spec_path, checkpoint_index, signals, **kwargs)


def _spec_resume(
    checkpoint_dir: str, spec_path: str, index: int | str, signals: Any, **kwargs: Any
) -> None:
    from nvalchemi.app.cli._errors import CLIError
    from nvalchemi.app.jobs.checks import check_horizons
    from nvalchemi.app.jobs.resolve import load_job
    from nvalchemi.app.jobs.run import distributed_enabled, launch_env, run_job, saved_progress

    options = _options(kwargs)
    num_steps = options.num_steps
    job, resolved = load_job(
        spec_path,
        trust=options.trust,
        allow_imports=options.allow_imports,
        minutes=options.minutes,
    )
    console = err_console()
    is_main = launch_env().rank == 0
    progress = saved_progress(checkpoint_dir, index)
    extend = (
        f"`nvalchemi-training spec resume {checkpoint_dir} --spec {spec_path} --num-steps N` "
        f"with N > {progress.step_count:,}"
    )

    def complete(what: str) -> None:
        if is_main:
            console.print(
                f"The run in {checkpoint_dir} {what}. To train longer: {extend}.",
                markup=False,
                soft_wrap=True,
            )

    if num_steps is not None and num_steps <= progress.step_count:
        raise CLIError(
            f"{num_steps:,} steps are not beyond the {progress.step_count:,} the checkpoint "
            "already trained (--num-steps is the total, not the number of extra steps)",
            field="--num-steps",
            fix=f"give more than {progress.step_count:,}",
        )
    if num_steps is None and progress.complete:
        return complete(f"is already complete ({progress.describe()}); nothing to train")
    ranks = launch_env().world_size if distributed_enabled(options.distributed) else 1
    if ranks != progress.world_size:
        launcher = f"torchrun --nproc_per_node={progress.world_size} -m nvalchemi.app.cli"
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
        job,
        resolved,
        options,
        resume_from=checkpoint_dir,
        checkpoint_index=index,
        console=console,
        signals=signals,
    )
    if result.strategy.step_count == progress.step_count and num_steps is None:
        return complete(f"was already complete ({progress.describe()}); nothing was trained")
    _summary(result, console)
