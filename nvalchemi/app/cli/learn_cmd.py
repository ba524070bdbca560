"""``learn``: run (or resume) an active-learning job and print its per-iteration report."""

from __future__ import annotations

import json
from typing import Any

import click

from nvalchemi.app.cli._app import debug_option, main
from nvalchemi.app.cli._console import err_console, print_table
from nvalchemi.app.cli._options import json_option

__all__ = ["learn", "print_learning"]


_COLUMNS = [
    "iteration",
    "labels",
    "frames <lo/between/>hi",
    "added",
    "test F MAE",
    "test E MAE",
    "MD stable",
    "s explore/label/train",
]


def _milli(block: dict[str, Any] | None, key: str) -> str:
    value = (block or {}).get(key)
    return "-" if value is None else f"{1000 * value:.1f}"


def _md_stable(check: dict[str, Any] | None) -> str:
    return "-" if not check else f"{check['stable']}/{check['runs']}"


def print_learning(console: Any, reports: list[dict[str, Any]]) -> None:
    """One row per iteration: labels, frames per deviation band, test errors, the MD
    check's stable runs, time."""
    rows = []
    for r in reports:
        bands, seconds = r["bands"], r["seconds"]
        rows.append(
            (
                str(r["iteration"]),
                f"{r['labels']:,}",
                f"{bands['accurate']}/{bands['candidate']}/{bands['failed']}",
                f"{r['labelled']}" + (f" ({r['failed']} failed)" if r["failed"] else ""),
                _milli(r.get("test"), "forces_mae"),
                _milli(r.get("test"), "energy_per_atom_mae"),
                _md_stable(r.get("md_check")),
                " / ".join(f"{seconds.get(p, 0):.0f}" for p in ("explore", "label", "train")),
            )
        )
    print_table(
        console,
        "Active learning: per iteration",
        _COLUMNS,
        rows,
    )
    console.print(
        "labels: labelled structures in training so far; frames: explored frames below, "
        "between and above the trust levels; F: meV/Å, E: meV/atom; MD stable: runs of "
        "the MD check that stayed physical"
    )


@main.command(
    "learn",
    epilog="""\b
Examples:
  nvalchemi-training learn examples/learn/learn.yaml
  nvalchemi-training learn learn.yaml --iterations 2    # stop after two (resume later)
""",
)
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option(
    "--iterations",
    type=click.IntRange(min=1),
    help="Run up to this many iterations (default: the job's); a later call continues.",
)
@json_option("the reports")
@debug_option
def learn(job_file: str, iterations: int | None, as_json: bool) -> None:
    """Active learning: explore with the committee (MD), select the structures it is unsure
    of, label them with the reference calculator, fine-tune, repeat. Resumes where it
    stopped (also after a kill)."""
    from nvalchemi.app.learn import run_learning

    console = err_console()
    result = run_learning(job_file, iterations=iterations, console=console)
    print_learning(console, result.reports)
    console.print(f"work directory: {result.work_dir}")
    console.print(f"committee:      {result.model}")
    for plot in result.plots:
        console.print(f"plot:           {plot}")
    if as_json:
        click.echo(json.dumps(result.reports, indent=2))
