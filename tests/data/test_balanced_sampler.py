"""SizeBalancedBatchSampler: disjoint, complete, balanced and deterministic shards."""

import pytest
import torch

from nvalchemi.data import AtomicData
from nvalchemi.data.datapipes import DataLoader, SizeBalancedBatchSampler
from nvalchemi.data.datapipes.dataset import InMemoryDataset


def sizes(n=64, seed=0):
    return torch.randint(4, 129, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def shards(atoms, **kwargs):
    return [list(SizeBalancedBatchSampler(atoms, num_replicas=2, rank=r, **kwargs)) for r in (0, 1)]


def test_ranks_get_disjoint_batches_that_cover_the_epoch():
    atoms = sizes()
    rank0, rank1 = shards(atoms, batch_size=4)
    assert len(rank0) == len(rank1) == 8
    seen = [i for batch in rank0 + rank1 for i in batch]
    assert sorted(seen) == list(range(64))
    assert all(len(b) == 4 for b in rank0 + rank1)


def test_atom_counts_are_balanced_much_better_than_round_robin():
    atoms = sizes(256, seed=1)
    rank0, rank1 = shards(atoms, batch_size=8, seed=3)
    balanced = sum(
        abs(sum(atoms[i] for i in a) - sum(atoms[i] for i in b)) for a, b in zip(rank0, rank1)
    )
    order = torch.randperm(256, generator=torch.Generator().manual_seed(3)).view(-1, 16)
    round_robin = sum(
        abs(sum(atoms[i] for i in s[0::2]) - sum(atoms[i] for i in s[1::2])) for s in order.tolist()
    )
    assert balanced * 5 < round_robin


def test_order_depends_only_on_seed_and_epoch():
    atoms = sizes()
    a = SizeBalancedBatchSampler(atoms, 4, num_replicas=1, rank=0, seed=7)
    b = SizeBalancedBatchSampler(atoms, 4, num_replicas=1, rank=0, seed=7)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)


def test_padding_and_drop_last():
    atoms = sizes(10)
    padded = shards(atoms, batch_size=2, shuffle=False)
    assert len(padded[0]) == 3 and sum(len(b) for s in padded for b in s) == 12
    dropped = shards(atoms, batch_size=2, shuffle=False, drop_last=True)
    assert len(dropped[0]) == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        SizeBalancedBatchSampler([1, 2], 0)
    with pytest.raises(ValueError, match="rank"):
        SizeBalancedBatchSampler([1, 2], 1, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="non-empty"):
        SizeBalancedBatchSampler([], 1)


def test_works_as_the_batch_sampler_of_our_loader():
    data = [
        AtomicData(atomic_numbers=torch.ones(n, dtype=torch.long), positions=torch.zeros(n, 3))
        for n in (2, 9, 3, 7, 4, 5)
    ]
    dataset = InMemoryDataset(data_list=data)
    sampler = SizeBalancedBatchSampler(dataset, 3, num_replicas=1, rank=0, shuffle=False)
    loader = DataLoader(dataset, batch_sampler=sampler)
    batches = list(loader)
    assert [b.num_graphs for b in batches] == [3, 3]
    assert sorted(n for b in batches for n in b.num_nodes_list) == [2, 3, 4, 5, 7, 9]
