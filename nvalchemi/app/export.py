"""Export a training checkpoint: its model as a torch-only file, with the run's record.

:func:`export_checkpoint` (``nvalchemi-training export CKPT OUT``) loads one model of a
checkpoint (its EMA weights by default), reads the run it belongs to (the checkpoint
root's folder: ``job.json`` of ``spec run`` or ``quickstart.json`` of the quickstart) for
the training data files and the final evaluation, checks the export on a few structures
of that data (or of ``check_file``) and writes it with
:func:`nvalchemi.models.export.export_model`. The metadata inside the file records the
model spec, the checkpoint and its training step, the weights, the data files with their
SHA-256 hashes, the run's final errors and the self-check.

Example:
    >>> info = export_checkpoint("runs/x/checkpoints", "runs/x/potential.pt")  # doctest: +SKIP
    >>> info["self_check"]["max_relative_error"]["forces"] < 1e-10  # doctest: +SKIP
    True
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError

__all__ = ["CHECK_STRUCTURES", "RunRecord", "export_checkpoint", "read_run_record"]

CHECK_STRUCTURES = 4
"""How many structures of the run's data the self-check uses (evenly spread over the files)."""

MAX_CHECK_FILE_STRUCTURES = 16
"""A ``check_file`` with more structures is checked on this many, evenly spread."""


@dataclass
class RunRecord:
    """What a run directory says about its training: data files and final errors."""

    run_dir: Path
    kind: str | None = None
    """``"spec run"``, ``"quickstart"`` or ``None`` (no record found)."""
    training_files: list[Path] = field(default_factory=list)
    validation_files: list[Path] = field(default_factory=list)
    test_files: list[Path] = field(default_factory=list)
    evaluation: dict[str, Any] | None = None
    """The run's final evaluation (``metrics`` and the weights it used), if written."""
    dataset: dict[str, Any] = field(default_factory=dict)
    """How the run read its data (``max_structures``, ``val_fraction``, ``seed``, ...)."""

    @property
    def check_files(self) -> list[Path]:
        """Files to draw self-check structures from: held-out data first."""
        files = self.validation_files or self.test_files or self.training_files
        return [f for f in files if f.exists()]

    def data_entries(self) -> list[dict[str, Any]]:
        """``[{"role", "path", "bytes", "sha256"}, ...]`` of every data file that exists."""
        out = []
        for role, files in (
            ("training", self.training_files),
            ("validation", self.validation_files),
            ("test", self.test_files),
        ):
            for path in files:
                entry: dict[str, Any] = {"role": role, "path": str(path)}
                if path.exists():
                    entry.update(bytes=_size(path), sha256=_sha256(path))
                else:
                    entry["missing"] = True
                out.append(entry)
        return out


def read_run_record(run_dir: str | Path) -> RunRecord:
    """The data files and final evaluation of the run in ``run_dir`` (empty if none)."""
    run_dir = Path(run_dir)
    record = RunRecord(run_dir)
    job_file, quickstart_file = run_dir / "job.json", run_dir / "quickstart.json"
    if job_file.is_file():
        dataset = _json(job_file).get("dataset") or {}
        record.kind = "spec run"
        paths = dataset.get("paths") or ([dataset["path"]] if dataset.get("path") else [])
        validation = dataset.get("validation_path") or []
        record.training_files = [Path(p) for p in paths]
        record.validation_files = [Path(p) for p in _as_list(validation)]
        record.dataset = {
            k: v for k, v in dataset.items() if k not in ("path", "paths", "validation_path")
        }
        record.evaluation = _evaluation(run_dir / "final_evaluation.json", "validation data")
    elif quickstart_file.is_file():
        from nvalchemi.data.bundled import bundled_split_path

        record.kind = "quickstart"
        record.training_files = [bundled_split_path("train")]
        record.validation_files = [bundled_split_path("val")]
        record.test_files = [bundled_split_path("test")]
        recipe = _json(quickstart_file).get("recipe") or {}
        record.dataset = {k: v for k, v in recipe.items() if k.startswith("max_")}
        record.evaluation = _evaluation(run_dir / "test_metrics.json", "test split")
    return record


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    use_ema: bool = True,
    dtype: str | None = None,
    format: str = "torchscript",
    check_file: str | Path | None = None,
    checkpoint_index: int | str = "latest",
    model_key: str = "main",
    head: str | None = None,
    trust: bool = False,
) -> dict[str, Any]:
    """Export model ``model_key`` of a checkpoint to ``out``; return the file's metadata.

    Args:
        checkpoint: the checkpoint root (``.../checkpoints``, holding ``manifest.json``).
        out: the file to write (replaced atomically; an existing non-export is refused).
        use_ema: the EMA weights when the checkpoint has them (else the trained ones).
        dtype: ``"float64"`` or ``"float32"`` (default: the model's).
        format: ``"torchscript"`` (``"aoti"`` is refused: not provided yet).
        check_file: structures to check the export on (extxyz / ASE db / zarr; up to
            :data:`MAX_CHECK_FILE_STRUCTURES` of them); default: a few of the run's
            data, else synthetic structures of the model's elements.
        checkpoint_index: ``"latest"``, ``"best"`` or an index.
        model_key: which saved model.
        head: the readout head of a multi-head model (default: its default head).
        trust: allow model specs outside the import allow-list (checkpoints you trust).

    Raises:
        FieldError: no checkpoint at ``checkpoint``, an unreadable ``check_file``, or any
            refusal of :func:`~nvalchemi.models.export.export_model` (an
            :class:`~nvalchemi.models.export.ExportError`: nothing is written then).
    """
    from nvalchemi.models.export import check_format, export_model, known_elements
    from nvalchemi.training.checkpoint import CheckpointStore, load_model_from_checkpoint

    check_format(format)  # before loading anything
    root = Path(checkpoint)
    if not (root / "manifest.json").is_file():
        raise FieldError(
            f"{root} is not an nvalchemi checkpoint directory (no manifest.json)",
            field="CHECKPOINT",
            fix="give the checkpoint root a CheckpointHook wrote, e.g. runs/quickstart/checkpoints",
        )
    store = CheckpointStore(root)
    manifest = store.manifest()
    files = store.open(checkpoint_index)
    entry = files.entry

    def load(ema: bool) -> Any:
        return load_model_from_checkpoint(
            root,
            map_location="cpu",
            model_key=model_key,
            use_ema=ema,
            checkpoint_index=entry.index,
            trust=trust,
        )

    model = load(use_ema)
    weights = "live"
    if use_ema:
        weights = (
            "ema" if _differ(model, load(False)) else "live (the checkpoint has no EMA weights)"
        )
    run = read_run_record(root.parent)
    structures, source = _check_structures(check_file, run, known_elements(model))
    latest = manifest is not None and entry.index == manifest.checkpoint_index
    metadata = {
        "model": {
            "spec": _json(files.spec("models", model_key)),
            "checkpoint": str(root.resolve()),
            "checkpoint_index": entry.index,
            "model_key": model_key,
            "weights": weights,
        },
        "training": {
            "step": entry.step_count,
            "epoch": entry.epoch_count,
            "run_dir": str(run.run_dir.resolve()) if run.kind else None,
            "run": run.kind,
            "data": run.data_entries(),
            "dataset": run.dataset,
            # the run's final errors belong to its last checkpoint
            "final_evaluation": run.evaluation if latest else None,
        },
        "self_check": {"source": source},
    }
    return export_model(
        model,
        out,
        head=head,
        dtype=dtype,
        structures=structures,
        metadata=metadata,
        format=format,
    )


