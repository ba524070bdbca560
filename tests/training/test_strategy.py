"""TrainingStrategy: construction errors, lifecycle, counters, specs, schedulers, NaN policy, stops."""

from __future__ import annotations

import json
import math
import warnings
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from _ranks import run_ranks
from _training_support import (
    Recorder,
    StageHook,
    TinyModel,
    adam,
    energy_training_fn,
    make_batch,
    make_batches,
    strategy,
)
from torch import nn

from nvalchemi.models.base import BaseModelMixin
from nvalchemi.training import (
    EnergyMSELoss,
    ForceMSELoss,
    OptimizerConfig,
    TrainingStage,
    TrainingStrategy,
    ValidationConfig,
    default_training_fn,
)
from nvalchemi.training.errors import NonFiniteLossError, TrainingStalledError
from nvalchemi.training.hooks.update import TrainingUpdateHook

S = TrainingStage
PER_BATCH = [
    "BEFORE_BATCH",
    "BEFORE_FORWARD",
    "AFTER_FORWARD",
    "BEFORE_LOSS",
    "AFTER_LOSS",
    "BEFORE_BACKWARD",
    "AFTER_BACKWARD",
    "BEFORE_OPTIMIZER_STEP",
    "AFTER_OPTIMIZER_STEP",
    "AFTER_BATCH",
]


# ----------------------------------------------------------------------------- construction
def _named_fn(models: dict[str, nn.Module], batch):
    return default_training_fn(models["main"], batch)


def _single_fn(model: nn.Module, batch):
    return default_training_fn(model, batch)


class _DoBackward:
    frequency = 1
    stage = S.DO_BACKWARD

    def __call__(self, ctx, stage):
        ctx.loss.backward()


CONSTRUCTION_ERRORS = [
    ({"models": {}}, r"models must contain at least one BaseModelMixin \(or nn.Module\) model"),
    ({"models": {"main": object()}}, "models must map names to torch.nn.Module"),
    ({"models": 3}, "models must be a torch.nn.Module or a mapping"),
    ({"optimizer_configs": {}}, "optimizer_configs must configure at least one model"),
    ({"optimizer_configs": {"other": [adam()]}}, "optimizer_configs key 'other' is not present"),
    ({"optimizer_configs": {"main": []}}, r"optimizer_configs\['main'\] must contain at least one"),
    ({"devices": ["cpu", "cpu"]}, "devices must have length 1 or len"),
    ({"devices": []}, "devices must contain at least one"),
    ({"num_steps": 5}, "Exactly one of num_epochs or num_steps"),
    ({"num_epochs": None}, "Exactly one of num_epochs or num_steps"),
    ({"num_epochs": 0}, "greater than or equal to 1"),
    ({"epoch_step_modifier": 0.0}, "greater than 0"),
    ({"training_fn": "no_dots"}, "expected 'module.attribute'"),
    ({"training_fn": "nvalchemi_missing_module.fn"}, "not found"),
    ({"training_fn": "nvalchemi.training.strategy.missing_fn"}, "has no attribute"),
    ({"training_fn": 3}, "training_fn must be callable"),
    ({"training_fn": lambda model: {}}, "must accept exactly the two arguments"),
    ({"training_fn": _named_fn}, "single-model"),
    ({"hooks": [_DoBackward(), _DoBackward()]}, "At most one hook may claim DO_BACKWARD"),
    ({"nonfinite_loss": "explode"}, "nonfinite_loss"),
    ({"unknown_field": 1}, "Extra inputs are not permitted"),
]


@pytest.mark.parametrize("overrides, match", CONSTRUCTION_ERRORS)
def test_construction_errors_name_the_field_and_fix(overrides, match):
    kwargs = {"num_epochs": 1}
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=match):
        TrainingStrategy(
            **{
                "models": TinyModel(),
                "optimizer_configs": adam(),
                "loss_fn": EnergyMSELoss(),
                **kwargs,
            }
        )


def test_unkeyed_optimizer_configs_need_a_single_model():
    with pytest.raises(ValueError, match="Unkeyed optimizer_configs require single-model input"):
        strategy({"a": TinyModel(), "b": TinyModel()}, optimizer_configs=adam())


def test_named_strategy_rejects_a_single_module_annotation():
    with pytest.raises(ValueError, match="models=model"):
        strategy(
            {"main": TinyModel()}, optimizer_configs={"main": [adam()]}, training_fn=_single_fn
        )


