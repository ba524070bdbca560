"""What is in a data set: statistics, suggested reference energies, an end-to-end check.

* :func:`check_data` verifies a source end to end (every chunk of a zarr store, every
  structure of any file);
* :func:`data_statistics` counts structures, atoms and elements, summarizes the
  labels, and suggests per-element reference energies by least squares
  (``E ≈ Σ_Z n_Z E0[Z]``; minimum-norm solution when the compositions do not fix
  every ``E0``);
* :func:`absent_chunk_warning` explains the absent chunks of stores of an older format.

Example:
    >>> from nvalchemi.data.bundled import bundled_split_path
    >>> from nvalchemi.data.sources import open_reader
    >>> stats = data_statistics([open_reader(bundled_split_path("val"), max_structures=8)])
    >>> stats["structures"], stats["labels"]["energy"]
    (8, 8)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nvalchemi._errors import FieldError
from nvalchemi.data.close_pairs import closest_pair, describe_close_pair

__all__ = ["absent_chunk_warning", "check_data", "data_statistics", "label_counts"]

ProgressFn = Callable[[int, int], None]


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
    (:meth:`~nvalchemi.data.io.zarr.AtomicDataZarrReader.verify`; opening the store has
    already checked that pointers count up, that arrays and masks cover what they count
    and that each array holds the field, level, shape and unit it is listed as). For any
    source every structure is read and validated as ``AtomicData`` (shapes, dtypes,
    finite values, atomic numbers 1..118, neighbour indices), plus finite positions, at
    least one atom, and no two atoms closer than
    :data:`~nvalchemi.data.close_pairs.DUPLICATE_DISTANCE` (a problem) or
    :data:`~nvalchemi.data.close_pairs.IMPLAUSIBLE_DISTANCE` (a warning): positions
    swapped with another array or in the wrong units fail here.
    """
    import torch

    from nvalchemi.data.atomic_data import AtomicData
    from nvalchemi.data.io.zarr import StoreDamagedError

    problems: list[str] = []
    warnings: list[str] = []
    implausible: list[str] = []
    chunks = None
    store = _zarr_store(reader)
    if store is not None:
        report = store.verify()
        chunks = report["chunks"]
        warnings += report["warnings"]
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
        if data.num_nodes == 0:
            problems.append(f"structure {index} has no atoms")
            return
        pair = closest_pair(data.positions, data.cell, data.pbc)
        if pair is not None:
            (problems if pair.duplicate else implausible).append(
                describe_close_pair(pair, f"structure {index}")
            )
            if pair.duplicate:
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
    if implausible:
        more = f" (and {len(implausible) - 1:,} more structures)" if len(implausible) > 1 else ""
        warnings.append(implausible[0] + more)
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
    out = {"reference_energies": {chemical_symbols[z]: float(e) for z, e in zip(zs, solution)}}
    residual_per_atom = _describe(residual / atoms)
    if residual_per_atom:
        out["residual_energy_per_atom"] = residual_per_atom
    return out


