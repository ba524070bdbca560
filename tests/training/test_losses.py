"""Leaf losses: hand-computed values, masks for missing labels, gradients, errors."""

import math
from types import SimpleNamespace

import pytest
import torch

from nvalchemi.training.losses import (
    BaseLossFunction,
    EnergyHuberLoss,
    EnergyMAELoss,
    EnergyMSELoss,
    ForceHuberLoss,
    ForceL2NormLoss,
    ForceMSELoss,
    StressHuberLoss,
    StressMSELoss,
    assert_same_shape,
    frobenius_mse,
    per_graph_mean,
    per_graph_sum,
)

NAN, INF = float("nan"), float("inf")
ALL_LEAVES = [
    EnergyMSELoss,
    EnergyMAELoss,
    EnergyHuberLoss,
    ForceMSELoss,
    ForceHuberLoss,
    ForceL2NormLoss,
    StressMSELoss,
    StressHuberLoss,
]


def huber(r, delta):
    r = abs(r)
    return 0.5 * r * r if r < delta else delta * (r - 0.5 * delta)


# Three structures with 3, 5 and 2 atoms.
E_PRED = torch.tensor([[6.0], [15.0], [8.0]], dtype=torch.float64)
E_TARGET = torch.tensor([[3.0], [10.0], [4.0]], dtype=torch.float64)
COUNTS = torch.tensor([3, 5, 2])

# Two structures with 3 and 2 atoms; |f|^2 per atom: 1, 4, 9 | 3, 4.
F_TARGET = torch.tensor(
    [[1.0, 0, 0], [2.0, 0, 0], [3.0, 0, 0], [1.0, 1.0, 1.0], [0, 2.0, 0]], dtype=torch.float64
)
BATCH_IDX = torch.tensor([0, 0, 0, 1, 1])
F_META = {"batch_idx": BATCH_IDX, "num_graphs": 2}

S_TARGET = torch.stack([torch.ones(3, 3), 3.0 * torch.eye(3)]).double()  # MSE vs 0: 1 and 3


MISSING_1 = torch.tensor([False, True, False])  # structure 1 of the energy case lacks the label


def zeros(t):
    return torch.zeros_like(t, requires_grad=True)


# ------------------------------------------------------------------------------- energy


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        (EnergyMSELoss(), (9 + 25 + 16) / 3),
        (EnergyMSELoss(per_atom=True), (3 * 1 + 5 * 1 + 2 * 4) / 10),
        (EnergyMAELoss(), (3 * 1 + 5 * 1 + 2 * 2) / 10),
        (EnergyMAELoss(per_atom=False), (3 + 5 + 4) / 3),
        (EnergyHuberLoss(delta=1.5), (huber(1, 1.5) * 2 + huber(2, 1.5)) / 3),
        (EnergyHuberLoss(), (huber(1, 0.01) * 2 + huber(2, 0.01)) / 3),
        (
            EnergyHuberLoss(per_atom=False, delta=4.5),
            (huber(3, 4.5) + huber(5, 4.5) + huber(4, 4.5)) / 3,
        ),
    ],
)
def test_energy_values(loss, expected):
    value = loss(E_PRED, E_TARGET, num_nodes_per_graph=COUNTS)
    assert value.item() == pytest.approx(expected)
    assert value.dtype == torch.float64
    assert loss.per_sample_loss.shape == (3,)


def test_energy_per_sample_values_are_unweighted_residuals():
    loss = EnergyMSELoss(per_atom=True)
    loss(E_PRED, E_TARGET, num_nodes_per_graph=COUNTS)
    assert loss.per_sample_loss.tolist() == [1.0, 1.0, 4.0]
    assert loss.per_sample_valid.tolist() == [True, True, True]
    target = E_TARGET.clone()
    target[1] = float("nan")  # structure 1 has no energy label
    loss(E_PRED, target, num_nodes_per_graph=COUNTS, missing_labels=MISSING_1)
    assert loss.per_sample_valid.tolist() == [True, False, True]
    assert loss.per_sample_loss[[0, 2]].tolist() == [1.0, 4.0]
    assert math.isnan(loss.per_sample_loss[1].item())


def test_energy_accepts_flat_shapes_and_padded_node_masks():
    flat = EnergyMSELoss(per_atom=True)(E_PRED[:, 0], E_TARGET[:, 0], num_nodes_per_graph=COUNTS)
    assert flat.item() == pytest.approx(1.6)
    mask = torch.arange(5)[None, :] < COUNTS[:, None]  # (B, V_max) padded node mask
    assert EnergyMSELoss(per_atom=True)(
        E_PRED, E_TARGET, num_nodes_per_graph=mask
    ).item() == pytest.approx(1.6)