def _mixin_fn(model: BaseModelMixin, batch):
    return default_training_fn(model, batch)


def test_named_strategy_rejects_a_base_model_mixin_annotation():
    with pytest.raises(ValueError, match=r"Pass models=model .* or annotate the parameter as a"):
        strategy({"main": TinyModel()}, optimizer_configs={"main": [adam()]}, training_fn=_mixin_fn)


def test_non_loss_is_a_type_error_naming_the_accepted_kinds():
    with pytest.raises(TypeError, match="Only loss functions that inherit `BaseLossFunction`"):
        strategy(loss_fn=nn.MSELoss())


def test_duplicate_hook_instances_are_rejected():
    hook = Recorder()
    with pytest.raises(ValueError, match="duplicate hook instances"):
        strategy(hooks=[hook, hook])


def test_defaults_and_normalization():
    model = TinyModel()
    s = strategy(model, loss_fn=EnergyMSELoss(), epoch=3)
    assert s.training_fn is default_training_fn
    assert s.single_model_input and s.models == {"main": model}
    assert type(s.loss_fn).__name__ == "ComposedLossFunction"
    assert s.optimizer_configs["main"][0].optimizer_cls is torch.optim.Adam
    assert s.epoch == s.epoch_count == 3
    s.epoch = 5
    assert s.epoch_count == 5
    dotted = strategy(training_fn="nvalchemi.training.strategy.default_training_fn")
    assert dotted.training_fn is default_training_fn
    named = strategy({"main": model}, optimizer_configs={0: adam()})
    assert not named.single_model_input and list(named.optimizer_configs) == ["main"]


def test_any_module_and_module_dict_are_accepted():
    class Plain(nn.Module):  # not a BaseModelMixin
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, batch):
            return {"energy": batch.energy * self.w}

    s = strategy(Plain(), loss_fn=EnergyMSELoss(), num_steps=2)
    s.run(make_batches(2))
    assert s.step_count == 2
    dict_strategy = strategy(
        nn.ModuleDict({"main": Plain()}),
        loss_fn=EnergyMSELoss(),
        optimizer_configs={"main": adam()},
    )
    assert isinstance(dict_strategy.models, dict) and not dict_strategy.single_model_input


# ----------------------------------------------------------------------------- lifecycle
def test_one_batch_fires_every_stage_in_order():
    recorder = Recorder()
    s = strategy(hooks=[recorder])
    s.run([make_batch()])
    assert recorder.names() == [
        "SETUP",
        "BEFORE_TRAINING",
        "BEFORE_EPOCH",
        *PER_BATCH,
        "AFTER_EPOCH",
        "AFTER_TRAINING",
    ]


def test_two_epochs_fire_epoch_stages_around_their_batches():
    recorder = Recorder(stages=(S.BEFORE_EPOCH, S.AFTER_BATCH, S.AFTER_EPOCH, S.AFTER_TRAINING))
    s = strategy(hooks=[recorder], num_epochs=2)
    s.run(make_batches(2))
    assert recorder.events == [
        ("BEFORE_EPOCH", 0),
        ("AFTER_BATCH", 1),
        ("AFTER_BATCH", 2),
        ("AFTER_EPOCH", 2),
        ("BEFORE_EPOCH", 2),
        ("AFTER_BATCH", 3),
        ("AFTER_BATCH", 4),
        ("AFTER_EPOCH", 4),
        ("AFTER_TRAINING", 4),
    ]


def test_loss_is_live_then_detached_and_predictions_are_exposed():
    recorder = Recorder()
    s = strategy(hooks=[recorder])
    s.run([make_batch()])
    by_stage = {snap["stage"]: snap for snap in recorder.snapshots}
    for stage in ("BEFORE_BATCH", "BEFORE_FORWARD", "BEFORE_LOSS", "AFTER_TRAINING"):
        assert by_stage[stage]["loss"] is None
    assert by_stage["AFTER_LOSS"]["loss_requires_grad"] is True
    assert by_stage["BEFORE_BACKWARD"]["loss_requires_grad"] is True
    for stage in ("AFTER_BACKWARD", "AFTER_OPTIMIZER_STEP", "AFTER_BATCH", "AFTER_EPOCH"):
        assert by_stage[stage]["loss_requires_grad"] is False
    assert by_stage["BEFORE_FORWARD"]["predictions"] is None
    assert set(by_stage["AFTER_FORWARD"]["predictions"]) == {"predicted_energy", "predicted_forces"}


