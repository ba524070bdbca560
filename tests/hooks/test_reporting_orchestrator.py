"""ReportingOrchestrator: stage matching, registry gating, ranks, error policies, lifecycle."""

from __future__ import annotations

import warnings
from enum import Enum, auto

import pytest
from _reporting_support import make_ctx

from nvalchemi.hooks import Hook
from nvalchemi.hooks.context import TrainContext
from nvalchemi.hooks.registry import HookRegistryMixin
from nvalchemi.hooks.reporting import (
    DEFAULT_REPORT_STAGES,
    Reporter,
    ReportingErrorPolicy,
    ReportingOrchestrator,
    ReportingState,
)
from nvalchemi.hooks.reporting import orchestrator as orchestrator_module
from nvalchemi.training.stages import TrainingStage


class Recorder:
    """A reporter that logs every call into a shared list."""

    def __init__(self, name, log, *, fail_on=(), rank_zero_only=False, requires_all_ranks=False):
        self.name, self.log, self.fail_on = name, log, set(fail_on)
        self.rank_zero_only = rank_zero_only
        self.requires_all_ranks = requires_all_ranks
        self.seen = []

    def report(self, ctx, stage, state):
        self.seen.append((ctx, stage, state))
        self.log.append((self.name, "report"))
        if "report" in self.fail_on:
            raise RuntimeError(f"{self.name} report broke")

    def __enter__(self):
        self.log.append((self.name, "enter"))
        if "enter" in self.fail_on:
            raise RuntimeError(f"{self.name} enter broke")
        return self

    def __exit__(self, *exc):
        self.log.append((self.name, "exit"))
        if "exit" in self.fail_on:
            raise RuntimeError(f"{self.name} exit broke")

    def close(self):
        self.log.append((self.name, "close"))
        if "close" in self.fail_on:
            raise RuntimeError(f"{self.name} close broke")


class CloseOnly:
    def __init__(self, log):
        self.log = log

    def report(self, ctx, stage, state):
        pass

    def close(self):
        self.log.append(("close_only", "close"))


class Engine(HookRegistryMixin):
    _stage_type = TrainingStage

    def __init__(self, hooks=()):
        self.step_count = 0
        self._init_hooks(hooks)


def test_orchestrator_is_a_hook_with_default_stages():
    hook = ReportingOrchestrator([])
    assert isinstance(hook, Hook)
    assert hook.stage is None and hook.frequency == 1
    assert hook.stages == DEFAULT_REPORT_STAGES == {"AFTER_OPTIMIZER_STEP", "AFTER_STEP"}
    assert hook._runs_on_stage(TrainingStage.AFTER_OPTIMIZER_STEP)
    assert not hook._runs_on_stage(TrainingStage.AFTER_BATCH)


def test_stages_match_members_and_names_of_any_enum():
    class OtherStage(Enum):
        AFTER_VALIDATION = auto()
        AFTER_EPOCH = auto()

    hook = ReportingOrchestrator([], stages={TrainingStage.AFTER_VALIDATION, "after_epoch"})
    assert hook.stages == {"AFTER_VALIDATION", "AFTER_EPOCH"}
    assert hook._runs_on_stage(TrainingStage.AFTER_VALIDATION)
    assert hook._runs_on_stage(TrainingStage.AFTER_EPOCH)
    assert hook._runs_on_stage(OtherStage.AFTER_VALIDATION)  # matched by name
    assert hook._runs_on_stage("AFTER_EPOCH")
    assert not hook._runs_on_stage(TrainingStage.AFTER_OPTIMIZER_STEP)


def test_reporters_receive_the_original_ctx_stage_and_shared_state():
    log = []
    first, second = Recorder("a", log), Recorder("b", log)
    state = ReportingState()
    hook = ReportingOrchestrator([first, second], state=state)
    ctx = make_ctx(step=3)
    hook(ctx, TrainingStage.AFTER_OPTIMIZER_STEP)
    assert [entry for entry in log] == [("a", "report"), ("b", "report")]
    for reporter in (first, second):
        seen_ctx, seen_stage, seen_state = reporter.seen[0]
        assert seen_ctx is ctx and seen_stage is TrainingStage.AFTER_OPTIMIZER_STEP
        assert seen_state is state
    assert state.event_count == 1
    assert state.last_stage == "AFTER_OPTIMIZER_STEP" and state.last_step_count == 3


