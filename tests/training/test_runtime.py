"""Runtime helpers: device placement, freezing, train modes, dataloaders, parallelism."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nvalchemi.data import AtomicData, Batch
from nvalchemi.training import (
    configure_dataloader,
    configure_parallelism,
    freeze_unconfigured_models,
    move_to_devices,
)
from nvalchemi.training.runtime import (
    evaluating,
    rehome_optimizer_state,
    train_configured_models,
    unwrap_model,
)


def test_move_to_devices_keeps_the_shape_and_checks_lengths():
    single = nn.Linear(2, 2)
    assert move_to_devices(single, ["cpu"]) is single
    named = {"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)}
    assert move_to_devices(named, [torch.device("cpu")]) is named
    assert move_to_devices(named, ["cpu", "cpu"]) is named
    with pytest.raises(ValueError, match="length 1 or len"):
        move_to_devices(named, ["cpu"] * 3)
    with pytest.raises(ValueError, match="exactly one device"):
        move_to_devices(single, ["cpu", "cpu"])


def test_freeze_restores_modes_and_flags_even_after_errors():
    teacher = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    teacher[1].eval()
    teacher[0].bias.requires_grad_(False)
    student = nn.Linear(2, 2)
    models = {"student": student, "teacher": teacher}
    with pytest.raises(RuntimeError), freeze_unconfigured_models(models, {"student": []}):
        assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
        assert student.weight.requires_grad
        raise RuntimeError("inside")
    assert teacher.training and not teacher[1].training
    assert teacher[0].weight.requires_grad and not teacher[0].bias.requires_grad


def test_evaluating_restores_every_modules_mode_and_the_active_outputs_even_after_errors():
    from nvalchemi.models.demo import DemoModel, DemoModelWrapper

    model = DemoModelWrapper(DemoModel())
    model.train()
    frozen = next(m for m in model.modules() if m is not model)
    frozen.eval()  # a submodule kept in eval mode on purpose (e.g. a frozen norm layer)
    before = model.model_config.active_outputs
    with pytest.raises(RuntimeError), evaluating(model, {"energy"}):
        assert not any(m.training for m in model.modules())
        assert set(model.model_config.active_outputs) == {"energy"}
        raise RuntimeError("inside")
    assert model.training and not frozen.training
    assert model.model_config.active_outputs == before
    plain = nn.Linear(2, 2)  # no model_config: only the mode
    with evaluating(plain, {"energy"}):
        assert not plain.training
    assert plain.training


def test_train_configured_models_restores_previous_modes():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout()).eval()
    with train_configured_models({"main": model}, {"main": []}):
        assert model.training and model[1].training
    assert not model.training and not model[1].training


def test_configure_dataloader_collates_batches_and_rejects_shuffle_with_sampler():
    data = [
        AtomicData(atomic_numbers=torch.tensor([1, 1]), positions=torch.zeros(2, 3))
        for _ in range(4)
    ]
    loader = configure_dataloader(data, batch_size=2)
    batch = next(iter(loader))
    assert isinstance(batch, Batch) and batch.num_graphs == 2 and len(loader) == 2
    sampler = torch.utils.data.SequentialSampler(data)
    with pytest.raises(ValueError, match="shuffle=True is incompatible with sampler"):
        configure_dataloader(data, batch_size=2, shuffle=True, sampler=sampler)
    assert len(configure_dataloader(data, batch_size=2, sampler=sampler)) == 2


def test_configure_dataloader_default_collate_falls_back_for_other_items():
    pairs = [(torch.tensor([float(i)]), i) for i in range(4)]
    features, labels = next(iter(configure_dataloader(pairs, batch_size=2, shuffle=False)))
    assert features.tolist() == [[0.0], [1.0]] and labels.tolist() == [0, 1]
    dicts = [{"x": torch.ones(2) * i} for i in range(3)]
    batch = next(iter(configure_dataloader(dicts, batch_size=3, shuffle=False, collate_fn=None)))
    assert batch["x"].shape == (3, 2)


def test_configure_parallelism_is_a_no_op_in_one_process():
    models = {"main": nn.Linear(2, 2)}
    assert configure_parallelism(models) is models
    assert configure_parallelism(models, strategy="ddp") is models
    with pytest.raises(ValueError, match="Unsupported parallelism strategy"):
        configure_parallelism(models, strategy="fsdp")


def test_unwrap_and_rehome_helpers():
    inner = nn.Linear(2, 2)
    assert unwrap_model(nn.DataParallel(inner)) is inner
    optimizer = torch.optim.Adam(inner.parameters())
    inner(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    rehome_optimizer_state(optimizer)  # all on the CPU already: a no-op that must not fail
    state = optimizer.state[inner.weight]
    assert state["exp_avg"].device == inner.weight.device
