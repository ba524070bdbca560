"""Neighbour lists (vesin) against ase.neighborlist, edge vectors, batches, the transform."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk, molecule
from ase.neighborlist import neighbor_list as ase_neighbor_list

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.neighbors import (
    NeighborListTransform,
    compute_neighbors,
    edge_vectors,
    has_neighbor_list,
    neighbor_list_for_system,
)


def as_set(pairs, shifts):
    return set(zip(pairs[:, 0].tolist(), pairs[:, 1].tolist(), map(tuple, shifts.tolist())))


def oracle(atoms: Atoms, cutoff: float) -> set:
    i, j, shifts = ase_neighbor_list("ijS", atoms, cutoff)
    return set(zip(i.tolist(), j.tolist(), map(tuple, shifts.tolist())))


def random_atoms(rng, n, cell, pbc, spread=1.0) -> Atoms:
    cell = np.asarray(cell, dtype=float)
    frac = rng.random((n, 3)) * spread - (spread - 1.0) / 2
    return Atoms(f"H{n}", positions=frac @ cell, cell=cell, pbc=pbc)


SKEWED = [[3.0, 0.0, 0.0], [2.6, 1.5, 0.0], [2.2, 1.1, 1.7]]
CASES = {
    "cubic": (12, np.eye(3) * 4.0, [True, True, True], 3.0),
    "skewed_triclinic": (10, SKEWED, [True, True, True], 3.5),
    "tiny_cell_sees_own_images": (1, np.eye(3) * 1.3, [True, True, True], 3.0),
    "tiny_skewed_two_atoms": (2, [[1.5, 0, 0], [1.2, 1.1, 0], [0.4, 0.3, 1.4]], [True] * 3, 2.8),
    "slab_xy": (8, [[3.0, 0, 0], [0.8, 3.2, 0], [0.3, 0.2, 9.0]], [True, True, False], 3.2),
    "wire_x": (5, [[2.0, 0, 0], [0, 6.0, 0], [0, 0, 6.0]], [True, False, False], 4.0),
    "mixed_xz": (6, [[2.5, 0, 0], [0, 7.0, 0], [0.4, 0.1, 2.7]], [True, False, True], 3.0),
    "open_box": (15, np.eye(3) * 6.0, [False, False, False], 2.5),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_full_list_matches_ase(name, seed):
    n, cell, pbc, cutoff = CASES[name]
    atoms = random_atoms(np.random.default_rng(seed), n, cell, pbc)
    pairs, shifts = neighbor_list_for_system(atoms.positions, atoms.cell.array, pbc, cutoff)
    assert pairs.dtype == np.int64 and shifts.dtype == np.int64
    assert pairs.shape[1] == 2 and shifts.shape == (pairs.shape[0], 3)
    assert as_set(pairs, shifts) == oracle(atoms, cutoff)
    assert len(as_set(pairs, shifts)) == pairs.shape[0]  # no duplicates
    assert np.all(np.diff(pairs[:, 0]) >= 0)  # sorted by sender


def test_positions_outside_the_cell_match_ase():
    rng = np.random.default_rng(3)
    atoms = random_atoms(rng, 9, SKEWED, [True, True, True], spread=3.0)
    pairs, shifts = neighbor_list_for_system(atoms.positions, atoms.cell.array, True, 3.0)
    assert as_set(pairs, shifts) == oracle(atoms, 3.0)


def test_open_boundary_molecule_without_cell():
    atoms = molecule("C6H6")
    pairs, shifts = neighbor_list_for_system(atoms.positions, None, None, 2.0)
    assert as_set(pairs, shifts) == oracle(atoms, 2.0)
    assert not shifts.any()


def test_tiny_cell_contains_self_image_pairs():
    pairs, _ = neighbor_list_for_system(np.zeros((1, 3)), np.eye(3) * 1.3, True, 3.0)
    assert (pairs[:, 0] == pairs[:, 1]).all()
    assert len(pairs) > 26  # more than one shell of images


@pytest.mark.parametrize("name", ["cubic", "tiny_cell_sees_own_images", "slab_xy", "open_box"])
def test_half_list_holds_each_pair_once(name):
    n, cell, pbc, cutoff = CASES[name]
    atoms = random_atoms(np.random.default_rng(5), n, cell, pbc)
    full = oracle(atoms, cutoff)
    pairs, shifts = neighbor_list_for_system(
        atoms.positions, atoms.cell.array, pbc, cutoff, full_list=False
    )
    half = as_set(pairs, shifts)
    reverse = {(j, i, tuple(-s for s in shift)) for i, j, shift in half}
    assert len(half) == pairs.shape[0] == len(full) // 2
    assert half | reverse == full
    assert not half & reverse


def test_displacement_convention_matches_ase_vectors():
    atoms = random_atoms(np.random.default_rng(7), 6, SKEWED, [True] * 3)
    pairs, shifts = neighbor_list_for_system(atoms.positions, atoms.cell.array, True, 3.5)
    vectors = edge_vectors(
        torch.tensor(atoms.positions),
        torch.tensor(atoms.cell.array),
        torch.from_numpy(pairs),
        torch.from_numpy(shifts),
    )
    i, j, d = ase_neighbor_list("ijD", atoms, 3.5)
    expected = {(a, b, tuple(np.round(v, 8))) for a, b, v in zip(i, j, d)}
    got = {(a, b, tuple(np.round(v, 8))) for (a, b), v in zip(pairs.tolist(), vectors.numpy())}
    assert got == expected
    assert float(vectors.norm(dim=1).max()) < 3.5


@pytest.mark.parametrize(
    "cell, pbc",
    [
        ([[2.0, 0, 0], [4.0, 0, 0], [0, 0, 5.0]], [True, True, False]),  # collinear: vesin SIGFPE
        ([[0.0, 0, 0], [0, 2.0, 0], [0, 0, 2.0]], [True, True, False]),  # zero periodic vector
        ([[2.0, 0, 0], [0, 2.0, 0], [0, 0, 0.0]], [True, True, True]),
    ],
)
def test_degenerate_periodic_cell_is_a_clear_error_not_a_crash(cell, pbc):
    with pytest.raises(ValueError, match="linearly dependent"):
        neighbor_list_for_system(np.random.rand(3, 3), cell, pbc, 3.0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        neighbor_list_for_system(np.zeros((2, 3)), None, None, 0.0)
    with pytest.raises(ValueError, match=r"\[n_atoms, 3\]"):
        neighbor_list_for_system(np.zeros((2, 2)), None, None, 1.0)
    with pytest.raises(ValueError, match=r"non-finite|failed"):
        neighbor_list_for_system(np.array([[np.nan, 0, 0], [0, 0, 0]]), None, None, 1.0)
    with pytest.raises(ValueError, match="no cell"):
        neighbor_list_for_system(np.zeros((2, 3)), None, [True, True, True], 1.0)
    pairs, shifts = neighbor_list_for_system(np.zeros((0, 3)), np.eye(3), True, 1.0)
    assert pairs.shape == (0, 2) and shifts.shape == (0, 3)


# ---------------------------------------------------------------------- batches
def crystal(seed: int, repeat=(2, 1, 1)) -> AtomicData:
    atoms = bulk("Cu", "fcc", a=3.6) * repeat
    atoms.rattle(0.05, seed=seed)
    return AtomicData.from_atoms(atoms, dtype=torch.float64)


def slab() -> AtomicData:
    atoms = random_atoms(np.random.default_rng(11), 6, CASES["slab_xy"][1], [True, True, False])
    return AtomicData.from_atoms(atoms, dtype=torch.float64)


def water() -> AtomicData:
    return AtomicData.from_atoms(molecule("H2O"), dtype=torch.float64)


@pytest.fixture
def mixed_batch() -> Batch:
    return Batch.from_data_list([crystal(0), water(), slab(), crystal(1, (1, 2, 1))])


def test_compute_neighbors_on_a_mixed_batch_matches_ase_per_system(mixed_batch):
    cutoff = 3.0
    compute_neighbors(mixed_batch, cutoff=cutoff)
    nl = mixed_batch.neighbor_list
    assert nl.dtype == torch.int64 and mixed_batch.neighbor_list_shifts.dtype == torch.int64
    counts = mixed_batch.num_edges_per_graph.tolist()
    assert sum(counts) == nl.shape[0]
    ptr = mixed_batch.ptr.tolist()
    start = 0
    for g, data in enumerate(mixed_batch.to_data_list()):
        edges = slice(start, start + counts[g])
        start += counts[g]
        local = nl[edges] - ptr[g]
        assert bool(((local >= 0) & (local < data.num_nodes)).all())
        got = as_set(local.numpy(), mixed_batch.neighbor_list_shifts[edges].numpy())
        assert got == oracle(data.to_atoms(), cutoff), f"system {g}"
    assert counts[1] == 6  # water: every pair within 3 Å, no images


def test_compute_neighbors_takes_a_neighbor_config_and_stamps_the_batch(mixed_batch):
    config = SimpleNamespace(cutoff=2.8, half_list=True, format="coo")
    compute_neighbors(mixed_batch, config=config)
    assert has_neighbor_list(mixed_batch, 2.8, half_list=True)
    assert not has_neighbor_list(mixed_batch, 2.8, half_list=False)
    assert not has_neighbor_list(mixed_batch, 3.0, half_list=True)
    full = Batch.from_data_list(mixed_batch.to_data_list())
    compute_neighbors(full, 2.8)
    assert full.num_edges == 2 * mixed_batch.num_edges


def test_stamp_is_invalidated_when_positions_change(mixed_batch):
    compute_neighbors(mixed_batch, 3.0)
    assert has_neighbor_list(mixed_batch, 3.0)
    mixed_batch.positions.add_(0.01)
    assert not has_neighbor_list(mixed_batch, 3.0)
    compute_neighbors(mixed_batch, 3.0)
    mixed_batch.positions = mixed_batch.positions.clone()
    assert not has_neighbor_list(mixed_batch, 3.0)


def test_stamped_batch_pickles_and_the_copy_keeps_a_valid_stamp(mixed_batch):
    import copy

    compute_neighbors(mixed_batch, 3.0, half_list=True)
    for clone in (pickle.loads(pickle.dumps(mixed_batch)), copy.deepcopy(mixed_batch)):
        assert torch.equal(clone.neighbor_list, mixed_batch.neighbor_list)
        assert has_neighbor_list(clone, 3.0, half_list=True)


def test_compute_neighbors_requires_a_cutoff(mixed_batch):
    with pytest.raises(ValueError, match="cutoff"):
        compute_neighbors(mixed_batch)
    with pytest.raises(ValueError, match="format"):
        compute_neighbors(mixed_batch, 3.0, format="csr")


def test_matrix_format_matches_coo(mixed_batch):
    compute_neighbors(mixed_batch, 3.0)
    coo = as_set(mixed_batch.neighbor_list.numpy(), mixed_batch.neighbor_list_shifts.numpy())
    compute_neighbors(mixed_batch, 3.0, format="matrix", max_neighbors=64)
    assert has_neighbor_list(mixed_batch, 3.0, format="matrix")
    assert has_neighbor_list(mixed_batch, 3.0, format="coo")
    matrix, counts = mixed_batch.neighbor_matrix, mixed_batch.num_neighbors
    shifts = mixed_batch.neighbor_matrix_shifts
    num_nodes = mixed_batch.num_nodes
    assert matrix.shape == (num_nodes, 64)
    got = set()
    for i in range(num_nodes):
        k = int(counts[i])
        assert bool((matrix[i, k:] == num_nodes).all())
        got |= {(i, int(j), tuple(s)) for j, s in zip(matrix[i, :k], shifts[i, :k].tolist())}
    assert got == coo
    with torch.no_grad():
        mixed_batch.positions[0] += 0.1  # both lists are now stale
    compute_neighbors(mixed_batch, 3.0, format="matrix")
    assert has_neighbor_list(mixed_batch, 3.0, format="matrix")
    assert not has_neighbor_list(mixed_batch, 3.0, format="coo")


def test_foreign_edge_fields_block_a_rebuild_but_cartesian_shifts_are_recomputed(mixed_batch):
    compute_neighbors(mixed_batch, 3.0)
    mixed_batch.add_key("bond_order", torch.ones(mixed_batch.num_edges), level="edge")
    with pytest.raises(ValueError, match="bond_order"):
        compute_neighbors(mixed_batch, 2.5)
    del mixed_batch["bond_order"]
    cart = mixed_batch.neighbor_list_shifts.double() @ torch.eye(3, dtype=torch.float64)
    mixed_batch.add_key("shifts", cart, level="edge")
    compute_neighbors(mixed_batch, 2.5)
    graph = mixed_batch.batch_idx[mixed_batch.neighbor_list[:, 0]]
    expected = torch.einsum(
        "ej,ejk->ek", mixed_batch.neighbor_list_shifts.double(), mixed_batch.cell[graph]
    )
    assert torch.allclose(mixed_batch.shifts, expected)


# ------------------------------------------------------------------- gradients
def test_edge_vectors_are_differentiable_in_positions_and_cell():
    batch = Batch.from_data_list([crystal(2), crystal(3, (1, 1, 2))])
    compute_neighbors(batch, 3.0)
    nl, shifts, batch_idx = batch.neighbor_list, batch.neighbor_list_shifts, batch.batch_idx

    def energy(positions, cell):
        vec = edge_vectors(positions, cell, nl, shifts, batch_idx)
        return torch.exp(-vec.norm(dim=1)).sum()

    positions = batch.positions.clone().requires_grad_(True)
    cell = batch.cell.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(energy, (positions, cell))
    e = energy(positions, cell)
    g_pos, g_cell = torch.autograd.grad(e, (positions, cell))
    assert g_cell.abs().sum() > 0 and g_pos.abs().sum() > 0


def test_edge_vectors_read_a_batch_and_give_stress_by_strain():
    batch = Batch.from_data_list([crystal(4)])
    compute_neighbors(batch, 3.0)
    strain = torch.zeros(3, 3, dtype=torch.float64, requires_grad=True)
    deform = torch.eye(3, dtype=torch.float64) + strain
    batch.positions = batch.positions @ deform
    batch.cell = batch.cell @ deform
    vec = edge_vectors(batch)
    energy = 0.5 * (vec.norm(dim=1) - 2.5).pow(2).sum()
    (virial,) = torch.autograd.grad(energy, strain)
    # Finite difference of one component of the strain derivative.
    eps = 1e-6
    base = Batch.from_data_list([crystal(4)])
    compute_neighbors(base, 3.0)

    def e_at(s):
        d = torch.eye(3, dtype=torch.float64) + s
        v = edge_vectors(
            base.positions @ d, base.cell @ d, base.neighbor_list, base.neighbor_list_shifts
        )
        return 0.5 * (v.norm(dim=1) - 2.5).pow(2).sum()

    s = torch.zeros(3, 3, dtype=torch.float64)
    s[0, 1] = eps
    fd = (e_at(s) - e_at(-s)) / (2 * eps)
    assert torch.allclose(virial[0, 1], fd, rtol=1e-5, atol=1e-8)


def test_edge_vectors_needs_batch_idx_for_many_cells():
    with pytest.raises(ValueError, match="batch_idx"):
        edge_vectors(
            torch.zeros(2, 3),
            torch.eye(3).repeat(2, 1, 1),
            torch.tensor([[0, 1]]),
            torch.tensor([[1, 0, 0]]),
        )


# ------------------------------------------------------------------- transform
def test_transform_stores_a_stamped_local_list_and_batches():
    transform = NeighborListTransform(SimpleNamespace(cutoff=3.0, half_list=False, format="coo"))
    samples = [transform(d, {"index": i})[0] for i, d in enumerate([crystal(5), water()])]
    for data in samples:
        assert data.info["neighbor_list_cutoff"] == 3.0
        assert oracle(data.to_atoms(), 3.0) == as_set(
            data.neighbor_list.numpy(), data.neighbor_list_shifts.numpy()
        )
    batch = Batch.from_data_list(samples)
    reference = Batch.from_data_list([crystal(5), water()])
    compute_neighbors(reference, 3.0)
    # the same edges per sender (their order within a sender is unspecified)
    assert torch.equal(batch.neighbor_list[:, 0], reference.neighbor_list[:, 0])
    assert as_set(batch.neighbor_list.numpy(), batch.neighbor_list_shifts.numpy()) == as_set(
        reference.neighbor_list.numpy(), reference.neighbor_list_shifts.numpy()
    )


def test_transform_cache_reuses_lists_for_the_same_structure_only():
    transform = NeighborListTransform(3.0, cache=True)
    first, _ = transform(crystal(6), {"index": 4})
    second, _ = transform(crystal(6), {"index": 4})
    assert transform.cache_hits == 1
    assert torch.equal(first.neighbor_list, second.neighbor_list)
    assert torch.equal(first.neighbor_list_shifts, second.neighbor_list_shifts)
    moved = crystal(7)
    third, _ = transform(moved, {"index": 4})  # same index, different structure
    assert transform.cache_hits == 1
    assert oracle(moved.to_atoms(), 3.0) == as_set(
        third.neighbor_list.numpy(), third.neighbor_list_shifts.numpy()
    )
    clone = pickle.loads(pickle.dumps(transform))
    assert clone._cache == {} and clone.cutoff == 3.0


def test_transform_passes_through_a_list_stamped_with_the_same_options(monkeypatch):
    import nvalchemi.data.neighbors as nb

    transform = NeighborListTransform(3.0)
    data, _ = transform(crystal(8), {"index": 0})
    calls = []
    monkeypatch.setattr(nb, "_run_vesin", lambda *a: calls.append(a))
    same, _ = transform(data, {"index": 0})
    assert same is data and calls == []
    data.info.clear()
    same, _ = transform(data, {"neighbor_list_cutoff": 3.0, "neighbor_list_half_list": False})
    assert calls == []  # stamp in reader metadata (zarr store)


def test_transform_rebuilds_a_list_of_another_cutoff():
    data, _ = NeighborListTransform(2.0)(crystal(9), {})
    data, _ = NeighborListTransform(3.0)(data, {})
    assert data.info["neighbor_list_cutoff"] == 3.0
    assert oracle(data.to_atoms(), 3.0) == as_set(
        data.neighbor_list.numpy(), data.neighbor_list_shifts.numpy()
    )


def test_transform_errors_name_the_sample():
    data = AtomicData(
        atomic_numbers=torch.tensor([1, 1]),
        positions=torch.zeros(2, 3),
        cell=torch.tensor([[[2.0, 0, 0], [4.0, 0, 0], [0, 0, 3.0]]]),
        pbc=torch.tensor([[True, True, False]]),
    )
    with pytest.raises(ValueError, match=r"sample 17 of a\.xyz"):
        NeighborListTransform(2.0)(data, {"index": 17, "source_file": "a.xyz"})
