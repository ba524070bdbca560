"""NvalchemiCalculator: ASE's calculator contract on top of an nvalchemi model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.calculators.calculator import PropertyNotImplementedError
from ase.calculators.fd import calculate_numerical_forces, calculate_numerical_stress

from nvalchemi.models import NvalchemiCalculator, PaiNN


def _painn(dtype=torch.float64):
    torch.manual_seed(0)
    return PaiNN(
        cutoff=4.0,
        hidden_channels=16,
        num_interactions=2,
        num_rbf=8,
        elements=[29, 79],
        atomic_energies={29: -3.0, 79: -2.5},
        scale=0.3,
        dtype=dtype,
    )


def test_forces_are_minus_the_energy_gradient(helpers):
    atoms = helpers.triclinic_cu_au()
    atoms.calc = NvalchemiCalculator(_painn())
    numeric = calculate_numerical_forces(atoms, eps=1e-4, iatoms=[0, 1])
    np.testing.assert_allclose(atoms.get_forces()[:2], numeric, atol=1e-7)


def test_stress_is_the_finite_strain_derivative(helpers):
    for atoms in (helpers.triclinic_cu_au(), helpers.au_slab()):
        atoms.calc = NvalchemiCalculator(_painn())
        numeric = calculate_numerical_stress(atoms, eps=1e-5)
        np.testing.assert_allclose(atoms.get_stress(), numeric, atol=1e-8)
        assert atoms.get_stress().shape == (6,)


def test_free_energy_and_non_periodic_systems(helpers):
    atoms = helpers.cu_cluster()
    atoms.calc = NvalchemiCalculator(_painn())
    energy = atoms.get_potential_energy()
    assert atoms.get_potential_energy(force_consistent=True) == energy
    assert atoms.get_forces().shape == (4, 3)
    with pytest.raises(PropertyNotImplementedError):
        atoms.get_stress()


def test_stress_of_a_periodic_cell_without_volume_is_an_error_not_zeros():
    from ase.build import fcc111

    slab = fcc111("Cu", (2, 2, 3), vacuum=None)  # pbc T, T, F; third cell vector zero
    assert slab.pbc.tolist() == [True, True, False] and slab.cell.volume == 0
    model = _painn()
    model.set_config("active_outputs", {"energy", "forces", "stress"})
    slab.calc = NvalchemiCalculator(model)
    energy = slab.get_potential_energy()  # energy and forces need no volume
    assert np.isfinite(energy) and slab.get_forces().shape == (12, 3)
    assert "stress" not in slab.calc.results  # no zeros kept for a later get_stress
    with pytest.raises(PropertyNotImplementedError, match=r"zero-volume cell.*atoms\.center"):
        slab.get_stress()
    slab.center(vacuum=5.0, axis=2)
    stress = slab.get_stress()
    assert np.abs(stress).max() > 0


def test_results_are_cached_until_the_atoms_change(helpers):
    model = _painn()
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    atoms = helpers.triclinic_cu_au()
    atoms.calc = NvalchemiCalculator(model)
    atoms.get_potential_energy()
    atoms.get_forces()
    atoms.get_stress()
    assert len(calls) == 1
    atoms.positions[0, 0] += 0.01
    atoms.get_forces()
    assert len(calls) == 2


def test_dtype_and_mode_selection_leave_the_model_untouched(helpers):
    model = _painn(torch.float32).train()
    calc = NvalchemiCalculator(model, device="cpu", dtype=torch.float64)
    assert model.dtype == torch.float32 and calc.model.dtype == torch.float64
    atoms = helpers.triclinic_cu_au()
    atoms.calc = calc
    reference = helpers.triclinic_cu_au()
    reference.calc = NvalchemiCalculator(_painn(torch.float64))
    assert atoms.get_potential_energy() == pytest.approx(reference.get_potential_energy(), abs=1e-5)
    same = NvalchemiCalculator(model)
    assert same.model is model
    atoms.calc = same
    atoms.get_forces()
    assert model.training  # the calculator's eval mode is temporary


def test_nve_dynamics_conserves_energy():
    from ase import units
    from ase.build import bulk
    from ase.md.velocitydistribution import thermalize_momenta
    from ase.md.verlet import VelocityVerlet

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True) * (2, 2, 2)
    atoms.numbers[::5] = 79
    atoms.rattle(0.02, seed=3)
    model = _painn()
    model.scale = 10.0  # a random but smooth potential with EMT-sized forces (~0.3 eV/Å)
    atoms.calc = NvalchemiCalculator(model)
    thermalize_momenta(atoms, temperature_K=300, rng=np.random.default_rng(0))
    dyn = VelocityVerlet(atoms, timestep=2.0 * units.fs)
    total, potential = [], []
    dyn.attach(lambda: total.append(atoms.get_total_energy()), interval=2)
    dyn.attach(lambda: potential.append(atoms.get_potential_energy()), interval=2)
    dyn.run(100)
    exchanged = max(potential) - min(potential)
    drift = max(total) - min(total)
    assert exchanged > 0.1, "the potential energy should change during the run"
    assert drift < 2e-3 * exchanged, f"total energy drifted {drift:.2e} eV ({exchanged:.2f} eV)"


def test_from_checkpoint_directory(tmp_path, helpers):
    checkpoint = pytest.importorskip("nvalchemi.training.checkpoint")
    if not hasattr(checkpoint, "load_model_from_checkpoint"):
        pytest.skip("nvalchemi.training.checkpoint.load_model_from_checkpoint is not available")
    model = _painn()
    checkpoint.save_checkpoint(tmp_path / "ckpt", models={"main": model})
    calc = NvalchemiCalculator.from_checkpoint(tmp_path / "ckpt", device="cpu")
    atoms, reference = helpers.triclinic_cu_au(), helpers.triclinic_cu_au()
    atoms.calc, reference.calc = calc, NvalchemiCalculator(model)
    np.testing.assert_allclose(atoms.get_forces(), reference.get_forces(), atol=1e-12)


def test_from_checkpoint_honours_checkpoint_index_and_passes_every_option(
    tmp_path, helpers, monkeypatch
):
    checkpoint = pytest.importorskip("nvalchemi.training.checkpoint")
    first, second = _painn(), _painn()
    with torch.no_grad():
        second.readout[-1].bias.add_(1.0)  # another energy
    assert checkpoint.save_checkpoint(tmp_path / "ckpt", models={"main": first}) == 0
    assert checkpoint.save_checkpoint(tmp_path / "ckpt", models={"main": second}) == 1

    def energy(calc):
        atoms = helpers.triclinic_cu_au()
        atoms.calc = calc
        return atoms.get_potential_energy()

    expected = [energy(NvalchemiCalculator(m)) for m in (first, second)]
    assert expected[0] != pytest.approx(expected[1])
    load = NvalchemiCalculator.from_checkpoint
    assert energy(load(tmp_path / "ckpt")) == pytest.approx(expected[1], abs=1e-12)
    assert energy(load(tmp_path / "ckpt", checkpoint_index=0)) == pytest.approx(
        expected[0], abs=1e-12
    )

    seen = {}

    def fake_load(path, map_location=None, model_key="main", **options):
        seen.update(options, map_location=map_location, model_key=model_key)
        return _painn()

    from nvalchemi import checkpoint_files  # the calculator reads through this module

    monkeypatch.setattr(checkpoint_files, "load_model_from_checkpoint", fake_load)
    calc = load(tmp_path / "ckpt", checkpoint_index=0, use_ema=False, trust=True, label="x")
    assert seen == {
        "use_ema": False,
        "checkpoint_index": 0,
        "trust": True,
        "map_location": "cpu",
        "model_key": "main",
    }
    assert calc.label == "x"


def test_unknown_keywords_are_a_type_error(tmp_path):
    with pytest.raises(TypeError, match=r"\['checkpoint_idx'\].*ASE Calculator options"):
        NvalchemiCalculator.from_checkpoint(tmp_path, checkpoint_idx=0)
    with pytest.raises(TypeError, match=r"\['use_emma'\]"):
        NvalchemiCalculator(_painn(), use_emma=True)
