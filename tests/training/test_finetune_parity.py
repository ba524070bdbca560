"""Zero-step parity: a fine-tune that has not stepped predicts what its source predicts."""

from __future__ import annotations

import copy

import pytest
import torch
from _finetune_support import AU, CU, painn, structures

from nvalchemi.training import EnergyMSELoss, ForceMSELoss, OptimizerConfig, TrainingStrategy
from nvalchemi.training.finetune import FineTuningStrategy
from nvalchemi.training.finetune_parity import check_zero_step_parity

TOLERANCE = 1e-10
RECIPE = {
    "loss_fn": EnergyMSELoss() + ForceMSELoss(),
    "optimizer_configs": OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
    "num_steps": 1,
}


def _periodic_and_open():
    data = structures(4)
    cluster = data[0].clone()
    for key in ("cell", "pbc", "stress"):
        cluster[key] = None
    return [*data, cluster]


def _source_with_stress():
    model = painn()
    model.set_config("active_outputs", {"energy", "forces", "stress"})
    return model


def test_from_a_native_checkpoint(tmp_path):
    source = _source_with_stress()
    TrainingStrategy(models=source, **RECIPE).save_checkpoint(tmp_path / "ckpt")
    strategy = FineTuningStrategy.from_pretrained_checkpoint(
        tmp_path / "ckpt", trainable_patterns=("main.readout.*",), **RECIPE
    )
    report = check_zero_step_parity(source, strategy.models["main"], _periodic_and_open())
    assert set(report.max_abs) == {"energy", "forces", "stress"}
    assert report.ok(TOLERANCE), report.format()
    assert report.num_structures == 5


def test_from_plain_weights(tmp_path):
    source = _source_with_stress()
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    fresh = painn(seed=7)  # other initial weights: the file must replace them all
    fresh.set_config("active_outputs", {"energy", "forces", "stress"})
    strategy = FineTuningStrategy.from_pretrained_weights(fresh, tmp_path / "weights.pt", **RECIPE)
    assert check_zero_step_parity(source, strategy.models["main"], _periodic_and_open()).ok(
        TOLERANCE
    )
    assert not check_zero_step_parity(source, painn(seed=7), _periodic_and_open()).ok(TOLERANCE)


def test_from_a_mace_model(tmp_path):
    pytest.importorskip("mace")
    from nvalchemi.models.mace import MACEWrapper

    source = MACEWrapper.from_mace_kwargs(
        atomic_numbers=[CU, AU],
        r_max=4.0,
        hidden_irreps="8x0e + 8x1o",
        num_interactions=2,
        atomic_energies={CU: -3.5, AU: -3.0},
        seed=0,
    )
    source.set_config("active_outputs", {"energy", "forces", "stress"})
    torch.save(source.model, tmp_path / "small.model")
    with pytest.warns(UserWarning, match="pickle"):
        strategy = FineTuningStrategy.from_mace(
            tmp_path / "small.model", trainable_patterns=("main.model.readouts.*",), **RECIPE
        )
    tuned = strategy.models["main"]
    tuned.set_config("active_outputs", {"energy", "forces", "stress"})
    report = check_zero_step_parity(source, tuned, _periodic_and_open())
    assert set(report.max_abs) == {"energy", "forces", "stress"}
    assert report.ok(TOLERANCE), report.format()


def test_an_added_head_starts_at_parity_with_its_source_head(tmp_path):
    source = _source_with_stress()
    TrainingStrategy(models=source, **RECIPE).save_checkpoint(tmp_path / "ckpt")
    strategy = FineTuningStrategy.from_pretrained_checkpoint(
        tmp_path / "ckpt", new_heads={"dft": None}, **RECIPE
    )
    model = strategy.models["main"]
    assert model.head_names == ("default", "dft")
    assert check_zero_step_parity(source, model, _periodic_and_open(), head="dft").ok(TOLERANCE)


def test_differences_are_reported_per_output_and_structure():
    source = painn()
    shifted = copy.deepcopy(source)
    shifted.set_reference_energies({"Cu": -3.4})  # +0.1 eV per Cu atom
    data = structures(3)
    report = check_zero_step_parity(source, shifted, data, outputs=("energy", "forces"))
    for row, item in zip(report.per_structure, data):
        assert row["energy"] == pytest.approx(0.1 * int((item.atomic_numbers == CU).sum()))
        assert row["forces"] == 0.0
    assert not report.ok(1e-3) and report.ok(1.0)
    assert "energy" in report.format() and "forces" in report.format()
    with pytest.raises(ValueError, match="not comparable"):
        check_zero_step_parity(source, shifted, data, outputs=("dipole",))


def test_structures_without_a_head_field_train_the_added_head(tmp_path):
    from nvalchemi.data.datapipes import DataLoader, InMemoryDataset
    from nvalchemi.data.neighbors import NeighborListTransform

    source = painn()
    TrainingStrategy(models=source, **RECIPE).save_checkpoint(tmp_path / "ckpt")
    strategy = FineTuningStrategy.from_pretrained_checkpoint(
        tmp_path / "ckpt",
        new_heads={"dft": None},
        trainable_patterns=("main.head_readouts.dft.*",),
        **{**RECIPE, "num_steps": 2},
    )
    model = strategy.models["main"]
    assert model.default_head == "dft"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = InMemoryDataset(data_list=structures(4), transforms=[NeighborListTransform(4.0)])
    strategy.run(DataLoader(data, batch_size=2))
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(n.startswith("head_readouts.dft.") for n in moved)
    # The source head still predicts what the source does.
    assert check_zero_step_parity(source, model, structures(2), head="default").ok(TOLERANCE)
