"""A step that runs out of memory is trained in pieces with the update of the whole batch.

The model raises ``torch.OutOfMemoryError`` (as CUDA's allocator would) for batches above
an atom limit, in the forward or in the backward; the split run must end with the
weights of the run that never ran out, with the same counters and hook calls.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from _ranks import run_ranks
from _training_support import Recorder, TinyModel

from nvalchemi.data import AtomicData, Batch
from nvalchemi.training import (
    EnergyHuberLoss,
    EnergyMAELoss,
    EnergyMSELoss,
    ForceHuberLoss,
    ForceL2NormLoss,
    ForceMSELoss,
    OptimizerConfig,
    StressHuberLoss,
    StressMSELoss,
    TrainingStage,
    TrainingStrategy,
)
from nvalchemi.training._memory_split import LossShares, halves
from nvalchemi.training.hooks import GradientAccumulationHook


class _OutOfMemoryInBackward(torch.autograd.Function):
    """Identity whose backward runs out of memory (a gradient too large to allocate)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory (injected in backward)")


class Limited(TinyModel):
    """``TinyModel`` that runs out of memory above ``limit`` atoms (forward or backward)."""

    def __init__(self, limit: int | None = None, where: str = "forward", **kwargs) -> None:
        super().__init__(**kwargs)
        self.limit, self.where = limit, where
        self.sizes: list[int] = []  # atoms of every batch it was called on
        self.structures: list[int] = []

    def forward(self, batch):
        self.sizes.append(batch.num_nodes)
        self.structures.append(batch.num_graphs)
        over = self.limit is not None and batch.num_nodes > self.limit
        if over and self.where == "forward":
            raise torch.OutOfMemoryError(f"CUDA out of memory ({batch.num_nodes} atoms)")
        out = super().forward(batch)
        if over:
            out["energy"] = _OutOfMemoryInBackward.apply(out["energy"])
        return out


def structure(atoms: int, seed: int, *, stress: bool = True, forces: bool = True) -> AtomicData:
    g = torch.Generator().manual_seed(seed)
    fields = {
        "atomic_numbers": torch.randint(1, 5, (atoms,), generator=g),
        "positions": torch.randn(atoms, 3, generator=g, dtype=torch.float64),
        "energy": torch.randn(1, 1, generator=g, dtype=torch.float64),
        "cell": 5.0 * torch.eye(3, dtype=torch.float64).unsqueeze(0),
        "pbc": torch.ones(1, 3, dtype=torch.bool),
    }
    if forces:
        fields["forces"] = torch.randn(atoms, 3, generator=g, dtype=torch.float64)
    if stress:
        fields["stress"] = torch.randn(1, 3, 3, generator=g, dtype=torch.float64)
    return AtomicData(**fields)


def batches(sizes=((3, 2, 5, 4, 1), (2, 6, 3), (4, 4, 4, 1))) -> list[Batch]:
    """Batches of structures with different atom counts; some lack stress or forces."""
    out = []
    for b, counts in enumerate(sizes):
        data = [
            structure(n, 10 * b + i, stress=(i % 3 != 1), forces=(b, i) != (0, 3))
            for i, n in enumerate(counts)
        ]
        out.append(Batch.from_data_list(data))
    return out


# Every reduction of the built-in leaves: means over structures, atom-weighted means,
# means over components and over atoms, with and without masking.
ALL_REDUCTIONS = (
    EnergyMSELoss()
    + EnergyMSELoss(per_atom=True)
    + EnergyMAELoss()
    + EnergyHuberLoss(delta=0.5)
    + ForceMSELoss()
    + 2.0 * ForceMSELoss(normalize_by_atom_count=False)
    + ForceHuberLoss(delta=0.5)
    + ForceL2NormLoss(normalize_by_atom_count=False)
    + ForceL2NormLoss()
    + StressMSELoss()
    + StressHuberLoss(delta=0.5)
)


