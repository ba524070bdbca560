"""Data statistics that set a model's data-dependent constructor arguments.

Every function accepts an ``AtomicData``, a ``Batch``, an ``ase.Atoms``, or any
iterable of those (a list, a dataset, a DataLoader) and returns plain Python values
that are passed to the model constructor, so the model stays fully described by its
keyword arguments.

Example:
    >>> from ase.build import bulk
    >>> from ase.calculators.emt import EMT
    >>> structures = []
    >>> for n, el in [(1, "Cu"), (2, "Cu"), (1, "Au")]:
    ...     atoms = bulk(el, "fcc") * (n, 1, 1)
    ...     atoms.calc = EMT()
    ...     atoms.get_potential_energy()
    ...     structures.append(atoms)
    >>> sorted(fit_atomic_energies(structures))
    [29, 79]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "atomic_number",
    "composition_and_energy",
    "data_elements",
    "element_counts",
    "fit_atomic_energies",
    "fit_scale_shift",
    "mean_num_neighbors",
    "solve_atomic_energies",
]

_MAX_Z = 119


def atomic_number(key: int | str) -> int:
    """An atomic number from ``29``, ``"29"`` or ``"Cu"``."""
    if isinstance(key, str) and not key.strip().isdigit():
        from ase.data import atomic_numbers

        if key not in atomic_numbers:
            raise ValueError(f"{key!r} is neither an atomic number nor a chemical symbol.")
        return atomic_numbers[key]
    return int(key)


@dataclass
class _Chunk:
    """One structure or batch, reduced to what the statistics need (CPU, float64)."""

    atomic_numbers: torch.Tensor  # [V]
    batch_idx: torch.Tensor  # [V]
    num_graphs: int
    energy: torch.Tensor | None  # [B]
    forces: torch.Tensor | None  # [V, 3]
    source: Any


def _chunk(item: Any) -> _Chunk:
    if type(item).__name__ == "Atoms" and hasattr(item, "get_chemical_symbols"):
        from nvalchemi.data.atomic_data import AtomicData

        item = AtomicData.from_atoms(item, dtype=torch.float64)
    z = item["atomic_numbers"].detach().cpu().long()
    num_graphs = getattr(item, "num_graphs", None)
    if num_graphs is None:
        batch_idx, num_graphs = torch.zeros_like(z), 1
    else:
        batch_idx = item.batch_idx.detach().cpu()
    energy = getattr(item, "energy", None)
    forces = getattr(item, "forces", None)
    return _Chunk(
        z,
        batch_idx,
        int(num_graphs),
        None if energy is None else energy.detach().cpu().double().reshape(-1),
        None if forces is None else forces.detach().cpu().double(),
        item,
    )


def _chunks(data: Any) -> Iterator[_Chunk]:
    if hasattr(data, "positions") and (
        hasattr(data, "get_chemical_symbols") or "atomic_numbers" in data
    ):
        yield _chunk(data)
        return
    try:
        if hasattr(data, "__len__") and not hasattr(data, "__iter__"):
            # A map-style dataset: index it (iter() would rely on IndexError at the end).
            iterator = (data[i] for i in range(len(data)))
        else:
            iterator = iter(data)
    except TypeError:
        raise TypeError(
            f"Expected AtomicData, Batch, ase.Atoms or an iterable of them; got "
            f"{type(data).__name__}."
        ) from None
    for item in iterator:
        yield _chunk(item)


def element_counts(
    atomic_numbers: torch.Tensor, batch_idx: torch.Tensor, num_graphs: int
) -> torch.Tensor:
    """How many atoms of each element every structure has: float64 ``[B, 120]`` (by Z).

    Example:
        >>> counts = element_counts(torch.tensor([29, 29, 79]), torch.tensor([0, 0, 1]), 2)
        >>> counts[0, 29].item(), counts[1, 79].item(), counts[1, 29].item()
        (2.0, 1.0, 0.0)
    """
    z = atomic_numbers.detach().cpu().long()
    out = torch.zeros(num_graphs, _MAX_Z + 1, dtype=torch.float64)
    out.index_put_(
        (batch_idx.detach().cpu().long(), z),
        torch.ones(z.shape[0], dtype=torch.float64),
        accumulate=True,
    )
    return out


def composition_and_energy(
    data: Any, elements: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Element counts ``[S, len(elements)]`` and energies ``[S]`` of every labelled structure.

    ``elements`` (default: those present) names the columns, in sorted order; an
    element in the data but not in ``elements`` raises ``ValueError``.
    """
    counts, energies = [], []
    zs = elements
    for chunk in _chunks(data):
        if chunk.energy is None:
            continue
        per_graph = element_counts(chunk.atomic_numbers, chunk.batch_idx, chunk.num_graphs)
        keep = torch.isfinite(chunk.energy)
        counts.append(per_graph[keep])
        energies.append(chunk.energy[keep])
    if not counts or sum(len(e) for e in energies) == 0:
        raise ValueError(
            "No structure in the data has an energy label; cannot fit reference energies."
        )
    counts_all = torch.cat(counts)
    present = torch.nonzero(counts_all.sum(0)).flatten().tolist()
    zs = present if zs is None else sorted({int(z) for z in zs})
    missing = sorted(set(present) - set(zs))
    if missing:
        raise ValueError(f"The data contains elements {missing} that are not in {list(zs)}.")
    return counts_all[:, zs], torch.cat(energies), list(zs)


def data_elements(data: Any) -> list[int]:
    """Sorted atomic numbers present in ``data``."""
    seen = torch.zeros(_MAX_Z + 1, dtype=torch.bool)
    for chunk in _chunks(data):
        seen[chunk.atomic_numbers] = True
    return torch.nonzero(seen).flatten().tolist()


