"""AtomicData: construction, validation, levels, copies and ASE conversion."""

import numpy as np
import pytest
import torch

from nvalchemi.data import AtomicData
from nvalchemi.data.atomic_data import (
    AtomicNumberTable,
    atomic_numbers_to_indices,
    to_one_hot,
    voigt_to_matrix,
)


def make(n=3, **kwargs):
    return AtomicData(atomic_numbers=torch.arange(1, n + 1), positions=torch.randn(n, 3), **kwargs)


def test_minimal_system_has_only_required_fields():
    data = make()
    assert data.keys() == ["atomic_numbers", "positions"]
    assert data.neighbor_list is None
    assert data.num_nodes == 3 and data.num_edges == 0
    assert data.dtype == torch.float32 and data.device.type == "cpu"


def test_missing_required_field_is_named():
    with pytest.raises(ValueError, match="positions"):
        AtomicData(atomic_numbers=torch.tensor([1]))


def test_system_fields_get_a_leading_one():
    data = make(
        energy=torch.tensor(1.5),
        cell=torch.eye(3),
        pbc=[True, True, False],
        stress=torch.zeros(3, 3),
        dipole=torch.zeros(3),
    )
    assert data.energy.shape == (1, 1)
    assert data.cell.shape == (1, 3, 3)
    assert data.pbc.shape == (1, 3) and data.pbc.dtype == torch.bool
    assert data.stress.shape == (1, 3, 3)
    assert data.dipole.shape == (1, 3)


def test_labels_keep_their_dtype():
    data = make(energy=torch.tensor([[2.0]], dtype=torch.float64), forces=torch.zeros(3, 3))
    assert data.positions.dtype == torch.float32
    assert data.energy.dtype == torch.float64


def test_index_fields_are_int64():
    data = make(neighbor_list=torch.tensor([[0, 1]], dtype=torch.int32))
    assert data.atomic_numbers.dtype == torch.int64
    assert data.neighbor_list.dtype == torch.int64


def test_float_atomic_numbers_rejected_with_field_name():
    with pytest.raises(TypeError, match="atomic_numbers"):
        AtomicData(atomic_numbers=torch.tensor([1.0]), positions=torch.zeros(1, 3))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("forces", torch.zeros(2, 3), "forces.*expected \\[n_atoms, 3\\]"),
        ("cell", torch.zeros(2, 2), "cell"),
        ("energy", torch.zeros(2), "energy"),
    ],
)
def test_wrong_shapes_are_rejected(field, value, match):
    with pytest.raises(ValueError, match=match):
        make(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("positions", torch.zeros(3, 3, dtype=torch.int64)),
        ("positions", [[0, 0, 0], [1, 0, 0], [0, 1, 0]]),  # a list of Python ints
        ("energy", torch.tensor(-3)),
        ("energy", 2),
        ("forces", torch.zeros(3, 3, dtype=torch.int32)),
        ("stress", torch.zeros(3, 3, dtype=torch.bool)),
        ("cell", torch.eye(3, dtype=torch.int64)),
    ],
)
def test_integer_positions_and_labels_are_refused_with_field_and_dtype(field, value):
    fields = {"atomic_numbers": torch.tensor([1, 2, 3]), "positions": torch.randn(3, 3)}
    fields[field] = value
    if field == "cell":
        fields["pbc"] = [True] * 3
    with pytest.raises(
        TypeError, match=rf"'{field}'.* must be floating point; got dtype torch\.\w+"
    ):
        AtomicData(**fields)


@pytest.mark.parametrize(("numbers", "bad", "index"), [([1, 0, 8], 0, 1), ([6, 8, 119], 119, 2)])
def test_atomic_numbers_outside_1_to_118_name_the_atom(numbers, bad, index):
    with pytest.raises(ValueError, match=rf"holds {bad} at atom {index}; .* 1\.\.118"):
        AtomicData(atomic_numbers=torch.tensor(numbers), positions=torch.zeros(3, 3))
    data = AtomicData(atomic_numbers=torch.tensor([1, 118]), positions=torch.zeros(2, 3))
    assert data.atomic_numbers.tolist() == [1, 118]


