"""Every user error exits 1 with one paragraph naming the field and the fix; no traceback."""

from __future__ import annotations

import json

import pytest

from ._support import TRAIN, assert_user_error, invoke, run_cli, tiny_job, write_job


def _run(tmp_path, job, *args):
    return invoke("spec", "run", write_job(tmp_path / "job.json", job), "--no-report", *args)


def test_missing_job_file(tmp_path):
    result = invoke("spec", "report", tmp_path / "nope.json")
    assert_user_error(result, "does not exist", fix="train init")


def test_unparsable_json_and_yaml(tmp_path):
    bad_json = tmp_path / "job.json"
    bad_json.write_text('{"workflow": "train",')
    assert_user_error(
        invoke("spec", "report", bad_json), f"Could not parse {bad_json}", fix="double-quoted keys"
    )
    bad_yaml = tmp_path / "job.yaml"
    bad_yaml.write_text("workflow: [train\n")
    assert_user_error(
        invoke("spec", "report", bad_yaml), f"Could not parse {bad_yaml}", fix="closed brackets"
    )


def test_a_misspelled_field_is_named(tmp_path):
    job = tiny_job(tmp_path)
    job["dataset"]["batchsize"] = 4
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(
        result, "dataset.batchsize", "Extra inputs are not permitted", fix="schema dump"
    )


def test_an_out_of_range_value_is_named(tmp_path):
    job = tiny_job(tmp_path)
    job["dataset"]["batch_size"] = 0
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(
        result, "dataset.batch_size", "must be >= 1", "(got 0)", fix="correct the field"
    )


def test_an_unknown_class_is_named(tmp_path):
    job = tiny_job(tmp_path)
    job["strategy"]["model_specs"]["main"]["cls_path"] = "nvalchemi.models.nope.Model"
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(
        result,
        "strategy.model_specs.main",
        "nvalchemi.models.nope.Model",
        fix="check the spelling and the import path",
    )

    job["strategy"]["model_specs"]["main"]["cls_path"] = "nvalchemi.models.painn.PaiNNX"
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(
        result,
        "strategy.model_specs.main",
        "PaiNNX",
        fix="did you mean 'nvalchemi.models.painn.PaiNN'?",
    )

    job = tiny_job(tmp_path)
    job["strategy"]["loss_fn_spec"]["components"][1]["cls_path"] += "s"  # ForceMSELosss
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(
        result,
        "strategy.loss_fn_spec",
        "ForceMSELosss",
        fix="did you mean 'nvalchemi.training.losses.terms.ForceMSELoss'?",
    )


def _optimizer(job):
    return job["strategy"]["optimizer_configs"]["main"][0]


def test_optimizer_errors_name_the_field_and_the_fix(tmp_path):
    where = "strategy.optimizer_configs.main[0]"
    job = tiny_job(tmp_path)
    _optimizer(job)["optimizer_cls"] = "torch.optim.AdamWW"
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(
        result, f"{where}.optimizer_cls", "AdamWW", fix="did you mean 'torch.optim.AdamW'?"
    )

    job = tiny_job(tmp_path)
    _optimizer(job)["optimizer_kwargs"]["lrr"] = _optimizer(job)["optimizer_kwargs"].pop("lr")
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(
        result, f"{where}.optimizer_kwargs.lrr", "AdamW accepts", fix="remove or respell"
    )

    job = tiny_job(tmp_path)
    _optimizer(job)["optimizer_kwargs"]["lr"] = -1
    result = invoke("spec", "run", write_job(tmp_path / "job.json", job), "--no-report")
    assert_user_error(
        result,
        f"{where}.optimizer_kwargs.lr",
        "Invalid learning rate",
        fix="give lr a valid value (got -1",
    )


