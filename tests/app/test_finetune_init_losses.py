"""``finetune init``: the source's loss terms and weights, stress as the data says, and the
``spec report`` warning when a fine-tune drops an output its source was trained on."""

from __future__ import annotations

import json

import pytest

from nvalchemi.app.jobs import TrainingJobSpec
from nvalchemi.app.jobs.checks import job_warnings
from nvalchemi.app.jobs.finetune import loss_terms
from nvalchemi.app.jobs.recipe import QUICKSTART

from ._finetune_sources import POLICY, painn_source, relabelled
from ._support import TRAIN, invoke, write_job


@pytest.fixture(scope="module")
def with_stress(tmp_path_factory):
    return painn_source(tmp_path_factory.mktemp("source") / "checkpoints", stress=True)


@pytest.fixture(scope="module")
def without_stress(tmp_path_factory):
    return painn_source(tmp_path_factory.mktemp("source") / "checkpoints", stress=False)


@pytest.fixture(scope="module")
def no_stress_data(tmp_path_factory):
    """The first 12 bundled structures with energy and forces only."""
    return relabelled(tmp_path_factory.mktemp("data") / "no_stress.extxyz", 12, stress=False)


def _init(tmp_path, *args, data=TRAIN):
    out = tmp_path / "ft.json"
    result = invoke(
        "finetune",
        "init",
        *args,
        "--dataset",
        data,
        "--output-dir",
        tmp_path / "ft",
        "--device",
        "cpu",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.stderr


def _terms(job):
    return {k: w for k, (_, w) in loss_terms(job["strategy"]["loss_fn_spec"]).items()}


def test_a_source_trained_with_stress_keeps_its_terms_and_weights_and_says_so(
    tmp_path, with_stress
):
    job, said = _init(tmp_path, "checkpoint", with_stress)
    assert _terms(job) == {"energy": 2.0, "forces": 3.0, "stress": 50.0}
    assert "the source's terms and weights (energy 2, forces 3, stress 50)" in said
    assert "with stress" in said  # "Created ...: a job that fine-tunes ... with stress"
    assert "active_outputs" not in job["source"]  # the model already computes stress
    # --from names the same source
    job, _ = _init(tmp_path, "--from", with_stress)
    assert _terms(job) == {"energy": 2.0, "forces": 3.0, "stress": 50.0}


def test_stress_labels_add_the_stress_loss_to_a_source_trained_without(tmp_path, without_stress):
    job, said = _init(tmp_path, "checkpoint", without_stress)
    assert _terms(job) == {"energy": 2.0, "forces": 3.0, "stress": QUICKSTART.stress_weight}
    assert job["source"]["active_outputs"] == ["energy", "forces", "stress"]
    assert "stress labels found in" in said and "adding the stress loss" in said
    assert "--no-stress to leave them out" in said


def test_no_stress_leaves_it_out_and_spec_report_warns(tmp_path, with_stress):
    job, said = _init(tmp_path, "checkpoint", with_stress, "--no-stress")
    assert _terms(job) == {"energy": 2.0, "forces": 3.0}
    assert job["source"]["active_outputs"] == ["energy", "forces"]  # stress not computed
    assert "--no-stress: leaving out the source's stress loss" in said
    report = invoke("spec", "report", tmp_path / "ft.json")
    assert report.exit_code == 0, report.output
    text = " ".join(report.output.split())
    assert "Dropped output" in text
    assert "the source checkpoint was trained on stress (StressMSELoss, weight 50)" in text


def test_data_without_stress_labels_drops_the_stress_loss_and_says_why(
    tmp_path, with_stress, no_stress_data
):
    job, said = _init(tmp_path, "checkpoint", with_stress, data=no_stress_data)
    assert _terms(job) == {"energy": 2.0, "forces": 3.0}
    assert "none of the first 12 training structures has a stress label" in said
    # --stress keeps it all the same
    job, _ = _init(tmp_path, "checkpoint", with_stress, "--stress", data=no_stress_data)
    assert _terms(job) == {"energy": 2.0, "forces": 3.0, "stress": 50.0}


def test_a_given_loss_dtype_policy_replaces_the_sources(tmp_path, with_stress):
    job, _ = _init(tmp_path, "checkpoint", with_stress)
    assert job["strategy"]["loss_fn_spec"]["dtype_policy"] == POLICY  # the source's
    job, _ = _init(
        tmp_path, "checkpoint", with_stress, "--loss-dtype-policy", "target_to_prediction"
    )
    assert job["strategy"]["loss_fn_spec"]["dtype_policy"] == "target_to_prediction"
    assert _terms(job) == {"energy": 2.0, "forces": 3.0, "stress": 50.0}


def test_use_original_loss_and_a_stress_flag_contradict(tmp_path, with_stress):
    result = invoke(
        "finetune", "init", "checkpoint", with_stress, "--dataset", TRAIN,
        "--output-dir", tmp_path / "ft", "--use-original-loss", "--no-stress",
    )  # fmt: skip
    assert result.exit_code == 1 and "--use-original-loss" in result.stderr


def test_a_mace_fine_tune_on_stress_data_adds_the_stress_loss_and_output(tmp_path):
    job, said = _init(tmp_path, "mace", "models/small.model")
    assert "stress" in _terms(job)
    assert job["source"]["active_outputs"] == ["energy", "forces", "stress"]
    assert "stress labels found in" in said
    job, _ = _init(tmp_path, "mace", "models/small.model", "--no-stress")
    assert "stress" not in _terms(job) and "active_outputs" not in job["source"]


def test_spec_report_warns_about_every_output_the_fine_tune_no_longer_trains(tmp_path, with_stress):
    job, _ = _init(tmp_path, "checkpoint", with_stress)
    assert not [
        w for w in job_warnings(TrainingJobSpec.model_validate(job)) if w.check == "Dropped output"
    ]
    loss = job["strategy"]["loss_fn_spec"]
    loss["components"], loss["weights"] = loss["components"][1:2], [1.0]  # forces only
    found = [
        w for w in job_warnings(TrainingJobSpec.model_validate(job)) if w.check == "Dropped output"
    ]
    assert [w.message.split(" (")[0] for w in found] == [
        "the source checkpoint was trained on energy",
        "the source checkpoint was trained on stress",
    ]
    assert all(w.field == "strategy.loss_fn_spec" and w.fix for w in found)
    job["source"]["use_original_loss"] = True  # the checkpoint's own loss: nothing dropped
    job["strategy"].pop("loss_fn_spec")
    assert not [
        w for w in job_warnings(TrainingJobSpec.model_validate(job)) if w.check == "Dropped output"
    ]


def test_the_written_stress_fine_tune_runs(tmp_path, without_stress):
    _init(
        tmp_path,
        "checkpoint",
        without_stress,
        "--num-steps",
        2,
        "--batch-size",
        4,
        "--val-fraction",
        0.25,
    )
    path = tmp_path / "ft.json"
    job = json.loads(path.read_text())
    job["dataset"].update({"max_structures": 8, "in_memory": True})
    job["output"].update({"tensorboard": False, "plots": False})
    result = invoke("spec", "run", write_job(path, job), "--no-report")
    assert result.exit_code == 0, result.output
    from nvalchemi.hooks.reporting import read_metrics

    [row] = [r for r in read_metrics(tmp_path / "ft") if r["kind"] == "validation"]
    assert row["validation/loss/StressMSELoss/weight"] == QUICKSTART.stress_weight
    assert row["validation/loss/EnergyMSELoss/weight"] == 2.0  # the source's
