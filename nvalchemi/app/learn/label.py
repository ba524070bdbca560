"""Label: the reference method on the selected frames, in worker processes.

The labeller is an ASE calculator class (or any factory returning a calculator) named by
import path in the job (``label.calculator``, keyword arguments ``label.kwargs``); the
path passes the trust rule in this process (the job's ``imports:`` list trusts it), and
workers import the path they are given. Each worker labels one structure at a time and
writes the label to the store itself (atomically) before it takes the next: a label,
once computed, is never lost and never computed again. A failed calculation (an
exception, or a process that dies) is stored as ``{"error": ...}`` and the structure is
skipped. Workers are fresh processes (``python -m nvalchemi.app.learn.label``: nothing of
this process, its lock, its threads or torch, is inherited) that watch their parent and
exit when it dies, so a killed ``learn`` leaves no labelling behind that could run twice.

Example:
    >>> labels = label_structures(  # doctest: +SKIP
    ...     frames, lambda i: store.label_path(0, i), job.label, imports=job.imports)
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_labeller", "label_structures", "labelled_structures"]


def check_labeller(path: str, imports: Sequence[str] = ()) -> Any:
    """The labeller factory named by ``path``, under the trust rule (``FieldError`` if not).

    ``imports`` (the job's list) are allowed first, as for every path a job names.
    """
    from nvalchemi._errors import FieldError
    from nvalchemi._serialization import UnsafeImportError, allow_import_path, import_path

    for name in imports:
        allow_import_path(name)
    try:
        factory = import_path(path)
    except UnsafeImportError:
        module = path.rpartition(".")[0] or path
        raise FieldError(
            f"{path!r} is outside the import trust rule (it is code the job would run)",
            field="label.calculator",
            fix=f"list its package under imports in the job file (imports: [{module}]) if "
            "you trust it",
        ) from None
    except (ImportError, ValueError, AttributeError) as exc:
        raise FieldError(
            f"cannot import {path!r}: {exc}",
            field="label.calculator",
            fix="name an ASE calculator class, e.g. ase.calculators.emt.EMT",
        ) from None
    if not callable(factory):
        raise FieldError(
            f"{path!r} is a {type(factory).__name__}, not a calculator class",
            field="label.calculator",
            fix="name an ASE calculator class, e.g. ase.calculators.emt.EMT",
        )
    return factory


# ------------------------------------------------------------------------ worker side
def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.1)
        if os.getppid() != parent:
            os._exit(1)  # the learn process died: stop before labelling anything twice


def _factory(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _label_one(task: dict[str, Any]) -> str | None:
    """Label one structure and store the label (or the error) at ``task["out"]``."""
    from ase import Atoms

    from nvalchemi._fileio import json_bytes, write_atomic

    try:
        atoms = Atoms(**task["atoms"])
        atoms.calc = _factory(task["calculator"])(**task["kwargs"])
        record: dict[str, Any] = {
            "energy": float(atoms.get_potential_energy()),
            "forces": atoms.get_forces().tolist(),
        }
        has_volume = atoms.pbc.any() and abs(atoms.cell.volume) > 1e-12
        if task["stress"] and has_volume:
            record["stress"] = [float(x) for x in atoms.get_stress()]
        values = [record["energy"], *record.get("stress", [])]
        values += [x for row in record["forces"] for x in row]
        if not all(math.isfinite(v) for v in values):
            raise ValueError("the calculator returned non-finite values")
    except Exception as exc:  # recorded and skipped, as the job asks
        record = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"}
    write_atomic(task["out"], json_bytes(record))
    return record.get("error")


def _serve() -> None:
    """A worker (``python -m nvalchemi.app.learn.label``): the first stdin line is
    ``{"parent": pid, "path": sys.path}``, then one task per line; one line back per
    stored label."""
    hello = json.loads(sys.stdin.readline())
    sys.path[:0] = [p for p in hello["path"] if p not in sys.path]
    threading.Thread(target=_watch_parent, args=(hello["parent"],), daemon=True).start()
    for line in sys.stdin:
        error = _label_one(json.loads(line))
        sys.stdout.write(json.dumps({"error": error}) + "\n")
        sys.stdout.flush()


# ------------------------------------------------------------------------ parent side
def _payload(atoms: Any) -> dict[str, Any]:
    return {
        "numbers": atoms.numbers.tolist(),
        "positions": atoms.positions.tolist(),
        "cell": atoms.cell.array.tolist(),
        "pbc": atoms.pbc.tolist(),
    }


class _Worker:
    """One labelling process, fed one task at a time."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nvalchemi.app.learn.label"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._send({"parent": os.getpid(), "path": sys.path})

    def _send(self, message: dict[str, Any]) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def label(self, task: dict[str, Any]) -> bool:
        """Whether the worker stored the task's record (``False``: it died)."""
        try:
            self._send(task)
        except BrokenPipeError:
            return False
        return bool(self.process.stdout.readline())

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def label_structures(
    structures: Sequence[Any],
    label_path: Callable[[int], Path],
    settings: Any,
    *,
    imports: Sequence[str] = (),
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Label every structure whose ``label_path(i)`` does not exist yet.

    ``settings``: the job's ``label`` block (``calculator``, ``kwargs``, ``workers``,
    ``stress``). ``progress(done, total)`` after each stored label. A worker that dies
    while labelling a structure (the calculator crashed its process) leaves that
    structure recorded as failed, and a new worker goes on with the rest.

    Raises:
        FieldError: the labeller is not trusted or not importable.
    """
    check_labeller(settings.calculator, imports)
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(structures)):
        if not label_path(i).is_file():
            todo.put(i)
    total, pending = len(structures), todo.qsize()
    if not pending:
        return
    finished: queue.Queue[int] = queue.Queue()

    def drive() -> None:
        worker = _Worker()
        try:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                task = {
                    "calculator": settings.calculator,
                    "kwargs": dict(settings.kwargs),
                    "stress": settings.stress,
                    "atoms": _payload(structures[i]),
                    "out": str(label_path(i)),
                }
                if not worker.label(task):
                    code = worker.process.wait()
                    if not label_path(i).is_file():
                        _record_death(label_path(i), code)
                    worker = _Worker()
                finished.put(i)
        finally:
            worker.close()

    threads = [
        threading.Thread(target=drive, daemon=True) for _ in range(min(settings.workers, pending))
    ]
    for thread in threads:
        thread.start()
    for done in range(total - pending + 1, total + 1):
        finished.get()
        if progress is not None:
            progress(done, total)
    for thread in threads:
        thread.join()


def _record_death(path: Path, code: int) -> None:
    from nvalchemi._fileio import json_bytes, write_atomic

    error = f"the labelling process died (exit status {code}) while labelling this structure"
    write_atomic(path, json_bytes({"error": error}))


def labelled_structures(
    structures: Sequence[Any], records: dict[int, dict[str, Any]]
) -> tuple[list[Any], list[dict[str, Any]]]:
    """``(structures with their labels attached, failures)`` from stored ``records``."""
    import numpy as np
    from ase.calculators.singlepoint import SinglePointCalculator

    labelled, failures = [], []
    for index, atoms in enumerate(structures):
        record = records.get(index)
        if record is None or "error" in record:
            failures.append({"index": index, "error": None if record is None else record["error"]})
            continue
        atoms = atoms.copy()
        results = {"energy": record["energy"], "forces": np.array(record["forces"])}
        if "stress" in record:
            results["stress"] = np.array(record["stress"])
        atoms.calc = SinglePointCalculator(atoms, **results)
        labelled.append(atoms)
    return labelled, failures


if __name__ == "__main__":
    _serve()
