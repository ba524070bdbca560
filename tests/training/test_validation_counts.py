"""Validation per-sample statistics skip structures without the component's label.

``per_component_sample`` is the mean of the weighted per-structure values over the
structures that have the label, ``per_component_sample_count`` their number, in one
process and after the distributed all-reduce. Also runnable as the rank script of the
distributed test (``python -c "import test_validation_counts as t; t.rank_main()"``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nvalchemi.data import AtomicData, Batch
from nvalchemi.training import (
    EnergyMSELoss,
    ForceMSELoss,
    StressMSELoss,
    ValidationConfig,
    ValidationLoop,
)

NAN = float("nan")
LEVELS = {"pe": "system", "pf": "atom", "ps": "system"}
NAMES = ("EnergyMSELoss", "ForceMSELoss", "StressMSELoss")

# Per structure: (atoms, has energy, has forces, stress label: "all" / "none" / "partial").
LAYOUT = [
    [(2, True, True, "all"), (3, True, False, "none"), (2, False, True, "all")],
    [(3, True, True, "none"), (2, False, False, "all")],
    [(1, True, True, "all"), (2, True, True, "partial"), (2, False, False, "none")],
]


def _structure(generator: torch.Generator, atoms: int, energy: bool, forces: bool, stress: str):
    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    fields = {
        "atomic_numbers": torch.ones(atoms, dtype=torch.long),
        "positions": torch.zeros(atoms, 3),
        "pe": rand(1, 1),
        "pf": rand(atoms, 3),
        "ps": rand(1, 3, 3),
    }
    if energy:
        fields["energy"] = rand(1, 1)
    if forces:
        fields["forces"] = rand(atoms, 3)
    if stress != "none":
        fields["stress"] = rand(1, 3, 3)
    return AtomicData(**fields, field_levels=LEVELS)


def make_batches(layout=LAYOUT) -> list[Batch]:
    generator = torch.Generator().manual_seed(3)
    batches = []
    for spec in layout:
        batch = Batch.from_data_list([_structure(generator, *s) for s in spec])
        for index, (_, _, _, stress) in enumerate(spec):
            if stress == "partial":  # some components missing: the structure stays labelled
                batch.stress[index, 0, :2] = NAN
        batches.append(batch)
    return batches


def echo_fn(model, batch):
    return {
        "predicted_energy": batch.pe,
        "predicted_forces": batch.pf,
        "predicted_stress": batch.ps,
    }


def loss_fn():
    # "partial" stress labels carry NaN components in a labelled structure: masked only with
    # ignore_nonfinite (a NaN that collation did not mark missing propagates otherwise)
    return EnergyMSELoss() + 2.0 * ForceMSELoss() + StressMSELoss(ignore_nonfinite=True)


def summarize(batches: list[Batch]) -> dict:
    config = ValidationConfig(validation_data=batches)
    loop = ValidationLoop(
        validation_data=batches,
        config=config,
        device="cpu",
        model=nn.Linear(1, 1),
        loss_fn=loss_fn(),
        validation_fn=echo_fn,
    )
    with loop:
        return loop.execute()


def _mean_labelled(pred: torch.Tensor, label: torch.Tensor) -> float | None:
    valid = ~torch.isnan(label)
    if not valid.any():
        return None
    return float(((pred - label)[valid] ** 2).mean())


def reference(batches: list[Batch]) -> tuple[dict[str, float], dict[str, int]]:
    """Weighted mean over labelled structures, one structure at a time (no batching)."""
    weights = dict(zip(NAMES, (0.25, 0.5, 0.25)))
    values: dict[str, list[float]] = {name: [] for name in NAMES}
    for batch in batches:
        for graph in range(batch.num_graphs):
            atoms = batch.batch_idx == graph
            pairs = zip(NAMES, ("pe", "pf", "ps"), ("energy", "forces", "stress"))
            for name, pred_key, label_key in pairs:
                pick = atoms if label_key == "forces" else graph
                pred, label = getattr(batch, pred_key)[pick], getattr(batch, label_key)[pick]
                value = _mean_labelled(pred, label)
                if value is not None:
                    values[name].append(weights[name] * value)
    means = {name: sum(v) / len(v) for name, v in values.items() if v}
    return means, {name: len(v) for name, v in values.items()}


def test_sample_statistics_count_only_labelled_structures():
    batches = make_batches()
    summary = summarize(batches)
    means, counts = reference(batches)
    assert counts == {"EnergyMSELoss": 5, "ForceMSELoss": 5, "StressMSELoss": 5}
    assert summary["per_component_sample_count"] == counts
    assert summary["num_structures"] == 8  # every structure is still a structure
    for name, expected in means.items():
        got = summary["per_component_sample"][name]
        assert math.isfinite(float(got)), name
        assert float(got) == pytest.approx(expected, rel=1e-12), name


def test_unlabelled_structures_do_not_change_the_sample_mean():
    labelled_only = [[(2, True, True, "all"), (1, True, True, "all")]]
    with_unlabelled = [
        [(2, True, True, "all"), (1, True, True, "all"), (3, False, False, "none")],
        [(2, False, False, "none"), (2, True, False, "none"), (1, True, True, "all")],
    ]
    base = summarize(make_batches(labelled_only))
    batches = make_batches(with_unlabelled)
    # batch 1 keeps the force and stress fields, but none of its structures has them
    batches[1] = batches[1][[0, 1]]
    assert batches[1].missing_labels["forces"].all() and batches[1].missing_labels["stress"].all()
    mixed = summarize(batches)
    assert mixed["per_component_sample_count"] == {
        "EnergyMSELoss": 3,
        "ForceMSELoss": 2,
        "StressMSELoss": 2,
    }
    # the two labelled structures of batch 0 are the same draws in both runs
    for name in ("ForceMSELoss", "StressMSELoss"):
        assert float(mixed["per_component_sample"][name]) == pytest.approx(
            float(base["per_component_sample"][name]), rel=1e-12
        )


def test_component_without_any_label_has_no_sample_mean():
    batches = make_batches(
        [[(2, True, True, "none"), (1, True, True, "none"), (1, True, True, "all")]]
    )
    batches[0] = batches[0][[0, 1]]  # the field exists but no structure has a stress label
    summary = summarize(batches)
    assert summary["per_component_sample_count"]["StressMSELoss"] == 0
    assert "StressMSELoss" not in summary["per_component_sample"]


def test_nan_prediction_for_a_labelled_structure_is_not_hidden():
    batches = make_batches([[(2, True, True, "all"), (1, False, True, "all")]])
    batches[0].pe[0, 0] = NAN  # structure 0 is labelled: its NaN must show
    summary = summarize(batches)
    assert summary["per_component_sample_count"]["EnergyMSELoss"] == 1
    assert math.isnan(float(summary["per_component_sample"]["EnergyMSELoss"]))
    assert math.isfinite(float(summary["per_component_sample"]["ForceMSELoss"]))


@pytest.mark.distributed
def test_distributed_counts_and_means_equal_single_process():
    from _ranks import run_ranks

    code = "import test_validation_counts as t; t.rank_main()"
    outputs = run_ranks(code)
    single = summarize(make_batches())
    for result in outputs:
        assert result["distributed_reduced"] is True
        assert result["count"] == single["per_component_sample_count"]
        for name, value in single["per_component_sample"].items():
            assert result["sample"][name] == pytest.approx(float(value), rel=1e-12), name
    assert outputs[0] == outputs[1]


def rank_main() -> None:
    """Rank side: rank 0 validates batches 0 and 2, rank 1 batch 1."""
    from _ranks import init_group, report, teardown

    rank = init_group()
    batches = make_batches()
    shard = [batches[0], batches[2]] if rank == 0 else [batches[1]]
    summary = summarize(shard)
    report(
        distributed_reduced=summary["distributed_reduced"],
        count=summary["per_component_sample_count"],
        sample={k: float(v) for k, v in summary["per_component_sample"].items()},
    )
    teardown()
