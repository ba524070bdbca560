"""StageTimingHook: stage sets, dispatch, cycles, timers, CSV rows, console cadence, NVTX."""

from __future__ import annotations

import csv
import logging
from enum import Enum, auto
from types import SimpleNamespace

import pytest
import torch
from _training_support import make_batches, strategy

from nvalchemi.hooks import Hook, StageTimingHook
from nvalchemi.training import TrainingStage as S

STEP_STAGES = (S.BEFORE_BATCH, S.AFTER_FORWARD, S.AFTER_BACKWARD, S.AFTER_BATCH)
STEP_PAIRS = [
    "BEFORE_BATCH->AFTER_FORWARD",
    "AFTER_FORWARD->AFTER_BACKWARD",
    "AFTER_BACKWARD->AFTER_BATCH",
]


class Sim(Enum):
    """The stages of a small simulation engine (not training's)."""

    BEFORE_STEP = auto()
    COMPUTE = auto()
    AFTER_STEP = auto()


def ctx(step=0, rank=0, batch=None):
    return SimpleNamespace(step_count=step, global_rank=rank, batch=batch)


def train(hook, steps=3):
    strategy(hooks=[hook], num_steps=steps).run(make_batches(steps))
    return hook


# ------------------------------------------------------------------ construction
@pytest.mark.parametrize("preset", ["all", "step", "detailed"])
def test_dynamics_presets_explain_that_there_is_no_dynamics_engine(preset):
    with pytest.raises(ValueError, match=r"DynamicsStage.*Pass the stages"):
        StageTimingHook(preset)


def test_unknown_preset_is_rejected():
    with pytest.raises(ValueError, match="unknown preset 'fast'"):
        StageTimingHook("fast")


@pytest.mark.parametrize("stages", [[S.AFTER_LOSS], [S.AFTER_LOSS, S.AFTER_LOSS], []])
def test_fewer_than_two_distinct_stages_are_rejected(stages):
    with pytest.raises(ValueError, match="at least 2 distinct"):
        StageTimingHook(stages)