def test_missing_labels_are_left_out_and_not_counted():
    target = E_TARGET.clone()
    target[1] = NAN  # as collation fills it
    pred = E_PRED.clone().requires_grad_()
    value = EnergyMSELoss()(pred, target, missing_labels={"energy": MISSING_1})
    assert value.item() == pytest.approx((9 + 16) / 2)
    value.backward()
    assert pred.grad[:, 0].tolist() == [3.0, 0.0, 4.0]  # 2 (p - t) / 2 labelled
    weighted = EnergyMSELoss(per_atom=True)(
        E_PRED, target, num_nodes_per_graph=COUNTS, missing_labels=MISSING_1
    )
    assert weighted.item() == pytest.approx((3 * 1 + 2 * 4) / 5)
    # a mapping for another label leaves this one alone
    other = EnergyMSELoss()(E_PRED, E_TARGET, missing_labels={"stress": MISSING_1})
    assert other.item() == pytest.approx(50 / 3)


@pytest.mark.parametrize("cls", [EnergyMSELoss, ForceMSELoss, StressMSELoss])
def test_nan_target_propagates_without_ignore_nonfinite(cls):
    pred, target, meta = _case(cls)
    target = target.clone()
    target[0] = NAN  # a NaN label that was not declared missing: a real non-finite value
    assert not cls().ignore_nonfinite
    assert math.isnan(cls()(zeros(pred), target, **meta).item())
    assert math.isfinite(cls(ignore_nonfinite=True)(zeros(pred), target, **meta).item())


def test_ignore_nonfinite_also_masks_inf():
    target = E_TARGET.clone()
    target[0] = INF
    assert math.isinf(EnergyMSELoss()(E_PRED, target).item())
    assert EnergyMSELoss(ignore_nonfinite=True)(E_PRED, target).item() == pytest.approx(
        (25 + 16) / 2
    )


def test_ignore_nonfinite_all_masked_structure_counts_zero_in_the_mean():
    forces = F_TARGET.clone()
    forces[3:] = NAN  # every force of structure 1 is non-finite
    loss = ForceMSELoss(ignore_nonfinite=True)
    assert loss(zeros(F_TARGET), forces, **F_META).item() == pytest.approx((14 / 9 + 0) / 2)
    assert loss.per_sample_loss.tolist() == pytest.approx([14 / 9, 0.0])
    assert loss.per_sample_valid.tolist() == [True, True]
    stress = S_TARGET.clone()
    stress[0] = NAN
    loss = StressMSELoss(ignore_nonfinite=True)
    assert loss(zeros(S_TARGET), stress).item() == pytest.approx((0 + 3) / 2)
    assert loss.per_sample_loss.tolist() == [0.0, 3.0]
    # declared missing instead: left out of the mean, NaN per sample
    assert StressMSELoss()(
        zeros(S_TARGET), stress, missing_labels=torch.tensor([True, False])
    ).item() == pytest.approx(3.0)


def _case(cls):
    if cls.__name__.startswith("Energy"):
        return E_PRED, E_TARGET, {"num_nodes_per_graph": COUNTS}
    if cls.__name__.startswith("Force"):
        return F_TARGET, F_TARGET, F_META
    return S_TARGET, S_TARGET, {}


@pytest.mark.parametrize("cls", ALL_LEAVES)
def test_all_missing_batch_gives_zero_with_zero_gradient(cls):
    pred, target, meta = _case(cls)
    pred, target = zeros(pred), torch.full_like(target, NAN)
    missing = torch.ones(3 if cls.__name__.startswith("Energy") else 2, dtype=torch.bool)
    value = cls()(pred, target, missing_labels=missing, **meta)
    value.backward()
    assert value.item() == 0.0
    assert torch.equal(pred.grad, torch.zeros_like(pred))


def test_per_atom_energy_requires_counts_of_matching_shape():
    with pytest.raises(
        ValueError, match=r"EnergyMAELoss requires num_nodes_per_graph=\.\.\. metadata"
    ):
        EnergyMAELoss()(E_PRED, E_TARGET)
    with pytest.raises(ValueError, match=r"leading dimension \(2\) must match energy batch size"):
        EnergyMAELoss()(E_PRED, E_TARGET, num_nodes_per_graph=torch.tensor([1, 2]))
    batch = SimpleNamespace(num_nodes_per_graph=COUNTS)
    assert EnergyMAELoss()(E_PRED, E_TARGET, batch=batch).item() == pytest.approx(1.2)


# ------------------------------------------------------------------------------- forces


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        (ForceMSELoss(), (14 / 9 + 7 / 6) / 2),
        (ForceMSELoss(normalize_by_atom_count=False), 21 / 15),
        (ForceL2NormLoss(), (6 / 3 + (math.sqrt(3) + 2) / 2) / 2),
        (ForceL2NormLoss(normalize_by_atom_count=False), (6 + math.sqrt(3) + 2) / 5),
        (
            ForceHuberLoss(delta=1.5),
            (huber(1, 1.5) * 4 + huber(2, 1.5) * 2 + huber(3, 1.5)) / 15,
        ),
        (
            ForceHuberLoss(delta=1.5, normalize_by_atom_count=True),
            (
                (huber(1, 1.5) + huber(2, 1.5) + huber(3, 1.5)) / 9
                + (3 * huber(1, 1.5) + huber(2, 1.5)) / 6
            )
            / 2,
        ),
    ],
)
def test_force_values(loss, expected):
    assert loss(zeros(F_TARGET), F_TARGET, **F_META).item() == pytest.approx(expected)


