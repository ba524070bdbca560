"""``TimeBudgetHook`` and ``WarmupCosineLR``: a run fitted to its budget (fake clocks), a
clean stop agreed by every rank under DDP."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _ranks import run_ranks
from _training_support import TinyModel, make_batches

from nvalchemi.training import EnergyMSELoss, OptimizerConfig, TrainingStrategy
from nvalchemi.training.stages import TrainingStage
from nvalchemi.training.time_budget import TimeBudgetHook, WarmupCosineLR

RANKS = Path(__file__).with_name("_time_budget_ranks.py")
AFTER = TrainingStage.AFTER_BATCH


class Clock:
    """A fake monotonic clock: the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Strategy:
    def __init__(self, num_steps=None, num_epochs=None, loader_len=20, validation=None):
        self.step_count = 0
        self.distributed_manager = None
        self.stop_reason = None
        self.num_steps, self.num_epochs = num_steps, num_epochs
        self.epoch_step_modifier = 1.0
        self.active_dataloader = list(range(loader_len))
        self.validation_config = validation

    def request_stop(self, reason):
        self.stop_reason = self.stop_reason or reason


def _scheduler(total=1000):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return optimizer, WarmupCosineLR(optimizer, total_steps=total, warmup_fraction=0.1)


def _train(hook, strategy, clock, step_s, *, scheduler=None, optimizer=None, until=10_000):
    """Drive the hook like the loop: a step of ``step_s(step)`` seconds each, until a stop."""
    ctx = SimpleNamespace(workflow=strategy, step_count=0, lr_schedulers=[scheduler])
    hook(ctx, TrainingStage.BEFORE_TRAINING)
    lrs = []
    while strategy.stop_reason is None and strategy.step_count < until:
        clock.now += step_s(strategy.step_count)
        if scheduler is not None:
            optimizer.step()
            scheduler.step()
            lrs.append(scheduler.get_last_lr()[0])
        strategy.step_count += 1
        ctx.step_count = strategy.step_count
        hook(ctx, AFTER)
    return lrs


def test_the_run_fills_the_budget_and_its_schedule_anneals_inside_it():
    clock, strategy = Clock(), _Strategy(num_steps=10**9)
    optimizer, scheduler = _scheduler()
    hook = TimeBudgetHook(100, warmup_steps=3, probe_steps=12, clock=clock)
    lrs = _train(hook, strategy, clock, lambda s: 0.5, scheduler=scheduler, optimizer=optimizer)
    # Timed at step 15 (0.5 s/step, 7.5 s spent): (99 - 7.5) / 0.5 = 183 more steps.
    assert hook.plan.planned_steps == 15 + 183 and strategy.step_count == 198
    assert strategy.stop_reason == "end of the run fitted to the 1.67 min budget (step 198)"
    assert clock.now <= 100 and clock.now >= 98  # used, not only capped
    assert scheduler.total_steps == 198
    assert lrs[-1] == pytest.approx(0.01)  # annealed to its final value at the planned end
    assert max(lrs) == pytest.approx(1.0, abs=1e-3)  # the warm-up reached the peak


def test_validation_passes_are_counted_in_the_plan():
    clock = Clock()
    validation = SimpleNamespace(
        validation_data=list(range(10)), every_n_epochs=1, every_n_steps=None
    )
    strategy = _Strategy(num_steps=10**9, loader_len=20, validation=validation)
    hook = TimeBudgetHook(100, warmup_steps=3, probe_steps=12, clock=clock)
    _train(hook, strategy, clock, lambda s: 0.5, until=16)
    # 10 validation batches at 0.6 x 0.5 s every 20 steps = 0.15 s per step; 3 s at the end.
    assert hook.plan.planned_steps == 15 + math.floor((99 - 7.5 - 3.0) / 0.65)


def test_a_speed_drift_refits_once_without_a_jump_in_the_learning_rate():
    clock, strategy = Clock(), _Strategy(num_steps=10**9)
    optimizer, scheduler = _scheduler()
    hook = TimeBudgetHook(100, warmup_steps=3, probe_steps=12, clock=clock)
    lrs = _train(
        hook,
        strategy,
        clock,
        lambda s: 0.5 if s < 15 else 1.0,  # slower after the plan
        scheduler=scheduler,
        optimizer=optimizer,
    )
    assert hook.plan.refitted
    first_quarter = 15 + (198 - 15) // 4
    assert hook.plan.planned_steps < 198 and strategy.step_count == hook.plan.planned_steps
    assert clock.now <= 100  # the refit keeps the run inside the budget
    jumps = [abs(b - a) for a, b in itertools.pairwise(lrs)]
    assert jumps[first_quarter - 1] < 5 * max(jumps[first_quarter - 5 : first_quarter - 1])
    assert lrs[-1] == pytest.approx(0.01)


def test_a_late_slowdown_shortens_the_run_so_the_anneal_still_ends_in_time():
    clock, strategy = Clock(), _Strategy(num_steps=10**9)
    optimizer, scheduler = _scheduler()
    hook = TimeBudgetHook(100, warmup_steps=3, probe_steps=12, clock=clock)
    lrs = _train(
        hook,
        strategy,
        clock,
        lambda s: 0.5 if s < 100 else 0.6,  # others joined in
        scheduler=scheduler,
        optimizer=optimizer,
    )
    assert not hook.plan.refitted and hook.plan.shortened  # the quarter was fine, 3/4 was not
    assert strategy.step_count == hook.plan.planned_steps < 198
    assert clock.now <= 100 and lrs[-1] == pytest.approx(0.01)
    assert strategy.stop_reason.startswith("end of the run fitted")