def train(model, data, *, hooks=(), loss_fn=ALL_REDUCTIONS, optimizer=torch.optim.SGD):
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(optimizer, {"lr": 0.05}),
        loss_fn=copy.deepcopy(loss_fn),
        num_epochs=1,
        hooks=list(hooks),
        nonfinite_check_interval=1,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.run(data)
    messages = [str(w.message) for w in caught if "pieces" in str(w.message)]
    return strategy, [p.detach().clone() for p in model.parameters()], messages


def largest_difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.fixture
def base():
    torch.manual_seed(0)
    return Limited(stress=True).double()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_split_update_equals_unsplit_update(base, where):
    reference = copy.deepcopy(base)
    split = copy.deepcopy(base)
    split.limit, split.where = 8, where
    rec_ref, rec_split = Recorder(), Recorder()
    ref_strategy, ref_weights, _ = train(reference, batches(), hooks=[rec_ref])
    strategy, weights, messages = train(split, batches(), hooks=[rec_split])

    # float64 rounding, plus ForceMSELoss's per-atom scale, which is computed in float32
    assert largest_difference(ref_weights, weights) < 1e-9
    assert (strategy.step_count, strategy.batch_count) == (3, 3)
    assert (ref_strategy.step_count, ref_strategy.batch_count) == (3, 3)
    for stage in ("BEFORE_BATCH", "AFTER_OPTIMIZER_STEP", "AFTER_BATCH", "AFTER_BACKWARD"):
        assert rec_split.names().count(stage) == 3, stage
    after_batch = [e for e in rec_split.events if e[0] == "AFTER_BATCH"]
    assert after_batch == [("AFTER_BATCH", 1), ("AFTER_BATCH", 2), ("AFTER_BATCH", 3)]
    # the whole batch's loss reaches the hooks, equal to the unsplit one
    ref_losses = [s["loss"] for s in rec_ref.snapshots if s["stage"] == "AFTER_BATCH"]
    losses = [s["loss"] for s in rec_split.snapshots if s["stage"] == "AFTER_BATCH"]
    assert torch.allclose(torch.stack(ref_losses), torch.stack(losses), rtol=1e-8, atol=0)
    # 15 atoms ran out; its pieces of 5 and 10 atoms, the 10 ran out again, then 5 + 5:
    # the largest piece that trained (5 atoms) is the budget from now on
    assert len(messages) == 1 and "15 atoms" in messages[0] and "above 5 atoms" in messages[0]
    assert split.sizes[:5] == [15, 5, 10, 5, 5]
    # from then on nothing above 5 atoms is tried, but single structures (the 6 atoms)
    later = list(zip(split.sizes[5:], split.structures[5:]))
    assert later and all(atoms <= 5 or count == 1 for atoms, count in later)
    assert (6, 1) in later


def test_predictions_of_the_split_step_are_the_whole_batch(base):
    split = copy.deepcopy(base)
    split.limit = 8
    hook = Recorder(stages=(TrainingStage.AFTER_LOSS,))
    _, _, _ = train(split, batches()[:1], hooks=[hook])
    whole = [s for s in hook.snapshots if s["stage"] == "AFTER_LOSS"][-1]
    batch = batches()[0]
    assert whole["predictions"]["predicted_forces"].shape == (batch.num_nodes, 3)
    assert whole["predictions"]["predicted_energy"].shape == (batch.num_graphs, 1)


def test_split_inside_an_accumulation_window_is_exact(base):
    reference = copy.deepcopy(base)
    split = copy.deepcopy(base)
    split.limit = 8
    data = batches() + batches()[:1]
    ref_strategy, ref_weights, _ = train(
        reference, data, hooks=[GradientAccumulationHook(2)], optimizer=torch.optim.Adam
    )
    strategy, weights, _ = train(
        split, data, hooks=[GradientAccumulationHook(2)], optimizer=torch.optim.Adam
    )
    assert largest_difference(ref_weights, weights) < 1e-9  # Adam divides by sqrt(v)
    assert strategy.step_count == ref_strategy.step_count == 2
    assert strategy.batch_count == 4


