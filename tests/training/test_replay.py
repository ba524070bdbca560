"""Replay: pseudo-labels (cached once), the mixed data set, and the forgetting measure."""

from __future__ import annotations

import copy

import pytest
import torch
from _finetune_support import CU, painn, predicted_energies, structures

from nvalchemi.data.datapipes import DataLoader, InMemoryDataset
from nvalchemi.data.neighbors import NeighborListTransform
from nvalchemi.training import EnergyMSELoss, ForceMSELoss, OptimizerConfig, ValidationConfig
from nvalchemi.training.finetune import FineTuningStrategy
from nvalchemi.training.hooks import ForgettingHook
from nvalchemi.training.replay import (
    mix_replay,
    pseudo_label,
    read_pseudo_labels,
    split_holdout,
)


def _dataset(data):
    return InMemoryDataset(data_list=data, transforms=[NeighborListTransform(4.0)])


def test_pseudo_labels_are_the_source_predictions_and_are_cached_once(tmp_path):
    source = painn()
    data = structures(5)
    labelled = pseudo_label(source, data, batch_size=2, cache=tmp_path / "labels.zarr")
    assert len(labelled) == 5
    energies = [float(labelled[i]["energy"]) for i in range(5)]
    assert energies == pytest.approx(predicted_energies(source, data), abs=1e-12)
    assert all("stress" in labelled[i] for i in range(5))  # periodic cells with volume
    assert not torch.equal(labelled[0]["energy"], data[0]["energy"])  # EMT labels replaced
    # A second call with the same inputs reads the cache (a model that would fail proves it).
    source.forward = None
    again = pseudo_label(source, data, batch_size=2, cache=tmp_path / "labels.zarr")
    assert [float(again[i]["energy"]) for i in range(5)] == pytest.approx(energies, abs=1e-12)
    assert not (tmp_path / "labels.zarr.partial").exists()


def _energies(dataset) -> list[float]:
    return [float(dataset[i]["energy"]) for i in range(len(dataset))]


def test_cached_pseudo_labels_are_made_again_when_the_structures_or_the_model_change(tmp_path):
    cache = tmp_path / "labels.zarr"
    source, data = painn(), structures(4)
    pseudo_label(source, data, cache=cache)
    moved = [d.clone() for d in data]
    moved[2]["positions"] = moved[2]["positions"] + 0.01  # a replay file edited in place
    with pytest.warns(UserWarning, match=r"\(the structures changed\); labelling"):
        labelled = pseudo_label(source, moved, cache=cache)
    assert _energies(labelled) == pytest.approx(predicted_energies(source, moved), abs=1e-12)
    retrained = painn()
    with torch.no_grad():
        next(retrained.parameters()).add_(0.1)  # the source checkpoint was trained on
    with pytest.warns(UserWarning, match=r"\(the model.s weights or settings changed\)"):
        labelled = pseudo_label(retrained, moved, cache=cache)
    expected = predicted_energies(retrained, moved)
    assert _energies(labelled) == pytest.approx(expected, abs=1e-12)
    assert _energies(read_pseudo_labels(cache)) == pytest.approx(expected, abs=1e-12)


def test_stale_or_unrecorded_replay_labels_are_refused_when_read(tmp_path):
    cache = tmp_path / "labels.zarr"
    data = structures(3)
    pseudo_label(painn(), data, cache=cache)
    assert len(read_pseudo_labels(cache, structures=data)) == 3
    with pytest.raises(ValueError, match="made from other structures"):
        read_pseudo_labels(cache, structures=structures(3, seed=7))
    (cache / "nvalchemi_replay_inputs.json").unlink()  # a store of an older version
    with pytest.raises(ValueError, match="does not record what its labels were made from"):
        pseudo_label(painn(), data, cache=cache)
    assert cache.is_dir()  # refused, not deleted


def test_split_holdout_is_seeded_and_disjoint():
    data = _dataset(structures(10))
    kept, held = split_holdout(data, 0.3, seed=1)
    _, held2 = split_holdout(data, 0.3, seed=1)
    assert (len(kept), len(held)) == (7, 3)
    energies = {float(held[i]["energy"]) for i in range(3)}
    assert energies == {float(held2[i]["energy"]) for i in range(3)}
    assert not energies & {float(kept[i]["energy"]) for i in range(7)}


