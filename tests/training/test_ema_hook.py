"""EMAHook: averaging numerics, cadence, skipped steps, exact state round trips, validation slot."""

from __future__ import annotations

import copy

import _update_support as S
import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.optim.swa_utils import AveragedModel

from nvalchemi.training import EMAHook as ExportedEMAHook
from nvalchemi.training import EnergyMSELoss, TrainingStage, ValidationConfig
from nvalchemi.training.hooks.ema import EMAHook, EMAValidationHook
from nvalchemi.training.validation import ValidationLoop


def _track_weights(strategy, model) -> list[list[torch.Tensor]]:
    """Weights after every batch (the optimizer step has run by AFTER_BATCH)."""
    history: list[list[torch.Tensor]] = []
    strategy.register_hook(
        S.StageHook(TrainingStage.AFTER_BATCH, lambda ctx: history.append(S.params_of(model)))
    )
    return history


def _shadow(hook: EMAHook) -> list[torch.Tensor]:
    return S.params_of(hook.get_averaged_model().module)


# ----------------------------------------------------------------------------- configuration
def test_defaults_and_bounds():
    hook = EMAHook()
    assert ExportedEMAHook is EMAHook
    assert (hook.model_key, hook.decay, hook.update_every, hook.start_step) == ("main", 0.999, 1, 0)
    assert (hook.use_buffers, hook.num_updates, hook.priority) == (True, 0, 50)
    assert EMAHook(model_key="  student ").model_key == "student"
    for bad in (
        {"model_key": ""},
        {"model_key": "   "},
        {"decay": 1.0},
        {"decay": -0.1},
        {"update_every": 0},
        {"start_step": -1},
        {"num_updates": -1},
        {"beta": 0.9},
    ):
        with pytest.raises(ValidationError):
            EMAHook(**bad)


def test_get_averaged_model_before_setup_raises():
    with pytest.raises(RuntimeError, match="has not initialized an averaged model yet"):
        EMAHook().get_averaged_model()


def test_unknown_model_key_names_the_available_keys():
    strategy = S.make_strategy(hooks=[EMAHook(model_key="teacher")])
    with pytest.raises(KeyError, match=r"model_key='teacher'; available keys .*\['main'\]"):
        strategy.run(S.make_batches(1))


