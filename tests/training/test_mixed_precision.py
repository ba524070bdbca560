"""MixedPrecisionHook: precision parsing, autocast scopes, fp16 GradScaler order and state."""

from __future__ import annotations

import _update_support as S
import pytest
import torch
from pydantic import ValidationError
from torch.nn.modules import module as module_hooks

from nvalchemi.data import Batch
from nvalchemi.hooks import Hook
from nvalchemi.training import EnergyMSELoss, OptimizerConfig, TrainingStage, ValidationConfig
from nvalchemi.training.hooks import MixedPrecisionHook as ExportedHook
from nvalchemi.training.hooks.gradients import GradientAccumulationHook
from nvalchemi.training.hooks.mixed_precision import MixedPrecisionHook
from nvalchemi.training.hooks.update import TrainingUpdateOrchestrator


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        ("float32", torch.float32),
        ("BFloat16", torch.bfloat16),
        ("torch.float16", torch.float16),
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("FP16", torch.float16),
    ],
)
def test_precision_accepts_dtypes_names_and_aliases(value, expected):
    assert MixedPrecisionHook(precision=value).precision is expected
    assert MixedPrecisionHook(value).precision is expected


@pytest.mark.parametrize("value", ["fp8", "float64", torch.float64, "int8", 16])
def test_unsupported_precision_error_names_allowed_ones(value):
    with pytest.raises(ValidationError, match=r"must be one of \(float32, bfloat16, float16\)"):
        MixedPrecisionHook(precision=value)


def test_extra_fields_rejected_and_class_contract():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        MixedPrecisionHook(precision="bf16", loss_scale=2.0)
    hook = MixedPrecisionHook("bf16")
    assert hook.priority == 20
    assert not isinstance(hook, Hook)
    assert ExportedHook is MixedPrecisionHook
    assert hook.precision_name == "bfloat16"
    with pytest.raises(ValueError, match="exclusive key 'MixedPrecisionHook'"):
        TrainingUpdateOrchestrator(MixedPrecisionHook("bf16"), MixedPrecisionHook("fp16"))


def test_config_dumps_to_json_and_back():
    hook = MixedPrecisionHook("bf16", autocast_scope="region")
    assert hook.model_dump() == {"precision": "bfloat16", "autocast_scope": "region"}
    again = MixedPrecisionHook.model_validate_json(hook.model_dump_json())
    assert (again.precision, again.autocast_scope) == (torch.bfloat16, "region")


def test_two_hooks_in_one_strategy_rejected():
    strategy = S.make_strategy(hooks=[MixedPrecisionHook("bf16")])
    with pytest.raises(ValueError, match="MixedPrecisionHook"):
        strategy.register_hook(MixedPrecisionHook("fp16"))


# ----------------------------------------------------------------------------- autocast scopes
def _autocast_probe(strategy, model):
    """Record autocast state in the training_fn, inside Linear layers, and after backward."""
    seen: dict[str, list] = {"forward": [], "linear": [], "after_backward": []}

    def record_enabled(module, args):
        seen["linear"].append(torch.is_autocast_enabled("cpu"))

    def record_dtype(module, args, output):
        seen["linear"][-1] = (seen["linear"][-1], output.dtype)

    handles = [
        model.mlp[0].register_forward_pre_hook(record_enabled),
        model.mlp[0].register_forward_hook(record_dtype),
    ]
    strategy.register_hook(
        S.StageHook(
            TrainingStage.BEFORE_FORWARD,
            lambda ctx: seen["forward"].append(torch.is_autocast_enabled("cpu")),
        )
    )
    strategy.register_hook(
        S.StageHook(
            TrainingStage.AFTER_BACKWARD,
            lambda ctx: seen["after_backward"].append(torch.is_autocast_enabled("cpu")),
        )
    )
    return seen, handles


def test_region_scope_spans_forward_and_is_released_before_backward():
    model = S.ForceMLP()
    strategy = S.make_strategy(
        model,
        hooks=[MixedPrecisionHook("bf16", autocast_scope="region")],
        num_steps=2,
        loss_fn=EnergyMSELoss(dtype_policy="prediction_to_target"),
    )
    seen, handles = _autocast_probe(strategy, model)
    strategy.run(S.make_batches(2))
    for handle in handles:
        handle.remove()
    assert seen["forward"] == [True, True]
    assert seen["linear"] == [(True, torch.bfloat16)] * 2
    assert seen["after_backward"] == [False, False]
    assert not torch.is_autocast_enabled("cpu")


def test_layers_scope_autocasts_only_matmul_layers_and_cleans_up():
    model = S.ForceMLP()
    strategy = S.make_strategy(model, hooks=[MixedPrecisionHook("bf16")], num_steps=2)
    before = (len(module_hooks._global_forward_hooks), len(module_hooks._global_forward_pre_hooks))
    seen, handles = _autocast_probe(strategy, model)
    strategy.run(S.make_batches(2))
    for handle in handles:
        handle.remove()
    assert seen["forward"] == [False, False]  # outside the layers: float32
    # inside the Linear autocast is on; its output is cast back to float32
    assert seen["linear"] == [(True, torch.float32)] * 2
    assert seen["after_backward"] == [False, False]
    after = (len(module_hooks._global_forward_hooks), len(module_hooks._global_forward_pre_hooks))
    assert after == before
    assert not torch.is_autocast_enabled("cpu")


