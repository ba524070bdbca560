"""TorchSimModel: nvalchemi potentials under torch-sim's integrators and optimizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ts = pytest.importorskip("torch_sim")

from ase import units  # noqa: E402
from ase.build import bulk, fcc100, fcc111, molecule  # noqa: E402
from ase.md.verlet import VelocityVerlet  # noqa: E402

from nvalchemi.models import NvalchemiCalculator, PaiNN, TorchSimModel  # noqa: E402


def _painn():
    torch.manual_seed(0)
    return PaiNN(
        cutoff=4.0,
        hidden_channels=16,
        num_interactions=2,
        num_rbf=8,
        elements=[1, 6, 8, 13, 29, 79],
        atomic_energies={29: -3.0, 79: -2.5, 13: -2.0},
        scale=0.3,
        dtype=torch.float64,
        active_outputs=("energy", "forces", "stress"),
    )


def _mixed_structures():
    """Periodic bulk (triclinic, two elements), a slab (pbc T, T, F) and a molecule."""
    crystal = bulk("Cu", "fcc", a=3.65) * (2, 2, 2)
    crystal.set_cell(crystal.cell[:] @ np.array([[1, 0.03, 0], [0.03, 1, 0.02], [0, 0, 1]]), True)
    crystal.numbers[[1, 5]] = 79
    crystal.rattle(0.05, seed=1)
    slab = fcc111("Al", (2, 2, 3), vacuum=6.0)
    slab.rattle(0.05, seed=2)
    mol = molecule("CH3OH")
    mol.center(vacuum=6.0)  # a box with more than the cutoff of vacuum
    return [crystal, slab, mol]


def _fully_periodic(structures):
    """torch-sim 0.3 has one pbc flag per state: True, with vacuum for slab and molecule."""
    out = []
    for atoms in structures:
        atoms = atoms.copy()
        atoms.pbc = True
        out.append(atoms)
    return out


def test_a_mixed_batch_gives_the_calculators_energies_forces_and_stress():
    model = _painn()
    structures = _mixed_structures()
    adapter = TorchSimModel(model)
    state = ts.io.atoms_to_state(_fully_periodic(structures), adapter.device, adapter.dtype)
    out = adapter(state)
    assert out["energy"].shape == (3,) and out["stress"].shape == (3, 3, 3)
    calc = NvalchemiCalculator(model)
    start = 0
    for index, atoms in enumerate(structures):
        atoms.calc = calc  # the structure's own pbc: bulk T T T, slab T T F, molecule open
        n = len(atoms)
        energy = atoms.get_potential_energy()
        assert out["energy"][index].item() == pytest.approx(energy, rel=1e-10, abs=1e-10)
        np.testing.assert_allclose(
            out["forces"][start : start + n].numpy(), atoms.get_forces(), rtol=0, atol=1e-10
        )
        if atoms.pbc.any():
            np.testing.assert_allclose(
                out["stress"][index].numpy(), atoms.get_stress(voigt=False), rtol=0, atol=1e-10
            )
        start += n
    # The same systems again after a move reuse the batch: results follow the new positions.
    state.positions = state.positions + 0.01 * torch.randn_like(state.positions)
    moved = adapter(state)
    first = structures[0].copy()
    first.positions = state.positions[: len(first)].numpy()
    first.calc = calc
    assert moved["energy"][0].item() == pytest.approx(first.get_potential_energy(), rel=1e-10)


def test_open_boundary_batches_and_per_system_pbc_rows():
    model = _painn()
    mol, cluster = molecule("H2O"), bulk("Cu", "fcc", a=3.6, cubic=True)
    cluster.pbc, cluster.cell = False, np.zeros((3, 3))
    adapter = TorchSimModel(model)
    state = ts.io.atoms_to_state([mol, cluster], adapter.device, adapter.dtype)
    assert state.pbc is False
    out = adapter(state)
    assert torch.count_nonzero(out["stress"]) == 0  # no periodic system, no stress
    calc = NvalchemiCalculator(model)
    for index, atoms in enumerate((mol, cluster)):
        atoms.calc = calc
        assert out["energy"][index].item() == pytest.approx(atoms.get_potential_energy(), rel=1e-10)
    # A dict state may say per system what is periodic: the slab keeps pbc T, T, F.
    crystal, slab, _ = _mixed_structures()
    both = ts.io.atoms_to_state(_fully_periodic([crystal, slab]), adapter.device, adapter.dtype)
    fields = {
        "positions": both.positions,
        "cell": both.cell,
        "atomic_numbers": both.atomic_numbers,
        "system_idx": both.system_idx,
        "pbc": torch.tensor([[True, True, True], [True, True, False]]),
    }
    out = adapter(fields)
    slab.calc = calc
    assert out["energy"][1].item() == pytest.approx(slab.get_potential_energy(), rel=1e-10)


def _check_against_calculator(adapter, model, structures):
    state = ts.io.atoms_to_state(_fully_periodic(structures), adapter.device, adapter.dtype)
    out = adapter(state)
    calc = NvalchemiCalculator(model)
    start = 0
    for index, atoms in enumerate(structures):
        atoms.calc = calc
        n = len(atoms)
        assert out["energy"][index].item() == pytest.approx(
            atoms.get_potential_energy(), rel=1e-10, abs=1e-10
        )
        np.testing.assert_allclose(
            out["forces"][start : start + n].numpy(), atoms.get_forces(), rtol=0, atol=1e-10
        )
        if atoms.pbc.any():
            np.testing.assert_allclose(
                out["stress"][index].numpy(), atoms.get_stress(voigt=False), rtol=0, atol=1e-10
            )
        start += n


def test_a_potential_following_the_export_contract_runs_batched():
    from nvalchemi.models.export import Potential

    model = _painn()
    adapter = TorchSimModel(Potential(model))
    assert adapter.contract and adapter.cutoff == 4.0 and adapter.dtype == torch.float64
    _check_against_calculator(adapter, model, _mixed_structures())


def test_from_export_loads_an_exported_file_and_matches_the_calculator(tmp_path):
    from nvalchemi.models import export

    if not hasattr(export, "export_model"):
        pytest.skip("nvalchemi.models.export.export_model is not on this branch yet")
    model = _painn()
    structures = _mixed_structures()
    export.export_model(model, tmp_path / "painn.pt", structures=structures[:1])
    adapter = TorchSimModel.from_export(tmp_path / "painn.pt")
    assert adapter.contract and adapter.cutoff == 4.0
    _check_against_calculator(adapter, model, structures)
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 1)), tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not an nvalchemi export"):
        TorchSimModel.from_export(tmp_path / "plain.pt")


def test_ten_nve_steps_equal_ases_velocity_verlet():
    model = _painn()
    structures = _mixed_structures()
    timestep_fs = 1.0
    momenta = []
    for i, atoms in enumerate(structures):
        kT = 600 * units.kB
        masses = atoms.get_masses()[:, None]
        atoms.set_momenta(
            np.random.default_rng(i).normal(size=(len(atoms), 3)) * np.sqrt(masses * kT)
        )
        momenta.append(atoms.get_momenta())
    adapter = TorchSimModel(model, compute_stress=False)
    state = ts.io.atoms_to_state(_fully_periodic(structures), adapter.device, adapter.dtype)
    state.momenta = torch.tensor(np.concatenate(momenta))
    dt = torch.tensor(timestep_fs * 1e-3 * ts.units.MetalUnits.time, dtype=torch.float64)
    init, update = ts.integrators.nve(model=adapter, dt=dt, kT=torch.tensor(0.0))
    md_state = init(state)
    for _ in range(10):
        md_state = update(md_state)

    start = 0
    for atoms in structures:
        atoms.calc = NvalchemiCalculator(model)
        VelocityVerlet(atoms, timestep=timestep_fs * units.fs).run(10)
        n = len(atoms)
        moved = md_state.positions[start : start + n].numpy()
        # torch-sim wraps periodic positions into the cell; compare the minimum image.
        frac = (moved - atoms.positions) @ np.linalg.inv(atoms.cell.array)
        delta = (frac - np.round(frac)) @ atoms.cell.array
        assert np.abs(delta).max() < 1e-8
        np.testing.assert_allclose(
            md_state.momenta[start : start + n].numpy(), atoms.get_momenta(), atol=1e-8
        )
        start += n


def test_fire_relaxes_a_batch_to_the_force_tolerance():
    from _reference_models import EMTModel

    rattled = []
    for seed, atoms in enumerate(
        (bulk("Cu", "fcc", a=3.6) * (2, 2, 2), fcc100("Cu", (2, 2, 3), vacuum=6.0, periodic=True))
    ):
        atoms.rattle(0.1, seed=seed)
        rattled.append(atoms)
    adapter = TorchSimModel(EMTModel(), compute_stress=False)
    state = ts.io.atoms_to_state(rattled, adapter.device, adapter.dtype)
    before = adapter(state)["forces"].norm(dim=1).max()
    assert before > 0.5
    relaxed = ts.optimize(
        system=state,
        model=adapter,
        optimizer=ts.optimizers.fire,
        convergence_fn=ts.runners.generate_force_convergence_fn(
            force_tol=0.01, include_cell_forces=False
        ),
        max_steps=500,
    )
    after = adapter(relaxed)
    assert after["forces"].norm(dim=1).max() < 0.01
    assert torch.all(after["energy"] < adapter(state)["energy"])


def test_from_checkpoint_loads_the_chosen_checkpoint(tmp_path):
    from nvalchemi.training.checkpoint import save_checkpoint

    first, second = _painn(), _painn()
    with torch.no_grad():
        second.readout[-1].bias.add_(1.0)  # another energy
    save_checkpoint(tmp_path / "ckpt", models={"main": first})
    save_checkpoint(tmp_path / "ckpt", models={"main": second})
    crystal = _mixed_structures()[0]
    state = ts.io.atoms_to_state([crystal], torch.device("cpu"), torch.float64)
    for index, model in ((0, first), ("latest", second)):
        loaded = TorchSimModel.from_checkpoint(tmp_path / "ckpt", checkpoint_index=index)
        assert loaded.dtype == torch.float64 and loaded.cutoff == 4.0
        expected = TorchSimModel(model)(state)
        assert loaded(state)["energy"].item() == pytest.approx(expected["energy"].item(), abs=1e-12)


def test_bad_input_is_refused_with_a_clear_message():
    with pytest.raises(TypeError, match="BaseModelMixin"):
        TorchSimModel(torch.nn.Linear(3, 1))
    from nvalchemi.models.export import Potential

    with pytest.raises(ValueError, match="head fixed at export"):
        TorchSimModel(Potential(_painn()), head="default")
    from nvalchemi.models import DemoModel, DemoModelWrapper

    with pytest.raises(ValueError, match="no stress output"):
        TorchSimModel(DemoModelWrapper(DemoModel(hidden_dim=4)), compute_stress=True)
    with pytest.raises(ValueError, match="head='x'"):
        TorchSimModel(_painn(), head="x")
    adapter = TorchSimModel(_painn())
    state = {
        "positions": torch.zeros(2, 3),
        "cell": torch.eye(3).unsqueeze(0) * 5,
        "atomic_numbers": torch.tensor([29, 29]),
        "pbc": torch.ones(2, 2, dtype=torch.bool),
    }
    with pytest.raises(ValueError, match="pbc must be"):
        adapter(state)


def test_torch_sim_is_imported_only_when_used_and_missing_it_names_the_extra():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import nvalchemi.models\n"
        "assert 'torch_sim' not in sys.modules, 'imported at import time'\n"
        "sys.modules['torch_sim'] = None\n"
        "sys.modules['torch_sim.models.interface'] = None\n"
        "try:\n"
        "    nvalchemi.models.TorchSimModel\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "pip install 'nvalchemi-training[md]'" in result.stdout


def test_the_modules_examples_run():
    import doctest

    import nvalchemi.models.torchsim as module

    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0
