"""Lists of a whole batch in one torch pass: the same lists as ASE and vesin, on every cell."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.neighborlist import neighbor_list as ase_neighbor_list

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data import _batched_neighbors as batched
from nvalchemi.data.datapipes.dataset import Dataset
from nvalchemi.data.neighbors import (
    NeighborListTransform,
    compute_neighbors,
    neighbor_list_for_system,
)

SKEWED = [[3.0, 0.0, 0.0], [2.6, 1.5, 0.0], [2.2, 1.1, 1.7]]
# (atoms, cell, pbc): skewed, tiny (atoms see their own images), mixed periodicity
CELLS = {
    "cubic": (12, np.eye(3) * 4.0, [True, True, True]),
    "skewed_triclinic": (10, SKEWED, [True, True, True]),
    "tiny_one_atom": (1, np.eye(3) * 1.3, [True, True, True]),
    "tiny_skewed_two_atoms": (2, [[1.5, 0, 0], [1.2, 1.1, 0], [0.4, 0.3, 1.4]], [True] * 3),
    "needle_cell": (3, [[0.9, 0, 0], [0, 6.0, 0], [0, 0, 6.0]], [True, True, True]),
    "slab_xy": (8, [[3.0, 0, 0], [0.8, 3.2, 0], [0.3, 0.2, 9.0]], [True, True, False]),
    "wire_x": (5, [[2.0, 0, 0], [0, 6.0, 0], [0, 0, 6.0]], [True, False, False]),
    "mixed_xz": (6, [[2.5, 0, 0], [0, 7.0, 0], [0.4, 0.1, 2.7]], [True, False, True]),
    "open_box": (15, np.eye(3) * 6.0, [False, False, False]),
}


# The CPU sends a structure to the torch pass or to vesin by cost; these pin one path.
ROUTES = {
    "torch pass": {"CPU_PASS_LIMIT": 1 << 40, "CPU_COSTS": batched.Costs(0, 0, 0, 1e9, 1e9)},
    "vesin": {"CPU_PASS_LIMIT": -1},
    "by cost": {},
}


@pytest.fixture(params=sorted(ROUTES))
def route(request, monkeypatch):
    for attr, value in ROUTES[request.param].items():
        monkeypatch.setattr(batched, attr, value)
    return request.param


@pytest.fixture
def torch_pass(monkeypatch):
    for attr, value in ROUTES["torch pass"].items():
        monkeypatch.setattr(batched, attr, value)


def random_atoms(seed: int, n: int, cell, pbc, spread: float = 1.0) -> Atoms:
    cell = np.asarray(cell, dtype=float)
    box = np.where(np.asarray(pbc)[:, None] | cell.any(1, keepdims=True), cell, 3.0 * np.eye(3))
    frac = np.random.default_rng(seed).random((n, 3)) * spread - (spread - 1.0) / 2
    return Atoms(f"H{n}", positions=frac @ box, cell=cell, pbc=pbc)


def ase_set(atoms: Atoms, cutoff: float) -> set:
    i, j, shifts = ase_neighbor_list("ijS", atoms, cutoff)
    return set(zip(i.tolist(), j.tolist(), map(tuple, shifts.tolist())))


def per_structure(batch: Batch) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each structure's (local pairs, shifts) from the batch's list."""
    counts = batch.num_edges_per_graph.tolist()
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    ptr = batch.ptr.tolist()
    out = []
    for g in range(batch.num_graphs):
        edges = slice(starts[g], starts[g + 1])
        pairs = (batch.neighbor_list[edges] - ptr[g]).numpy()
        out.append((pairs, batch.neighbor_list_shifts[edges].numpy()))
    return out


def as_set(pairs: np.ndarray, shifts: np.ndarray) -> set:
    return set(zip(pairs[:, 0].tolist(), pairs[:, 1].tolist(), map(tuple, shifts.tolist())))


def mixed_atoms(seed: int, spread: float = 1.0) -> list[Atoms]:
    return [random_atoms(seed + k, *CELLS[name], spread) for k, name in enumerate(sorted(CELLS))]


