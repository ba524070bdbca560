"""Weights in every loss: a weighted mean divided by the sum of the weights (issue 29, point 1).

Structure weights (``loss_weight``), per-label weights (``energy_weight``, ``forces_weight``,
``stress_weight``) and per-element force weights (``element_weights``).
"""

import json

import pytest
import torch

from nvalchemi.data import AtomicData, Batch
from nvalchemi.spec import create_model_spec_from_json
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
    compute_supervised_loss,
)

torch.manual_seed(0)
COUNTS = [3, 1, 4, 2]
B, N = len(COUNTS), sum(COUNTS)
BATCH_IDX = torch.repeat_interleave(torch.arange(B), torch.tensor(COUNTS))
META = {"batch_idx": BATCH_IDX, "num_graphs": B, "num_nodes_per_graph": torch.tensor(COUNTS)}
ENERGY = torch.randn(B, 1, dtype=torch.float64)
FORCES = torch.randn(N, 3, dtype=torch.float64)
STRESS = torch.randn(B, 3, 3, dtype=torch.float64)
NUMBERS = torch.tensor([1, 8, 1, 29, 1, 1, 8, 8, 29, 1])
WEIGHTS = torch.tensor([2.0, 0.5, 0.0, 3.0], dtype=torch.float64)

ENERGY_LEAVES = [
    EnergyMSELoss(),
    EnergyMSELoss(per_atom=True),
    EnergyMAELoss(),
    EnergyMAELoss(per_atom=False),
    EnergyHuberLoss(delta=0.3),
]
FORCE_LEAVES = [
    ForceMSELoss(),
    ForceMSELoss(normalize_by_atom_count=False),
    ForceHuberLoss(delta=0.3),
    ForceHuberLoss(delta=0.3, normalize_by_atom_count=True),
    ForceL2NormLoss(),
    ForceL2NormLoss(normalize_by_atom_count=False),
]
STRESS_LEAVES = [StressMSELoss(), StressHuberLoss(delta=0.3)]


def case(loss):
    """``(prediction, target)`` of a leaf (predictions require grad)."""
    target = {"energy": ENERGY, "forces": FORCES, "stress": STRESS}[loss.target_key]
    return (target + 0.7 * torch.randn_like(target)).requires_grad_(), target


def value_and_grad(loss, pred, target, **kwargs):
    pred.grad = None
    value = loss(pred, target, **META, **kwargs)
    value.backward()
    return value.detach(), pred.grad.clone()


ALL = ENERGY_LEAVES + FORCE_LEAVES + STRESS_LEAVES
IDS = [f"{type(x).__name__}-{i}" for i, x in enumerate(ALL)]


@pytest.mark.parametrize("loss", ALL, ids=IDS)
def test_a_weight_of_2_on_every_structure_changes_nothing(loss):
    pred, target = case(loss)
    plain = value_and_grad(loss, pred, target)
    twice = value_and_grad(loss, pred, target, loss_weight=torch.full((B,), 2.0))
    assert torch.allclose(plain[0], twice[0]) and torch.allclose(plain[1], twice[1])
    label = value_and_grad(
        loss, pred, target, label_weights={loss.target_key: torch.full((B, 1), 2.0)}
    )
    assert torch.allclose(plain[0], label[0]) and torch.allclose(plain[1], label[1])
    # the same with a structure without the label: it stays out
    missing = torch.tensor([False, True, False, False])
    left_out = value_and_grad(loss, pred, target, missing_labels={loss.target_key: missing})
    both = value_and_grad(
        loss,
        pred,
        target,
        missing_labels={loss.target_key: missing},
        loss_weight=torch.full((B,), 2.0),
    )
    assert torch.allclose(left_out[0], both[0]) and torch.allclose(left_out[1], both[1])


@pytest.mark.parametrize("loss", FORCE_LEAVES, ids=IDS[len(ENERGY_LEAVES) : -len(STRESS_LEAVES)])
def test_element_weights_scaled_together_change_nothing(loss):
    pred, target = case(loss)
    kwargs = {"atomic_numbers": NUMBERS, "loss_weight": WEIGHTS}
    loss.element_weights = {"H": 0.5, "O": 2.0, "Cu": 1.0}
    once = value_and_grad(loss, pred, target, **kwargs)
    loss.element_weights = {"H": 1.5, "O": 6.0, "Cu": 3.0}
    thrice = value_and_grad(loss, pred, target, **kwargs)
    loss.element_weights = None
    assert torch.allclose(once[0], thrice[0]) and torch.allclose(once[1], thrice[1])
    plain = value_and_grad(loss, pred, target, **kwargs)
    assert not torch.allclose(once[0], plain[0])  # they do weight something


