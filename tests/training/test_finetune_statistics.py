"""Fine-tune statistics: the E0 modes, scale/shift, the run-directory record, and ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _finetune_support import AG, AU, CU, painn, predicted_energies, relabelled, structures
from _ranks import run_ranks

from nvalchemi.models.statistics import fit_atomic_energies
from nvalchemi.training.finetune_statistics import (
    STATISTICS_FILENAME,
    compute_finetune_statistics,
    prepare_finetune_model,
    read_finetune_statistics,
)

OFFSETS = {CU: 0.123456789, AU: -0.987654321}


def test_estimated_recovers_per_element_offsets_of_the_new_labels():
    model = painn()
    data = relabelled(model, structures(10), OFFSETS)
    stats = compute_finetune_statistics(model, data, e0="estimated", batch_size=3)
    assert stats.e0_mode == "estimated" and stats.new_elements == []
    for symbol, z in (("Cu", CU), ("Au", AU)):
        offset = stats.atomic_energies[symbol] - stats.source_atomic_energies[symbol]
        assert offset == pytest.approx(OFFSETS[z], abs=1e-8)
    # The model was not changed by computing; applying moves it onto the new labels.
    stats.apply(model)
    assert predicted_energies(model, data) == pytest.approx(
        [float(d["energy"]) for d in data], abs=1e-8
    )


def test_keep_fits_only_elements_the_source_has_no_reference_energy_for():
    model = painn(atomic_energies={CU: -3.5})  # Au and Ag have none
    data = relabelled(model, structures(10), OFFSETS)
    stats = prepare_finetune_model(model, data, e0="keep")
    assert stats.new_elements == ["Au"]
    assert stats.atomic_energies["Cu"] == -3.5  # kept, although the labels moved it
    assert stats.atomic_energies["Au"] != 0.0
    assert model.get_reference_energies()[AU] == stats.atomic_energies["Au"]
    assert model.get_reference_energies()[AG] == 0.0  # not in the data: untouched


def test_keep_without_new_elements_does_not_run_the_model():
    class Counting(type(painn())):
        calls = 0

        def forward(self, data, head=None, **kwargs):
            Counting.calls += 1
            return super().forward(data, head=head, **kwargs)

    torch.manual_seed(0)
    model = Counting(
        elements=[CU, AU],
        atomic_energies={CU: -3.5, AU: -3.0},
        cutoff=4.0,
        hidden_channels=8,
        num_interactions=1,
        dtype=torch.float64,
    )
    stats = compute_finetune_statistics(model, structures(6), e0="keep")
    assert Counting.calls == 0
    assert stats.atomic_energies == {"Cu": -3.5, "Au": -3.0}
    assert stats.mean_num_neighbors > 0


def test_refit_is_least_squares_on_the_new_energies():
    model = painn()
    data = structures(10)
    stats = compute_finetune_statistics(model, data, e0="refit")
    expected = fit_atomic_energies(data)
    assert stats.atomic_energies["Cu"] == pytest.approx(expected[CU], abs=1e-10)
    assert stats.atomic_energies["Au"] == pytest.approx(expected[AU], abs=1e-10)
    assert stats.residual_rmse_per_atom is None  # the model never ran


def test_fixed_uses_the_given_values_and_fits_the_new_elements():
    model = painn(atomic_energies={CU: -3.5})
    data = relabelled(model, structures(10), OFFSETS)
    stats = compute_finetune_statistics(
        model, data, e0="fixed", atomic_energies={"Cu": -3.5 + OFFSETS[CU], "Ag": -1.0}
    )
    assert stats.atomic_energies["Cu"] == pytest.approx(-3.5 + OFFSETS[CU])
    assert stats.atomic_energies["Ag"] == -1.0
    # With Cu's true offset given, Au's fitted E0 is exactly its offset (source had none).
    assert stats.atomic_energies["Au"] == pytest.approx(OFFSETS[AU], abs=1e-8)


def test_scale_shift_refit_measures_the_new_data():
    model = painn()
    data = structures(8)
    stats = compute_finetune_statistics(model, data, e0="refit", scale_shift="refit")
    forces = torch.cat([d["forces"] for d in data])
    assert stats.scale == pytest.approx(float(forces.pow(2).mean().sqrt()), rel=1e-12)
    assert (stats.source_scale, stats.source_shift) == (0.4, 0.0)
    stats.apply(model)
    assert model.get_scale_shift() == (stats.scale, stats.shift)


def test_statistics_of_an_added_head_leave_the_source_head_alone():
    model = painn()
    model.add_head("new")
    data = relabelled(model, structures(8), OFFSETS, head="new")
    prepare_finetune_model(model, data, e0="estimated", head="new")
    assert model.get_reference_energies("default")[CU] == -3.5
    assert model.get_reference_energies("new")[CU] == pytest.approx(-3.5 + OFFSETS[CU], abs=1e-8)


def test_the_choice_and_values_are_written_to_the_run_directory(tmp_path):
    model = painn()
    data = relabelled(model, structures(6), OFFSETS)
    stats = prepare_finetune_model(model, data, e0="estimated", run_dir=tmp_path)
    written = json.loads((tmp_path / STATISTICS_FILENAME).read_text())
    assert written["e0_mode"] == "estimated"
    assert read_finetune_statistics(tmp_path) == stats
    assert read_finetune_statistics(tmp_path / "elsewhere") is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"e0": "guess"}, "e0='guess'"),
        ({"e0": "keep", "atomic_energies": {"Cu": 1.0}}, "only of it"),
        ({"e0": "fixed"}, "only of it"),
        ({"scale_shift": "maybe"}, "scale_shift='maybe'"),
    ],
)
def test_bad_options_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_finetune_statistics(painn(), structures(2), **kwargs)


def test_elements_the_model_lacks_are_named():
    model = painn(elements=(CU,), atomic_energies={CU: -3.5})
    with pytest.raises(ValueError, match=r"elements \['Au'\] that the model does not support"):
        compute_finetune_statistics(model, structures(4), e0="estimated")


def test_models_without_reference_energies_are_refused():
    from nvalchemi.models.demo import DemoModel, DemoModelWrapper

    with pytest.raises(TypeError, match="reference energies per head"):
        compute_finetune_statistics(DemoModelWrapper(DemoModel(hidden_dim=4)), structures(2))


def test_statistics_are_computed_once_and_equal_on_two_ranks(tmp_path):
    script = Path(__file__).with_name("_finetune_stats_ranks.py")
    results = run_ranks(script, args=[str(tmp_path)], timeout=180)
    assert results[0]["stats"] == results[1]["stats"]
    assert results[0]["model_e0"] == results[1]["model_e0"]
    model = painn()
    single = compute_finetune_statistics(
        model, relabelled(model, structures(10), OFFSETS), e0="estimated"
    )
    assert results[0]["stats"] == single.to_dict()  # rank 0's data, not rank 1's
    assert json.loads((tmp_path / STATISTICS_FILENAME).read_text()) == single.to_dict()