def test_layers_scope_cleans_up_after_a_failing_forward():
    def failing_fn(model, batch):
        model(batch)
        raise RuntimeError("boom")

    strategy = S.make_strategy(hooks=[MixedPrecisionHook("bf16")], training_fn=failing_fn)
    before = len(module_hooks._global_forward_hooks)
    with pytest.raises(RuntimeError, match="boom"):
        strategy.run(S.make_batches(1))
    assert len(module_hooks._global_forward_hooks) == before
    assert not torch.is_autocast_enabled("cpu")


def test_float32_creates_no_amp_state():
    hook = MixedPrecisionHook("fp32")
    strategy = S.make_strategy(hooks=[hook], num_steps=2)
    scalers = []
    strategy.register_hook(
        S.StageHook(TrainingStage.AFTER_BATCH, lambda ctx: scalers.append(ctx.grad_scaler))
    )
    strategy.run(S.make_batches(2))
    assert scalers == [None, None]
    assert hook.grad_scaler is None
    assert hook.state_dict()["grad_scaler"] is None


@pytest.mark.parametrize("scope", ["layers", "region"])
def test_bf16_forces_are_float32_and_close_to_float32_forces(scope):
    torch.manual_seed(0)
    model = S.ForceMLP(hidden=32, norm=True).train()
    batch = S.make_batches(1, size=3, atoms=5)[0]
    reference = model(batch)
    hook = MixedPrecisionHook("bf16", autocast_scope=scope)
    with hook.inference_autocast("cpu"):
        low = model(batch)
    assert low["forces"].dtype == torch.float32
    assert batch.positions.dtype == torch.float32
    scale = reference["forces"].abs().max()
    assert (low["forces"] - reference["forces"]).abs().max() < 0.05 * scale
    if scope == "layers":  # the per-structure energy sum stays float32 too
        assert low["energy"].dtype == torch.float32
        assert torch.allclose(low["energy"], reference["energy"], rtol=0.05, atol=0.05)


def test_inference_autocast_float32_is_a_nullcontext_and_validation_reports_precision():
    import contextlib

    assert isinstance(MixedPrecisionHook("fp32").inference_autocast("cpu"), contextlib.nullcontext)
    batches = S.make_batches(2)
    strategy = S.make_strategy(
        hooks=[MixedPrecisionHook("bf16")],
        num_steps=1,
        validation_config=ValidationConfig(validation_data=batches, use_mixed_precision="always"),
    )
    strategy.run(batches)
    assert strategy.last_validation["precision"] == "bfloat16"
    assert torch.isfinite(strategy.last_validation["total_loss"])


# ----------------------------------------------------------------------------- fp16 scaler
class _RecordingScaler(torch.amp.GradScaler):
    """Records its calls; a small initial scale so no step overflows (no retries)."""

    calls: list[str] = []

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**8, **kwargs):
        super().__init__(device, init_scale, **kwargs)

    def scale(self, outputs):
        type(self).calls.append("scale")
        return super().scale(outputs)

    def unscale_(self, optimizer):
        type(self).calls.append("unscale_")
        return super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        type(self).calls.append("step")
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        type(self).calls.append("update")
        return super().update(new_scale)


@pytest.fixture
def recording_scaler(monkeypatch):
    _RecordingScaler.calls = []
    monkeypatch.setattr(torch.amp, "GradScaler", _RecordingScaler)
    return _RecordingScaler


def test_fp16_call_order_once_each_per_batch(recording_scaler):
    strategy = S.make_strategy(hooks=[MixedPrecisionHook("fp16")], num_steps=2)
    strategy.run(S.make_batches(2))
    assert recording_scaler.calls == ["scale", "unscale_", "step", "update"] * 2
    assert strategy.step_count == 2


def test_fp16_two_optimizers_unscale_all_before_stepping(recording_scaler):
    strategy = S.make_strategy(
        hooks=[MixedPrecisionHook("fp16")],
        optimizer_configs=[
            OptimizerConfig(torch.optim.SGD, {"lr": 0.05}, parameters=["embedding.*"]),
            S.adam(),
        ],
        num_steps=1,
    )
    strategy.run(S.make_batches(1))
    assert recording_scaler.calls == ["scale", "unscale_", "unscale_", "step", "step", "update"]


def test_fp16_vetoed_step_performs_no_unscale_step_or_update(recording_scaler):
    strategy = S.make_strategy(
        hooks=[MixedPrecisionHook("fp16"), GradientAccumulationHook(2)], num_steps=1
    )
    strategy.run(S.make_batches(2))
    # batch 0: vetoed by accumulation before the unscale -> only scale
    assert recording_scaler.calls == ["scale", "scale", "unscale_", "step", "update"]


