"""The export contract: ``Potential`` (eager), ``neighbor_inputs`` and the exported model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvalchemi.data.neighbors import neighbor_list_for_system
from nvalchemi.models import NvalchemiCalculator, PaiNN
from nvalchemi.models.export import Potential, neighbor_inputs

TIGHT = {"rtol": 1e-10, "atol": 1e-12}


def _painn(dtype=torch.float64, **kwargs):
    torch.manual_seed(0)
    params = {
        "cutoff": 4.0,
        "hidden_channels": 16,
        "num_interactions": 2,
        "num_rbf": 8,
        "elements": [29, 79],
        "atomic_energies": {29: -3.0, 79: -2.5},
        "scale": 0.3,
        "dtype": dtype,
        "active_outputs": ("energy", "forces", "stress"),
    }
    return PaiNN(**{**params, **kwargs})


def contract_inputs(atoms, cutoff, dtype=torch.float64):
    """The contract's inputs of one ``ase.Atoms``."""
    inputs = {
        "positions": torch.tensor(atoms.positions, dtype=dtype),
        "atomic_numbers": torch.tensor(atoms.numbers, dtype=torch.long),
        "cell": torch.tensor(atoms.cell.array, dtype=dtype),
        "pbc": torch.tensor(atoms.pbc, dtype=torch.bool),
    }
    inputs.update(neighbor_inputs(**inputs, cutoff=cutoff))
    return inputs


def batched_inputs(atoms_list, cutoff, dtype=torch.float64):
    """The contract's batched inputs of several ``ase.Atoms``."""
    inputs = {
        "positions": torch.tensor(np.concatenate([a.positions for a in atoms_list]), dtype=dtype),
        "atomic_numbers": torch.tensor(np.concatenate([a.numbers for a in atoms_list])),
        "cell": torch.tensor(np.stack([a.cell.array for a in atoms_list]), dtype=dtype),
        "pbc": torch.tensor(np.stack([a.pbc for a in atoms_list])),
        "batch": torch.repeat_interleave(
            torch.arange(len(atoms_list)), torch.tensor([len(a) for a in atoms_list])
        ),
    }
    inputs.update(neighbor_inputs(**inputs, cutoff=cutoff))
    return inputs


def _slab_with_volume(helpers):
    return helpers.au_slab()  # pbc T, T, F with vacuum: a cell with volume


def _cases(helpers):
    return {
        "periodic": helpers.triclinic_cu_au(),
        "primitive": helpers.small_primitive_cu(),
        "slab": _slab_with_volume(helpers),
        "molecule": helpers.cu_cluster(),
    }


# ------------------------------------------------------------------ neighbor_inputs
def test_neighbor_inputs_are_vesins_full_list_with_cartesian_shifts(helpers):
    for atoms in _cases(helpers).values():
        inputs = contract_inputs(atoms, 4.0)
        periodic = atoms.pbc.any()
        pairs, images = neighbor_list_for_system(
            atoms.positions,
            atoms.cell.array if periodic else None,
            atoms.pbc if periodic else None,
            4.0,
        )
        assert inputs["edge_index"].dtype == torch.long
        np.testing.assert_array_equal(inputs["edge_index"].numpy(), pairs.T)
        expected = images @ atoms.cell.array if periodic else np.zeros_like(images, float)
        np.testing.assert_allclose(inputs["shifts"].numpy(), expected, atol=1e-12)
        # the contract's vector of every edge is shorter than the cutoff
        i, j = inputs["edge_index"]
        vectors = inputs["positions"][j] - inputs["positions"][i] + inputs["shifts"]
        assert float(vectors.norm(dim=1).max()) < 4.0
        # both directions of every pair are present
        shifts = np.round(inputs["shifts"].numpy(), 6) + 0.0  # + 0.0: no -0.0
        forward = sorted(zip(i.tolist(), j.tolist(), map(tuple, shifts)))
        backward = sorted(zip(j.tolist(), i.tolist(), map(tuple, -shifts + 0.0)))
        assert forward == backward


def test_neighbor_inputs_of_a_batch_are_each_systems_list_offset(helpers):
    atoms_list = list(_cases(helpers).values())
    inputs = batched_inputs(atoms_list, 4.0)
    start, edges = 0, 0
    for atoms in atoms_list:
        alone = contract_inputs(atoms, 4.0)
        count = alone["edge_index"].shape[1]
        np.testing.assert_array_equal(
            inputs["edge_index"][:, edges : edges + count].numpy(),
            alone["edge_index"].numpy() + start,
        )
        np.testing.assert_allclose(inputs["shifts"][edges : edges + count], alone["shifts"])
        start, edges = start + len(atoms), edges + count
    assert edges == inputs["edge_index"].shape[1]


