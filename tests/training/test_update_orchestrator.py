"""TrainingUpdateHook / TrainingUpdateOrchestrator: algebra, ordering, vetoes, loss threading, scaler."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _training_support import StageHook, TinyModel, make_batches, strategy
from pydantic import ValidationError

from nvalchemi.hooks import Hook
from nvalchemi.training import OptimizerConfig, TrainingStage, ValidationConfig
from nvalchemi.training.hooks.update import (
    _MULTIPLE_ORCHESTRATOR_MSG,
    TrainingUpdateHook,
    TrainingUpdateOrchestrator,
    _check_veto,
    _fold_training_update_hooks,
)

S = TrainingStage


class Logged(TrainingUpdateHook):
    """Records (name, stage, will_skip); vetoes at the stages in ``veto``."""

    def __init__(self, name, log, priority=50, veto=(), loss_factor=None):
        self.name, self.log, self.veto, self.loss_factor = name, log, set(veto), loss_factor
        self.priority = priority
        self.registered = 0

    def on_register(self, workflow):
        self.registered += 1

    def __call__(self, ctx, stage, will_skip):
        self.log.append((self.name, stage.name, will_skip))
        if stage is S.DO_BACKWARD and self.loss_factor is not None:
            return True, ctx.loss * self.loss_factor
        return stage not in self.veto, ctx.loss


class Param:
    """A one-parameter setup with an SGD optimizer for direct orchestrator calls."""

    def __init__(self, scheduler=False):
        self.w = torch.nn.Parameter(torch.tensor(1.0))
        self.optimizer = torch.optim.SGD([self.w], lr=0.1)
        self.scheduler = (
            torch.optim.lr_scheduler.StepLR(self.optimizer, 1, gamma=0.5) if scheduler else None
        )

    def ctx(self, scaler=None):
        loss = (self.w * 2.0) ** 2
        return SimpleNamespace(
            loss=loss,
            optimizers=[self.optimizer],
            lr_schedulers=[self.scheduler],
            grad_scaler=scaler,
            workflow=None,
        )


# ----------------------------------------------------------------------------- the hook base
def test_update_hook_defaults_and_algebra():
    hook = TrainingUpdateHook()
    assert hook.priority == 50 and hook._exclusive_update_key is None
    stages = [s for s in S if hook._runs_on_stage(s)]
    assert stages == [S.BEFORE_BATCH, S.DO_BACKWARD, S.DO_OPTIMIZER_STEP, S.AFTER_OPTIMIZER_STEP]
    ctx = SimpleNamespace(loss=torch.tensor(1.0))
    assert hook(ctx, S.DO_BACKWARD, False) == (True, ctx.loss)
    combined = hook + TrainingUpdateHook()
    assert (
        isinstance(combined, TrainingUpdateOrchestrator) and len(list(combined.iter_hooks())) == 2
    )
    assert isinstance(combined + TrainingUpdateHook(), TrainingUpdateOrchestrator)
    with pytest.raises(TypeError):
        hook + 1
    assert not isinstance(hook, Hook) and isinstance(combined, Hook)


def test_orchestrator_sorts_by_priority_stably_and_flattens():
    log = []
    a, b, c, d = (Logged(n, log, p) for n, p in (("a", 50), ("b", 10), ("c", 50), ("d", 30)))
    orchestrator = TrainingUpdateOrchestrator(a, TrainingUpdateOrchestrator(b, c), d)
    assert [h.name for h in orchestrator.iter_hooks()] == ["b", "d", "a", "c"]
    assert TrainingUpdateOrchestrator()._hooks == []


def test_orchestrator_rejects_non_hooks_and_exclusive_duplicates():
    with pytest.raises(TypeError, match=r"argument 0 must be TrainingUpdateHook.*\*hooks"):
        TrainingUpdateOrchestrator([TrainingUpdateHook()])

    class Exclusive(TrainingUpdateHook):
        _exclusive_update_key = "only-one"

    with pytest.raises(ValueError, match="exclusive key 'only-one'"):
        TrainingUpdateOrchestrator(Exclusive(), Exclusive())


# ----------------------------------------------------------------------------- dispatch
def test_veto_runs_every_hook_with_cumulative_will_skip():
    log = []
    first = Logged("first", log, 10, veto={S.DO_OPTIMIZER_STEP})
    second = Logged("second", log, 20)
    orchestrator = TrainingUpdateOrchestrator(first, second)
    p = Param(scheduler=True)
    ctx = p.ctx()
    ctx.loss.backward()
    orchestrator(ctx, S.DO_OPTIMIZER_STEP)
    assert log == [("first", "DO_OPTIMIZER_STEP", False), ("second", "DO_OPTIMIZER_STEP", True)]
    assert orchestrator.optimizer_step_skipped
    assert float(p.w.detach()) == 1.0 and p.scheduler.last_epoch == 0
    orchestrator(ctx, S.AFTER_OPTIMIZER_STEP)
    assert log[-2:] == [
        ("first", "AFTER_OPTIMIZER_STEP", True),
        ("second", "AFTER_OPTIMIZER_STEP", True),
    ]


def test_before_batch_veto_keeps_gradients():
    p = Param()
    ctx = p.ctx()
    ctx.loss.backward()
    TrainingUpdateOrchestrator(Logged("v", [], veto={S.BEFORE_BATCH}))(ctx, S.BEFORE_BATCH)
    assert p.w.grad is not None
    TrainingUpdateOrchestrator(Logged("ok", []))(ctx, S.BEFORE_BATCH)
    assert p.w.grad is None


def test_step_runs_optimizer_and_scheduler_when_allowed():
    p = Param(scheduler=True)
    ctx = p.ctx()
    ctx.loss.backward()
    orchestrator = TrainingUpdateOrchestrator(Logged("ok", []))
    orchestrator(ctx, S.DO_OPTIMIZER_STEP)
    assert not orchestrator.optimizer_step_skipped
    assert float(p.w.detach()) == pytest.approx(1.0 - 0.1 * 8.0) and p.scheduler.last_epoch == 1


def test_do_backward_threads_the_loss_and_backpropagates_once():
    log = []
    orchestrator = TrainingUpdateOrchestrator(
        Logged("half", log, 10, loss_factor=0.5), Logged("triple", log, 20, loss_factor=3.0)
    )
    p = Param()
    ctx = p.ctx()
    original = ctx.loss
    orchestrator(ctx, S.DO_BACKWARD)
    assert ctx.loss is original  # restored: later stages see the loss that came in
    assert float(p.w.grad) == pytest.approx(8.0 * 1.5)  # d(1.5 * 4 w^2)/dw at w = 1, once


def test_do_backward_requires_a_tensor_and_gated_stages_a_strict_bool():
    class NoLoss(TrainingUpdateHook):
        def __call__(self, ctx, stage, will_skip):
            return True, None

    with pytest.raises(TypeError, match="did not provide a Tensor loss for DO_BACKWARD"):
        TrainingUpdateOrchestrator(NoLoss())(Param().ctx(), S.DO_BACKWARD)
    with pytest.raises(TypeError, match=r"must return \(bool, Tensor \| None\); proceed got int"):
        _check_veto(TrainingUpdateHook(), S.BEFORE_BATCH, (1, None))


class FakeScaler:
    """GradScaler stand-in: reports inf for the first step (scale halves), then steps."""

    def __init__(self, overflow):
        self.overflow = overflow
        self.scale = 1024.0
        self.calls = []

    def get_scale(self):
        return self.scale

    def step(self, optimizer):
        self.calls.append("step")
        if not self.overflow:
            optimizer.step()

    def update(self):
        self.calls.append("update")
        if self.overflow:
            self.scale /= 2

    def _found_inf_per_device(self, optimizer):
        return {torch.device("cpu"): torch.tensor(1.0 if self.overflow else 0.0)}


@pytest.mark.parametrize("overflow", [True, False])
@pytest.mark.parametrize("with_scheduler", [True, False])
def test_grad_scaler_overflow_skips_the_step_and_its_scheduler(overflow, with_scheduler):
    p = Param(scheduler=with_scheduler)
    scaler = FakeScaler(overflow)
    ctx = p.ctx(scaler)
    ctx.loss.backward()
    orchestrator = TrainingUpdateOrchestrator()
    orchestrator(ctx, S.DO_OPTIMIZER_STEP)
    assert scaler.calls == ["step", "update"]
    assert orchestrator.optimizer_step_skipped is overflow
    if with_scheduler:
        assert p.scheduler.last_epoch == (0 if overflow else 1)


def test_lifecycle_and_checkpoint_state_reach_children():
    events = []

    class Stateful(TrainingUpdateHook):
        def __init__(self):
            self.value = 0

        def __enter__(self):
            events.append("enter")
            return self

        def __exit__(self, *exc):
            events.append("exit")

        def state_dict(self):
            return {"value": self.value}

        def load_state_dict(self, state):
            self.value = state["value"]

    a, b = Stateful(), Stateful()
    a.value = 3
    orchestrator = TrainingUpdateOrchestrator(a, b, TrainingUpdateHook())
    with orchestrator:
        pass
    assert events == ["enter", "enter", "exit", "exit"]
    state = orchestrator.state_dict()
    assert state == {"Stateful": {"value": 3}, "Stateful#1": {"value": 0}}
    fresh = TrainingUpdateOrchestrator(Stateful(), Stateful())
    fresh.load_state_dict(state)
    assert [h.value for h in fresh.iter_hooks()] == [3, 0]
    with pytest.raises(ValueError, match="does not match the registered hooks"):
        TrainingUpdateOrchestrator(Stateful()).load_state_dict(state)


# ----------------------------------------------------------------------------- strategy integration
def test_folding_places_one_orchestrator_at_the_first_update_hook():
    plain = StageHook(S.AFTER_BATCH)
    a, b = TrainingUpdateHook(), TrainingUpdateHook()
    folded = _fold_training_update_hooks([plain, a, StageHook(S.SETUP), b])
    assert isinstance(folded[1], TrainingUpdateOrchestrator) and len(folded) == 3
    assert list(folded[1].iter_hooks()) == [a, b]
    lone = TrainingUpdateOrchestrator(a)
    assert _fold_training_update_hooks([lone])[0] is lone
    with pytest.raises(ValueError, match=r"\+"):
        _fold_training_update_hooks([TrainingUpdateOrchestrator(), TrainingUpdateOrchestrator()])
    assert "+" in _MULTIPLE_ORCHESTRATOR_MSG


def test_strategy_folds_at_construction_and_at_registration():
    log = []
    first = Logged("first", log)
    s = strategy(hooks=[first])
    orchestrator = s.hooks[0]
    assert isinstance(orchestrator, TrainingUpdateOrchestrator)
    second = Logged("second", log, priority=10)
    s.register_hook(second)
    assert s.hooks == [orchestrator]
    assert [h.name for h in orchestrator.iter_hooks()] == ["second", "first"]
    with pytest.raises(ValueError, match="stage= is not supported"):
        s.register_hook(TrainingUpdateHook(), stage=S.AFTER_BATCH)
    with pytest.raises(ValueError, match=r"Only one TrainingUpdateOrchestrator"):
        s.register_hook(TrainingUpdateOrchestrator())


def test_late_registration_does_not_rerun_other_hooks_on_register():
    log = []
    early = Logged("early", log)

    class Plain:
        frequency, stage = 1, S.AFTER_BATCH

        def __init__(self):
            self.registered = 0

        def on_register(self, workflow):
            self.registered += 1

        def __call__(self, ctx, stage):
            pass

    plain = Plain()
    s = strategy(hooks=[plain, early])
    late = Logged("late", log)
    s.register_hook(late)
    s.register_hook(StageHook(S.BEFORE_BATCH))
    assert (plain.registered, early.registered, late.registered) == (1, 1, 1)


def test_do_slot_conflicts_are_rejected_with_a_hint():
    class PlainBackward:
        frequency, stage = 1, S.DO_BACKWARD

        def __call__(self, ctx, stage):
            ctx.loss.backward()

    with pytest.raises(
        ValidationError, match=r"At most one hook may claim DO_BACKWARD.*TrainingUpdateHook"
    ):
        strategy(hooks=[TrainingUpdateHook(), PlainBackward()])
    s = strategy(hooks=[TrainingUpdateHook()])
    with pytest.raises(ValueError, match="At most one hook may claim DO_BACKWARD"):
        s.register_hook(PlainBackward())
    assert len(s.hooks) == 1


def test_strategy_runs_update_stages_through_the_orchestrator():
    log = []
    s = strategy(hooks=[Logged("u", log)], num_steps=2)
    s.run(make_batches(2))
    stages = [stage for _, stage, _ in log]
    one_batch = [
        "SETUP",
        "BEFORE_BATCH",
        "DO_BACKWARD",
        "DO_OPTIMIZER_STEP",
        "AFTER_OPTIMIZER_STEP",
    ]
    assert stages == one_batch + one_batch[1:]
    assert s.step_count == 2


def test_vetoed_steps_advance_batches_only_and_step_validation_fires_once_per_multiple():
    class EveryThird(TrainingUpdateHook):
        """Gradient-accumulation-like: step on every third batch only."""

        def __init__(self):
            self.seen = 0

        def __call__(self, ctx, stage, will_skip):
            if stage is S.BEFORE_BATCH:
                return self.seen % 3 == 0, ctx.loss
            if stage is S.DO_OPTIMIZER_STEP:
                self.seen += 1
                return self.seen % 3 == 0, ctx.loss
            return True, ctx.loss

    steps = []
    val = ValidationConfig(validation_data=make_batches(1), every_n_steps=2)
    hook = StageHook(S.AFTER_VALIDATION, lambda ctx: steps.append(ctx.step_count))
    s = strategy(hooks=[EveryThird(), hook], num_steps=4, validation_config=val)
    s.run(make_batches(3))
    assert (s.step_count, s.batch_count) == (4, 12)
    assert steps == [2, 4]


def test_optimizer_step_skipped_by_a_plain_claimant_is_trusted():
    class NoStep:
        frequency, stage = 1, S.DO_OPTIMIZER_STEP

        def __call__(self, ctx, stage):
            pass

    model = TinyModel()
    before = [p.detach().clone() for p in model.parameters()]
    s = strategy(
        model, hooks=[NoStep()], optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 1.0})
    )
    s.run(make_batches(2))
    assert s.step_count == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ----------------------------------------------------------------------------- two-argument calls
def test_every_built_in_update_hook_is_callable_without_will_skip():
    from nvalchemi.training.hooks import (
        EMAHook,
        GradientAccumulationHook,
        GradientClipHook,
        LossSpikeSkipHook,
        MixedPrecisionHook,
    )

    setup = Param()
    for hook in (
        TrainingUpdateHook(),
        EMAHook(),
        MixedPrecisionHook(precision="float32"),
        GradientAccumulationHook(steps=1),
        GradientClipHook(max_norm=1.0),
        LossSpikeSkipHook(),
    ):
        ctx = setup.ctx()
        assert hook(ctx, S.BEFORE_BATCH) == (True, ctx.loss), type(hook).__name__


def test_ema_hook_called_as_hook_ctx_stage_updates_as_if_not_skipped():
    from nvalchemi.training.hooks import EMAHook

    model = TinyModel()
    ctx = SimpleNamespace(models={"main": model}, workflow=None, step_count=0, loss=None)
    hook = EMAHook(decay=0.5)
    hook(ctx, S.SETUP)
    hook(ctx, S.AFTER_OPTIMIZER_STEP)  # will_skip defaults to False: an update
    assert hook.num_updates == 1
    hook(ctx, S.AFTER_OPTIMIZER_STEP, True)
    assert hook.num_updates == 1


def test_a_users_two_argument_update_hook_runs_in_a_strategy():
    seen = []

    class Halve(TrainingUpdateHook):
        priority = 30

        def __call__(self, ctx, stage):  # no will_skip
            seen.append(stage.name)
            if stage is S.DO_BACKWARD:
                return True, ctx.loss * 0.5
            return True, ctx.loss

    log = []
    s = strategy(hooks=[Halve(), Logged("u", log)], num_steps=2)
    s.run(make_batches(2))
    assert s.step_count == 2
    assert seen.count("DO_BACKWARD") == 2 and seen[0] == "SETUP"
    assert [skip for _, stage, skip in log if stage == "AFTER_OPTIMIZER_STEP"] == [False, False]