def test_a_fixed_length_wins_and_a_shorter_budget_says_so():
    clock, strategy = Clock(), _Strategy(num_steps=1000)
    optimizer, scheduler = _scheduler(total=1000)
    hook = TimeBudgetHook(100, fit=False, warmup_steps=3, probe_steps=12, clock=clock)
    with pytest.warns(UserWarning, match=r"fits about 198 of the run's 1,000 steps"):
        _train(hook, strategy, clock, lambda s: 0.5, scheduler=scheduler, optimizer=optimizer)
    assert scheduler.total_steps == 1000  # not fitted
    assert strategy.stop_reason == "time budget of 1.67 min reached"
    assert 100 <= clock.now < 100.5


def test_a_fixed_length_schedule_is_named_when_the_run_is_fitted():
    clock, strategy = Clock(), _Strategy(num_steps=10**9)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=50)
    hook = TimeBudgetHook(100, warmup_steps=1, probe_steps=2, clock=clock)
    with pytest.warns(UserWarning, match=r"\['CosineAnnealingLR'\] have a fixed length"):
        _train(hook, strategy, clock, lambda s: 0.5, scheduler=cosine, optimizer=optimizer, until=4)


def test_the_plan_is_checkpointed_and_a_resumed_run_keeps_it():
    clock, strategy = Clock(), _Strategy(num_steps=10**9)
    hook = TimeBudgetHook(100, warmup_steps=3, probe_steps=12, clock=clock)
    _train(hook, strategy, clock, lambda s: 0.5, until=100)  # preempted at step 100
    state = hook.state_dict()
    assert state["planned_steps"] == 198 and state["spent_s"] == pytest.approx(50.0)

    later, again = Clock(), TimeBudgetHook(100, warmup_steps=3, probe_steps=12, clock=Clock())
    again.clock = later
    again.load_state_dict(state)
    strategy.stop_reason = None
    _train(again, strategy, later, lambda s: 0.5)
    assert strategy.step_count == 198  # the same end, not a new plan
    assert later.now == pytest.approx(49.0)  # the 50 s it had left (minus the reserve)

    fresh = TimeBudgetHook(200)
    fresh.load_state_dict(state)  # another budget: a new plan
    assert fresh.plan.planned_steps is None


def test_progress_reports_the_time_left_and_the_planned_end():
    clock, strategy = Clock(), _Strategy(num_steps=10**9)
    hook = TimeBudgetHook(100, warmup_steps=3, probe_steps=12, clock=clock)
    _train(hook, strategy, clock, lambda s: 0.5, until=20)
    assert hook.progress() == {"seconds": 100.0, "remaining_s": 90.0, "planned_steps": 198.0}


def test_warmup_cosine_shape_and_a_fit_without_a_jump():
    optimizer, scheduler = _scheduler(total=100)
    lrs = [scheduler.get_last_lr()[0]]
    for _ in range(100):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs[0] == pytest.approx(0.04) and lrs[10] == pytest.approx(1.0)
    assert all(b <= a for a, b in itertools.pairwise(lrs[10:])) and lrs[100] == pytest.approx(0.01)

    optimizer, scheduler = _scheduler(total=100)
    for _ in range(40):
        optimizer.step()
        scheduler.step()
    before = scheduler.get_last_lr()[0]
    scheduler.fit_total_steps(400)
    assert scheduler.get_lr()[0] == pytest.approx(before)  # continuous at the refit
    state = scheduler.state_dict()
    restored = _scheduler(total=5)[1]
    restored.load_state_dict(state)
    assert restored.total_steps == 400 and restored.factor(200) == scheduler.factor(200)


def test_a_real_run_stops_at_its_fitted_end_with_the_schedule_annealed():
    clock = Clock()

    class Ticking(TimeBudgetHook):
        def __call__(self, ctx, stage):
            clock.now += 1.0  # one second per optimizer step
            super().__call__(ctx, stage)

    hook = Ticking(30, warmup_steps=1, probe_steps=3, clock=clock)
    strategy = TrainingStrategy(
        models=TinyModel(),
        loss_fn=EnergyMSELoss(),
        num_steps=10**9,
        hooks=[hook],
        optimizer_configs=OptimizerConfig(
            torch.optim.Adam, {"lr": 1e-3}, WarmupCosineLR, {"total_steps": 1000}
        ),
    )
    strategy.run(make_batches(4))
    planned = hook.plan.planned_steps
    assert planned is not None and strategy.step_count == planned < 30
    _, (scheduler,) = strategy.ensure_optimizers()
    assert scheduler.total_steps == planned
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-5)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="positive number of seconds"):
        TimeBudgetHook(0)
    with pytest.raises(ValueError, match="check_interval"):
        TimeBudgetHook(10, check_interval=0)
    with pytest.raises(ValueError, match="total_steps must be an int >= 1"):
        _scheduler(total=0)


def test_the_hook_is_public_api():
    import nvalchemi.training as training
    import nvalchemi.training.hooks as hooks

    assert training.TimeBudgetHook is TimeBudgetHook is hooks.TimeBudgetHook
    assert training.WarmupCosineLR is WarmupCosineLR


@pytest.mark.distributed
def test_ranks_with_skewed_budgets_stop_at_the_same_step():
    results = run_ranks(RANKS, 2, rendezvous="tcp", timeout=180)  # both ranks must exit 0
    steps = [r["step"] for r in results]
    assert steps == [3, 3]  # the first agreement (check_interval=3), on both ranks
    assert all(r["reason"].startswith("time budget of") for r in results)
