"""WandbReporter and MLflowReporter: what reaches the tracked run, ranks, checkpoints, resume.

The base's rules are pinned with a recording tracker; the real trackers run offline (W&B
``WANDB_MODE=offline``, read back from its run files; MLflow a ``file:`` store, read back
through ``MlflowClient``). W&B runs are few: each costs about a second to start.
"""

from __future__ import annotations

import base64
import doctest
import importlib
import json
import subprocess
import sys
from pathlib import Path

import _checkpoint_support as C
import _reporting_support as support
import pytest
from _ranks import clean_env, run_ranks
from _tracker_files import TRACKER_ENV, mlflow_run, mlflow_run_ids, wandb_run

from nvalchemi._optional import OptionalDependency, OptionalDependencyError
from nvalchemi.hooks.reporting import (
    JSONLinesReporter,
    MLflowReporter,
    ReportingOrchestrator,
    ReportingState,
    TrackerReporter,
    WandbReporter,
    read_metrics,
)
from nvalchemi.training import TrainingStage, TrainingStrategy, ValidationConfig
from nvalchemi.training.hooks import CheckpointHook

STEP = TrainingStage.AFTER_OPTIMIZER_STEP
STAGES = {"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"}
RANKS = Path(__file__).with_name("_tracker_ranks.py")
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
"""A 1x1 PNG (W&B opens the images it logs)."""

requires_trackers = pytest.mark.skipif(
    not (OptionalDependency.WANDB.is_available() and OptionalDependency.MLFLOW.is_available()),
    reason="trackers extra not installed",
)


class Recording(TrackerReporter):
    """A tracker that records what the base sends it."""

    tracker = "recording"

    def __init__(self, existing: tuple[str, ...] = (), **options):
        super().__init__(**options)
        self.existing, self.calls, self.started = set(existing), [], 0

    def _start(self, run_id):
        self.started += 1
        return run_id or f"run{self.started}", run_id in self.existing

    def _log_config(self, config):
        self.calls.append(("config", config))

    def _log_scalars(self, scalars, step):
        self.calls.append(("scalars", step, scalars))

    def _log_summary(self, values, step):
        self.calls.append(("summary", step, values))

    def _log_table(self, name, columns, rows):
        self.calls.append(("table", name, columns, rows))

    def _log_image(self, name, path):
        self.calls.append(("image", name, path.name))

    def _finish(self, status):
        self.calls.append(("finish", status))

    def kinds(self):
        return [call[0] for call in self.calls]


# ----------------------------------------------------------------------------- the base's rules
def test_scalars_at_the_completed_step_and_the_config_once_for_a_new_run():
    tracker = Recording(config={"job": {"name": "demo"}}, include_memory=False)
    ctx = support.make_ctx(step=4)
    ctx.workflow.to_spec_dict = lambda: {"num_steps": 10}
    tracker.report(ctx, STEP, ReportingState())
    tracker.report(ctx, STEP, ReportingState())
    configs = [call[1] for call in tracker.calls if call[0] == "config"]
    assert configs == [{"job": {"name": "demo"}}, {"strategy": {"num_steps": 10}}]
    (_, step, scalars), _ = [call for call in tracker.calls if call[0] == "scalars"]
    assert step == 5 and scalars["loss/EnergyMSELoss/unweighted"] == pytest.approx(0.5)
    assert tracker.run_id == "run1" and tracker.started == 1


def test_validation_metrics_carry_their_units():
    tracker = Recording()
    ctx = support.make_ctx(step=2)
    ctx.validation = support.validation_summary()
    tracker.report(ctx, TrainingStage.AFTER_VALIDATION, ReportingState())
    (scalars,) = [call[2] for call in tracker.calls if call[0] == "scalars"]
    assert "validation/forces_mae_eV_per_A" in scalars