def test_fp16_veto_after_unscale_resets_the_scaler_for_the_next_batch(recording_scaler):
    strategy = S.make_strategy(hooks=[MixedPrecisionHook("fp16"), S.Veto({0})], num_steps=1)
    strategy.run(S.make_batches(2))
    assert recording_scaler.calls == [
        *("scale", "unscale_", "update"),  # vetoed by a later hook: no step
        *("scale", "unscale_", "step", "update"),
    ]
    assert strategy.step_count == 1 and strategy.batch_count == 2


def test_fp16_scaler_state_round_trips_and_survives_strategy_contexts():
    hook = MixedPrecisionHook("fp16")
    strategy = S.make_strategy(hooks=[hook], num_steps=2)
    batches = S.make_batches(2)
    strategy.run(batches)
    scaler = hook.grad_scaler
    assert scaler is not None
    scaler.update(1024.0)  # a distinctive scale
    strategy.num_steps = 3
    strategy.run(batches)  # a second context: the scaler and its scale are kept (bug 10)
    assert hook.grad_scaler is scaler
    state = hook.state_dict()
    assert state["precision"] == "float16"
    assert state["grad_scaler"]["scale"] == scaler.get_scale()

    fresh = MixedPrecisionHook("fp16")
    fresh.load_state_dict(state)  # before the scaler exists: kept pending
    assert fresh.state_dict()["grad_scaler"] == state["grad_scaler"]
    resumed = S.make_strategy(hooks=[fresh], num_steps=1)
    resumed.run(batches)
    # the restored scale was used for the first resumed step (no overflow: unchanged)
    assert fresh.grad_scaler.get_scale() == state["grad_scaler"]["scale"]

    live = MixedPrecisionHook("fp16")
    live.load_state_dict(
        {"precision": "fp16", "grad_scaler": {**state["grad_scaler"], "scale": 8.0}}
    )
    S.make_strategy(hooks=[live], num_steps=1).run(batches)
    assert live.grad_scaler.get_scale() == 8.0


def test_state_from_another_precision_drops_the_scaler_with_a_warning():
    hook = MixedPrecisionHook("bf16")
    with pytest.warns(UserWarning, match="GradScaler state is not restored"):
        hook.load_state_dict({"precision": "float16", "grad_scaler": {"scale": 4.0}})
    assert hook.state_dict()["grad_scaler"] is None


def test_fp16_overflow_skips_the_step_and_keeps_weights():
    model = S.ForceMLP()
    hook = MixedPrecisionHook("fp16")
    strategy = S.make_strategy(model, hooks=[hook], num_steps=1, max_consecutive_skips=None)
    batches = S.make_batches(2)
    strategy.run(batches[:1])
    steps, seen = strategy.step_count, strategy.batch_count
    weights = S.params_of(model)
    hook.grad_scaler.update(2.0**60)  # fp16 gradients overflow at this scale
    strategy.num_steps = 2
    strategy.train_batch(batches[1])
    strategy.close()
    assert (strategy.step_count, strategy.batch_count) == (steps, seen + 1)
    assert all(torch.equal(a, b) for a, b in zip(weights, S.params_of(model)))
    assert hook.grad_scaler.get_scale() == 2.0**59  # backed off once


# ----------------------------------------------------------------------------- training
def _painn_or_none():
    try:
        from nvalchemi.models.painn import PaiNN
    except Exception:
        return None
    return PaiNN


def test_bf16_training_decreases_the_loss_on_cpu():
    torch.manual_seed(0)
    batches = S.make_batches(4, size=4, atoms=4)
    model = S.ForceMLP(hidden=32)
    strategy = S.make_strategy(
        model,
        hooks=[MixedPrecisionHook("bf16")],
        optimizer_configs=S.adam(2e-2),
        loss_fn=EnergyMSELoss(),
        num_steps=16,
    )
    losses: list[float] = []
    strategy.register_hook(
        S.StageHook(
            TrainingStage.AFTER_BATCH, lambda ctx: losses.append(float(ctx.losses["total_loss"]))
        )
    )
    strategy.run(batches)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.7 * first


def test_bf16_training_of_painn_decreases_the_loss():
    PaiNN = _painn_or_none()
    if PaiNN is None:
        pytest.skip("nvalchemi.models.painn is not available")
    pytest.importorskip("vesin")
    torch.manual_seed(0)
    structures = S.make_structures(8, atoms=4, seed=3)
    model = PaiNN(
        cutoff=4.0, hidden_channels=8, num_interactions=1, num_rbf=4, elements=[1, 2, 3, 4]
    )
    batches = [Batch.from_data_list(structures[i : i + 4]) for i in (0, 4)]
    hooks = [
        MixedPrecisionHook("bf16"),
        *model.make_neighbor_hooks(stage=TrainingStage.BEFORE_FORWARD),
    ]
    strategy = S.make_strategy(model, hooks=hooks, optimizer_configs=S.adam(1e-2), num_steps=16)
    losses: list[float] = []
    strategy.register_hook(
        S.StageHook(
            TrainingStage.AFTER_BATCH, lambda ctx: losses.append(float(ctx.losses["total_loss"]))
        )
    )
    strategy.run(batches)
    assert sum(losses[-2:]) < 0.9 * sum(losses[:2])