def _check_structures(
    check_file: str | Path | None, run: RunRecord, elements: list[int]
) -> tuple[list[Any], str]:
    """Structures for the self-check and where they come from."""
    if check_file is not None:
        structures = _read_structures([Path(check_file)], MAX_CHECK_FILE_STRUCTURES, "--check")
        if not structures:
            raise FieldError(f"{check_file} holds no structures", field="--check")
        for i, atoms in enumerate(structures):
            unknown = sorted(set(atoms.numbers.tolist()) - set(elements or atoms.numbers))
            if unknown:
                raise FieldError(
                    f"structure {i} checked from {check_file} ({atoms.get_chemical_formula()}) "
                    f"has elements Z={unknown} that the model does not know (it knows {elements})",
                    field="--check",
                    fix="check on structures of the model's elements",
                )
        return structures, f"--check {check_file}"
    files = run.check_files
    limit = run.dataset.get("max_structures") if run.kind == "spec run" else None
    if files:
        # more candidates than needed: structures with elements the model does not know
        # (beyond what it was trained on) are skipped
        candidates = _read_structures(files, 4 * CHECK_STRUCTURES, "the run's data", limit)
        usable = [a for a in candidates if not elements or set(a.numbers) <= set(elements)]
        structures = _spread(usable, CHECK_STRUCTURES)
        if structures:
            return structures, f"{len(structures)} structures of {', '.join(map(str, files))}"
    return [], "synthetic structures of the model's elements (no usable run data found)"


def _spread(items: Sequence[Any], count: int) -> list[Any]:
    """Up to ``count`` of ``items``, evenly spread (first and last included)."""
    if len(items) <= count:
        return list(items)
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


def _read_structures(
    paths: list[Path], count: int, where: str, max_structures: int | None = None
) -> list[Any]:
    """Up to ``count`` structures spread evenly over ``paths``, as ``ase.Atoms``."""
    from nvalchemi.data.sources import open_reader

    readers = [
        open_reader(p, dtype="float64", field=where, max_structures=max_structures) for p in paths
    ]
    try:
        sizes = [len(r) for r in readers]
        structures = []
        for pick in _spread(range(sum(sizes)), count):
            for reader, size in zip(readers, sizes):
                if pick < size:
                    structures.append(reader.read_data(pick).to_atoms())
                    break
                pick -= size
        return structures
    finally:
        for reader in readers:
            reader.close()


def _differ(model: Any, other: Any) -> bool:
    import torch

    theirs = other.state_dict()
    return any(not torch.equal(v, theirs[k]) for k, v in model.state_dict().items())


def _evaluation(path: Path, on: str) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    report = _json(path)
    metrics = report.get("metrics")
    if not isinstance(metrics, dict):
        return None
    return {"on": on, "weights": report.get("weights", "ema"), "metrics": metrics}


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FieldError(f"cannot read {path}: {exc}", fix="check the run directory") from None
    return data if isinstance(data, dict) else {}


def _as_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in _files(path))


def _sha256(path: Path) -> str:
    """The SHA-256 of a file, or of a store folder's files (relative names and contents)."""
    digest = hashlib.sha256()
    for part in _files(path):
        if path.is_dir():
            digest.update(str(part.relative_to(path)).encode() + b"\0")
        with part.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
