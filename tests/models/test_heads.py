"""Readout heads: PaiNN and MACEWrapper pick a head per structure; checkpoints and the
calculator keep them."""

from __future__ import annotations

import pytest
import torch

from nvalchemi.models import PaiNN
from nvalchemi.models.calculator import NvalchemiCalculator
from nvalchemi.training import EnergyMSELoss, OptimizerConfig, TrainingStrategy
from nvalchemi.training.checkpoint import load_model_from_checkpoint
from nvalchemi.training.model_spec import model_spec_for

SMALL = {"cutoff": 4.0, "hidden_channels": 8, "num_interactions": 1, "num_rbf": 6}


def _painn(**kwargs):
    torch.manual_seed(0)
    params = {**SMALL, "elements": [29, 79], "atomic_energies": {29: -3.5, 79: -3.0}}
    return PaiNN(dtype=torch.float64, scale=0.3, **{**params, **kwargs})


def _energies(model, batch, **kwargs):
    return model(batch, **kwargs)["energy"].detach().reshape(-1)


def test_an_added_head_predicts_exactly_what_it_was_copied_from(helpers):
    model = _painn()
    batch = helpers.batch_of([helpers.triclinic_cu_au(), helpers.cu_cluster()], 4.0)
    before = model(batch)
    model.add_head("dft")
    after = model(batch, head="dft")
    assert model.head_names == ("default", "dft")
    assert torch.equal(after["energy"], before["energy"])
    assert torch.equal(after["forces"], before["forces"])
    names = {n for n, _ in model.named_parameters()}
    assert {"head_readouts.dft.readout.0.weight", "readout.0.weight"} <= names


def test_each_structure_uses_the_head_its_head_field_names(helpers):
    model = _painn()
    model.add_head("dft")
    model.set_reference_energies({"Cu": -5.0}, head="dft")
    batch = helpers.batch_of([helpers.triclinic_cu_au(), helpers.triclinic_cu_au()], 4.0)
    first, second = _energies(model, batch, head="default"), _energies(model, batch, head="dft")
    cu_atoms = int((batch.atomic_numbers[: batch.num_nodes_per_graph[0]] == 29).sum())
    assert torch.allclose(second - first, torch.full_like(first, -1.5 * cu_atoms))
    batch.add_key("head", torch.tensor([1, 0]), level="system")
    mixed = _energies(model, batch)
    assert torch.equal(mixed, torch.stack([second[0], first[1]]))
    batch.add_key("head", torch.tensor([0, 2]), level="system", overwrite=True)
    with pytest.raises(ValueError, match="'head' field holds \\[2\\]"):
        model(batch)


def test_per_head_reference_energies_and_scale_shift_are_separate():
    model = _painn()
    model.add_head("dft", copy_from="default")
    model.set_scale_shift(2.0, 0.5, head="dft")
    model.set_reference_energies({79: -1.0}, head="dft")
    assert model.get_scale_shift("default") == (0.3, 0.0)
    assert model.get_scale_shift("dft") == (2.0, 0.5)
    assert model.get_reference_energies("default") == {29: -3.5, 79: -3.0}
    assert model.get_reference_energies("dft") == {29: -3.5, 79: -1.0}
    with pytest.raises(ValueError, match="has no head 'x'"):
        model.get_scale_shift("x")
    with pytest.raises(ValueError, match="already has a head 'dft'"):
        model.add_head("dft")


def test_heads_are_constructor_arguments_so_specs_rebuild_them(helpers):
    model = _painn()
    model.add_head("dft")
    model.set_scale_shift(1.7, -0.2, head="dft")
    spec = model_spec_for(model)
    rebuilt = spec.build()
    rebuilt.load_state_dict(model.state_dict())
    batch = helpers.batch_of([helpers.triclinic_cu_au()], 4.0)
    assert rebuilt.head_names == ("default", "dft")
    assert torch.equal(_energies(rebuilt, batch, head="dft"), _energies(model, batch, head="dft"))


def test_a_two_head_model_round_trips_through_a_checkpoint_and_the_calculator(tmp_path, helpers):
    model = _painn(heads=("pbe", "r2scan"), head_params={"r2scan": {"scale": 0.5, "shift": 0.1}})
    model.set_reference_energies({"Cu": -4.0, "Au": -2.5}, head="r2scan")
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
        loss_fn=EnergyMSELoss(),
        num_steps=1,
    )
    strategy.save_checkpoint(tmp_path / "ckpt")
    loaded = load_model_from_checkpoint(tmp_path / "ckpt", use_ema=False)
    assert loaded.head_names == ("pbe", "r2scan")
    atoms = helpers.triclinic_cu_au()
    for head in ("pbe", "r2scan"):
        calc = NvalchemiCalculator.from_checkpoint(tmp_path / "ckpt", use_ema=False, head=head)
        atoms.calc = calc
        energy = atoms.get_potential_energy()
        expected = float(_energies(model, helpers.batch_of([atoms], 4.0), head=head)[0])
        assert energy == pytest.approx(expected, abs=1e-10)
    assert NvalchemiCalculator(loaded).head is None
    with pytest.raises(ValueError, match="not a head of this model"):
        NvalchemiCalculator(loaded, head="ccsd")