def test_shares_of_every_leaf_sum_to_one_and_follow_the_reduction():
    batch = batches()[0]  # atoms 3, 2, 5, 4, 1; structure 1 and 4 lack stress, 3 lacks forces
    shares = LossShares(ALL_REDUCTIONS, batch)
    assert not shares.approximate
    names = ALL_REDUCTIONS.component_names
    first, second = shares.of(0, 2), shares.of(2, 5)
    for name in names:
        assert first[name] + second[name] == pytest.approx(1.0)
    by_name = dict(zip(names, [first[n] for n in names]))
    assert by_name["EnergyMSELoss_0"] == pytest.approx(2 / 5)  # structures
    assert by_name["EnergyMSELoss_1"] == pytest.approx(5 / 15)  # atoms (per_atom=True)
    assert by_name["ForceMSELoss_0"] == pytest.approx(2 / 4)  # labelled structures
    assert by_name["ForceMSELoss_1"] == pytest.approx(15 / 33)  # components of labelled
    assert by_name["ForceL2NormLoss_0"] == pytest.approx(5 / 11)  # atoms of labelled
    assert by_name["StressMSELoss"] == pytest.approx(1 / 3)  # structures with stress


def test_halves_are_contiguous_and_balanced_by_atoms():
    batch = batches()[0]
    first, second = halves(batch)
    assert first.num_nodes_list + second.num_nodes_list == batch.num_nodes_list
    assert torch.equal(torch.cat([first.positions, second.positions]), batch.positions)


def test_a_single_structure_that_does_not_fit_names_its_size(base):
    model = copy.deepcopy(base)
    model.limit = 4
    with pytest.raises(torch.OutOfMemoryError, match="structure 2 of the batch has 5 atoms"):
        train(model, batches()[:1])


def test_a_user_loss_is_split_by_structures_with_a_warning(base):
    class Custom(EnergyMSELoss):
        def reduce(self, residual, valid, ctx, **kwargs):
            return super().reduce(residual, valid, ctx, **kwargs)

    model = copy.deepcopy(base)
    model.limit = 8
    with pytest.warns(UserWarning, match="Custom.*share of the structures"):
        TrainingStrategy(
            models=model,
            optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
            loss_fn=Custom(),
            num_epochs=1,
        ).run(batches()[:1])


def test_out_of_memory_after_backward_is_raised_with_a_note(base):
    class Fails:
        frequency = 1
        stage = TrainingStage.AFTER_BACKWARD

        def __call__(self, ctx, stage):
            raise torch.OutOfMemoryError("CUDA out of memory (optimizer state)")

    strategy = TrainingStrategy(
        models=copy.deepcopy(base),
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
        loss_fn=EnergyMSELoss(),
        num_epochs=1,
        hooks=[Fails()],
    )
    with pytest.raises(torch.OutOfMemoryError) as info:
        strategy.run(batches()[:1])
    assert any("gradients were already complete" in n for n in info.value.__notes__)


def test_ddp_rank_that_runs_out_makes_every_rank_train_in_pieces():
    results = run_ranks(Path(__file__).with_name("_memory_split_ranks.py"), timeout=240)
    for result in results:
        assert result["difference"] < 1e-9
        assert result["steps"] == [3, 3]
    assert results[0]["weights"] == pytest.approx(results[1]["weights"], abs=1e-14)
    assert "another rank ran out" in results[0]["message"]
    assert "ran out of memory" in results[1]["message"]
    # rank 1: 15 atoms ran out, then its 10-atom half; later nothing above 5 atoms is tried
    calls = [tuple(c) for c in results[1]["calls"]]
    assert [atoms for atoms, _ in calls[:5]] == [15, 5, 10, 5, 5]
    assert all(atoms <= 5 or count == 1 for atoms, count in calls[5:])
    # rank 0 never ran out; every step the ranks voted to train in pieces, so rank 0 ran
    # each batch twice: the forward before the vote, then whole again, as one piece
    assert [atoms for atoms, _ in results[0]["calls"]] == [10, 10, 11, 11, 9, 9]
