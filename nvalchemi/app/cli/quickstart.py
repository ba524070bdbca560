"""``quickstart``: the main job, from bundled data to an ASE calculator in a few minutes.

Trains the built-in PaiNN on the bundled EMT data (:mod:`nvalchemi.app.jobs.quickstart`,
settings in :mod:`nvalchemi.app.jobs.recipe`), evaluates the final checkpoint on the
test split, writes plots, prints and runs a snippet using the checkpoint from ASE, and
prints the commands that take it further (the MD check, the export).
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import time
from pathlib import Path
from typing import Any

import click

from nvalchemi.app.cli._app import debug_option, main
from nvalchemi.app.cli._console import err_console
from nvalchemi.app.cli._options import MINUTES, threads_option

__all__ = ["calculator_snippet", "next_steps", "quickstart"]


def calculator_snippet(checkpoint_dir: str | Path, symbol: str) -> str:
    """Python that loads the checkpoint as an ASE calculator and compares it with EMT."""
    return f'''\
from ase.build import bulk
from ase.calculators.emt import EMT
from nvalchemi.models import NvalchemiCalculator

atoms = bulk("{symbol}", "fcc", cubic=True) * (2, 2, 2)
atoms.rattle(stdev=0.05, seed=1)
atoms.calc = NvalchemiCalculator.from_checkpoint({str(checkpoint_dir)!r})
energy, forces = atoms.get_potential_energy(), atoms.get_forces()
atoms.calc = EMT()
reference = atoms.get_potential_energy()
print(f"PaiNN energy {{energy:.4f}} eV, EMT {{reference:.4f}} eV ({{len(atoms)}} atoms)")
print(f"energy error {{1000 * abs(energy - reference) / len(atoms):.2f}} meV/atom")
print(f"max |force error| vs EMT {{abs(forces - atoms.get_forces()).max():.4f}} eV/Å")
'''


def next_steps(checkpoint_dir: str | Path, run_dir: str | Path) -> str:
    """The commands that take a trained checkpoint to an MD engine, checked first."""
    from nvalchemi.data.bundled import bundled_split_path

    checkpoints, potential = shlex.quote(str(checkpoint_dir)), Path(run_dir) / "potential.pt"
    test = shlex.quote(str(bundled_split_path("test")))
    return f"""\
# does it survive MD? Langevin NVT at 300 and 900 K then NVE, per structure type
nvalchemi-training evaluate {checkpoints} --dataset {test} --md
# a file that runs with torch only (ASE, torch-sim, LAMMPS); checked against the model
nvalchemi-training export {checkpoints} {shlex.quote(str(potential))}
# then: NvalchemiCalculator.from_export(...) in ASE, TorchSimModel.from_export(...) for
# batched MD, nvalchemi.models.lammps.run_lammps(...) in LAMMPS: see docs/deploy.md"""


def _demo_symbol(model: Any) -> str:
    from ase.data import chemical_symbols

    elements = list(getattr(model, "elements", None) or [29])
    return "Cu" if 29 in elements else chemical_symbols[int(elements[0])]


