"""A committee through the export contract: ``Potential(committee)``, ``export_model`` of a
committee and the calculators on its export give the members' mean and calibrated spread."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from nvalchemi.models import CommitteeCalculator, NvalchemiCalculator, PaiNN
from nvalchemi.models.committee import SPREAD_NAMES, Committee
from nvalchemi.models.export import Potential, export_model, neighbor_inputs, quiet_torchscript
from nvalchemi.spec import create_model_spec

TIGHT = {"rtol": 1e-10, "atol": 1e-12}
MEMBER = {
    "cutoff": 4.0,
    "hidden_channels": 8,
    "num_interactions": 1,
    "num_rbf": 4,
    "elements": [29, 79],
    "scale": 0.3,
    "dtype": torch.float64,
    "active_outputs": ["energy", "forces", "stress"],
}
FACTORS = {"energy": 2.0, "forces": 3.0, "stress": 0.5}


def _committee(size: int = 3) -> Committee:
    committee = Committee([create_model_spec(PaiNN, **MEMBER)], size=size, seed=7)
    committee.set_uncertainty_scale(**FACTORS)
    return committee


@pytest.fixture(scope="module")
def committee_export(tmp_path_factory):
    """A calibrated float64 committee of three tiny PaiNN and its export (read only)."""
    committee = _committee()
    path = tmp_path_factory.mktemp("committee-export") / "committee.pt"
    info = export_model(committee, path)
    return committee, path, info


def _load(path):
    with quiet_torchscript():
        return torch.jit.load(str(path))


def _batched_inputs(atoms_list):
    inputs = {
        "positions": torch.tensor(np.concatenate([a.positions for a in atoms_list])),
        "atomic_numbers": torch.tensor(np.concatenate([a.numbers for a in atoms_list])),
        "cell": torch.tensor(np.stack([a.cell.array for a in atoms_list])),
        "pbc": torch.tensor(np.stack([a.pbc for a in atoms_list])),
        "batch": torch.repeat_interleave(
            torch.arange(len(atoms_list)), torch.tensor([len(a) for a in atoms_list])
        ),
    }
    inputs.update(neighbor_inputs(**inputs, cutoff=MEMBER["cutoff"]))
    return inputs


def _single_inputs(atoms):
    inputs = {
        "positions": torch.tensor(atoms.positions),
        "atomic_numbers": torch.tensor(atoms.numbers),
        "cell": torch.tensor(atoms.cell.array),
        "pbc": torch.tensor(atoms.pbc),
    }
    inputs.update(neighbor_inputs(**inputs, cutoff=MEMBER["cutoff"]))
    return inputs


def _by_hand(committee, inputs):
    """Mean and calibrated spread from each member alone (numpy, population std)."""
    members = [Potential(member)(inputs) for member in committee.members]
    stack = {key: np.stack([m[key].numpy() for m in members]) for key in members[0]}
    batch = inputs["batch"].numpy()
    forces_var = stack["forces"].var(axis=0)
    per_atom = np.sqrt(forces_var.sum(-1)) * FACTORS["forces"]
    return {
        **{key: values.mean(axis=0) for key, values in stack.items()},
        "energy_std": stack["energy"].std(axis=0) * FACTORS["energy"],
        "forces_std": np.sqrt(forces_var) * FACTORS["forces"],
        "max_force_deviation": np.array(
            [per_atom[batch == b].max() for b in range(int(batch.max()) + 1)]
        ),
        "stress_std": stack["stress"].std(axis=0) * FACTORS["stress"],
    }


def test_the_export_gives_the_members_mean_and_calibrated_spread(helpers, committee_export):
    committee, path, _ = committee_export
    exported = _load(path)
    atoms_list = [helpers.triclinic_cu_au(), helpers.au_slab(), helpers.cu_cluster()]
    inputs = _batched_inputs(atoms_list)
    out, eager = exported(inputs), Potential(committee)(inputs)
    assert (
        set(out)
        == set(eager)
        == {
            "energy",
            "atomic_energies",
            "forces",
            "stress",
            "virial",
            *SPREAD_NAMES,
        }
    )
    expected = _by_hand(committee, inputs)
    for key in eager:
        np.testing.assert_allclose(out[key].numpy(), eager[key].numpy(), **TIGHT)
        if key in expected:
            np.testing.assert_allclose(out[key].numpy(), expected[key], **TIGHT)
    assert out["energy_std"].shape == out["max_force_deviation"].shape == (3,)
    assert float(out["max_force_deviation"].min()) > 0  # the members do disagree
    assert not out["stress_std"][2].any()  # the cluster has no stress, nor its spread
    # one system: per-system spreads are scalars, as the energy
    single = exported(_single_inputs(atoms_list[0]))
    assert single["energy_std"].shape == single["max_force_deviation"].shape == ()
    np.testing.assert_allclose(single["max_force_deviation"], out["max_force_deviation"][0])
    np.testing.assert_allclose(single["stress_std"], out["stress_std"][0], **TIGHT)


def test_the_export_records_the_committee_and_checked_its_spread(committee_export):
    _, path, info = committee_export
    exported = _load(path)
    assert exported.committee_size == 3 and exported.atomic_numbers == [29, 79]
    assert info["committee"]["size"] == 3
    assert info["committee"]["calibration_factors"] == FACTORS
    assert set(SPREAD_NAMES) <= set(info["outputs"])
    assert info["model"]["class"] == "nvalchemi.models.committee.Committee"
    errors = info["self_check"]["max_relative_error"]
    assert set(SPREAD_NAMES) <= set(errors) and max(errors.values()) <= 1e-10


def test_calculators_on_the_export_give_the_committees_spread(helpers, committee_export):
    from ase.calculators.calculator import PropertyNotImplementedError

    committee, path, _ = committee_export
    for atoms in (helpers.triclinic_cu_au(), helpers.cu_cluster()):
        eager = atoms.copy()
        eager.calc = CommitteeCalculator(committee)
        for calc in (NvalchemiCalculator.from_export(path), CommitteeCalculator.from_export(path)):
            assert set(SPREAD_NAMES) <= set(calc.implemented_properties)
            exported = atoms.copy()
            exported.calc = calc
            names = ["energy", "forces", "energy_std", "forces_std", "max_force_deviation"]
            if atoms.pbc.any():
                names += ["stress", "stress_std"]
            for name in names:
                np.testing.assert_allclose(
                    calc.get_property(name, exported),
                    eager.calc.get_property(name, eager),
                    **TIGHT,
                )
            if not atoms.pbc.any():
                with pytest.raises(PropertyNotImplementedError):
                    calc.get_property("stress_std", exported)


def test_a_single_models_export_has_no_spread_and_the_committee_calculator_refuses_it(tmp_path):
    member = PaiNN(**MEMBER)
    path = tmp_path / "single.pt"
    info = export_model(member, path)
    assert "committee" not in info and _load(path).committee_size == 1
    assert not set(SPREAD_NAMES) & set(NvalchemiCalculator.from_export(path).implemented_properties)
    with pytest.raises(TypeError, match="outputs no spread"):
        CommitteeCalculator.from_export(path)


_TORCH_ONLY = r"""
import sys

