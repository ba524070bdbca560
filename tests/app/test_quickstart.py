"""``quickstart --quick`` end to end (subprocess), a time budget, and exact ``--resume``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from nvalchemi.hooks.reporting import read_metrics
from nvalchemi.training.checkpoint import CheckpointManifest, load_models_from_checkpoint

from ._support import assert_user_error, invoke, is_png, run_cli


def test_quickstart_quick_end_to_end(tmp_path):
    run = tmp_path / "qs"
    result = run_cli("quickstart", "--quick", "--run-dir", run)
    assert result.returncode == 0, result.stderr
    text = result.stderr
    for fragment in (
        "Test metrics",
        "energy per atom",
        "Errors per element",
        "Errors per structure type (config_type)",
        "final checkpoint:",
        "NvalchemiCalculator.from_checkpoint",
        "PaiNN energy",
        "meV/atom",
        "Next: take the potential to molecular dynamics",
    ):
        assert fragment in text, fragment
    assert "Traceback" not in text
    # the printed next steps are commands that run as printed (the export one, here)
    export_line = next(
        line for line in text.splitlines() if line.startswith("nvalchemi-training export")
    )
    exported = invoke(*shlex.split(export_line)[1:])
    assert exported.exit_code == 0, exported.output
    assert (run / "potential.pt").is_file()
    md_line = next(line for line in text.splitlines() if " --md" in line)
    assert shlex.split(md_line)[:3] == ["nvalchemi-training", "evaluate", str(run / "checkpoints")]
    assert Path(shlex.split(md_line)[4]).is_file()
    metrics = json.loads((run / "test_metrics.json").read_text())["metrics"]
    assert metrics["num_structures"] == 16 and metrics["forces_mae"] > 0
    for name in ("learning_curves.png", "parity_energy_per_atom.png", "parity_forces.png"):
        assert is_png(run / name), name
        assert str(run / name) in text
    rows = read_metrics(run / "metrics.jsonl")
    assert {r["kind"] for r in rows} == {"train", "validation"}
    assert len([r for r in rows if r["kind"] == "validation"]) >= 2  # every epoch
    manifest = CheckpointManifest.read(run / "checkpoints")
    assert manifest.entry("latest").step_count == 12
    assert len(manifest.checkpoints) <= 4  # last 3 + best
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def _final_weights(run):
    model = load_models_from_checkpoint(run / "checkpoints", "latest", "cpu", use_ema=False)
    return model["main"].state_dict()


def test_time_budget_stops_cleanly_and_resume_continues_exactly(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert invoke("quickstart", "--quick", "--epochs", 2, "--run-dir", straight).exit_code == 0

    first = invoke("quickstart", "--quick", "--epochs", 2, "--minutes", 1e-5, "--run-dir", stopped)
    assert first.exit_code == 0, first.output
    assert "stopped early: time budget" in first.stderr
    assert "Test metrics" in first.stderr  # evaluated even though stopped
    entry = CheckpointManifest.read(stopped / "checkpoints").entry("latest")
    assert entry.step_count == 1

    again = invoke("quickstart", "--quick", "--run-dir", stopped)
    assert_user_error(again, "already holds a quickstart run", "--resume")
    wrong = invoke("quickstart", "--resume", "--epochs", 5, "--run-dir", stopped)
    assert_user_error(wrong, "--epochs 5 differs")

    resumed = invoke("quickstart", "--resume", "--run-dir", stopped)
    assert resumed.exit_code == 0, resumed.output
    assert "resuming from step 1" in resumed.stderr
    a, b = _final_weights(straight), _final_weights(stopped)
    assert a.keys() == b.keys()
    for key in a:  # bit for bit (E0 holds a NaN row for unknown elements)
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, equal_nan=True)


def test_without_epochs_the_quickstart_is_fitted_to_its_budget(tmp_path):
    """The quickstart uses spec run's mechanism: a fitting TimeBudgetHook and WarmupCosineLR."""
    from nvalchemi.app.jobs import quickstart as qs
    from nvalchemi.training.time_budget import TimeBudgetHook, WarmupCosineLR

    plan = qs.prepare_run(
        tmp_path / "qs",
        resume=False,
        overwrite=False,
        quick=True,
        epochs=None,
        minutes=None,
        device="cpu",
    )
    assert not plan.fitted  # --quick trains a fixed 2 epochs
    plan.recipe = type(plan.recipe)(**{**plan.recipe.to_dict(), "epochs": None})
    plan.budget_s = 60.0
    assert plan.fitted
    splits = qs.load_splits(plan.recipe)
    train, val, _ = qs.loaders(splits, plan.recipe)
    strategy = qs.build_strategy(plan, qs.build_model(splits, plan.recipe, "cpu"), train, val)
    budget = [h for h in strategy.hooks if isinstance(h, TimeBudgetHook)]
    assert len(budget) == 1 and budget[0].fit and budget[0].seconds == 60.0
    _, schedulers = strategy.ensure_optimizers()
    assert isinstance(schedulers[0], WarmupCosineLR)


def test_calculator_snippet_quotes_the_checkpoint_path_as_data():
    import ast

    from nvalchemi.app.cli.quickstart import calculator_snippet

    path = 'runs/a"); import os; os.system("echo pwned'
    tree = ast.parse(calculator_snippet(path, "Cu"))
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    assert path in strings
    calls = {
        n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and hasattr(n.func, "attr")
    }
    assert "system" not in calls


def test_overwrite_refuses_a_run_quickstart_did_not_create(tmp_path, trained_run):
    import shutil

    run = tmp_path / "spec_run"
    shutil.copytree(trained_run["run_dir"], run)  # a `spec run`'s results: checkpoints, ...
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for flags in ((), ("--overwrite",), ("--resume",)):
        result = invoke("quickstart", "--quick", *flags, "--run-dir", run)
        assert result.exit_code == 1, result.output
        assert "checkpoints" in result.stderr and str(run) in result.stderr, result.stderr
    assert "quickstart did not create" in result.stderr or "no quickstart run" in result.stderr
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing deleted


def _plan(run, **options):
    from nvalchemi.app.jobs import quickstart as qs

    settings = {"resume": False, "overwrite": False, "quick": True, "epochs": None}
    return qs.prepare_run(run, **{**settings, "minutes": None, "device": "cpu", **options})


def test_overwrite_deletes_only_what_the_quickstart_run_created(tmp_path):
    from nvalchemi.app.jobs import quickstart as qs

    run = tmp_path / "qs"
    qs.save_plan(_plan(run))  # the record quickstart writes before it trains
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "manifest.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    (run / "notes.txt").write_text("mine")  # the user's, beside the run
    elsewhere = tmp_path / "data"
    elsewhere.mkdir()
    (elsewhere / "keep.extxyz").write_text("data")
    (run / "tensorboard").symlink_to(elsewhere)  # a link quickstart did not make... nor follow
    plan = _plan(run, overwrite=True)
    assert not plan.resume
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    assert (elsewhere / "keep.extxyz").read_text() == "data"
