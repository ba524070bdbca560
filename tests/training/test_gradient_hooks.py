"""Gradient accumulation, clipping and loss-spike skipping, alone and composed with EMA and AMP."""

from __future__ import annotations

import copy
import textwrap

import _update_support as S
import pytest
import torch
from _ranks import run_ranks
from pydantic import ValidationError

from nvalchemi.data import Batch
from nvalchemi.training import EnergyMSELoss, TrainingStage, ValidationConfig
from nvalchemi.training.hooks import (
    EMAHook,
    GradientAccumulationHook,
    GradientClipHook,
    LossSpikeSkipHook,
    MixedPrecisionHook,
)
from nvalchemi.training.hooks.update import TrainingUpdateOrchestrator


def _record(strategy, stage, fn, frequency: int = 1) -> list:
    out: list = []
    strategy.register_hook(S.StageHook(stage, lambda ctx: out.append(fn(ctx)), frequency))
    return out


# ----------------------------------------------------------------------------- configuration
def test_priorities_exclusivity_and_validation():
    assert (GradientAccumulationHook.priority, GradientClipHook.priority) == (10, 30)
    assert LossSpikeSkipHook.priority == 40
    assert GradientAccumulationHook(3).steps == 3
    assert GradientClipHook(2.0).max_norm == 2.0
    for bad in (
        lambda: GradientAccumulationHook(0),
        lambda: GradientClipHook(max_norm=0.0),
        lambda: GradientClipHook(max_value=-1.0),
        lambda: LossSpikeSkipHook(factor=1.0),
        lambda: LossSpikeSkipHook(window=5, warmup_steps=6),
        lambda: GradientClipHook(1.0, max_norm=2.0),
        lambda: LossSpikeSkipHook(threshold=3.0),
    ):
        with pytest.raises((ValidationError, TypeError)):
            bad()
    with pytest.raises(ValueError, match="exclusive key 'GradientClipHook'"):
        TrainingUpdateOrchestrator(GradientClipHook(1.0), GradientClipHook(2.0))


