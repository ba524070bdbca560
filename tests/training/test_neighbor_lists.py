"""A model with a ``NeighborConfig`` trains on batches that come without neighbour lists.

The seed's minimal pattern with ``models=PaiNN(...)`` and a plain torch ``DataLoader``
(``collate_fn=Batch.from_data_list``): the strategy builds the lists (training and
validation) and gets the losses of the run whose batches carried precomputed lists.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.neighbors import compute_neighbors
from nvalchemi.hooks.neighbor_list import NeighborListHook
from nvalchemi.models.painn import PaiNN
from nvalchemi.training import (
    ComposedLossFunction,
    EnergyMSELoss,
    ForceMSELoss,
    OptimizerConfig,
    TrainingStage,
    TrainingStrategy,
    ValidationConfig,
)

CUTOFF = 4.0


def structures(n: int, seed: int) -> list[AtomicData]:
    from ase.build import bulk
    from ase.calculators.emt import EMT

    out = []
    for i in range(n):
        atoms = bulk("Cu", "fcc", a=3.6) * (1, 1, 1 + i % 2)
        atoms.rattle(0.05, seed=seed + i)
        atoms.calc = EMT()
        data = AtomicData.from_atoms(atoms, dtype=torch.float64)
        data.energy = torch.tensor([[atoms.get_potential_energy()]], dtype=torch.float64)
        data.forces = torch.tensor(atoms.get_forces(), dtype=torch.float64)
        out.append(data)
    return out


def with_lists(loader) -> list[Batch]:
    batches = []
    for batch in loader:
        compute_neighbors(batch, cutoff=CUTOFF)
        batches.append(batch)
    return batches


class Losses:
    frequency = 1
    stage = TrainingStage.AFTER_BATCH

    def __init__(self) -> None:
        self.values: list[float] = []

    def __call__(self, ctx, stage) -> None:
        self.values.append(float(ctx.loss))


def seed_pattern(model, train_loader, val_loader) -> tuple[TrainingStrategy, Losses]:
    losses = Losses()
    loss_fn = ComposedLossFunction(
        [EnergyMSELoss(), ForceMSELoss()], weights=[1.0, 10.0], normalize_weights=False
    )
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(
            optimizer_cls=torch.optim.AdamW,
            optimizer_kwargs={"lr": 1e-3, "weight_decay": 1e-5},
        ),
        loss_fn=loss_fn,
        validation_config=ValidationConfig(validation_data=val_loader, every_n_epochs=1),
        hooks=[losses],
        num_epochs=2,
    )
    strategy.run(train_loader)
    return strategy, losses


@pytest.fixture(scope="module")
def data():
    train, val = structures(6, 0), structures(2, 100)
    loader = DataLoader(train, batch_size=2, collate_fn=Batch.from_data_list)
    val_loader = DataLoader(val, batch_size=2, collate_fn=Batch.from_data_list)
    return loader, val_loader


def test_painn_trains_on_a_torch_dataloader_without_lists(data):
    loader, val_loader = data
    torch.manual_seed(0)
    model = PaiNN(cutoff=CUTOFF, hidden_channels=8, num_interactions=1, elements=[29])
    model = model.double()
    reference = copy.deepcopy(model)

    strategy, losses = seed_pattern(model, loader, val_loader)
    expected, expected_losses = seed_pattern(reference, with_lists(loader), with_lists(val_loader))

    assert strategy.step_count == expected.step_count == 6
    assert losses.values == expected_losses.values  # the same lists, so the same numbers
    assert strategy.last_validation["total_loss"] == expected.last_validation["total_loss"]
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    (builder,) = strategy.neighbor_list_builders()
    # 3 batches x 2 epochs of training, 1 validation batch x 2 validations
    assert builder.builds == 3 * 2 + 2
    (unused,) = expected.neighbor_list_builders()
    assert unused.builds == 0  # batches with lists cost nothing


def test_builders_follow_the_model_config_and_yield_to_a_registered_hook():
    model = PaiNN(cutoff=3.5, hidden_channels=8, num_interactions=1, elements=[29])
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        loss_fn=EnergyMSELoss(),
        num_steps=1,
    )
    (builder,) = strategy.neighbor_list_builders()
    assert (builder.cutoff, builder.half_list, builder.format) == (3.5, False, "coo")
    strategy.register_hook(*model.make_neighbor_hooks(stage=TrainingStage.BEFORE_FORWARD))
    assert strategy.neighbor_list_builders() == ()
    assert any(isinstance(h, NeighborListHook) for h in strategy.hooks)


def test_models_without_neighbor_config_get_no_builder():
    strategy = TrainingStrategy(
        models=torch.nn.Linear(1, 1),
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        loss_fn=EnergyMSELoss(),
        num_steps=1,
    )
    assert strategy.neighbor_list_builders() == ()