def test_calculator_head_needs_a_multi_head_model():
    from nvalchemi.models.demo import DemoModel, DemoModelWrapper

    with pytest.raises(ValueError, match="has no readout heads"):
        NvalchemiCalculator(DemoModelWrapper(DemoModel(hidden_dim=4)), head="x")


def test_mace_heads_pick_per_structure_and_hold_their_own_reference_energies(helpers):
    pytest.importorskip("mace")
    from nvalchemi.models.mace import MACEWrapper

    wrapper = MACEWrapper.from_mace_kwargs(
        atomic_numbers=[29, 79],
        r_max=4.0,
        hidden_irreps="8x0e",
        num_interactions=1,
        heads=["pbe", "r2scan"],
        atomic_energies={29: -1.0},
        seed=0,
    )
    assert wrapper.head_names == ("pbe", "r2scan")
    batch = helpers.batch_of([helpers.triclinic_cu_au()] * 2, 4.0)
    wrapper.set_reference_energies({"Cu": -3.0}, head="r2scan")
    pbe, r2scan = _energies(wrapper, batch, head="pbe"), _energies(wrapper, batch, head="r2scan")
    assert wrapper.get_reference_energies("pbe") == {29: -1.0, 79: 0.0}
    assert wrapper.get_reference_energies("r2scan") == {29: -3.0, 79: 0.0}
    batch.add_key("head", torch.tensor([1, 0]), level="system")
    assert torch.allclose(_energies(wrapper, batch), torch.stack([r2scan[0], pbe[1]]))
    wrapper.set_scale_shift(2.0, 0.1, head="r2scan")
    assert wrapper.get_scale_shift("r2scan") == (2.0, pytest.approx(0.1))
    assert wrapper.get_scale_shift("pbe") == (1.0, 0.0)
    rebuilt = wrapper.checkpoint_spec().build()
    rebuilt.load_state_dict(wrapper.state_dict())
    assert torch.equal(_energies(rebuilt, batch), _energies(wrapper, batch))


@pytest.mark.parametrize("heads", [None, ["pbe", "r2scan"]])
def test_mace_add_head_keeps_every_head_and_copies_the_source(helpers, heads):
    pytest.importorskip("mace")
    from nvalchemi.models.mace import MACEWrapper

    wrapper = MACEWrapper.from_mace_kwargs(
        atomic_numbers=[29, 79],
        r_max=4.0,
        hidden_irreps="8x0e + 8x1o",
        num_interactions=2,
        heads=heads,
        atomic_energies={29: -1.0, 79: -2.0},
        seed=0,
    )
    with torch.no_grad():  # readouts that differ per head
        for p in wrapper.parameters():
            p.add_(0.1 * torch.randn_like(p))
    batch = helpers.batch_of([helpers.triclinic_cu_au()] * 2, 4.0)
    before = {h: wrapper(batch, head=h) for h in wrapper.head_names}
    source = wrapper.head_names[-1]
    wrapper.add_head("new", copy_from=source, make_default=True)
    assert wrapper.head_names == (*before, "new") and wrapper.default_head == "new"
    for head, out in [*before.items(), ("new", before[source])]:
        now = wrapper(batch, head=head)
        assert (now["energy"] - out["energy"]).abs().max() < 1e-10
        assert (now["forces"] - out["forces"]).abs().max() < 1e-10
    assert torch.equal(_energies(wrapper, batch), _energies(wrapper, batch, head="new"))
    rebuilt = wrapper.checkpoint_spec().build()
    rebuilt.load_state_dict(wrapper.state_dict())
    assert rebuilt.default_head == "new"
    assert torch.equal(_energies(rebuilt, batch), _energies(wrapper, batch))


def test_mace_add_head_needs_recorded_constructor_arguments():
    pytest.importorskip("mace")
    from nvalchemi.models.mace import MACEWrapper

    built = MACEWrapper.from_mace_kwargs(
        atomic_numbers=[29], r_max=4.0, hidden_irreps="8x0e", num_interactions=1
    )
    with pytest.raises(ValueError, match="from_mace_kwargs"):
        MACEWrapper(built.model).add_head("x")
