"""Relative paths in job files are relative to the job file's directory.

:func:`resolve_job_paths` makes a job file's relative paths absolute (``spec
report|run|resume``, from any working directory); :func:`rebase_job_paths` rewrites paths
typed on the command line so that they stay right in a job file written elsewhere
(``train init --out``). Paths are the job's file and directory fields, and keyword
arguments of ``source.hooks`` specs ending in ``_dir``, ``_path`` or ``_file``; URIs and
absolute paths are kept, ``~`` is expanded, paths inside ``strategy`` are left as written.

Example:
    >>> job = {"dataset": {"path": "data/train.xyz"}, "output": {"run_dir": "/abs/run"}}
    >>> resolve_job_paths(job, "/jobs")["dataset"]["path"], job["output"]["run_dir"]
    ('/jobs/data/train.xyz', '/abs/run')
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["map_job_paths", "rebase_job_paths", "resolve_job_paths"]

_FIELDS = {
    ("dataset",): ("path", "paths", "validation_path"),
    ("output",): ("run_dir", "checkpoint_dir", "report_path"),
    ("source",): ("checkpoint_path",),
    ("source", "mace"): ("atomic_energies_path",),
    ("finetune", "replay"): ("path", "paths"),
}
_HOOK_SUFFIXES = ("_dir", "_path", "_file")


def _apply(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [fn(v) if isinstance(v, str) else v for v in value]
    return value


def map_job_paths(data: dict[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    """A copy of the raw job mapping ``data`` with ``fn`` applied to every path string."""
    out = copy.deepcopy(data)
    for blocks, keys in _FIELDS.items():
        section = out
        for block in blocks:
            section = section.get(block) if isinstance(section, dict) else None
        if not isinstance(section, dict):
            continue
        for key in set(keys) & set(section):
            section[key] = _apply(section[key], fn)
    source = out.get("source")
    hooks = source.get("hooks") if isinstance(source, dict) else None
    for entry in hooks or []:
        if not isinstance(entry, dict):
            continue
        spec = entry.get("spec") if isinstance(entry.get("spec"), dict) else entry
        for key in list(spec):
            if key != "cls_path" and str(key).endswith(_HOOK_SUFFIXES):
                spec[key] = _apply(spec[key], fn)
    return out


def _keep(path: str) -> bool:
    return "://" in path or not path


def resolve_job_paths(data: dict[str, Any], job_dir: str | Path) -> dict[str, Any]:
    """Relative paths of a job file in ``job_dir`` as absolute, normalised paths."""
    base = Path(job_dir).expanduser().absolute()

    def resolve(path: str) -> str:
        if _keep(path):
            return path
        expanded = os.path.expanduser(path)
        return os.path.normpath(expanded if os.path.isabs(expanded) else base / expanded)

    return map_job_paths(data, resolve)


def rebase_job_paths(data: dict[str, Any], job_dir: str | Path) -> dict[str, Any]:
    """Paths relative to the current directory (command-line input), rewritten relative to
    ``job_dir`` (where the job is written); absolute paths are kept."""
    base = Path(job_dir).expanduser().absolute()

    def rebase(path: str) -> str:
        if _keep(path) or os.path.isabs(os.path.expanduser(path)):
            return path
        return os.path.relpath(os.path.abspath(path), base)

    return map_job_paths(data, rebase)
