"""HookRegistryMixin: validation, on_register, the per-stage table and dispatch."""

from __future__ import annotations

import subprocess
import sys
from enum import Enum, auto
from pathlib import Path
from typing import Any, ClassVar

import pydantic
import pytest

from nvalchemi.hooks.context import HookContext, TrainContext
from nvalchemi.hooks.registry import HookRegistryMixin
from nvalchemi.training.stages import TrainingStage

REPO_ROOT = Path(__file__).resolve().parents[2]


class DynamicsStage(Enum):
    BEFORE_STEP = auto()
    AFTER_STEP = auto()


class Engine(HookRegistryMixin):
    _stage_type = TrainingStage

    def __init__(self, hooks=()):
        self.step_count = 0
        self._init_hooks(hooks)


class Recorder:
    """A hook that records (name, stage, ctx) for each call."""

    def __init__(self, name, stage=None, frequency=1, log=None):
        self.name = name
        self.stage = stage
        self.frequency = frequency
        self.log = [] if log is None else log

    def __call__(self, ctx, stage):
        self.log.append((self.name, stage, ctx))


class MultiStage(Recorder):
    def __init__(self, name, stages, **kwargs):
        super().__init__(name, **kwargs)
        self.stages = set(stages)
        self.queries = 0

    def _runs_on_stage(self, stage):
        self.queries += 1
        return stage in self.stages


class Registering(Recorder):
    def __init__(self, name, **kwargs):
        super().__init__(name, **kwargs)
        self.registered_with = []

    def on_register(self, engine):
        self.registered_with.append(engine)


def names(log):
    return [entry[0] for entry in log]


# ----------------------------------------------------------------------------- dispatch
def test_dispatch_runs_only_hooks_at_that_stage_in_registration_order():
    log = []
    engine = Engine(
        [
            Recorder("a", TrainingStage.AFTER_LOSS, log=log),
            Recorder("b", TrainingStage.BEFORE_BATCH, log=log),
            Recorder("c", TrainingStage.AFTER_LOSS, log=log),
        ]
    )
    ctx = TrainContext(batch=None)
    engine._call_hooks(TrainingStage.AFTER_LOSS, ctx)
    assert names(log) == ["a", "c"]
    engine._call_hooks(TrainingStage.AFTER_EPOCH, ctx)
    assert names(log) == ["a", "c"]


def test_dispatch_passes_the_engines_context_object_and_stage_unchanged():
    log = []
    engine = Engine([Recorder("a", TrainingStage.AFTER_FORWARD, log=log)])
    ctx = TrainContext(batch=None)
    engine._call_hooks(TrainingStage.AFTER_FORWARD, ctx)
    ctx.step_count = 1
    engine.step_count = 1
    engine._call_hooks(TrainingStage.AFTER_FORWARD, ctx)
    assert [entry[2] for entry in log] == [ctx, ctx]
    assert all(entry[2] is ctx for entry in log)
    assert all(entry[1] is TrainingStage.AFTER_FORWARD for entry in log)


def test_frequency_gates_on_the_engine_step_count():
    log = []
    engine = Engine(
        [
            Recorder("every", TrainingStage.AFTER_BATCH, log=log),
            Recorder("third", TrainingStage.AFTER_BATCH, frequency=3, log=log),
        ]
    )
    fired = []
    for step in range(7):
        engine.step_count = step
        before = len(log)
        engine._call_hooks(TrainingStage.AFTER_BATCH, None)
        fired.append(names(log[before:]))
    assert fired == [
        ["every", "third"],
        ["every"],
        ["every"],
        ["every", "third"],
        ["every"],
        ["every"],
        ["every", "third"],
    ]


def test_multi_stage_hook_runs_where_runs_on_stage_says_and_overrides_stage():
    log = []
    hook = MultiStage(
        "multi",
        {TrainingStage.BEFORE_BATCH, TrainingStage.AFTER_BATCH},
        stage=TrainingStage.SETUP,
        log=log,
    )
    engine = Engine([hook])
    for stage in TrainingStage:
        engine._call_hooks(stage, None)
    assert [entry[1] for entry in log] == [TrainingStage.BEFORE_BATCH, TrainingStage.AFTER_BATCH]


def test_stage_table_is_precomputed_so_dispatch_does_not_ask_hooks_again():
    hook = MultiStage("multi", {TrainingStage.AFTER_LOSS})
    engine = Engine([hook])
    queries_after_registration = hook.queries
    assert queries_after_registration >= len(TrainingStage)
    for _ in range(100):
        for stage in TrainingStage:
            engine._call_hooks(stage, None)
    assert hook.queries == queries_after_registration
    assert len(hook.log) == 100


