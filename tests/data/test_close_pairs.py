"""closest_pair: the closest two atoms of a structure, periodic images included."""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms

from nvalchemi.data.close_pairs import (
    DUPLICATE_DISTANCE,
    IMPLAUSIBLE_DISTANCE,
    closest_pair,
    describe_close_pair,
)


def _reference(atoms):
    d = atoms.get_all_distances(mic=bool(atoms.pbc.any()))
    np.fill_diagonal(d, np.inf)
    i, j = np.unravel_index(np.argmin(d), d.shape)
    return sorted((int(i), int(j))), float(d[i, j])


@pytest.mark.parametrize("pbc", [(True, True, True), (True, True, False), (False,) * 3])
def test_a_pair_planted_across_the_cell_boundary_is_found_as_ase_measures_it(pbc):
    rng = np.random.default_rng(0)
    cell = np.array([[7.0, 0.0, 0.0], [2.0, 6.5, 0.0], [1.0, 1.5, 8.0]])  # triclinic
    frac = rng.random((20, 3)) * 0.8 + 0.1
    frac[0] = [0.002, 0.5, 0.5]
    frac[7] = [0.996, 0.5, 0.5]  # across the boundary of a periodic axis: 0.042 Å away
    atoms = Atoms("Cu20", scaled_positions=frac, cell=cell, pbc=pbc)
    pair = closest_pair(atoms.positions, atoms.cell.array, atoms.pbc, below=10.0)
    expected_pair, expected = _reference(atoms)
    assert [pair.first, pair.second] == expected_pair
    assert pair.distance == pytest.approx(expected, abs=1e-9)
    assert pair.duplicate == (expected < DUPLICATE_DISTANCE)


def test_a_cluster_in_a_large_box_and_a_cell_too_small_for_its_atom():
    cluster = Atoms("Au3", positions=[[100, 100, 100], [102.5, 100, 100], [100, 102.4, 100]])
    cluster.set_cell(np.eye(3) * 200.0)
    cluster.pbc = True
    assert closest_pair(cluster.positions, cluster.cell.array, cluster.pbc) is None
    far = closest_pair(cluster.positions, cluster.cell.array, cluster.pbc, below=3.0)
    assert (far.first, far.second) == (0, 2) and far.distance == pytest.approx(2.4)
    tiny = closest_pair(np.zeros((1, 3)), np.eye(3) * 0.3, [True] * 3)
    assert (tiny.first, tiny.second, tiny.distance) == (0, 0, pytest.approx(0.3))
    assert "its own periodic image" in describe_close_pair(tiny, "structure 0")


def test_nothing_below_the_floor_and_structures_left_to_other_checks():
    assert closest_pair(np.array([[0.0, 0, 0], [IMPLAUSIBLE_DISTANCE, 0, 0]])) is None
    assert closest_pair(np.zeros((0, 3))) is None
    assert closest_pair(np.array([[0.0, 0, 0], [np.nan, 0, 0]])) is None
    assert closest_pair(np.zeros((2, 3)), np.zeros((3, 3)), [True] * 3) is None  # no cell
