"""Data utilities behind ``data convert`` and ``data stats``.

* :func:`convert_to_zarr` streams extxyz / ASE db structures into an
  ``AtomicDataZarrWriter`` store in chunks (optionally with neighbour lists for a
  cutoff, so training need not build them), reporting progress;
* :func:`data_statistics` counts structures, atoms and elements, summarizes the
  labels, and suggests per-element reference energies by least squares
  (``E ≈ Σ_Z n_Z E0[Z]``; minimum-norm solution when the compositions do not fix
  every ``E0``).

Example:
    >>> stats = data_statistics([])  # doctest: +SKIP
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nvalchemi.training.cli._errors import CLIError

__all__ = ["convert_to_zarr", "data_statistics", "open_inputs", "prepare_output"]

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


def prepare_output(output: str | Path, *, overwrite: bool) -> Path:
    """``output`` ready to be written (``CLIError`` if it exists and not ``overwrite``)."""
    output = Path(output)
    if output.exists():
        if not overwrite:
            raise CLIError(
                f"{output} already exists",
                field="OUTPUT",
                fix="choose a new path or pass --overwrite",
            )
        shutil.rmtree(output) if output.is_dir() else output.unlink()
    return output


def convert_to_zarr(
    readers: Sequence[Any],
    output: str | Path,
    *,
    cutoff: float | None = None,
    half_list: bool = False,
    chunk_size: int = 256,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Write every structure of ``readers`` to a new zarr store ``output``; return a summary.

    Readers are closed afterwards.
    """
    from nvalchemi.data.io.zarr import AtomicDataZarrWriter
    from nvalchemi.data.neighbors import NeighborListTransform

    transform = None if cutoff is None else NeighborListTransform(cutoff, half_list=half_list)
    total = sum(len(r) for r in readers)
    writer = AtomicDataZarrWriter(str(output))
    done, atoms, edges, first = 0, 0, 0, True
    try:
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
    finally:
        for reader in readers:
            reader.close()
    summary = {"output": str(output), "structures": done, "atoms": atoms}
    if cutoff is not None:
        summary.update({"neighbor_cutoff": float(cutoff), "edges": edges})
    return summary


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