@pytest.mark.parametrize(
    ("field", "value", "canonical"),
    [
        ("energy", torch.tensor(1.5), (1, 1)),
        ("energy", torch.tensor([1.5]), (1, 1)),
        ("energy", torch.tensor([[1.5]]), (1, 1)),
        ("charge", 1.0, (1, 1)),
        ("dipole", torch.zeros(3), (1, 3)),
        ("stress", torch.zeros(3, 3), (1, 3, 3)),
        ("stress", torch.zeros(1, 6), (1, 3, 3)),
        ("stress", torch.arange(9.0), (1, 3, 3)),
        ("virial", torch.zeros(6), (1, 3, 3)),
        ("cell", torch.eye(3), (1, 3, 3)),
    ],
)
def test_documented_non_canonical_shapes_are_converted(field, value, canonical):
    extra = {"pbc": [True] * 3} if field == "cell" else {}
    data = make(**{field: value}, **extra)
    assert tuple(data[field].shape) == canonical


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("energy", torch.zeros(1, 1, 1), r"\[1, 1\]"),
        ("energy", torch.zeros(2, 1), r"\[1, 1\]"),
        ("dipole", torch.zeros(3, 1), r"\[1, 3\]"),
        ("stress", torch.zeros(3, 1, 3), r"\[1, 3, 3\]"),
        ("stress", torch.zeros(9, 1), r"\[1, 3, 3\]"),
        ("cell", torch.zeros(9), r"\[1, 3, 3\]"),  # Voigt/row-major only for stress, virial
        ("cell", torch.zeros(6), r"\[1, 3, 3\]"),
    ],
)
def test_every_other_label_shape_is_refused_with_the_expected_shape(field, value, expected):
    with pytest.raises(
        ValueError, match=rf"'{field}' has shape .*; expected {expected} \(accepted"
    ):
        make(**{field: value})


def test_nan_labels_rejected():
    with pytest.raises(ValueError, match="'energy' contains NaN"):
        make(energy=torch.tensor(float("nan")))
    with pytest.raises(ValueError, match="'forces' contains NaN"):
        make(forces=torch.full((3, 3), float("inf")))


def test_pbc_without_cell_rejected():
    with pytest.raises(ValueError, match="'pbc' but no 'cell'"):
        make(pbc=[True, True, True])