def test_bad_stage_sets_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="mixes stages of several engines"):
        StageTimingHook({S.BEFORE_BATCH, Sim.AFTER_STEP})
    with pytest.raises(TypeError, match=r"profiled_stages\[1\] = 'AFTER_LOSS' is not an Enum"):
        StageTimingHook([S.BEFORE_LOSS, "AFTER_LOSS"])
    with pytest.raises(ValueError, match="DO_BACKWARD is a replacement slot"):
        StageTimingHook({S.BEFORE_BACKWARD, S.DO_BACKWARD})
    with pytest.raises(ValueError, match=r"stage=.*AFTER_LOSS.* is not one of the profiled"):
        StageTimingHook({S.BEFORE_BATCH, S.AFTER_BATCH}, stage=S.AFTER_LOSS)
    with pytest.raises(ValueError, match="timer_backend must be one of"):
        StageTimingHook({S.BEFORE_BATCH, S.AFTER_BATCH}, timer_backend="tsc")
    with pytest.raises(ValueError, match="console_frequency must be an int >= 1"):
        StageTimingHook({S.BEFORE_BATCH, S.AFTER_BATCH}, console_frequency=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_event_timer_needs_a_cuda_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StageTimingHook({S.BEFORE_BATCH, S.AFTER_BATCH}, timer_backend="cuda_event")


def test_stages_are_put_in_execution_order_and_the_hook_follows_the_protocol():
    hook = StageTimingHook([S.AFTER_BATCH, S.BEFORE_FORWARD, S.AFTER_LOSS])
    assert hook.profiled_stages == (S.BEFORE_FORWARD, S.AFTER_LOSS, S.AFTER_BATCH)
    assert hook.stage is S.BEFORE_FORWARD and hook.frequency == 1
    assert isinstance(hook, Hook)
    assert [s for s in S if hook._runs_on_stage(s)] == list(hook.profiled_stages)
    custom = StageTimingHook({Sim.AFTER_STEP, Sim.BEFORE_STEP}, stage=Sim.AFTER_STEP)
    assert custom.profiled_stages == (Sim.BEFORE_STEP, Sim.AFTER_STEP)
    assert custom.stage is Sim.AFTER_STEP


# ------------------------------------------------------------------ timing a real run
def test_a_training_run_is_timed_between_each_pair_of_consecutive_stages():
    hook = train(StageTimingHook(set(STEP_STAGES)))
    assert list(hook.timings) == STEP_PAIRS  # AFTER_BATCH (after the counters move) included
    assert all(len(v) == 3 and all(d > 0 for d in v) for v in hook.timings.values())
    assert hook.backend_used == "perf_counter"  # the batches are on the CPU
    summary = hook.summary()
    assert list(summary) == STEP_PAIRS
    for label, stats in summary.items():
        values = hook.timings[label]
        assert stats["n_samples"] == 3 and stats["total_s"] == pytest.approx(sum(values))
        assert stats["min_s"] == min(values) and stats["max_s"] == max(values)
        assert stats["min_s"] <= stats["mean_s"] <= stats["max_s"] and stats["std_s"] >= 0


def test_frequency_times_only_the_steps_the_engine_runs_the_hook_at(tmp_path):
    hook = train(StageTimingHook(set(STEP_STAGES), frequency=2, log_path=tmp_path / "t.csv"), 4)
    assert [len(v) for v in hook.timings.values()] == [2, 2, 2]
    with open(tmp_path / "t.csv", newline="") as handle:
        steps = {int(row["step"]) for row in csv.DictReader(handle)}
    assert steps == {1, 3}  # the 2nd and the 4th optimizer step (0-based counters 1 and 3)


def test_reset_forgets_the_timings():
    hook = train(StageTimingHook(set(STEP_STAGES)), 2)
    hook.reset()
    assert hook.timings == {} and hook.summary() == {}
    train(hook, 1)
    assert [len(v) for v in hook.timings.values()] == [1, 1, 1]


# ------------------------------------------------------------------ cycles, called directly
def test_a_stage_out_of_order_ends_the_cycle_and_a_lone_stage_times_nothing():
    hook = StageTimingHook({Sim.BEFORE_STEP, Sim.COMPUTE, Sim.AFTER_STEP})
    hook(ctx(0), Sim.BEFORE_STEP)
    hook(ctx(1), Sim.BEFORE_STEP)  # the next step began: the first cycle had one stage
    assert hook.timings == {}
    hook(ctx(1), Sim.COMPUTE)
    hook(ctx(2), Sim.BEFORE_STEP)  # out of order: the cycle BEFORE_STEP, COMPUTE ends
    assert list(hook.timings) == ["BEFORE_STEP->COMPUTE"]
    hook(ctx(2), Sim.AFTER_STEP)  # the last profiled stage ends the cycle at once
    assert hook.timings["BEFORE_STEP->AFTER_STEP"] and len(hook.timings) == 2


def test_a_cycle_never_spans_steps_the_hook_did_not_see():
    hook = StageTimingHook({Sim.BEFORE_STEP, Sim.AFTER_STEP})
    hook(ctx(0), Sim.BEFORE_STEP)
    hook(ctx(2), Sim.AFTER_STEP)  # step 1 was not seen: not one interval
    assert hook.timings == {}
    hook(ctx(4), Sim.BEFORE_STEP)
    hook(ctx(5), Sim.AFTER_STEP)  # the counter may move once inside a step (training does)
    assert len(hook.timings["BEFORE_STEP->AFTER_STEP"]) == 1


def test_close_times_the_cycle_in_progress():
    hook = StageTimingHook({Sim.BEFORE_STEP, Sim.COMPUTE, Sim.AFTER_STEP})
    hook(ctx(0), Sim.BEFORE_STEP)
    hook(ctx(0), Sim.COMPUTE)
    assert hook.timings == {}
    hook.close()
    assert list(hook.timings) == ["BEFORE_STEP->COMPUTE"]


# ------------------------------------------------------------------ outputs
def test_csv_rows_match_the_timings_and_appending_keeps_one_header(tmp_path):
    path = tmp_path / "logs" / "timing_{rank}.csv"
    first = train(StageTimingHook(set(STEP_STAGES), log_path=path), 2)
    first.close()
    written = tmp_path / "logs" / "timing_0.csv"
    with open(written, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["rank", "step", "stage", "t_since_init_s", "delta_s"]
    assert [r["stage"] for r in rows] == STEP_PAIRS * 2
    assert [int(r["step"]) for r in rows] == [0, 0, 0, 1, 1, 1]
    assert {r["rank"] for r in rows} == {"0"}
    deltas = [float(r["delta_s"]) for r in rows]
    expected = [first.timings[label][i] for i in range(2) for label in STEP_PAIRS]
    assert deltas == pytest.approx(expected, abs=1e-6)
    times = [float(r["t_since_init_s"]) for r in rows]
    assert times == sorted(times) and times[0] > 0
    train(StageTimingHook(set(STEP_STAGES), log_path=path), 1).close()
    lines = written.read_text().splitlines()
    assert len(lines) == 1 + 9 and lines.count(lines[0]) == 1


def test_a_file_that_is_not_a_timing_csv_is_left_alone(tmp_path):
    path = tmp_path / "notes.csv"
    path.write_text("name,value\nkeep,1\n")
    hook = StageTimingHook({Sim.BEFORE_STEP, Sim.AFTER_STEP}, log_path=path)
    hook(ctx(0), Sim.BEFORE_STEP)
    with pytest.raises(ValueError, match=r"notes\.csv exists and is not a stage-timing CSV"):
        hook(ctx(0), Sim.AFTER_STEP)
    assert path.read_text() == "name,value\nkeep,1\n"


def test_the_console_table_is_logged_every_console_frequency_cycles(caplog):
    caplog.set_level(logging.INFO, logger="nvalchemi.hooks.stage_timing")
    train(StageTimingHook(set(STEP_STAGES), show_console=True, console_frequency=2), 4)
    tables = [r.getMessage() for r in caplog.records if r.name == "nvalchemi.hooks.stage_timing"]
    assert len(tables) == 2
    assert tables[0].startswith("stage timings, rank 0, step 1:")
    assert all(label in tables[1] for label in STEP_PAIRS) and " ms" in tables[1]
    caplog.clear()
    train(StageTimingHook(set(STEP_STAGES)), 2)
    assert not [r for r in caplog.records if r.name == "nvalchemi.hooks.stage_timing"]


def test_nvtx_ranges_span_each_stage_to_the_next(monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: log.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: log.append(("pop",)))
    hook = StageTimingHook({S.BEFORE_BATCH, S.AFTER_FORWARD, S.AFTER_BATCH})
    log.clear()  # the availability probe
    train(hook, 2)
    assert log == [
        ("push", "training/BEFORE_BATCH/0"),
        ("pop",),
        ("push", "training/AFTER_FORWARD/0"),
        ("pop",),
        ("push", "training/BEFORE_BATCH/1"),
        ("pop",),
        ("push", "training/AFTER_FORWARD/1"),
        ("pop",),
    ]
    log.clear()
    custom = StageTimingHook({Sim.BEFORE_STEP, Sim.AFTER_STEP})
    log.clear()
    custom(ctx(7), Sim.BEFORE_STEP)
    custom.reset()  # an open range is closed, never leaked
    assert log == [("push", "custom/BEFORE_STEP/7"), ("pop",)]
    log.clear()
    train(StageTimingHook({S.BEFORE_BATCH, S.AFTER_BATCH}, enable_nvtx=False), 1)
    assert log == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_are_timed_with_cuda_events_that_see_queued_device_work():
    hook = StageTimingHook({Sim.BEFORE_STEP, Sim.COMPUTE, Sim.AFTER_STEP})
    batch = SimpleNamespace(device=torch.device("cuda"))
    for step in range(3):
        hook(ctx(step, batch=batch), Sim.BEFORE_STEP)
        torch.cuda._sleep(50_000_000)  # queued device work; the host returns at once
        hook(ctx(step, batch=batch), Sim.COMPUTE)
        hook(ctx(step, batch=batch), Sim.AFTER_STEP)
    assert hook.backend_used == "cuda_event"
    busy, idle = hook.timings["BEFORE_STEP->COMPUTE"], hook.timings["COMPUTE->AFTER_STEP"]
    # The device time lands in the interval whose work it was, whatever the host did.
    assert all(b > 10 * i for b, i in zip(busy, idle))
    on_gpu = StageTimingHook(set(STEP_STAGES))
    strategy(hooks=[on_gpu], num_steps=2, devices="cuda").run(make_batches(2))
    assert on_gpu.backend_used == "cuda_event" and list(on_gpu.timings) == STEP_PAIRS
