"""HookContext, TrainContext and DynamicsContext: fields, defaults and in-place use."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nvalchemi.hooks.context import DynamicsContext, HookContext, TrainContext


def test_batch_is_required_and_keyword_only():
    with pytest.raises(TypeError):
        HookContext()
    with pytest.raises(TypeError):
        HookContext(None)
    ctx = HookContext(batch=None)
    assert (ctx.batch, ctx.model, ctx.global_rank, ctx.workflow) == (None, None, 0, None)


def test_train_context_defaults_follow_the_spec():
    ctx = TrainContext(batch=None)
    assert isinstance(ctx, HookContext)
    assert (
        ctx.step_count,
        ctx.global_step_count,
        ctx.batch_count,
        ctx.epoch_step_count,
        ctx.epoch,
    ) == (0, 0, 0, 0, 0)
    for name in (
        "loss",
        "losses",
        "models",
        "gradients",
        "grad_scaler",
        "validation",
        "predictions",
        "grad_norm",
    ):
        assert getattr(ctx, name) is None, name
    assert ctx.optimizers == [] and ctx.lr_schedulers == []


def test_default_lists_are_independent_per_instance():
    first, second = TrainContext(batch=None), TrainContext(batch=None)
    first.optimizers.append("opt")
    first.lr_schedulers.append(None)
    assert second.optimizers == [] and second.lr_schedulers == []


def test_predictions_and_grad_norm_are_fields_hooks_can_read():
    preds = {"predicted_energy": torch.zeros(2, 1)}
    ctx = TrainContext(batch=None, predictions=preds, grad_norm=torch.tensor(3.0))
    assert ctx.predictions is preds
    assert float(ctx.grad_norm) == 3.0
    names = {f.name for f in dataclasses.fields(TrainContext)}
    assert {"predictions", "grad_norm"} <= names


def test_context_is_updated_in_place_and_unknown_attributes_are_rejected():
    ctx = TrainContext(batch=None)
    ctx.step_count += 1
    ctx.loss = torch.tensor(1.0)
    assert ctx.step_count == 1
    with pytest.raises(AttributeError):
        ctx.stepcount = 2  # typo must not silently create an attribute
    assert not hasattr(ctx, "__dict__")


def test_clear_step_outputs_forgets_per_batch_tensors_only():
    models = {"main": torch.nn.Linear(1, 1)}
    ctx = TrainContext(
        batch=None,
        models=models,
        step_count=4,
        loss=torch.tensor(1.0),
        losses={"total_loss": torch.tensor(1.0)},
        predictions={"predicted_energy": torch.zeros(1)},
        grad_norm=torch.tensor(2.0),
        gradients={"w": torch.zeros(1)},
    )
    ctx.clear_step_outputs()
    assert (ctx.loss, ctx.losses, ctx.predictions, ctx.grad_norm, ctx.gradients) == (None,) * 5
    assert ctx.models is models and ctx.step_count == 4


def test_contexts_compare_by_identity_even_with_tensors():
    a = TrainContext(batch=None, loss=torch.tensor([1.0, 2.0]))
    b = TrainContext(batch=None, loss=torch.tensor([1.0, 2.0]))
    assert a == a
    assert a != b  # no elementwise tensor comparison


def test_repr_omits_the_engine_back_reference():
    class Engine:
        def __repr__(self):
            raise AssertionError("repr must not recurse into the engine")

    text = repr(TrainContext(batch=None, workflow=Engine(), step_count=7))
    assert "step_count=7" in text and "workflow" not in text


def test_dynamics_context_fields():
    ctx = DynamicsContext(batch=None, step_count=3)
    assert isinstance(ctx, HookContext)
    assert ctx.step_count == 3 and ctx.converged_mask is None


def test_replace_copies_a_context():
    ctx = TrainContext(batch=None, step_count=2)
    copy = dataclasses.replace(ctx, step_count=3)
    assert copy.step_count == 3 and ctx.step_count == 2
