"""Job-file paths relative to the job file, ``--num-steps`` beyond a schedule, finished runs."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from nvalchemi._errors import FieldError
from nvalchemi.app.jobs.checks import check_horizons
from nvalchemi.app.jobs.resolve import load_job
from nvalchemi.training.checkpoint import CheckpointManifest, read_strategy_metadata

from ._support import TRAIN, VAL, assert_user_error, invoke, tiny_job, write_job

COSINE = "torch.optim.lr_scheduler.CosineAnnealingLR"


def test_job_paths_are_relative_to_the_job_file_and_options_to_the_cwd(tmp_path, monkeypatch):
    jobs, elsewhere = tmp_path / "jobs", tmp_path / "elsewhere"
    (jobs / "data").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(TRAIN, jobs / "data" / "train.extxyz")
    shutil.copy(VAL, elsewhere / "val.extxyz")
    job = tiny_job(tmp_path, num_steps=1, structures=8)  # total_steps = 1
    job["dataset"].update({"path": "data/train.extxyz"})
    job["output"].update({"run_dir": "run", "checkpoint_dir": "run/checkpoints"})
    job["source"]["hooks"][0]["spec"]["checkpoint_dir"] = "run/checkpoints"
    write_job(jobs / "job.json", job)
    monkeypatch.chdir(elsewhere)
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the CLI prints warnings; shown even under -W ignore
        result = invoke(
            "spec",
            "run",
            "../jobs/job.json",
            "--no-report",
            "--num-steps",
            2,
            "--validation-dataset",
            "val.extxyz",
        )
    assert result.exit_code == 0, result.output
    assert (jobs / "run" / "checkpoints" / "manifest.json").is_file()
    assert not (elsewhere / "run").exists()
    assert "data: 8 training / 8 validation structures" in result.stderr  # val.extxyz from CWD
    ran = json.loads((jobs / "run" / "job.json").read_text())
    assert ran["dataset"]["path"] == str(jobs / "data" / "train.extxyz")  # absolute, re-runnable
    # --num-steps 2 outlives the job's schedule (total_steps = 1): a warning says so.
    warning = next(line for line in result.stderr.splitlines() if "total_steps = 1" in line)
    assert "WarmupCosineLR" in warning and "--num-steps 2" in warning


def test_init_out_writes_paths_relative_to_the_job_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(
        "train",
        "init",
        "--dataset",
        TRAIN,
        "--validation-dataset",
        "data/val.xyz",
        "--output-dir",
        "runs/x",
        "--device",
        "cpu",
        "--out",
        "configs/job.json",
    )
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "configs" / "job.json").read_text())
    assert written["dataset"]["path"] == str(TRAIN)  # absolute stays absolute
    assert written["dataset"]["validation_path"] == "../data/val.xyz"
    assert written["output"]["run_dir"] == "../runs/x"
    job, _ = load_job("configs/job.json")
    assert job.output.run_dir == str(tmp_path / "runs" / "x")
    assert job.dataset.validation_paths == [str(tmp_path / "data" / "val.xyz")]


def test_schedule_horizons():
    configs = {"main": [{"scheduler_cls": COSINE, "scheduler_kwargs": {"T_max": 10}}]}
    assert check_horizons(configs, 10) == []  # covered
    assert check_horizons(configs, 5) == []  # a smoke test shorter than the schedule is fine
    with pytest.warns(UserWarning, match=r"ends at step 10 \(T_max = 10\).*--num-steps 20"):
        check_horizons(configs, 20)
    one_cycle = {
        "main": [
            {
                "scheduler_cls": "torch.optim.lr_scheduler.OneCycleLR",
                "scheduler_kwargs": {"max_lr": 1e-3, "total_steps": 10},
            }
        ]
    }
    with pytest.raises(FieldError, match=r"scheduler_kwargs\.total_steps.*Fix: set"):
        check_horizons(one_cycle, 11)


def test_resuming_a_finished_run_says_so_and_how_to_extend_it(trained_run):
    root = trained_run["checkpoints"]
    before = CheckpointManifest.read(root).entry("latest").index
    result = invoke("spec", "resume", root, "--spec", trained_run["job_path"])
    assert result.exit_code == 0, result.output
    assert "already complete (step 4 of num_steps = 4)" in result.stderr
    assert "--num-steps N" in result.stderr and "N > 4" in result.stderr
    assert "Run summary" not in result.stderr
    assert CheckpointManifest.read(root).entry("latest").index == before  # nothing written
    result = invoke("spec", "resume", root, "--spec", trained_run["job_path"], "--num-steps", 4)
    assert_user_error(result, "--num-steps", "not beyond the 4", fix="more than 4")


def _copy_of_the_run(tmp_path, trained_run):
    """A copy of the trained run's checkpoints and a job file that points at it."""
    job = json.loads(json.dumps(trained_run["job"]))
    root = tmp_path / "checkpoints"
    shutil.copytree(trained_run["checkpoints"], root)
    job["source"]["hooks"][0]["spec"]["checkpoint_dir"] = str(root)
    job["output"].update({"run_dir": str(tmp_path / "run"), "checkpoint_dir": str(root)})
    return root, write_job(tmp_path / "job.json", job)


def test_resume_num_steps_extends_a_finished_run(tmp_path, trained_run):
    root, path = _copy_of_the_run(tmp_path, trained_run)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        result = invoke("spec", "resume", root, "--spec", path, "--num-steps", 5)
    assert result.exit_code == 0, result.output
    meta = read_strategy_metadata(root)
    assert meta["runtime_state"]["step_count"] == 5 and meta["num_steps"] == 5
    warning = next(line for line in result.stderr.splitlines() if "total_steps = 4" in line)
    assert "--num-steps 5" in warning and "a resumed run keeps the schedule" in warning


def test_resume_on_another_number_of_ranks_is_refused_with_a_fix(trained_run, monkeypatch):
    root = trained_run["checkpoints"]
    halfway = next(e.index for e in CheckpointManifest.read(root).checkpoints if e.step_count == 2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun --nproc_per_node=2
    result = invoke(
        "spec", "resume", root, "--spec", trained_run["job_path"], "--checkpoint-index", halfway
    )
    assert_user_error(
        result,
        "launch (world size)",
        "trained on 1 rank(s)",
        "runs on 2",
        fix="resume in one process",
    )


def test_resume_lr_overrides_the_learning_rate_and_is_recorded(tmp_path, trained_run):
    root, path = _copy_of_the_run(tmp_path, trained_run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = invoke("spec", "resume", root, "--spec", path, "--num-steps", 5, "--lr", 1e-5)
    assert result.exit_code == 0, result.output
    meta = read_strategy_metadata(root)
    assert meta["optimizer_configs"]["main"][0]["optimizer_kwargs"]["lr"] == 1e-5
    events = {h["event"]: h for h in CheckpointManifest.read(root).history}
    assert events["resume_overrides"]["overrides"]["optimizer_kwargs"] == {"lr": 1e-5}
    result = invoke("spec", "resume", root, "--spec", path, "--num-steps", 6, "--lr", 0)
    assert result.exit_code != 0 and "--lr" in result.output