for name in ("nvalchemi", "ase", "vesin"):
    sys.modules[name] = None  # any import of them fails from here on
import torch

model = torch.jit.load(sys.argv[1])
torch.save(model(torch.load(sys.argv[2], weights_only=True)), sys.argv[3])
print(model.committee_size)
"""


def test_the_committee_export_runs_with_torch_only(helpers, committee_export, tmp_path):
    committee, path, _ = committee_export
    inputs = _batched_inputs([helpers.triclinic_cu_au(), helpers.cu_cluster()])
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", _TORCH_ONLY, str(path), "inputs.pt", "out.pt"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3"]
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    eager = Potential(committee)(inputs)
    for key in eager:
        np.testing.assert_allclose(out[key].numpy(), eager[key].numpy(), **TIGHT)


def test_torch_sim_passes_the_spread_on_from_the_committee_and_its_export(
    helpers, committee_export
):
    """The explorer of ``learn`` reads the deviation from ``TorchSimModel``'s output."""
    pytest.importorskip("torch_sim")
    from nvalchemi.models import TorchSimModel

    committee, path, _ = committee_export
    atoms_list = [helpers.triclinic_cu_au(), helpers.au_slab()]
    inputs = _batched_inputs(atoms_list)
    expected = Potential(committee)(inputs)
    state = {
        "positions": inputs["positions"],
        "cell": inputs["cell"].mT,  # torch-sim: lattice vectors as columns
        "pbc": inputs["pbc"],
        "atomic_numbers": inputs["atomic_numbers"],
        "system_idx": inputs["batch"],
    }
    for model in (TorchSimModel(committee), TorchSimModel.from_export(path)):
        out = model(state)
        assert set(SPREAD_NAMES) <= set(out)
        assert out["max_force_deviation"].shape == out["energy_std"].shape == (2,)
        for key in ("energy", "forces", "stress", *SPREAD_NAMES):
            np.testing.assert_allclose(out[key].numpy(), expected[key].numpy(), **TIGHT)
    out = TorchSimModel(committee, compute_stress=False)(state)
    assert "stress_std" not in out and "max_force_deviation" in out
