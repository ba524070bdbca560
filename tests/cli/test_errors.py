"""Every user error exits 1 with one paragraph naming the field and the fix; no traceback."""

from __future__ import annotations

import json

from ._support import TRAIN, assert_user_error, invoke, run_cli, tiny_job, write_job


def _run(tmp_path, job, *args):
    return invoke("spec", "run", write_job(tmp_path / "job.json", job), "--no-report", *args)


def test_missing_job_file(tmp_path):
    assert_user_error(invoke("spec", "report", tmp_path / "nope.json"), "does not exist", "init")


def test_unparsable_json_and_yaml(tmp_path):
    bad_json = tmp_path / "job.json"
    bad_json.write_text('{"workflow": "train",')
    assert_user_error(invoke("spec", "report", bad_json), f"Could not parse {bad_json}")
    bad_yaml = tmp_path / "job.yaml"
    bad_yaml.write_text("workflow: [train\n")
    assert_user_error(invoke("spec", "report", bad_yaml), f"Could not parse {bad_yaml}")


def test_a_misspelled_field_is_named(tmp_path):
    job = tiny_job(tmp_path)
    job["dataset"]["batchsize"] = 4
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(result, "dataset.batchsize", "Extra inputs are not permitted")


def test_an_out_of_range_value_is_named(tmp_path):
    job = tiny_job(tmp_path)
    job["dataset"]["batch_size"] = 0
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(result, "dataset.batch_size", "greater than or equal to 1", "(got 0)")


def test_an_unknown_class_is_named(tmp_path):
    job = tiny_job(tmp_path)
    job["strategy"]["model_specs"]["main"]["cls_path"] = "nvalchemi.models.nope.Model"
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(result, "strategy.model_specs.main", "nvalchemi.models.nope.Model")


def test_an_unsafe_hook_is_refused(tmp_path):
    job = tiny_job(tmp_path)
    job["source"]["hooks"].append({"spec": {"cls_path": "os.system", "command": "true"}})
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(result, "source.hooks[3].spec", "Refusing to import 'os.system'", "--trust")


def test_invalid_combinations(tmp_path):
    job = tiny_job(tmp_path, "--model", "custom")
    job["dataset"].pop("val_fraction")
    job["validation"] = {"every_n_epochs": 1}
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(result, "validation block needs validation data", "val_fraction")

    job = tiny_job(tmp_path)
    job["source"]["use_original_loss"] = True
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(result, "source.use_original_loss only applies to 'native-checkpoint'")

    job = tiny_job(tmp_path)
    job["strategy"]["num_epochs"] = 2
    result = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert_user_error(result, "exactly one of num_epochs and num_steps")


def test_run_names_a_missing_data_file(tmp_path):
    job = tiny_job(tmp_path)
    job["dataset"]["path"] = str(tmp_path / "missing.extxyz")
    assert_user_error(_run(tmp_path, job), "dataset.path", "missing.extxyz does not exist")


def test_run_needs_a_model_for_training_from_scratch(tmp_path):
    job = tiny_job(tmp_path, "--model", "custom")
    assert_user_error(_run(tmp_path, job), "strategy.model_specs", "training-from-scratch")


def test_a_fresh_run_refuses_an_existing_checkpoint_root(tmp_path, trained_run):
    result = invoke("spec", "run", trained_run["job_path"], "--no-report")
    assert_user_error(result, "already holds checkpoints", "spec resume")


def test_mace_files_need_trust(tmp_path):
    model = tmp_path / "small.model"
    model.write_bytes(b"not really a model")
    result = invoke("finetune", "init", "mace", model, "--dataset", TRAIN, "--output-dir",
                    tmp_path / "ft", "--device", "cpu")  # fmt: skip
    job = json.loads(result.stdout)
    job["dataset"]["max_structures"] = 4
    assert_user_error(_run(tmp_path, job), "source.checkpoint_path", "pickles", "--trust")


def test_evaluate_and_resume_name_a_missing_checkpoint(tmp_path):
    result = invoke("evaluate", tmp_path / "ckpt", "--dataset", TRAIN)
    assert_user_error(result, "CHECKPOINT_DIR", "no manifest.json")
    job = write_job(tmp_path / "job.json", tiny_job(tmp_path))
    result = invoke("spec", "resume", tmp_path / "ckpt", "--spec", job)
    assert_user_error(result, "no checkpoints")


def test_data_commands_name_bad_inputs(tmp_path):
    result = invoke("data", "convert", tmp_path / "in.extxyz", tmp_path / "out.zarr")
    assert_user_error(result, "INPUT", "in.extxyz does not exist")
    result = invoke("data", "stats", tmp_path / "data.csv")
    assert_user_error(result, "does not exist")
    weird = tmp_path / "data.csv"
    weird.write_text("x")
    assert_user_error(invoke("data", "stats", weird), "cannot tell the format", "dataset.format")


def test_quickstart_resume_without_a_run_and_bad_devices(tmp_path):
    result = invoke("quickstart", "--resume", "--run-dir", tmp_path / "qs")
    assert_user_error(result, "--resume", "no quickstart run to resume")
    result = invoke("quickstart", "--device", "gpu", "--run-dir", tmp_path / "qs")
    assert_user_error(result, "--device", "'gpu' is not a device")


def test_subprocess_errors_have_no_traceback_unless_debug(tmp_path):
    missing = tmp_path / "nope.yaml"
    plain = run_cli("spec", "report", missing)
    assert_user_error(plain, "does not exist")
    debug = run_cli("--debug", "spec", "run", missing)
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr
