"""Read back what the tracker reporters wrote: W&B's offline files and an MLflow file store.

W&B (0.31) has no Python reader of its offline ``run-<id>.wandb`` files, so
:func:`wandb_records` reads their documented framing (LevelDB log blocks of 32 KiB after a
7-byte ``:W&B`` header) and parses W&B's own ``Record`` protobufs. MLflow runs are read
through ``MlflowClient``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7  # crc32 (4), length (2), chunk type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4

TRACKER_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_DISABLE_GIT": "true",
    "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 asks for this to use a local folder
}
"""The environment of an offline test: W&B writes files only, MLflow a local store."""


def wandb_records(path: Path) -> Iterator[Any]:
    """The ``wandb_internal_pb2.Record`` messages of one ``run-<id>.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending = _HEADER, b""
    while position + _HEADER <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _HEADER])
        if kind == 0:
            break
        pending += data[position + _HEADER : position + _HEADER + length]
        position += _HEADER + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run_dirs(wandb_dir: Path, run_id: str) -> list[Path]:
    """The offline run folders of run ``run_id`` (one per session), oldest first."""
    folders = [p for p in (wandb_dir / "wandb").glob(f"offline-run-*-{run_id}*") if p.is_dir()]
    return sorted(folders, key=lambda p: p.stat().st_mtime_ns)


def _items(updates: Any) -> dict[str, Any]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}


def wandb_run(wandb_dir: Path, run_id: str) -> dict[str, Any]:
    """``{"sessions", "history", "summary", "config", "files", "exit_codes"}`` of a run.

    ``history`` is the rows of every session in order (``_step`` included); ``summary``
    and ``config`` hold the latest value of each key.
    """
    out: dict[str, Any] = {"history": [], "summary": {}, "config": {}, "files": []}
    out["sessions"], out["exit_codes"] = wandb_run_dirs(wandb_dir, run_id), []
    for folder in out["sessions"]:
        for record in wandb_records(folder / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                out["history"].append(_items(record.history.item))
            elif kind == "summary":
                out["summary"].update(_items(record.summary.update))
            elif kind == "config":
                out["config"].update(_items(record.config.update))
            elif kind == "files":
                out["files"] += [f.path for f in record.files.files]
            elif kind == "exit":
                out["exit_codes"].append(record.exit.exit_code)
    return out


def mlflow_run(uri: str, run_id: str) -> dict[str, Any]:
    """``{"status", "params", "history": {key: [(step, value)]}, "artifacts", "experiment"}``."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        for key in run.data.metrics
    }

    def artifacts(folder: str | None = None) -> list[str]:
        found = []
        for info in client.list_artifacts(run_id, folder):
            found += artifacts(info.path) if info.is_dir else [info.path]
        return found

    return {
        "status": run.info.status,
        "name": run.info.run_name,
        "params": dict(run.data.params),
        "history": history,
        "artifacts": artifacts(),
        "experiment": client.get_experiment(run.info.experiment_id).name,
        "client": client,
    }


def mlflow_run_ids(uri: str) -> list[str]:
    """Every run id in the store (all experiments)."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    return [run.info.run_id for run in client.search_runs(ids)]
