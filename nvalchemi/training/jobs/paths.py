"""Relative paths in job files are relative to the job file's directory.

A job file is read the same way from any working directory: :func:`resolve_job_paths`
turns its relative paths into absolute ones (``spec report|run|resume``), and
:func:`rebase_job_paths` rewrites paths a person typed on the command line (relative to
the current directory) so that they stay right in a job file written elsewhere
(``train init`` / ``finetune init`` with ``--out``). Paths given as command-line options
(``--validation-dataset``, ``CHECKPOINT_DIR``, ...) stay relative to the current directory.

Paths are the job's file and directory fields: ``dataset.path``/``paths``/
``validation_path``, ``output.run_dir``/``checkpoint_dir``/``report_path``,
``source.checkpoint_path``, ``source.mace.atomic_energies_path``,
``finetune.replay.path``/``paths``, and keyword arguments of
``source.hooks`` specs whose name ends in ``_dir``, ``_path`` or ``_file`` (e.g. a
``CheckpointHook``'s ``checkpoint_dir``). URIs (``s3://...``) and absolute paths are kept;
``~`` is expanded. Paths inside ``strategy`` are passed on as written.

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
    "dataset": ("path", "paths", "validation_path"),
    "output": ("run_dir", "checkpoint_dir", "report_path"),
    "source": ("checkpoint_path",),
}
_HOOK_SUFFIXES = ("_dir", "_path", "_file")


def _is_hook_path(key: str) -> bool:
    return key != "cls_path" and key.endswith(_HOOK_SUFFIXES)


def _apply(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [fn(v) if isinstance(v, str) else v for v in value]
    return value


def map_job_paths(data: dict[str, Any], fn: Callable[[str], str]) -> dict[str, Any]:
    """A copy of the raw job mapping ``data`` with ``fn`` applied to every path string."""
    out = copy.deepcopy(data)
    for block, keys in _FIELDS.items():
        section = out.get(block)
        if not isinstance(section, dict):
            continue
        for key in keys:
            if key in section:
                section[key] = _apply(section[key], fn)
    finetune = out.get("finetune")
    replay = finetune.get("replay") if isinstance(finetune, dict) else None
    if isinstance(replay, dict):
        for key in ("path", "paths"):
            if key in replay:
                replay[key] = _apply(replay[key], fn)
    source = out.get("source")
    if not isinstance(source, dict):
        return out
    mace = source.get("mace")
    if isinstance(mace, dict) and "atomic_energies_path" in mace:
        mace["atomic_energies_path"] = _apply(mace["atomic_energies_path"], fn)
    for entry in source.get("hooks") or []:
        if not isinstance(entry, dict):
            continue
        spec = entry.get("spec") if isinstance(entry.get("spec"), dict) else entry
        for key in list(spec):
            if _is_hook_path(str(key)):
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
    """Paths relative to the current directory, rewritten relative to ``job_dir``.

    For a job written to ``job_dir`` from command-line input; absolute paths are kept.
    """
    base = Path(job_dir).expanduser().absolute()

    def rebase(path: str) -> str:
        if _keep(path) or os.path.isabs(os.path.expanduser(path)):
            return path
        return os.path.relpath(os.path.abspath(path), base)

    return map_job_paths(data, rebase)