def _run_snippet(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<quickstart calculator snippet>", "exec"), {"__name__": "__snippet__"})
    return out.getvalue()


@main.command(
    "quickstart",
    epilog="""\b
Examples:
  nvalchemi-training quickstart                      # about 5 minutes on 2 CPU cores
  nvalchemi-training quickstart --minutes 15 --run-dir runs/qs15
""",
)
@click.option(
    "--run-dir",
    default="runs/quickstart",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where checkpoints, metrics and plots go.",
)
@click.option(
    "--minutes",
    type=MINUTES,
    help="Training time budget (default 5 min). Without --epochs the run's length and "
    "learning-rate schedule are fitted to it after timing the first steps; with --epochs "
    "it is a cap. Training stops cleanly when it runs out.",
)
@click.option("--epochs", type=click.IntRange(min=1), help="Train exactly this many epochs.")
@click.option(
    "--resume", is_flag=True, help="Continue the run in --run-dir from its latest checkpoint."
)
@click.option("--overwrite", is_flag=True, help="Replace an earlier run in --run-dir.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--quick", is_flag=True, help="A tiny run (seconds), e.g. to check an install.")
@click.option(
    "--logger",
    "loggers",
    multiple=True,
    type=click.Choice(["tensorboard", "wandb", "mlflow"]),
    help="Log to this experiment tracker (repeatable; default: TensorBoard when installed).",
)
@threads_option("This small model gains little from more.")
@debug_option
def quickstart(threads: int, **options: Any) -> None:
    """Train PaiNN on the bundled EMT data set, evaluate it, and use it from ASE."""
    import torch

    from nvalchemi.app.jobs import quickstart as qs
    from nvalchemi.app.jobs.trackers import open_trackers

    started = time.perf_counter()
    console = err_console()
    plan = qs.prepare_run(**options)  # the other options are prepare_run's parameters
    torch.set_num_threads(threads)
    console.rule("nvalchemi quickstart: PaiNN on the bundled EMT data set")
    splits = qs.load_splits(plan.recipe)
    sizes = splits.sizes
    console.print(
        f"data: {sizes['train']:,} train / {sizes['val']:,} validation / {sizes['test']:,} test "
        f"structures, neighbour lists within {plan.recipe.cutoff} Å ({splits.seconds:.1f} s)"
    )
    train, val, test = qs.loaders(splits, plan.recipe)
    if plan.resume:
        strategy = qs.resume_strategy(plan, val)
        target = (
            f"{plan.recipe.epochs} epochs"
            if plan.recipe.epochs
            else f"the run fitted to {plan.recipe.minutes:g} min"
        )
        console.print(
            f"resuming from step {strategy.step_count:,} (epoch {strategy.epoch_count}) of {target}"
        )
    else:
        model = qs.build_model(splits, plan.recipe, plan.device)
        qs.save_plan(plan)
        params = sum(p.numel() for p in model.parameters())
        length = (
            f"{plan.recipe.epochs} epochs x {len(train)} steps"
            if not plan.fitted
            else f"as many {len(train)}-step epochs as fit in {plan.budget_s / 60:.3g} min "
            "(length and schedule fitted after timing the first steps)"
        )
        console.print(
            f"model: PaiNN (built-in), {params:,} parameters, cutoff {plan.recipe.cutoff} Å; "
            f"{length} on {plan.device}"
        )
        strategy = qs.build_strategy(plan, model, train, val)
    with open_trackers(plan.trackers):  # one tracked run for training and the test split
        strategy.run(train)
        reason = strategy.stop_reason or ""
        if reason and not reason.startswith("end of the run fitted"):
            console.print(f"stopped early: {reason} (continue with --resume)")
        elif reason:
            console.print(f"{reason}: {strategy.step_count:,} steps, {strategy.epoch_count} epochs")
        _finish(console, plan, test, started)


def _finish(console: Any, plan: Any, test: Any, started: float) -> None:
    from nvalchemi.app.cli.evaluate_cmd import print_evaluation
    from nvalchemi.app.evaluation import predict, structure_groups
    from nvalchemi.app.jobs import quickstart as qs
    from nvalchemi.app.jobs.trackers import log_evaluation
    from nvalchemi.data.bundled import bundled_split_path
    from nvalchemi.data.sources import open_reader
    from nvalchemi.hooks.reporting.presets import PLOTS_HINT, learning_curves, plots_available
    from nvalchemi.training.checkpoint import load_model_from_checkpoint

    path, index, step = qs.final_checkpoint(plan)
    model = load_model_from_checkpoint(plan.checkpoint_dir, map_location=plan.device)
    evaluation = predict(model, test, device=plan.device)
    reader = open_reader(bundled_split_path("test"), max_structures=plan.recipe.max_test)
    try:
        evaluation.groups, grouping = structure_groups([reader])
    finally:
        reader.close()
    console.rule("Test split (EMA weights of the final checkpoint)")
    result = print_evaluation(console, evaluation, "Test metrics", grouping)
    (plan.run_dir / "test_metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    plots = []
    if plots_available():
        plots = [learning_curves(plan.run_dir), *evaluation.parity_plots(plan.run_dir)]
        plots = [plot for plot in plots if plot is not None]
        for plot in plots:
            console.print(f"plot:             {plot}")
    else:
        console.print(PLOTS_HINT)
    log_evaluation(plan.trackers, evaluation, prefix="test", plots=plots)
    for tracker in plan.trackers:
        console.print(f"{tracker.tracker + ' run:':<18}{tracker.run_id}")
    console.print(f"metrics:          {plan.run_dir / 'metrics.jsonl'}")
    console.print(
        f"checkpoint root:  {plan.checkpoint_dir} (manifest.json; load it with 'latest' or 'best')"
    )
    console.print(f"final checkpoint: index {index} (step {step}), files in {path}")
    console.rule("Use the checkpoint as an ASE calculator")
    snippet = calculator_snippet(plan.checkpoint_dir, _demo_symbol(model))
    console.print(snippet, markup=False, highlight=False, soft_wrap=True)
    console.print("output:", style="bold")
    console.print(_run_snippet(snippet).rstrip(), markup=False)
    console.rule("Next: take the potential to molecular dynamics")
    console.print(
        next_steps(plan.checkpoint_dir, plan.run_dir), markup=False, highlight=False, soft_wrap=True
    )
    seconds = time.perf_counter() - started
    took = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
    console.print(f"done in {took}")
