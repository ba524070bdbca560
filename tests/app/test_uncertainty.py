"""Uncertainty in evaluation: calibration and rank correlation on known answers, and a
committee job end to end (fitted on validation data, stored, applied by evaluate)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nvalchemi.app.uncertainty import (
    EXPECTED_COVERAGE,
    apply_calibration,
    fit_calibration,
    uncertainty_metrics,
    uncertainty_report,
)

from ._support import TEST, TINY_PAINN, invoke, is_png, tiny_job, write_job


def _synthetic(factor: float, atoms: int = 20_000, seed: int = 0, groups: int = 1):
    """Per-component force errors drawn from N(0, (factor * sigma)^2): the committee's
    raw sigmas are ``factor`` times too small."""
    rng = np.random.default_rng(seed)
    sigma = rng.uniform(0.02, 0.5, size=(atoms, 3))
    per_structure = 10
    structures = atoms // per_structure
    energy_sigma = rng.uniform(0.01, 0.1, size=structures)
    return SimpleNamespace(
        forces_pred=rng.normal(0.0, factor * sigma),
        forces_ref=np.zeros((atoms, 3)),
        forces_std=sigma,
        energy_per_atom_pred=rng.normal(0.0, factor * energy_sigma),
        energy_per_atom_ref=np.zeros(structures),
        energy_std=energy_sigma * per_structure,  # eV per structure
        atoms_per_structure=np.full(structures, per_structure),
        stress_std=None,
        groups=np.array([f"g{i % groups}" for i in range(structures)]),
        uncertainty_scale={"energy": 1.0, "forces": 1.0, "stress": 1.0},
    )


def test_gaussian_errors_with_a_known_scale_are_recalibrated_to_gaussian_coverage():
    evaluation = _synthetic(2.5)
    factors = fit_calibration(evaluation)
    assert factors["forces"] == pytest.approx(2.5, rel=0.02)
    assert factors["energy"] == pytest.approx(2.5, rel=0.05)
    before = uncertainty_metrics(evaluation, "forces")
    for k in (1, 2, 3):  # sigmas 2.5x too small: only |z| <= k / 2.5 are inside
        assert before[f"within_{k}_sigma"] == pytest.approx(math.erf(k / 2.5 / 2**0.5), abs=0.01)
    apply_calibration(evaluation, factors)
    after = uncertainty_metrics(evaluation, "forces")
    for k in (1, 2, 3):
        assert after[f"within_{k}_sigma"] == pytest.approx(EXPECTED_COVERAGE[k], abs=0.01)
        # the uncalibrated numbers are still reported, from the raw sigmas
        assert after[f"uncalibrated_within_{k}_sigma"] == pytest.approx(
            before[f"within_{k}_sigma"], abs=1e-12
        )
    # a second fit on calibrated spreads finds the same factor (it works on raw sigmas)
    assert fit_calibration(evaluation)["forces"] == pytest.approx(factors["forces"], rel=1e-9)


def test_spearman_is_one_when_errors_follow_sigma_and_zero_when_independent():
    evaluation = _synthetic(1.0)
    evaluation.forces_pred = evaluation.forces_std * 1.3  # |error| = 1.3 sigma exactly
    assert uncertainty_metrics(evaluation, "forces")["spearman"] == pytest.approx(1.0)
    rng = np.random.default_rng(1)
    evaluation.forces_pred = rng.normal(0.0, 0.2, size=evaluation.forces_std.shape)
    assert abs(uncertainty_metrics(evaluation, "forces")["spearman"]) < 0.05
    evaluation.energy_per_atom_pred = -0.7 * evaluation.energy_std / 10  # per atom
    assert uncertainty_metrics(evaluation, "energy")["spearman"] == pytest.approx(1.0)


def test_report_breaks_calibration_down_per_group():
    evaluation = _synthetic(1.0, groups=2)
    owner = np.repeat(np.arange(len(evaluation.groups)), 10)
    second = (evaluation.groups == "g1")[owner]
    evaluation.forces_pred[second] *= 3.0  # group g1's errors are 3x its sigmas
    report = uncertainty_report(evaluation)
    g0, g1 = report["by_group"]["g0"]["forces"], report["by_group"]["g1"]["forces"]
    assert g0["within_1_sigma"] == pytest.approx(EXPECTED_COVERAGE[1], abs=0.02)
    assert g1["within_1_sigma"] == pytest.approx(math.erf(1 / 3 / 2**0.5), abs=0.02)
    assert g0["count"] + g1["count"] == report["overall"]["forces"]["count"]
    assert report["expected"]["within_2_sigma"] == pytest.approx(0.9545, abs=1e-4)
    assert set(report["overall"]) == {"energy", "forces"}  # no stress spreads given


def test_zero_sigmas_are_left_out_not_counted_as_infinite():
    evaluation = _synthetic(1.0, atoms=100)
    evaluation.forces_std[:10] = 0.0
    assert uncertainty_metrics(evaluation, "forces")["count"] == 270


def test_predict_collects_spreads_aligned_with_structures_without_stress(helpers_models):
    from nvalchemi.app.evaluation import predict
    from nvalchemi.data.sources import make_loader

    committee, data = helpers_models
    evaluation = predict(committee, make_loader(data, batch_size=1))
    assert evaluation.forces_std.shape == evaluation.forces_pred.shape
    assert evaluation.energy_std.shape == (len(data),)
    assert evaluation.stress_std.shape == (len(data), 9)
    assert np.isnan(evaluation.stress_std[-1]).all()  # the cluster has no stress
    assert np.isfinite(evaluation.stress_std[0]).all()
    assert evaluation.uncertainty_scale == {"energy": 1.0, "forces": 1.0, "stress": 1.0}
    assert "uncertainty" in evaluation.report()
    evaluation.energy_std = evaluation.forces_std = evaluation.stress_std = None
    assert "uncertainty" not in evaluation.report()


@pytest.fixture
def helpers_models():
    from ase import Atoms
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    from nvalchemi.data import AtomicData
    from nvalchemi.data.neighbors import NeighborListTransform
    from nvalchemi.models import PaiNN
    from nvalchemi.models.committee import Committee
    from nvalchemi.spec import create_model_spec

    cells = [bulk("Cu", "fcc", a=3.6, cubic=True), bulk("Cu", "fcc", a=3.7, cubic=True)]
    cells.append(Atoms("Cu3", positions=[[0, 0, 0], [2.4, 0, 0], [0, 2.5, 0]]))
    transform = NeighborListTransform(4.0)
    data = []
    for atoms in cells:
        atoms.rattle(0.05, seed=1)
        atoms.calc = EMT()
        labels = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
        if atoms.pbc.any():
            labels["stress"] = atoms.get_stress()
        atoms.calc = SinglePointCalculator(atoms, **labels)
        data.append(transform(AtomicData.from_atoms(atoms, dtype=torch.float64), {})[0])
    member = create_model_spec(
        PaiNN,
        **{**TINY_PAINN, "active_outputs": ["energy", "forces", "stress"]},
        elements=[29],
        dtype=torch.float64,
    )
    return Committee([member], size=2), data


@pytest.fixture(scope="module")
def committee_run(tmp_path_factory):
    """A tiny committee job (2 members, 4 steps) run by ``spec run`` (read only)."""
    tmp = tmp_path_factory.mktemp("committee-run")
    job = tiny_job(tmp, "--committee", "2", num_steps=4)
    main = job["strategy"]["model_specs"]["main"]
    for key in TINY_PAINN:  # tiny_job shrinks a plain PaiNN: shrink the members instead
        main.pop(key)
    main["members"][0].update(TINY_PAINN)
    result = invoke("spec", "run", write_job(tmp / "job.json", job), "--no-report")
    assert result.exit_code == 0, result.output
    return tmp / "run"


def test_a_committee_job_calibrates_on_validation_stores_it_and_evaluate_applies_it(
    committee_run,
):
    from nvalchemi.training.checkpoint import load_model_from_checkpoint

    run = committee_run
    final = json.loads((run / "final_evaluation.json").read_text())
    factors = final["uncertainty"]["calibration_factors"]
    assert set(final["uncertainty"]["overall"]) >= {"energy", "forces"}
    assert factors["forces"] != 1.0 and factors["energy"] != 1.0
    assert is_png(run / "calibration.png")
    for use_ema in (True, False):  # stored with the model (EMA and live weights)
        model = load_model_from_checkpoint(run / "checkpoints", use_ema=use_ema)
        stored = dict(zip(("energy", "forces"), model.uncertainty_scale.tolist()))
        assert stored == pytest.approx({k: factors[k] for k in stored})
    result = invoke(
        "evaluate", run / "checkpoints", "--dataset", TEST, "--max-structures", 6, "--json"
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["uncertainty"]["calibration_factors"]["forces"] == pytest.approx(
        factors["forces"]
    )
    assert "within_1_sigma" in report["uncertainty"]["overall"]["forces"]
    assert any(p.endswith("calibration.png") for p in report["plots"])
    assert "Uncertainty (committee spread vs error)" in result.stderr


def test_the_export_of_a_committee_checkpoint_carries_its_calibrated_spread(
    committee_run, tmp_path
):
    """``nvalchemi-training export`` of a committee: the calculator on the file gives the
    spread of the calculator on the checkpoint (float64, 1e-10)."""
    from ase.io import read

    from nvalchemi.models import CommitteeCalculator
    from nvalchemi.models.committee import SPREAD_NAMES
    from nvalchemi.models.export import read_export_metadata

    out = tmp_path / "committee.pt"
    result = invoke("export", committee_run / "checkpoints", out, "--dtype", "float64")
    assert result.exit_code == 0, result.output
    assert "committee:  2 members" in result.stderr
    info = read_export_metadata(out)
    final = json.loads((committee_run / "final_evaluation.json").read_text())
    assert info["committee"]["calibration_factors"] == pytest.approx(
        final["uncertainty"]["calibration_factors"]
    )
    assert set(SPREAD_NAMES) <= set(info["self_check"]["max_relative_error"])
    for atoms in read(TEST, index=":3"):
        exported, eager = atoms.copy(), atoms.copy()
        exported.calc = CommitteeCalculator.from_export(out)
        eager.calc = CommitteeCalculator.from_checkpoint(
            committee_run / "checkpoints", dtype=torch.float64
        )
        names = ["energy", "forces", "energy_std", "forces_std", "max_force_deviation"]
        if atoms.pbc.all():
            names += ["stress", "stress_std"]
        for name in names:
            np.testing.assert_allclose(
                exported.calc.get_property(name, exported),
                eager.calc.get_property(name, eager),
                rtol=1e-10,
                atol=1e-12,
            )
