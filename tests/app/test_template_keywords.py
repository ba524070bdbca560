"""``TrainingJobSpec.template()``: bare, the placeholder dict ``schema template`` prints; with
the reference's keywords (``dataset``, ``output_dir``, ...), a ``TrainingJobSpec``."""

from __future__ import annotations

import pytest

from nvalchemi.app.jobs import TrainingJobSpec

EMA = "nvalchemi.training.hooks.ema.EMAHook"


def test_called_bare_it_is_still_the_placeholder_dict():
    job = TrainingJobSpec.template()
    assert isinstance(job, dict) and job["workflow"] == "train" and job["minutes"] == 10.0
    finetune = TrainingJobSpec.template("finetune", "mace")
    assert isinstance(finetune, dict) and finetune["source"]["model"] == "mace"


def test_the_references_keywords_give_a_job_spec_of_your_data():
    job = TrainingJobSpec.template(
        workflow="finetune",
        model="native-checkpoint",
        dataset="data/new.extxyz",
        output_dir="runs/ft",
        source_path="runs/pre/checkpoints",
        trainable_patterns=("main.readout.*",),
        device="cpu",
    )
    assert isinstance(job, TrainingJobSpec)
    assert job.name == "native-checkpoint-fine-tune" and job.workflow == "finetune"
    assert job.source.model == "native-checkpoint"
    assert job.source.checkpoint_path == "runs/pre/checkpoints"
    assert job.dataset.all_paths == ["data/new.extxyz"]
    assert job.output.run_dir == "runs/ft" and job.output.checkpoint_dir == "runs/ft/checkpoints"
    assert job.strategy.num_steps == 1000 and job.strategy.num_epochs is None
    [config] = job.strategy.optimizer_configs["main"]
    assert config["optimizer_kwargs"]["lr"] == 1e-5
    assert job.strategy.trainable_patterns == ["main.readout.*"]
    assert job.strategy.devices == ["cpu"]
    assert TrainingJobSpec.model_validate_json(job.model_dump_json()) == job


def test_mace_sources_epochs_datasets_and_extra_hooks():
    hook = {"cls_path": EMA, "timestamp": "2026-01-01T00:00:00+00:00", "decay": 0.99}
    job = TrainingJobSpec.template(
        workflow="finetune",
        model="mace",
        dataset=("a.extxyz", "b.extxyz"),
        output_dir="runs/mace",
        model_id="small-0b",
        compile_model=False,
        lr=3e-5,
        num_epochs=4,
        hooks=(hook,),
        device="cpu",
    )
    assert job.name == "mace-fine-tune" and job.source.model_id == "small-0b"
    assert job.source.compile_model is False
    assert job.dataset.all_paths == ["a.extxyz", "b.extxyz"]
    assert job.strategy.num_epochs == 4 and job.strategy.num_steps is None
    assert job.strategy.optimizer_configs["main"][0]["optimizer_kwargs"]["lr"] == 3e-5
    assert [h.spec["cls_path"] for h in job.source.hooks][-1] == EMA


def test_a_training_job_leaves_the_model_to_you():
    job = TrainingJobSpec.template(
        workflow="train", model="custom", dataset="d.extxyz", output_dir="runs/t", device="cpu"
    )
    assert job.name == "train-from-scratch" and job.strategy.model_specs == {}


def test_half_the_keywords_is_a_type_error():
    with pytest.raises(TypeError, match="both dataset= and output_dir="):
        TrainingJobSpec.template(workflow="train", model="custom", dataset="d.extxyz")
    with pytest.raises(TypeError, match="without dataset= and output_dir="):
        TrainingJobSpec.template("finetune", "mace", model_id="small-0b")