def test_a_continued_run_gets_no_config_again():
    tracker = Recording(existing=("old",), config={"job": {}})
    tracker.load_state_dict({"run_id": "old"})
    ctx = support.make_ctx()
    ctx.workflow.to_spec_dict = lambda: {"num_steps": 10}
    tracker.report(ctx, STEP, ReportingState())
    assert "config" not in tracker.kinds() and tracker.run_id == "old"


def test_other_ranks_never_start_a_tracked_run(monkeypatch):
    tracker = Recording()
    tracker.report(support.make_ctx(global_rank=1), STEP, ReportingState())
    monkeypatch.setattr("nvalchemi.hooks.reporting.tracker.get_rank", lambda: 1)
    with tracker:
        tracker.log_summary({"final/x": 1.0})
        tracker.log_table("t", [{"a": 1}])
    assert tracker.calls == [] and tracker.started == 0 and tracker.run_id is None


def test_nested_with_keeps_the_run_open_and_the_exit_names_how_it_ended():
    tracker = Recording()
    with tracker:
        with ReportingOrchestrator([tracker], stages=STAGES) as hook:  # enters it again
            hook(support.make_ctx(), STEP)
        assert "finish" not in tracker.kinds()  # still open for a final evaluation
        tracker.log_summary({"final/forces_mae_eV_per_A": 0.01})
    assert tracker.calls[-1] == ("finish", "finished") and tracker.started == 1
    for error, status in ((RuntimeError, "failed"), (KeyboardInterrupt, "killed")):
        with pytest.raises(error), tracker:
            raise error()
        assert tracker.calls[-1] == ("finish", status)


def test_tables_take_the_union_of_the_row_keys_and_images_must_exist(tmp_path):
    tracker = Recording()
    tracker.log_table("final/by_group", [{"group": "bulk", "mae": 0.1}, {"group": "slab", "n": 2}])
    assert tracker.calls[-1] == (
        "table",
        "final/by_group",
        ["group", "mae", "n"],
        [["bulk", 0.1, None], ["slab", None, 2]],
    )
    (tmp_path / "parity_forces.png").write_bytes(b"png")
    tracker.log_image(tmp_path / "parity_forces.png")
    assert tracker.calls[-1] == ("image", "plots/parity_forces", "parity_forces.png")
    with pytest.raises(FileNotFoundError, match=r"missing\.png"):
        tracker.log_image(tmp_path / "missing.png")


def test_the_run_id_is_the_state_and_a_late_load_is_refused():
    tracker = Recording()
    assert tracker.state_dict() == {"run_id": None}
    tracker.load_state_dict({"run_id": "abc"})
    with tracker:
        assert tracker.state_dict() == {"run_id": "abc"}
        tracker.load_state_dict({"run_id": "abc"})  # the same run: fine
        with pytest.raises(RuntimeError, match="before training starts"):
            tracker.load_state_dict({"run_id": "other"})
    with pytest.raises(ValueError, match="run_id"):
        Recording(run_id="")
    with pytest.raises(TypeError, match="mapping"):
        Recording().load_state_dict("abc")


def test_the_orchestrator_checkpoints_its_stateful_reporters_under_their_names():
    first, second = Recording(), Recording()
    hook = ReportingOrchestrator([JSONLinesReporter("unused"), first, second])
    assert [key for key, _ in hook.checkpointable_children()] == ["Recording", "Recording#1"]
    first.run_id, second.run_id = "a", "b"
    state = hook.state_dict()
    assert state == {"Recording": {"run_id": "a"}, "Recording#1": {"run_id": "b"}}
    again = [Recording(), Recording()]
    ReportingOrchestrator(again).load_state_dict(state)
    assert [r.run_id for r in again] == ["a", "b"]