def batch_of(atoms_list: list[Atoms], dtype=torch.float64) -> Batch:
    return Batch.from_data_list([AtomicData.from_atoms(a, dtype=dtype) for a in atoms_list])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cutoff", [2.5, 3.5])
def test_one_call_gives_every_structure_the_same_list_as_ase(seed, cutoff, route):
    atoms_list = mixed_atoms(seed)
    batch = batch_of(atoms_list)
    compute_neighbors(batch, cutoff)
    for atoms, (pairs, shifts) in zip(atoms_list, per_structure(batch)):
        assert as_set(pairs, shifts) == ase_set(atoms, cutoff), atoms.cell.array.tolist()
        assert len(as_set(pairs, shifts)) == len(pairs)  # no duplicates
        assert np.all(np.diff(pairs[:, 0]) >= 0)  # sorted by sender


def test_positions_far_outside_the_cell_get_the_right_images(route):
    atoms_list = mixed_atoms(5, spread=4.0)
    batch = batch_of(atoms_list)
    compute_neighbors(batch, 3.0)
    for atoms, (pairs, shifts) in zip(atoms_list, per_structure(batch)):
        assert as_set(pairs, shifts) == ase_set(atoms, 3.0)


@pytest.mark.parametrize("seed", [0, 3])
def test_half_lists_keep_the_same_member_of_each_pair_as_vesin(seed, torch_pass):
    atoms_list = mixed_atoms(seed)
    batch = batch_of(atoms_list)
    compute_neighbors(batch, 3.0, half_list=True)
    for atoms, (pairs, shifts) in zip(atoms_list, per_structure(batch)):
        expected = neighbor_list_for_system(
            atoms.positions, atoms.cell.array, atoms.pbc, 3.0, full_list=False
        )
        assert as_set(pairs, shifts) == as_set(*expected)
        assert len(pairs) == len(expected[0])


def test_float32_batches_give_the_float64_lists(torch_pass):
    atoms_list = mixed_atoms(7)
    single, double = batch_of(atoms_list, torch.float32), batch_of(atoms_list)
    compute_neighbors(single, 3.0)
    compute_neighbors(double, 3.0)
    assert torch.equal(single.neighbor_list, double.neighbor_list)
    assert torch.equal(single.neighbor_list_shifts, double.neighbor_list_shifts)


def test_the_torch_pass_vesin_and_row_chunks_agree(monkeypatch):
    from ase.build import bulk

    big = bulk("Cu", "fcc", a=3.61, cubic=True) * (3, 3, 3)  # 108 atoms
    big.rattle(0.05, seed=1)
    atoms_list = [big, *mixed_atoms(2)]
    reference = batch_of(atoms_list)
    compute_neighbors(reference, 4.0, method="cell_list")  # vesin for everything
    runs = {
        "torch only": ROUTES["torch pass"],
        "torch in row chunks": {**ROUTES["torch pass"], "CPU_PASS_CANDIDATES": 4096},
        "vesin only": ROUTES["vesin"],
        "by cost": {},
    }
    expected = [as_set(*p) for p in per_structure(reference)]
    for name, settings in runs.items():
        with monkeypatch.context() as patch:
            for attr, value in settings.items():
                patch.setattr(batched, attr, value)
            batch = batch_of(atoms_list)
            compute_neighbors(batch, 4.0)
        got = per_structure(batch)
        assert [as_set(*p) for p in got] == expected, name
        assert all(np.all(np.diff(p[:, 0]) >= 0) for p, _ in got), name
        assert torch.equal(batch.num_edges_per_graph, reference.num_edges_per_graph), name