def test_hooks_for_and_has_hooks_report_the_table():
    a = Recorder("a", TrainingStage.AFTER_LOSS)
    multi = MultiStage("m", {TrainingStage.AFTER_LOSS, TrainingStage.SETUP})
    engine = Engine([a, multi])
    assert engine.hooks_for(TrainingStage.AFTER_LOSS) == (a, multi)
    assert engine.hooks_for(TrainingStage.SETUP) == (multi,)
    assert engine.hooks_for(TrainingStage.DO_BACKWARD) == ()
    assert isinstance(engine.hooks_for(TrainingStage.AFTER_LOSS), tuple)
    assert engine.has_hooks(TrainingStage.SETUP)
    assert not engine.has_hooks(TrainingStage.AFTER_VALIDATION)


def test_engine_without_stage_type_dispatches_unseen_stages_lazily():
    class Untyped(HookRegistryMixin):
        def __init__(self, hooks):
            self.step_count = 0
            self._init_hooks(hooks)

    log = []
    engine = Untyped(
        [
            Recorder("dyn", DynamicsStage.AFTER_STEP, log=log),
            MultiStage("multi", {"custom-stage"}, log=log),
        ]
    )
    engine._call_hooks(DynamicsStage.AFTER_STEP, None)
    engine._call_hooks("custom-stage", None)
    engine._call_hooks("custom-stage", None)
    assert names(log) == ["dyn", "multi", "multi"]


def test_hook_exception_propagates_with_a_note_naming_hook_and_stage():
    class Boom:
        frequency = 1
        stage = TrainingStage.BEFORE_BACKWARD

        def __call__(self, ctx, stage):
            raise KeyError("energy")

    engine = Engine([Boom()])
    with pytest.raises(KeyError) as info:
        engine._call_hooks(TrainingStage.BEFORE_BACKWARD, None)
    assert any("Boom" in n and "BEFORE_BACKWARD" in n for n in info.value.__notes__)


# ----------------------------------------------------------------------------- registration
def test_on_register_runs_once_with_the_engine():
    hook = Registering("r", stage=TrainingStage.SETUP)
    engine = Engine([hook])
    assert hook.registered_with == [engine]


def test_late_registration_does_not_rerun_earlier_on_register():
    first = Registering("first", stage=TrainingStage.SETUP)
    second = Registering("second", stage=TrainingStage.AFTER_BATCH)
    engine = Engine([first])
    engine.register_hook(second)
    engine.register_hook(Recorder("plain", TrainingStage.AFTER_BATCH))
    assert first.registered_with == [engine]
    assert second.registered_with == [engine]
    assert [hook.name for hook in engine.hooks] == ["first", "second", "plain"]


def test_late_registration_is_dispatched_immediately():
    log = []
    engine = Engine()
    assert not engine.has_hooks(TrainingStage.AFTER_BATCH)
    engine.register_hook(Recorder("late", log=log), stage=TrainingStage.AFTER_BATCH)
    engine._call_hooks(TrainingStage.AFTER_BATCH, None)
    assert names(log) == ["late"]


def test_stage_argument_binds_the_hook():
    hook = Recorder("h")
    engine = Engine()
    engine.register_hook(hook, stage=TrainingStage.AFTER_EPOCH)
    assert hook.stage is TrainingStage.AFTER_EPOCH
    assert engine.hooks_for(TrainingStage.AFTER_EPOCH) == (hook,)


@pytest.mark.parametrize("frequency", [0, -2, 1.5, "2", True, None])
def test_frequency_must_be_a_positive_integer(frequency):
    engine = Engine()
    with pytest.raises(ValueError, match="Hook frequency must be a positive integer"):
        engine.register_hook(Recorder("bad", TrainingStage.SETUP, frequency=frequency))
    assert engine.hooks == []


def test_hook_without_stage_is_rejected():
    with pytest.raises(TypeError, match="no stage assigned"):
        Engine([Recorder("stageless")])


def test_stage_of_another_engine_is_rejected():
    with pytest.raises(TypeError, match=r"type DynamicsStage.*only accepts TrainingStage"):
        Engine([Recorder("dyn", DynamicsStage.BEFORE_STEP)])
    engine = Engine()
    with pytest.raises(TypeError, match="only accepts TrainingStage"):
        engine.register_hook(Recorder("dyn"), stage=DynamicsStage.AFTER_STEP)
    with pytest.raises(TypeError, match="only accepts TrainingStage"):
        engine.register_hook(Recorder("str", "AFTER_LOSS"))


def test_engine_accepting_two_stage_types():
    class Hybrid(Engine):
        _stage_type = (TrainingStage, DynamicsStage)

    log = []
    engine = Hybrid([Recorder("d", DynamicsStage.AFTER_STEP, log=log)])
    engine._call_hooks(DynamicsStage.AFTER_STEP, None)
    assert names(log) == ["d"]
    with pytest.raises(TypeError, match="only accepts TrainingStage or DynamicsStage"):
        engine.register_hook(Recorder("s", "SETUP"))


def test_multi_stage_hooks_bypass_the_stage_type_check():
    hook = MultiStage("m", {DynamicsStage.AFTER_STEP, TrainingStage.AFTER_LOSS})
    engine = Engine([hook])
    assert engine.hooks_for(TrainingStage.AFTER_LOSS) == (hook,)


