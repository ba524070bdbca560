"""``spec report``: tables and warnings without loading tensors; LR preview from the real scheduler."""

from __future__ import annotations

import json

import pytest
import torch

from nvalchemi.app.jobs.lr_preview import lr_preview
from nvalchemi.training.optimizers import OptimizerConfig

from ._support import TRAIN, assert_user_error, invoke, tiny_job, write_job


def _report(tmp_path, job, *args):
    path = write_job(tmp_path / "job.json", job)
    return invoke("spec", "report", path, *args)


def test_report_renders_every_section_and_the_dtype_policy(tmp_path):
    job = tiny_job(tmp_path, "--loss-dtype-policy", "prediction_to_target")
    job["notes"] = "a note for the reader"
    result = _report(tmp_path, job)
    assert result.exit_code == 0, result.output
    text = result.stderr
    for title in (
        "Training report: train-painn",
        "Training Intent",
        "Hook Firing Order",
        "Warnings",
        "TrainingStrategy",
        "Optimizers",
        "Notes",
        "Learning-rate preview: main[0] AdamW + WarmupCosineLR",
    ):
        assert title in text, title
    assert "main: PaiNN (built-in, nvalchemi.models.painn)" in text  # the model by name
    assert "prediction_to_target" in text
    assert "a note for the reader" in text
    assert result.stdout == ""  # reports go to stderr


def test_report_json_prints_the_normalized_job_on_stdout(tmp_path):
    job = tiny_job(tmp_path)
    result = _report(tmp_path, job, "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed["dataset"]["max_structures"] == 16
    assert printed["workflow"] == "train"


def test_report_warns_about_missing_paths_validation_lr_and_devices(tmp_path):
    result = invoke(
        "finetune",
        "init",
        "checkpoint",
        tmp_path / "nowhere",
        "--dataset",
        tmp_path / "missing.extxyz",
        "--output-dir",
        tmp_path / "ft",
        "--lr",
        1e-3,
        "--device",
        "cuda:0",
    )
    assert result.exit_code == 0, result.output
    report = _report(tmp_path, json.loads(result.stdout))
    assert report.exit_code == 0, report.output
    text = report.stderr
    for check in (
        "Missing local path",
        "Validation data",
        "Learning rate",
        "Full model update",
        "No adaptation boundary",
    ):
        assert check in text, check
    if not torch.cuda.is_available():
        assert "Device selection: strategy.devices: devices ['cuda:0'] ask for CUDA" in text
    # Every warning names its field and the fix, on one line.
    line = next(x for x in text.splitlines() if "Missing local path" in x)
    assert "dataset.path:" in line and "missing.extxyz does not exist" in line and "Fix: " in line


def test_report_warns_when_a_checkpoint_dir_has_no_hook_and_a_train_job_has_no_model(tmp_path):
    job = tiny_job(tmp_path, "--model", "custom")
    job["source"]["hooks"] = []
    text = _report(tmp_path, job).stderr
    assert "Checkpoint hook" in text
    assert "Model spec" in text


def test_a_clean_job_reports_ok(tmp_path):
    job = tiny_job(tmp_path)
    job["strategy"]["devices"] = ["cpu"]
    text = _report(tmp_path, job).stderr
    assert "Missing local path" not in text and "Validation data" not in text


def test_lr_preview_steps_the_real_scheduler():
    config = OptimizerConfig(
        torch.optim.SGD,
        {"lr": 1.0},
        torch.optim.lr_scheduler.StepLR,
        {"step_size": 2, "gamma": 0.5},
    )
    preview = lr_preview(config, 4)
    assert preview.lrs[0] == 1.0 and preview.lrs[2] == 0.5 and preview.lrs[4] == 0.25

    # OneCycleLR cannot be guessed from its name; the preview must match the class itself.
    kwargs = {"max_lr": 0.01, "total_steps": 50, "pct_start": 0.2, "cycle_momentum": False}
    config = OptimizerConfig(
        torch.optim.AdamW, {"lr": 0.01}, torch.optim.lr_scheduler.OneCycleLR, kwargs
    )
    preview = lr_preview(config, 40)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, **kwargs)
    expected = [optimizer.param_groups[0]["lr"]]
    for _ in range(40):
        optimizer.step()
        scheduler.step()
        expected.append(optimizer.param_groups[0]["lr"])
    assert preview.lrs == pytest.approx(expected)
    assert max(preview.lrs) == pytest.approx(0.01)


def test_lr_preview_notes_a_schedule_shorter_than_the_run():
    config = OptimizerConfig(
        torch.optim.AdamW,
        {"lr": 0.01},
        torch.optim.lr_scheduler.OneCycleLR,
        {"max_lr": 0.01, "total_steps": 5},
    )
    preview = lr_preview(config, 20)
    assert "fails at step" in (preview.note or "")


def test_report_shows_the_scheduler_values(tmp_path):
    job = tiny_job(tmp_path)
    job["strategy"]["optimizer_configs"]["main"][0].update(
        {
            "scheduler_cls": "torch.optim.lr_scheduler.StepLR",
            "scheduler_kwargs": {"step_size": 1, "gamma": 0.5},
        }
    )
    job["strategy"]["optimizer_configs"]["main"][0]["optimizer_kwargs"]["lr"] = 1.0
    text = _report(tmp_path, job).stderr
    assert "StepLR" in text
    assert "1.250e-01" in text  # lr after 3 steps: 1 * 0.5**3


def test_report_refuses_paths_outside_the_allow_list_unless_trusted(tmp_path):
    job = tiny_job(tmp_path)
    job["strategy"]["training_fn"] = "os.path.join"
    result = _report(tmp_path, job)
    assert_user_error(result, "strategy.training_fn", "allow-list", "--trust")
    assert _report(tmp_path, job, "--trust").exit_code == 0


def test_report_names_an_unknown_model_keyword(tmp_path):
    job = tiny_job(tmp_path)
    job["strategy"]["model_specs"]["main"]["hidden_chanels"] = 8
    assert_user_error(_report(tmp_path, job), "strategy.model_specs.main", "hidden_chanels")


def test_report_loads_no_data(tmp_path):
    job = tiny_job(tmp_path)
    job["dataset"]["path"] = str(tmp_path / "not_there.extxyz")
    result = _report(tmp_path, job)
    assert result.exit_code == 0 and "Missing local path" in result.stderr
    assert str(TRAIN) != job["dataset"]["path"]