def test_voigt_stress_is_expanded():
    data = make(stress=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    expected = torch.tensor([[1.0, 6.0, 5.0], [6.0, 2.0, 4.0], [5.0, 4.0, 3.0]])
    assert torch.equal(data.stress[0], expected)


def test_custom_field_levels_inferred_and_explicit():
    data = make(n=4, neighbor_list=torch.tensor([[0, 1], [1, 0]]), weight=torch.tensor([2.0]))
    data.per_atom = torch.ones(4)
    data.per_edge = torch.ones(2)
    assert data.level_of("per_atom") == "atom"
    assert data.level_of("per_edge") == "edge"
    assert data.level_of("weight") == "system"
    data.add_system_property("tag", torch.tensor(3.0))
    assert data.tag.shape == (1,) and data.level_of("tag") == "system"
    other = make(n=4)
    assert "per_atom" not in other


def test_custom_field_with_unmatched_leading_dim_is_an_error():
    with pytest.raises(ValueError, match="Cannot tell the level of custom field 'x'"):
        make(n=3, x=torch.ones(5))


def test_inconsistent_counts_rejected():
    data = make(n=3)
    with pytest.raises(ValueError, match="Inconsistent number of atoms"):
        data.add_node_property("q", torch.ones(4))


def test_equality_compares_all_fields_including_labels():
    a = make(energy=torch.tensor(1.0))
    b = a.clone()
    assert a == b
    b.energy = torch.tensor(2.0)
    assert a != b
    assert a != "not data"


def test_clone_is_deep_and_keeps_custom_levels():
    a = make(weight=torch.tensor([1.0]))
    b = a.clone()
    b.positions.add_(1.0)
    assert not torch.equal(a.positions, b.positions)
    assert b.level_of("weight") == "system"


def test_to_casts_floats_only():
    a = make(energy=torch.tensor(1.0))
    b = a.to(dtype=torch.float64)
    assert b.positions.dtype == torch.float64 and b.energy.dtype == torch.float64
    assert b.atomic_numbers.dtype == torch.int64
    assert a.positions.dtype == torch.float32


def test_mapping_access_and_iteration():
    a = make()
    assert a["positions"] is a.positions
    a["forces"] = torch.zeros(3, 3)
    assert "forces" in a
    assert dict(iter(a)).keys() == {"atomic_numbers", "positions", "forces"}
    del a.forces
    assert "forces" not in a


def test_masses_are_derived_from_atomic_numbers():
    data = AtomicData(atomic_numbers=torch.tensor([1, 8]), positions=torch.zeros(2, 3))
    assert torch.allclose(data.atomic_masses, torch.tensor([1.008, 15.999]), atol=1e-3)


def test_chemical_hash_depends_on_structure_not_labels():
    a = make(energy=torch.tensor(1.0))
    b = a.clone()
    b.energy = torch.tensor(5.0)
    assert a.chemical_hash == b.chemical_hash
    b.positions = b.positions + 1
    assert a.chemical_hash != b.chemical_hash


def test_pickle_round_trip():
    import pickle

    a = make(energy=torch.tensor(1.0), weight=torch.tensor([1.0]))
    b = pickle.loads(pickle.dumps(a))
    assert a == b and b.level_of("weight") == "system"


def test_from_atoms_reads_info_arrays_and_calculator():
    from ase.build import bulk
    from ase.calculators.emt import EMT

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.rattle(0.05, seed=1)
    atoms.calc = EMT()
    energy = atoms.get_potential_energy()
    forces = atoms.get_forces()
    stress = atoms.get_stress(voigt=False)
    data = AtomicData.from_atoms(atoms, dtype=torch.float64)
    assert data.energy.item() == pytest.approx(energy)
    assert np.allclose(data.forces.numpy(), forces)
    assert np.allclose(data.stress[0].numpy(), stress)
    assert data.pbc.all() and data.cell.shape == (1, 3, 3)

    back = data.to_atoms()
    assert back.get_potential_energy() == pytest.approx(energy)
    assert np.allclose(back.get_stress(voigt=False), stress)
    assert np.allclose(back.cell.array, atoms.cell.array)


def test_from_atoms_ignores_calculator_results_of_an_old_geometry():
    from ase.build import bulk
    from ase.calculators.emt import EMT

    atoms = bulk("Cu", "fcc", a=3.6) * (2, 2, 2)
    atoms.calc = EMT()
    atoms.get_forces()
    atoms.rattle(0.1, seed=3)  # the calculator still holds the unrattled results
    stale = AtomicData.from_atoms(atoms, dtype=torch.float64)
    assert stale.energy is None and stale.forces is None and stale.stress is None
    assert "energy" in atoms.calc.results  # reading did not clear the user's calculator

    energy = atoms.get_potential_energy()  # recomputed for the rattled geometry
    fresh = AtomicData.from_atoms(atoms, dtype=torch.float64)
    assert fresh.energy.item() == pytest.approx(energy)
    assert np.allclose(fresh.forces.numpy(), atoms.get_forces())


def test_from_atoms_converts_labels_to_label_dtype():
    from ase.build import bulk
    from ase.calculators.emt import EMT

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.calc = EMT()
    atoms.get_forces()
    default = AtomicData.from_atoms(atoms)
    assert default.energy.dtype == torch.float32 and default.forces.dtype == torch.float32
    kept = AtomicData.from_atoms(atoms, label_dtype=torch.float64)
    assert kept.positions.dtype == torch.float32 and kept.energy.dtype == torch.float64


def test_from_atoms_molecule_has_no_cell_and_keeps_info():
    from ase.build import molecule

    atoms = molecule("H2O")
    atoms.info["energy"] = -14.0
    atoms.info["tag"] = 3
    atoms.info["name"] = "water"
    data = AtomicData.from_atoms(atoms)
    assert data.cell is None and data.pbc is None
    assert data.energy.item() == pytest.approx(-14.0)
    assert data.info["tag"] == 3 and data.info["name"] == "water"
    assert "energy" not in data.info


def test_from_atoms_rejects_degenerate_periodic_cell():
    from ase import Atoms

    atoms = Atoms("H", positions=[[0, 0, 0]], cell=[1, 1, 0], pbc=[True, True, False])
    with pytest.raises(ValueError, match="degenerate cell"):
        AtomicData.from_atoms(atoms)


def test_helpers():
    table = AtomicNumberTable([1, 6, 8])
    assert table.z_to_index(8) == 2 and str(table) == "AtomicNumberTable: (1, 6, 8)"
    with pytest.raises(ValueError):
        table.z_to_index(7)
    assert atomic_numbers_to_indices(np.array([8, 1]), table).tolist() == [2, 0]
    assert to_one_hot(torch.tensor([[2], [0]]), 3).tolist() == [[0, 0, 1], [1, 0, 0]]
    assert voigt_to_matrix(torch.arange(9.0)).shape == (3, 3)
    with pytest.raises(ValueError, match="Voigt"):
        voigt_to_matrix(torch.zeros(4))
