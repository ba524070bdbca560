"""The CLI on your own data: stress in one flag, time budgets, units, threads, batch budgets."""

from __future__ import annotations

import json

import pytest
import torch

from nvalchemi.data.bundled import bundled_split_path

from ._support import TRAIN, assert_user_error, invoke, tiny_job, write_job


def _init(tmp_path, *args):
    out = tmp_path / "job.json"
    result = invoke(
        "train",
        "init",
        "--dataset",
        TRAIN,
        "--val-fraction",
        0.1,
        "--output-dir",
        tmp_path / "run",
        "--device",
        "cpu",
        "--out",
        out,
        *args,
    )
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.stderr


def _losses(job):
    return [c["cls_path"].rsplit(".", 1)[1] for c in job["strategy"]["loss_fn_spec"]["components"]]


def test_stress_labels_in_the_data_add_the_stress_loss_and_output_with_a_line(tmp_path):
    job, stderr = _init(tmp_path)
    assert "stress labels found in 500 of the first 500 training structures" in stderr
    assert _losses(job) == ["EnergyMSELoss", "ForceMSELoss", "StressMSELoss"]
    assert job["strategy"]["loss_fn_spec"]["weights"] == [10.0, 1.0, 100.0]
    assert job["strategy"]["model_specs"]["main"]["active_outputs"] == [
        "energy",
        "forces",
        "stress",
    ]
    assert "with stress" in stderr

    job, stderr = _init(tmp_path, "--no-stress")
    assert _losses(job) == ["EnergyMSELoss", "ForceMSELoss"] and "stress labels" not in stderr
    assert "active_outputs" not in job["strategy"]["model_specs"]["main"]


def test_stress_flag_on_data_without_stress(tmp_path):
    molecules = tmp_path / "molecules.extxyz"
    from ase.io import read, write

    frames = [a for a in read(bundled_split_path("val"), index=":40") if not a.pbc.any()][:4]
    if not frames:
        pytest.skip("no molecules in the first bundled validation structures")
    for atoms in frames:
        atoms.info.pop("stress", None)
    write(molecules, frames)
    out = tmp_path / "job.json"
    result = invoke(
        "train",
        "init",
        "--dataset",
        molecules,
        "--output-dir",
        tmp_path / "r",
        "--out",
        out,
        "--device",
        "cpu",
    )
    assert result.exit_code == 0 and "stress labels" not in result.stderr
    assert "StressMSELoss" not in out.read_text()


def test_report_refuses_a_stress_loss_the_model_does_not_produce(tmp_path):
    job, _ = _init(tmp_path)
    del job["strategy"]["model_specs"]["main"]["active_outputs"]  # PaiNN's default: no stress
    result = invoke("spec", "report", write_job(tmp_path / "bad.json", job))
    assert_user_error(
        result,
        "strategy.model_specs.main.active_outputs",
        "'stress' (for StressMSELoss)",
        fix="['energy', 'forces', 'stress']",
    )


def test_mace_fine_tunes_name_source_active_outputs(tmp_path):
    result = invoke(
        "finetune",
        "init",
        "mace",
        tmp_path / "small.model",
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path / "ft",
        "--device",
        "cpu",
        "--no-stress",  # then a stress term added by hand needs the output
    )
    job = json.loads(result.stdout)
    loss = job["strategy"]["loss_fn_spec"]
    loss["components"].append({"cls_path": "nvalchemi.training.losses.terms.StressMSELoss"})
    loss["weights"].append(100.0)
    result = invoke("spec", "report", write_job(tmp_path / "ft.json", job))
    assert_user_error(result, "source.active_outputs", "'stress'", fix="source.active_outputs")
    job["source"]["active_outputs"] = ["energy", "forces", "stress"]
    result = invoke("spec", "report", write_job(tmp_path / "ft.json", job))
    assert result.exit_code == 0, result.stderr


def test_train_init_writes_the_recipe_with_a_time_budget(tmp_path):
    job, stderr = _init(tmp_path, "--no-stress")
    assert job["minutes"] == 10.0 and "num_steps" not in job["strategy"]
    assert job["name"] == "train-painn" and job["dataset"]["in_memory"] is True
    config = job["strategy"]["optimizer_configs"]["main"][0]
    assert config["optimizer_kwargs"] == {"lr": 0.003, "weight_decay": 0.0}
    assert config["scheduler_cls"] == "nvalchemi.training.time_budget.WarmupCosineLR"
    assert (
        "trains PaiNN (built-in, nvalchemi.models.painn) from scratch, fitted to 10 min" in stderr
    )
    hooks = {h["spec"]["cls_path"].rsplit(".", 1)[1]: h["spec"] for h in job["source"]["hooks"]}
    assert hooks["EMAHook"]["decay"] == 0.995 and hooks["GradientClipHook"]["max_norm"] == 10.0
    result = invoke(
        "train",
        "init",
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path,
        "--minutes",
        5,
        "--num-steps",
        10,
    )
    assert_user_error(result, "--minutes and --num-steps contradict", fix="a budget")


