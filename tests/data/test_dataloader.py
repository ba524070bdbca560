"""The batch DataLoader: batching, seeded shuffling, seeking, workers, samplers."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.datapipes.dataloader import DataLoader
from nvalchemi.data.datapipes.dataset import Dataset, InMemoryDataset
from nvalchemi.data.datapipes.multidataset import MultiDataset
from nvalchemi.data.datapipes.samplers import MultiDatasetBatchSampler, ShuffleSampler


def make_structure(i: int) -> AtomicData:
    n = i % 4 + 1
    gen = torch.Generator().manual_seed(i)
    return AtomicData(
        atomic_numbers=torch.full((n,), i % 50 + 1),
        positions=torch.rand(n, 3, generator=gen) * 4,
        energy=torch.tensor(float(i)),
        forces=torch.rand(n, 3, generator=gen),
    )


ITEMS = [make_structure(i) for i in range(23)]


class ListReader:
    """List-backed reader that records every read (in this process)."""

    def __init__(self, items=ITEMS):
        self.items = items
        self.calls: list[list[int]] = []

    def __len__(self):
        return len(self.items)

    def read_many(self, indices):
        self.calls.append(list(indices))
        return [(dict(self.items[i].items()), {}) for i in indices]


def add_pair_count(data: AtomicData, metadata: dict) -> tuple[AtomicData, dict]:
    """A per-structure transform standing in for a neighbour list."""
    data.add_system_property("pairs", torch.tensor([float(data.num_nodes**2)]))
    return data, metadata


def scale_energy(batch: Batch) -> Batch:
    batch.energy = batch.energy * 10
    return batch


def fail_on_seven(data: AtomicData, metadata: dict) -> tuple[AtomicData, dict]:
    if metadata["index"] == 7:
        raise ValueError("structure seven is broken")
    return data, metadata


def flat(lists: list[list[int]]) -> list[int]:
    return [i for part in lists for i in part]


def tags(loader) -> list[list[int]]:
    return [b.energy.flatten().long().tolist() for b in loader]


def dataset(**kwargs) -> Dataset:
    return Dataset(ListReader(), **kwargs)


# ------------------------------------------------------------------ batching
def test_sequential_batches_from_a_list_reader():
    loader = DataLoader(dataset(), batch_size=5)
    batches = list(loader)
    assert len(loader) == 5 == len(batches)
    assert batches[0].energy.flatten().long().tolist() == [0, 1, 2, 3, 4]
    assert [b.num_graphs for b in batches] == [5, 5, 5, 5, 3]
    assert torch.equal(batches[1].positions, Batch.from_data_list(ITEMS[5:10]).positions)


def test_drop_last_drops_the_incomplete_batch():
    loader = DataLoader(dataset(), batch_size=5, drop_last=True)
    assert len(loader) == 4
    assert [len(t) for t in tags(loader)] == [5, 5, 5, 5]


def test_one_reader_call_per_window_of_prefetch_factor_batches():
    reader = ListReader()
    list(DataLoader(Dataset(reader), batch_size=10, prefetch_factor=1))
    assert reader.calls == [list(range(10)), list(range(10, 20)), [20, 21, 22]]
    reader.calls.clear()
    batches = list(DataLoader(Dataset(reader), batch_size=10, prefetch_factor=2))
    assert reader.calls == [list(range(20)), [20, 21, 22]]
    assert [b.num_graphs for b in batches] == [10, 10, 3]


# ----------------------------------------------------------------- shuffling
def test_shuffle_order_is_a_pure_function_of_seed_and_epoch():
    a = DataLoader(dataset(), batch_size=4, shuffle=True, seed=3)
    b = DataLoader(dataset(), batch_size=4, shuffle=True, seed=3)
    torch.manual_seed(0)
    epoch0 = tags(a)
    torch.manual_seed(999)  # the global RNG must not matter
    assert tags(b) == epoch0 == tags(a)  # same epoch, same order
    assert sorted(flat(epoch0)) == list(range(23))
    assert epoch0 != [list(range(i, min(i + 4, 23))) for i in range(0, 23, 4)]
    a.set_epoch(1)
    assert tags(a) != epoch0
    b.set_epoch(1)
    assert tags(a) == tags(b)
    assert tags(DataLoader(dataset(), batch_size=4, shuffle=True, seed=4)) != epoch0


def test_iteration_does_not_touch_the_global_rng():
    state = torch.get_rng_state()
    list(DataLoader(dataset(), batch_size=4, shuffle=True))
    assert torch.equal(torch.get_rng_state(), state)


# ------------------------------------------------------------------- seeking
def test_set_epoch_step_skips_batches_without_loading_them():
    reader = ListReader()
    loader = DataLoader(Dataset(reader), batch_size=4, shuffle=True, seed=1)
    loader.set_epoch(2)
    full = tags(loader)
    reader.calls.clear()
    loader.set_epoch_step(3)
    resumed = tags(loader)
    assert resumed == full[3:]
    loaded = sorted(flat(reader.calls))
    assert loaded == sorted(flat(full[3:]))  # skipped batches were never read
    assert tags(loader) == full  # one-shot


def test_set_epoch_step_validation():
    loader = DataLoader(dataset(), batch_size=4)
    with pytest.raises(ValueError, match="step"):
        loader.set_epoch_step(-1)
    loader.set_epoch_step(100)
    assert list(loader) == []


def test_state_dict_resumes_mid_epoch_in_a_new_loader():
    loader = DataLoader(dataset(), batch_size=3, shuffle=True, seed=7)
    loader.set_epoch(4)
    full = tags(loader)
    it = iter(loader)
    seen = [next(it).energy.flatten().long().tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state == {"epoch": 4, "epoch_step": 3, "seed": 7}
    fresh = DataLoader(dataset(), batch_size=3, shuffle=True, seed=7)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert seen + tags(fresh) == full
    wrong_seed = DataLoader(dataset(), batch_size=3, shuffle=True, seed=8)
    with pytest.raises(ValueError, match="seed"):
        wrong_seed.load_state_dict(state)


# ------------------------------------------------------------------- workers
@pytest.mark.parametrize("prefetch_factor", [0, 2, 5])
def test_workers_give_the_same_batches_as_in_process(prefetch_factor):
    kwargs = dict(
        batch_size=4,
        shuffle=True,
        seed=5,
        batch_transforms=[scale_energy],
        prefetch_factor=prefetch_factor,
    )
    local = DataLoader(dataset(transforms=[add_pair_count]), **kwargs)
    workers = DataLoader(dataset(transforms=[add_pair_count]), num_workers=2, **kwargs)
    local.set_epoch(1)
    workers.set_epoch(1)
    expected, got = list(local), list(workers)
    assert len(expected) == len(got) == 6
    for a, b in zip(expected, got):
        assert torch.equal(a.energy, b.energy)
        assert torch.equal(a.positions, b.positions)
        assert torch.equal(a.pairs, b.pairs)
        assert torch.equal(a.batch_idx, b.batch_idx)


class LoggingReader(ListReader):
    """Appends the size of every read to a file (reads happen in worker processes)."""

    def __init__(self, log):
        super().__init__()
        self.log = str(log)

    def read_many(self, indices):
        with open(self.log, "a") as handle:
            handle.write(f"{len(indices)}\n")
        return super().read_many(indices)


def test_worker_tasks_hold_at_least_64_structures_of_small_batches(tmp_path):
    log = tmp_path / "reads.txt"
    loader = DataLoader(Dataset(LoggingReader(log)), batch_size=4, num_workers=1)
    assert [b.num_graphs for b in loader] == [4, 4, 4, 4, 4, 3]  # batches as before
    assert log.read_text().split() == ["23"]  # one task: all six batches, one reader call
    log.unlink()
    large = DataLoader(Dataset(LoggingReader(log)), batch_size=10, num_workers=1)
    list(large)
    assert log.read_text().split() == ["23"]  # ceil(64 / 10) = 7 batches per task
    log.unlink()
    own = DataLoader(Dataset(LoggingReader(log)), batch_sampler=[[0, 1], [2], [3, 4]],
                     num_workers=1, prefetch_factor=2)  # fmt: skip
    list(own)
    assert log.read_text().split() == ["3", "2"]  # a batch sampler's windows: prefetch_factor


def test_persistent_workers_follow_epochs_and_seeks():
    local = DataLoader(dataset(), batch_size=5, shuffle=True, seed=2)
    workers = DataLoader(
        dataset(), batch_size=5, shuffle=True, seed=2, num_workers=2, persistent_workers=True
    )
    for epoch in range(2):
        local.set_epoch(epoch)
        workers.set_epoch(epoch)
        assert tags(workers) == tags(local)
    local.set_epoch_step(2)
    workers.set_epoch_step(2)
    assert tags(workers) == tags(local)
    it = iter(workers)  # an abandoned pass must not leak into the next one
    next(it)
    del it
    assert tags(workers) == tags(local)


def test_worker_errors_reach_the_main_process():
    loader = DataLoader(dataset(transforms=[fail_on_seven]), batch_size=4, num_workers=2)
    with pytest.raises(RuntimeError, match="structure 7"):
        list(loader)


def test_in_memory_and_multi_datasets_with_workers():
    multi = MultiDataset(InMemoryDataset(data_list=ITEMS[:10]), dataset())
    local = DataLoader(multi, batch_size=6, shuffle=True)
    workers = DataLoader(multi, batch_size=6, shuffle=True, num_workers=2)
    assert tags(workers) == tags(local)


# ------------------------------------------------------------------ samplers
def test_torch_distributed_sampler_shards_and_receives_set_epoch():
    shards = []
    for rank in range(2):
        sampler = DistributedSampler(ITEMS, num_replicas=2, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(dataset(), batch_size=4, sampler=sampler)
        loader.set_epoch(3)
        assert sampler.epoch == 3 and loader.epoch == 3
        shards.append(flat(tags(loader)))
    assert len(shards[0]) == len(shards[1]) == 12
    assert set(shards[0]) | set(shards[1]) == set(range(23))


def test_batch_sampler_reassigned_like_a_ddp_hook():
    loader = DataLoader(dataset(), batch_size=4)
    sampler = DistributedSampler(ITEMS, num_replicas=2, rank=1, shuffle=False)
    loader.batch_sampler = BatchSampler(sampler, loader.batch_size, drop_last=False)
    loader.sampler = None
    assert len(loader) == 3
    assert tags(loader) == [[1, 3, 5, 7], [9, 11, 13, 15], [17, 19, 21, 0]]  # torch pads
    loader.set_epoch(2)
    assert sampler.epoch == 2


def test_multidataset_batch_sampler_as_batch_sampler_with_workers():
    multi = MultiDataset(dataset(), InMemoryDataset(data_list=ITEMS[:8]))
    sampler = MultiDatasetBatchSampler(multi, batch_size=4, samples_per_dataset=[3, 1], seed=1)
    local = DataLoader(multi, batch_sampler=sampler)
    workers = DataLoader(multi, batch_sampler=sampler, num_workers=2)
    expected = tags(local)
    assert len(expected) == len(local) == len(sampler)
    assert tags(workers) == expected
    local.set_epoch(1)
    assert sampler.epoch == 1 and tags(local) != expected


def test_default_sampler_is_seeded_and_not_distributed():
    loader = DataLoader(dataset(), batch_size=4, shuffle=True, seed=11)
    assert isinstance(loader.sampler, ShuffleSampler) and loader.sampler.seed == 11
    assert loader.batch_sampler is None


# ------------------------------------------------------------ construction
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(prefetch_factor=-1), ValueError, "prefetch_factor"),
        (dict(num_workers=-1), ValueError, "num_workers"),
        (dict(batch_sampler=[[0, 1]], sampler=[0, 1]), ValueError, "batch_sampler"),
        (dict(batch_sampler=[[0, 1]], shuffle=True), ValueError, "batch_sampler"),
        (dict(sampler=[0, 1], shuffle=True), ValueError, "shuffle"),
        (dict(persistent_workers=True), ValueError, "persistent_workers"),
        (dict(batch_transforms=scale_energy), TypeError, "Sequence"),
        (dict(collate_fn=3), TypeError, "collate_fn"),
    ],
)
def test_construction_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        DataLoader(dataset(), **kwargs)


def test_empty_dataset_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        DataLoader(Dataset(ListReader([])))


# ------------------------------------------------------ transforms/collate
def test_batch_transforms_apply_in_order():
    def plus_one(batch: Batch) -> Batch:
        batch.energy = batch.energy + 1
        return batch

    loader = DataLoader(dataset(), batch_size=23, batch_transforms=[scale_energy, plus_one])
    assert tags(loader)[0][:3] == [1, 11, 21]


def test_collate_fn_and_generic_map_datasets():
    calls = []

    def collate(items):
        calls.append(len(items))
        return Batch.from_data_list(items)

    assert tags(DataLoader(dataset(), batch_size=10, collate_fn=collate))[2] == [20, 21, 22]
    assert calls == [10, 10, 3]
    plain = DataLoader(ITEMS, batch_size=10)  # a list of AtomicData is a map-style dataset
    assert tags(plain)[1] == list(range(10, 20))


def test_plain_torch_loader_with_random_sampler_still_works_through_ours():
    loader = DataLoader(dataset(), batch_size=4, sampler=RandomSampler(ITEMS))
    assert sorted(flat(tags(loader))) == list(range(23))


# ------------------------------------------------------------ internals
def test_packed_batches_round_trip_exactly_including_wide_integers():
    import pickle

    from nvalchemi.data.datapipes.dataloader import _Packed

    data = [make_structure(i) for i in range(3)]
    for d in data:
        n = d.num_nodes
        d.add_node_property("big", torch.arange(n, dtype=torch.int64) + 2**40)
        d.add_node_property("flag", torch.ones(n, dtype=torch.bool))
        d.add_system_property("weight", torch.tensor([[0.5]], dtype=torch.float64))
    batch = Batch.from_data_list(data)
    edges = torch.randint(0, batch.num_nodes, (3000, 2))
    batch.set_edges(edges, torch.randint(-2, 3, (3000, 3)), torch.tensor([1000, 1000, 1000]))
    packed = _Packed(batch)
    assert packed.buffer.numel() < 3000 * 5 * 8 / 3  # int64 edges travel narrowed
    restored = pickle.loads(pickle.dumps(packed)).unpack(Batch)
    assert restored.num_graphs == 3
    for key, value in batch:
        assert restored[key].dtype == value.dtype, key
        assert torch.equal(restored[key], value), key
    assert torch.equal(restored.batch_idx, batch.batch_idx)
    assert torch.equal(restored.num_edges_per_graph, batch.num_edges_per_graph)


def test_in_process_loading_runs_single_threaded_and_restores_threads():
    seen = []

    def record(batch: Batch) -> Batch:
        seen.append(torch.get_num_threads())
        return batch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        list(DataLoader(dataset(), batch_size=8, batch_transforms=[record]))
        assert seen == [1, 1, 1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_pin_memory_is_harmless_without_cuda():
    loader = DataLoader(dataset(), batch_size=8, pin_memory=True)
    assert [b.num_graphs for b in loader] == [8, 8, 7]
