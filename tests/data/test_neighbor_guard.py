"""The neighbour-list explosion guard: a cell in the wrong units is refused, named, everywhere."""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.singlepoint import SinglePointCalculator

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.io.ase import ASEReader, write_extxyz
from nvalchemi.data.neighbors import (
    MAX_PAIRS_ENV,
    NeighborListTransform,
    check_neighbor_explosion,
    compute_neighbors,
    neighbor_list_for_system,
)

# What a new user tries: a 2-atom cubic cell of 0.02 Å edge (nm typed as Å, twice).
TINY_EDGE = 0.02
CUTOFF = 5.0
CAUSE = "wrong units"


def tiny_atoms(edge: float = TINY_EDGE) -> Atoms:
    atoms = Atoms("Cu2", positions=[[0, 0, 0], [edge / 2] * 3], cell=np.eye(3) * edge, pbc=True)
    atoms.calc = SinglePointCalculator(atoms, energy=-1.0, forces=np.zeros((2, 3)))
    return atoms


def good_atoms(seed: int) -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True)
    atoms.rattle(0.05, seed=seed)
    atoms.calc = SinglePointCalculator(atoms, energy=-3.0, forces=np.zeros((4, 3)))
    return atoms


def assert_named(message: str, *parts: str) -> None:
    for part in (*parts, "[[0.02, 0.0, 0.0]", CAUSE, MAX_PAIRS_ENV):
        assert part in message, (part, message)


@pytest.fixture
def extxyz_with_a_tiny_frame(tmp_path):
    path = tmp_path / "mixed.extxyz"
    write_extxyz(path, [AtomicData.from_atoms(a) for a in (good_atoms(0), good_atoms(1))])
    from ase.io import write

    write(path, tiny_atoms(), format="extxyz", append=True)
    return path


def test_the_reader_refuses_the_frame_naming_file_frame_cell_and_cause(extxyz_with_a_tiny_frame):
    reader = ASEReader(extxyz_with_a_tiny_frame, cache_dir=extxyz_with_a_tiny_frame.parent)
    assert reader.read_data(1).num_nodes == 4  # good frames read as before
    with pytest.raises(ValueError) as caught:
        reader.read_data(2)
    assert_named(str(caught.value), str(extxyz_with_a_tiny_frame), "frame 2")


@pytest.mark.parametrize("edge", [TINY_EDGE, 0.001])
def test_builders_refuse_before_allocating(edge):
    atoms = tiny_atoms(edge)
    with pytest.raises(ValueError, match="refusing to build a neighbour list"):
        neighbor_list_for_system(atoms.positions, atoms.cell.array, atoms.pbc, CUTOFF)
    batch = Batch.from_data_list(
        [AtomicData.from_atoms(good_atoms(0)), AtomicData.from_atoms(atoms)]
    )
    with pytest.raises(ValueError, match="compute_neighbors: system 1: refusing"):
        compute_neighbors(batch, CUTOFF)


def test_the_loader_transform_names_the_source_file_and_frame():
    data = AtomicData.from_atoms(tiny_atoms())
    data.info.update(source_file="train.extxyz", frame=7)
    with pytest.raises(ValueError) as caught:
        NeighborListTransform(CUTOFF)(data, {"index": 3})
    assert_named(str(caught.value), "sample 3 of train.extxyz, frame 7")


def test_a_dataset_batch_names_the_structure():
    from nvalchemi.data.datapipes.dataset import Dataset

    items = [AtomicData.from_atoms(a) for a in (good_atoms(0), tiny_atoms(), good_atoms(1))]

    class Reader:
        validates = True

        def __len__(self):
            return len(items)

        def read_many(self, indices):
            return [
                (items[i], {"index": i, "source_file": "x.extxyz", "frame": i}) for i in indices
            ]

    dataset = Dataset(Reader(), transforms=[NeighborListTransform(CUTOFF)])
    with pytest.raises(ValueError) as caught:
        dataset.load_batches([[0, 1, 2]])
    assert_named(str(caught.value), "structure 1 (x.extxyz, frame 1)")


