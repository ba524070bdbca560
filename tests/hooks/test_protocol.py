"""Hook and CheckpointableHook are structural, runtime-checkable protocols."""

from __future__ import annotations

from nvalchemi.hooks.protocol import CheckpointableHook, Hook
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