def test_non_callable_on_register_is_rejected():
    hook = Recorder("h", TrainingStage.SETUP)
    hook.on_register = "not callable"
    with pytest.raises(TypeError, match="on_register must be callable"):
        Engine([hook])


def test_failed_on_register_leaves_registry_and_stage_unchanged():
    class Failing(Recorder):
        def on_register(self, engine):
            raise AttributeError("model has no attribute 'head'")

    hook = Failing("f", stage=TrainingStage.SETUP)
    engine = Engine()
    with pytest.raises(AttributeError, match="head"):
        engine.register_hook(hook, stage=TrainingStage.AFTER_LOSS)
    assert engine.hooks == []
    assert hook.stage is TrainingStage.SETUP
    assert not engine.has_hooks(TrainingStage.AFTER_LOSS)


def test_same_instance_cannot_be_registered_twice():
    hook = Recorder("h", TrainingStage.SETUP)
    engine = Engine([hook])
    with pytest.raises(ValueError, match="already registered"):
        engine.register_hook(hook)


def test_non_callable_and_frequencyless_objects_are_rejected():
    engine = Engine()

    class NoCall:
        frequency, stage = 1, TrainingStage.SETUP

    class NoFrequency:
        stage = TrainingStage.SETUP

        def __call__(self, ctx, stage):
            pass

    with pytest.raises(TypeError, match="not callable"):
        engine.register_hook(NoCall())
    with pytest.raises(TypeError, match="frequency"):
        engine.register_hook(NoFrequency())


def test_unregister_and_refresh():
    a, b = Recorder("a", TrainingStage.SETUP), Recorder("b", TrainingStage.SETUP)
    engine = Engine([a, b])
    engine.unregister_hook(a)
    assert engine.hooks_for(TrainingStage.SETUP) == (b,)
    with pytest.raises(ValueError, match="not registered"):
        engine.unregister_hook(a)
    # direct edits of the list are picked up by hooks_for and refresh_hooks()
    engine.hooks.append(a)
    assert engine.hooks_for(TrainingStage.SETUP) == (b, a)
    engine.hooks[0] = Recorder("c", TrainingStage.AFTER_LOSS)
    engine.refresh_hooks()
    assert engine.hooks_for(TrainingStage.SETUP) == (a,)


# ----------------------------------------------------------------------------- contexts
def test_call_hooks_with_batch_builds_a_generic_context_only_when_needed():
    class Generic(HookRegistryMixin):
        def __init__(self, hooks):
            self.step_count = 0
            self.model = "the-model"
            self.built = 0
            self._init_hooks(hooks)

        def _build_context(self, batch):
            self.built += 1
            return super()._build_context(batch)

    log = []
    engine = Generic([Recorder("r", DynamicsStage.AFTER_STEP, log=log)])
    engine._call_hooks_with_batch(DynamicsStage.BEFORE_STEP, "batch")
    assert engine.built == 0
    engine._call_hooks_with_batch(DynamicsStage.AFTER_STEP, "batch")
    ctx = log[0][2]
    assert type(ctx) is HookContext
    assert (ctx.batch, ctx.model, ctx.global_rank, ctx.workflow) == (
        "batch",
        "the-model",
        0,
        engine,
    )


def test_build_context_reads_rank_from_the_engines_manager():
    class Manager:
        rank = 3

    engine = Engine()
    engine.distributed_manager = Manager()
    assert engine._build_context(None).global_rank == 3


# ----------------------------------------------------------------------------- hosts
def test_pydantic_host_with_a_hooks_field():
    class Strategy(pydantic.BaseModel, HookRegistryMixin):
        model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)
        _stage_type: ClassVar[Any] = TrainingStage
        hooks: list[Any] = []
        step_count: int = 0

        def model_post_init(self, context):
            self._init_hooks(list(self.hooks))

    first = Registering("first", stage=TrainingStage.SETUP)
    strategy = Strategy(hooks=[first])
    strategy.register_hook(Registering("second"), stage=TrainingStage.AFTER_BATCH)
    assert first.registered_with == [strategy]
    strategy.step_count = 2
    strategy._call_hooks(TrainingStage.SETUP, None)
    assert names(first.log) == ["first"]
    with pytest.raises(TypeError, match="only accepts TrainingStage"):
        strategy.register_hook(Recorder("d", DynamicsStage.AFTER_STEP))
    # rolling back by reassigning the field is picked up by hooks_for
    strategy.hooks = [first]
    assert strategy.hooks_for(TrainingStage.AFTER_BATCH) == ()


def test_hooks_package_does_not_import_training():
    code = (
        "import sys, nvalchemi.hooks.registry, nvalchemi.hooks.context, nvalchemi.hooks.protocol;"
        "print(sorted(m for m in sys.modules if m.startswith('nvalchemi.training')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
