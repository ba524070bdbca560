"""ValidationConfig, ValidationLoop: metrics, modes and gradients, hooks, errors, distributed parity."""

from __future__ import annotations

import math
from pathlib import Path

import _validation_ranks
import pytest
import torch
from _ranks import run_ranks
from _training_support import StageHook, TinyModel, make_batches, strategy
from pydantic import ValidationError
from torch import nn

from nvalchemi.data import AtomicData, Batch
from nvalchemi.training import (
    EnergyMSELoss,
    ForceMSELoss,
    TrainingStage,
    ValidationConfig,
    ValidationLoop,
    default_training_fn,
)
from nvalchemi.training import _validation as documented_path

S = TrainingStage
NAN = float("nan")
LEVELS = {"pe": "system", "pf": "atom", "ps": "system"}


# ----------------------------------------------------------------------------- config
def test_config_defaults_and_documented_import_path():
    config = ValidationConfig(validation_data=[])
    assert (config.grad_mode, config.set_eval, config.use_ema, config.name) == (
        "auto",
        True,
        "auto",
        "validation",
    )
    assert documented_path.ValidationLoop is ValidationLoop
    wrapped = ValidationConfig(validation_data=[], loss_fn=EnergyMSELoss())
    assert type(wrapped.loss_fn).__name__ == "ComposedLossFunction"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"validation_data": (b for b in [])}, "re-iterable"),
        ({"validation_data": iter([])}, "re-iterable"),
        ({"validation_data": 3}, "iterable"),
        ({"validation_data": [], "every_n_epochs": 1, "every_n_steps": 1}, "Only one of"),
        ({"validation_data": [], "every_n_steps": 0}, "greater than or equal to 1"),
        ({"validation_data": [], "name": ""}, "at least 1 character"),
        ({"validation_data": [], "bogus": 1}, "Extra inputs are not permitted"),
        ({"validation_data": [], "grad_mode": "sometimes"}, "grad_mode"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        ValidationConfig(**kwargs)


# ----------------------------------------------------------------------------- metrics
class Echo(nn.Module):
    """Returns the predictions stored on the batch (``pe``, ``pf``, ``ps``) times w = 1."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, batch):
        out = {"energy": batch.pe * self.w, "forces": batch.pf * self.w}
        if "ps" in batch:
            out["stress"] = batch.ps * self.w
        return out


def _structure(atoms, energy, pred_energy, forces, pred_forces, stress=None, pred_stress=None):
    fields = {
        "atomic_numbers": torch.ones(atoms, dtype=torch.long),
        "positions": torch.zeros(atoms, 3),
        "pe": torch.tensor([[pred_energy]]),
        "pf": pred_forces,
    }
    if energy is not None:
        fields["energy"] = torch.tensor([[energy]])
    if forces is not None:
        fields["forces"] = forces
    if stress is not None:
        fields.update(stress=stress, ps=pred_stress)
    return AtomicData(**fields, field_levels=LEVELS)


def _hand_batches():
    zero_stress, pred_stress = torch.zeros(1, 3, 3), torch.full((1, 3, 3), 0.3)
    pf_a, pf_b = torch.full((2, 3), 0.1), torch.full((3, 3), 0.2)
    a = Batch.from_data_list(
        [
            _structure(2, 1.0, 1.5, torch.zeros(2, 3), pf_a, zero_stress, pred_stress),
            _structure(2, 2.0, 1.0, torch.zeros(2, 3), pf_a, zero_stress, pred_stress),
        ]
    )
    # structure 0 has no energy label, structure 1 no force labels: both become NaN (missing)
    b = Batch.from_data_list(
        [_structure(3, None, 7.0, torch.zeros(3, 3), pf_b), _structure(3, 3.0, 3.0, None, pf_b)]
    )
    assert torch.isnan(b.energy[0]).all() and torch.isnan(b.forces[3:]).all()
    return [a, b]


def test_metrics_match_a_hand_computed_case():
    batches = _hand_batches()
    config = ValidationConfig(validation_data=batches)
    s = strategy(Echo(), loss_fn=EnergyMSELoss() + ForceMSELoss(), validation_config=config)
    summary = s.validate()
    assert summary["energy_mae"] == pytest.approx(1.5 / 3)
    assert summary["energy_rmse"] == pytest.approx(math.sqrt(1.25 / 3))
    assert summary["energy_per_atom_mae"] == pytest.approx(0.75 / 3)
    assert summary["energy_per_atom_rmse"] == pytest.approx(math.sqrt(0.3125 / 3))
    assert summary["forces_mae"] == pytest.approx((12 * 0.1 + 9 * 0.2) / 21)
    assert summary["forces_rmse"] == pytest.approx(math.sqrt((12 * 0.01 + 9 * 0.04) / 21))
    assert summary["stress_mae"] == pytest.approx(0.3)
    assert summary["stress_rmse"] == pytest.approx(0.3)
    assert summary["num_batches"] == 2 and summary["num_structures"] == 4
    per_batch = []
    for batch in batches:  # reference values from the loss itself
        predictions = default_training_fn(Echo(), batch)
        targets = {"energy": batch.energy, "forces": batch.forces}
        with torch.no_grad():
            out = s.loss_fn(
                predictions,
                targets,
                batch_idx=batch.batch_idx,
                num_graphs=batch.num_graphs,
                num_nodes_per_graph=batch.num_nodes_per_graph,
                missing_labels=batch.missing_labels,
            )
        per_batch.append(out)
    expected_total = sum(float(o["total_loss"]) for o in per_batch) / 2
    assert float(summary["total_loss"]) == pytest.approx(expected_total)
    assert summary["total_loss"].dtype == torch.float64
    assert float(summary["per_component_unweighted"]["ForceMSELoss"]) == pytest.approx(
        sum(float(o["per_component_unweighted"]["ForceMSELoss"]) for o in per_batch) / 2
    )
    assert summary["per_component_weight"] == {"EnergyMSELoss": 0.5, "ForceMSELoss": 0.5}
    # structures without the component's label are not counted (one each in batch b)
    assert summary["per_component_sample_count"] == {"EnergyMSELoss": 3, "ForceMSELoss": 3}
    assert float(summary["per_component_sample"]["EnergyMSELoss"]) == pytest.approx(
        0.5 * (0.25 + 1.0 + 0.0) / 3
    )
    assert float(summary["per_component_sample"]["ForceMSELoss"]) == pytest.approx(
        0.5 * (0.01 + 0.01 + 0.04) / 3
    )
    assert (summary["model_source"], summary["precision"], summary["distributed_reduced"]) == (
        "live",
        "float32",
        False,
    )
    assert s.last_validation is summary


def test_missing_predictions_give_no_metric():
    class EnergyOnly(Echo):
        def forward(self, batch):
            return {"energy": batch.pe * self.w}

    config = ValidationConfig(validation_data=_hand_batches()[:1])
    summary = strategy(EnergyOnly(), loss_fn=EnergyMSELoss(), validation_config=config).validate()
    assert "energy_mae" in summary and "forces_mae" not in summary and "stress_mae" not in summary


# ----------------------------------------------------------------------------- modes, grads, hooks
class WithNorm(TinyModel):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4)


@pytest.mark.parametrize(
    "loss, grad_expected", [(EnergyMSELoss(), False), (EnergyMSELoss() + ForceMSELoss(), True)]
)
def test_grads_enabled_only_when_needed_and_state_restored(loss, grad_expected):
    model = WithNorm()
    model.train()
    model.norm.eval()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    grads = [p.grad for p in model.parameters()]
    seen = []

    def record(ctx):
        seen.append((torch.is_grad_enabled(), ctx.model.training, ctx.predictions is not None))

    config = ValidationConfig(validation_data=make_batches(2))
    s = strategy(
        model, loss_fn=loss, validation_config=config, hooks=[StageHook(S.AFTER_FORWARD, record)]
    )
    s.validate()
    assert seen == [(grad_expected, False, True)] * 2
    assert model.training and not model.norm.training and model.mlp.training
    assert all(p.grad is g and bool((g == 7).all()) for p, g in zip(model.parameters(), grads))


def test_forward_hooks_run_around_each_validation_batch_and_after_validation_sees_summary():
    before, after = StageHook(S.BEFORE_FORWARD), StageHook(S.AFTER_FORWARD)
    summaries = []
    final = StageHook(S.AFTER_VALIDATION, lambda ctx: summaries.append(ctx.validation))
    config = ValidationConfig(validation_data=make_batches(3))
    s = strategy(validation_config=config, hooks=[before, after, final])
    summary = s.validate()
    assert len(before.calls) == 3 and len(after.calls) == 3
    assert summaries == [summary] and "total_loss" in summary


def test_modes_are_restored_when_validation_fails():
    model = TinyModel().train()

    def boom(model, batch):
        raise RuntimeError("validation forward failed")

    config = ValidationConfig(validation_data=make_batches(1), validation_fn=boom)
    s = strategy(model, validation_config=config)
    with pytest.raises(RuntimeError, match="validation forward failed") as info:
        s.validate()
    assert model.training
    assert "validation 'validation'" in " ".join(info.value.__notes__)


def test_batch_callback_receives_each_batch():
    calls = []

    def callback(*, batch, predictions, loss, batch_count, step_count, epoch):
        calls.append(
            (
                batch_count,
                step_count,
                epoch,
                "total_loss" in loss,
                "predicted_energy" in predictions,
            )
        )

    config = ValidationConfig(validation_data=make_batches(2), batch_callback=callback)
    strategy(validation_config=config, step_count=4, epoch_count=1).validate()
    assert calls == [(0, 4, 1, True, True), (1, 4, 1, True, True)]


def test_inference_model_slot_is_used_per_use_ema():
    ema = TinyModel()
    config = ValidationConfig(validation_data=make_batches(1))
    s = strategy(validation_config=config)
    assert s.validate()["model_source"] == "live"
    s.set_inference_model(ema)
    summary = s.validate()
    assert summary["model_source"] == "ema" and summary["ema_model_keys"] == ["main"]
    never = ValidationConfig(validation_data=make_batches(1), use_ema="never")
    assert s.validate(never)["model_source"] == "live"
    always = ValidationConfig(validation_data=make_batches(1), use_ema="always")
    with pytest.raises(RuntimeError, match="inference_model slot"):
        strategy(validation_config=always).validate()


def test_mixed_precision_always_needs_a_precision_hook():
    config = ValidationConfig(validation_data=make_batches(1), use_mixed_precision="always")
    with pytest.raises(RuntimeError, match="MixedPrecisionHook"):
        strategy(validation_config=config).validate()


def test_empty_validation_data_is_an_error():
    with pytest.raises(ValueError, match="validation_data produced no batches"):
        strategy(validation_config=ValidationConfig(validation_data=[])).validate()


# ----------------------------------------------------------------------------- standalone loop
def test_standalone_loop_rules():
    config = ValidationConfig(validation_data=[])
    base = {"validation_data": make_batches(2), "config": config, "device": "cpu"}
    with pytest.raises(ValueError, match="Exactly one of 'model' or 'models'"):
        ValidationLoop(**base, loss_fn=EnergyMSELoss(), validation_fn=default_training_fn)
    with pytest.raises(ValueError, match="validation_fn is required"):
        ValidationLoop(**base, model=TinyModel(), loss_fn=EnergyMSELoss())
    with pytest.raises(ValueError, match="loss_fn must be provided"):
        ValidationLoop(**base, model=TinyModel(), validation_fn=default_training_fn)
    loop = ValidationLoop(
        **base, model=TinyModel(), loss_fn=EnergyMSELoss(), validation_fn=default_training_fn
    )
    with pytest.raises(RuntimeError, match="inside a 'with' block"):
        loop.execute()
    with loop:
        summary = loop.execute()
    assert summary["num_batches"] == 2 and not loop.grad_enabled
    named = ValidationLoop(
        **base,
        models={"main": TinyModel()},
        loss_fn=EnergyMSELoss(),
        validation_fn=default_training_fn,
        autocast=lambda: torch.autocast("cpu", enabled=False),
    )
    with named:
        assert named.execute()["precision"] == "mixed"


# ----------------------------------------------------------------------------- distributed parity
@pytest.mark.distributed
def test_distributed_metrics_equal_single_process_with_uneven_and_empty_shards():
    outputs = run_ranks(Path(__file__).with_name("_validation_ranks.py"))
    reference = _validation_ranks.floats(_validation_ranks.single_process_summary())["values"]
    for result in outputs:
        for scenario in ("uneven", "empty_rank"):
            got = result[scenario]
            assert got["distributed_reduced"] is True
            assert set(got["values"]) == set(reference)
            for key, value in reference.items():
                assert got["values"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert outputs[0] == outputs[1]
