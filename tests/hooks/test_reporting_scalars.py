"""Scalar collection (keys, coercion, one sync per event), throughput, progress and rank reduction."""

from __future__ import annotations

import json
import textwrap
from types import SimpleNamespace

import _reporting_support as support
import numpy as np
import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks

from nvalchemi.hooks.context import TrainContext
from nvalchemi.hooks.reporting import (
    ReportingState,
    collect_scalars,
    extract_loss_scalars,
    extract_optimizer_lr_scalars,
    extract_scalars,
    extract_validation_scalars,
)
from nvalchemi.hooks.reporting.reduce import normalize_rank_reduction, reduce_scalar_snapshot
from nvalchemi.hooks.reporting.scalars import training_plan
from nvalchemi.hooks.reporting.state import RateMeter
from nvalchemi.training.stages import TrainingStage

STEP = TrainingStage.AFTER_OPTIMIZER_STEP


# --------------------------------------------------------------------------- losses
def test_plain_loss_becomes_loss_total():
    assert extract_loss_scalars(TrainContext(batch=None, loss=torch.tensor(0.25))) == {
        "loss/total": 0.25
    }


def test_composed_loss_keys_use_component_class_names():
    ctx = support.make_ctx(energy=0.5, forces=0.25)
    ctx.loss = torch.tensor(99.0)  # the composed total_loss wins
    scalars = extract_loss_scalars(ctx)
    assert scalars == pytest.approx(
        {
            "loss/total": 0.5 + 10 * 0.25,
            "loss/EnergyMSELoss/unweighted": 0.5,
            "loss/ForceMSELoss/unweighted": 0.25,
            "loss/EnergyMSELoss/weight": 1.0,
            "loss/ForceMSELoss/weight": 10.0,
            "loss/EnergyMSELoss/raw_weight": 1.0,
            "loss/ForceMSELoss/raw_weight": 10.0,
            "loss/EnergyMSELoss/sample_mean": 0.5,
            "loss/ForceMSELoss/sample_mean": 0.25,
        }
    )


def test_sample_means_skip_structures_without_the_label():
    # losses mark structures without a label NaN in per_component_sample
    ctx = TrainContext(
        batch=None,
        losses={
            "total_loss": torch.tensor(1.0),
            "per_component_sample": {"StressMSELoss": torch.tensor([1.0, float("nan"), 3.0])},
        },
    )
    assert extract_loss_scalars(ctx)["loss/StressMSELoss/sample_mean"] == pytest.approx(2.0)


def test_other_loss_entries_are_flattened():
    ctx = TrainContext(
        batch=None, losses={"aux": {"a": 1.0, "b": {"c": torch.tensor(2.0)}}, "x": 3}
    )
    assert extract_loss_scalars(ctx) == {"loss/aux/a": 1.0, "loss/aux/b/c": 2.0, "loss/x": 3.0}


def test_bad_values_raise_clear_errors():
    with pytest.raises(TypeError, match="mapping"):
        extract_loss_scalars(SimpleNamespace(loss=None, losses=[1.0]))
    with pytest.raises(ValueError, match=r"'loss/total'.*shape \(3,\)"):
        extract_loss_scalars(TrainContext(batch=None, loss=torch.ones(3)))
    with pytest.raises(TypeError, match="'x'"):
        extract_scalars({"x": "high"})
    with pytest.raises(TypeError, match="keys must be strings"):
        extract_scalars({1: 2.0})


def test_extract_scalars_coerces_numbers_bools_numpy_and_tensors():
    out = extract_scalars(
        {"a": True, "b": np.float32(1.5), "c": np.array([2.0]), "d": torch.tensor([[3]]), "e": None}
    )
    assert out == {"a": 1.0, "b": 1.5, "c": 2.0, "d": 3.0}


