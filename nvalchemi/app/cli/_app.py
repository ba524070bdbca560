"""The ``nvalchemi-training`` click group: ``--debug``, error handling, plain warnings.

Command modules add their commands to :data:`main`. Failures become a one-paragraph
message and exit status 1 (``--debug``: the traceback); warnings print as ``warning:`` lines.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["debug_option", "main"]

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
