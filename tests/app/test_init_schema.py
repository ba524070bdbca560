"""``train init``, ``finetune init ...`` and ``schema dump|template`` write valid specs."""

from __future__ import annotations

import json

import pytest
import yaml

from nvalchemi.app.jobs.resolve import check_job
from nvalchemi.app.jobs.spec import TrainingJobSpec

from ._support import TRAIN, VAL, assert_user_error, invoke


def _job(text: str) -> TrainingJobSpec:
    job = TrainingJobSpec.model_validate(json.loads(text))
    check_job(job)  # every dotted path resolves through the allow-list
    return job


@pytest.mark.parametrize("policy", ["strict", "prediction_to_target", "target_to_prediction"])
def test_train_init_records_the_loss_dtype_policy(tmp_path, policy):
    out = tmp_path / "job.json"
    result = invoke(
        "train",
        "init",
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path / "run",
        "--loss-dtype-policy",
        policy,
        "--device",
        "cpu",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    assert f"Wrote {out}" in result.stderr
    assert (
        f"Created {out}: a job that trains PaiNN (built-in, nvalchemi.models.painn)"
        in result.stderr
    )
    job = _job(out.read_text())
    assert job.strategy.loss_fn_spec["dtype_policy"] == policy
    assert check_job(job).loss_fn.dtype_policy == policy


def test_train_init_scaffolds_a_runnable_painn_job_on_stdout(tmp_path):
    result = invoke(
        "train",
        "init",
        "--dataset",
        TRAIN,
        "--validation-dataset",
        VAL,
        "--output-dir",
        tmp_path / "run",
        "--num-epochs",
        3,
        "--device",
        "cpu",
    )
    assert result.exit_code == 0, result.stderr
    job = _job(result.stdout)
    assert job.workflow == "train" and job.source.model == "custom" and job.source.fit_to_data
    assert job.strategy.model_specs["main"]["cls_path"] == "nvalchemi.models.painn.PaiNN"
    assert job.strategy.num_epochs == 3 and job.strategy.num_steps is None and job.minutes is None
    # The recipe's schedule over exactly 3 epochs of the 2,400 structures in batches of 8.
    scheduler = job.strategy.optimizer_configs["main"][0]
    assert scheduler["scheduler_cls"] == "nvalchemi.training.time_budget.WarmupCosineLR"
    assert scheduler["scheduler_kwargs"]["total_steps"] == 3 * 300
    assert job.validation is not None and job.validation.every_n_epochs == 1
    assert job.dataset.validation_paths == [str(VAL)]
    hooks = [h.spec["cls_path"].rsplit(".", 1)[1] for h in job.source.hooks]
    assert hooks == ["CheckpointHook", "EMAHook", "GradientClipHook"]


def test_train_init_writes_yaml_for_a_yaml_path(tmp_path):
    out = tmp_path / "job.yaml"
    result = invoke(
        "train",
        "init",
        "--dataset",
        TRAIN,
        "--output-dir",
        "runs/x",
        "--model",
        "custom",
        "--device",
        "cpu",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(out.read_text())
    assert data["strategy"]["model_specs"] == {}
    TrainingJobSpec.model_validate(data)


def test_an_invalid_loss_dtype_policy_is_rejected_by_click(tmp_path):
    result = invoke(
        "train",
        "init",
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path,
        "--loss-dtype-policy",
        "loose",
    )
    assert result.exit_code == 2
    assert "'loose' is not one of" in result.stderr


def test_both_validation_cadences_are_one_error(tmp_path):
    result = invoke(
        "train",
        "init",
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path,
        "--val-fraction",
        0.1,
        "--validation-every-epochs",
        1,
        "--validation-every-steps",
        5,
    )
    assert_user_error(result, "Use only one of --validation-every-epochs and")


def test_finetune_init_checkpoint_fills_the_source_and_reuse_flags(tmp_path):
    result = invoke(
        "finetune",
        "init",
        "checkpoint",
        "runs/pre/checkpoints",
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path,
        "--lr",
        3e-5,
        "--trainable-pattern",
        "main.readout.*",
        "--use-original-loss",
        "--device",
        "cpu",
    )
    assert result.exit_code == 0, result.stderr
    job = _job(result.stdout)
    assert job.name == "native-checkpoint-fine-tune"
    assert job.source.model == "native-checkpoint"
    assert job.source.checkpoint_path == "runs/pre/checkpoints"
    assert job.source.use_original_loss and not job.source.use_original_opt_class
    assert job.source.optimizer_lr == 3e-5
    assert job.strategy.loss_fn_spec is None  # the checkpoint's loss is used
    assert job.strategy.trainable_patterns == ["main.readout.*"]


def test_finetune_init_mace_defaults_to_training_the_readouts(tmp_path):
    result = invoke(
        "finetune",
        "init",
        "mace",
        "models/small.model",
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path,
        "--device",
        "cpu",
    )
    assert result.exit_code == 0, result.stderr
    job = _job(result.stdout)
    assert job.source.checkpoint_path == "models/small.model"
    assert job.source.compile_model is False
    assert job.strategy.trainable_patterns == ["main.model.readouts.*"]
    named = invoke(
        "finetune",
        "init",
        "mace",
        "small-0b",
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path,
        "--device",
        "cpu",
    )
    assert _job(named.stdout).source.model_id == "small-0b"


def test_finetune_init_custom_records_the_weights_file(tmp_path):
    result = invoke(
        "finetune",
        "init",
        "custom",
        "weights.pt",
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path,
        "--device",
        "cpu",
    )
    assert result.exit_code == 0, result.stderr
    job = _job(result.stdout)
    assert job.source.model == "custom" and job.source.checkpoint_path == "weights.pt"


def test_schema_dump_has_one_json_schema_per_section_in_file_order(tmp_path):
    out = tmp_path / "schema.json"
    assert invoke("schema", "dump", "--out", out).exit_code == 0
    schema = json.loads(out.read_text())
    assert list(schema) == list(TrainingJobSpec.model_fields)  # name, workflow, minutes, ...
    for section in ("source", "dataset", "output", "strategy"):
        assert schema[section]["type"] == "object" and "properties" in schema[section], section
    assert set(schema["source"]["properties"]["model"]["enum"]) == {
        "native-checkpoint",
        "mace",
        "custom",
    }
    hook = schema["source"]["$defs"]["RuntimeHookSpec"]
    assert set(hook["properties"]) == {"spec", "stages"}
    assert hook["properties"]["spec"]["additionalProperties"] is True
    assert "optimizer_configs" in schema["strategy"]["properties"]
    assert schema["minutes"]["anyOf"][0]["type"] == "number"


def test_the_template_is_what_train_init_writes_and_valid():
    from nvalchemi.training.cli import TrainingJobSpec as exported

    template = exported.template()
    job = TrainingJobSpec.model_validate(template)
    check_job(job)
    assert template["minutes"] == 10.0 and template["strategy"].get("num_steps") is None
    assert template["strategy"]["model_specs"]["main"]["cls_path"] == "nvalchemi.models.painn.PaiNN"
    assert [h["spec"]["cls_path"].rsplit(".", 1)[1] for h in template["source"]["hooks"]] == [
        "CheckpointHook",
        "EMAHook",
        "GradientClipHook",
    ]
    assert TrainingJobSpec.model_validate(TrainingJobSpec.template("finetune", "mace"))


@pytest.mark.parametrize(
    "args", [("--workflow", "train"), ("--model", "native-checkpoint"), ("--model", "mace")]
)
def test_schema_templates_are_valid_jobs(args):
    result = invoke("schema", "template", *args)
    assert result.exit_code == 0, result.stderr
    _job(result.stdout)