def test_force_per_graph_samples_and_missing_structure():
    loss = ForceMSELoss()
    loss(zeros(F_TARGET), F_TARGET, **F_META)
    assert loss.per_sample_loss.tolist() == pytest.approx([14 / 9, 7 / 6])
    target = F_TARGET.clone()
    target[3:] = NAN  # structure 1 has no force labels
    missing = torch.tensor([False, True])
    value = loss(zeros(F_TARGET), target, missing_labels=missing, **F_META)
    assert value.item() == pytest.approx(14 / 9)
    # the unlabelled structure is NaN (not 0) and marked invalid, so per-sample means skip it
    assert loss.per_sample_loss[0].item() == pytest.approx(14 / 9)
    assert math.isnan(loss.per_sample_loss[1].item())
    assert loss.per_sample_valid.tolist() == [True, False]
    l2 = ForceL2NormLoss()
    partial = F_TARGET.clone()
    partial[0, 1] = NAN  # one bad component removes the whole atom from the L2 loss
    assert l2(zeros(F_TARGET), partial, **F_META).item() == pytest.approx(
        (5 / 2 + (math.sqrt(3) + 2) / 2) / 2
    )


def test_force_gradient_matches_the_graph_balanced_formula():
    pred = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    ForceMSELoss()(pred, F_TARGET, **F_META).backward()
    comps = torch.tensor([9.0, 9, 9, 6, 6], dtype=torch.float64)[:, None]
    expected = 2 * (pred.detach() - F_TARGET) / comps / 2
    assert torch.allclose(pred.grad, expected)


def test_force_metadata_errors_and_batch_fallback():
    with pytest.raises(ValueError, match=r"ForceMSELoss requires batch_idx=\.\.\. metadata"):
        ForceMSELoss()(zeros(F_TARGET), F_TARGET)
    with pytest.raises(
        ValueError,
        match=r"ForceMSELoss: batch_idx must have shape \(5,\), one entry per atom of "
        r"target_key='forces'; got shape \(4,\)",
    ):
        ForceMSELoss()(zeros(F_TARGET), F_TARGET, batch_idx=BATCH_IDX[:4], num_graphs=2)
    batch = SimpleNamespace(batch_idx=BATCH_IDX, num_graphs=2)
    assert ForceMSELoss()(zeros(F_TARGET), F_TARGET, batch=batch).item() == pytest.approx(49 / 36)
    # explicit keywords win over batch=
    wrong = SimpleNamespace(batch_idx=torch.zeros(5, dtype=torch.long), num_graphs=1)
    assert ForceMSELoss()(zeros(F_TARGET), F_TARGET, batch=wrong, **F_META).item() == pytest.approx(
        49 / 36
    )
    # num_graphs may not be omitted (the reference's rule: it is never guessed from batch_idx)
    with pytest.raises(ValueError, match=r"ForceMSELoss requires num_graphs=\.\.\. metadata"):
        ForceMSELoss()(zeros(F_TARGET), F_TARGET, batch_idx=BATCH_IDX)


# ------------------------------------------------------------------------------- stress


def test_stress_values_and_missing_structure():
    pred = zeros(S_TARGET)
    loss = StressMSELoss()
    assert loss(pred, S_TARGET).item() == pytest.approx(2.0)
    assert loss.per_sample_loss.tolist() == pytest.approx([1.0, 3.0])
    assert torch.allclose(loss.per_sample_loss, frobenius_mse(pred.detach(), S_TARGET))
    target = S_TARGET.clone()
    target[0] = NAN  # e.g. an open-boundary molecule batched with a crystal
    value = loss(pred, target, missing_labels=torch.tensor([True, False]))
    assert value.item() == pytest.approx(3.0)  # mean over the one labelled structure
    assert math.isnan(loss.per_sample_loss[0].item()) and loss.per_sample_loss[1].item() == 3.0
    assert loss.per_sample_valid.tolist() == [False, True]
    value.backward()
    assert torch.equal(pred.grad[0], torch.zeros(3, 3, dtype=torch.float64))
    assert torch.allclose(pred.grad[1], -2 * S_TARGET[1] / 9)
    expected = (huber(1, 1.5) + 3 * huber(3, 1.5) / 9) / 2
    assert StressHuberLoss(delta=1.5)(zeros(S_TARGET), S_TARGET).item() == pytest.approx(expected)


