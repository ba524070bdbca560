"""DemoModel / DemoModelWrapper: the small non-physical test model."""

from __future__ import annotations

import pytest
import torch

from nvalchemi._serialization import init_kwargs_from_attrs
from nvalchemi.data import AtomicData, Batch
from nvalchemi.models import DemoModel, DemoModelWrapper
from nvalchemi.models.testing import check_model


def _batch():
    torch.manual_seed(0)
    a = AtomicData(atomic_numbers=torch.tensor([1, 8]), positions=torch.randn(2, 3))
    b = AtomicData(atomic_numbers=torch.tensor([6, 1, 1]), positions=torch.randn(3, 3))
    return Batch.from_data_list([a, b])


def _wrapper(**kwargs):
    torch.manual_seed(0)
    return DemoModelWrapper(DemoModel(num_atom_types=10, hidden_dim=8, **kwargs))


def test_defaults_and_parameter_names():
    model = DemoModel()
    assert model.num_atom_types == 100 and model.hidden_dim == 64
    names = {name for name, _ in DemoModelWrapper(model).named_parameters()}
    assert {"model.projection.weight", "model.projection.bias"} <= names
    assert any(name.startswith("model.joint_mlp.") for name in names)


def test_config():
    cfg = _wrapper().model_config
    assert cfg.outputs == {"energy", "forces"}
    assert cfg.autograd_outputs == {"forces"}
    assert cfg.active_outputs == {"energy", "forces"}
    assert not cfg.supports_pbc and cfg.neighbor_config is None


def test_forward_shapes_on_a_batch_and_a_single_structure():
    model = _wrapper()
    batch = _batch()
    out = model(batch)
    assert out["energy"].shape == (2, 1) and out["forces"].shape == (5, 3)
    single = model(batch[1])
    torch.testing.assert_close(single["energy"], out["energy"][1:])
    torch.testing.assert_close(single["forces"], out["forces"][2:])


def test_energy_only_mode():
    model = _wrapper()
    model.set_config("active_outputs", {"energy"})
    out = model(_batch())
    assert list(out) == ["energy"]


def test_train_mode_force_loss_reaches_the_weights():
    model = _wrapper().train()
    out = model(_batch())
    assert out["forces"].requires_grad
    out["forces"].pow(2).sum().backward()
    assert model.model.coord_embedding[0].weight.grad.abs().sum() > 0


def test_passes_the_model_checks_that_apply_to_it(helpers):
    # Demo embeds raw coordinates: not translation or rotation invariant by design.
    structures = [helpers.cu_cluster(), helpers.cu_cluster()[:3]]
    model = DemoModelWrapper(DemoModel(num_atom_types=100, hidden_dim=8))
    report = check_model(model, structures, checks=("permutation", "forces_fd", "batch", "dtype"))
    assert set(report) == {"permutation", "forces_fd", "batch", "dtype"}


def test_embeddings():
    model = _wrapper()
    assert model.embedding_shapes == {"node_embeddings": (8,), "graph_embeddings": (8,)}
    batch = model.compute_embeddings(_batch())
    assert batch.node_embeddings.shape == (5, 8)
    assert batch.graph_embeddings.shape == (2, 8)
    assert batch.level_of("node_embeddings") == "atom"
    single = model.compute_embeddings(_batch()[0])
    assert single.graph_embeddings.shape == (1, 8)


def test_export_and_from_checkpoint_round_trip(tmp_path):
    model = _wrapper()
    model.export_model(tmp_path / "demo.pt")
    again = DemoModelWrapper.from_checkpoint(tmp_path / "demo.pt")
    batch = _batch()
    torch.testing.assert_close(again(batch)["energy"], model(batch)["energy"])
    model.export_model(tmp_path / "weights.pt", as_state_dict=True)
    assert "projection.weight" in torch.load(tmp_path / "weights.pt", weights_only=True)
    with pytest.raises(ValueError, match="export_model"):
        DemoModelWrapper.from_checkpoint(tmp_path / "weights.pt")


def test_constructor_arguments_are_recoverable_from_attributes():
    model = _wrapper()
    wrapper_kwargs = init_kwargs_from_attrs(model)
    inner_kwargs = init_kwargs_from_attrs(wrapper_kwargs["model"])
    assert inner_kwargs == {"num_atom_types": 10, "hidden_dim": 8}
    rebuilt = DemoModelWrapper(DemoModel(**inner_kwargs))
    rebuilt.load_state_dict(model.state_dict())
    batch = _batch()
    torch.testing.assert_close(rebuilt(batch)["forces"], model(batch)["forces"])


@pytest.mark.parametrize("bad", [10, 29])  # 0 is refused by AtomicData itself
def test_atomic_numbers_outside_the_species_table_are_a_value_error(bad):
    model = _wrapper()  # num_atom_types=10: Z in 1..9
    data = AtomicData(atomic_numbers=torch.tensor([1, bad]), positions=torch.randn(2, 3))
    with pytest.raises(ValueError, match=rf"num_atom_types=10.*Z values \[{bad}\]"):
        model(Batch.from_data_list([data]))
    with pytest.raises(ValueError, match=rf"Z values \[{bad}\]"):
        model.compute_embeddings(data)
