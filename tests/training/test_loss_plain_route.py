"""The plain route of ``compute_supervised_loss``: a fully labelled ``Batch`` skips the general
path, gives the general path's output to the bit (values, gradients, per-sample values), and
declines every case that needs masking, weighting, hooks or the general path's errors."""

import pytest
import torch
import torch.nn.functional as F

from nvalchemi.data import AtomicData, Batch
from nvalchemi.training.losses import (
    ComposedLossFunction,
    EnergyHuberLoss,
    EnergyMAELoss,
    EnergyMSELoss,
    ForceHuberLoss,
    ForceL2NormLoss,
    ForceMSELoss,
    StressHuberLoss,
    StressMSELoss,
    assemble_loss_targets,
    compute_supervised_loss,
    terms,
)

COUNTS = (2, 3, 1)


def make_batch(dtype=torch.float32, energy_missing=False, loss_weight=False) -> Batch:
    g = torch.Generator().manual_seed(0)
    structures = []
    for i, n in enumerate(COUNTS):
        fields = dict(
            atomic_numbers=torch.ones(n, dtype=torch.long),
            positions=torch.randn(n, 3, generator=g, dtype=dtype),
            forces=torch.randn(n, 3, generator=g, dtype=dtype),
            stress=torch.randn(1, 3, 3, generator=g, dtype=dtype),
        )
        if not (energy_missing and i == 1):
            fields["energy"] = torch.randn(1, 1, generator=g, dtype=dtype)
        if loss_weight:
            fields["loss_weight"] = torch.tensor([float(i + 1)], dtype=dtype)
        structures.append(AtomicData(**fields))
    return Batch.from_data_list(structures)


def make_predictions(batch: Batch) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    dtype = batch.forces.dtype
    return {
        "predicted_energy": torch.randn(3, 1, generator=g, dtype=dtype).requires_grad_(),
        "predicted_forces": torch.randn(6, 3, generator=g, dtype=dtype).requires_grad_(),
        "predicted_stress": torch.randn(3, 3, 3, generator=g, dtype=dtype).requires_grad_(),
    }


def general(loss_fn, predictions, batch, step=0):
    """The general path, by hand: assembled targets and the composition's forward."""
    targets = assemble_loss_targets(loss_fn, predictions, batch)
    meta = {
        "batch_idx": batch.batch_idx,
        "num_graphs": batch.num_graphs,
        "num_nodes_per_graph": batch.num_nodes_per_graph,
    }
    return loss_fn(predictions, targets, step=step, epoch=0, **meta)


PLAIN_LOSSES = {
    "energy": lambda: EnergyMSELoss(),
    "energy+forces": lambda: EnergyMSELoss() + ForceMSELoss(),
    "unnormalized forces, weights 1": lambda: ComposedLossFunction(
        [EnergyMSELoss(), ForceMSELoss(normalize_by_atom_count=False)],
        normalize_weights=False,
    ),
    "weighted, three terms": lambda: 2.0 * EnergyMSELoss() + 0.5 * ForceMSELoss() + StressMSELoss(),
    "force norm, balanced": lambda: ForceL2NormLoss(ignore_nonfinite=False),
    "huber": lambda: (
        EnergyHuberLoss(per_atom=False, ignore_nonfinite=False)
        + ForceHuberLoss(ignore_nonfinite=False)
    ),
    "stress mse + huber": lambda: ComposedLossFunction(
        [StressMSELoss(), StressHuberLoss(ignore_nonfinite=False)], normalize_weights=False
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(PLAIN_LOSSES))
def test_the_plain_route_gives_the_general_paths_output_to_the_bit(name, dtype):
    batch = make_batch(dtype)
    fast_fn, slow_fn = PLAIN_LOSSES[name](), PLAIN_LOSSES[name]()
    fast_fn = (
        fast_fn if isinstance(fast_fn, ComposedLossFunction) else ComposedLossFunction([fast_fn])
    )
    slow_fn = (
        slow_fn if isinstance(slow_fn, ComposedLossFunction) else ComposedLossFunction([slow_fn])
    )
    pred_fast, pred_slow = make_predictions(batch), make_predictions(batch)

    assert fast_fn.plain_output(pred_fast, batch, 3, 0) is not None  # the route is taken
    fast = compute_supervised_loss(fast_fn, pred_fast, batch, step=3, epoch=0)
    slow = general(slow_fn, pred_slow, batch, step=3)

    assert torch.equal(fast["total_loss"], slow["total_loss"])
    assert fast["per_component_weight"] == slow["per_component_weight"]
    assert fast["per_component_raw_weight"] == slow["per_component_raw_weight"]
    assert fast["per_component_unweighted"].keys() == slow["per_component_unweighted"].keys()
    for key, value in fast["per_component_unweighted"].items():
        assert torch.equal(value, slow["per_component_unweighted"][key]), key
    assert fast["per_component_sample"].keys() == slow["per_component_sample"].keys()
    for key, value in fast["per_component_sample"].items():
        assert torch.equal(value, slow["per_component_sample"][key]), key
    for leaf_fast, leaf_slow in zip(fast_fn.components, slow_fn.components):
        a, b = leaf_fast.per_sample_loss, leaf_slow.per_sample_loss
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    fast["total_loss"].backward()
    slow["total_loss"].backward()
    for key in pred_fast:
        a, b = pred_fast[key].grad, pred_slow[key].grad
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), key