# ------------------------------------------------------------------------------- contract


def test_every_leaf_declares_requires_eval_grad():
    flags = {cls.__name__: cls.requires_eval_grad for cls in ALL_LEAVES}
    assert flags == {
        "EnergyMSELoss": False,
        "EnergyMAELoss": False,
        "EnergyHuberLoss": False,
        "ForceMSELoss": True,
        "ForceHuberLoss": True,
        "ForceL2NormLoss": True,
        "StressMSELoss": True,
        "StressHuberLoss": True,
    }


@pytest.mark.parametrize("cls", ALL_LEAVES)
def test_leaves_are_stateless_and_weightless(cls):
    leaf = cls()
    assert leaf.state_dict() == {} and not hasattr(leaf, "weight")
    assert leaf.dtype_policy == "strict"
    assert "dtype_policy=None" in repr(leaf)


def test_defaults_follow_the_spec():
    assert (EnergyMSELoss().per_atom, EnergyMSELoss().ignore_nonfinite) == (False, False)
    assert (EnergyMAELoss().per_atom, EnergyMAELoss().ignore_nonfinite) == (True, True)
    assert (EnergyHuberLoss().delta, EnergyHuberLoss().per_atom) == (0.01, True)
    assert ForceMSELoss().normalize_by_atom_count and not ForceMSELoss().ignore_nonfinite
    assert not ForceHuberLoss().normalize_by_atom_count and ForceHuberLoss().ignore_nonfinite
    assert ForceL2NormLoss().normalize_by_atom_count and ForceL2NormLoss().ignore_nonfinite
    assert not StressMSELoss().ignore_nonfinite and StressHuberLoss().ignore_nonfinite
    assert (ForceMSELoss().prediction_key, ForceMSELoss().target_key) == (
        "predicted_forces",
        "forces",
    )
    assert StressHuberLoss().prediction_key == "predicted_stress"


@pytest.mark.parametrize("cls", [EnergyHuberLoss, ForceHuberLoss, StressHuberLoss])
def test_huber_delta_must_be_positive(cls):
    with pytest.raises(ValueError, match=r"delta must be a positive number"):
        cls(delta=0.0)


def test_base_class_is_abstract():
    with pytest.raises(TypeError):
        BaseLossFunction()


def test_strict_dtype_error_names_both_dtypes_and_the_other_policies():
    with pytest.raises(ValueError) as info:
        EnergyMSELoss()(E_PRED.float(), E_TARGET)
    message = str(info.value)
    assert "torch.float32" in message and "torch.float64" in message
    assert "prediction_key='predicted_energy'" in message and "target_key='energy'" in message
    assert "'prediction_to_target'" in message and "'target_to_prediction'" in message


def test_dtype_policies_cast():
    value = EnergyMSELoss(dtype_policy="prediction_to_target")(E_PRED.float(), E_TARGET)
    assert value.dtype == torch.float64
    value = EnergyMSELoss(dtype_policy="target_to_prediction")(E_PRED.float(), E_TARGET)
    assert value.dtype == torch.float32 and value.item() == pytest.approx(50 / 3)
    with pytest.raises(
        ValueError, match=r"dtype_policy must be one of 'strict', 'prediction_to_target'"
    ):
        EnergyMSELoss(dtype_policy="loose")
    leaf = EnergyMSELoss()
    leaf.dtype_policy = "target_to_prediction"
    assert leaf.dtype_policy == "target_to_prediction"


def test_shapes_must_match_exactly():
    with pytest.raises(ValueError, match=r"shape must match exactly"):
        EnergyMSELoss()(E_PRED, E_TARGET[:, 0])
    with pytest.raises(ValueError, match=r"shape mismatch; prediction has shape \(2,\)"):
        assert_same_shape(torch.ones(2), torch.ones(3), name="X")
    assert_same_shape(torch.ones(2, 1), torch.ones(2), name="X")  # broadcastable is fine


# ------------------------------------------------------------------------------- reductions


def test_per_graph_reductions():
    values = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    idx = torch.tensor([0, 0, 2, 2])
    assert per_graph_sum(values, idx, 4).tolist() == [[3.0], [0.0], [7.0], [0.0]]
    assert per_graph_mean(values, idx, 4).tolist() == [[1.5], [0.0], [3.5], [0.0]]
    assert per_graph_sum(values[:, 0], idx).tolist() == [3.0, 0.0, 7.0]
    with pytest.raises(ValueError, match=r"num_graphs must be positive"):
        per_graph_sum(values, idx, 0)
    with pytest.raises(ValueError, match=r"batch_idx must be 1-D"):
        per_graph_sum(values, idx[None])
    with pytest.raises(ValueError, match=r"num_graphs must be given when batch_idx is empty"):
        per_graph_sum(values[:0], idx[:0])