def test_without_hooks_no_context_is_built(monkeypatch):
    import nvalchemi.training.strategy as module

    built = []
    real = module.TrainContext
    monkeypatch.setattr(module, "TrainContext", lambda **kw: built.append(kw) or real(**kw))
    s = strategy(num_epochs=2)
    s.run(make_batches(2))
    assert s.step_count == 4 and built == []


def test_one_context_object_serves_the_whole_run():
    seen = []
    s = strategy(hooks=[StageHook(S.AFTER_BATCH, lambda ctx: seen.append(id(ctx)))], num_epochs=3)
    s.run(make_batches(2))
    assert len(seen) == 6 and len(set(seen)) == 1


def test_do_backward_and_do_optimizer_step_replace_the_defaults():
    calls = []

    class ScaledBackward:
        frequency, stage = 1, S.DO_BACKWARD

        def __call__(self, ctx, stage):
            calls.append("backward")
            (ctx.loss * 0.0).backward()  # zero gradients: the step must not move weights

    class CountingStep:
        frequency, stage = 1, S.DO_OPTIMIZER_STEP

        def __call__(self, ctx, stage):
            calls.append("step")
            for optimizer in ctx.optimizers:
                optimizer.step()

    model = TinyModel()
    s = strategy(model, optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 1.0}))
    s.register_hook(ScaledBackward())
    s.register_hook(CountingStep())
    before = [p.detach().clone() for p in model.parameters()]
    s.run(make_batches(2))
    assert calls == ["backward", "step", "backward", "step"]
    assert s.step_count == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ----------------------------------------------------------------------------- counters
def test_counters_over_two_epochs():
    recorder = Recorder(stages=(S.AFTER_LOSS,))
    s = strategy(hooks=[recorder], num_epochs=2)
    s.run(make_batches(3))
    assert (s.step_count, s.batch_count, s.global_step_count) == (6, 6, 6)
    assert (s.epoch_count, s.epoch_step_count) == (2, 0)
    assert [step for _, step in recorder.events] == [0, 1, 2, 3, 4, 5]


def test_num_steps_recycles_the_loader_and_rerun_at_target_does_nothing():
    recorder = Recorder(stages=(S.SETUP, S.BEFORE_TRAINING))
    s = strategy(hooks=[recorder], num_steps=5)
    s.run(make_batches(2))
    assert (s.step_count, s.epoch_count, s.epoch_step_count) == (5, 2, 1)
    s.run(make_batches(2))
    assert s.step_count == 5
    assert recorder.names() == ["SETUP", "BEFORE_TRAINING", "SETUP"]


def test_epoch_step_modifier_scales_the_target():
    s = strategy(num_epochs=2, epoch_step_modifier=0.5)
    s.run(make_batches(4))
    assert s.step_count == 4 and s.epoch_count == 1


def test_num_epochs_needs_a_sized_non_empty_loader():
    with pytest.raises(ValueError, match="num_epochs requires a sized dataloader"):
        strategy().run(iter(make_batches(2)))
    with pytest.raises(ValueError, match="at least one batch"):
        strategy().run([])
    with pytest.raises(ValueError, match="dataloader produced no batches"):
        strategy(num_steps=3).run(iter(make_batches(2)))  # a generator is empty the second time


def test_world_size_scales_global_step_count():
    class Manager:
        world_size = 4
        rank = 0

    seen = []
    hook = StageHook(
        S.AFTER_BATCH, lambda ctx: seen.append((ctx.step_count, ctx.global_step_count))
    )
    s = strategy(hooks=[hook], distributed_manager=Manager(), num_steps=2)
    s.run(make_batches(2))
    assert seen == [(1, 4), (2, 8)]
    assert strategy(distributed_manager=Manager(), step_count=3).global_step_count == 12


class _EpochLoader:
    """A sized loader recording set_epoch / set_epoch_step calls and yielded batch indices."""

    def __init__(self, n: int, seekable: bool) -> None:
        self.batches = make_batches(n)
        self.seekable = seekable
        self.calls: list[tuple[str, int]] = []
        self.yielded: list[int] = []
        self._skip = 0
        if seekable:
            self.set_epoch_step = self._set_epoch_step

    def set_epoch(self, epoch: int) -> None:
        self.calls.append(("set_epoch", epoch))

    def _set_epoch_step(self, step: int) -> None:
        self.calls.append(("set_epoch_step", step))
        self._skip = step

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        start, self._skip = self._skip, 0
        for i in range(start, len(self.batches)):
            self.yielded.append(i)
            yield self.batches[i]


