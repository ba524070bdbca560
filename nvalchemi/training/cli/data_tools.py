"""Data utilities behind ``data convert``, ``data check`` and ``data stats``.

* :func:`check_output` refuses outputs that would destroy an input or anything that is
  not a store; :func:`convert_to_zarr` streams extxyz / ASE db structures into an
  ``AtomicDataZarrWriter`` store in chunks (optionally with neighbour lists for a
  cutoff, so training need not build them), reporting progress, in a temporary
  sibling that is moved into place when complete;
* :func:`check_data` verifies a source end to end (every chunk of a zarr store, every
  structure of any file);
* :func:`data_statistics` counts structures, atoms and elements, summarizes the
  labels, and suggests per-element reference energies by least squares
  (``E ≈ Σ_Z n_Z E0[Z]``; minimum-norm solution when the compositions do not fix
  every ``E0``).

Example:
    >>> stats = data_statistics([])  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nvalchemi.training.cli._errors import CLIError

__all__ = [
    "absent_chunk_warning",
    "check_data",
    "check_output",
    "convert_to_zarr",
    "data_statistics",
    "open_inputs",
]

ProgressFn = Callable[[int, int], None]


def open_inputs(
    inputs: Sequence[str],
    *,
    dtype: str = "float32",
    label_keys: dict[str, str] | None = None,
    max_structures: int | None = None,
) -> list[Any]:
    """Readers of extxyz / ASE db ``inputs`` (``CLIError`` for stores or bad files)."""
    from nvalchemi.training.cli.data_sources import detect_format, open_reader

    for path in inputs:
        if Path(path).exists() and detect_format(path) == "alchemi-zarr":
            raise CLIError(
                f"{path} is already a zarr store", field="INPUT",
                fix="convert extxyz or ASE db files",
            )  # fmt: skip
    return [
        open_reader(p, dtype=dtype, label_keys=label_keys, max_structures=max_structures,
                    field="INPUT")
        for p in inputs
    ]  # fmt: skip


def _is_our_store(path: Path) -> bool:
    """Whether ``path`` is a zarr store in our layout (any format, also the reference's)."""
    return (
        path.is_dir()
        and (path / "zarr.json").is_file()
        and (path / "meta").is_dir()
        and (path / "core").is_dir()
    )


def check_output(inputs: Sequence[str | Path], output: str | Path, *, overwrite: bool) -> Path:
    """``output`` checked for :func:`convert_to_zarr` (``CLIError`` when it may not be written).

    Refused, with or without ``overwrite``: an output that is one of the inputs, holds
    one (a directory above it) or lies inside one. An existing output needs
    ``overwrite``, and only a zarr store in our layout (or an empty directory) is ever
    replaced: a file or a directory with other contents is not ours to delete.
    """
    output = Path(output)
    target = output.resolve()
    for given in inputs:
        source = Path(given).resolve()
        if target == source or target in source.parents or source in target.parents:
            relation = (
                "is" if target == source else "contains" if target in source.parents else
                "is inside"
            )  # fmt: skip
            raise CLIError(
                f"{output} {relation} the input {given}; writing it would destroy the data "
                "being converted", field="OUTPUT",
                fix="write the store to a new path next to the inputs, e.g. data/train.zarr",
            )  # fmt: skip
    if not output.exists() and not output.is_symlink():
        return output
    if not overwrite:
        raise CLIError(
            f"{output} already exists", field="OUTPUT", fix="choose a new path or pass --overwrite"
        )
    empty_dir = output.is_dir() and not output.is_symlink() and not any(output.iterdir())
    if output.is_symlink() or not (empty_dir or _is_our_store(output)):
        kind = "a file" if output.is_file() else "not a zarr store written by nvalchemi"
        raise CLIError(
            f"{output} is {kind}; --overwrite replaces only such stores (or an empty directory)",
            field="OUTPUT",
            fix="choose another path, or move it away yourself if it can go",
        )
    return output


def convert_to_zarr(
    readers: Sequence[Any],
    output: str | Path,
    *,
    cutoff: float | None = None,
    half_list: bool = False,
    chunk_size: int = 256,
    progress: ProgressFn | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write every structure of ``readers`` to a new zarr store ``output``; return a summary.

    The store is built in a temporary sibling directory and moved into place only when
    complete: an interrupted or failed conversion leaves ``output`` as it was (absent,
    or the store it replaces, with ``overwrite=True``; see :func:`check_output`, which
    the caller runs first with the input paths). Readers are closed afterwards.
    """
    output = Path(output)
    if output.exists() and not overwrite:
        raise CLIError(
            f"{output} already exists", field="OUTPUT", fix="choose a new path or pass --overwrite"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.converting-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)  # a leftover of this very process id
    try:
        summary = _write_store(readers, partial, cutoff, half_list, chunk_size, progress)
        _swap_in(partial, output)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # only ever what this call created
        for reader in readers:
            reader.close()
    summary["output"] = str(output)
    return summary


def _swap_in(partial: Path, output: Path) -> None:
    """Move the finished store ``partial`` to ``output``, replacing what is there."""
    if not output.exists():
        os.replace(partial, output)
        return
    old = output.with_name(f".{output.name}.replaced-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(output, old)
    try:
        os.replace(partial, output)
    except BaseException:
        os.replace(old, output)  # put the previous store back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_store(
    readers: Sequence[Any],
    path: Path,
    cutoff: float | None,
    half_list: bool,
    chunk_size: int,
    progress: ProgressFn | None,
) -> dict[str, Any]:
    from nvalchemi.data.io.zarr import AtomicDataZarrWriter
    from nvalchemi.data.neighbors import NeighborListTransform

    transform = None if cutoff is None else NeighborListTransform(cutoff, half_list=half_list)
    total = sum(len(r) for r in readers)
    writer = AtomicDataZarrWriter(str(path))
    done, atoms, edges, first = 0, 0, 0, True
    for reader in readers:
        for start in range(0, len(reader), chunk_size):
            chunk = []
            for i in range(start, min(start + chunk_size, len(reader))):
                data = reader.read_data(i)
                if transform is not None:
                    data, _ = transform(data, {"index": done + len(chunk)})
                    edges += int(data.num_edges)
                atoms += int(data.num_nodes)
                chunk.append(data)
            if first:
                writer.write(chunk)
                first = False
            else:
                writer.append(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    if first:
        raise CLIError("the inputs hold no structures", field="INPUT", fix="check the input files")
    summary: dict[str, Any] = {"structures": done, "atoms": atoms}
    if cutoff is not None:
        summary.update({"neighbor_cutoff": float(cutoff), "edges": edges})
    return summary


def _zarr_store(reader: Any) -> Any:
    """The ``AtomicDataZarrReader`` behind ``reader`` (a subset of one), else ``None``."""
    from nvalchemi.data.io.zarr import AtomicDataZarrReader

    inner = getattr(reader, "reader", reader)
    return inner if isinstance(inner, AtomicDataZarrReader) else None


def absent_chunk_warning(reader: Any) -> str | None:
    """For a store of an older format with absent chunks: what that means (else ``None``).

    Such stores (format 1, the reference toolkit's) leave out chunks of zeros, so an
    absent chunk reads as zeros and cannot be told from one lost in a copy.
    """
    store = _zarr_store(reader)
    if store is None or store.every_chunk_written:
        return None
    absent = [p for p in store.verify()["problems"] if " is missing " in p]
    if not absent:
        return None
    return (
        f"{store.store}: {len(absent)} chunk file(s) absent (first: {absent[0]}). This store "
        "was written by an older version (or the reference toolkit), which leaves out chunks "
        "of zeros, so they read as zeros and cannot be told from chunks lost in a copy; "
        "rewrite it with `nvalchemi-training data convert` from the source files to make it "
        "checkable"
    )


def check_data(
    reader: Any, *, batch_size: int = 256, progress: ProgressFn | None = None
) -> dict[str, Any]:
    """Verify one data source end to end; return counts and every problem found.

    For a zarr store every chunk of every array is read and decoded
    (:meth:`~nvalchemi.data.io.zarr.AtomicDataZarrReader.verify`); for any source every
    structure is read and validated as ``AtomicData`` (shapes, dtypes, finite values,
    atomic numbers 1..118, neighbour indices), plus finite positions.
    """
    import torch

    from nvalchemi.data.atomic_data import AtomicData
    from nvalchemi.data.io.zarr import StoreDamagedError

    problems: list[str] = []
    warnings: list[str] = []
    chunks = None
    store = _zarr_store(reader)
    if store is not None:
        report = store.verify()
        chunks = report["chunks"]
        if report["absent_may_be_zeros"]:
            warning = absent_chunk_warning(reader)
            warnings += [warning] if warning else []
            problems += [p for p in report["problems"] if " is missing " not in p]
        else:
            problems += report["problems"]
    levels = dict(getattr(reader, "field_levels", {}) or {})
    total = len(reader)
    checked = atoms = unreadable = 0

    def validate(index: int, fields: dict[str, Any]) -> None:
        nonlocal checked, atoms
        try:
            data = AtomicData(**fields, field_levels={k: levels[k] for k in fields if k in levels})
            if not bool(torch.isfinite(data.positions).all()):
                raise ValueError("AtomicData field 'positions' contains NaN or inf values")
        except (ValueError, TypeError) as exc:
            problems.append(f"structure {index}: {' '.join(str(exc).split())}")
            return
        checked += 1
        atoms += data.num_nodes

    for start in range(0, total, batch_size):
        indices = list(range(start, min(start + batch_size, total)))
        try:
            samples = reader.read_many(indices)
        except StoreDamagedError as exc:
            unreadable += len(indices)
            if not problems:  # verify() reports each damaged chunk once
                problems.append(" ".join(str(exc).split()))
            samples = None
        except Exception:
            samples = None
            for index in indices:  # find the structures that fail, one at a time
                try:
                    validate(index, reader.read(index)[0])
                except Exception as exc:
                    problems.append(f"structure {index}: {' '.join(str(exc).split())}")
        for index, (fields, _) in zip(indices, samples or []):
            validate(index, fields)
        if progress is not None:
            progress(indices[-1] + 1, total)
    return {
        "structures": total,
        "structures_valid": checked,
        "structures_unreadable": unreadable,
        "atoms": atoms,
        "chunks": chunks,
        "problems": problems,
        "warnings": warnings,
    }


def _describe(values: np.ndarray) -> dict[str, float]:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return {}
    return {
        "mean": float(values.mean()),
        "std": float(values.std()),
        "min": float(values.min()),
        "max": float(values.max()),
    }


def _reference_energies(counts: np.ndarray, energies: np.ndarray, zs: list[int]) -> dict:
    from ase.data import chemical_symbols

    labelled = np.isfinite(energies)
    if labelled.sum() == 0:
        return {}
    solution, *_ = np.linalg.lstsq(counts[labelled], energies[labelled], rcond=None)
    residual = energies[labelled] - counts[labelled] @ solution
    atoms = counts[labelled].sum(axis=1)
    return {
        "reference_energies": {chemical_symbols[z]: float(e) for z, e in zip(zs, solution)},
        "residual_energy_per_atom": _describe(residual / atoms),
    }


def data_statistics(
    readers: Sequence[Any], *, batch_size: int = 256, progress: ProgressFn | None = None
) -> dict[str, Any]:
    """Counts, elements, label statistics and suggested reference energies of ``readers``."""
    from ase.data import chemical_symbols

    from nvalchemi.training.cli.data_sources import ChainedBatches

    total = sum(len(r) for r in readers)
    loader = ChainedBatches(readers, batch_size=batch_size)
    sizes, energies, periodic, zs_all = [], [], [], []
    composition: list[np.ndarray] = []
    force_parts, stress_parts = [], []
    labels = {"energy": 0, "forces": 0, "stress": 0}
    done = 0
    for batch in loader:
        n = batch.num_nodes_per_graph.cpu().numpy()
        z = batch.atomic_numbers.cpu().numpy()
        graph = batch.batch_idx.cpu().numpy()
        per_graph = np.zeros((len(n), 119))
        np.add.at(per_graph, (graph, z), 1)
        composition.append(per_graph)
        sizes.append(n)
        zs_all.append(z)
        if "energy" in batch:
            e = batch.energy.double().reshape(-1).cpu().numpy()
            labels["energy"] += int(np.isfinite(e).sum())
            energies.append(e)
        else:
            energies.append(np.full(len(n), np.nan))
        if "forces" in batch:
            f = batch.forces.double().cpu().numpy()
            ok = np.isfinite(f).all(axis=1)
            labels["forces"] += len(np.unique(graph[ok]))
            force_parts.append(f[ok])
        if "stress" in batch:
            s = batch.stress.double().reshape(-1, 9).cpu().numpy()
            ok = np.isfinite(s).all(axis=1)
            labels["stress"] += int(ok.sum())
            stress_parts.append(s[ok])
        if "pbc" in batch:
            periodic.append(batch.pbc.cpu().numpy().any(axis=1))
        done += len(n)
        if progress is not None:
            progress(done, total)
    if done == 0:
        raise CLIError("the data set is empty", field="PATH", fix="check the input files")
    sizes_arr = np.concatenate(sizes)
    counts = np.concatenate(composition)
    present = [int(z) for z in np.flatnonzero(counts.sum(axis=0))]
    counts = counts[:, present]
    energy = np.concatenate(energies)
    z_all = np.concatenate(zs_all)
    stats: dict[str, Any] = {
        "structures": int(done),
        "atoms": int(sizes_arr.sum()),
        "atoms_per_structure": {
            "min": int(sizes_arr.min()), "mean": float(sizes_arr.mean()),
            "max": int(sizes_arr.max()),
        },
        "periodic_structures": int(np.concatenate(periodic).sum()) if periodic else 0,
        "elements": {
            chemical_symbols[z]: {"atoms": int((z_all == z).sum()),
                                  "structures": int((counts[:, i] > 0).sum())}
            for i, z in enumerate(present)
        },
        "labels": labels,
    }  # fmt: skip
    if labels["energy"]:
        stats["energy_per_atom"] = _describe(energy / sizes_arr)
        stats.update(_reference_energies(counts, energy, present))
    if force_parts:
        forces = np.concatenate(force_parts)
        norms = np.linalg.norm(forces, axis=1)
        stats["forces"] = {
            "component_rms": float(math.sqrt((forces**2).mean())) if forces.size else 0.0,
            "max_norm": float(norms.max()) if norms.size else 0.0,
        }
    if stress_parts:
        stats["stress"] = _describe(np.concatenate(stress_parts).reshape(-1))
    return stats