# ----------------------------------------------------------------------------- accumulation
def test_accumulating_n_batches_equals_one_batch_n_times_larger():
    structures = S.make_structures(6, atoms=3, seed=7)
    small = [Batch.from_data_list(structures[i : i + 2]) for i in (0, 2, 4)]
    large = Batch.from_data_list(structures)
    torch.manual_seed(0)
    model_a = S.ForceMLP()
    model_b = copy.deepcopy(model_a)

    probe_a = S.GradProbe(priority=35)
    acc = S.make_strategy(model_a, hooks=[GradientAccumulationHook(3), probe_a], num_steps=1)
    acc.run(small)
    probe_b = S.GradProbe(priority=35)
    S.make_strategy(model_b, hooks=[probe_b], num_steps=1).run([large])

    assert (acc.step_count, acc.batch_count) == (1, 3)
    assert len(probe_a.grads) == len(probe_b.grads) == 1  # one optimizer step each
    for a, b in zip(probe_a.grads[0], probe_b.grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_parked_steps_do_not_refire_step_cadence():
    val = S.make_batches(1, seed=40)
    strategy = S.make_strategy(
        hooks=[GradientAccumulationHook(3)],
        num_steps=4,
        validation_config=ValidationConfig(validation_data=val, every_n_steps=2),
    )
    validated = _record(strategy, TrainingStage.AFTER_VALIDATION, lambda ctx: ctx.step_count)
    every_two = _record(strategy, TrainingStage.AFTER_BATCH, lambda ctx: ctx.step_count, 2)
    strategy.run(S.make_batches(12))
    assert (strategy.step_count, strategy.batch_count) == (4, 12)
    assert validated == [2, 4]
    assert every_two == [2, 4]


def test_loss_published_after_backward_is_the_unscaled_loss():
    strategy = S.make_strategy(hooks=[GradientAccumulationHook(2)], num_steps=10)
    seen = _record(
        strategy,
        TrainingStage.AFTER_BATCH,
        lambda ctx: (float(ctx.loss), float(ctx.losses["total_loss"])),
    )
    returned = [float(strategy.train_batch(batch)) for batch in S.make_batches(2)]
    strategy.close()
    assert [published for published, _ in seen] == pytest.approx([total for _, total in seen])
    assert returned == pytest.approx([total for _, total in seen])


def test_accumulation_state_round_trip():
    hook = GradientAccumulationHook(4)
    strategy = S.make_strategy(hooks=[hook], num_steps=10)
    for batch in S.make_batches(6):  # one step, then two parked batches
        strategy.train_batch(batch)
    strategy.close()
    assert (strategy.step_count, hook.micro_step) == (1, 2)
    state = hook.state_dict()
    fresh = GradientAccumulationHook(4)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state == {"steps": 4, "micro_step": 2}
    with pytest.raises(ValueError, match="steps=4 vs constructor steps=2"):
        GradientAccumulationHook(2).load_state_dict(state)


# ----------------------------------------------------------------------------- clipping
def _clip_run(clip: GradientClipHook):
    torch.manual_seed(0)
    before, after = S.GradProbe(priority=25), S.GradProbe(priority=35)
    S.make_strategy(hooks=[clip, before, after], num_steps=2).run(S.make_batches(2))
    return before, after


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def test_clip_by_norm_reports_the_pre_clip_norm():
    before, after = _clip_run(GradientClipHook(max_norm=1e-3))
    for raw, clipped, reported in zip(before.grads, after.grads, after.norms):
        assert isinstance(reported, torch.Tensor) and reported.device.type == "cpu"
        torch.testing.assert_close(reported, _norm(raw))
        assert _norm(raw) > 1e-3
        torch.testing.assert_close(_norm(clipped), torch.tensor(1e-3), rtol=1e-3, atol=0)
        for r, c in zip(raw, clipped):  # same direction
            torch.testing.assert_close(c, r * (1e-3 / _norm(raw)), rtol=1e-3, atol=1e-9)


def test_clip_by_value_and_both():
    before, after = _clip_run(GradientClipHook(max_value=1e-3))
    for raw, clipped, reported in zip(before.grads, after.grads, after.norms):
        torch.testing.assert_close(reported, _norm(raw))
        for r, c in zip(raw, clipped):
            torch.testing.assert_close(c, r.clamp(-1e-3, 1e-3))
    before, after = _clip_run(GradientClipHook(max_norm=1e-3, max_value=1e-4))
    for raw, clipped, reported in zip(before.grads, after.grads, after.norms):
        torch.testing.assert_close(reported, _norm(raw))
        assert max(c.abs().max() for c in clipped) <= 1e-4 + 1e-12
        assert _norm(clipped) <= 1e-3 * (1 + 1e-4)


def test_monitor_only_and_no_clipping_on_parked_batches():
    before, after = _clip_run(GradientClipHook())
    for raw, kept in zip(before.grads, after.grads):
        assert all(torch.equal(r, k) for r, k in zip(raw, kept))
    strategy = S.make_strategy(
        hooks=[GradientAccumulationHook(2), GradientClipHook(1.0)], num_steps=2
    )
    norms = _record(strategy, TrainingStage.AFTER_BATCH, lambda ctx: ctx.grad_norm)
    strategy.run(S.make_batches(4))
    assert [n is None for n in norms] == [True, False, True, False]


# ----------------------------------------------------------------------------- spike skipping
def _spiky_batches(n: int, spike_at: set[int], scale: float = 30.0) -> list[Batch]:
    structures = S.make_structures(2, atoms=3, seed=11)
    batches = []
    for i in range(n):
        batch = Batch.from_data_list(structures)
        if i in spike_at:
            batch = batch.clone()
            batch.energy = batch.energy * scale + scale
        batches.append(batch)
    return batches


def test_spike_skipping_skips_exactly_the_spiking_step():
    model = S.ForceMLP()
    hook = LossSpikeSkipHook(factor=3.0, window=10, warmup_steps=2)
    strategy = S.make_strategy(model, hooks=[hook], num_steps=5, loss_fn=EnergyMSELoss())
    decisions = _record(strategy, TrainingStage.AFTER_BATCH, lambda ctx: hook.last_step_skipped)
    weights = _record(strategy, TrainingStage.AFTER_BATCH, lambda ctx: S.params_of(model))
    strategy.run(_spiky_batches(6, {4}))
    assert decisions == [False, False, False, False, True, False]
    assert hook.num_skipped == 1
    assert (strategy.step_count, strategy.batch_count) == (5, 6)
    assert all(torch.equal(a, b) for a, b in zip(weights[3], weights[4]))
    assert not all(torch.equal(a, b) for a, b in zip(weights[4], weights[5]))


def test_spike_before_warmup_is_not_skipped():
    hook = LossSpikeSkipHook(factor=3.0, window=4, warmup_steps=3)
    strategy = S.make_strategy(hooks=[hook], num_steps=3, loss_fn=EnergyMSELoss())
    strategy.run(_spiky_batches(3, {1}))
    assert hook.num_skipped == 0 and strategy.step_count == 3


def test_ema_statistic_skips_the_spike():
    hook = LossSpikeSkipHook(factor=3.0, window=4, warmup_steps=3, statistic="ema")
    strategy = S.make_strategy(hooks=[hook], num_steps=6, loss_fn=EnergyMSELoss())
    decisions = _record(strategy, TrainingStage.AFTER_BATCH, lambda ctx: hook.last_step_skipped)
    strategy.run(_spiky_batches(7, {5}))
    assert decisions == [False] * 5 + [True, False]
    assert hook.state_dict()["ema"] is not None


@pytest.mark.parametrize("nonfinite_loss", ["ignore", "raise"])
def test_nonfinite_gradients_are_skipped(nonfinite_loss):
    # With "raise", a NaN the hook skipped must not raise at the strategy's next check.
    model = S.ForceMLP()
    hook = LossSpikeSkipHook(warmup_steps=1)

    def poison(ctx):
        if ctx.batch_count == 2:
            ctx.loss = ctx.loss * float("nan")

    strategy = S.make_strategy(model, hooks=[hook], num_steps=3, nonfinite_loss=nonfinite_loss)
    strategy.register_hook(S.StageHook(TrainingStage.AFTER_LOSS, poison))
    strategy.run(S.make_batches(4))
    assert hook.num_skipped == 1 and strategy.step_count == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_max_grad_norm_threshold_uses_the_clip_hooks_pre_clip_norm():
    hook = LossSpikeSkipHook(max_grad_norm=1e-9, warmup_steps=1)
    strategy = S.make_strategy(
        hooks=[GradientClipHook(1.0), hook], num_steps=1, max_consecutive_skips=None
    )
    strategy.num_steps = 1
    for batch in S.make_batches(3):
        strategy.train_batch(batch)
    strategy.close()
    assert hook.num_skipped == 3 and strategy.step_count == 0


def test_spike_in_an_accumulation_window_skips_the_whole_window():
    hook = LossSpikeSkipHook(factor=3.0, window=10, warmup_steps=2)
    strategy = S.make_strategy(
        hooks=[GradientAccumulationHook(2), hook], num_steps=4, loss_fn=EnergyMSELoss()
    )
    decisions = _record(strategy, TrainingStage.AFTER_BATCH, lambda ctx: ctx.step_count)
    strategy.run(_spiky_batches(10, {6}))
    assert hook.num_skipped == 1
    assert decisions == [0, 1, 1, 2, 2, 3, 3, 3, 3, 4]


def test_spike_state_round_trip():
    hook = LossSpikeSkipHook(factor=3.0, window=10, warmup_steps=2)
    S.make_strategy(hooks=[hook], num_steps=5, loss_fn=EnergyMSELoss()).run(_spiky_batches(6, {4}))
    state = hook.state_dict()
    fresh = LossSpikeSkipHook(factor=3.0, window=10, warmup_steps=2)
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    assert again.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):  # NaN marks unused ring-buffer slots
            assert torch.equal(value.nan_to_num(-1.0), again[key].nan_to_num(-1.0))
        else:
            assert value == again[key]
    assert fresh.num_skipped == 1
    with pytest.raises(ValueError, match="window=10 vs constructor window=20"):
        LossSpikeSkipHook(window=20).load_state_dict(state)