def test_frobenius_mse():
    a, b = torch.zeros(2, 3, 3), S_TARGET.float()
    assert frobenius_mse(a, b).tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match=r"shapes must match"):
        frobenius_mse(a, b[:1])
    with pytest.raises(ValueError, match=r"expects"):
        frobenius_mse(a[0], b[0])


def test_real_batch_mixed_molecule_and_crystal():
    data = pytest.importorskip("nvalchemi.data")
    from nvalchemi.training.losses import compute_supervised_loss

    g = torch.Generator().manual_seed(0)
    molecule = data.AtomicData(
        atomic_numbers=torch.tensor([1, 8, 1]),
        positions=torch.randn(3, 3, generator=g),
        energy=torch.tensor([[-1.0]]),
        forces=torch.randn(3, 3, generator=g),
    )
    crystal = data.AtomicData(
        atomic_numbers=torch.tensor([14, 14]),
        positions=torch.randn(2, 3, generator=g),
        cell=5.0 * torch.eye(3)[None],
        pbc=torch.ones(1, 3, dtype=torch.bool),
        energy=torch.tensor([[-2.0]]),
        forces=torch.randn(2, 3, generator=g),
        stress=torch.randn(1, 3, 3, generator=g),
    )
    batch = data.Batch.from_data_list([molecule, crystal])
    preds = {
        "predicted_energy": torch.zeros_like(batch.energy),
        "predicted_forces": torch.zeros_like(batch.forces),
        "predicted_stress": torch.zeros_like(batch.stress, requires_grad=True),
    }
    loss_fn = EnergyMSELoss() + ForceMSELoss() + StressMSELoss()
    out = compute_supervised_loss(loss_fn, preds, batch, step=0)
    assert out["per_component_unweighted"]["StressMSELoss"].item() == pytest.approx(
        (crystal.stress**2).mean().item()
    )
    out["total_loss"].backward()
    assert (
        torch.isfinite(out["total_loss"]) and torch.isfinite(preds["predicted_stress"].grad).all()
    )


# ------------------------------------------------------------------------------- loss weights

LOSS_WEIGHT = torch.tensor([2.0, 0.0, 1.0], dtype=torch.float64)


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        (EnergyMSELoss(), (2 * 9 + 0 * 25 + 16) / 3),
        (EnergyMSELoss(per_atom=True), (2 * 3 * 1 + 0 + 2 * 4) / (2 * 3 + 0 + 2)),
        (EnergyMAELoss(), (2 * 3 * 1 + 0 + 2 * 2) / (2 * 3 + 0 + 2)),
        (EnergyHuberLoss(delta=1.5), (2 * huber(1, 1.5) + 0 + huber(2, 1.5)) / 3),
    ],
)
def test_energy_loss_weight_is_a_weighted_mean_over_structures(loss, expected):
    # weights 2, 0, 1: divided by their sum (3 here, so a mean over structures is unchanged;
    # a mean weighted by atom counts divides by sum(w * N) = 8)
    value = loss(E_PRED, E_TARGET, num_nodes_per_graph=COUNTS, loss_weight=LOSS_WEIGHT[:, None])
    assert value.item() == pytest.approx(expected)
    weighted_samples = loss.per_sample_loss.clone()
    loss(E_PRED, E_TARGET, num_nodes_per_graph=COUNTS)
    # per-sample values stay the structures' own (unweighted) errors
    assert torch.equal(weighted_samples, loss.per_sample_loss)


def test_loss_weight_scales_the_gradient_of_its_structure_proportionally():
    pred = E_PRED.clone().requires_grad_()
    EnergyMSELoss()(pred, E_TARGET).backward()
    plain = pred.grad.clone()
    pred.grad = None
    EnergyMSELoss()(pred, E_TARGET, loss_weight=LOSS_WEIGHT).backward()
    assert torch.allclose(pred.grad, plain * LOSS_WEIGHT[:, None])


F_WEIGHT = torch.tensor([3.0, 0.5], dtype=torch.float64)


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        (ForceMSELoss(), (3 * 14 / 9 + 0.5 * 7 / 6) / 3.5),
        (ForceMSELoss(normalize_by_atom_count=False), (3 * 14 + 0.5 * 7) / (3 * 9 + 0.5 * 6)),
        (ForceL2NormLoss(), (3 * 6 / 3 + 0.5 * (math.sqrt(3) + 2) / 2) / 3.5),
        (
            ForceL2NormLoss(normalize_by_atom_count=False),
            (3 * 6 + 0.5 * (math.sqrt(3) + 2)) / (3 * 3 + 0.5 * 2),
        ),
        (
            ForceHuberLoss(delta=1.5),
            (
                3 * (huber(1, 1.5) + huber(2, 1.5) + huber(3, 1.5))
                + 0.5 * (3 * huber(1, 1.5) + huber(2, 1.5))
            )
            / (3 * 9 + 0.5 * 6),
        ),
    ],
)
def test_force_loss_weight_weights_each_atom_by_its_structure(loss, expected):
    pred = zeros(F_TARGET)
    value = loss(pred, F_TARGET, loss_weight=F_WEIGHT, **F_META)
    assert value.item() == pytest.approx(expected)


