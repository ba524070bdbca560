"""``spec run`` / ``spec resume``: files written, patterns and reuse flags honoured, exact resume."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from _ranks import run_torchrun

from nvalchemi.app.jobs import TrainingJobSpec
from nvalchemi.hooks.reporting import read_metrics
from nvalchemi.training.checkpoint import (
    CheckpointManifest,
    load_models_from_checkpoint,
    read_strategy_metadata,
)

from ._support import TEST, TRAIN, VAL, invoke, is_png, tiny_job, write_job


def _weights(root, index="latest"):
    model = load_models_from_checkpoint(root, index, "cpu", use_ema=False)["main"]
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _indices(root):
    return sorted(entry.index for entry in CheckpointManifest.read(root).checkpoints)


def test_run_writes_checkpoints_metrics_and_plots(trained_run):
    run = trained_run["run_dir"]
    assert (trained_run["checkpoints"] / "manifest.json").is_file()
    assert "data: 12 training / 4 validation structures" in trained_run["output"]
    assert "Final model (EMA weights) on the validation data" in trained_run["output"]
    rows = read_metrics(run / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    validation = [r for r in rows if r["kind"] == "validation"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(isinstance(r["loss/total"], float) for r in train)
    assert validation and "validation/forces_mae_eV_per_A" in validation[-1]
    assert is_png(run / "learning_curves.png")
    # Parity plots of the final (EMA) model on the validation split, listed in the summary.
    for name in ("parity_energy_per_atom.png", "parity_forces.png"):
        assert is_png(run / name), name
        assert f"plot:          {run / name}" in trained_run["output"]
    final = json.loads((run / "final_evaluation.json").read_text())
    assert final["weights"] == "ema" and final["metrics"]["num_structures"] == 4
    assert json.loads((run / "job.json").read_text())["workflow"] == "train"
    meta = read_strategy_metadata(trained_run["checkpoints"])
    assert meta["runtime_state"]["step_count"] == 4


def test_train_jobs_honour_trainable_patterns(tmp_path):
    job = tiny_job(
        tmp_path, "--trainable-pattern", "main.readout.*", num_steps=3, checkpoint_every=1
    )
    assert invoke("spec", "run", write_job(tmp_path / "j.json", job), "--no-report").exit_code == 0
    root = tmp_path / "run" / "checkpoints"
    meta = read_strategy_metadata(root)
    assert meta["strategy_cls"] == "nvalchemi.training.finetune.FineTuningStrategy"
    assert meta["trainable_patterns"] == ["main.readout.*"]
    first, last = _weights(root, _indices(root)[0]), _weights(root)
    changed = {name for name in first if not torch.equal(first[name], last[name])}
    assert changed and all(name.startswith("readout.") for name in changed)


def test_train_jobs_honour_freeze_patterns(tmp_path):
    job = tiny_job(
        tmp_path, "--freeze-pattern", "main.embedding.*", num_steps=3, checkpoint_every=1
    )
    assert invoke("spec", "run", write_job(tmp_path / "j.json", job), "--no-report").exit_code == 0
    root = tmp_path / "run" / "checkpoints"
    first, last = _weights(root, _indices(root)[0]), _weights(root)
    assert torch.equal(first["embedding.weight"], last["embedding.weight"])
    assert not torch.equal(first["readout.0.weight"], last["readout.0.weight"])


def _finetune_job(tmp_path, pretrained, *flags, reuse=False):
    result = invoke(
        "finetune",
        "init",
        "checkpoint",
        pretrained,
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path / "ft",
        "--num-steps",
        2,
        "--batch-size",
        4,
        "--lr",
        2e-5,
        "--device",
        "cpu",
        "--no-stress",  # the pretraining recipe below has two terms (energy, forces)
        *flags,
    )
    assert result.exit_code == 0, result.output
    job = json.loads(result.stdout)
    job["dataset"].update({"max_structures": 8, "in_memory": True})
    job["output"]["tensorboard"] = False
    # A payload recipe that differs from the pretraining one (AdamW, weights 10 / 1).
    config = job["strategy"]["optimizer_configs"]["main"][0]
    config.update(
        {
            "optimizer_cls": "torch.optim.SGD",
            "optimizer_kwargs": {"lr": 0.5},
            "scheduler_cls": None,
            "scheduler_kwargs": {},
        }
    )
    job["strategy"]["loss_fn_spec"]["weights"] = [1.0, 100.0]
    job["source"].update({"use_original_loss": reuse, "use_original_opt_class": reuse})
    return job


def test_use_original_loss_and_opt_class_take_effect(tmp_path, trained_run):
    pretrained = trained_run["checkpoints"]
    job = _finetune_job(tmp_path, pretrained, "--trainable-pattern", "main.readout.*")
    result = invoke("spec", "run", write_job(tmp_path / "ft.json", job), "--no-report")
    assert result.exit_code == 0, result.output
    meta = read_strategy_metadata(tmp_path / "ft" / "checkpoints")
    config = meta["optimizer_configs"]["main"][0]
    assert config["optimizer_cls"] == "torch.optim.sgd.SGD"
    assert meta["loss_fn_spec"]["weights"] == [1.0, 100.0]

    other = tmp_path / "reuse"
    job = _finetune_job(other, pretrained, reuse=True)
    result = invoke("spec", "run", write_job(tmp_path / "reuse.json", job), "--no-report")
    assert result.exit_code == 0, result.output
    meta = read_strategy_metadata(other / "ft" / "checkpoints")
    config = meta["optimizer_configs"]["main"][0]
    assert config["optimizer_cls"] == "torch.optim.adamw.AdamW"  # the pretraining optimizer
    assert config["optimizer_kwargs"]["lr"] == 2e-5  # with lr = source.optimizer_lr
    assert meta["loss_fn_spec"]["weights"] == [10.0, 1.0]  # the pretraining loss


def test_finetune_init_reuse_flags_make_a_runnable_job(tmp_path, trained_run):
    result = invoke(
        "finetune",
        "init",
        "checkpoint",
        trained_run["checkpoints"],
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path / "ft",
        "--num-steps",
        1,
        "--batch-size",
        4,
        "--use-original-loss",
        "--use-original-opt-class",
        "--lr",
        3e-5,
        "--device",
        "cpu",
    )
    job = json.loads(result.stdout)
    assert "loss_fn_spec" not in job["strategy"] and "optimizer_configs" not in job["strategy"]
    job["dataset"].update({"max_structures": 4, "in_memory": True})
    job["output"]["tensorboard"] = False
    result = invoke("spec", "run", write_job(tmp_path / "ft.json", job))
    assert result.exit_code == 0, result.output
    assert "from the source checkpoint (use_original_loss)" in result.stderr  # the report
    meta = read_strategy_metadata(tmp_path / "ft" / "checkpoints")
    assert meta["optimizer_configs"]["main"][0]["optimizer_kwargs"]["lr"] == 3e-5
    assert meta["loss_fn_spec"]["weights"] == [10.0, 1.0]


def test_resume_continues_exactly(tmp_path, trained_run):
    job = json.loads(json.dumps(trained_run["job"]))
    root = tmp_path / "checkpoints"
    shutil.copytree(trained_run["checkpoints"], root)
    job["source"]["hooks"][0]["spec"]["checkpoint_dir"] = str(root)
    job["output"].update({"run_dir": str(tmp_path / "run"), "checkpoint_dir": str(root)})
    path = write_job(tmp_path / "job.json", job)
    halfway = next(e.index for e in CheckpointManifest.read(root).checkpoints if e.step_count == 2)
    result = invoke("spec", "resume", root, "--spec", path, "--checkpoint-index", halfway)
    assert result.exit_code == 0, result.output
    assert read_strategy_metadata(root)["runtime_state"]["step_count"] == 4
    resumed, original = _weights(root), _weights(trained_run["checkpoints"])
    assert all(torch.equal(resumed[k], original[k]) for k in original)
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps and min(steps) == 3  # the resumed run logged steps 3 and 4


def test_the_same_job_twice_gives_bitwise_identical_weights(tmp_path, trained_run):
    job = json.loads(json.dumps(trained_run["job"]))  # the fixture's job, another directory
    root = tmp_path / "checkpoints"
    job["source"]["hooks"][0]["spec"]["checkpoint_dir"] = str(root)
    job["output"].update({"run_dir": str(tmp_path / "run"), "checkpoint_dir": str(root)})
    torch.manual_seed(1234)  # whatever state the process is in, the job's seed decides
    result = invoke("spec", "run", write_job(tmp_path / "job.json", job), "--no-report")
    assert result.exit_code == 0, result.output
    again, first = _weights(root), _weights(trained_run["checkpoints"])
    assert all(torch.equal(again[k], first[k]) for k in first)


def test_zarr_store_multiple_files_and_tensorboard(tmp_path):
    store = tmp_path / "val.zarr"
    result = invoke("data", "convert", VAL, store, "--cutoff", 4.0, "--max-structures", 12)
    assert result.exit_code == 0, result.output
    job = tiny_job(tmp_path, "--validation-dataset", TEST, num_steps=2)
    job["dataset"].pop("path")
    job["dataset"]["paths"] = [str(TRAIN), str(store)]
    job["dataset"]["max_structures"] = 6
    job["output"]["tensorboard"] = True
    result = invoke("spec", "run", write_job(tmp_path / "job.json", job), "--no-report")
    assert result.exit_code == 0, result.output
    assert "data: 12 training / 6 validation structures from 2 source(s)" in result.stderr
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events


@pytest.mark.distributed
def test_spec_run_under_torchrun_trains_with_ddp(tmp_path):
    job = tiny_job(tmp_path, num_steps=2, structures=16)
    path = write_job(tmp_path / "job.json", job)
    args = ["-m", "nvalchemi.training.cli", "spec", "run", path, "--ddp-backend", "gloo"]
    result = run_torchrun(args, cwd=tmp_path)  # exit code 0 is checked by run_torchrun
    assert result.stderr.count("Run summary") == 1  # rank 0 reports
    assert "distributed: 2 ranks (torchrun launch)" in result.stderr
    assert "structures/s are per rank" in result.stderr
    meta = read_strategy_metadata(tmp_path / "run" / "checkpoints")
    assert meta["runtime_state"]["step_count"] == 2
    assert meta["runtime_state"]["global_step_count"] == 4  # two ranks


def test_resume_warns_only_about_job_hooks_the_job_dropped(tmp_path):
    job = tiny_job(tmp_path, num_steps=2, checkpoint_every=1)
    path = write_job(tmp_path / "job.json", job)
    result = invoke("spec", "run", path, "--no-report", "--minutes", 60)  # adds TimeBudgetHook
    assert result.exit_code == 0, result.output
    root = tmp_path / "run" / "checkpoints"
    first = next(e.index for e in CheckpointManifest.read(root).checkpoints if e.step_count == 1)
    job["source"]["hooks"] = [
        h for h in job["source"]["hooks"] if not h["spec"]["cls_path"].endswith("GradientClipHook")
    ]
    path = write_job(tmp_path / "job.json", job)
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # shown even under -W ignore
        result = invoke("spec", "resume", root, "--spec", path, "--checkpoint-index", first)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if "The saved run used hooks" in line]
    assert len(lines) == 1, result.stderr
    assert "['GradientClipHook']" in lines[0]  # not TimeBudgetHook: --minutes is the CLI's
    assert "source.hooks" in lines[0] and "hooks=[...]" not in lines[0]


def test_job_json_is_the_job_as_run_and_a_refused_run_keeps_the_previous_copy(tmp_path):
    job = tiny_job(tmp_path, num_steps=3)
    job["output"]["plots"] = False
    path = write_job(tmp_path / "job.json", job)
    overrides = ("--num-steps", 2, "--minutes", 30, "--batch-size", 3, "--no-shuffle")
    validation = ("--validation-dataset", VAL, "--validation-every-steps", 1)
    result = invoke("spec", "run", path, "--no-report", *overrides, *validation)
    assert result.exit_code == 0, result.output
    as_run = json.loads((tmp_path / "run" / "job.json").read_text())
    assert as_run["strategy"]["num_steps"] == 2 and "num_epochs" not in as_run["strategy"]
    assert as_run["minutes"] == 30 and as_run["dataset"]["batch_size"] == 3
    assert as_run["dataset"]["shuffle"] is False
    assert as_run["dataset"]["validation_path"] == [str(VAL)]
    assert "val_fraction" not in as_run["dataset"]
    assert as_run["validation"]["every_n_steps"] == 1
    assert TrainingJobSpec.model_validate(as_run)  # still a job `spec run` takes
    before = (tmp_path / "run" / "job.json").read_bytes()

    job["dataset"]["dtype"] = "float64"  # refused at the first batch: the loss's dtype check
    job["source"]["hooks"][0]["spec"]["checkpoint_dir"] = str(tmp_path / "other")
    job["output"]["checkpoint_dir"] = str(tmp_path / "other")
    refused = invoke("spec", "run", write_job(tmp_path / "bad.json", job), "--no-report")
    assert refused.exit_code == 1 and "dtype" in refused.stderr, refused.output
    assert (tmp_path / "run" / "job.json").read_bytes() == before
