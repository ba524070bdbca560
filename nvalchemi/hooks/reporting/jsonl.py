"""``JSONLinesReporter``: ``metrics.jsonl``, one JSON object per logged step and per validation.

Each line is a flat object::

    {"kind": "train", "step": 120, "epoch": 0, "batch_count": 120, "time": 1718000000.1,
     "elapsed_s": 61.2, "loss/total": 0.0123, "loss/EnergyMSELoss/unweighted": 0.011, ...}

``kind`` is ``"train"`` or ``"validation"`` (validation scalars are named
``validation/loss/total``, ``validation/forces_mae_eV_per_A``, ...: error metrics carry
their unit in the key); ``step`` counts completed optimizer steps, ``epoch`` is the
strategy's completed-epoch counter, ``time`` is Unix time. Non-finite values are
written as ``null``. The first row with a key that has a unit also holds ``"units":
{"loss/ForceMSELoss/unweighted": "(eV/Å)²", "validation/forces_mae_eV_per_A": "eV/Å",
...}``: what each key is measured in (loss terms included); :func:`metric_units`
collects them.
The file is appended to, so a resumed run continues it; :func:`read_metrics`
keeps the latest rows when a resumed run repeats steps.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from nvalchemi._fileio import sync_file
from nvalchemi.hooks.reporting._base import ClosesOnExit
from nvalchemi.hooks.reporting._events import event_position, is_validation_stage
from nvalchemi.hooks.reporting.scalars import (
    ScalarCallback,
    collect_scalars,
    validate_custom_scalars,
)
from nvalchemi.hooks.reporting.state import ReportingState
from nvalchemi.hooks.reporting.units import loss_units, units_of

__all__ = ["METRICS_FILENAME", "JSONLinesReporter", "metric_units", "read_metrics"]

METRICS_FILENAME = "metrics.jsonl"
_FIELDS = ("kind", "step", "epoch", "batch_count", "time", "elapsed_s", "units")


def _metrics_path(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir() or path.suffix not in (".jsonl", ".json", ".ndjson"):
        return path / METRICS_FILENAME
    return path


class JSONLinesReporter(ClosesOnExit):
    """Append training and validation scalars to a JSON-lines file (global rank 0 only).

    Args:
        path: the file, or a run directory (then ``<dir>/metrics.jsonl``).
        include_validation: also write a row at each ``AFTER_VALIDATION`` event.
        flush_every: flush to the OS every N rows (1: after every row). The file
            is fsynced on close.
        custom_scalars: ``{name: callback(ctx, stage)}`` extra columns.

    Rows are written only for events that carry scalars; a second train row for
    the same step (e.g. ``AFTER_EPOCH`` right after the last step) is skipped.

    Example:
        >>> import tempfile, torch
        >>> from nvalchemi.hooks.context import TrainContext
        >>> run = tempfile.mkdtemp()
        >>> with JSONLinesReporter(run) as reporter:
        ...     reporter.report(TrainContext(batch=None, loss=torch.tensor(0.5)),
        ...                     "AFTER_OPTIMIZER_STEP", ReportingState())
        >>> [(row["kind"], row["step"], row["loss/total"]) for row in read_metrics(run)]
        [('train', 1, 0.5)]
    """

    rank_zero_only = True
    requires_all_ranks = False

    def __init__(
        self,
        path: str | Path,
        *,
        include_validation: bool = True,
        flush_every: int = 1,
        custom_scalars: Mapping[str, ScalarCallback] | None = None,
    ) -> None:
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(
                f"JSONLinesReporter flush_every must be an int >= 1; got {flush_every!r}."
            )
        self.path = _metrics_path(path)
        self.include_validation = bool(include_validation)
        self.flush_every = flush_every
        self.custom_scalars = validate_custom_scalars(custom_scalars)
        self._file: IO[str] | None = None
        self._unflushed = 0
        self._last_train_step: int | None = None
        self._units_written: set[str] = set()

    def report(self, ctx: Any, stage: Any, state: ReportingState) -> None:
        """Append one row for this event (training step or validation)."""
        if getattr(ctx, "global_rank", 0) != 0:
            return
        validating = is_validation_stage(stage)
        if validating and not self.include_validation:
            return
        snapshot = collect_scalars(
            ctx,
            stage,
            state,
            custom_scalars=self.custom_scalars,
            include_throughput=True,
            include_memory=True,
        )
        if not snapshot.scalars:
            return
        if not validating:
            if snapshot.step == self._last_train_step:
                return
            self._last_train_step = snapshot.step
        row: dict[str, Any] = {
            "kind": "validation" if validating else "train",
            "step": snapshot.step,
            "epoch": snapshot.epoch,
            "batch_count": event_position(ctx, stage).batch,
            "time": round(snapshot.timestamp_s, 3),
            "elapsed_s": round(snapshot.elapsed_s, 3),
        }
        for key in sorted(snapshot.scalars):
            if key in row:
                raise ValueError(
                    f"Scalar name {key!r} collides with a metrics.jsonl field {_FIELDS}; "
                    "rename the custom scalar."
                )
            value = snapshot.scalars[key]
            row[key] = value if math.isfinite(value) else None
        new = self._new_units(ctx, snapshot.scalars)
        if new:
            row["units"] = new
        self._write(json.dumps(row, separators=(",", ":"), allow_nan=False, ensure_ascii=False))

    def _new_units(self, ctx: Any, scalars: Mapping[str, float]) -> dict[str, str]:
        """Units of the keys whose unit no earlier row gave."""
        loss = loss_units(getattr(getattr(ctx, "workflow", None), "loss_fn", None))
        new = {
            k: u for k, u in units_of(list(scalars), loss).items() if k not in self._units_written
        }
        self._units_written.update(new)
        return new

    def _open(self) -> IO[str]:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            needs_newline = False
            if self.path.exists() and self.path.stat().st_size > 0:
                with self.path.open("rb") as existing:
                    existing.seek(-1, os.SEEK_END)
                    needs_newline = existing.read(1) != b"\n"  # a crash cut the last row
            self._file = self.path.open("a", encoding="utf-8")
            if needs_newline:
                self._file.write("\n")
        return self._file

    def _write(self, line: str) -> None:
        handle = self._open()
        handle.write(line + "\n")  # one write per row: a crash never leaves half a row behind
        self._unflushed += 1
        if self._unflushed >= self.flush_every:
            handle.flush()
            self._unflushed = 0

    def close(self) -> None:
        """Flush, fsync and close the file (reopened in append mode if reporting continues)."""
        handle, self._file = self._file, None
        if handle is None:
            return
        try:
            sync_file(handle)
        finally:
            handle.close()
            self._unflushed = 0


def read_metrics(path: str | Path, *, latest_only: bool = True) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` file (or of ``<dir>/metrics.jsonl``).

    Lines that are not complete JSON objects (a row cut by a crash) are
    skipped. With ``latest_only``, when a resumed run writes a train row for a
    step that was already logged, the earlier rows from that step on are
    dropped, so each step appears once with the values of the run that
    continued.
    """
    file = _metrics_path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"No metrics file at {file}; was the run reporting with JSONLinesReporter?"
        )
    rows: list[dict[str, Any]] = []
    last_train: int | None = None
    with file.open(encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(row, dict):
                continue
            step = row.get("step")
            if latest_only and row.get("kind") == "train" and isinstance(step, int):
                if last_train is not None and step <= last_train:
                    rows = [
                        r
                        for r in rows
                        if not (isinstance(r.get("step"), int) and r["step"] >= step)
                    ]
                last_train = step
            rows.append(row)
    return rows


def metric_units(rows: list[dict[str, Any]]) -> dict[str, str]:
    """``{key: unit}`` from the ``"units"`` entries of :func:`read_metrics` rows."""
    out: dict[str, str] = {}
    for row in rows:
        if isinstance(row.get("units"), dict):
            out.update(row["units"])
    return out