# ----------------------------------------------------------------------------- composition
def test_all_hooks_composed_in_one_run():
    torch.manual_seed(0)
    model = S.ForceMLP(hidden=32)
    hooks = [
        EMAHook(decay=0.9),
        MixedPrecisionHook("bf16"),
        GradientAccumulationHook(2),
        GradientClipHook(max_norm=5.0),
        LossSpikeSkipHook(factor=5.0, warmup_steps=3),
    ]
    val = S.make_batches(2, size=4, atoms=4, seed=30)
    strategy = S.make_strategy(
        model,
        hooks=hooks,
        optimizer_configs=S.adam(1e-2),
        loss_fn=EnergyMSELoss(),  # random force labels are not learnable; energies are
        num_steps=12,
        validation_config=ValidationConfig(validation_data=val, every_n_steps=6),
    )
    losses = _record(
        strategy, TrainingStage.AFTER_BATCH, lambda ctx: float(ctx.losses["total_loss"])
    )
    validated = _record(strategy, TrainingStage.AFTER_VALIDATION, lambda ctx: ctx.step_count)
    strategy.run(S.make_batches(2, size=4, atoms=4))
    orchestrator = strategy.hooks[0]
    assert [type(h).__name__ for h in orchestrator.iter_hooks()] == [
        "GradientAccumulationHook",
        "MixedPrecisionHook",
        "GradientClipHook",
        "LossSpikeSkipHook",
        "EMAHook",
    ]
    skipped = hooks[4].num_skipped
    assert strategy.step_count == 12 and strategy.batch_count == 2 * (12 + skipped)
    assert hooks[0].num_updates == 12
    assert validated == [6, 12]
    assert strategy.last_validation["model_source"] == "ema"
    assert strategy.last_validation["precision"] == "bfloat16"
    assert sum(losses[-4:]) < 0.5 * sum(losses[:4]), losses

    # every stateful hook round-trips through the orchestrator (keys = class names)
    state = orchestrator.state_dict()
    assert set(state) == {
        "EMAHook",
        "MixedPrecisionHook",
        "GradientAccumulationHook",
        "LossSpikeSkipHook",
    }
    fresh_hooks = [
        EMAHook(decay=0.9),
        MixedPrecisionHook("bf16"),
        GradientAccumulationHook(2),
        GradientClipHook(max_norm=5.0),
        LossSpikeSkipHook(factor=5.0, warmup_steps=3),
    ]
    fresh = TrainingUpdateOrchestrator(*fresh_hooks)
    fresh.load_state_dict(state)
    restored = fresh.state_dict()
    assert restored["GradientAccumulationHook"] == state["GradientAccumulationHook"]
    assert restored["MixedPrecisionHook"] == state["MixedPrecisionHook"]
    assert restored["EMAHook"]["num_updates"] == 12
    for key, value in state["EMAHook"]["averaged_model_state"].items():
        assert torch.equal(restored["EMAHook"]["averaged_model_state"][key], value)


