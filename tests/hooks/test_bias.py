"""BiasedPotentialHook: model + bias in the loss (delta learning), batches of a dynamics engine, errors."""

from __future__ import annotations

import copy
from enum import Enum, auto
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from nvalchemi.data import AtomicData, Batch
from nvalchemi.hooks import BiasedPotentialHook, Hook


class Stage(Enum):
    AFTER_FORWARD = auto()
    AFTER_LOSS = auto()


class Harmonic(nn.Module):
    """E = sum_i k_Z |r_i|^2 / 2 per structure, forces by autograd (a tiny trainable model)."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Parameter(torch.full((4,), 0.5, dtype=torch.float64))

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        positions = batch.positions.detach().requires_grad_(True)
        atom = 0.5 * self.k[batch.atomic_numbers] * (positions**2).sum(-1)
        energy = atom.new_zeros(batch.num_graphs).index_add(0, batch.batch_idx, atom)
        (grad,) = torch.autograd.grad(energy.sum(), positions, create_graph=self.training)
        return {"energy": energy.unsqueeze(-1), "forces": -grad}


def pair_wall(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed baseline: a linear potential along x, E = sum_i 0.3 x_i, F = (-0.3, 0, 0)."""
    atom = 0.3 * batch.positions[:, 0]
    energy = atom.new_zeros(batch.num_graphs).index_add(0, batch.batch_idx, atom)
    forces = torch.zeros_like(batch.positions)
    forces[:, 0] = -0.3
    return energy.unsqueeze(-1), forces


def structures(shift_labels: bool) -> list[AtomicData]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        positions = torch.randn(3, 3, generator=generator, dtype=torch.float64)
        numbers = torch.randint(1, 4, (3,), generator=generator)
        energy = torch.randn(1, 1, generator=generator, dtype=torch.float64)
        forces = torch.randn(3, 3, generator=generator, dtype=torch.float64)
        data = AtomicData(atomic_numbers=numbers, positions=positions, energy=energy, forces=forces)
        if shift_labels:  # what the model alone must learn: the labels minus the baseline
            bias_energy, bias_forces = pair_wall(Batch.from_data_list([data]))
            data.energy = energy - bias_energy
            data.forces = forces - bias_forces
        out.append(data)
    return out


def train(hooks: list, shift_labels: bool, model: nn.Module) -> list[float]:
    from nvalchemi.training import EnergyMSELoss, ForceMSELoss, OptimizerConfig, TrainingStrategy

    data = structures(shift_labels)
    batches = [Batch.from_data_list(data[i : i + 2]) for i in (0, 2)]
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
        loss_fn=EnergyMSELoss() + ForceMSELoss(),
        num_steps=6,
        hooks=hooks,
    )
    return [float(strategy.train_batch(batches[i % 2])) for i in range(6)]


def test_training_model_plus_bias_equals_training_the_model_on_the_labels_minus_the_bias():
    torch.manual_seed(0)
    with_bias = Harmonic()
    reference = copy.deepcopy(with_bias)
    losses = train([BiasedPotentialHook(pair_wall)], shift_labels=False, model=with_bias)
    expected = train([], shift_labels=True, model=reference)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-12, atol=0)
    torch.testing.assert_close(with_bias.k, reference.k, rtol=1e-12, atol=0)
    assert not torch.equal(with_bias.k, torch.full((4,), 0.5, dtype=torch.float64))  # it trained


def test_without_predictions_the_bias_goes_into_the_batch():
    batch = Batch.from_data_list(structures(False)[:2])
    energy, forces = batch.energy.clone(), batch.forces.clone()
    bias_energy, bias_forces = pair_wall(batch)
    BiasedPotentialHook(pair_wall)(SimpleNamespace(batch=batch), Stage.AFTER_FORWARD)
    torch.testing.assert_close(batch.energy, energy + bias_energy)
    torch.testing.assert_close(batch.forces, forces + bias_forces)


def test_an_energy_only_bias_leaves_the_forces_and_accepts_a_flat_energy():
    predictions = {"predicted_energy": torch.zeros(2, 1), "predicted_forces": torch.ones(6, 3)}
    batch = Batch.from_data_list(structures(False)[:2])
    hook = BiasedPotentialHook(lambda b: (torch.tensor([1.0, 2.0]), None))
    hook(SimpleNamespace(batch=batch, predictions=predictions), Stage.AFTER_FORWARD)
    assert predictions["predicted_energy"].tolist() == [[1.0], [2.0]]
    assert torch.equal(predictions["predicted_forces"], torch.ones(6, 3))


def test_bad_biases_are_named():
    batch = Batch.from_data_list(structures(False)[:2])
    ctx = SimpleNamespace(batch=batch, predictions={"predicted_energy": torch.zeros(2, 1)})
    wrong = BiasedPotentialHook(lambda b: (torch.zeros(3, 1), None))
    with pytest.raises(ValueError, match=r"bias energy has shape \(3, 1\); expected \(2, 1\)"):
        wrong(ctx, Stage.AFTER_FORWARD)
    no_forces = BiasedPotentialHook(lambda b: (torch.zeros(2, 1), torch.zeros(6, 3)))
    with pytest.raises(ValueError, match="'predicted_forces' is missing"):
        no_forces(ctx, Stage.AFTER_FORWARD)
    not_tensor = BiasedPotentialHook(lambda b: ([0.0, 0.0], None))
    with pytest.raises(TypeError, match="its energy is list"):
        not_tensor(ctx, Stage.AFTER_FORWARD)
    with pytest.raises(TypeError, match="bias_fn must be callable"):
        BiasedPotentialHook(None)


def test_stage_wiring_and_protocol():
    hook = BiasedPotentialHook(pair_wall)
    assert isinstance(hook, Hook) and hook.frequency == 1 and hook.stage is None
    assert hook._runs_on_stage(Stage.AFTER_FORWARD) and not hook._runs_on_stage(Stage.AFTER_LOSS)
    pinned = BiasedPotentialHook(pair_wall, stage=Stage.AFTER_LOSS)
    assert pinned._runs_on_stage(Stage.AFTER_LOSS)
    assert "pair_wall" in repr(hook)
