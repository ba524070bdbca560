"""Hook and CheckpointableHook are structural, runtime-checkable protocols."""

from __future__ import annotations

import pytest

from nvalchemi.hooks.protocol import CheckpointableHook, Hook, enter_hooks, exit_hooks
from nvalchemi.training.stages import TrainingStage


class ClassAttributeHook:
    frequency = 1
    stage = TrainingStage.AFTER_LOSS

    def __call__(self, ctx, stage):
        pass


class InstanceAttributeHook:
    def __init__(self):
        self.frequency = 5
        self.stage = None

    def __call__(self, ctx, stage):
        pass


class NoFrequency:
    stage = TrainingStage.AFTER_LOSS

    def __call__(self, ctx, stage):
        pass


class NoStage:
    frequency = 1

    def __call__(self, ctx, stage):
        pass


class NotCallable:
    frequency = 1
    stage = TrainingStage.AFTER_LOSS


class Stateful:
    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        self.n = state["n"]


class HalfStateful:
    def state_dict(self):
        return {}


def test_objects_with_frequency_stage_and_call_are_hooks():
    assert isinstance(ClassAttributeHook(), Hook)
    assert isinstance(InstanceAttributeHook(), Hook)


def test_missing_member_is_not_a_hook():
    assert not isinstance(NoFrequency(), Hook)
    assert not isinstance(NoStage(), Hook)
    assert not isinstance(NotCallable(), Hook)


def test_no_inheritance_needed_for_checkpointable_hooks():
    assert isinstance(Stateful(), CheckpointableHook)
    assert not isinstance(HalfStateful(), CheckpointableHook)
    assert not isinstance(ClassAttributeHook(), CheckpointableHook)


def test_a_hook_can_be_both():
    class Both(ClassAttributeHook, Stateful):
        pass

    assert isinstance(Both(), Hook)
    assert isinstance(Both(), CheckpointableHook)


def test_package_exports_the_protocols():
    import nvalchemi.hooks

    assert nvalchemi.hooks.Hook is Hook
    assert nvalchemi.hooks.CheckpointableHook is CheckpointableHook


def test_hook_contexts_unwind_on_a_failed_enter_and_all_exit_despite_a_failure():
    calls = []

    class Context:
        def __init__(self, name, fail_enter=False, fail_exit=False):
            self.name, self.fail_enter, self.fail_exit = name, fail_enter, fail_exit

        def __enter__(self):
            if self.fail_enter:
                raise RuntimeError(f"enter {self.name}")
            calls.append(f"enter {self.name}")

        def __exit__(self, *exc_info):
            calls.append(f"exit {self.name}")
            if self.fail_exit:
                raise RuntimeError(f"exit {self.name}")

    class Closing:
        def close(self):
            calls.append("close")

    hooks = [Context("a"), Closing(), Context("b", fail_enter=True), Context("c")]
    with pytest.raises(RuntimeError, match="enter b"):
        enter_hooks(hooks)
    assert calls == ["enter a", "exit a"]  # only what was entered is exited
    calls.clear()
    with pytest.raises(RuntimeError, match="exit c"):
        exit_hooks(
            [Context("a", fail_exit=True), Closing(), Context("c", fail_exit=True)],
            None,
            None,
            None,
        )
    assert calls == ["exit c", "close", "exit a"]
    calls.clear()
    exit_hooks([Context("a", fail_exit=True)], RuntimeError, RuntimeError("run"), None)
    assert calls == ["exit a"]  # the run's own error wins: the hook's is not raised