class _SyncDetected(AssertionError):
    pass


def test_per_step_hook_code_never_reads_device_values(monkeypatch):
    """EMA, AMP (bf16), accumulation and clipping: no .item()/bool()/float()/.cpu() per step."""
    guarded = {"on": False}

    def forbid(name):
        original = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            if guarded["on"]:
                raise _SyncDetected(f"Tensor.{name} called inside an update hook")
            return original(self, *args, **kwargs)

        return method

    for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbid(name))

    def watch(cls):
        call = cls.__call__

        def wrapped(self, ctx, stage, will_skip):
            if stage is TrainingStage.SETUP:
                return call(self, ctx, stage, will_skip)
            guarded["on"] = True
            try:
                return call(self, ctx, stage, will_skip)
            finally:
                guarded["on"] = False

        monkeypatch.setattr(cls, "__call__", wrapped)

    for cls in (EMAHook, MixedPrecisionHook, GradientAccumulationHook, GradientClipHook):
        watch(cls)
    hooks = [
        EMAHook(decay=0.9),
        MixedPrecisionHook("bf16"),
        GradientAccumulationHook(2),
        GradientClipHook(max_norm=1.0, max_value=1.0),
    ]
    strategy = S.make_strategy(hooks=hooks, num_steps=3, nonfinite_loss="ignore")
    strategy.run(S.make_batches(6))
    assert strategy.step_count == 3 and hooks[0].num_updates == 3


# ----------------------------------------------------------------------------- distributed
_CHILD = textwrap.dedent(
    """
    import torch
    import _update_support as S
    from _ranks import init_group, report, teardown
    from nvalchemi.data import Batch
    from nvalchemi.training import EnergyMSELoss, TrainingStage
    from nvalchemi.training.hooks import LossSpikeSkipHook
    rank = init_group()
    structures = S.make_structures(2, atoms=3, seed=11)
    batches = []
    for i in range(6):
        batch = Batch.from_data_list(structures)
        if rank == 0 and i == 4:  # only rank 0 sees the spike
            batch = batch.clone(); batch.energy = batch.energy * 30.0 + 30.0
        batches.append(batch)
    torch.manual_seed(0)
    hook = LossSpikeSkipHook(factor=3.0, window=10, warmup_steps=2)
    strategy = S.make_strategy(S.ForceMLP(), hooks=[hook], num_steps=5, loss_fn=EnergyMSELoss())
    decisions = []
    strategy.register_hook(S.StageHook(TrainingStage.AFTER_BATCH,
                                       lambda ctx: decisions.append(hook.last_step_skipped)))
    strategy.run(batches)
    report(rank=rank, decisions=decisions, steps=strategy.step_count)
    teardown()
    """
)


@pytest.mark.slow
@pytest.mark.distributed
def test_spike_decision_agrees_across_ranks():
    results = run_ranks(_CHILD)
    expected = [False, False, False, False, True, False]
    assert [r["decisions"] for r in results] == [expected] * 2
    assert [r["steps"] for r in results] == [5, 5]
