"""User-facing errors: one paragraph naming the field and the fix, never a traceback.

Commands raise :class:`CLIError`; library :class:`~nvalchemi._errors.FieldError` texts
already name the field and the fix; anything else is worded by :func:`user_message`.
``--debug`` (or ``NVALCHEMI_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import errno
import os
import textwrap

import click

__all__ = ["CLIError", "debug_enabled", "enable_debug", "environment_error", "user_message"]


class CLIError(click.ClickException):
    """A user error: what is wrong (``field`` when there is one) and how to fix it.

    Example:
        >>> str(CLIError("must be >= 1; got 0", field="dataset.batch_size", fix="set it to 8"))
        'dataset.batch_size: must be >= 1; got 0. Fix: set it to 8.'
    """

    exit_code = 1

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        text = message.rstrip()
        if field:
            text = f"{field}: {text}"
        if fix:
            text = f"{text.rstrip('.')}. Fix: {fix.rstrip('.')}."
        super().__init__(text)
        self.field = field
        self.fix = fix


def enable_debug(ctx: click.Context) -> None:
    """Remember that ``--debug`` was given (for the whole command line)."""
    ctx.find_root().meta["nvalchemi_debug"] = True


def debug_enabled(ctx: click.Context) -> bool:
    """Whether tracebacks should be shown instead of one-paragraph messages."""
    if os.environ.get("NVALCHEMI_DEBUG", "").lower() in ("1", "true", "yes"):
        return True
    return bool(ctx.find_root().meta.get("nvalchemi_debug"))


_ELSEWHERE = "or write elsewhere"
_MACHINE_FIXES = {
    errno.ENOSPC: f"free space on that disk, {_ELSEWHERE}",
    errno.EDQUOT: f"free space within your disk quota, {_ELSEWHERE}",
    errno.EFBIG: f"a file size limit (ulimit -f) or the disk is full: raise it or free space, "
    f"{_ELSEWHERE}",
    errno.EROFS: f"the file system is read-only: {_ELSEWHERE}",
    errno.EACCES: "choose a path you may write (and read), or fix its permissions",
    errno.EPERM: "choose a path you may write (and read), or fix its permissions",
}


def environment_error(exc: BaseException, path: object = None) -> CLIError | None:
    """``exc`` as a user error when the machine refused (a full disk, a read-only file
    system, no permission), naming the path (``exc.filename``, else ``path``) and the
    cause; ``None`` for anything else.

    >>> import errno
    >>> str(environment_error(OSError(errno.ENOSPC, "No space left on device"), "out.zarr"))
    'out.zarr: No space left on device. Fix: free space on that disk, or write elsewhere.'
    """
    from nvalchemi.training.checkpoint.store import CheckpointWriteError

    if not isinstance(exc, OSError) or isinstance(exc, CheckpointWriteError):
        return None
    fix = _MACHINE_FIXES.get(exc.errno)
    if fix is None:
        return None
    where = exc.filename if exc.filename is not None else path
    cause = exc.strerror or os.strerror(exc.errno)
    return CLIError(f"{where}: {cause}" if where is not None else cause, fix=fix)


def _collective_text(exc: BaseException) -> str:
    """A failed collective: the framework's notes (which collective, which rank) first."""
    notes = [n for n in getattr(exc, "__notes__", None) or [] if isinstance(n, str)]
    ours = [n.removeprefix("nvalchemi: ") for n in notes if n.startswith("nvalchemi:")]
    where = [n for n in notes if n.startswith("raised during training")]
    head = " ".join(ours) or (
        "a collective operation between the ranks failed: another rank most likely exited, "
        "crashed or stalled; check its log"
    )
    tail = f"PyTorch: {type(exc).__name__}: {exc}"
    if where:
        tail += f"; {where[0]}"
    return f"{head} ({tail})"


def user_message(exc: BaseException) -> str:
    """One paragraph describing ``exc`` for a person at a terminal."""
    from pydantic import ValidationError

    from nvalchemi._errors import validation_lines
    from nvalchemi.distributed.stalls import is_collective_failure
    from nvalchemi.training.checkpoint.store import CheckpointLockError, CheckpointWriteError

    if isinstance(exc, (CheckpointLockError, CheckpointWriteError)):
        text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    elif isinstance(exc, ValidationError):
        lines = validation_lines(exc)
        title = exc.title or "input"
        text = f"invalid {title}: " + "; ".join(lines)
    elif isinstance(exc, FileNotFoundError):
        text = str(exc) if exc.filename is None else f"{exc.filename}: no such file or directory"
    elif isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        text = exc.args[0]
    elif isinstance(exc, (ValueError, TypeError, KeyError, PermissionError, IsADirectoryError)):
        text = str(exc) or type(exc).__name__
    elif isinstance(exc, ImportError):
        text = f"{exc}. Install the missing package (see the README's install section)"
    elif is_collective_failure(exc):
        text = _collective_text(exc)
    else:
        text = (
            f"unexpected {type(exc).__name__}: {exc}. This may be a bug; re-run with --debug "
            "to see the traceback and report it"
        )
    text = " ".join(text.split())
    return textwrap.shorten(text, width=4000, placeholder=" ...")