def test_energy_weighted_means_by_hand():
    pred, target = case(EnergyMSELoss())
    r = (pred - target).detach().reshape(-1)
    n = torch.tensor(COUNTS, dtype=torch.float64)
    w = WEIGHTS
    mse = EnergyMSELoss()(pred, target, loss_weight=w, **META)
    assert mse.item() == pytest.approx(float((w * r**2).sum() / w.sum()))
    per_atom = EnergyMSELoss(per_atom=True)(pred, target, loss_weight=w, **META)
    assert per_atom.item() == pytest.approx(float((w * n * (r / n) ** 2).sum() / (w * n).sum()))
    mae = EnergyMAELoss()(pred, target, loss_weight=w, **META)
    assert mae.item() == pytest.approx(float((w * r.abs()).sum() / (w * n).sum()))


def test_force_weighted_means_by_hand():
    pred, target = case(ForceMSELoss())
    sq = ((pred - target).detach() ** 2).sum(-1)  # per atom, over components
    z_weight = torch.where(NUMBERS == 8, 2.0, 1.0).double()
    atom_w = WEIGHTS[BATCH_IDX]
    per_structure = torch.zeros(B, dtype=torch.float64).index_add(0, BATCH_IDX, z_weight * sq)
    per_structure /= 3 * torch.zeros(B, dtype=torch.float64).index_add(0, BATCH_IDX, z_weight)
    loss = ForceMSELoss(element_weights={"O": 2.0})
    value = loss(pred, target, loss_weight=WEIGHTS, atomic_numbers=NUMBERS, **META)
    assert value.item() == pytest.approx(float((WEIGHTS * per_structure).sum() / WEIGHTS.sum()))
    assert torch.allclose(loss.per_sample_loss, per_structure)  # unweighted by structure
    flat = ForceMSELoss(normalize_by_atom_count=False, element_weights={8: 2.0})
    value = flat(pred, target, loss_weight=WEIGHTS, atomic_numbers=NUMBERS, **META)
    expected = (atom_w * z_weight * sq).sum() / (3 * (atom_w * z_weight).sum())
    assert value.item() == pytest.approx(float(expected))


def test_stress_weighted_mean_by_hand():
    pred, target = case(StressMSELoss())
    per = ((pred - target).detach() ** 2).reshape(B, -1).mean(1)
    value = StressMSELoss()(pred, target, label_weights={"stress": WEIGHTS[:, None]}, **META)
    assert value.item() == pytest.approx(float((WEIGHTS * per).sum() / WEIGHTS.sum()))


def test_all_weights_zero_gives_a_zero_loss_with_finite_gradients():
    for loss in ALL:
        pred, target = case(loss)
        value, grad = value_and_grad(loss, pred, target, loss_weight=torch.zeros(B))
        assert value.item() == 0.0 and bool(torch.isfinite(grad).all()) and not grad.any()


