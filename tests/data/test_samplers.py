"""Samplers: seeded shuffling, weighted multi-dataset sampling, distributed sharding."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from nvalchemi.data import AtomicData
from nvalchemi.data.datapipes.dataset import InMemoryDataset
from nvalchemi.data.datapipes.multidataset import MultiDataset
from nvalchemi.data.datapipes.samplers import (
    DistributedSamplerProtocol,
    MultiDatasetBatchSampler,
    MultiDatasetSampler,
    ShuffleSampler,
    allocate,
    epoch_generator,
)


def _child(n: int) -> InMemoryDataset:
    if n == 0:
        return _Empty()
    data = [
        AtomicData(atomic_numbers=torch.tensor([i + 1]), positions=torch.zeros(1, 3))
        for i in range(n)
    ]
    return InMemoryDataset(data_list=data)


class _Empty:
    """An empty child dataset (InMemoryDataset refuses to be empty)."""

    field_names: list[str] = []

    def __len__(self):
        return 0

    def __getitem__(self, index):
        raise IndexError(index)

    def load_batches(self, lists):
        return []

    def get_metadata(self, index):
        raise IndexError(index)

    def close(self):
        pass


def _multi(*sizes: int) -> MultiDataset:
    return MultiDataset(*[_child(n) for n in sizes])


class _Manager:
    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank

    def is_initialized(self) -> bool:
        return True


# ------------------------------------------------------------------ basics
def test_torch_distributed_sampler_satisfies_protocol_but_shuffle_sampler_does_not():
    assert isinstance(
        DistributedSampler(range(4), num_replicas=2, rank=0), DistributedSamplerProtocol
    )
    # a DDP hook must not mistake the loader's default sampler for a distributed one
    assert not isinstance(ShuffleSampler(4), DistributedSamplerProtocol)


def test_epoch_generator_is_a_pure_function_of_seed_and_epoch():
    def perm(seed, epoch):
        return torch.randperm(50, generator=epoch_generator(seed, epoch)).tolist()

    assert perm(3, 1) == perm(3, 1)
    assert perm(3, 1) != perm(3, 2)
    assert perm(3, 2) != perm(4, 1)  # seed + epoch would collide here


def test_allocate_uses_largest_remainder():
    assert allocate(5, [0.8, 0.2]) == [4, 1]
    assert allocate(10, [1 / 3, 1 / 3, 1 / 3]) == [4, 3, 3]
    assert sum(allocate(7, [0.1, 0.6, 0.3])) == 7


def test_shuffle_sampler_is_deterministic_per_epoch_and_ignores_global_rng():
    sampler = ShuffleSampler(20, seed=5)
    torch.manual_seed(0)
    first = list(sampler)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    assert list(sampler) == first
    assert torch.equal(torch.get_rng_state(), state)
    assert sorted(first) == list(range(20))
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    assert ShuffleSampler(20, seed=5).indices().tolist() == first


def test_shuffle_sampler_without_shuffle_is_sequential_and_follows_length():
    items = [0, 1, 2]
    sampler = ShuffleSampler(items, shuffle=False)
    assert list(sampler) == [0, 1, 2]
    items.append(3)
    assert len(sampler) == 4 and list(sampler) == [0, 1, 2, 3]


def test_set_epoch_rejects_negative_values():
    with pytest.raises(ValueError, match="epoch"):
        ShuffleSampler(3).set_epoch(-1)


# ------------------------------------------------------ MultiDatasetSampler
def test_multidataset_sampler_shards_samples_across_ranks():
    dataset = _multi(3, 3)
    rank0 = MultiDatasetSampler(dataset, num_replicas=2, rank=0, replacement=False, shuffle=False)
    rank1 = MultiDatasetSampler(dataset, num_replicas=2, rank=1, replacement=False, shuffle=False)
    assert isinstance(rank0, DistributedSamplerProtocol)
    assert (len(rank0), len(rank1)) == (3, 3)
    assert list(rank0) == [0, 2, 4]
    assert list(rank1) == [1, 3, 5]


def test_multidataset_sampler_takes_rank_from_initialised_manager():
    sampler = MultiDatasetSampler(
        _multi(3, 3), distributed_manager=_Manager(2, 1), replacement=False, shuffle=False
    )
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    assert list(sampler) == [1, 3, 5]


def test_multidataset_sampler_uses_weights_without_replacement():
    dataset = _multi(3, 8)
    sampler = MultiDatasetSampler(
        dataset, weights=[1.0, 3.0], num_samples=8, replacement=False, shuffle=False
    )
    indices = list(sampler)
    assert indices == [0, 1, 3, 4, 5, 6, 7, 8]
    assert [dataset.to_local_index(i)[0] for i in indices] == [0, 0, 1, 1, 1, 1, 1, 1]


def test_multidataset_sampler_set_epoch_changes_the_owned_shuffle():
    sampler = MultiDatasetSampler(
        _multi(8, 8), num_samples=12, replacement=False, shuffle=True, seed=17
    )
    epoch0 = list(sampler)
    assert epoch0 == list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != epoch0


def test_user_generator_still_reshuffles_on_set_epoch():
    # reference quirk: a user generator made set_epoch a no-op (the state just advanced)
    make = lambda: MultiDatasetSampler(  # noqa: E731
        _multi(10, 10), generator=torch.Generator().manual_seed(4), replacement=False
    )
    a, b = make(), make()
    assert list(a) == list(a) == list(b)
    epoch0 = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) != epoch0
    assert list(a) == list(b)


def test_replacement_draws_are_valid_and_identical_across_ranks():
    dataset = _multi(4, 7)
    full = MultiDatasetSampler(dataset, num_samples=30, seed=2).epoch_indices()
    assert full.min() >= 0 and full.max() < 11
    shards = [
        list(MultiDatasetSampler(dataset, num_samples=30, seed=2, num_replicas=3, rank=r))
        for r in range(3)
    ]
    interleaved = [shards[r][k] for k in range(10) for r in range(3)]
    assert interleaved == full.tolist()


def test_sampler_without_replacement_rejects_oversized_allocation():
    with pytest.raises(ValueError, match="replacement=True"):
        MultiDatasetSampler(_multi(2, 8), weights=[1, 1], num_samples=10, replacement=False)


def test_weight_validation_errors():
    dataset = _multi(2, 3)
    for weights in ([1.0], [-1.0, 1.0], [0.0, 0.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError):
            MultiDatasetSampler(dataset, weights=weights)
    with pytest.raises(ValueError, match="empty"):
        MultiDatasetSampler(MultiDataset(_child(2), _Empty()), weights=[1.0, 1.0])


def test_drop_last_sharding_truncates_like_torch():
    dataset = _multi(3, 4)  # 7 samples over 2 ranks
    kept = MultiDatasetSampler(dataset, num_replicas=2, rank=1, shuffle=False, replacement=False)
    dropped = MultiDatasetSampler(
        dataset, num_replicas=2, rank=1, shuffle=False, replacement=False, drop_last=True
    )
    torch_kept = DistributedSampler(range(7), num_replicas=2, rank=1, shuffle=False)
    assert list(kept) == list(torch_kept) == [1, 3, 5, 0]
    assert list(dropped) == [1, 3, 5] and len(dropped) == 3


def test_rank_validation():
    with pytest.raises(ValueError, match="rank"):
        MultiDatasetSampler(_multi(2, 2), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas"):
        MultiDatasetSampler(_multi(2, 2), num_replicas=0, rank=0)


# ------------------------------------------------- MultiDatasetBatchSampler
def test_batch_sampler_shards_whole_batches_round_robin():
    dataset = _multi(6, 6)
    kwargs = dict(
        batch_size=4,
        samples_per_dataset=[2, 2],
        num_batches=3,
        num_replicas=2,
        replacement=False,
        shuffle=False,
    )
    rank0 = MultiDatasetBatchSampler(dataset, rank=0, **kwargs)
    rank1 = MultiDatasetBatchSampler(dataset, rank=1, **kwargs)
    assert isinstance(rank0, DistributedSamplerProtocol)
    assert (len(rank0), len(rank1)) == (2, 2)
    assert list(rank0) == [[0, 1, 6, 7], [4, 5, 10, 11]]
    assert list(rank1) == [[2, 3, 8, 9], [0, 1, 6, 7]]


def test_batch_sampler_pads_every_rank_when_batches_are_fewer_than_ranks():
    dataset = _multi(2, 2)
    batches = [
        list(
            MultiDatasetBatchSampler(
                dataset,
                batch_size=2,
                samples_per_dataset=[1, 1],
                num_batches=1,
                num_replicas=4,
                rank=rank,
                replacement=False,
                shuffle=False,
            )
        )
        for rank in range(4)
    ]
    assert batches == [[[0, 2]]] * 4


def test_batch_sampler_drop_last_truncates_the_ragged_round():
    sampler = MultiDatasetBatchSampler(
        _multi(6, 6),
        batch_size=4,
        samples_per_dataset=[2, 2],
        num_batches=3,
        num_replicas=2,
        rank=1,
        replacement=False,
        shuffle=False,
        drop_last=True,
    )
    assert len(sampler) == 1
    assert list(sampler) == [[2, 3, 8, 9]]


def test_balanced_batches():
    sampler = MultiDatasetBatchSampler.balanced(
        _multi(4, 6), batch_size=4, num_batches=2, replacement=False, shuffle=False
    )
    assert list(sampler) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_weights_allocate_batch_slots():
    sampler = MultiDatasetBatchSampler(
        _multi(8, 8),
        batch_size=5,
        weights=[4.0, 1.0],
        num_batches=2,
        replacement=False,
        shuffle=False,
    )
    assert sampler.samples_per_dataset == [4, 1]
    assert list(sampler) == [[0, 1, 2, 3, 8], [4, 5, 6, 7, 9]]


def test_float_samples_per_dataset_are_relative_rates():
    sampler = MultiDatasetBatchSampler(
        _multi(8, 8),
        batch_size=8,
        samples_per_dataset=[1.0, 3.0],
        num_batches=1,
        replacement=False,
        shuffle=False,
    )
    assert sampler.samples_per_dataset == [2, 6]
    assert list(sampler) == [[0, 1, 8, 9, 10, 11, 12, 13]]


def test_epoch_policies():
    dataset = _multi(2, 6)
    small = MultiDatasetBatchSampler.balanced(
        dataset, batch_size=4, epoch_policy="min_size", shuffle=False
    )
    assert len(small) == 1 and list(small) == [[0, 1, 2, 3]]
    large = MultiDatasetBatchSampler.balanced(
        dataset, batch_size=4, epoch_policy="max_size", shuffle=False
    )
    assert len(large) == 3
    assert list(large) == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 6, 7]]
    default = MultiDatasetBatchSampler.balanced(dataset, batch_size=4, shuffle=False)
    assert len(default) == 2  # ceil(8 / 4)
    with pytest.raises(ValueError, match="replacement=True"):
        MultiDatasetBatchSampler.balanced(
            dataset, batch_size=4, epoch_policy="max_size", replacement=False
        )


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(batch_size=0), ValueError),
        (dict(batch_size=4, weights=[1, 1], samples_per_dataset=[2, 2]), ValueError),
        (dict(batch_size=4, samples_per_dataset=[2, 1]), ValueError),
        (dict(batch_size=4, samples_per_dataset=[0, 0]), ValueError),
        (dict(batch_size=4, samples_per_dataset=[True, 3]), TypeError),
        (dict(batch_size=4, samples_per_dataset=[2, 2, 0]), ValueError),
        (dict(batch_size=4, num_batches=0), ValueError),
        (dict(batch_size=4, num_batches=3, replacement=False), ValueError),
        (dict(batch_size=4, epoch_policy="forever"), ValueError),
    ],
)
def test_batch_sampler_validation(kwargs, error):
    with pytest.raises(error):
        MultiDatasetBatchSampler(_multi(4, 4), **kwargs)


def test_positive_count_on_empty_child_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        MultiDatasetBatchSampler(
            MultiDataset(_child(4), _Empty()), batch_size=2, samples_per_dataset=[1, 1]
        )


def test_shuffled_batch_epochs_are_deterministic_and_identical_across_ranks():
    dataset = _multi(10, 14)
    make = lambda **kw: MultiDatasetBatchSampler(  # noqa: E731
        dataset, batch_size=4, samples_per_dataset=[2, 2], seed=9, **kw
    )
    single = list(make())
    assert single == list(make())
    ranks = [list(make(num_replicas=3, rank=r)) for r in range(3)]
    assert all(len(r) == len(make(num_replicas=3, rank=0)) for r in ranks)
    interleaved = [ranks[k % 3][k // 3] for k in range(len(single))]
    assert interleaved == single
    for batch in single:
        assert sum(i < 10 for i in batch) == 2  # two from each child per batch
    epoch1 = make()
    epoch1.set_epoch(1)
    assert list(epoch1) != single


def test_batch_sampler_without_replacement_covers_each_child_once():
    sampler = MultiDatasetBatchSampler(
        _multi(6, 9), batch_size=5, samples_per_dataset=[2, 3], replacement=False, seed=1
    )
    flat = [i for batch in sampler for i in batch]
    assert len(flat) == len(set(flat)) == 15