def test_cuda_on_a_machine_without_it_is_refused_before_building(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    job = tiny_job(tmp_path)
    job["strategy"]["devices"] = ["cuda"]
    result = _run(tmp_path, job)
    assert_user_error(result, "strategy.devices", "'cuda' asks for CUDA", fix="--map-location cpu")
    assert "data:" not in result.stderr  # nothing was read or built
    result = _run(tmp_path, tiny_job(tmp_path), "--map-location", "cuda:0")
    assert_user_error(result, "--map-location", "not available", fix="--map-location cpu")


def test_an_unsafe_hook_is_refused(tmp_path):
    job = tiny_job(tmp_path)
    job["source"]["hooks"].append({"spec": {"cls_path": "os.system", "command": "true"}})
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(
        result, "source.hooks[3].spec", "Refusing to import 'os.system'", fix="--trust"
    )


def test_invalid_combinations(tmp_path):
    job = tiny_job(tmp_path, "--model", "custom")
    job["dataset"].pop("val_fraction")
    job["validation"] = {"every_n_epochs": 1}
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(
        result, "validation block needs validation data", "val_fraction", fix="correct the field"
    )

    job = tiny_job(tmp_path)
    job["source"]["use_original_loss"] = True
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(
        result,
        "source.use_original_loss only applies to 'native-checkpoint'",
        fix="correct the field",
    )

    job = tiny_job(tmp_path)
    job["strategy"]["num_epochs"] = 2
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(result, "exactly one of num_epochs and num_steps", fix="correct the field")


def test_run_names_a_missing_data_file(tmp_path):
    job = tiny_job(tmp_path)
    job["dataset"]["path"] = str(tmp_path / "missing.extxyz")
    assert_user_error(
        _run(tmp_path, job),
        "dataset.path",
        "missing.extxyz does not exist",
        fix="give the path of an",
    )


def test_run_needs_a_model_for_training_from_scratch(tmp_path):
    job = tiny_job(tmp_path, "--model", "custom")
    assert_user_error(
        _run(tmp_path, job),
        "strategy.model_specs",
        "training-from-scratch",
        fix="train init --model painn",
    )


def test_a_fresh_run_refuses_an_existing_checkpoint_root(tmp_path, trained_run):
    result = invoke("spec", "run", trained_run["job_path"], "--no-report")
    assert_user_error(result, "already holds checkpoints", fix="spec resume")


def test_mace_files_need_trust(tmp_path):
    model = tmp_path / "small.model"
    model.write_bytes(b"not really a model")
    result = invoke(
        "finetune",
        "init",
        "mace",
        model,
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path / "ft",
        "--device",
        "cpu",
    )
    job = json.loads(result.stdout)
    job["dataset"]["max_structures"] = 4
    assert_user_error(_run(tmp_path, job), "source.checkpoint_path", "pickles", fix="--trust")


def test_evaluate_and_resume_name_a_missing_checkpoint(tmp_path):
    result = invoke("evaluate", tmp_path / "ckpt", "--dataset", TRAIN)
    assert_user_error(result, "CHECKPOINT_DIR", "no manifest.json", fix="checkpoint root")
    job = write_job(tmp_path / "job.json", tiny_job(tmp_path))
    result = invoke("spec", "resume", tmp_path / "ckpt", "--spec", job)
    assert_user_error(result, "CHECKPOINT_DIR", "no checkpoints", fix="output.checkpoint_dir")


def test_data_commands_name_bad_inputs(tmp_path):
    result = invoke("data", "convert", tmp_path / "in.extxyz", tmp_path / "out.zarr")
    assert_user_error(result, "INPUT", "in.extxyz does not exist", fix="give the path of an")
    result = invoke("data", "stats", tmp_path / "data.csv")
    assert_user_error(result, "PATH", "does not exist", fix="give the path of an")
    weird = tmp_path / "data.csv"
    weird.write_text("x")
    assert_user_error(
        invoke("data", "stats", weird), "cannot tell the format", fix="dataset.format"
    )


def test_quickstart_resume_without_a_run_and_bad_devices(tmp_path):
    result = invoke("quickstart", "--resume", "--run-dir", tmp_path / "qs")
    assert_user_error(result, "--resume", "no quickstart run to resume", fix="without --resume")
    result = invoke("quickstart", "--device", "gpu", "--run-dir", tmp_path / "qs")
    assert_user_error(result, "--device", "'gpu' is not a device", fix="--device cpu")


def test_subprocess_errors_have_no_traceback_unless_debug(tmp_path):
    missing = tmp_path / "nope.yaml"
    plain = run_cli("spec", "report", missing)
    assert_user_error(plain, "does not exist", fix="train init")
    debug = run_cli("--debug", "spec", "run", missing)
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr


# ---------------------------------------------- where the machine says no (issue 30, point 11)
def _unwritable_dir(tmp_path):
    """A directory this process cannot write in (root ignores permission bits: then a
    kernel folder, where even root may not create files)."""
    import os
    from pathlib import Path

    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    for candidate in (folder, Path("/sys/kernel")):
        try:
            os.rmdir(os.path.join(candidate, os.path.basename(_mkdtemp(candidate))))
        except OSError:
            return candidate
    pytest.skip("no directory here refuses writes to this process")


def _mkdtemp(folder):
    import tempfile

    return tempfile.mkdtemp(dir=folder)


@pytest.mark.parametrize("where", ["run_dir", "checkpoint_dir", "run_dir_parent"])
def test_an_unwritable_run_dir_or_checkpoint_root_is_named_before_anything_runs(tmp_path, where):
    locked = _unwritable_dir(tmp_path)
    job = tiny_job(tmp_path, num_steps=1)
    job["output"]["tensorboard"] = True  # its writer thread must not get to fail
    if where == "checkpoint_dir":
        target, field = locked / "checkpoints", "CheckpointHook.checkpoint_dir"
        job["source"]["hooks"][0]["spec"]["checkpoint_dir"] = str(target)
        job["output"]["checkpoint_dir"] = str(target)
    else:
        target = locked if where == "run_dir" else locked / "new" / "run"
        field = "output.run_dir"
        job["output"]["run_dir"] = str(target)
    result = _run(tmp_path, job)
    assert_user_error(result, field, str(locked), fix="writable")
    assert "data:" not in result.stderr  # refused before the data is read
    assert "Traceback" not in result.stderr and "may be a bug" not in result.stderr


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_minutes_must_be_finite(tmp_path, value):
    job = tiny_job(tmp_path, num_steps=1)
    for result in (
        _run(tmp_path, job, "--minutes", value),
        invoke("quickstart", "--quick", "--minutes", value, "--run-dir", tmp_path / "qs"),
    ):
        assert result.exit_code == 2, result.output
        assert "--minutes" in result.stderr and "finite" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "qs").exists()


def test_minutes_gives_a_job_without_a_length_its_length(tmp_path):
    job = tiny_job(tmp_path)
    job["strategy"].update(num_steps=None, num_epochs=None)
    job.pop("minutes", None)
    job["output"]["plots"] = False
    result = _run(tmp_path, job)
    assert_user_error(result, "the job has no length", fix="correct")
    result = _run(tmp_path, job, "--minutes", 0.02)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "job.json").read_text())["minutes"] == 0.02


def test_threads_beyond_the_machine_are_capped_with_a_warning(tmp_path):
    import os

    cores = len(os.sched_getaffinity(0))
    job = tiny_job(tmp_path, num_steps=1)
    job["output"]["plots"] = False
    path = write_job(tmp_path / "job.json", job)
    result = run_cli("spec", "run", path, "--no-report", "--threads", 4096, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"warning: --threads 4096 is more than the {cores} CPU core" in result.stderr