def declines(loss_fn, batch, predictions=None) -> bool:
    predictions = make_predictions(batch) if predictions is None else predictions
    return loss_fn.plain_output(predictions, batch, 0, 0) is None


def test_the_plain_route_declines_what_needs_masks_weights_or_the_general_path():
    plain = EnergyMSELoss() + ForceMSELoss()
    assert not declines(plain, make_batch())
    # masking or weighting: the batch's missing labels, loss weights, ignore_nonfinite
    assert declines(plain, make_batch(energy_missing=True))
    assert declines(plain, make_batch(loss_weight=True))
    assert declines(ComposedLossFunction([ForceMSELoss(ignore_nonfinite=True)]), make_batch())
    # template steps the leaf does differently: per-atom energies, the padded layout
    assert declines(ComposedLossFunction([EnergyMSELoss(per_atom=True)]), make_batch())
    assert declines(ComposedLossFunction([EnergyMAELoss(ignore_nonfinite=False)]), make_batch())
    batch = make_batch()
    padded = make_predictions(batch)
    padded["predicted_forces"] = torch.zeros(3, 3, 3)
    batch.add_key("forces", torch.zeros(3, 3, 3), level="graph", overwrite=True)
    assert declines(ComposedLossFunction([ForceMSELoss()]), batch, padded)
    # inputs the general path must check (and name in its errors)
    wrong_dtype = make_predictions(make_batch())
    wrong_dtype["predicted_energy"] = wrong_dtype["predicted_energy"].double()
    assert declines(plain, make_batch(), wrong_dtype)
    wrong_shape = make_predictions(make_batch())
    wrong_shape["predicted_energy"] = wrong_shape["predicted_energy"].reshape(-1)
    assert declines(plain, make_batch(), wrong_shape)
    missing_prediction = make_predictions(make_batch())
    del missing_prediction["predicted_forces"]
    assert declines(plain, make_batch(), missing_prediction)
    # a target that is not a batch field (distillation reads it from the predictions)
    teacher = ComposedLossFunction([EnergyMSELoss(target_key="teacher_energy")])
    distill = make_predictions(make_batch())
    distill["teacher_energy"] = torch.zeros(3, 1)
    assert declines(teacher, make_batch(), distill)
    out = compute_supervised_loss(teacher, distill, make_batch())
    expected = F.mse_loss(distill["predicted_energy"], distill["teacher_energy"])
    assert torch.equal(out["total_loss"], expected)

    # a leaf whose custom forward would be skipped
    class Custom(EnergyMSELoss):
        def forward(self, pred, target, **kwargs):
            return super().forward(pred, target, **kwargs) * 3

    assert declines(ComposedLossFunction([Custom()]), make_batch())


def test_errors_still_come_from_the_general_path():
    batch = make_batch()
    predictions = make_predictions(batch)
    predictions["predicted_energy"] = predictions["predicted_energy"].double()
    with pytest.raises(ValueError, match="dtype mismatch"):
        compute_supervised_loss(EnergyMSELoss() + ForceMSELoss(), predictions, batch)
    del predictions["predicted_energy"]
    with pytest.raises(KeyError, match="predicted_energy"):
        compute_supervised_loss(EnergyMSELoss(), predictions, batch)


def test_module_hooks_on_a_leaf_the_composition_or_globally_still_run():
    batch = make_batch()
    calls = []
    leaf = EnergyMSELoss()
    handle = leaf.register_forward_hook(lambda module, args, out: calls.append("leaf"))
    loss_fn = ComposedLossFunction([leaf])
    assert declines(loss_fn, batch)
    compute_supervised_loss(loss_fn, make_predictions(batch), batch)
    handle.remove()
    assert calls == ["leaf"]

    loss_fn = ComposedLossFunction([EnergyMSELoss()])
    handle = loss_fn.register_forward_hook(lambda module, args, out: calls.append("composition"))
    compute_supervised_loss(loss_fn, make_predictions(batch), batch)
    handle.remove()
    assert calls == ["leaf", "composition"]

    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: calls.append(type(module).__name__)
    )
    try:
        assert declines(loss_fn, batch)
        compute_supervised_loss(loss_fn, make_predictions(batch), batch)
    finally:
        handle.remove()
    assert calls == ["leaf", "composition", "EnergyMSELoss", "ComposedLossFunction"]


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_direct_kernels_equal_the_functional_losses(reduction, dtype):
    g = torch.Generator().manual_seed(2)
    pred = torch.randn(7, 3, generator=g, dtype=dtype, requires_grad=True)
    target = torch.randn(7, 3, generator=g, dtype=dtype)
    pairs = [
        (terms._mse(pred, target, reduction), F.mse_loss(pred, target, reduction=reduction)),
        (terms._l1(pred, target, reduction), F.l1_loss(pred, target, reduction=reduction)),
        (
            terms._huber(pred, target, reduction, 0.3),
            F.huber_loss(pred, target, reduction=reduction, delta=0.3),
        ),
    ]
    for ours, reference in pairs:
        assert torch.equal(ours, reference)
        (grad_ours,) = torch.autograd.grad(ours.sum(), pred)
        (grad_reference,) = torch.autograd.grad(reference.sum(), pred)
        assert torch.equal(grad_ours, grad_reference)
    # unequal shapes go through the functional wrapper (which broadcasts, with its warning)
    column = torch.randn(7, 1, generator=g, dtype=dtype)
    with pytest.warns(UserWarning, match="target size"):
        assert torch.equal(
            terms._mse(column, target[:, 0], "mean"), F.mse_loss(column, target[:, 0])
        )
