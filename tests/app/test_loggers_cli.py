"""``--logger`` and ``output.loggers``: which trackers a job logs to, and a resume continuing them.

W&B runs offline and MLflow writes a ``file:`` store (see ``tests/hooks/_tracker_files.py``).
"""

from __future__ import annotations

import re
import sys

import pytest
from _tracker_files import TRACKER_ENV, mlflow_run, mlflow_run_ids, wandb_run
from pydantic import ValidationError

from nvalchemi._optional import OptionalDependency
from nvalchemi.app.jobs.spec import OutputSpec
from nvalchemi.app.jobs.trackers import chosen_loggers, tensorboard_switch
from nvalchemi.training.checkpoint import CheckpointManifest

from ._support import assert_user_error, invoke, tiny_job, write_job

requires_trackers = pytest.mark.skipif(
    not (OptionalDependency.WANDB.is_available() and OptionalDependency.MLFLOW.is_available()),
    reason="trackers extra not installed",
)


def _job(**output):
    from types import SimpleNamespace

    return SimpleNamespace(output=OutputSpec(run_dir="run", **output))


def test_the_command_line_replaces_the_jobs_loggers_and_tensorboard_follows_them():
    assert chosen_loggers(_job()) is None  # unset: the job's tensorboard switch decides
    assert tensorboard_switch(_job(tensorboard=False), None) is False
    job = _job(loggers=["mlflow", "tensorboard", "mlflow"])
    assert chosen_loggers(job) == ["mlflow", "tensorboard"]
    assert chosen_loggers(job, ("wandb",)) == ["wandb"]
    assert tensorboard_switch(job, ["wandb"]) is False
    assert tensorboard_switch(job, ["tensorboard"]) is True
    assert tensorboard_switch(_job(loggers=[]), []) is False  # []: no tracker at all


def test_tensorboard_and_loggers_must_agree():
    with pytest.raises(ValidationError, match="tensorboard: true disagrees with loggers"):
        OutputSpec(run_dir="run", tensorboard=True, loggers=["wandb"])
    with pytest.raises(ValidationError, match="loggers"):
        OutputSpec(run_dir="run", loggers=["neptune"])
    OutputSpec(run_dir="run", tensorboard=True, loggers=["tensorboard", "wandb"])


def test_an_unknown_logger_is_refused_with_the_choices(tmp_path):
    result = invoke("spec", "run", tmp_path / "job.json", "--logger", "neptune")
    assert result.exit_code == 2
    assert "'neptune' is not one of 'tensorboard', 'wandb', 'mlflow'" in result.stderr


def test_a_missing_tracker_package_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    path = write_job(tmp_path / "job.json", tiny_job(tmp_path))
    result = invoke("spec", "run", path, "--no-report", "--logger", "wandb")
    assert_user_error(result, "output.loggers (--logger): wandb is not installed", fix="[trackers]")
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before training


@requires_trackers
def test_a_tracker_that_cannot_start_stops_the_job_before_training(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow 3 refuses file:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    path = write_job(tmp_path / "job.json", tiny_job(tmp_path))
    result = invoke("spec", "run", path, "--no-report", "--logger", "mlflow")
    assert_user_error(
        result,
        "output.loggers (--logger): MLflow could not start its run",
        fix="MLFLOW_TRACKING_URI",
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


def _run_ids(stderr: str) -> tuple[str, str]:
    wandb_id = re.search(r"W&B run:\s+(\S+)", stderr)
    mlflow_id = re.search(r"MLflow run:\s+(\S+)", stderr)
    assert wandb_id and mlflow_id, stderr
    return wandb_id.group(1), mlflow_id.group(1)


@requires_trackers
def test_a_job_logs_to_both_trackers_and_its_resume_continues_the_same_runs(tmp_path, monkeypatch):
    for key in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(key, raising=False)
    for key, value in TRACKER_ENV.items():
        monkeypatch.setenv(key, value)
    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    job = tiny_job(tmp_path, num_steps=4, checkpoint_every=2)
    job["output"].pop("tensorboard")
    job["output"]["loggers"] = ["wandb", "mlflow"]
    path = write_job(tmp_path / "job.json", job)
    result = invoke("spec", "run", path, "--no-report")
    assert result.exit_code == 0, result.output
    wandb_id, mlflow_id = _run_ids(result.stderr)
    run_dir = tmp_path / "run"
    assert not (run_dir / "tensorboard").exists()  # not in loggers

    ml = mlflow_run(uri, mlflow_id)
    assert ml["status"] == "FINISHED" and ml["experiment"] == "nvalchemi"
    assert ml["name"] == job["name"] and ml["params"]["job.name"] == job["name"]
    trained = ml["history"]["loss/total"]
    assert [step for step, _ in trained] == [1, 2, 3, 4]
    assert "final/forces_mae_eV_per_A" in ml["history"]
    assert {"final/by_group.json", "final/per_element.json"} <= set(ml["artifacts"])
    assert "plots/parity_forces.png" in ml["artifacts"]

    wb = wandb_run(run_dir, wandb_id)  # WANDB_DIR unset: the run directory
    assert wb["config"]["job"]["name"] == job["name"] and wb["exit_codes"] == [0]
    assert (
        wb["summary"]["final/forces_mae_eV_per_A"]
        == ml["history"]["final/forces_mae_eV_per_A"][0][1]
    )
    assert "final/by_group/nrows" in wb["summary"]
    assert any(f.startswith("media/images/plots/parity_forces") for f in wb["files"])

    root = run_dir / "checkpoints"
    halfway = next(e.index for e in CheckpointManifest.read(root).checkpoints if e.step_count == 2)
    result = invoke(
        "spec", "resume", root, "--spec", path, "--checkpoint-index", halfway,
        "--logger", "wandb", "--logger", "mlflow",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert _run_ids(result.stderr) == (wandb_id, mlflow_id)
    assert mlflow_run_ids(uri) == [mlflow_id]
    resumed = mlflow_run(uri, mlflow_id)["history"]["loss/total"]
    assert resumed[:4] == trained and [step for step, _ in resumed[4:]] == [3, 4]
    assert [v for _, v in resumed[4:]] == pytest.approx([v for _, v in trained[2:]])
    wb = wandb_run(run_dir, wandb_id)
    assert len(wb["sessions"]) == 2 and wb["exit_codes"] == [0, 0]


@requires_trackers
def test_the_quickstart_logs_training_and_the_test_split_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    for key, value in TRACKER_ENV.items():
        monkeypatch.setenv(key, value)
    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run = tmp_path / "qs"
    result = invoke("quickstart", "--quick", "--run-dir", run, "--logger", "mlflow")
    assert result.exit_code == 0, result.output
    (run_id,) = mlflow_run_ids(uri)
    assert f"MLflow run:       {run_id}" in result.stderr
    ml = mlflow_run(uri, run_id)
    assert ml["name"] == "quickstart" and ml["status"] == "FINISHED"
    steps = [step for step, _ in ml["history"]["loss/total"]]
    assert steps == sorted(steps) and steps[-1] == 12  # the quick run's 12 steps
    assert "test/forces_mae_eV_per_A" in ml["history"] and "test/by_group.json" in ml["artifacts"]
    assert "plots/parity_forces.png" in ml["artifacts"]
    assert not (run / "tensorboard").exists()  # --logger names the trackers