@pytest.mark.parametrize("seekable", [False, True])
def test_restart_positions_counters_and_seeks_the_loader(seekable):
    loader = _EpochLoader(3, seekable)
    s = strategy(num_epochs=3, step_count=4, epoch_count=1)
    s.run(loader)
    assert (s.step_count, s.batch_count, s.epoch_count, s.epoch_step_count) == (9, 9, 3, 0)
    assert loader.calls[0] == ("set_epoch", 1)
    if seekable:
        assert loader.calls[1] == ("set_epoch_step", 1)
        assert loader.yielded[:2] == [1, 2]
    else:
        assert loader.yielded[:3] == [0, 1, 2]  # batch 0 is read and skipped
    assert ("set_epoch", 2) in loader.calls


def test_inconsistent_restart_counters_are_rejected():
    s = strategy(num_epochs=5, batch_count=4, epoch_count=2, epoch_step_count=1)
    with pytest.raises(ValueError, match="restart counters are inconsistent"):
        s.run(make_batches(3))


def test_sampler_set_epoch_is_called_every_epoch():
    class Sampler:
        def __init__(self):
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    class Loader(list):
        pass

    loader = Loader(make_batches(2))
    loader.sampler = Sampler()
    strategy(num_epochs=3).run(loader)
    assert loader.sampler.epochs == [0, 1, 2]


# ----------------------------------------------------------------------------- models and devices
def test_frozen_models_are_eval_and_frozen_during_run_then_restored():
    student, teacher = TinyModel(), TinyModel()
    teacher.mlp[1].eval()  # a submodule deliberately in another mode
    teacher.embedding.weight.requires_grad_(False)
    seen = {}

    def training_fn(models, batch):
        seen["training"] = models["teacher"].training
        seen["frozen"] = all(not p.requires_grad for p in models["teacher"].parameters())
        with torch.no_grad():
            target = models["teacher"](batch)["energy"] if False else None
        del target
        return default_training_fn(models["student"], batch)

    s = strategy(
        {"student": student, "teacher": teacher},
        optimizer_configs={"student": [adam()]},
        training_fn=training_fn,
        loss_fn=EnergyMSELoss(),
    )
    teacher_before = [p.detach().clone() for p in teacher.parameters()]
    s.run(make_batches(2))
    assert seen == {"training": False, "frozen": True}
    assert teacher.training and not teacher.mlp[1].training
    assert teacher.mlp[0].weight.requires_grad and not teacher.embedding.weight.requires_grad
    assert all(torch.equal(a, b) for a, b in zip(teacher_before, teacher.parameters()))


def test_configured_models_train_during_run_and_modes_are_restored():
    model = TinyModel().eval()
    modes = []
    s = strategy(
        model, hooks=[StageHook(S.BEFORE_FORWARD, lambda ctx: modes.append(ctx.model.training))]
    )
    s.run([make_batch()])
    assert modes == [True] and not model.training


def test_devices_per_model_are_applied():
    s = strategy(
        {"a": TinyModel(), "b": TinyModel()},
        optimizer_configs={"a": [adam()]},
        devices=["cpu", "cpu"],
        training_fn=lambda models, batch: default_training_fn(models["a"], batch),
    )
    s.run([make_batch()])
    assert s.devices == [torch.device("cpu"), torch.device("cpu")] and s.step_count == 1


def test_setup_hook_may_replace_the_active_dataloader():
    replacement = make_batches(4)

    def swap(ctx):
        ctx.workflow.active_dataloader = replacement

    s = strategy(hooks=[StageHook(S.SETUP, swap)])
    s.run(make_batches(1))
    assert s.step_count == 4 and s.active_dataloader is replacement


def test_set_inference_model_fills_the_slot():
    single = strategy()
    ema = TinyModel()
    single.set_inference_model(ema)
    assert single.inference_model is ema
    named = strategy(
        {"a": TinyModel(), "b": TinyModel()},
        optimizer_configs={"a": [adam()]},
        training_fn=lambda models, batch: default_training_fn(models["a"], batch),
    )
    named.set_inference_model(ema, model_key="a")
    assert isinstance(named.inference_model, nn.ModuleDict) and named.inference_model["a"] is ema