def data_statistics(
    readers: Sequence[Any],
    *,
    batch_size: int = 256,
    progress: ProgressFn | None = None,
    group_by: str = "config_type",
) -> dict[str, Any]:
    """Counts, elements, label statistics and suggested reference energies of ``readers``.

    ``close_pairs`` lists the structures with two atoms closer than
    :data:`~nvalchemi.data.close_pairs.IMPLAUSIBLE_DISTANCE` (``source``, ``structure``,
    ``atoms``, ``distance`` and a sentence, ``text``): duplicate atoms, or positions in
    the wrong units. ``groups`` counts the structures of every ``group_by`` value of their
    ``atoms.info`` (``{}`` when no structure has one); ``weights`` summarises the weight
    fields (``config_weight`` and the others, :mod:`nvalchemi.data.weights`): for each, the
    structures whose weight is not 1, and the smallest and largest weight.
    """
    from ase.data import chemical_symbols

    from nvalchemi.data.groups import group_counts, info_labels
    from nvalchemi.data.sources import ChainedBatches
    from nvalchemi.data.weights import WEIGHT_FIELDS

    total = sum(len(r) for r in readers)
    starts = np.cumsum([0, *(len(r) for r in readers)])
    close_pairs: list[dict[str, Any]] = []
    loader = ChainedBatches(readers, batch_size=batch_size)
    sizes, energies, periodic, zs_all = [], [], [], []
    composition: list[np.ndarray] = []
    force_parts, stress_parts = [], []
    labels = {"energy": 0, "forces": 0, "stress": 0}
    weights: dict[str, list[np.ndarray]] = {}
    done = 0
    for batch in loader:
        for name in WEIGHT_FIELDS:
            if name in batch:
                weights.setdefault(name, []).append(batch[name].double().reshape(-1).numpy())
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
        for g, pair in _close_pairs(batch):
            k = int(np.searchsorted(starts, done + g, side="right")) - 1
            where = f"structure {done + g - int(starts[k])}"
            if len(readers) > 1:
                where = f"{_source_name(readers[k])}: {where}"
            close_pairs.append(
                {
                    "source": _source_name(readers[k]),
                    "structure": done + g - int(starts[k]),
                    "atoms": [pair.first, pair.second],
                    "distance": pair.distance,
                    "text": describe_close_pair(pair, where),
                }
            )
        done += len(n)
        if progress is not None:
            progress(done, total)
    if done == 0:
        raise FieldError("the data set is empty", field="PATH", fix="check the input files")
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
            "min": int(sizes_arr.min()),
            "mean": float(sizes_arr.mean()),
            "max": int(sizes_arr.max()),
        },
        "periodic_structures": int(np.concatenate(periodic).sum()) if periodic else 0,
        "elements": {
            chemical_symbols[z]: {
                "atoms": int((z_all == z).sum()),
                "structures": int((counts[:, i] > 0).sum()),
            }
            for i, z in enumerate(present)
        },
        "labels": labels,
        "close_pairs": close_pairs,
        "group_by": group_by,
        "groups": {},
        "weights": {},
    }
    group_labels = info_labels(readers, group_by)
    if any(label is not None for label in group_labels):
        stats["groups"] = group_counts(group_labels)
    for name, parts in weights.items():
        values = np.concatenate(parts)
        stats["weights"][name] = {
            "structures": int((values != 1.0).sum()),
            "min": float(values.min()),
            "max": float(values.max()),
        }
    if labels["energy"]:
        has_atoms = sizes_arr > 0  # a structure without atoms has no energy per atom
        per_atom = _describe(energy[has_atoms] / sizes_arr[has_atoms])
        if per_atom:
            stats["energy_per_atom"] = per_atom
            stats.update(_reference_energies(counts[has_atoms], energy[has_atoms], present))
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


def _close_pairs(batch: Any) -> list[tuple[int, Any]]:
    """``(structure in batch, ClosePair)`` for the structures with atoms too close."""
    positions = batch.positions.detach().cpu().double().numpy()
    ptr = batch.ptr.cpu().numpy()
    cells = batch.cell.detach().cpu().double().numpy() if "cell" in batch else None
    pbcs = batch.pbc.cpu().numpy() if "pbc" in batch else None
    found = []
    for g in range(len(ptr) - 1):
        pair = closest_pair(
            positions[ptr[g] : ptr[g + 1]],
            None if cells is None else cells[g],
            None if pbcs is None else pbcs[g],
        )
        if pair is not None:
            found.append((g, pair))
    return found


def _source_name(reader: Any) -> str:
    inner = getattr(reader, "reader", reader)
    paths = getattr(inner, "paths", None)
    if paths:
        return str(paths[0]) if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} files)"
    return str(getattr(inner, "store", type(inner).__name__))


def label_counts(readers: Sequence[Any], *, limit: int | None = 500) -> dict[str, int]:
    """How many structures carry each label, from the first ``limit`` of every reader.

    Returns ``{"structures": <all structures>, "scanned": ..., "energy": ..., "forces":
    ..., "stress": ...}`` (label counts among the scanned ones). Cheap enough to run
    before a job is written (``train init`` adds the stress loss when stress is found).

    Example:
        >>> from nvalchemi.data.bundled import bundled_split_path
        >>> from nvalchemi.data.sources import open_reader
        >>> counts = label_counts([open_reader(bundled_split_path("val"))], limit=20)
        >>> counts["scanned"], counts["stress"] > 0
        (20, True)
    """
    import torch

    out = {"structures": 0, "scanned": 0, "energy": 0, "forces": 0, "stress": 0}
    for reader in readers:
        out["structures"] += len(reader)
        for i in range(len(reader) if limit is None else min(limit, len(reader))):
            data = reader.read_data(i)
            out["scanned"] += 1
            for label in ("energy", "forces", "stress"):
                value = getattr(data, label, None) if label in data else None
                if isinstance(value, torch.Tensor) and bool(torch.isfinite(value).all()):
                    out[label] += 1
    return out