def _padded(flat: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(B, max(COUNTS), *flat.shape[1:], dtype=flat.dtype)
    for g, (start, n) in enumerate(zip([0, 3, 4, 8], COUNTS)):
        out[g, :n] = flat[start : start + n]
    return out


@pytest.mark.parametrize("loss", FORCE_LEAVES, ids=IDS[len(ENERGY_LEAVES) : -len(STRESS_LEAVES)])
def test_weighted_forces_agree_in_the_padded_layout(loss):
    pred, target = case(loss)
    loss.element_weights = {"O": 2.0, "H": 0.25}
    kwargs = {"loss_weight": WEIGHTS, "missing_labels": torch.tensor([False, False, True, False])}
    flat = loss(pred, target, atomic_numbers=NUMBERS, **META, **kwargs)
    counts = torch.tensor(COUNTS)
    padded = loss(
        _padded(pred.detach()),
        _padded(target),
        num_nodes_per_graph=counts,
        atomic_numbers=NUMBERS,
        **kwargs,
    )
    padded_numbers = loss(
        _padded(pred.detach()),
        _padded(target),
        num_nodes_per_graph=counts,
        atomic_numbers=_padded(NUMBERS),
        **kwargs,
    )
    loss.element_weights = None
    assert padded.item() == pytest.approx(flat.item())
    assert padded_numbers.item() == pytest.approx(flat.item())


def test_element_weights_are_checked_and_round_trip_through_a_spec():
    loss = ForceMSELoss(element_weights={"H": 0.5, 29: 2})
    assert loss.element_weights == {"H": 0.5, "Cu": 2.0}
    rebuilt = create_model_spec_from_json(json.loads(json.dumps(loss.to_spec().model_dump())))
    assert rebuilt.build().element_weights == {"H": 0.5, "Cu": 2.0}
    with pytest.raises(
        ValueError, match=r"ForceMSELoss: element_weights has an unknown element 'Xx'"
    ):
        ForceMSELoss(element_weights={"Xx": 1.0})
    with pytest.raises(ValueError, match=r"element_weights\['H'\] must be finite and >= 0"):
        ForceL2NormLoss(element_weights={"H": -1.0})
    with pytest.raises(ValueError, match=r"requires atomic_numbers=\.\.\. metadata"):
        loss(FORCES + 1, FORCES, **META)


def _structure(n, seed, **extra):
    g = torch.Generator().manual_seed(seed)
    return AtomicData(
        atomic_numbers=torch.tensor(([1, 8] * n)[:n]),
        positions=torch.randn(n, 3, generator=g),
        energy=torch.randn(1, 1, generator=g),
        forces=torch.randn(n, 3, generator=g),
        **{k: torch.tensor([[v]]) for k, v in extra.items()},
    )


def test_label_weights_of_a_batch_reach_only_their_own_leaf():
    items = [
        _structure(3, 0, forces_weight=4.0),
        _structure(2, 1, energy_weight=0.0),
        _structure(4, 2),
    ]
    batch = Batch.from_data_list(items)
    assert batch.forces_weight.reshape(-1).tolist() == [4.0, 1.0, 1.0]  # absent: 1
    assert batch.energy_weight.reshape(-1).tolist() == [1.0, 0.0, 1.0]
    preds = {
        "predicted_energy": torch.zeros_like(batch.energy),
        "predicted_forces": torch.zeros_like(batch.forces),
    }
    out = compute_supervised_loss(EnergyMSELoss() + ForceMSELoss(), preds, batch)
    e = batch.energy.reshape(-1) ** 2
    assert out["per_component_unweighted"]["EnergyMSELoss"].item() == pytest.approx(
        float((e[0] + e[2]) / 2)
    )
    f = ForceMSELoss()
    f(preds["predicted_forces"], batch.forces, batch=batch)
    per = f.per_sample_loss
    expected = (4 * per[0] + per[1] + per[2]) / 6
    assert out["per_component_unweighted"]["ForceMSELoss"].item() == pytest.approx(float(expected))


class _Spy(BaseLossFunction):
    """A leaf recording the keywords it is called with."""

    requires_eval_grad = False
    target_key, prediction_key = "energy", "predicted_energy"

    def __init__(self):
        super().__init__()
        self.seen = set()

    def forward(self, pred, target, **kwargs):
        self.seen = set(kwargs)
        return (pred - target).pow(2).mean()

    def compute_residual(self, pred, target, valid):  # pragma: no cover - forward is custom
        return pred - target


def test_without_weights_the_loss_call_gets_nothing_new():
    batch = Batch.from_data_list([_structure(3, 0), _structure(2, 1)])
    spy = _Spy()
    preds = {"predicted_energy": torch.zeros_like(batch.energy)}
    compute_supervised_loss(
        spy + ForceMSELoss(), {**preds, "predicted_forces": batch.forces}, batch
    )
    assert spy.seen == {"batch_idx", "num_graphs", "num_nodes_per_graph"}
    weighted = Batch.from_data_list([_structure(3, 0, energy_weight=2.0), _structure(2, 1)])
    compute_supervised_loss(
        spy + ForceMSELoss(element_weights={"O": 2.0}),
        {"predicted_energy": torch.zeros(2, 1), "predicted_forces": weighted.forces},
        weighted,
    )
    assert {"label_weights", "atomic_numbers"} <= spy.seen


def test_weighted_losses_split_exactly_into_pieces():
    """A batch trained in pieces (out of memory) keeps the weighted loss of the whole batch."""
    from nvalchemi.training._memory_split import LossShares, halves

    items = [
        _structure(3, 0, loss_weight=2.0, forces_weight=0.5),
        _structure(2, 1, energy_weight=3.0),
        _structure(5, 2, loss_weight=0.25),
        _structure(1, 3),
        _structure(4, 4, forces_weight=4.0),
    ]
    batch = Batch.from_data_list(items)
    loss_fn = (
        EnergyMSELoss()
        + EnergyMSELoss(per_atom=True)
        + ForceMSELoss(element_weights={"O": 3.0})
        + ForceMSELoss(normalize_by_atom_count=False, element_weights={"H": 0.5})
        + ForceL2NormLoss(normalize_by_atom_count=False)
    )
    loss_fn.normalize_weights = False

    def parts(b):
        g = torch.Generator().manual_seed(b.num_nodes)
        preds = {
            "predicted_energy": torch.zeros_like(b.energy),
            "predicted_forces": torch.randn(b.forces.shape, generator=g, dtype=b.forces.dtype),
        }
        return compute_supervised_loss(loss_fn, preds, b)["per_component_unweighted"]

    first, second = halves(batch)
    shares = LossShares(loss_fn, batch)
    k = first.num_graphs
    g1, g2 = (torch.Generator().manual_seed(p.num_nodes) for p in (first, second))
    forces = torch.cat(
        [
            torch.randn(first.forces.shape, generator=g1, dtype=first.forces.dtype),
            torch.randn(second.forces.shape, generator=g2, dtype=second.forces.dtype),
        ]
    )
    preds = {"predicted_energy": torch.zeros_like(batch.energy), "predicted_forces": forces}
    whole = compute_supervised_loss(loss_fn, preds, batch)["per_component_unweighted"]
    a, b = parts(first), parts(second)
    share_a, share_b = shares.of(0, k), shares.of(k, batch.num_graphs)
    for name, value in whole.items():
        pieces = share_a[name] * a[name] + share_b[name] * b[name]
        assert pieces.item() == pytest.approx(value.item(), rel=1e-6), name