# ----------------------------------------------------------------------------- optimizers
def test_optimizers_and_adam_state_survive_successive_runs():
    s = strategy(num_steps=2)
    s.run(make_batches(2))
    optimizer = s._optimizers[0]
    state = next(iter(optimizer.state.values()))
    assert int(state["step"]) == 2
    s.num_steps = 5
    s.run(make_batches(2))
    assert s._optimizers[0] is optimizer
    assert int(next(iter(optimizer.state.values()))["step"]) == 5


def test_train_batch_reuses_optimizers_and_sets_up_once_per_session():
    setup = StageHook(S.SETUP)
    after_batch = StageHook(S.AFTER_BATCH)
    s = strategy(hooks=[setup, after_batch])
    losses = [s.train_batch(b) for b in make_batches(3)]
    assert all(isinstance(x, torch.Tensor) and not x.requires_grad for x in losses)
    optimizers, schedulers = list(s._optimizers), list(s._lr_schedulers)
    s.train_batch(make_batch())
    assert s._optimizers == optimizers and s._lr_schedulers == schedulers
    assert len(setup.calls) == 1 and after_batch.calls == [1, 2, 3, 4]
    assert (s.step_count, s.batch_count, s.epoch_count) == (4, 4, 0)
    s.close()
    s.train_batch(make_batch())
    assert len(setup.calls) == 2
    s.close()


def test_optimizers_are_rebuilt_when_trainable_parameters_change():
    model = TinyModel()
    s = strategy(model, num_steps=1)
    s.run([make_batch()])
    first = s._optimizers[0]
    model.embedding.weight.requires_grad_(False)
    s.num_steps = 2
    s.run([make_batch()])
    assert s._optimizers[0] is not first
    params = {id(p) for group in s._optimizers[0].param_groups for p in group["params"]}
    assert id(model.embedding.weight) not in params


def test_time_based_schedulers_step_every_optimizer_step():
    config = OptimizerConfig(
        torch.optim.SGD,
        {"lr": 0.5},
        scheduler_cls=torch.optim.lr_scheduler.StepLR,
        scheduler_kwargs={"step_size": 1, "gamma": 0.9},
    )
    s = strategy(optimizer_configs=config, num_steps=4)
    s.run(make_batches(2))
    assert s._optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5 * 0.9**4)


def test_metric_schedulers_step_only_after_validation_and_keep_the_summary():
    config = OptimizerConfig(
        torch.optim.SGD,
        {"lr": 1.0},
        scheduler_cls=torch.optim.lr_scheduler.ReduceLROnPlateau,
        scheduler_kwargs={"patience": 0, "factor": 0.5},
        scheduler_metric_adapter="energy_mae",
    )
    seen = []
    hook = StageHook(S.AFTER_VALIDATION, lambda ctx: seen.append("energy_mae" in ctx.validation))
    val = ValidationConfig(validation_data=make_batches(1), every_n_epochs=1)
    s = strategy(
        optimizer_configs=config,
        loss_fn=EnergyMSELoss(),
        num_epochs=3,
        validation_config=val,
        hooks=[hook],
    )
    s.run(make_batches(2))
    scheduler = s._lr_schedulers[0]
    assert seen == [True, True, True]
    assert scheduler.last_epoch == 3  # one step per validation, none per optimizer step
    assert "energy_mae" in s.last_validation  # still readable after the scheduler stepped


# ----------------------------------------------------------------------------- validation cadence
def _validation_steps(**cadence):
    steps = []
    hook = StageHook(S.AFTER_VALIDATION, lambda ctx: steps.append(ctx.step_count))
    config = ValidationConfig(validation_data=make_batches(1), **cadence)
    return steps, hook, config


def test_epoch_cadence_without_a_duplicate_final_pass():
    steps, hook, config = _validation_steps(every_n_epochs=1)
    s = strategy(num_epochs=2, validation_config=config, hooks=[hook])
    s.run(make_batches(2))
    assert steps == [2, 4]
    assert s.last_validation is not None


def test_step_cadence_and_off_boundary_final_pass():
    steps, hook, config = _validation_steps(every_n_steps=2)
    strategy(num_steps=5, validation_config=config, hooks=[hook]).run(make_batches(2))
    assert steps == [2, 4, 5]


def test_no_cadence_validates_once_at_the_end():
    steps, hook, config = _validation_steps()
    strategy(num_epochs=2, validation_config=config, hooks=[hook]).run(make_batches(2))
    assert steps == [4]


def test_validate_without_config_is_an_error():
    with pytest.raises(RuntimeError, match="requires a validation_config"):
        strategy().validate()


