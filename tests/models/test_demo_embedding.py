"""DemoModel's species table is named ``embedding``; weights saved under its old name load."""

from __future__ import annotations

import re

import torch

from nvalchemi.data import AtomicData, Batch
from nvalchemi.models import DemoModel, DemoModelWrapper


def _wrapper(seed: int) -> DemoModelWrapper:
    torch.manual_seed(seed)
    return DemoModelWrapper(DemoModel(num_atom_types=10, hidden_dim=8))


def _batch() -> Batch:
    torch.manual_seed(0)
    a = AtomicData(atomic_numbers=torch.tensor([1, 8]), positions=torch.randn(2, 3))
    b = AtomicData(atomic_numbers=torch.tensor([6, 1, 1]), positions=torch.randn(3, 3))
    return Batch.from_data_list([a, b])


def _as_before_the_rename(state: dict) -> dict:
    """``state`` with the species table under its former name, as older files hold it."""
    return {re.sub(r"(^|\.)embedding\.", r"\1species_embedding.", k): v for k, v in state.items()}


def test_the_species_table_is_named_embedding():
    model = DemoModel(num_atom_types=10, hidden_dim=8)
    assert isinstance(model.embedding, torch.nn.Embedding)
    assert model.embedding.weight.shape == (10, 8)
    assert "embedding.weight" in model.state_dict()
    assert not any(k.startswith("species_embedding") for k in model.state_dict())


def test_weights_saved_under_the_old_name_load_into_the_model_and_the_wrapper():
    source, target = _wrapper(0), _wrapper(1)
    old = _as_before_the_rename(source.model.state_dict())
    assert "species_embedding.weight" in old and "embedding.weight" not in old
    target.model.load_state_dict(old)  # strict: every key found
    torch.testing.assert_close(target.model.embedding.weight, source.model.embedding.weight)
    wrapped = _as_before_the_rename(source.state_dict())
    assert "model.species_embedding.weight" in wrapped
    fresh = _wrapper(2)
    fresh.load_state_dict(wrapped)
    batch = _batch()
    torch.testing.assert_close(fresh(batch)["energy"], source(batch)["energy"])


def test_an_old_training_checkpoint_of_a_demo_model_loads(tmp_path):
    from nvalchemi.training import save_checkpoint
    from nvalchemi.training.checkpoint import load_model_from_checkpoint

    source = _wrapper(0)
    save_checkpoint(tmp_path / "ckpt", models={"main": source})
    [weights] = (tmp_path / "ckpt").rglob("models/main/weights.pt")
    state = torch.load(weights, weights_only=True)
    torch.save(_as_before_the_rename(state), weights)
    loaded = load_model_from_checkpoint(tmp_path / "ckpt", map_location="cpu")
    batch = _batch()
    torch.testing.assert_close(loaded(batch)["energy"], source.eval()(batch)["energy"])