def test_no_active_reporter_leaves_state_untouched(monkeypatch):
    monkeypatch.setattr(orchestrator_module, "get_rank", lambda: 1)
    hook = ReportingOrchestrator([Recorder("a", [], rank_zero_only=True)])
    hook(make_ctx(), TrainingStage.AFTER_OPTIMIZER_STEP)
    assert hook.state.event_count == 0 and hook.state.last_stage is None


def test_frequency_is_applied_by_the_engine_registry():
    log = []
    hook = ReportingOrchestrator([Recorder("a", log)], frequency=2)
    engine = Engine([hook])
    ctx = TrainContext(batch=None)
    fired = []
    for step in range(6):
        engine.step_count = ctx.step_count = step
        before = len(log)
        engine._call_hooks(TrainingStage.AFTER_OPTIMIZER_STEP, ctx)
        engine._call_hooks(TrainingStage.AFTER_BATCH, ctx)  # not a reporting stage
        if len(log) > before:
            fired.append(step)
    assert fired == [0, 2, 4]


def test_on_register_rejects_stage_names_the_engine_does_not_have():
    with pytest.raises(ValueError, match="AFTER_VALIDATON"):
        Engine([ReportingOrchestrator([], stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATON"})])
    Engine([ReportingOrchestrator([])])  # defaults name a dynamics stage too; that is fine


@pytest.mark.parametrize(
    ("orchestrator_rank_zero", "reporter_flags", "runs_on_rank_1"),
    [
        (False, {}, True),
        (False, {"rank_zero_only": True}, False),
        (True, {}, False),
        (True, {"requires_all_ranks": True}, True),
        (False, {"rank_zero_only": True, "requires_all_ranks": True}, True),
    ],
)
def test_rank_gating(monkeypatch, orchestrator_rank_zero, reporter_flags, runs_on_rank_1):
    log = []
    hook = ReportingOrchestrator(
        [Recorder("a", log, **reporter_flags)], rank_zero_only=orchestrator_rank_zero
    )
    monkeypatch.setattr(orchestrator_module, "get_rank", lambda: 1)
    assert hook.global_rank == 1 and not hook.is_rank_zero
    hook(make_ctx(global_rank=1), TrainingStage.AFTER_OPTIMIZER_STEP)
    assert (("a", "report") in log) is runs_on_rank_1
    monkeypatch.setattr(orchestrator_module, "get_rank", lambda: 0)
    log.clear()
    hook(make_ctx(), TrainingStage.AFTER_OPTIMIZER_STEP)
    assert log == [("a", "report")]  # rank 0 always reports


def test_raise_policy_records_and_reraises():
    log = []
    hook = ReportingOrchestrator([Recorder("a", log, fail_on={"report"}), Recorder("b", log)])
    with pytest.raises(RuntimeError, match="a report broke"):
        hook(make_ctx(), TrainingStage.AFTER_OPTIMIZER_STEP)
    (message,) = hook.state.messages
    assert message.level == "error" and message.reporter == "Recorder"
    assert message.message == "Recorder failed during report: RuntimeError: a report broke"
    assert message.stage == "AFTER_OPTIMIZER_STEP"
    assert ("b", "report") not in log


def test_warn_policy_warns_and_continues():
    log = []
    hook = ReportingOrchestrator(
        [Recorder("a", log, fail_on={"report"}), Recorder("b", log)], error_policy="warn"
    )
    with pytest.warns(UserWarning, match="failed during report"):
        hook(make_ctx(), TrainingStage.AFTER_OPTIMIZER_STEP)
    assert ("b", "report") in log
    assert hook.error_policy is ReportingErrorPolicy.WARN
    assert hook.state.messages[-1].level == "error"


def test_ignore_policy_is_silent_but_recorded():
    log = []
    hook = ReportingOrchestrator(
        [Recorder("a", log, fail_on={"report"}), Recorder("b", log)],
        error_policy=ReportingErrorPolicy.IGNORE,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hook(make_ctx(), TrainingStage.AFTER_OPTIMIZER_STEP)
    assert ("b", "report") in log and len(hook.state.messages) == 1


def test_nested_with_enters_once_and_closes_in_reverse_preferring_exit():
    log = []
    hook = ReportingOrchestrator([Recorder("a", log), CloseOnly(log), Recorder("b", log)])
    with hook:
        with hook:
            hook(make_ctx(), TrainingStage.AFTER_OPTIMIZER_STEP)
        assert ("a", "exit") not in log  # inner exit closes nothing
    assert log == [
        ("a", "enter"),
        ("b", "enter"),
        ("a", "report"),
        ("b", "report"),
        ("b", "exit"),
        ("close_only", "close"),
        ("a", "exit"),
    ]
    hook.close()  # already closed: nothing happens twice
    assert log.count(("a", "exit")) == 1 and ("a", "close") not in log


def test_close_without_with_calls_close_once():
    log = []
    hook = ReportingOrchestrator([Recorder("a", log), Recorder("b", log)])
    hook.close()
    hook.close()
    assert log == [("b", "close"), ("a", "close")]


def test_orchestrator_can_be_entered_again_after_a_run():
    log = []
    hook = ReportingOrchestrator([Recorder("a", log)])
    for _ in range(2):
        with hook:
            pass
    assert log == [("a", "enter"), ("a", "exit")] * 2


def test_close_failures_still_close_the_rest_and_raise_after():
    log = []
    hook = ReportingOrchestrator([Recorder("a", log), Recorder("b", log, fail_on={"exit"})])
    with pytest.raises(RuntimeError, match="b exit broke"), hook:
        pass
    assert ("a", "exit") in log
    assert "failed during exit" in hook.state.messages[-1].message


def test_close_failures_during_a_workflow_exception_only_warn():
    log = []
    hook = ReportingOrchestrator([Recorder("a", log, fail_on={"exit"}), Recorder("b", log)])
    with (
        pytest.warns(UserWarning, match="a exit broke"),
        pytest.raises(KeyError, match="boom"),
        hook,
    ):
        raise KeyError("boom")
    assert ("b", "exit") in log and ("a", "exit") in log


def test_enter_failure_under_raise_unwinds_entered_reporters():
    log = []
    hook = ReportingOrchestrator(
        [Recorder("a", log), Recorder("b", log, fail_on={"enter"}), Recorder("c", log)]
    )
    with pytest.raises(RuntimeError, match="b enter broke"):
        hook.__enter__()
    assert log == [("a", "enter"), ("b", "enter"), ("a", "exit")]
    assert "failed during enter" in hook.state.messages[-1].message


def test_enter_failure_under_warn_disables_the_reporter():
    log = []
    hook = ReportingOrchestrator(
        [Recorder("a", log, fail_on={"enter"}), Recorder("b", log)], error_policy="warn"
    )
    with pytest.warns(UserWarning, match="a enter broke"), hook:
        hook(make_ctx(), TrainingStage.AFTER_OPTIMIZER_STEP)
    assert ("a", "report") not in log and ("b", "report") in log


def test_rank_skipped_reporters_are_not_entered(monkeypatch):
    monkeypatch.setattr(orchestrator_module, "get_rank", lambda: 1)
    log = []
    hook = ReportingOrchestrator([Recorder("a", log, rank_zero_only=True), Recorder("b", log)])
    with hook:
        pass
    assert ("a", "enter") not in log and ("b", "enter") in log
    assert ("a", "close") in log  # never entered: closed with close()


def test_messages_are_bounded():
    state = ReportingState(max_messages=3)
    hook = ReportingOrchestrator(
        [Recorder("a", [], fail_on={"report"})], error_policy="ignore", state=state
    )
    for step in range(5):
        hook(make_ctx(step=step), TrainingStage.AFTER_OPTIMIZER_STEP)
    assert len(state.messages) == 3 and state.message_count == 5
    assert [m.step_count for m in state.messages] == [2, 3, 4]
    with pytest.raises(ValueError, match="level"):
        state.add_message("fatal", "x")


def test_constructor_errors_name_the_argument():
    with pytest.raises(ValueError, match="frequency"):
        ReportingOrchestrator([], frequency=0)
    with pytest.raises(ValueError, match="error_policy"):
        ReportingOrchestrator([], error_policy="explode")
    with pytest.raises(TypeError, match=r"reporters\[1\]"):
        ReportingOrchestrator([Recorder("a", []), object()])
    with pytest.raises(TypeError, match="stage"):
        ReportingOrchestrator([], stages={3})
    with pytest.raises(ValueError, match="at least one stage"):
        ReportingOrchestrator([], stages=set())
    with pytest.raises(TypeError, match="ReportingState"):
        ReportingOrchestrator([], state={})


def test_reporter_protocol_is_structural():
    assert isinstance(Recorder("a", []), Reporter)
    assert not isinstance(object(), Reporter)