def test_hook_frequency_counts_completed_steps_and_epochs():
    every_two = StageHook(S.AFTER_BATCH, frequency=2)
    before = StageHook(S.BEFORE_FORWARD, frequency=2)
    epochs = StageHook(S.AFTER_EPOCH, frequency=2)
    s = strategy(hooks=[every_two, before, epochs], num_epochs=3)
    s.run(make_batches(2))
    assert every_two.calls == [2, 4, 6]
    assert before.calls == [1, 3, 5]  # the batches that build steps 2, 4, 6
    assert epochs.calls == [4]  # after epoch 2


# ----------------------------------------------------------------------------- NaN policy
class _NaNOnBigBatches(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, batch):
        energy = batch.energy * self.w
        if batch.num_graphs == 3:
            energy = energy * float("nan")
        return {"energy": energy}


def _nan_batches():
    return [
        make_batch(2, seed=0),
        make_batch(2, seed=1),
        make_batch(3, seed=2),
        make_batch(2, seed=3),
    ]


def test_raise_policy_names_step_epoch_batch_and_component_without_syncing_each_step(monkeypatch):
    from nvalchemi.training._run import NonFiniteRecord as _NonFiniteRecord

    checks = []
    original = _NonFiniteRecord.first_bad

    def counting(self):
        checks.append(len(self.losses))
        return original(self)

    monkeypatch.setattr(_NonFiniteRecord, "first_bad", counting)
    s = strategy(_NaNOnBigBatches(), loss_fn=EnergyMSELoss(), num_epochs=2)
    with pytest.raises(NonFiniteLossError) as info:
        s.run(_nan_batches())
    err = info.value
    assert (err.step, err.epoch, err.epoch_step, err.batch_count) == (2, 0, 2, 2)
    assert err.components == ["EnergyMSELoss"]
    assert "step 2" in str(err) and "batch 2 of the epoch" in str(err)
    assert checks == [8]  # one check, at the end of the run: no per-step sync


def test_raise_policy_checks_at_the_interval():
    s = strategy(
        _NaNOnBigBatches(), loss_fn=EnergyMSELoss(), num_steps=20, nonfinite_check_interval=3
    )
    with pytest.raises(NonFiniteLossError) as info:
        s.run(_nan_batches())
    # found at the check that the third loss makes due, before that batch's optimizer step
    assert info.value.step == 2 and s.step_count == 2
    assert "no optimizer step used it" in str(info.value)


def test_check_nonfinite_is_public_and_clears():
    seen = []

    def check(ctx):
        with pytest.raises(NonFiniteLossError) if ctx.step_count == 3 else nullcontext():
            ctx.workflow.check_nonfinite()
        ctx.workflow.check_nonfinite()  # the record was consumed
        seen.append(ctx.step_count)

    s = strategy(
        _NaNOnBigBatches(),
        loss_fn=EnergyMSELoss(),
        num_steps=3,
        hooks=[StageHook(S.AFTER_BATCH, check)],
    )
    s.run(_nan_batches())
    assert seen == [1, 2, 3]


def test_skip_policy_skips_backward_and_step_of_nonfinite_batches():
    model = _NaNOnBigBatches()
    s = strategy(model, loss_fn=EnergyMSELoss(), num_epochs=1, nonfinite_loss="skip")
    s.run(_nan_batches())
    assert (s.step_count, s.batch_count) == (4, 5)
    assert torch.isfinite(model.w).all()


def test_skip_policy_stops_when_every_batch_is_skipped():
    s = strategy(
        _NaNOnBigBatches(),
        loss_fn=EnergyMSELoss(),
        num_steps=3,
        nonfinite_loss="skip",
        max_consecutive_skips=5,
    )
    with pytest.raises(TrainingStalledError, match="5 consecutive batches made no optimizer step"):
        s.run([make_batch(3)])
    assert s.step_count == 0 and s.batch_count == 5


def test_vetoing_every_step_stops_instead_of_looping_forever():
    class VetoAll(TrainingUpdateHook):
        def __call__(self, ctx, stage, will_skip):
            return stage is not S.DO_OPTIMIZER_STEP, ctx.loss

    s = strategy(hooks=[VetoAll()], num_steps=2, max_consecutive_skips=7)
    with pytest.raises(TrainingStalledError, match="vetoed"):
        s.run(make_batches(2))
    assert s.batch_count == 7


