"""Structures and helpers shared by the model tests (exposed as fixtures)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: threading only adds overhead (and the test machine has 2 cores).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def triclinic_cu_au():
    """A 4-atom sheared Cu/Au fcc cell (triclinic, periodic), lightly rattled."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.65) * (2, 2, 1)
    strain = np.array([[0.02, 0.04, 0.0], [0.04, -0.01, 0.03], [0.0, 0.03, 0.01]])
    atoms.set_cell(atoms.cell[:] @ (np.eye(3) + strain), scale_atoms=True)
    atoms.rattle(0.05, seed=1)
    atoms.numbers[1] = 79
    return atoms


def small_primitive_cu():
    """One atom in a primitive fcc cell: the cutoff spans many periodic images."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6)
    atoms.positions += 0.1
    return atoms


def au_slab():
    """A Au(111) slab, periodic in-plane only (pbc = T, T, F)."""
    from ase.build import fcc111

    atoms = fcc111("Au", size=(2, 2, 2), vacuum=4.0)
    atoms.rattle(0.05, seed=2)
    return atoms


def cu_cluster():
    """Four Cu atoms without a cell (open boundaries)."""
    from ase import Atoms

    rng = np.random.default_rng(0)
    return Atoms("Cu3Au", positions=rng.normal(size=(4, 3)) * 1.3)


def emt_labelled(atoms_list):
    """Copies of ``atoms_list`` with EMT energy, forces and (periodic) stress attached."""
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    out = []
    for atoms in atoms_list:
        atoms = atoms.copy()
        atoms.calc = EMT()
        results = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
        if atoms.pbc.any():
            results["stress"] = atoms.get_stress()
        atoms.calc = SinglePointCalculator(atoms, **results)
        out.append(atoms)
    return out


def batch_of(atoms_list, cutoff, dtype=torch.float64):
    """A Batch of ``atoms_list`` with full neighbour lists for ``cutoff``."""
    from nvalchemi.data import AtomicData, Batch
    from nvalchemi.data.neighbors import compute_neighbors

    batch = Batch.from_data_list([AtomicData.from_atoms(a, dtype=dtype) for a in atoms_list])
    compute_neighbors(batch, cutoff=cutoff)
    return batch


@pytest.fixture
def structures():
    """Triclinic Cu/Au cell, 1-atom primitive cell, Au slab (T, T, F), open cluster."""
    return [triclinic_cu_au(), small_primitive_cu(), au_slab(), cu_cluster()]


@pytest.fixture
def helpers():
    """The structure builders and helpers of this module, for tests that need variants."""
    return types.SimpleNamespace(
        triclinic_cu_au=triclinic_cu_au,
        small_primitive_cu=small_primitive_cu,
        au_slab=au_slab,
        cu_cluster=cu_cluster,
        emt_labelled=emt_labelled,
        batch_of=batch_of,
    )