def test_neighbor_inputs_keep_the_dtype_and_reject_bad_batches():
    pos = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float32)
    out = neighbor_inputs(pos, torch.tensor([1, 1]), None, None, 2.0)
    assert out["shifts"].dtype == torch.float32
    with pytest.raises(ValueError, match="contiguous"):
        neighbor_inputs(pos, torch.tensor([1, 1]), None, None, 2.0, batch=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="2 atomic numbers for 3 positions"):
        neighbor_inputs(torch.zeros(3, 3), torch.tensor([1, 1]), None, None, 2.0)


# ------------------------------------------------------------------ Potential
@pytest.mark.parametrize("case", ["periodic", "primitive", "slab", "molecule"])
def test_potential_equals_the_calculator(helpers, case):
    atoms = _cases(helpers)[case]
    model = _painn()
    potential = Potential(model)
    out = potential(contract_inputs(atoms, potential.cutoff))
    atoms.calc = NvalchemiCalculator(model)
    assert out["energy"].shape == ()
    np.testing.assert_allclose(float(out["energy"]), atoms.get_potential_energy(), **TIGHT)
    np.testing.assert_allclose(out["forces"].numpy(), atoms.get_forces(), **TIGHT)
    np.testing.assert_allclose(float(out["atomic_energies"].sum()), float(out["energy"]), **TIGHT)
    if atoms.pbc.any():
        from ase.stress import voigt_6_to_full_3x3_stress

        stress = voigt_6_to_full_3x3_stress(atoms.get_stress())
        np.testing.assert_allclose(out["stress"].numpy(), stress, **TIGHT)
        np.testing.assert_allclose(out["virial"].numpy(), -stress * atoms.cell.volume, **TIGHT)
    else:
        assert "stress" not in out and "virial" not in out


def test_potential_atomic_energies_are_the_models_per_atom_energies(helpers):
    atoms = helpers.triclinic_cu_au()
    model = _painn()
    out = Potential(model)(contract_inputs(atoms, model.cutoff))
    data = helpers.batch_of([atoms], model.cutoff)
    species = model.species_index(data.atomic_numbers)
    with torch.no_grad():
        features = model.node_features(
            species,
            data.positions,
            data.neighbor_list,
            data.neighbor_list_shifts,
            data.cell,
            data.batch_idx,
        )
        expected = model.atomic_energy(species, features)
    np.testing.assert_allclose(out["atomic_energies"].numpy(), expected.numpy(), **TIGHT)


def test_potential_batched_equals_each_system_alone(helpers):
    cases = _cases(helpers)
    atoms_list = [cases["periodic"], cases["molecule"], cases["slab"], cases["primitive"]]
    potential = Potential(_painn())
    out = potential(batched_inputs(atoms_list, potential.cutoff))
    assert out["energy"].shape == (4,) and out["stress"].shape == (4, 3, 3)
    start = 0
    for s, atoms in enumerate(atoms_list):
        alone = potential(contract_inputs(atoms, potential.cutoff))
        atoms_slice = slice(start, start + len(atoms))
        np.testing.assert_allclose(out["energy"][s], alone["energy"], **TIGHT)
        np.testing.assert_allclose(out["forces"][atoms_slice], alone["forces"], **TIGHT)
        np.testing.assert_allclose(
            out["atomic_energies"][atoms_slice], alone["atomic_energies"], **TIGHT
        )
        if atoms.pbc.any():
            np.testing.assert_allclose(out["stress"][s], alone["stress"], **TIGHT)
            np.testing.assert_allclose(out["virial"][s], alone["virial"], **TIGHT)
        else:  # a molecule's rows are zero
            assert not out["stress"][s].any() and not out["virial"][s].any()
        start += len(atoms)


def test_potential_leaves_the_model_as_it_was(helpers):
    model = _painn().train()
    before = set(model.model_config.active_outputs)
    Potential(model)(contract_inputs(helpers.triclinic_cu_au(), model.cutoff))
    assert model.training and set(model.model_config.active_outputs) == before


def test_potential_rejects_shifts_that_are_not_lattice_translations(helpers):
    atoms = helpers.triclinic_cu_au()
    inputs = contract_inputs(atoms, 4.0)
    inputs["shifts"] = inputs["shifts"] + 0.3
    with pytest.raises(ValueError, match="not lattice translations"):
        Potential(_painn())(inputs)


def test_potential_checks_the_head():
    with pytest.raises(ValueError, match="not a head of this model"):
        Potential(_painn(heads=["pbe", "r2scan"]), head="ccsd")