# ----------------------------------------------------------------------------- numerics
def test_ema_matches_hand_computed_average():
    torch.manual_seed(0)
    model = S.ForceMLP()
    hook = EMAHook(decay=0.8)
    strategy = S.make_strategy(model, hooks=[hook], num_steps=4)
    history = _track_weights(strategy, model)
    strategy.run(S.make_batches(4))
    expected = [w.clone() for w in history[0]]  # the first update copies
    for weights in history[1:]:
        expected = [0.8 * e + 0.2 * w for e, w in zip(expected, weights)]
    assert hook.num_updates == 4
    for got, want in zip(_shadow(hook), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # deep copy: no storage shared with the live model
    live = {p.data_ptr() for p in model.parameters()}
    assert not live & {p.data_ptr() for p in hook.get_averaged_model().module.parameters()}


class _TorchPathEMA(EMAHook):
    """Overrides the build seam: updates then go through AveragedModel.update_parameters."""

    def _build_averaged_model(self, source):
        from torch.optim.swa_utils import get_ema_multi_avg_fn

        return AveragedModel(
            source, multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=True
        )


def test_fused_update_is_bitwise_equal_to_averaged_model_update_parameters():
    runs = []
    for cls in (EMAHook, _TorchPathEMA):
        torch.manual_seed(0)
        model = S.ForceMLP(norm=True)
        hook = cls(decay=0.9)
        S.make_strategy(model, hooks=[hook], num_steps=3).run(S.make_batches(3))
        runs.append(hook)
    assert type(runs[1].get_averaged_model()) is AveragedModel
    for a, b in zip(
        runs[0].get_averaged_model().state_dict().values(),
        runs[1].get_averaged_model().state_dict().values(),
    ):
        assert torch.equal(a, b)


def test_decay_zero_copies_the_weights():
    model = S.ForceMLP()
    hook = EMAHook(decay=0.0)
    strategy = S.make_strategy(model, hooks=[hook], num_steps=3)
    strategy.run(S.make_batches(3))
    assert all(torch.equal(a, b) for a, b in zip(_shadow(hook), S.params_of(model)))


def test_update_every_and_start_step_use_the_global_step_modulo():
    model = S.ForceMLP()
    hook = EMAHook(decay=0.5, update_every=3, start_step=5)
    strategy = S.make_strategy(model, hooks=[hook], num_steps=12)
    updates: list[int] = []
    strategy.register_hook(
        S.StageHook(TrainingStage.AFTER_BATCH, lambda ctx: updates.append(hook.num_updates))
    )
    strategy.run(S.make_batches(4))
    steps_with_update = [i + 1 for i in range(12) if updates[i] > (updates[i - 1] if i else 0)]
    assert steps_with_update == [6, 9, 12]


def test_setup_initializes_and_publishes_without_updating():
    model = S.ForceMLP()
    initial = S.params_of(model)
    hook = EMAHook(start_step=100)
    strategy = S.make_strategy(model, hooks=[hook], num_steps=2)
    strategy.run(S.make_batches(2))
    assert hook.num_updates == 0
    assert strategy.inference_model is hook.get_averaged_model().module
    # before the first update the shadow tracks the live (trained) weights, not the initial
    assert all(torch.equal(a, b) for a, b in zip(_shadow(hook), S.params_of(model)))
    assert not all(torch.equal(a, b) for a, b in zip(_shadow(hook), initial))


def test_skipped_steps_are_not_averaged_and_grads_untouched():
    model = S.ForceMLP()
    hook = EMAHook(decay=0.5)
    strategy = S.make_strategy(model, hooks=[hook, S.Veto({1})], num_steps=3)
    history = _track_weights(strategy, model)
    grads: list[list] = []
    strategy.register_hook(
        S.StageHook(
            TrainingStage.AFTER_BATCH,
            lambda ctx: grads.append([p.grad.clone() for p in model.parameters()]),
        )
    )
    shadows: list[list[torch.Tensor]] = []
    strategy.register_hook(
        S.StageHook(TrainingStage.AFTER_BATCH, lambda ctx: shadows.append(_shadow(hook)))
    )
    strategy.run(S.make_batches(4))
    assert strategy.batch_count == 4 and strategy.step_count == 3
    assert hook.num_updates == 3
    assert all(torch.equal(a, b) for a, b in zip(shadows[0], shadows[1]))  # vetoed batch
    expected = history[0]
    for weights in (history[2], history[3]):
        expected = [0.5 * e + 0.5 * w for e, w in zip(expected, weights)]
    for got, want in zip(shadows[-1], expected):
        torch.testing.assert_close(got, want)
    assert all(g.abs().sum() > 0 for g in grads[-1])  # EMA never clears gradients


def test_averaged_model_follows_source_dtype():
    model = S.ForceMLP().double()
    hook = EMAHook()
    batches = [b.to(dtype=torch.float64) for b in S.make_batches(2)]
    S.make_strategy(model, hooks=[hook], num_steps=1, loss_fn=EnergyMSELoss()).run(batches)
    assert {p.dtype for p in hook.get_averaged_model().module.parameters()} == {torch.float64}


def test_named_models_publish_a_module_dict_slot():
    student, teacher = S.ForceMLP(), S.ForceMLP()

    def fn(models, batch):
        return {"predicted_energy": models["student"](batch)["energy"]}

    hook = EMAHook(model_key="student")
    strategy = S.make_strategy(
        models={"student": student, "teacher": teacher},
        optimizer_configs={"student": [S.sgd()]},
        training_fn=fn,
        loss_fn=EnergyMSELoss(),
        hooks=[hook],
        num_steps=2,
    )
    strategy.run(S.make_batches(2))
    assert isinstance(strategy.inference_model, nn.ModuleDict)
    assert strategy.inference_model["student"] is hook.get_averaged_model().module


# ----------------------------------------------------------------------------- checkpoints
def _trained_hook(steps: int = 3, **kwargs):
    torch.manual_seed(0)
    model = S.ForceMLP()
    hook = EMAHook(decay=0.7, **kwargs)
    strategy = S.make_strategy(model, hooks=[hook], num_steps=steps)
    strategy.run(S.make_batches(4))
    return model, hook, strategy


def test_state_round_trip_is_bitwise_including_pending_state():
    model, hook, _ = _trained_hook()
    state = hook.state_dict()
    assert state["num_updates"] == 3
    assert {"model_key", "decay", "update_every", "start_step", "use_buffers"} <= set(state)

    restored = EMAHook(decay=0.7)
    restored.load_state_dict(state)  # before any model exists: pending
    assert restored.num_updates == 3
    pending = restored.state_dict()["averaged_model_state"]
    assert all(torch.equal(pending[k], v) for k, v in state["averaged_model_state"].items())
    # materialised at SETUP, even when run() has nothing left to do
    strategy = S.make_strategy(copy.deepcopy(model), hooks=[restored], num_steps=1, step_count=1)
    strategy.run(S.make_batches(1))
    live = restored.get_averaged_model().state_dict()
    assert all(torch.equal(live[k], v) for k, v in state["averaged_model_state"].items())
    assert strategy.inference_model is restored.get_averaged_model().module

    # the saved state is a snapshot: later updates do not change it
    again = hook.state_dict()["averaged_model_state"]
    hook.get_averaged_model().module.mlp[0].weight.data.add_(1.0)
    assert all(torch.equal(again[k], v) for k, v in state["averaged_model_state"].items())


def test_resumed_run_reproduces_the_uninterrupted_average_exactly():
    batches = S.make_batches(4)
    torch.manual_seed(0)
    model = S.ForceMLP()
    start = copy.deepcopy(model.state_dict())
    full = EMAHook(decay=0.7)
    S.make_strategy(model, hooks=[full], num_steps=4).run(batches)

    first_model = S.ForceMLP()
    first_model.load_state_dict(start)
    first = EMAHook(decay=0.7)
    first_strategy = S.make_strategy(first_model, hooks=[first], num_steps=2)
    first_strategy.run(batches)
    saved_model = copy.deepcopy(first_model.state_dict())
    saved_hook = first.state_dict()

    second_model = S.ForceMLP()
    second_model.load_state_dict(saved_model)
    second = EMAHook(decay=0.7)
    second.load_state_dict(saved_hook)
    S.make_strategy(second_model, hooks=[second], num_steps=4, step_count=2).run(batches)
    assert second.num_updates == full.num_updates == 4
    for a, b in zip(_shadow(second), _shadow(full)):
        assert torch.equal(a, b)


def test_load_into_a_built_hook_and_config_conflicts():
    _, hook, _ = _trained_hook()
    state = hook.state_dict()
    _, other, _ = _trained_hook(steps=1)
    other.load_state_dict(state)  # live model: loaded immediately
    assert all(torch.equal(a, b) for a, b in zip(_shadow(other), _shadow(hook)))
    with pytest.raises(
        ValueError, match=r"EMAHook checkpoint conflict: decay=0.7 vs constructor decay=0.9"
    ) as info:
        EMAHook(decay=0.9).load_state_dict(state)
    assert "construct the hook with matching config" in str(info.value).lower()
    with pytest.raises(ValueError, match="update_every"):
        EMAHook(decay=0.7, update_every=2).load_state_dict(state)


class RepairedCopy(S.ForceMLP):
    """A model whose runtime methods do not survive deepcopy and are repaired on the copy."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, float]] = []

    def modify_ema_methods(self) -> None:
        first = next(self.parameters())
        self.calls.append((id(self), float(first.detach().flatten()[0])))


def test_ema_calls_modify_ema_methods_on_the_copy_before_pending_weights():
    _, trained, _ = _trained_hook()
    state = trained.state_dict()
    for name, value in list(state["averaged_model_state"].items()):
        if name.startswith("module.") and value.is_floating_point():
            state["averaged_model_state"][name] = torch.full_like(value, 7.0)
    torch.manual_seed(0)
    model = RepairedCopy()
    hook = EMAHook(decay=0.7)
    hook.load_state_dict(state)  # pending until the copy exists
    S.make_strategy(model, hooks=[hook], num_steps=1).run(S.make_batches(1))
    copy_ = hook.get_averaged_model().module
    assert model.calls == [] and len(copy_.calls) == 1  # once, on the copy only
    copied_id, first_value = copy_.calls[0]
    assert copied_id == id(copy_)
    assert first_value != 7.0  # called before the checkpointed weights were loaded


def test_state_without_averaged_weights_clears_them():
    _, hook, _ = _trained_hook()
    hook.load_state_dict({"num_updates": 0})
    assert hook.num_updates == 0
    with pytest.raises(RuntimeError):
        hook.get_averaged_model()
    assert "averaged_model_state" not in hook.state_dict()


def test_state_round_trips_through_the_orchestrator_by_class_name():
    _, hook, strategy = _trained_hook()
    orchestrator = strategy.hooks[0]
    state = orchestrator.state_dict()
    assert set(state) == {"EMAHook"}
    fresh = EMAHook(decay=0.7)
    S.make_strategy(hooks=[fresh]).hooks[0].load_state_dict(state)
    assert fresh.num_updates == hook.num_updates


# ----------------------------------------------------------------------------- validation
def test_validation_uses_the_ema_slot_per_use_ema():
    _, hook, strategy = _trained_hook(steps=4)
    val = S.make_batches(2, seed=50)
    summaries = {}
    for mode in ("auto", "always", "never"):
        summaries[mode] = strategy.validate(ValidationConfig(validation_data=val, use_ema=mode))
    assert summaries["auto"]["model_source"] == "ema"
    assert summaries["always"]["model_source"] == "ema"
    assert summaries["never"]["model_source"] == "live"
    # the EMA pass really ran the averaged weights
    standalone = ValidationLoop(
        validation_data=val,
        config=ValidationConfig(validation_data=val),
        device="cpu",
        model=hook.get_averaged_model().module,
        loss_fn=strategy.loss_fn,
        validation_fn=strategy.training_fn,
    )
    with standalone:
        expected = standalone.execute()
    torch.testing.assert_close(summaries["auto"]["total_loss"], expected["total_loss"])
    assert not torch.equal(summaries["auto"]["total_loss"], summaries["never"]["total_loss"])


def test_ema_validation_hook_reports_live_and_ema_metrics():
    val = S.make_batches(2, seed=50)
    model = S.ForceMLP()
    strategy = S.make_strategy(
        model,
        hooks=[EMAHook(decay=0.7), EMAValidationHook()],
        num_steps=3,
        validation_config=ValidationConfig(validation_data=val),
    )
    strategy.run(S.make_batches(3))
    summary = strategy.last_validation
    assert summary["model_source"] == "ema"
    assert "live/total_loss" in summary and "live/forces_mae" in summary
    live = strategy.validate(ValidationConfig(validation_data=val, use_ema="never"))
    torch.testing.assert_close(summary["live/total_loss"], live["total_loss"])
    assert "ema/total_loss" in live  # the hook also runs after a live pass
    torch.testing.assert_close(live["ema/total_loss"], summary["total_loss"])