def test_stress_loss_weight():
    value = StressMSELoss()(zeros(S_TARGET), S_TARGET, loss_weight=torch.tensor([0.0, 2.0]))
    assert value.item() == pytest.approx((0 * 1 + 2 * 3) / 2)


def test_loss_weight_of_the_wrong_shape_or_dtype_is_refused():
    with pytest.raises(
        ValueError,
        match=r"EnergyMSELoss: expected one value per structure of target_key='energy' "
        r"\(shape \(3,\)\); got shape \(2,\)",
    ):
        EnergyMSELoss()(E_PRED, E_TARGET, loss_weight=torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"ForceMSELoss: loss_weight must be a floating tensor"):
        ForceMSELoss()(
            zeros(F_TARGET), F_TARGET, loss_weight=torch.ones(2, dtype=torch.long), **F_META
        )
    with pytest.raises(
        ValueError, match=r"shape \(num_graphs,\) or \(num_graphs, 1\); got shape \(2, 2\)"
    ):
        StressMSELoss()(zeros(S_TARGET), S_TARGET, loss_weight=torch.ones(2, 2))


def test_batch_loss_weight_collates_and_reaches_every_leaf():
    data = pytest.importorskip("nvalchemi.data")
    from nvalchemi.training.losses import compute_supervised_loss

    def structure(n, energy, weight=None):
        extra = {} if weight is None else {"loss_weight": torch.tensor(weight)}
        return data.AtomicData(
            atomic_numbers=torch.ones(n, dtype=torch.long),
            positions=torch.randn(n, 3),
            energy=torch.tensor(energy),
            forces=torch.ones(n, 3),
            **extra,
        )

    # one-atom structures make the level of a custom (1, 1) field ambiguous: the table decides
    items = [structure(1, 1.0, 4.0), structure(2, 2.0), structure(3, 3.0, 0.0)]
    batch = data.Batch.from_data_list(items)
    assert batch.level_of("loss_weight") == "system"
    assert batch.loss_weight.tolist() == [[4.0], [1.0], [0.0]]  # absent = weight 1
    preds = {
        "predicted_energy": torch.zeros_like(batch.energy),
        "predicted_forces": torch.zeros_like(batch.forces),
    }
    loss_fn = EnergyMSELoss() + ForceMSELoss()
    out = compute_supervised_loss(loss_fn, preds, batch)
    parts = out["per_component_unweighted"]
    assert parts["EnergyMSELoss"].item() == pytest.approx((4 * 1 + 1 * 4 + 0 * 9) / 5)
    assert parts["ForceMSELoss"].item() == pytest.approx((4 + 1 + 0) / 5)
    unweighted = data.Batch.from_data_list([structure(1, 1.0), structure(2, 2.0)])
    assert "loss_weight" not in unweighted


# ------------------------------------------------------------------------------- padded forces

# The F_TARGET structures (3 and 2 atoms) in the padded layout (B, N_max=4, 3), zero padding.
F_PADDED = torch.zeros((2, 4, 3), dtype=torch.float64)
F_PADDED[0, :3], F_PADDED[1, :2] = F_TARGET[:3], F_TARGET[3:]
F_COUNTS = torch.tensor([3, 2])
FORCE_LEAVES = [
    ForceMSELoss(),
    ForceMSELoss(normalize_by_atom_count=False),
    ForceHuberLoss(delta=1.5),
    ForceHuberLoss(delta=1.5, normalize_by_atom_count=True),
    ForceL2NormLoss(),
    ForceL2NormLoss(normalize_by_atom_count=False),
]


@pytest.mark.parametrize("loss", FORCE_LEAVES, ids=repr)
@pytest.mark.parametrize("nodes", ["counts", "mask"])
def test_padded_forces_give_the_flat_value_and_gradient(loss, nodes):
    pred_flat = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pred_pad = torch.full((2, 4, 3), 5.0, dtype=torch.float64)  # padding must not count
    pred_pad[0, :3], pred_pad[1, :2] = pred_flat[:3], pred_flat[3:]
    pred_flat.requires_grad_(), pred_pad.requires_grad_()
    num_nodes = F_COUNTS if nodes == "counts" else torch.arange(4)[None, :] < F_COUNTS[:, None]
    flat = loss(pred_flat, F_TARGET, num_nodes_per_graph=F_COUNTS, **F_META)
    padded = loss(pred_pad, F_PADDED, num_nodes_per_graph=num_nodes)
    assert padded.item() == pytest.approx(flat.item())
    flat.backward(), padded.backward()
    assert torch.allclose(pred_pad.grad[0, :3], pred_flat.grad[:3])
    assert torch.allclose(pred_pad.grad[1, :2], pred_flat.grad[3:])
    assert torch.equal(pred_pad.grad[0, 3], torch.zeros(3, dtype=torch.float64))
    # with a loss weight and a structure without forces too
    weight = torch.tensor([2.0, 0.5], dtype=torch.float64)
    missing = torch.tensor([False, True])
    flat = loss(pred_flat, F_TARGET, loss_weight=weight, missing_labels=missing, **F_META)
    padded = loss(
        pred_pad,
        F_PADDED,
        num_nodes_per_graph=num_nodes,
        loss_weight=weight,
        missing_labels=missing,
    )
    assert padded.item() == pytest.approx(flat.item())


