"""WrapPeriodicHook and wrap_positions_into_cell: wrapped positions, edges kept, stage wiring."""

from __future__ import annotations

from enum import Enum, auto
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk, molecule

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.neighbors import compute_neighbors, edge_vectors, has_neighbor_list
from nvalchemi.hooks import Hook, WrapPeriodicHook
from nvalchemi.hooks.periodic import wrap_positions_into_cell


class Stage(Enum):
    BEFORE_FORWARD = auto()
    AFTER_FORWARD = auto()


def skewed_slab(seed: int) -> Atoms:
    """A triclinic cell, periodic in a and b only, with atoms pushed out through every face."""
    rng = np.random.default_rng(seed)
    cell = np.array([[4.0, 0.0, 0.0], [1.3, 3.7, 0.0], [0.4, -0.6, 9.0]])
    fractional = rng.uniform(0.05, 0.95, size=(8, 3))
    fractional[:, :2] += rng.integers(-2, 3, size=(8, 2))  # whole lattice vectors out
    fractional[:, 2] += rng.choice([-1.0, 0.0, 1.0], size=8)  # outside along the open axis
    return Atoms("Cu8", scaled_positions=fractional, cell=cell, pbc=[True, True, False])


def batch_of(*atoms: Atoms) -> Batch:
    items = [AtomicData.from_atoms(a, dtype=torch.float64) for a in atoms]
    return Batch.from_data_list(items)


def test_positions_match_ase_wrap_on_periodic_axes_only():
    slab, crystal = skewed_slab(0), bulk("Cu", "fcc", a=3.6) * (2, 1, 1)
    crystal.positions += np.array([5.0, -7.0, 11.0])
    batch = batch_of(slab, crystal)
    wrapped = wrap_positions_into_cell(batch.positions, batch.cell, batch.pbc, batch.batch_idx)
    expected = []
    for atoms in (slab, crystal):
        copy = atoms.copy()
        copy.wrap(eps=0.0)  # ASE wraps periodic axes only
        expected.append(copy.positions)
    np.testing.assert_allclose(wrapped.numpy(), np.concatenate(expected), atol=1e-10)
    # the open axis of the slab is untouched, the fractional coordinates are inside [0, 1)
    np.testing.assert_allclose(wrapped[:8, 2].numpy(), slab.positions[:, 2], atol=1e-12)
    fractional = np.linalg.solve(slab.cell.array.T, wrapped[:8].numpy().T).T
    assert (fractional[:, :2] >= 0).all() and (fractional[:, :2] < 1).all()


def test_the_move_is_differentiable_with_gradient_one():
    positions = torch.tensor([[5.0, 1.0, -3.0]], dtype=torch.float64, requires_grad=True)
    cell = torch.eye(3, dtype=torch.float64).mul(2.0).unsqueeze(0)
    wrapped = wrap_positions_into_cell(positions, cell, torch.tensor([[True, True, True]]))
    assert wrapped.tolist() == [[1.0, 1.0, 1.0]]
    wrapped.sum().backward()
    assert positions.grad.tolist() == [[1.0, 1.0, 1.0]]


def test_several_cells_need_batch_idx():
    cells = torch.eye(3).repeat(2, 1, 1)
    with pytest.raises(ValueError, match="2 cells need batch_idx"):
        wrap_positions_into_cell(torch.zeros(2, 3), cells, torch.ones(2, 3, dtype=torch.bool))