# ----------------------------------------------------------------------------- stop requests
def test_stop_mid_epoch_finishes_the_batch_and_keeps_counters_consistent():
    recorder = Recorder(stages=(S.AFTER_BATCH, S.AFTER_EPOCH, S.AFTER_TRAINING, S.AFTER_VALIDATION))

    def stop_at_two(ctx):
        if ctx.step_count == 2:
            ctx.workflow.request_stop("test says stop")

    val = ValidationConfig(validation_data=make_batches(1))
    s = strategy(
        hooks=[StageHook(S.AFTER_BATCH, stop_at_two), recorder], num_epochs=5, validation_config=val
    )
    s.run(make_batches(3))
    assert s.stop_reason == "test says stop" and s.stop_requested
    assert (s.step_count, s.batch_count, s.epoch_count, s.epoch_step_count) == (2, 2, 0, 2)
    assert recorder.names() == ["AFTER_BATCH", "AFTER_BATCH", "AFTER_TRAINING", "AFTER_VALIDATION"]


def test_stop_on_the_last_batch_of_an_epoch_still_fires_after_epoch():
    recorder = Recorder(stages=(S.AFTER_EPOCH, S.AFTER_TRAINING))

    def stop(ctx):
        if ctx.step_count == 2:
            ctx.workflow.request_stop("done")

    s = strategy(hooks=[StageHook(S.AFTER_BATCH, stop), recorder], num_epochs=5)
    s.run(make_batches(2))
    assert recorder.names() == ["AFTER_EPOCH", "AFTER_TRAINING"]
    assert (s.step_count, s.epoch_count, s.epoch_step_count) == (2, 1, 0)
    s.run(make_batches(2))  # a new run clears the request
    assert s.step_count == 10 and s.stop_reason is None


# ----------------------------------------------------------------------------- errors in the loop
def test_model_errors_are_annotated_with_the_stage():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, batch):
            raise RuntimeError("model exploded")

    with pytest.raises(RuntimeError, match="model exploded") as info:
        strategy(Broken(), loss_fn=EnergyMSELoss()).run(make_batches(2))
    note = " ".join(info.value.__notes__)
    assert "forward pass" in note and "step 0" in note and "epoch 0" in note


def test_hook_errors_name_the_hook_and_stage():
    def fail(ctx):
        raise ValueError("bad hook")

    with pytest.raises(ValueError, match="bad hook") as info:
        strategy(hooks=[StageHook(S.AFTER_LOSS, fail)]).run(make_batches(2))
    note = " ".join(info.value.__notes__)
    assert "StageHook" in note and "AFTER_LOSS" in note


def test_missing_targets_and_data_errors_are_annotated():
    batch = make_batch()
    del batch.forces
    with pytest.raises(KeyError, match="forces") as info:
        strategy().run([batch])
    assert "loss computation" in " ".join(info.value.__notes__)

    class BadLoader:
        def __len__(self):
            return 2

        def __iter__(self):
            yield make_batch()
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone") as info:
        strategy().run(BadLoader())
    assert "loading the next batch" in " ".join(info.value.__notes__)


def test_a_run_can_be_repeated_after_a_hook_failure():
    state = {"fail": True}

    def maybe_fail(ctx):
        if state["fail"]:
            raise RuntimeError("once")

    s = strategy(hooks=[StageHook(S.AFTER_BATCH, maybe_fail)], num_steps=2)
    with pytest.raises(RuntimeError):
        s.run(make_batches(2))
    state["fail"] = False
    s.run(make_batches(2))
    assert s.step_count == 2


# ----------------------------------------------------------------------------- specs
def test_spec_round_trip_is_json_and_rebuilds_the_configuration():
    s = strategy(
        loss_fn=EnergyMSELoss(per_atom=True) + 2.0 * ForceMSELoss(),
        num_steps=7,
        training_fn=energy_training_fn,
        nonfinite_loss="skip",
    )
    s.loss_fn.dtype_policy = "prediction_to_target"
    spec = json.loads(json.dumps(s.to_spec_dict()))
    assert spec["training_fn"] == "_training_support.energy_training_fn"
    rebuilt = TrainingStrategy.from_spec_dict(spec, trust=True)
    assert rebuilt.num_steps == 7 and rebuilt.num_epochs is None
    assert rebuilt.devices == [torch.device("cpu")] and rebuilt.single_model_input
    assert rebuilt.training_fn is energy_training_fn and rebuilt.nonfinite_loss == "skip"
    assert rebuilt.optimizer_configs["main"][0].optimizer_kwargs == {"lr": 1e-2}
    assert rebuilt.loss_fn.weights == s.loss_fn.weights
    assert rebuilt.loss_fn.dtype_policy == "prediction_to_target"
    assert rebuilt.loss_fn.components[0].per_atom is True
    assert type(rebuilt.models["main"]) is TinyModel