def test_padded_forces_need_node_counts_of_the_right_shape():
    with pytest.raises(ValueError, match=r"ForceMSELoss requires num_nodes_per_graph=\.\.\."):
        ForceMSELoss()(zeros(F_PADDED), F_PADDED)
    with pytest.raises(
        ValueError,
        match=r"ForceL2NormLoss: padded node mask width \(3\) must match force max nodes \(4\) "
        r"for padded force tensors; padded target_key='forces' of shape \(2, 4, 3\) needs "
        r"num_nodes_per_graph as atom counts of shape \(2,\) or a node mask of shape \(2, 4\)",
    ):
        ForceL2NormLoss()(zeros(F_PADDED), F_PADDED, num_nodes_per_graph=torch.ones(2, 3) > 0)


# ------------------------------------------------------------------------------- error messages


def test_leaf_errors_name_the_loss_the_key_and_expected_and_actual():
    with pytest.raises(ValueError) as info:
        ForceMSELoss()(torch.zeros(5, 3), torch.zeros(5, 3, dtype=torch.float64), **F_META)
    message = str(info.value)
    for word in (
        "ForceMSELoss",
        "prediction",
        "target",
        "dtype",
        "'predicted_forces'",
        "'forces'",
        "torch.float32",
        "torch.float64",
        "expected",
    ):
        assert word in message
    with pytest.raises(ValueError) as info:
        StressMSELoss(target_key="virial_stress")(torch.zeros(2, 9), torch.zeros(2, 3, 3))
    message = str(info.value)
    for word in ("StressMSELoss", "shape", "'virial_stress'", "(2, 9)", "(2, 3, 3)", "expected"):
        assert word in message
    with pytest.raises(ValueError, match=r"ForceMSELoss: target_key='forces' must have shape"):
        ForceMSELoss()(torch.zeros(5), torch.zeros(5), **F_META)


def test_composition_key_errors_name_the_loss_and_the_keys_on_offer():
    from nvalchemi.training.losses import as_composed_loss

    with pytest.raises(KeyError) as info:
        as_composed_loss(ForceMSELoss())({"predicted_energy": E_PRED}, {"forces": F_TARGET})
    message = str(info.value)
    assert "ForceMSELoss" in message and "'predicted_forces'" in message
    assert "['predicted_energy']" in message


# ------------------------------------------------------------------------------- the batch path


def _structure(n, energy=None, forces=True, seed=0):
    from nvalchemi.data import AtomicData

    g = torch.Generator().manual_seed(seed)
    labels = {} if energy is None else {"energy": torch.tensor(energy)}
    if forces:
        labels["forces"] = torch.randn(n, 3, generator=g)
    return AtomicData(
        atomic_numbers=torch.ones(n, dtype=torch.long),
        positions=torch.randn(n, 3, generator=g),
        **labels,
    )


def test_collation_marks_missing_labels_and_losses_leave_them_out():
    from nvalchemi.data import Batch
    from nvalchemi.training.losses import compute_supervised_loss

    batch = Batch.from_data_list([_structure(2, 1.0), _structure(3), _structure(1, 3.0)])
    assert batch.missing_labels["energy"].tolist() == [False, True, False]
    assert "forces" not in batch.missing_labels
    preds = {"predicted_energy": torch.zeros(3, 1), "predicted_forces": torch.zeros(6, 3)}
    out = compute_supervised_loss(EnergyMSELoss() + ForceMSELoss(), preds, batch)
    assert out["per_component_unweighted"]["EnergyMSELoss"].item() == pytest.approx((1 + 9) / 2)
    samples = out["per_component_sample"]["EnergyMSELoss"]
    assert math.isnan(samples[1].item()) and samples[0].item() == pytest.approx(0.5)
    # a NaN label that collation did not mark missing is a real non-finite value
    complete = Batch.from_data_list([_structure(2, 1.0), _structure(3, 2.0)])
    complete.energy = torch.tensor([[NAN], [2.0]])
    assert complete.missing_labels == {}
    out = compute_supervised_loss(
        EnergyMSELoss(), {"predicted_energy": torch.zeros(2, 1)}, complete
    )
    assert math.isnan(out["total_loss"].item())


