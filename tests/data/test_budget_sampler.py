"""BudgetBatchSampler: budgets kept on mixed data, exactly once per epoch, seeded, resumable,
balanced and equal across ranks (in-process shards and two real gloo ranks)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from _ranks import run_ranks

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.bundled import bundled_split_path
from nvalchemi.data.datapipes import (
    BudgetBatchSampler,
    DataLoader,
    InMemoryDataset,
    count_atoms,
    count_edges,
)
from nvalchemi.data.neighbors import NeighborListTransform

CUTOFF = 4.0


def bundled_sizes(split: str = "train") -> list[int]:
    """Atom counts of a bundled split, from the extxyz frame headers (fast)."""
    sizes = []
    with open(bundled_split_path(split)) as handle:
        for line in handle:
            n = int(line)
            sizes.append(n)
            for _ in range(n + 1):
                next(handle)
    return sizes


def slab(seed: int, atoms: int):
    """A rattled fcc(111) slab of about ``atoms`` atoms (200-500), with vacuum."""
    from ase.build import fcc111

    layers = 4
    side = max(2, round((atoms / layers) ** 0.5))
    built = fcc111("Cu", size=(side, side, layers), vacuum=6.0)
    built.rattle(0.03, seed=seed)
    return built


@pytest.fixture(scope="module")
def mixed_sizes() -> list[int]:
    rng = np.random.default_rng(0)
    return bundled_sizes() + rng.integers(200, 501, 30).tolist()


@pytest.fixture(scope="module")
def mixed_dataset() -> InMemoryDataset:
    """Bundled validation cells plus five 200-500-atom slabs, with lists at the cutoff."""
    from nvalchemi.data.io.ase import ASEReader

    reader = ASEReader(bundled_split_path("val"))
    items = [reader.read_data(i) for i in range(80)]
    items += [AtomicData.from_atoms(slab(k, n)) for k, n in enumerate([200, 260, 330, 420, 500])]
    return InMemoryDataset(data_list=items, transforms=[NeighborListTransform(CUTOFF)])


def plan(sampler: BudgetBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("max_atoms", [600, 2000])
def test_no_batch_exceeds_the_budget_and_batches_are_full(mixed_sizes, max_atoms):
    sampler = BudgetBatchSampler(mixed_sizes, max_atoms=max_atoms, seed=3)
    for epoch in range(3):
        totals = [sum(mixed_sizes[i] for i in b) for b in plan(sampler, epoch)]
        assert max(totals) <= max_atoms
        assert np.mean(totals) > 0.95 * max_atoms  # packed, not fixed-count


def test_every_structure_exactly_once_per_epoch_and_the_same_count_every_epoch(mixed_sizes):
    sampler = BudgetBatchSampler(mixed_sizes, max_atoms=800, seed=1)
    counts = set()
    for epoch in range(4):
        batches = plan(sampler, epoch)
        assert sorted(i for b in batches for i in b) == list(range(len(mixed_sizes)))
        counts.add(len(batches))
    assert counts == {len(sampler)}


def test_the_same_seed_and_epoch_give_the_same_batches(mixed_sizes):
    a = BudgetBatchSampler(mixed_sizes, max_atoms=700, seed=5)
    b = BudgetBatchSampler(mixed_sizes, max_atoms=700, seed=5)
    assert plan(a, 2) == plan(b, 2)
    assert plan(a, 2) == plan(a, 2)  # iterating again repeats the epoch
    assert plan(a, 3) != plan(a, 2)
    assert plan(BudgetBatchSampler(mixed_sizes, max_atoms=700, seed=6), 2) != plan(a, 2)


def test_a_mid_epoch_state_dict_resumes_exactly(mixed_sizes):
    sampler = BudgetBatchSampler(mixed_sizes, max_atoms=900, seed=2)
    sampler.set_epoch(4)
    iterator = iter(sampler)
    head = [next(iterator) for _ in range(7)]
    state = sampler.state_dict()
    tail = list(iterator)
    resumed = BudgetBatchSampler(mixed_sizes, max_atoms=900, seed=2)
    resumed.load_state_dict(state)
    assert resumed.epoch == 4 and state["epoch_step"] == 7
    assert list(resumed) == tail
    assert head + tail == plan(BudgetBatchSampler(mixed_sizes, max_atoms=900, seed=2), 4)
    with pytest.raises(ValueError, match="other structure sizes, budgets"):
        BudgetBatchSampler(mixed_sizes, max_atoms=901, seed=2).load_state_dict(state)


def test_our_loader_resumes_bitwise_mid_epoch_through_its_state(mixed_dataset):
    def loader():
        return DataLoader(
            mixed_dataset, batch_sampler=BudgetBatchSampler(mixed_dataset, max_atoms=900)
        )

    first = loader()
    first.set_epoch(1)
    it = iter(first)
    for _ in range(2):
        next(it)
    state = first.state_dict()
    rest = list(it)
    again = loader()
    again.load_state_dict(state)
    resumed = list(again)
    assert len(resumed) == len(rest) > 0
    for x, y in zip(rest, resumed):
        assert torch.equal(x.positions, y.positions) and torch.equal(
            x.neighbor_list, y.neighbor_list
        )


def test_torch_dataloader_takes_it_as_batch_sampler_and_resumes_from_the_sampler(mixed_dataset):
    sampler = BudgetBatchSampler(mixed_dataset, max_atoms=900, seed=4)
    loader = torch.utils.data.DataLoader(
        mixed_dataset, batch_sampler=sampler, collate_fn=Batch.from_data_list
    )
    it = iter(loader)
    next(it)
    state = sampler.state_dict()
    rest = [b.num_nodes_list for b in it]
    fresh = BudgetBatchSampler(mixed_dataset, max_atoms=900, seed=4)
    fresh.load_state_dict(state)
    again = torch.utils.data.DataLoader(
        mixed_dataset, batch_sampler=fresh, collate_fn=Batch.from_data_list
    )
    assert [b.num_nodes_list for b in again] == rest


def test_atom_and_edge_budgets_hold_on_real_batches(mixed_dataset):
    edges = count_edges(mixed_dataset, CUTOFF)
    assert edges == mixed_dataset.batch.num_edges_per_graph.tolist()  # stored lists, exact
    sampler = BudgetBatchSampler(mixed_dataset, max_atoms=1200, max_edges=30_000, seed=0)
    assert sampler.edges == edges  # taken from the dataset's NeighborListTransform cutoff
    loader = DataLoader(mixed_dataset, batch_sampler=sampler)
    seen = 0
    for batch in loader:
        assert batch.num_nodes <= 1200 and batch.num_edges <= 30_000
        seen += batch.num_graphs
    assert seen == len(mixed_dataset)


def test_edges_are_counted_at_the_cutoff_when_not_stored():
    from ase.build import bulk

    items = []
    for k, repeat in enumerate([(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2)]):
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True) * repeat
        atoms.rattle(0.05, seed=k)
        items.append(AtomicData.from_atoms(atoms))
    dataset = InMemoryDataset(data_list=items)
    counts = count_edges(dataset, 3.0)
    from nvalchemi.data.neighbors import neighbor_list_for_system

    expected = [
        len(neighbor_list_for_system(d.positions, d.cell[0], d.pbc[0], 3.0)[0]) for d in items
    ]
    assert counts == expected
    assert count_atoms(dataset) == [4, 8, 16, 32]
    with pytest.raises(ValueError, match="count_edges"):
        BudgetBatchSampler(dataset, max_edges=1000)  # no transform to take a cutoff from
    sampler = BudgetBatchSampler(dataset, max_edges=1000, edge_counts=counts)
    assert all(sum(counts[i] for i in b) <= 1000 for b in sampler)


def test_drop_last_never_splits_or_repeats_and_drops_only_a_few(mixed_sizes):
    budget = 1500
    keep = BudgetBatchSampler(mixed_sizes, max_atoms=budget, seed=7, drop_last=True)
    for epoch in range(3):
        batches = plan(keep, epoch)
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat))  # nothing twice
        assert len(batches) == len(keep)
        assert len(mixed_sizes) - len(flat) < 0.03 * len(mixed_sizes)
        totals = [sum(mixed_sizes[i] for i in b) for b in batches]
        assert min(totals) > 0.5 * budget


def test_an_oversized_structure_gets_its_own_batch_with_a_warning():
    with pytest.warns(UserWarning, match="exceed the budget on their own"):
        sampler = BudgetBatchSampler([10, 10, 500, 10], max_atoms=100, shuffle=False)
    assert [2] in list(sampler)


def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match="needs a budget"):
        BudgetBatchSampler([1, 2])
    with pytest.raises(ValueError, match="max_atoms must be a positive"):
        BudgetBatchSampler([1, 2], max_atoms=0)
    with pytest.raises(ValueError, match="edge_counts has 1 entries"):
        BudgetBatchSampler([1, 2], max_edges=5, edge_counts=[1])
    with pytest.raises(ValueError, match="max_edges needs edge counts"):
        BudgetBatchSampler([1, 2], max_edges=5)
    with pytest.raises(ValueError, match="rank must be in"):
        BudgetBatchSampler([1, 2], max_atoms=5, num_replicas=2, rank=2)


def test_four_ranks_get_equal_counts_disjoint_shards_and_balanced_steps():
    sizes = bundled_sizes()
    single = BudgetBatchSampler(sizes, max_atoms=512, seed=0)
    ranks = [single.shard(num_replicas=4, rank=r) for r in range(4)]
    worst = []
    for epoch in range(3):
        per_rank = [plan(r, epoch) for r in ranks]
        assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == len(ranks[0])
        flat = sorted(i for p in per_rank for b in p for i in b)
        assert flat == list(range(len(sizes)))  # disjoint, complete
        totals = np.array([[sum(sizes[i] for i in b) for b in p] for p in per_rank])
        assert totals.max() <= 512
        worst.append((totals.max(0) / totals.mean(0)).max())
    assert max(worst) <= 1.05


def test_two_gloo_ranks_installed_by_ddp_hook_see_each_structure_once_balanced():
    script = Path(__file__).with_name("_budget_ranks.py")
    results = run_ranks(script, timeout=240)
    spec = importlib.util.spec_from_file_location("_budget_ranks", script)
    ranks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ranks)

    sizes = ranks.sizes()
    r0, r1 = results
    assert (r0["sampler_replicas"], r0["sampler_rank"]) == (2, 0)
    assert (r1["sampler_replicas"], r1["sampler_rank"]) == (2, 1)
    assert r0["batches"] == r1["batches"] > 0
    assert sorted(r0["labels"] + r1["labels"]) == list(range(len(sizes)))
    steps = np.array([r0["atoms"], r1["atoms"]])
    assert steps.max() <= ranks.MAX_ATOMS
    assert (steps.max(0) / steps.mean(0)).max() <= 1.05
