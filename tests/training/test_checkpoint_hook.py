"""CheckpointHook cadence, async writes, best/last retention, NaN guard, ranks; PreemptionHandler."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import _checkpoint_support as C
import _update_support as U
import pytest
import torch
from _ranks import run_ranks
from pydantic import ValidationError

from nvalchemi.training import TrainingStage, TrainingStrategy, ValidationConfig
from nvalchemi.training.checkpoint import (
    CheckpointManifest,
    load_checkpoint,
    strategy_load_checkpoint,
)
from nvalchemi.training.errors import NonFiniteLossError
from nvalchemi.training.hooks.checkpoint import CheckpointHook
from nvalchemi.training.hooks.ema import EMAHook
from nvalchemi.training.preemption import PREEMPTION_EXIT_CODE, PreemptionHandler


def _entries(root: Path) -> list[tuple[int, int, str]]:
    manifest = CheckpointManifest.read(root)
    return [(e.index, e.step_count, e.reason) for e in manifest.checkpoints]


# ---------------------------------------------------------------------------- construction
def test_exactly_one_positive_interval_and_the_directory_by_position_or_keyword():
    hook = CheckpointHook("runs/x", step_interval=10)
    assert hook.checkpoint_dir == Path("runs/x") and hook.keep_last is None
    assert CheckpointHook(checkpoint_dir="runs/x", step_interval=1).checkpoint_dir == Path("runs/x")
    assert "last_checkpoint_index" not in hook.model_dump()
    with pytest.raises(ValidationError, match="exactly one"):
        CheckpointHook("runs/x")
    with pytest.raises(ValidationError, match="exactly one"):
        CheckpointHook("runs/x", step_interval=1, epoch_interval=1)
    with pytest.raises(ValidationError, match="greater than 0"):
        CheckpointHook("runs/x", step_interval=0)
    with pytest.raises(TypeError, match="multiple values for argument 'checkpoint_dir'"):
        CheckpointHook("runs/x", checkpoint_dir="runs/y", step_interval=1)
    with pytest.raises(ValidationError, match="Extra inputs"):
        CheckpointHook("runs/x", step_interval=1, max_checkpoints=5)


# ---------------------------------------------------------------------------- cadence
def test_step_cadence_saves_once_per_multiple_even_when_steps_are_vetoed(tmp_path):
    hook = CheckpointHook(tmp_path, step_interval=2)
    veto = U.Veto({0, 2, 4, 6})  # every other batch makes no optimizer step
    strategy = C.strategy(num_steps=4, hooks=[hook, veto])
    strategy.run(C.batches(8))
    assert strategy.step_count == 4 and strategy.batch_count == 8
    assert [(i, s) for i, s, _ in _entries(tmp_path)] == [(0, 2), (1, 4)]
    assert hook.last_checkpoint_index == 1


def test_epoch_cadence_saves_at_epoch_ends(tmp_path):
    strategy = C.strategy(
        num_steps=None, num_epochs=3, hooks=[CheckpointHook(tmp_path, epoch_interval=1)]
    )
    strategy.run(C.batches(2))
    assert [s for _, s, _ in _entries(tmp_path)] == [2, 4, 6]
    assert [e.epoch_count for e in CheckpointManifest.read(tmp_path).checkpoints] == [1, 2, 3]


def test_save_on_train_end_writes_the_final_state_once(tmp_path):
    strategy = C.strategy(num_steps=3, hooks=[CheckpointHook(tmp_path, step_interval=2)])
    strategy.run(C.batches())
    assert _entries(tmp_path) == [(0, 2, "step"), (1, 3, "train_end")]
    quiet = C.strategy(
        num_steps=3,
        hooks=[CheckpointHook(tmp_path / "q", step_interval=2, save_on_train_end=False)],
    )
    quiet.run(C.batches())
    assert [s for _, s, _ in _entries(tmp_path / "q")] == [2]


@pytest.mark.filterwarnings("ignore:The saved run used hooks")
def test_async_writes_hold_the_state_of_their_step_and_are_flushed_at_exit(tmp_path, monkeypatch):
    monkeypatch.setenv("NVALCHEMI_CHECKPOINT_SLOW_WRITES", "0.01")
    weights = {}
    model = C.demo_model()
    record = U.StageHook(
        TrainingStage.AFTER_BATCH, lambda ctx: weights.setdefault(ctx.step_count, C.params(model))
    )
    hook = CheckpointHook(tmp_path, step_interval=1, async_save=True)
    strategy = C.strategy(model, num_steps=4, hooks=[record, hook])
    strategy.run(C.batches(4))
    assert not any(t.name.startswith("nvalchemi-checkpoint") for t in threading.enumerate())
    assert hook.last_checkpoint_index == 3
    for index, step, _ in _entries(tmp_path):
        loaded = load_checkpoint(tmp_path, checkpoint_index=index)["strategy"]
        assert loaded.step_count == step
        assert C.same_state(C.params(loaded.unwrapped_models()["main"]), weights[step])


def test_nonfinite_loss_stops_the_save_and_keeps_previous_checkpoints(tmp_path):
    hook = CheckpointHook(tmp_path, step_interval=1, async_save=False)
    strategy = C.strategy(num_steps=3, hooks=[hook])
    batches = C.batches(1) + C.batches(2, nan=True)
    with pytest.raises(NonFiniteLossError):
        strategy.run(batches)
    assert [s for _, s, _ in _entries(tmp_path)] == [1]


def test_best_and_last_retention_follow_validation(tmp_path):
    values = iter([3.0, 1.0, 2.0, 5.0])  # validations at steps 2, 4, 6, 8

    class Summary:
        frequency, stage = 1, TrainingStage.AFTER_VALIDATION

        def __call__(self, ctx, stage):
            ctx.validation["total_loss"] = torch.tensor(next(values))

    val = ValidationConfig(validation_data=C.batches(1), every_n_steps=2)
    hook = CheckpointHook(tmp_path, step_interval=1, keep_last=1, keep_best=2)
    strategy = C.strategy(num_steps=8, hooks=[Summary(), hook], validation_config=val)
    strategy.run(C.batches(4))
    manifest = CheckpointManifest.read(tmp_path)
    kept = {e.step_count: e.metric["value"] if e.metric else None for e in manifest.checkpoints}
    assert kept == {4: 1.0, 6: 2.0, 8: 5.0}  # the two best and the latest
    assert manifest.entry("best").step_count == 4
    assert len(list((tmp_path / "checkpoints").iterdir())) == 3


@pytest.mark.filterwarnings("ignore:The saved run used hooks")
def test_resume_reproduces_uninterrupted_ema_training_in_process(tmp_path):
    reference_ema = EMAHook(decay=0.5)
    reference = C.strategy(num_steps=6, hooks=[reference_ema])
    reference.run(C.batches())

    first = C.strategy(
        num_steps=4, hooks=[EMAHook(decay=0.5), CheckpointHook(tmp_path, step_interval=2)]
    )
    first.run(C.batches())
    ema = EMAHook(decay=0.5)
    resumed = strategy_load_checkpoint(TrainingStrategy, tmp_path, checkpoint_index=0, hooks=[ema])
    assert resumed.step_count == 2
    resumed.num_steps = 6
    resumed.run(C.batches())
    assert C.same_state(
        C.params(resumed.unwrapped_models()["main"]), C.params(reference.unwrapped_models()["main"])
    )
    assert C.same_state(
        ema.get_averaged_model().state_dict(), reference_ema.get_averaged_model().state_dict()
    )


def test_other_ranks_do_not_write(tmp_path):
    class Rank1:
        global_rank, world_size = 1, 1

    strategy = C.strategy(
        num_steps=2, hooks=[CheckpointHook(tmp_path, step_interval=1)], distributed_manager=Rank1()
    )
    strategy.run(C.batches())
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_gloo_ranks_rank0_writes_and_each_rank_restores_its_rng(tmp_path):
    script = Path(__file__).with_name("_checkpoint_ranks.py")
    results = run_ranks(script, args=[str(tmp_path / "ckpt")])
    r0, r1 = results
    assert r0["index"] == 0 and r1["index"] is None  # only rank 0 wrote
    assert r0["entries"] == r1["entries"] == [0]
    assert r0["rng_files"] == ["rank_0.pt", "rank_1.pt"] and r0["world_size"] == 2
    assert r0["same_draws"] and r1["same_draws"] and r0["draws"] != r1["draws"]
    assert r0["step"] == r1["step"] == 2


# ---------------------------------------------------------------------------- preemption
class _SignalAt:
    frequency, stage = 1, TrainingStage.AFTER_BATCH

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def __call__(self, ctx, stage):
        if ctx.step_count == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.filterwarnings("ignore:The saved run used hooks")
def test_preemption_signal_checkpoints_after_the_step_and_exits_75(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    handler = PreemptionHandler()
    hooks = [_SignalAt(2, signal.SIGUSR1), CheckpointHook(tmp_path, step_interval=100), handler]
    strategy = C.strategy(num_steps=10, hooks=hooks)
    with pytest.raises(SystemExit) as exit_info:
        strategy.run(C.batches())
    assert exit_info.value.code == PREEMPTION_EXIT_CODE == 75
    assert signal.getsignal(signal.SIGUSR1) is before
    assert handler.preempted and strategy.step_count == 2
    assert "SIGUSR1" in strategy.stop_reason
    assert [s for _, s, _ in _entries(tmp_path)] == [2]
    assert strategy_load_checkpoint(TrainingStrategy, tmp_path).step_count == 2


def test_preemption_without_exit_returns_and_can_use_its_own_directory(tmp_path):
    handler = PreemptionHandler(tmp_path / "pre", exit=False)
    strategy = C.strategy(num_steps=10, hooks=[_SignalAt(3, signal.SIGTERM), handler])
    strategy.run(C.batches())
    assert handler.preempted and handler.checkpoint_index == 0 and strategy.step_count == 3
    assert CheckpointManifest.read(tmp_path / "pre").entry("latest").reason == "preemption"


def test_preemption_needs_a_checkpoint_destination():
    strategy = C.strategy(num_steps=1, hooks=[PreemptionHandler()])
    with pytest.raises(ValueError, match="register a CheckpointHook"):
        strategy.run(C.batches())


def _flat(value):
    if isinstance(value, dict):
        return {k: _flat(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.cpu().numpy().tobytes())
    return value


def test_update_hook_states_grad_scaler_spike_statistics_and_accumulation_round_trip(tmp_path):
    from nvalchemi.training.hooks.gradients import GradientAccumulationHook, LossSpikeSkipHook
    from nvalchemi.training.hooks.mixed_precision import MixedPrecisionHook

    def hooks():
        return [
            MixedPrecisionHook(precision="float16"),
            LossSpikeSkipHook(factor=10.0, window=4, warmup_steps=1),
            GradientAccumulationHook(2),
            EMAHook(decay=0.5),
        ]

    first = hooks()
    strategy = C.strategy(num_steps=3, hooks=first)
    strategy.run(C.batches(7))
    strategy.save_checkpoint(tmp_path)
    saved = _flat(strategy.orchestrator().state_dict())
    assert saved["MixedPrecisionHook"]["grad_scaler"] is not None
    assert saved["LossSpikeSkipHook"]["accepted"] == 3

    second = hooks()
    loaded = TrainingStrategy.load_checkpoint(tmp_path, hooks=second)
    assert _flat(loaded.orchestrator().state_dict()) == saved
