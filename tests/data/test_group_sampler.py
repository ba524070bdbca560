"""``GroupBalancedSampler``: groups drawn in proportion to count**alpha (issue 29, point 2)."""

import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch
from _ranks import run_ranks

from nvalchemi.data import AtomicData
from nvalchemi.data.datapipes import (
    BudgetBatchSampler,
    DataLoader,
    GroupBalancedSampler,
    InMemoryDataset,
    ShuffleSampler,
)
from nvalchemi.data.datapipes.samplers import group_shares

GROUPS = ["bulk"] * 90 + ["slab"] * 9 + ["cluster"] * 1


def drawn(sampler, epoch=0):
    sampler.set_epoch(epoch)
    return Counter(GROUPS[i] for i in sampler)


def test_alpha_1_is_exactly_the_plain_shuffle():
    for epoch in (0, 3):
        plain, balanced = (
            ShuffleSampler(len(GROUPS), seed=5),
            GroupBalancedSampler(GROUPS, alpha=1.0, seed=5),
        )
        plain.set_epoch(epoch)
        balanced.set_epoch(epoch)
        assert list(balanced) == list(plain)


def test_alpha_sets_each_groups_share_of_an_epoch():
    assert drawn(GroupBalancedSampler(GROUPS, alpha=0.0)) == {"bulk": 34, "slab": 33, "cluster": 33}
    half = GroupBalancedSampler(GROUPS, alpha=0.5)
    # sqrt(90) : sqrt(9) : sqrt(1) = 70.3 : 22.2 : 7.4 of 100 draws (largest remainder)
    assert [round(100 * p, 1) for p in group_shares([90, 9, 1], 0.5)] == [70.3, 22.2, 7.4]
    assert half.counts == {"bulk": 70, "cluster": 8, "slab": 22}
    assert drawn(half) == half.counts
    assert len(half) == len(list(half)) == 100  # an epoch keeps its length
    assert drawn(GroupBalancedSampler(GROUPS, alpha=1.0)) == {"bulk": 90, "slab": 9, "cluster": 1}


def test_every_structure_of_a_group_is_seen_equally_often_over_epochs():
    sampler = GroupBalancedSampler(GROUPS, alpha=0.0)  # bulk: 34 of 90 per epoch
    seen = Counter()
    for epoch in range(45):  # 45 * 34 = 17 passes over the 90 bulk structures
        sampler.set_epoch(epoch)
        seen.update(i for i in sampler if GROUPS[i] == "bulk")
    assert set(seen.values()) == {17}


def test_the_order_is_a_pure_function_of_seed_and_epoch_and_a_loader_resumes_exactly():
    a, b = (
        GroupBalancedSampler(GROUPS, alpha=0.3, seed=1),
        GroupBalancedSampler(GROUPS, alpha=0.3, seed=1),
    )
    b.set_epoch(4)
    b_first = list(b)
    b.set_epoch(2)
    a.set_epoch(2)
    assert list(a) == list(b)
    b.set_epoch(4)
    assert list(b) == b_first
    other = GroupBalancedSampler(GROUPS, alpha=0.3, seed=2)
    other.set_epoch(4)
    assert list(other) != b_first
    data = [
        AtomicData(
            atomic_numbers=torch.tensor([1]),
            positions=torch.zeros(1, 3),
            energy=torch.full((1, 1), float(i)),
        )
        for i in range(len(GROUPS))
    ]
    dataset = InMemoryDataset(data_list=data)

    def loader():
        return DataLoader(
            dataset, sampler=GroupBalancedSampler(GROUPS, alpha=0.3, seed=1), batch_size=7
        )

    full = loader()
    full.set_epoch(3)
    epoch = [b.energy.reshape(-1).tolist() for b in full]
    resumed = loader()
    resumed.load_state_dict({"epoch": 3, "epoch_step": 5})
    assert [b.energy.reshape(-1).tolist() for b in resumed] == epoch[5:]


def test_two_ranks_share_the_epoch_exactly_with_ddp():
    script = Path(__file__).with_name("_group_ranks.py")
    spec = importlib.util.spec_from_file_location("_group_ranks", script)
    ranks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ranks)
    r0, r1 = run_ranks(script, timeout=240)
    assert r0["same_sampler"] and r1["same_sampler"]  # DDPHook kept it: it shards itself
    assert (r0["replicas"], r0["sampler_rank"], r1["sampler_rank"]) == (2, 0, 1)
    for epoch in range(2):
        whole = GroupBalancedSampler(ranks.GROUPS, alpha=ranks.ALPHA, seed=ranks.SEED)
        whole.set_epoch(epoch)
        order = whole.epoch_indices().tolist()  # 48 draws, 24 per rank
        per_rank = len(order) // 2
        batches = per_rank // ranks.BATCH
        mine = [r["labels"][epoch * batches : (epoch + 1) * batches] for r in (r0, r1)]
        assert [i for b in mine[0] for i in b] == order[0::2]
        assert [i for b in mine[1] for i in b] == order[1::2]
        assert Counter(ranks.GROUPS[i] for i in order) == {"bulk": 16, "slab": 16, "cluster": 16}


def test_budget_batches_pack_the_balanced_draws():
    sizes = [8] * 90 + [40] * 9 + [60]
    balanced = GroupBalancedSampler(GROUPS, alpha=0.0, seed=0, num_replicas=1, rank=0)
    sampler = BudgetBatchSampler(sizes, max_atoms=120, seed=0, sampler=balanced)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        balanced.set_epoch(epoch)
        expected = Counter(balanced.epoch_indices().tolist())
        batches = list(sampler)
        assert Counter(i for b in batches for i in b) == expected  # every draw, once
        assert max(sum(sizes[i] for i in b) for b in batches) <= 120
    shard = sampler.shard(2, 1)
    assert shard.sampler is balanced and len(shard) == len(sampler) // 2
    with pytest.raises(ValueError, match="num_replicas=1"):
        BudgetBatchSampler(
            sizes, max_atoms=120, sampler=GroupBalancedSampler(GROUPS, num_replicas=2, rank=0)
        )


def test_bad_alpha_and_empty_groups_are_refused():
    with pytest.raises(ValueError, match="alpha must be a number >= 0"):
        GroupBalancedSampler(GROUPS, alpha=-1)
    with pytest.raises(ValueError, match="at least one structure"):
        GroupBalancedSampler([])