def test_missing_label_masks_follow_selection_concatenation_and_devices():
    from nvalchemi.data import Batch

    a = Batch.from_data_list([_structure(2, 1.0), _structure(3)])
    b = Batch.from_data_list([_structure(1, 2.0), _structure(2, 3.0)])
    both = Batch.cat([a, b])
    assert both.missing_labels["energy"].tolist() == [False, True, False, False]
    assert both[[1, 2]].missing_labels["energy"].tolist() == [True, False]
    assert both.to("cpu", dtype=torch.float64).missing_labels["energy"].tolist() == [
        False,
        True,
        False,
        False,
    ]
    assert "energy" not in both.get_data(1) and "energy" in both.get_data(0)
    c = Batch.from_data_list([_structure(2, forces=False), _structure(2, forces=False)])
    merged = Batch.cat([a, c])  # c has no energy at all
    assert merged.missing_labels["energy"].tolist() == [False, True, True, True]
    assert merged.missing_labels["forces"].tolist() == [False, False, True, True]
    del merged.energy
    assert "energy" not in merged.missing_labels


# ------------------------------------------------------------------------------- contract details


class ReferenceStyleLoss(BaseLossFunction):
    """Written for the reference contract: ``reduce`` uses ``valid`` as a tensor."""

    requires_eval_grad = False
    prediction_key, target_key = "predicted_energy", "energy"

    def compute_residual(self, pred, target, valid):
        return (pred - target).abs()

    def reduce(self, residual, valid, ctx, **kwargs):
        return (residual * valid).sum() / valid.sum()


def test_subclasses_written_for_the_reference_get_a_tensor_mask():
    assert ReferenceStyleLoss()(E_PRED, E_TARGET).item() == pytest.approx(4.0)
    subclass = type("Defaults", (EnergyMSELoss,), {})  # only defaults changed: fast path
    assert subclass()(E_PRED, E_TARGET).item() == pytest.approx(50 / 3)


def test_per_sample_values_are_computed_when_read_and_pickle_as_a_dict():
    import pickle

    from nvalchemi.training.losses import as_composed_loss

    loss_fn = as_composed_loss(EnergyMSELoss() + 3.0 * StressMSELoss())
    out = loss_fn(
        {"predicted_energy": E_PRED[:2], "predicted_stress": zeros(S_TARGET)},
        {"energy": E_TARGET[:2], "stress": S_TARGET},
    )
    samples = out["per_component_sample"]
    restored = pickle.loads(pickle.dumps(samples))
    assert type(restored) is dict
    assert restored["StressMSELoss"].tolist() == pytest.approx([0.75, 2.25])
    assert dict(samples).keys() == {"EnergyMSELoss", "StressMSELoss"}
    assert len(samples) == 2 and "EnergyMSELoss" in samples
    assert samples["EnergyMSELoss"].tolist() == pytest.approx([9 / 4, 25 / 4])
    leaf = loss_fn.components[1]
    assert pickle.loads(pickle.dumps(leaf)).per_sample_loss.tolist() == [1.0, 3.0]


def test_nothing_missing_gives_the_autograd_graph_of_a_hand_written_loss():
    from nvalchemi.data import Batch
    from nvalchemi.training.losses import compute_supervised_loss

    pred = E_PRED.clone().requires_grad_()
    assert EnergyMSELoss()(pred, E_TARGET).grad_fn.name() == "MseLossBackward0"
    assert StressMSELoss()(zeros(S_TARGET), S_TARGET).grad_fn.name() == "MseLossBackward0"
    plain = ForceMSELoss(normalize_by_atom_count=False)
    assert plain(zeros(F_TARGET), F_TARGET, **F_META).grad_fn.name() == "MseLossBackward0"
    batch = Batch.from_data_list([_structure(2, 1.0), _structure(3, 2.0)])
    out = compute_supervised_loss(
        EnergyMSELoss(), {"predicted_energy": torch.zeros(2, 1, requires_grad=True)}, batch
    )
    assert out["total_loss"].grad_fn.name() == "MseLossBackward0"
    # a missing label takes the masked path, with the same value where nothing is masked
    mixed = Batch.from_data_list([_structure(2, 1.0), _structure(3)])
    preds = {"predicted_energy": torch.zeros(2, 1, requires_grad=True)}
    masked = compute_supervised_loss(EnergyMSELoss(), preds, mixed)["total_loss"]
    assert masked.grad_fn.name() != "MseLossBackward0" and masked.item() == pytest.approx(1.0)


def test_a_subclass_overriding_a_template_step_always_runs_it():
    seen = []

    class Checked(EnergyMSELoss):
        def validate(self, pred, target):
            seen.append(tuple(pred.shape))
            super().validate(pred, target)

    assert Checked()(E_PRED, E_TARGET).item() == pytest.approx(50 / 3)
    assert seen == [(3, 1)]