def test_a_budget_run_is_fitted_and_its_lines_show_units_and_time_left(tmp_path):
    job = tiny_job(tmp_path, num_steps=3)
    job["strategy"]["num_steps"] = None
    job["minutes"] = 0.05  # three seconds: length fitted to it
    path = write_job(tmp_path / "job.json", job)
    report = invoke("spec", "report", path)
    assert "fitted to 0.05 min: length and learning-rate schedule set" in report.stderr
    result = invoke("spec", "run", path, "--no-report")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    train = next(line for line in lines if line.startswith("epoch ") and "left of 00:03" in line)
    assert "(weighted sum)" in train and "ForceMSELoss" in train and "(eV/Å)²" in train
    validation = next(line for line in lines if line.startswith("validation "))
    assert "meV/atom" in validation and "meV/Å" in validation and "energy (total) MAE" in validation
    assert "EMA weights" in validation
    # the budget ended the run: at its fitted length, or (on a machine slower than its first
    # steps said) at the cap; which one depends on real time (the fit is tested with a fake clock)
    assert (
        "end of the run fitted to the 0.05 min budget" in result.stderr
        or "time budget of 0.05 min reached" in result.stderr
    )
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("budget/remaining_s" in r for r in rows)
    final = json.loads((tmp_path / "run" / "final_evaluation.json").read_text())
    assert final["grouping"] == "config_type" and final["by_group"]


def test_a_fixed_length_job_with_minutes_says_the_fixed_length_wins(tmp_path):
    job = tiny_job(tmp_path, num_steps=3)
    job["minutes"] = 5
    report = invoke("spec", "report", write_job(tmp_path / "job.json", job))
    assert "Time budget: strategy.num_steps: the job has a fixed length" in report.stderr
    assert "3 steps (capped at 5 min)" in report.stderr


def test_threads_set_torch_and_the_neighbour_list_builder(tmp_path, monkeypatch):
    import nvalchemi.data.neighbors as neighbors

    seen = []

    class Recording(neighbors.NeighborListTransform):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.n_threads)

    monkeypatch.setattr(neighbors, "NeighborListTransform", Recording)
    job = tiny_job(tmp_path, num_steps=1)
    result = invoke(
        "spec", "run", write_job(tmp_path / "job.json", job), "--no-report", "--threads", 2
    )
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == 2 and seen and set(seen) == {2}


def test_an_atom_budget_batches_by_atoms_and_the_report_shows_the_distribution(tmp_path):
    job = tiny_job(tmp_path, num_steps=2, structures=16)
    job["dataset"]["max_atoms"] = 64
    path = write_job(tmp_path / "job.json", job)
    report = invoke("spec", "report", path)
    assert report.exit_code == 0, report.stderr
    assert "at most 64 atoms per batch (BudgetBatchSampler)" in report.stderr
    assert "atoms per batch" in report.stderr and "(budget 64)" in report.stderr
    result = invoke("spec", "run", path, "--no-report")
    assert result.exit_code == 0, result.output


def test_batch_size_auto_probes_the_model_and_writes_the_choice(tmp_path):
    job = tiny_job(tmp_path, num_steps=1, structures=8)
    job["dataset"]["batch_size"] = "auto"
    result = invoke("spec", "run", write_job(tmp_path / "job.json", job), "--no-report")
    assert result.exit_code == 0, result.output
    assert "batch budget (batch_size: auto)" in result.stderr
    chosen = json.loads((tmp_path / "run" / "batch_budget.json").read_text())
    assert chosen["max_atoms"] >= 1
    report = invoke("spec", "report", tmp_path / "job.json")
    assert "budget found by the last run" in report.stderr


def test_every_command_help_ends_with_examples():
    from click import Group

    from nvalchemi.training.cli import main

    def commands(group, prefix=()):
        for name, command in group.commands.items():
            yield (*prefix, name), command
            if isinstance(command, Group):
                yield from commands(command, (*prefix, name))

    for path, command in commands(main):
        if isinstance(command, Group) and not getattr(command, "invoke_without_command", False):
            continue
        text = invoke(*path, "--help").stdout
        assert "Examples:" in text, path
        lines = [line.strip() for line in text.split("Examples:")[1].strip().splitlines()]
        assert lines, path
        for before, line in zip(["", *lines], lines):  # commands, or their continued lines
            assert line.startswith("nvalchemi-training") or before.endswith("\\"), (path, line)


def test_bench_reports_throughput_loader_share_and_the_candidates():
    result = invoke(
        "bench",
        "--model",
        "demo",
        "--steps",
        4,
        "--warmup",
        1,
        "--max-structures",
        40,
        "--precision",
        "bf16",
        "--compile",
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["steps"] == 4 and data["structures_per_s"] > 0 and 0 <= data["loader_share"] < 1
    assert data["peak_memory_mib"] > 0 and data["memory_kind"] == "process peak RSS"
    bf16, compiled = data["candidates"]
    assert bf16["name"] == "bf16" and 1e-6 < bf16["loss_rel_error_max"] < 1  # bf16 rounds
    # compiled float32 trains the same batches to float32 rounding, not bitwise
    assert compiled["name"] == "compile" and compiled["loss_rel_error_max"] < 1e-4
    assert compiled["grad_norm_rel_error_max"] < 1e-4
    assert "loader share of the step" in result.stderr