def test_importing_and_building_reporters_imports_no_tracker():
    code = (
        "import sys, nvalchemi.training, nvalchemi.hooks\n"
        "from nvalchemi.hooks.reporting import WandbReporter, MLflowReporter, run_reporting\n"
        "WandbReporter('p'); MLflowReporter('e')\n"
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_missing_packages_name_the_trackers_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(OptionalDependencyError, match=r"nvalchemi-training\[trackers\]"):
        WandbReporter("p")
    with pytest.raises(OptionalDependencyError, match=r"nvalchemi-training\[trackers\]"):
        MLflowReporter("e")


@requires_trackers
def test_wandb_settings_the_reporter_owns_are_refused():
    with pytest.raises(ValueError, match="'id'"):
        WandbReporter("p", init_kwargs={"id": "x"})


# ----------------------------------------------------------------------------- real trackers
@pytest.fixture
def offline_trackers(monkeypatch):
    """W&B offline, MLflow file stores allowed; no settings of the caller's environment."""
    for key in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    for key, value in TRACKER_ENV.items():
        monkeypatch.setenv(key, value)


class CrashAtStep:
    """Raise before the forward of the step after ``steps`` completed ones (a crash)."""

    frequency = 1
    stage = TrainingStage.BEFORE_FORWARD

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, ctx, stage):
        if ctx.step_count == self.steps:
            raise RuntimeError("simulated crash")


def _reporting(run_dir: Path, *trackers) -> ReportingOrchestrator:
    return ReportingOrchestrator([JSONLinesReporter(run_dir), *trackers], stages=STAGES)


def _trackers(tmp_path: Path) -> tuple[WandbReporter, MLflowReporter]:
    return (
        WandbReporter("tests", name="tiny", dir=tmp_path),
        MLflowReporter("tests", name="tiny", tracking_uri=f"file:{tmp_path / 'mlruns'}"),
    )


def _validation() -> ValidationConfig:
    return ValidationConfig(validation_data=C.batches(1, seed=7))


def _reference_rows(tmp_path: Path) -> dict[int, dict]:
    """``metrics.jsonl`` train rows by step of the same run, uninterrupted and untracked."""
    strategy = C.strategy(hooks=[_reporting(tmp_path / "reference")])
    strategy.validation_config = _validation()
    strategy.run(C.batches(4))
    rows = read_metrics(tmp_path / "reference")
    return {row["step"]: row for row in rows if row["kind"] == "train"}


@requires_trackers
@pytest.mark.filterwarnings("ignore:The saved run used hooks")  # the crash is not resumed
def test_a_crashed_and_resumed_run_continues_the_same_tracked_runs(tmp_path, offline_trackers):
    reference = _reference_rows(tmp_path)
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"

    wandb_reporter, mlflow_reporter = _trackers(tmp_path)
    hooks = [CheckpointHook(ckpt, step_interval=2), CrashAtStep(2)]
    strategy = C.strategy(hooks=[*hooks, _reporting(run_dir, wandb_reporter, mlflow_reporter)])
    strategy.validation_config = _validation()
    with pytest.raises(RuntimeError, match="simulated crash"):
        strategy.run(C.batches(4))
    first = (wandb_reporter.run_id, mlflow_reporter.run_id)
    assert mlflow_run(f"file:{tmp_path / 'mlruns'}", first[1])["status"] == "FAILED"

    wandb_reporter, mlflow_reporter = _trackers(tmp_path)  # a new process would build new ones
    reporting = _reporting(run_dir, wandb_reporter, mlflow_reporter)
    resumed = TrainingStrategy.load_checkpoint(
        ckpt,
        hooks=[CheckpointHook(ckpt, step_interval=2), reporting],
        overrides={"validation_config": _validation()},
    )
    assert (wandb_reporter.run_id, mlflow_reporter.run_id) == first  # from the checkpoint
    resumed.run(C.batches(4))
    assert (wandb_reporter.run_id, mlflow_reporter.run_id) == first

    losses = [reference[step]["loss/total"] for step in (1, 2, 3, 4)]
    ml = mlflow_run(f"file:{tmp_path / 'mlruns'}", first[1])
    assert mlflow_run_ids(f"file:{tmp_path / 'mlruns'}") == [first[1]]  # one run in the store
    assert ml["status"] == "FINISHED" and ml["experiment"] == "tests" and ml["name"] == "tiny"
    assert [step for step, _ in ml["history"]["loss/total"]] == [1, 2, 3, 4]
    assert [value for _, value in ml["history"]["loss/total"]] == pytest.approx(losses)
    # (validation events repeat the learning rate at their step)
    assert dict(ml["history"]["optimizer/lr"]) == {
        s: reference[s]["optimizer/lr"] for s in reference
    }
    assert [step for step, _ in ml["history"]["validation/forces_mae_eV_per_A"]] == [4]
    assert ml["params"]["strategy.num_steps"] == "4" and "config.json" in ml["artifacts"]

    wb = wandb_run(tmp_path, first[0])
    assert len(wb["sessions"]) == 2 and wb["exit_codes"] == [1, 0]  # crashed, then finished
    rows = {row["_step"]: row for row in wb["history"]}
    assert sorted(rows) == [1, 2, 3, 4]
    assert [rows[step]["loss/total"] for step in (1, 2, 3, 4)] == pytest.approx(losses)
    assert "validation/forces_mae_eV_per_A" in rows[4]
    assert wb["config"]["strategy"]["num_steps"] == 4
    assert wb["summary"]["loss/total"] == pytest.approx(losses[-1])