def test_one_device_transfer_per_event(monkeypatch):
    ctx = support.make_ctx()
    ctx.grad_norm = torch.tensor(1.0)
    calls = []
    original = torch.Tensor.tolist

    def counting_tolist(self):
        calls.append(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    snapshot = collect_scalars(ctx, STEP)
    assert len(snapshot.scalars) > 10
    assert len(calls) == 1  # all tensors of the event converted together


# --------------------------------------------------------------------------- learning rates
def _optimizer(groups=1, lr=0.1):
    params = [
        {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr * (g + 1)} for g in range(groups)
    ]
    return torch.optim.SGD(params, lr=lr)


def test_learning_rate_key_scheme():
    one = SimpleNamespace(optimizers=[_optimizer()], lr_schedulers=[])
    assert extract_optimizer_lr_scalars(one) == {"optimizer/lr": 0.1}
    groups = SimpleNamespace(optimizers=[_optimizer(groups=2)], lr_schedulers=[])
    assert extract_optimizer_lr_scalars(groups) == pytest.approx(
        {"optimizer/group_0/lr": 0.1, "optimizer/group_1/lr": 0.2}
    )
    first, second = _optimizer(), _optimizer(groups=2)
    scheduler = torch.optim.lr_scheduler.StepLR(second, step_size=1, gamma=0.5)
    many = SimpleNamespace(optimizers=[first, second], lr_schedulers=[None, scheduler])
    assert extract_optimizer_lr_scalars(many) == pytest.approx(
        {
            "optimizer/0/lr": 0.1,
            "optimizer/1/group_0/lr": 0.1,
            "optimizer/1/group_1/lr": 0.2,
            "scheduler/1/group_0/lr": 0.1,  # slot index of the scheduler is kept
            "scheduler/1/group_1/lr": 0.2,
        }
    )


def test_single_scheduler_key():
    optimizer = _optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step()
    scheduler.step()
    ctx = SimpleNamespace(optimizers=[optimizer], lr_schedulers=[scheduler])
    assert extract_optimizer_lr_scalars(ctx) == pytest.approx(
        {"optimizer/lr": 0.05, "scheduler/lr": 0.05}
    )


# --------------------------------------------------------------------------- snapshot
def test_snapshot_counters_and_completed_step():
    ctx = support.make_ctx(step=4)
    snapshot = collect_scalars(ctx, STEP)
    assert snapshot.stage == "AFTER_OPTIMIZER_STEP"
    assert (snapshot.step_count, snapshot.batch_count, snapshot.epoch) == (4, 4, 0)
    assert snapshot.step == 5  # the step just taken is counted
    support.advance(ctx)
    assert collect_scalars(ctx, TrainingStage.AFTER_BATCH).step == 5


def test_snapshot_as_dict_is_json_ready():
    state = ReportingState()
    state.add_message("warning", "careful")
    ctx = TrainContext(batch=None, loss=torch.tensor(float("nan")))
    state.mark_event(ctx, STEP)
    data = collect_scalars(ctx, STEP, state).as_dict()
    assert data["scalars"]["loss/total"] is None
    assert data["messages"][0]["message"] == "careful"
    json.dumps(data, allow_nan=False)


def test_custom_scalars_grad_norm_and_memory():
    ctx = support.make_ctx()
    ctx.grad_norm = torch.tensor(2.5)
    custom = {
        "atoms": lambda c, stage: c.batch.num_nodes,
        "nested": lambda c, stage: {"stage_is_step": stage is STEP, "skip": None},
        "nothing": lambda c, stage: None,
    }
    scalars = collect_scalars(ctx, STEP, custom_scalars=custom, include_memory=True).scalars
    assert scalars["atoms"] == 32.0 and scalars["nested/stage_is_step"] == 1.0
    assert "nothing" not in scalars and "nested/skip" not in scalars
    assert scalars["grad_norm"] == 2.5
    assert scalars["memory/rss_peak_mib"] > 1.0
    with pytest.raises(TypeError, match=r"custom_scalars\['bad'\]"):
        collect_scalars(ctx, STEP, custom_scalars={"bad": 3})


def test_validation_stage_reports_the_summary_not_the_last_batch():
    ctx = support.make_ctx()
    ctx.grad_norm = torch.tensor(1.0)
    ctx.validation = support.validation_summary(loss=0.4, forces_mae=0.05)
    scalars = collect_scalars(ctx, TrainingStage.AFTER_VALIDATION).scalars
    assert not any(k.startswith("loss/") for k in scalars) and "grad_norm" not in scalars
    assert scalars["validation/loss/total"] == pytest.approx(0.4)
    assert scalars["validation/loss/EnergyMSELoss/unweighted"] == pytest.approx(0.2)
    assert scalars["validation/forces_mae_eV_per_A"] == pytest.approx(0.05)  # unit in the key
    assert scalars["validation/num_batches"] == 3.0
    assert "validation/model_source" not in scalars
    assert "validation/distributed_reduced" not in scalars
    assert "optimizer/lr" in scalars  # the learning rate is still useful next to validation
    assert extract_validation_scalars(None) == {}


# --------------------------------------------------------------------------- throughput and progress
def test_rate_meter_measures_between_events_and_skips_pauses():
    meter = RateMeter(smoothing=1.0)
    meter.observe(10.0, batches=0, steps=0, structures_per_batch=4, atoms_per_batch=40)
    assert meter.steps_per_s is None  # one event: no window yet
    meter.observe(12.0, batches=10, steps=10, structures_per_batch=4, atoms_per_batch=40)
    assert meter.batches_per_s == pytest.approx(5.0)
    assert meter.structures_per_s == pytest.approx(20.0)
    assert meter.atoms_per_s == pytest.approx(200.0)
    meter.observe(100.0, batches=10, steps=10)  # a validation pass: no progress, window restarts
    meter.observe(101.0, batches=20, steps=20, structures_per_batch=4)
    assert meter.steps_per_s == pytest.approx(10.0)


def test_state_feeds_throughput_scalars(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("nvalchemi.hooks.reporting.state.time.monotonic", lambda: clock[0])
    state = ReportingState()
    ctx = support.make_ctx(step=0)
    state.mark_event(ctx, STEP)
    for _ in range(4):
        support.advance(ctx)
    clock[0] = 102.0
    state.mark_event(ctx, STEP)
    scalars = collect_scalars(ctx, STEP, state, include_throughput=True).scalars
    assert scalars["throughput/structures_per_s"] == pytest.approx(4 * 4 / 2.0)
    assert scalars["throughput/atoms_per_s"] == pytest.approx(4 * 32 / 2.0)


def test_progress_scalars_and_training_plan():
    ctx = support.make_ctx(step=5, batches_per_epoch=4, num_epochs=3)
    assert training_plan(ctx.workflow).target_steps == 12
    state = ReportingState()
    state.rates.steps_per_s = state.rates.batches_per_s = 2.0
    scalars = collect_scalars(ctx, STEP, state, include_progress=True).scalars
    assert scalars["training/target_steps"] == 12.0
    assert scalars["training/remaining_steps"] == 6.0  # 6 steps done after this one
    assert scalars["training/progress_fraction"] == pytest.approx(0.5)
    assert scalars["training/eta_s"] == pytest.approx(3.0)
    assert scalars["training/target_epochs"] == 3.0
    assert scalars["training/epoch_fraction"] == pytest.approx(0.5)
    ctx.workflow.num_steps = 100
    assert training_plan(ctx.workflow).target_steps == 100
    ctx.workflow.active_dataloader = iter(range(3))  # unsized
    assert training_plan(ctx.workflow).batches_per_epoch is None


# --------------------------------------------------------------------------- reduction
def test_normalize_rank_reduction():
    assert normalize_rank_reduction(None) == (None, False)
    assert normalize_rank_reduction("none") == (None, False)
    assert normalize_rank_reduction("Mean") == (dist.ReduceOp.SUM, True)
    assert normalize_rank_reduction("max") == (dist.ReduceOp.MAX, False)
    assert normalize_rank_reduction(dist.ReduceOp.MIN) == (dist.ReduceOp.MIN, False)
    with pytest.raises(ValueError, match="median"):
        normalize_rank_reduction("median")
    with pytest.raises(TypeError, match="rank_reduction"):
        normalize_rank_reduction(3)


def test_reduction_is_a_no_op_in_one_process():
    snapshot = collect_scalars(TrainContext(batch=None, loss=torch.tensor(1.0)), STEP)
    assert reduce_scalar_snapshot(snapshot, "mean") is snapshot


_WORKER = textwrap.dedent(
    """
    import io
    from datetime import timedelta
    import torch
    from _ranks import init_group, report, teardown
    from rich.console import Console
    from nvalchemi.hooks.context import TrainContext
    from nvalchemi.hooks.reporting import ReportingOrchestrator, RichReporter, TensorBoardReporter
    from nvalchemi.hooks.reporting.reduce import reduce_scalar_snapshot
    from nvalchemi.hooks.reporting.scalars import ScalarSnapshot

    rank = init_group(timeout=timedelta(seconds=30))

    def snap(scalars):
        return ScalarSnapshot(stage="AFTER_OPTIMIZER_STEP", scalars=scalars, timestamp_s=0.0,
                              elapsed_s=0.0, event_count=1, step_count=0, batch_count=0,
                              epoch_step_count=0, epoch=0, global_rank=rank, step=1)

    values = {"loss/total": float(rank + 1), "optimizer/lr": 0.1 * (rank + 1)}
    out = {}
    for name in ("mean", "sum", "min", "max"):
        out[name] = reduce_scalar_snapshot(snap(values), name).scalars
    try:
        reduce_scalar_snapshot(snap({f"only_on_{rank}": 1.0}), "mean")
        out["mismatch"] = "no error"
    except ValueError as exc:
        out["mismatch"] = str(exc)

    class Writer:
        def __init__(self):
            self.calls = []
        def add_scalar(self, tag, value, global_step=None):
            self.calls.append([tag, value, global_step])
        def flush(self):
            pass
        def close(self):
            pass

    writer = Writer()
    console = Console(file=io.StringIO(), width=200)
    rich = RichReporter(console=console, rank_reduction="mean", include_memory=False)
    tb = TensorBoardReporter("unused", writer=writer, rank_reduction="sum", include_memory=False)
    hook = ReportingOrchestrator([rich, tb], rank_zero_only=True)
    ctx = TrainContext(batch=None, loss=torch.tensor(float(rank + 1)), global_rank=rank)
    with hook:
        hook(ctx, "AFTER_OPTIMIZER_STEP")
    out["rich"] = console.file.getvalue()
    out["tb"] = writer.calls
    report(**out)
    teardown()
    """
)


@pytest.mark.distributed
def test_two_process_gloo_reduction():
    results = run_ranks(_WORKER, timeout=90)
    for result in results:
        assert result["mean"] == pytest.approx({"loss/total": 1.5, "optimizer/lr": 0.15})
        assert result["sum"] == pytest.approx({"loss/total": 3.0, "optimizer/lr": 0.3})
        assert result["min"] == pytest.approx({"loss/total": 1.0, "optimizer/lr": 0.1})
        assert result["max"] == pytest.approx({"loss/total": 2.0, "optimizer/lr": 0.2})
        assert "different keys" in result["mismatch"] and "only_on_1" in result["mismatch"]
    rank0, rank1 = results
    assert "loss 1.50e+00" in rank0["rich"]  # the mean of 1 and 2, drawn on rank 0 only
    assert rank1["rich"] == ""
    assert ["loss/total", 3.0, 1] in rank0["tb"] and rank1["tb"] == []
