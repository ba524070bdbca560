"""The on-disk state of an active-learning run: :class:`LearnStore`.

Everything the loop learns is written here before the next step uses it, atomically
(a crash leaves the old file or the new one, never half of one)::

    work_dir/
      .lock                      held by the running learn process (one at a time)
      state.json                 {"iteration": i, "phase": "label", "times": {...}}
      iterations/0000/
        candidates.extxyz        the explored frames (info: max_force_deviation, ...)
        explore.json             trajectories, frames per deviation band
        selected.extxyz          the frames chosen for labelling
        labels/00003.json        each label as it arrives (or the error of a failed one)
        labelled.extxyz          the selected frames with their labels
        checkpoints/             the committee fine-tuned on them
        report.json              the iteration's numbers
      report.json, learning_curve.png

A phase is done when ``state.json`` has moved past it; a killed process resumes at the
phase in ``state.json``: explore and select run again (they are deterministic), label
only labels the structures that have no file in ``labels/`` yet, and train resumes from
its last checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError
from nvalchemi._fileio import atomic_path, json_bytes, write_atomic

__all__ = ["PHASES", "LearnStore"]

PHASES = ("explore", "select", "label", "train", "report")
"""The phases of an iteration, in order."""

STATE = "state.json"
LOCK = ".lock"


class LearnStore:
    """Paths and atomic reads/writes of one run's ``work_dir``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    # ------------------------------------------------------------------- locking
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the run's lock (raises ``FieldError`` if another learn process holds it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise FieldError(
                    f"another learn process is running in {self.root}",
                    field="work_dir",
                    fix="wait for it to finish, or stop it (a killed one resumes where it was)",
                ) from None
            yield
        finally:
            os.close(fd)  # releases the lock

    # --------------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        """``{"iteration", "phase", "times"}``; a new run starts at iteration 0, explore."""
        path = self.root / STATE
        if not path.is_file():
            return {"iteration": 0, "phase": PHASES[0], "times": {}}
        return json.loads(path.read_text())

    def advance(self, state: dict[str, Any], seconds: float) -> dict[str, Any]:
        """Mark the current phase done (``seconds`` spent in it) and move to the next."""
        state = dict(state)
        key = f"{state['iteration']}/{state['phase']}"
        state["times"] = {**state.get("times", {}), key: state.get("times", {}).get(key, 0.0)}
        state["times"][key] += seconds
        index = PHASES.index(state["phase"])
        if index + 1 < len(PHASES):
            state["phase"] = PHASES[index + 1]
        else:
            state["iteration"], state["phase"] = state["iteration"] + 1, PHASES[0]
        write_atomic(self.root / STATE, json_bytes(state))
        return state

    def add_time(self, state: dict[str, Any], seconds: float) -> None:
        """Add ``seconds`` to the current phase's time (a run killed in it spent them)."""
        key = f"{state['iteration']}/{state['phase']}"
        times = state.setdefault("times", {})
        times[key] = times.get(key, 0.0) + seconds

    # ---------------------------------------------------------------- iterations
    def iteration(self, index: int) -> Path:
        """The folder of iteration ``index``."""
        return self.root / "iterations" / f"{index:04d}"

    def checkpoints(self, index: int) -> Path:
        """The checkpoint root of the committee trained in iteration ``index``."""
        return self.iteration(index) / "checkpoints"

    def label_path(self, index: int, structure: int) -> Path:
        return self.iteration(index) / "labels" / f"{structure:05d}.json"

    def stored_labels(self, index: int) -> dict[int, dict[str, Any]]:
        """Every label (or failure record) of iteration ``index`` stored so far."""
        folder = self.iteration(index) / "labels"
        out = {}
        if folder.is_dir():
            for path in sorted(folder.glob("[0-9]*.json")):
                out[int(path.stem)] = json.loads(path.read_text())
        return out

    # -------------------------------------------------------------------- files
    def write_json(self, path: Path, data: Any) -> None:
        write_atomic(path, json_bytes(data))

    def read_json(self, path: Path) -> Any:
        return json.loads(path.read_text())

    def write_structures(self, path: Path, structures: list[Any]) -> None:
        """Write ASE ``Atoms`` to extxyz atomically (labels from their calculators)."""
        from ase.io import write

        with atomic_path(path) as tmp:
            write(tmp, structures, format="extxyz")

    def read_structures(self, path: Path) -> list[Any]:
        from ase.io import read

        if not path.is_file() or path.stat().st_size == 0:
            return []
        return read(path, index=":", format="extxyz")
