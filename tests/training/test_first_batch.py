"""What ``run`` is given is checked once, before the first forward: loader, batch type, dtype."""

from __future__ import annotations

import re

import pytest
import torch
from _training_support import TinyModel, make_batch, make_batches, strategy

from nvalchemi.data import AtomicData, Batch
from nvalchemi.models.demo import DemoModel, DemoModelWrapper


def _structures(n=4):
    return [
        AtomicData(
            atomic_numbers=torch.tensor([1, 2]),
            positions=torch.randn(2, 3),
            energy=torch.tensor(1.0),
            forces=torch.zeros(2, 3),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("given", [42, None, "data.extxyz", 3.5])
def test_run_with_something_that_is_not_a_loader_names_it_and_the_fix(given):
    with pytest.raises(
        TypeError,
        match=rf"run\(dataloader\): got {type(given).__name__} .*"
        r"collate_fn=Batch\.from_data_list",
    ):
        strategy(num_steps=2).run(given)


def test_run_with_one_batch_says_to_use_train_batch():
    with pytest.raises(TypeError, match=r"got one Batch, not a dataloader.*train_batch"):
        strategy(num_steps=2).run(make_batch())


def test_a_loader_of_atomic_data_names_the_loader_what_it_yielded_and_the_fix():
    plain = torch.utils.data.DataLoader(_structures(), batch_size=None)  # single items
    with pytest.raises(
        TypeError,
        match=r"dataloader DataLoader\(collate_fn=.*\) yielded one "
        r"AtomicData instead of a Batch.*collate_fn=Batch\.from_data_list",
    ):
        strategy(num_steps=2).run(plain)
    listing = torch.utils.data.DataLoader(_structures(), batch_size=2, collate_fn=list)
    with pytest.raises(TypeError, match=r"yielded a list of 2 AtomicData"):
        strategy(num_steps=2).run(listing)
    default = torch.utils.data.DataLoader(_structures(), batch_size=2)  # torch's default_collate
    with pytest.raises(
        TypeError,
        match=r"DataLoader\(collate_fn=default_collate\) cannot "
        r"collate AtomicData .*collate_fn=Batch\.from_data_list",
    ):
        strategy(num_steps=2).run(default)
    with pytest.raises(TypeError, match="yielded one AtomicData"):
        strategy(num_steps=2).train_batch(_structures(1)[0])


def test_a_float64_batch_for_a_float32_model_says_which_to_change():
    batches = [b.to(dtype=torch.float64) for b in make_batches(2)]
    model = TinyModel()
    with pytest.raises(
        TypeError,
        match=r"float64 positions but model 'main' \(TinyModel\) has "
        r"float32 parameters.*dtype=torch\.float32 of the reader.*model\.double\(\)",
    ):
        strategy(model, num_steps=2).run(batches)
    assert all(p.grad is None for p in model.parameters())  # nothing ran
    trained = strategy(TinyModel().double(), num_steps=2)
    trained.run(batches)  # matching dtypes train
    assert trained.step_count == 2


def test_nvalchemi_models_cast_their_inputs_and_are_not_refused():
    from nvalchemi.training._first_batch import check_first_batch

    batch = make_batch().to(dtype=torch.float64)
    model = DemoModelWrapper(DemoModel(hidden_dim=8))  # float32; BaseModelMixin casts inputs
    check_first_batch(batch, {"main": model}, default_training_fn=True)
    with pytest.raises(TypeError, match="float64 positions"):
        check_first_batch(batch, {"main": TinyModel()}, default_training_fn=True)
    check_first_batch(batch, {"main": TinyModel()}, default_training_fn=False)  # a custom one


def _own_training_fn(model, batch):  # nothing is checked before a custom one runs
    return {f"predicted_{k}": v for k, v in model(batch).items()}


@pytest.mark.parametrize(
    ("model", "where"),
    [
        (TinyModel(), r"the forward pass \(training_fn\) failed: .*same dtype"),
        (DemoModelWrapper(DemoModel(hidden_dim=8)), "the loss computation failed: .*mismatch"),
    ],
    ids=["plain module, own training_fn", "nvalchemi model"],
)
def test_a_float64_data_set_into_a_float32_model_fails_at_the_first_batch_naming_both(model, where):
    batches = [b.to(dtype=torch.float64) for b in make_batches(2)]
    trainer = strategy(model, num_steps=2, training_fn=_own_training_fn)
    with pytest.raises(TypeError, match=r"float64 positions but model 'main'") as caught:
        trainer.run(batches)
    text = str(caught.value)
    assert "has float32 parameters" in text and re.search(where, text)
    assert "Fix: read the data as float32" in text and "model.double()" in text
    assert trainer.step_count == 0


def test_a_loader_of_batches_passes_unchanged():
    loader = torch.utils.data.DataLoader(
        _structures(), batch_size=2, collate_fn=Batch.from_data_list
    )
    s = strategy(num_steps=2)
    s.run(loader)
    assert s.step_count == 2