def fit_atomic_energies(
    data: Any,
    elements: Sequence[int] | None = None,
    *,
    fixed: Mapping[int | str, float] | None = None,
) -> dict[int, float]:
    """Reference energies ``{Z: E0}`` (eV) by least squares of energies on element counts.

    ``E_total ~ sum_Z count_Z * E0[Z]`` over every structure with an energy label. When
    the compositions do not determine every ``E0`` (e.g. an element that only appears
    in a fixed ratio) the minimum-norm solution is returned. Elements in ``elements``
    but absent from the data get 0. ``fixed`` (atomic number or symbol -> eV) holds
    those elements at the given values and fits the others.
    """
    counts, energies, zs = composition_and_energy(data, elements)
    return solve_atomic_energies(counts, energies, zs, fixed=fixed)


def solve_atomic_energies(
    counts: torch.Tensor,
    energies: torch.Tensor,
    elements: Sequence[int],
    *,
    fixed: Mapping[int | str, float] | None = None,
) -> dict[int, float]:
    """Least-squares ``{Z: E0}`` for ``energies [S] ~ counts [S, len(elements)] @ E0``.

    Elements in ``fixed`` keep their given values (their share is subtracted first);
    the others are fitted (minimum-norm where the compositions leave them open; 0 for
    an element no structure contains). Float64 throughout.

    Example:
        >>> counts = torch.tensor([[1.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
        >>> energies = torch.tensor([-1.0, -5.0], dtype=torch.float64)
        >>> fit = solve_atomic_energies(counts, energies, [29, 79])
        >>> {z: round(e, 9) for z, e in fit.items()}
        {29: -1.0, 79: -2.0}
        >>> fit = solve_atomic_energies(counts, energies, [29, 79], fixed={"Cu": -3.0})
        >>> {z: round(e, 9) for z, e in fit.items()}
        {29: -3.0, 79: -1.0}
    """
    zs = [int(z) for z in elements]
    counts = counts.to(torch.float64)
    target = energies.to(torch.float64).reshape(-1)
    held = {atomic_number(z): float(e) for z, e in (fixed or {}).items()}
    held = {z: e for z, e in held.items() if z in zs}
    free = [i for i, z in enumerate(zs) if z not in held]
    if held:
        columns = [zs.index(z) for z in held]
        values = torch.tensor(list(held.values()), dtype=torch.float64)
        target = target - counts[:, columns] @ values
    out = dict(held)
    if free:
        present = [i for i in free if bool(counts[:, i].any())]
        solution = (
            torch.linalg.lstsq(counts[:, present], target.unsqueeze(-1), driver="gelsd")
            .solution.flatten()
            .tolist()
            if present
            else []
        )
        fitted = dict(zip(present, solution))
        for i in free:
            out[zs[i]] = float(fitted.get(i, 0.0))
    return {z: out[z] for z in zs}


def fit_scale_shift(
    data: Any, atomic_energies: Mapping[int, float] | None = None
) -> tuple[float, float]:
    """``(scale, shift)`` for a per-atom energy ``scale * NN + shift + E0[Z]``.

    ``atomic_energies`` maps atomic numbers or chemical symbols to ``E0`` (eV).

    ``shift`` is the mean per-atom energy left after subtracting ``E0`` (0 without
    energy labels). ``scale`` is the root mean square of the force components when
    the data has forces, else the standard deviation of that per-atom residual; it
    is 1.0 when neither can be measured.
    """
    e0 = torch.zeros(_MAX_Z + 1, dtype=torch.float64)
    for z, value in (atomic_energies or {}).items():
        e0[atomic_number(z)] = float(value)
    residuals, force_sq, force_count = [], 0.0, 0
    for chunk in _chunks(data):
        if chunk.forces is not None:
            finite = torch.isfinite(chunk.forces)
            force_sq += float((chunk.forces[finite] ** 2).sum())
            force_count += int(finite.sum())
        if chunk.energy is not None:
            natoms = torch.bincount(chunk.batch_idx, minlength=chunk.num_graphs).double()
            reference = torch.zeros(chunk.num_graphs, dtype=torch.float64).index_add_(
                0, chunk.batch_idx, e0[chunk.atomic_numbers]
            )
            per_atom = (chunk.energy - reference) / natoms
            residuals.append(per_atom[torch.isfinite(per_atom)])
    residual = torch.cat(residuals) if residuals else torch.zeros(0, dtype=torch.float64)
    shift = float(residual.mean()) if residual.numel() else 0.0
    if force_count:
        scale = (force_sq / force_count) ** 0.5
    elif residual.numel() > 1:
        scale = float(residual.std())
    else:
        scale = 1.0
    return (scale if scale > 1e-12 else 1.0), shift


def mean_num_neighbors(data: Any, cutoff: float) -> float | None:
    """Average number of neighbours within ``cutoff`` per atom, from the neighbour lists
    the data carries; ``None`` when it carries none."""
    from nvalchemi.data.neighbors import edge_vectors

    edges, atoms = 0, 0
    for chunk in _chunks(data):
        item = chunk.source
        if "neighbor_list" not in item:
            continue
        shifts = getattr(item, "neighbor_list_shifts", None)
        cell = getattr(item, "cell", None)
        vectors = edge_vectors(
            item["positions"].detach().double(),
            None if cell is None else cell.detach().double(),
            item["neighbor_list"],
            shifts,
            chunk.batch_idx.to(item["positions"].device),
        )
        edges += int((vectors.norm(dim=-1) < cutoff).sum())
        atoms += chunk.atomic_numbers.shape[0]
    return edges / atoms if atoms else None
