"""Read a job file into a checked :class:`TrainingJobSpec` (or a one-paragraph error)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from nvalchemi.training.cli._errors import CLIError, _validation_lines
from nvalchemi.training.cli.job_paths import resolve_job_paths
from nvalchemi.training.cli.job_spec import TrainingJobSpec, read_job_file
from nvalchemi.training.cli.payload import ResolvedJob, check_job

__all__ = ["load_job", "validate_job_data"]


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


def load_job(path: str | Path, *, trust: bool = False) -> tuple[TrainingJobSpec, ResolvedJob]:
    """Parse, validate and resolve the job file at ``path``.

    Relative paths in the file are taken relative to the file's directory (see
    :mod:`nvalchemi.training.cli.job_paths`); the returned job holds absolute paths.
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
    return job, check_job(job, trust=trust)
