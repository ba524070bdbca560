"""Read a job file into a checked :class:`TrainingJobSpec` (or a one-paragraph error)."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from nvalchemi.training.cli._errors import CLIError, _validation_lines
from nvalchemi.training.cli.job_paths import resolve_job_paths
from nvalchemi.training.cli.job_spec import TrainingJobSpec, read_job_file
from nvalchemi.training.cli.payload import ResolvedJob, check_job

__all__ = ["allow_user_code", "load_job", "validate_job_data"]

_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def allow_user_code(modules: Sequence[str], directory: str | Path, field: str = "imports") -> None:
    """Let specs and checkpoints name ``modules`` (the user's choice: a job's ``imports:``,
    ``--allow-import``), found next to the job file or in the working directory.

    Each name goes to :func:`~nvalchemi._serialization.allow_import_path`; ``directory``
    and the working directory join ``sys.path`` (at the end: installed packages win).
    """
    from nvalchemi._serialization import allow_import_path

    if not modules:
        return
    for i, name in enumerate(modules):
        if not isinstance(name, str) or not _MODULE.fullmatch(name):
            raise CLIError(
                f"{name!r} is not a module name", field=f"{field}[{i}]",
                fix="list dotted module names such as common or mypkg.models",
            )  # fmt: skip
        allow_import_path(name)
    for folder in (str(Path(directory).resolve()), str(Path.cwd())):
        if folder not in sys.path:
            sys.path.append(folder)


def validate_job_data(data: dict[str, Any], where: str) -> TrainingJobSpec:
    """``TrainingJobSpec`` from a mapping; a :class:`CLIError` naming the fields otherwise."""
    try:
        return TrainingJobSpec.model_validate(data)
    except ValidationError as exc:
        lines = _validation_lines(exc)
        raise CLIError(
            f"{where} is not a valid job: " + "; ".join(lines),
            fix="correct the field(s) named above (`nvalchemi-training schema dump` prints "
            "the schema)",
        ) from None


def load_job(
    path: str | Path, *, trust: bool = False, allow_imports: Sequence[str] = ()
) -> tuple[TrainingJobSpec, ResolvedJob]:
    """Parse, validate and resolve the job file at ``path``.

    Relative paths in the file are taken relative to the file's directory (see
    :mod:`nvalchemi.training.cli.job_paths`); the returned job holds absolute paths. The
    job's ``imports:`` and ``allow_imports`` (``--allow-import``) pass the trust rule.
    """
    try:
        data = read_job_file(path)
    except FileNotFoundError as exc:
        raise CLIError(
            str(exc).split(";")[0],
            fix="check the path, or create a job with `nvalchemi-training train init ... "
            "--out job.yaml`",
        ) from None
    except ValueError as exc:
        message = str(exc)
        fix = (
            "write the job as one mapping (`nvalchemi-training schema template` prints one)"
            if "must hold a mapping" in message
            else "correct the syntax at the line and column given (JSON: double-quoted keys, "
            "no trailing commas; YAML: closed brackets, consistent indentation)"
        )
        raise CLIError(message, fix=fix) from None
    # Relative paths in the file are relative to the file, wherever it is run from.
    data = resolve_job_paths(data, Path(path).parent)
    job = validate_job_data(data, str(path))
    allow_user_code(job.imports, Path(path).parent)
    allow_user_code(list(allow_imports), Path(path).parent, field="--allow-import")
    return job, check_job(job, trust=trust)
