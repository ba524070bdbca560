"""The option shapes several commands share: one definition each, so that ``--threads``,
``--trust``, the checkpoint choice and the like read and behave the same everywhere.

A shared option is a decorator (or an :func:`option_group` of several) that a command
stacks like any ``click.option``; its value reaches the command under the same name in
every command.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import click

from nvalchemi.app.cli._errors import CLIError

__all__ = [
    "MINUTES",
    "allow_import_option",
    "batch_size_value",
    "checkpoint_index_option",
    "checkpoint_options",
    "json_option",
    "max_structures_option",
    "option_group",
    "parse_checkpoint_index",
    "threads_option",
    "threads_value",
    "trust_options",
]


def option_group(*options: Any) -> Any:
    """One decorator applying ``options`` in the order they are listed (as in ``--help``)."""

    def decorate(fn: Any) -> Any:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def batch_size_value(ctx: Any, param: Any, value: str | None) -> int | str | None:
    """A ``--batch-size`` value: an int >= 1 or ``"auto"`` (click callback)."""
    if value is None or value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise click.BadParameter(f"{value!r} is neither an int >= 1 nor 'auto'")
    return number


class _Minutes(click.ParamType):
    """A time budget in minutes: a finite number > 0 (``inf`` and ``nan`` are refused)."""

    name = "minutes"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of minutes", param, ctx)
        if not math.isfinite(number) or number <= 0:
            self.fail(f"{value!r} is not a finite number of minutes > 0, e.g. 10", param, ctx)
        return number


MINUTES = _Minutes()
"""The type of every ``--minutes`` option."""


def threads_value(ctx: Any, param: Any, value: int | None) -> int | None:
    """A ``--threads`` value capped at the CPU cores this process may use, with a warning
    (far more threads than cores only slows a run down, and thousands crash OpenMP)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if value is None or cores is None or value <= cores:
        return value
    warnings.warn(
        f"--threads {value} is more than the {cores} CPU core(s) this process may use; "
        f"using {cores}",
        UserWarning,
        stacklevel=2,
    )
    return cores


def parse_checkpoint_index(text: str) -> int | str:
    """A ``--checkpoint-index`` value: ``"latest"``, ``"best"`` or an int."""
    if text in ("latest", "best"):
        return text
    try:
        return int(text)
    except ValueError:
        raise CLIError(
            f"--checkpoint-index must be an int, 'latest' or 'best'; got {text!r}"
        ) from None


def threads_option(help: str = "") -> Any:
    """``--threads`` (default 1, capped at the cores): torch's CPU threads (and the neighbour
    lists'); ``help`` adds what more threads do for this command."""
    return click.option(
        "--threads",
        type=click.IntRange(min=1),
        callback=threads_value,
        default=1,
        show_default=True,
        help=(
            "torch CPU threads. Extra threads slow a run down a lot when other processes "
            "share the CPU; raise it on a dedicated machine. " + help
        ).strip(),
    )


def json_option(what: str = "the result") -> Any:
    """``--json``: print ``what`` as JSON on stdout (the value arrives as ``as_json``)."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as JSON on stdout.")


def max_structures_option(help: str = "Read only the first N structures of each file.") -> Any:
    """``--max-structures N`` (no default: every structure)."""
    return click.option("--max-structures", type=click.IntRange(min=1), help=help)


TRUST_HELP = (
    "Trust the files named here: resolve dotted paths outside the import allow-list and "
    "load pickled model files (a job file's `imports:` may then name any module). Only for "
    "files you wrote or trust."
)
ALLOW_IMPORT_HELP = (
    "Let the files name classes and functions of this module or package (repeatable; any "
    "package, since you name it), e.g. --allow-import common."
)

allow_import_option = click.option(
    "--allow-import", "allow_imports", multiple=True, metavar="PKG", help=ALLOW_IMPORT_HELP
)
"""``--allow-import PKG`` (repeatable): the value arrives as ``allow_imports``."""

trust_options = option_group(
    click.option("--trust", is_flag=True, help=TRUST_HELP), allow_import_option
)
"""``--trust`` and ``--allow-import``: what a file may name (the trust rule, README)."""


def _checkpoint_index(ctx: Any, param: Any, value: str) -> int | str:
    return parse_checkpoint_index(value)


checkpoint_index_option = click.option(
    "--checkpoint-index",
    default="latest",
    show_default=True,
    callback=_checkpoint_index,
    help="Which checkpoint: an index, 'latest' or 'best'.",
)
"""``--checkpoint-index``: the value arrives parsed (``"latest"``, ``"best"`` or an int)."""

checkpoint_options = option_group(
    checkpoint_index_option,
    click.option(
        "--ema/--live",
        " /--no-ema",
        default=True,
        show_default=True,
        help="The EMA (averaged) weights when the checkpoint has them, or the trained ones.",
    ),
    click.option("--head", help="Readout head of a multi-head model (default: its first)."),
    click.option("--model-key", default="main", show_default=True, help="Which saved model."),
)
"""The model a command reads from a checkpoint root: ``checkpoint_index``, ``ema``,
``head``, ``model_key``."""
