"""The ``nvalchemi-training`` click group: ``--debug``, error handling, plain warnings.

Command modules add their commands to :data:`main`. Failures become a one-paragraph
message and exit status 1 (``--debug``: the traceback); warnings print as ``warning:`` lines.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import click

from nvalchemi._errors import FieldError
from nvalchemi.app.cli._errors import (
    CLIError,
    debug_enabled,
    enable_debug,
    environment_error,
    user_message,
)

__all__ = [
    "MINUTES",
    "batch_size_value",
    "debug_option",
    "main",
    "option_group",
    "parse_checkpoint_index",
    "threads_value",
]

_EPILOG = """\b
Examples:
  nvalchemi-training quickstart                      # train PaiNN on the bundled EMT data
  nvalchemi-training train init --dataset data/train.extxyz --val-fraction 0.1 \\
      --output-dir runs/my --out job.yaml
  nvalchemi-training spec report job.yaml            # tables and warnings, loads no tensors
  nvalchemi-training spec run job.yaml --minutes 10  # length and schedule fitted to 10 min
  nvalchemi-training spec resume runs/my/checkpoints --spec job.yaml
  nvalchemi-training evaluate runs/my/checkpoints --dataset data/test.extxyz
  nvalchemi-training data convert data/train.extxyz data/train.zarr --cutoff 6
  nvalchemi-training bench --model painn             # structures/s, steps/s, memory
"""


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        enable_debug(ctx)
    return value


def debug_option(fn: Any) -> Any:
    """``--debug`` on a subcommand (same effect as on the group)."""
    return click.option(
        "--debug",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_set_debug,
        help="Show full tracebacks instead of one-line error messages.",
    )(fn)


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


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    stream = file or sys.stderr
    with contextlib.suppress(OSError, ValueError):
        stream.write(f"warning: {' '.join(str(message).split())}\n")


@contextlib.contextmanager
def _plain_warnings() -> Iterator[None]:
    previous = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        yield
    finally:
        warnings.showwarning = previous


class _Main(click.Group):
    """A group that turns exceptions into one-paragraph messages (unless ``--debug``)."""

    def invoke(self, ctx: click.Context) -> Any:
        with _plain_warnings():
            try:
                return super().invoke(ctx)
            except CLIError:
                if debug_enabled(ctx):
                    traceback.print_exc()
                raise
            except (click.exceptions.Exit, click.Abort, click.ClickException):
                raise
            except (Exception, KeyboardInterrupt) as exc:
                if debug_enabled(ctx):
                    raise
                if isinstance(exc, KeyboardInterrupt):
                    click.echo("Interrupted.", err=True)
                    ctx.exit(130)
                if isinstance(exc, FieldError):  # a library error naming the field and the fix
                    raise CLIError(" ".join(str(exc).split())) from None
                refused = environment_error(exc)  # the machine said no: not a bug
                if refused is not None:
                    raise refused from None
                raise CLIError(
                    user_message(exc) + " (run with --debug for the traceback)"
                ) from None


@click.group(
    cls=_Main,
    context_settings={"max_content_width": 100, "help_option_names": ["-h", "--help"]},
    epilog=_EPILOG,
)
@debug_option
@click.version_option(package_name="nvalchemi-training", prog_name="nvalchemi-training")
def main() -> None:
    """Train, fine-tune and evaluate machine-learned interatomic potentials."""
