"""TorchProfilerHook: settings, stages, traces of real runs, schedules, one profiler at a time."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from enum import Enum, auto
from types import SimpleNamespace

import pytest
import torch
from _ranks import REPO_ROOT, clean_env, run_ranks
from _training_support import StageHook, make_batches, strategy
from torch.profiler import ProfilerActivity, schedule

from nvalchemi.hooks import Hook, TorchProfilerHook
from nvalchemi.training import TrainingStage as S

pytestmark = [
    pytest.mark.filterwarnings("ignore:Profiler won't be using warmup"),
    pytest.mark.filterwarnings("ignore:Warning. Profiler clears events"),
]


class Sim(Enum):
    BEFORE_STEP = auto()
    COMPUTE = auto()
    AFTER_STEP = auto()


def events(path):
    return json.loads(path.read_text())["traceEvents"]


def op_counts(path):
    return Counter(e.get("name") for e in events(path))


def profiler_on() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def watch_profiler():
    """A hook that notes, at every forward, whether a torch profiler is recording."""
    seen = []
    return StageHook(S.AFTER_FORWARD, lambda ctx: seen.append(profiler_on())), seen


# ------------------------------------------------------------------ settings
def test_both_hooks_are_exported_and_imported_only_when_used():
    code = (
        "import sys, nvalchemi.training, nvalchemi.training.hooks, nvalchemi.hooks;"
        "print(sorted(m for m in sys.modules if m.startswith('nvalchemi.hooks.') and"
        " m.rsplit('.', 1)[1] in ('profiler', 'stage_timing')));"
        "from nvalchemi.hooks import StageTimingHook, TorchProfilerHook;"
        "from nvalchemi.hooks.stage_timing import StageTimingHook as S;"
        "print(nvalchemi.training.hooks.TorchProfilerHook is TorchProfilerHook, S is StageTimingHook)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True True"]


def test_settings_are_checked_and_activities_accept_names():
    hook = TorchProfilerHook("out", activities=["cpu", "CUDA", ProfilerActivity.CPU])
    assert hook.activities == (ProfilerActivity.CPU, ProfilerActivity.CUDA)
    assert TorchProfilerHook("out").activities is None
    assert (hook.record_shapes, hook.profile_memory, hook.with_flops, hook.with_stack) == (
        True,
        True,
        True,
        False,
    )
    assert (hook.frequency, hook.name, hook.rank_subdirs, hook.stage) == (1, "torch", True, None)
    with pytest.raises(ValueError, match=r"activities\[1\] = 'tpu' is not a profiler activity"):
        TorchProfilerHook("out", activities=("cpu", "tpu"))
    with pytest.raises(ValueError, match="frequency must be an int >= 1"):
        TorchProfilerHook("out", frequency=0)
    with pytest.raises(TypeError, match="schedule must be callable"):
        TorchProfilerHook("out", schedule=3)
    with pytest.raises(ValueError, match="name is a file-name prefix"):
        TorchProfilerHook("out", name="../x")
    with pytest.raises(TypeError, match="unexpected keyword argument 'sort_by'"):
        TorchProfilerHook("out", sort_by="cpu_time")


def test_it_runs_at_the_batch_and_training_boundaries_of_any_engine():
    hook = TorchProfilerHook("out")
    assert isinstance(hook, Hook)
    assert [s for s in S if hook._runs_on_stage(s)] == [
        S.BEFORE_TRAINING,
        S.BEFORE_BATCH,
        S.AFTER_BATCH,
        S.AFTER_TRAINING,
    ]
    assert [s for s in Sim if hook._runs_on_stage(s)] == [Sim.BEFORE_STEP, Sim.AFTER_STEP]


# ------------------------------------------------------------------ real runs
def test_a_three_step_run_writes_one_chrome_trace_per_rank_folder(tmp_path):
    hook = TorchProfilerHook(tmp_path / "prof", activities=("cpu",))
    watcher, seen = watch_profiler()
    strategy(hooks=[hook, watcher], num_steps=3).run(make_batches(3))
    assert seen == [True, True, True]
    [trace] = hook.trace_files
    assert trace.parent == tmp_path / "prof" / "rank_0"
    assert trace.name.startswith("torch.") and trace.name.endswith(".pt.trace.json")
    assert sorted(p.name for p in trace.parent.iterdir()) == [trace.name]  # no temp files left
    assert op_counts(trace)["aten::linear"] == 6  # 3 forwards of a 2-layer MLP
    assert not profiler_on()  # stopped at AFTER_TRAINING


def test_a_schedule_records_only_the_batches_it_selects(tmp_path):
    hook = TorchProfilerHook(
        tmp_path, activities=("cpu",), schedule=schedule(wait=1, warmup=0, active=1, repeat=1)
    )
    watcher, seen = watch_profiler()
    strategy(hooks=[hook, watcher], num_steps=3).run(make_batches(3))
    assert seen == [False, True, False]
    [trace] = hook.trace_files
    counts = op_counts(trace)
    assert [n for n in counts if n.startswith("ProfilerStep#")] == ["ProfilerStep#1"]
    assert counts["aten::linear"] == 2


def test_a_schedule_that_never_records_costs_no_recording_and_writes_nothing(tmp_path):
    hook = TorchProfilerHook(tmp_path / "prof", schedule=schedule(wait=100, warmup=0, active=1))
    watcher, seen = watch_profiler()
    strategy(hooks=[hook, watcher], num_steps=3).run(make_batches(3))
    assert seen == [False, False, False]
    assert hook.trace_files == [] and not (tmp_path / "prof").exists()


@pytest.mark.parametrize("frequency, linears_per_trace", [(1, 2), (2, 4)])
def test_with_a_frequency_one_profiler_step_spans_that_many_batches(
    tmp_path, frequency, linears_per_trace
):
    hook = TorchProfilerHook(
        tmp_path,
        activities=("cpu",),
        schedule=schedule(wait=0, warmup=0, active=1),
        frequency=frequency,
        rank_subdirs=False,
    )
    strategy(hooks=[hook], num_steps=4).run(make_batches(4))
    assert len(hook.trace_files) == 4 // frequency + 1  # the last: the tail to AFTER_TRAINING
    full = hook.trace_files[:-1]
    assert [op_counts(t)["aten::linear"] for t in full] == [linears_per_trace] * len(full)
    assert all(t.parent == tmp_path for t in hook.trace_files)  # rank_subdirs=False


def test_a_failing_run_still_writes_its_trace(tmp_path):
    def fail(ctx):
        if ctx.step_count == 1:
            raise RuntimeError("boom")

    hook = TorchProfilerHook(tmp_path, activities=("cpu",))
    run = strategy(hooks=[hook, StageHook(S.AFTER_FORWARD, fail)], num_steps=3)
    with pytest.raises(RuntimeError, match="boom"):
        run.run(make_batches(3))
    [trace] = hook.trace_files
    assert op_counts(trace)["aten::linear"] == 4 and not profiler_on()


def test_a_train_batch_session_is_profiled_until_it_closes(tmp_path):
    hook = TorchProfilerHook(tmp_path, activities=("cpu",), on_trace_ready_path=tmp_path / "tb")
    run = strategy(hooks=[hook], num_steps=3)
    for batch in make_batches(2):
        run.train_batch(batch)
    assert hook.trace_files == [] and profiler_on()
    run.close()
    [trace] = hook.trace_files
    assert op_counts(trace)["aten::linear"] == 4 and not profiler_on()
    copy = tmp_path / "tb" / "rank_0" / trace.name
    assert copy.read_bytes() == trace.read_bytes()


def test_context_exit_stops_the_profiler_of_a_simulation_engine(tmp_path):
    hook = TorchProfilerHook(tmp_path, activities=("cpu",), rank_subdirs=False)
    ctx = SimpleNamespace(global_rank=0, workflow=None, batch=None)
    with hook:
        for _ in range(2):
            hook(ctx, Sim.BEFORE_STEP)
            torch.ones(4)
            hook(ctx, Sim.AFTER_STEP)
    [trace] = hook.trace_files
    assert op_counts(trace)["aten::ones"] == 2 and not profiler_on()


# ------------------------------------------------------------------ one profiler at a time
def test_a_profiler_starts_once(tmp_path):
    hook = TorchProfilerHook(tmp_path, activities=("cpu",))
    run = strategy(hooks=[hook], num_steps=1)
    run.run(make_batches(1))
    with pytest.raises(RuntimeError, match=r"already stopped its profiler.*new TorchProfilerHook"):
        strategy(hooks=[hook], num_steps=1).run(make_batches(1))
    assert len(hook.trace_files) == 1


def test_two_profilers_never_run_at_once(tmp_path):
    ctx = SimpleNamespace(global_rank=0, workflow=None, batch=None)
    waiting = TorchProfilerHook(tmp_path / "a", schedule=schedule(wait=5, warmup=0, active=1))
    waiting(ctx, S.BEFORE_BATCH)  # started, still waiting: torch records nothing yet
    second = TorchProfilerHook(tmp_path / "b")
    with pytest.raises(RuntimeError, match="another torch profiler is already running"):
        second(ctx, S.BEFORE_BATCH)
    waiting.close()
    with (
        torch.profiler.profile(activities=[ProfilerActivity.CPU]),
        pytest.raises(RuntimeError, match=r"torch\.profiler\.profile block"),
    ):
        second(ctx, S.BEFORE_BATCH)
    second(ctx, S.BEFORE_BATCH)  # free again
    second.close()
    assert len(second.trace_files) == 1


RANK_SCRIPT = """
import json, sys
from pathlib import Path
from _ranks import init_group, report, teardown
from _training_support import make_batches, strategy
from nvalchemi.hooks import TorchProfilerHook

rank = init_group()
hook = TorchProfilerHook(sys.argv[1], activities=("cpu",), rank_subdirs=False)
strategy(hooks=[hook], num_steps=2).run(make_batches(2))
[trace] = hook.trace_files
events = json.loads(trace.read_text())["traceEvents"]
report(rank=rank, folder=trace.parent.name, linears=sum(e.get("name") == "aten::linear" for e in events))
teardown()
"""


@pytest.mark.distributed
def test_each_rank_writes_its_own_folder(tmp_path):
    results = run_ranks(RANK_SCRIPT, args=[str(tmp_path)])
    assert [(r["rank"], r["folder"], r["linears"]) for r in results] == [
        (0, "rank_0", 4),
        (1, "rank_1", 4),
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0", "rank_1"]