@pytest.mark.parametrize("fmt", ["coo", "matrix"])
def test_the_hook_wraps_in_place_and_keeps_every_edge_vector(fmt):
    batch = batch_of(skewed_slab(1), skewed_slab(2), molecule("H2O"))
    compute_neighbors(batch, 3.0, format=fmt)
    before_positions = batch.positions.clone()
    if fmt == "coo":
        before = edge_vectors(batch)
    else:
        matrix, shifts = batch.neighbor_matrix.clone(), batch.neighbor_matrix_shifts.clone()
    WrapPeriodicHook()(SimpleNamespace(batch=batch), Stage.BEFORE_FORWARD)

    expected = wrap_positions_into_cell(before_positions, batch.cell, batch.pbc, batch.batch_idx)
    assert torch.equal(batch.positions, expected)
    assert not torch.equal(batch.positions, before_positions)  # atoms did move
    water = batch.batch_idx == 2
    assert torch.equal(batch.positions[water], before_positions[water])  # no cell: untouched
    assert has_neighbor_list(batch, 3.0, format=fmt)  # the stamp follows the new positions
    if fmt == "coo":
        torch.testing.assert_close(edge_vectors(batch), before, rtol=0, atol=1e-12)
    else:
        real = matrix < batch.num_nodes
        assert torch.equal(batch.neighbor_matrix, matrix)
        cell = batch.cell[batch.batch_idx]  # [V, 3, 3]

        def vectors(pos, shift):
            j = matrix.clamp(max=batch.num_nodes - 1)
            return pos[j] - pos.unsqueeze(1) + torch.einsum("vki,vij->vkj", shift.double(), cell)

        old = vectors(before_positions, shifts)[real]
        new = vectors(batch.positions, batch.neighbor_matrix_shifts)[real]
        torch.testing.assert_close(new, old, rtol=0, atol=1e-12)
        # padding entries are left as they were
        assert torch.equal(batch.neighbor_matrix_shifts[~real], shifts[~real])


def test_wrapping_twice_changes_nothing_more():
    batch = batch_of(skewed_slab(3))
    compute_neighbors(batch, 3.0)
    hook = WrapPeriodicHook()
    hook(SimpleNamespace(batch=batch), Stage.BEFORE_FORWARD)
    positions, shifts = batch.positions.clone(), batch.neighbor_list_shifts.clone()
    hook(SimpleNamespace(batch=batch), Stage.BEFORE_FORWARD)
    assert torch.equal(batch.positions, positions)
    assert torch.equal(batch.neighbor_list_shifts, shifts)


def test_stage_wiring_and_protocol():
    hook = WrapPeriodicHook()
    assert isinstance(hook, Hook) and hook.frequency == 1 and hook.stage is None
    assert hook._runs_on_stage(Stage.BEFORE_FORWARD)
    assert not hook._runs_on_stage(Stage.AFTER_FORWARD)
    pinned = WrapPeriodicHook(frequency=5, stage=Stage.AFTER_FORWARD)
    assert pinned._runs_on_stage(Stage.AFTER_FORWARD)
    assert not pinned._runs_on_stage(Stage.BEFORE_FORWARD)
    with pytest.raises(ValueError, match="frequency must be an int >= 1"):
        WrapPeriodicHook(frequency=0)


def test_training_with_the_hook_gives_the_same_losses_on_unwrapped_data():
    """PaiNN sees the same edges, so wrapping before the forward changes no number."""
    from nvalchemi.models import PaiNN
    from nvalchemi.training import EnergyMSELoss, OptimizerConfig, TrainingStrategy

    structures = []
    for seed in range(4):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        atoms.rattle(0.1, seed=seed)
        atoms.positions += np.random.default_rng(seed).integers(-1, 2, size=(4, 3)) * 3.6
        data = AtomicData.from_atoms(atoms, dtype=torch.float64)
        data.energy = torch.tensor([[float(seed)]], dtype=torch.float64)
        structures.append(data)

    def train(hooks):
        batches = [Batch.from_data_list(structures[i : i + 2]) for i in (0, 2)]
        for batch in batches:
            compute_neighbors(batch, 3.0)
        torch.manual_seed(0)
        model = PaiNN(cutoff=3.0, hidden_channels=8, num_interactions=1, elements=[29]).double()
        strategy = TrainingStrategy(
            models=model,
            optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 0.01}),
            loss_fn=EnergyMSELoss(),
            num_steps=4,
            hooks=hooks,
        )
        losses = [float(strategy.train_batch(batches[i % 2])) for i in range(4)]
        return losses, batches

    plain, _ = train([])
    wrapped, batches = train([WrapPeriodicHook()])
    np.testing.assert_allclose(wrapped, plain, rtol=1e-10)
    for batch in batches:  # the batches were wrapped in place
        torch.testing.assert_close(
            batch.positions,
            wrap_positions_into_cell(batch.positions, batch.cell, batch.pbc, batch.batch_idx),
        )
