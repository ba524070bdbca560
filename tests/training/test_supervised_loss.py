"""``compute_supervised_loss`` on a ``Batch``: errors name what is wrong, and module hooks on the
leaves, the composition or registered globally run (the loss is made of module calls)."""

import pytest
import torch

from nvalchemi.data import AtomicData, Batch
from nvalchemi.training.losses import (
    ComposedLossFunction,
    EnergyMSELoss,
    ForceMSELoss,
    compute_supervised_loss,
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
        compute_supervised_loss(loss_fn, make_predictions(batch), batch)
    finally:
        handle.remove()
    assert calls == ["leaf", "composition", "EnergyMSELoss", "ComposedLossFunction"]