def test_neighbor_list_hook_refuses_the_batch():
    from types import SimpleNamespace

    from nvalchemi.hooks.neighbor_list import NeighborListHook

    batch = Batch.from_data_list([AtomicData.from_atoms(tiny_atoms())])
    hook = NeighborListHook(CUTOFF)
    with pytest.raises(ValueError, match="system 0: refusing"):
        hook(SimpleNamespace(batch=batch))


def test_the_calculator_refuses_the_structure():
    from nvalchemi.models.calculator import NvalchemiCalculator
    from nvalchemi.models.painn import PaiNN

    model = PaiNN(cutoff=CUTOFF, hidden_channels=8, num_interactions=1, num_rbf=4)
    atoms = tiny_atoms()
    atoms.calc = NvalchemiCalculator(model)
    with pytest.raises(ValueError) as caught:
        atoms.get_potential_energy()
    assert_named(str(caught.value), "NvalchemiCalculator")


def test_data_convert_stops_at_the_frame(extxyz_with_a_tiny_frame, tmp_path):
    from nvalchemi.data.convert import convert_to_zarr

    reader = ASEReader(extxyz_with_a_tiny_frame, cache_dir=tmp_path)
    with pytest.raises(ValueError) as caught:
        convert_to_zarr([reader], tmp_path / "out.zarr", cutoff=CUTOFF)
    assert_named(str(caught.value), str(extxyz_with_a_tiny_frame), "frame 2")


def test_the_limit_is_configurable(monkeypatch):
    atoms = Atoms("H2", positions=[[0, 0, 0], [0.2, 0.2, 0.2]], cell=np.eye(3) * 0.6, pbc=True)
    estimate = check_neighbor_explosion(atoms, CUTOFF)  # a dense but small list passes
    assert 1e3 < estimate < 1e5
    with pytest.raises(ValueError, match="limit 1e\\+03"):
        check_neighbor_explosion(atoms, CUTOFF, max_pairs=1e3)
    monkeypatch.setenv(MAX_PAIRS_ENV, "1000")
    with pytest.raises(ValueError, match="refusing"):
        neighbor_list_for_system(atoms.positions, atoms.cell.array, atoms.pbc, CUTOFF)
    monkeypatch.setenv(MAX_PAIRS_ENV, "lots")
    with pytest.raises(ValueError, match=f"{MAX_PAIRS_ENV}='lots' is not a number"):
        check_neighbor_explosion(atoms, CUTOFF)


def test_the_estimate_is_close_for_real_cells_and_spares_large_honest_structures():
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True) * (3, 3, 3)
    atoms.rattle(0.05, seed=0)
    actual = len(neighbor_list_for_system(atoms.positions, atoms.cell.array, True, CUTOFF)[0])
    estimate = check_neighbor_explosion(atoms, CUTOFF)
    assert 0.8 * actual < estimate < 1.25 * actual
    # a 40,000-atom open cluster at liquid density: N^2 is 1.6e9, the estimate is not
    rng = np.random.default_rng(0)
    side = (40_000 / 0.08) ** (1 / 3)
    cluster = {"positions": rng.random((40_000, 3)) * side}
    assert check_neighbor_explosion(cluster, CUTOFF) < 1e7


def test_degenerate_cells_keep_their_own_error():
    atoms = Atoms("H2", positions=[[0, 0, 0], [0.5, 0, 0]], cell=[[2, 0, 0], [4, 0, 0], [0, 0, 3]])
    with pytest.raises(ValueError, match="linearly dependent"):
        neighbor_list_for_system(atoms.positions, atoms.cell.array, [True, True, False], CUTOFF)


def test_bundled_structures_all_pass_the_reading_check():
    from nvalchemi.data.bundled import bundled_split_path

    reader = ASEReader(bundled_split_path("val"))
    for i in range(len(reader)):
        reader.read_data(i)