def test_checkpoint_dict_restores_counters_and_class():
    s = strategy(num_steps=3)
    s.run(make_batches(2))
    data = json.loads(json.dumps(s.to_checkpoint_dict()))
    assert data["strategy_cls"] == "nvalchemi.training.strategy.TrainingStrategy"
    restored = TrainingStrategy.from_checkpoint_dict(data, models=TinyModel())
    assert (restored.step_count, restored.batch_count, restored.epoch_count) == (3, 3, 1)
    assert restored.epoch_step_count == 1


def test_non_importable_training_fn_is_omitted_with_a_warning():
    s = strategy(training_fn=lambda model, batch: default_training_fn(model, batch))
    with pytest.warns(UserWarning, match="Omitting non-importable training_fn"):
        spec = s.to_spec_dict()
    assert "training_fn" not in spec
    with pytest.raises(ValueError, match="no training_fn was supplied"):
        TrainingStrategy.from_spec_dict(spec, models=TinyModel())


@pytest.mark.parametrize(
    "change, match",
    [
        ({"optimizer_configs": []}, "optimizer_configs"),
        ({"devices": "cpu"}, "devices"),
        ({"loss_fn_spec": 3}, "loss_fn_spec"),
        ({"model_specs": []}, "model_specs"),
        ({"training_fn": 3}, "training_fn"),
        ({"single_model_input": "yes"}, "single_model_input"),
    ],
)
def test_malformed_specs_name_the_field(change, match):
    spec = strategy().to_spec_dict()
    spec.update(change)
    with pytest.raises(ValueError, match=match):
        TrainingStrategy.from_spec_dict(spec, trust=True)


def test_runtime_state_round_trip():
    s = strategy(num_steps=3)
    s.run(make_batches(2))
    state = s.runtime_state()
    other = strategy(num_steps=3)
    other.load_runtime_state(state)
    assert other.runtime_state() == state
    with pytest.raises(ValueError, match="must be >= 0"):
        other.load_runtime_state({"step_count": -1})


def test_iter_checkpointable_hooks_gives_stable_keys():
    class Stateful:
        frequency, stage = 1, S.AFTER_BATCH

        def __call__(self, ctx, stage):
            pass

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    a, b = Stateful(), Stateful()
    s = strategy(hooks=[a, Recorder(), b])
    assert list(s.iter_checkpointable_hooks()) == [("Stateful", a), ("Stateful#1", b)]
    assert s.trainable_models() == s.models and s.unwrapped_models() == s.models


def test_labels_keep_their_dtype_so_strict_policy_catches_float64_labels():
    batches = make_batches(2, energy_dtype=torch.float64)
    assert batches[0].energy.dtype == torch.float64
    with pytest.raises(ValueError, match="dtype"):
        strategy(loss_fn=EnergyMSELoss()).run(batches)
    loss = EnergyMSELoss()
    loss.dtype_policy = "prediction_to_target"
    s = strategy(loss_fn=loss)
    s.run(batches)
    assert s.step_count == 2


def test_nonfinite_record_survives_no_warning_noise():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy(nonfinite_loss="skip", num_steps=2).run(make_batches(2))
    assert math.isfinite(1.0)


@pytest.mark.distributed
def test_nonfinite_verdicts_are_agreed_across_ranks():
    results = run_ranks(Path(__file__).with_name("_strategy_ranks.py"))
    by_rank = {r["rank"]: r for r in results}
    assert by_rank[1]["raised"] == {"step": 2, "components": ["EnergyMSELoss"]}
    assert by_rank[0]["raised"] is not None  # told by rank 1, instead of hanging
    assert by_rank[0]["skip_counts"] == by_rank[1]["skip_counts"] == [4, 5]


def test_launcher_variables_without_a_process_group_do_not_scale_global_steps(monkeypatch):
    # e.g. `srun -n 2 ... --no-distributed`: every task trains alone
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    s = strategy(num_steps=2)
    s.run(make_batches(2))
    assert (s.step_count, s.global_step_count) == (2, 2)


def test_restored_counters_use_the_same_world_size_rule(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert strategy(step_count=3).global_step_count == 3