@requires_trackers
def test_summary_tables_and_plots_reach_both_trackers(tmp_path, offline_trackers):
    plot = tmp_path / "parity_forces.png"
    plot.write_bytes(base64.b64decode(PNG))
    wandb_reporter, mlflow_reporter = _trackers(tmp_path)
    rows = [{"group": "bulk", "forces_mae_eV_per_A": 0.03}, {"group": "slab", "atoms": 7}]
    for tracker in (wandb_reporter, mlflow_reporter):
        with tracker:
            tracker.log_summary({"final/forces_mae_eV_per_A": 0.02})
            tracker.log_table("final/by_group", rows)
            tracker.log_image(plot)

    ml = mlflow_run(f"file:{tmp_path / 'mlruns'}", mlflow_reporter.run_id)
    assert ml["history"]["final/forces_mae_eV_per_A"] == [(0, 0.02)]
    assert {"final/by_group.json", "plots/parity_forces.png"} <= set(ml["artifacts"])
    local = ml["client"].download_artifacts(mlflow_reporter.run_id, "final/by_group.json", tmp_path)
    assert json.loads(Path(local).read_text()) == {
        "columns": ["group", "forces_mae_eV_per_A", "atoms"],
        "data": [["bulk", 0.03, None], ["slab", None, 7]],
    }

    wb = wandb_run(tmp_path, wandb_reporter.run_id)
    assert wb["summary"]["final/forces_mae_eV_per_A"] == 0.02
    assert wb["summary"]["final/by_group/nrows"] == 2
    assert any(f.startswith("media/images/plots/parity_forces") for f in wb["files"])


@pytest.mark.distributed
@requires_trackers
def test_two_gloo_ranks_write_one_tracked_run(tmp_path, offline_trackers):
    results = run_ranks(RANKS, 2, args=[str(tmp_path)], env=TRACKER_ENV, rendezvous="tcp")
    assert results[1] == {"rank": 1, "run_ids": [None, None], "imported": []}
    wandb_id, mlflow_id = results[0]["run_ids"]
    assert mlflow_run_ids(f"file:{tmp_path / 'mlruns'}") == [mlflow_id]
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1
    assert [row["_step"] for row in wandb_run(tmp_path, wandb_id)["history"]] == [1, 2, 3]


def test_the_modules_examples_run():
    for name in ("tracker", "wandb", "mlflow"):
        module = importlib.import_module(f"nvalchemi.hooks.reporting.{name}")
        assert doctest.testmod(module).failed == 0, name