def test_structures_of_many_sizes_are_padded_into_groups_without_changing_their_lists(torch_pass):
    from ase.build import bulk

    atoms_list = []
    for k, repeat in enumerate([(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 1, 1), (2, 2, 2), (3, 1, 1)]):
        atoms = bulk("Ni", "fcc", a=3.52, cubic=True) * repeat
        atoms.rattle(0.04, seed=k)
        atoms_list.append(atoms)
    batch = batch_of(atoms_list)
    groups = batched.plan_groups(
        batch.num_nodes_list, [(2, 2, 2)] * 6, list(range(6)), 1 << 14, batched.CPU_COSTS
    )
    assert len(groups) > 1  # the sizes do not all fit one padded group
    compute_neighbors(batch, 4.5)
    for atoms, (pairs, shifts) in zip(atoms_list, per_structure(batch)):
        assert as_set(pairs, shifts) == ase_set(atoms, 4.5)


def test_edge_vectors_from_batched_lists_stay_differentiable(torch_pass):
    from nvalchemi.data.neighbors import edge_vectors

    batch = batch_of(mixed_atoms(4))
    compute_neighbors(batch, 3.0)
    positions = batch.positions.clone().requires_grad_(True)
    vectors = edge_vectors(
        positions, batch.cell, batch.neighbor_list, batch.neighbor_list_shifts, batch.batch_idx
    )
    assert float(vectors.detach().norm(dim=1).max()) < 3.0
    vectors.norm(dim=1).sum().backward()
    assert positions.grad is not None and torch.isfinite(positions.grad).all()


def test_non_finite_positions_are_named_not_silently_dropped(route):
    atoms_list = mixed_atoms(0)
    batch = batch_of(atoms_list)
    batch.positions[batch.ptr[3]] = float("nan")
    with pytest.raises(ValueError, match="system 3: non-finite positions"):
        compute_neighbors(batch, 3.0)


def test_a_dataset_builds_the_lists_of_each_batch_in_one_call(route):
    from nvalchemi.data.datapipes.dataloader import DataLoader

    atoms_list = mixed_atoms(1) + mixed_atoms(2)
    items = [AtomicData.from_atoms(a, dtype=torch.float64) for a in atoms_list]

    class Reader:
        validates = True

        def __len__(self):
            return len(items)

        def read_many(self, indices):
            return [(items[i], {"index": i}) for i in indices]

    transform = NeighborListTransform(3.0)
    dataset = Dataset(Reader(), transforms=[transform])
    assert dataset._batch_neighbors is transform  # run on collated batches
    loader = DataLoader(dataset, batch_size=7)
    seen = 0
    for batch in loader:
        for pairs, shifts in per_structure(batch):
            assert as_set(pairs, shifts) == ase_set(atoms_list[seen], 3.0)
            seen += 1
    assert seen == len(items)
    # one structure alone still gets its list from the per-sample path
    single = dataset[4]
    assert as_set(single.neighbor_list.numpy(), single.neighbor_list_shifts.numpy()) == ase_set(
        atoms_list[4], 3.0
    )


def test_the_cpu_sends_small_cells_to_one_pass_and_large_or_lone_tiny_ones_to_vesin():
    from nvalchemi.data.neighbors import _route

    cpu = torch.device("cpu")
    # sixteen 32-atom cells (the data-pipeline case): one pass for all of them
    groups, by_vesin = _route(cpu, "auto", [32] * 16, [(2, 2, 2)] * 16, [1400.0] * 16)
    assert [g[0] for g in groups] == [list(range(16))] and by_vesin == []
    # a lone 4-atom cell: a pass costs more than one vesin call
    assert _route(cpu, "auto", [4], [(3, 3, 3)], [170.0]) == ([], [0])
    # 256-atom cells: vesin's cell list
    assert _route(cpu, "auto", [256] * 4, [(1, 1, 1)] * 4, [11000.0] * 4) == ([], [0, 1, 2, 3])
    # on an accelerator everything stays in passes on the device
    groups, by_vesin = _route(
        torch.device("meta"), "auto", [256, 4], [(1, 1, 1), (3, 3, 3)], [0, 0]
    )
    assert by_vesin == [] and sorted(m for g in groups for m in g[0]) == [0, 1]