def test_the_replay_ratio_fixes_the_share_of_every_batch():
    finetune, replay = _dataset(structures(12, seed=1)), _dataset(structures(6, seed=2))
    mix = mix_replay(finetune, replay, batch_size=5, ratio=0.4, weight=0.25, heads=[1, 0])
    batches = list(mix.loader())
    assert len(batches) == 4  # every fine-tuning structure about once per epoch (12 / 3)
    for batch in batches:
        weights = batch["loss_weight"].reshape(-1).tolist()
        assert sorted(weights) == [0.25, 0.25, 1.0, 1.0, 1.0]
        assert [h for h, w in zip(batch["head"].tolist(), weights) if w == 0.25] == [0, 0]
    with pytest.raises(ValueError, match="between 0 and 1"):
        mix_replay(finetune, replay, batch_size=5, ratio=1.0)


def _strategy(source_checkpoint, hooks, validation):
    return FineTuningStrategy.from_pretrained_checkpoint(
        source_checkpoint,
        loss_fn=EnergyMSELoss(per_atom=True) + ForceMSELoss(),
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 5e-2}),
        num_steps=4,
        hooks=hooks,
        validation_config=validation,
    )


def test_forgetting_is_measured_before_and_after_and_joins_validation_rows(tmp_path):
    from nvalchemi.hooks.reporting import JSONLinesReporter, ReportingOrchestrator, read_metrics
    from nvalchemi.training import TrainingStrategy

    source = painn()
    TrainingStrategy(
        models=source,
        loss_fn=EnergyMSELoss(),
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
        num_steps=1,
    ).save_checkpoint(tmp_path / "ckpt")
    holdout = pseudo_label(source, structures(4, seed=5))
    new_task = [d.clone() for d in structures(8, seed=6)]
    for item in new_task:
        item["energy"] = item["energy"] + 2.0 * int((item.atomic_numbers == CU).sum())
    reporter = ReportingOrchestrator(
        [JSONLinesReporter(tmp_path / "run")], stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"}
    )
    forgetting = ForgettingHook(DataLoader(holdout, batch_size=2))
    validation = ValidationConfig(
        validation_data=DataLoader(_dataset(new_task), batch_size=4), every_n_steps=2
    )
    strategy = _strategy(tmp_path / "ckpt", [reporter, forgetting], validation)
    assert strategy.hooks.index(forgetting) < strategy.hooks.index(reporter)
    strategy.run(DataLoader(_dataset(new_task), batch_size=4, shuffle=True))
    result = forgetting.result
    assert result["before"]["energy_per_atom_mae"] == pytest.approx(0.0, abs=1e-9)
    assert result["after"]["energy_per_atom_mae"] > 1e-4  # the trunk moved: it forgot
    increase = result["increase"]["energy_per_atom_mae"]
    assert increase == pytest.approx(result["after"]["energy_per_atom_mae"], abs=1e-9)
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "validation"]
    assert rows and all("validation/forgetting/energy_per_atom_mae_before" in r for r in rows)
    assert rows[-1]["validation/forgetting/energy_per_atom_mae"] == pytest.approx(
        result["after"]["energy_per_atom_mae"]
    )
    # The baseline is state: a resumed run keeps the first one.
    restored = ForgettingHook()
    restored.load_state_dict(copy.deepcopy(forgetting.state_dict()))
    assert restored.before == forgetting.before


def test_forgetting_without_holdout_data_says_how_to_give_it(tmp_path):
    hook = ForgettingHook()
    with pytest.raises(RuntimeError, match="no holdout data"):
        hook.evaluate(object())


def test_the_replay_weight_sets_replays_share_against_the_fine_tuning_structures():
    # Weighted means divide by the sum of the weights (issue 29): only the ratio of the
    # replay weight to the fine-tuning weight counts, and weight 0 leaves replay out.
    from nvalchemi.data.datapipes import MultiDataset
    from nvalchemi.training import default_training_fn
    from nvalchemi.training.losses.composition import compute_supervised_loss

    model = painn()
    loss_fn = EnergyMSELoss(per_atom=True) + 10.0 * ForceMSELoss()
    finetune, replay = _dataset(structures(3, seed=1)), _dataset(structures(3, seed=2))
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(weights: list[float], indices: list[int]) -> torch.Tensor:
        mixed = MultiDataset(finetune, replay, loss_weights=weights)
        batch = mixed.get_batch(indices)
        loss = compute_supervised_loss(loss_fn, default_training_fn(model, batch), batch)
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss["total_loss"], params)])

    mixed = [0, 3, 1, 4, 5]  # fine-tuning and replay structures
    alone = gradient([1.0, 1.0], [0, 1])  # the fine-tuning structures of that batch alone
    assert torch.allclose(gradient([1.0, 0.0], mixed), alone, rtol=1e-9, atol=1e-14)
    half = gradient([1.0, 0.5], mixed)
    assert torch.allclose(gradient([2.0, 1.0], mixed), half, rtol=1e-9, atol=1e-14)
    assert not torch.allclose(half, gradient([1.0, 1.0], mixed), rtol=1e-6)
