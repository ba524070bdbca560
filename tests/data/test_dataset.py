"""Dataset and InMemoryDataset over list-backed readers."""

from __future__ import annotations

import pytest
import torch

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.datapipes.dataset import BatchDatasetProtocol, Dataset, InMemoryDataset


def make_structure(i: int) -> AtomicData:
    n = i % 3 + 1
    gen = torch.Generator().manual_seed(i)
    return AtomicData(
        atomic_numbers=torch.full((n,), i % 50 + 1),
        positions=torch.rand(n, 3, generator=gen) * 3,
        energy=torch.tensor(float(i)),
        forces=torch.rand(n, 3, generator=gen),
    )


class ListReader:
    """A reader over a list of AtomicData that records every read."""

    def __init__(self, items, *, field_levels=None):
        self.items = items
        self.calls: list[list[int]] = []
        self.closed = False
        if field_levels is not None:
            self.field_levels = field_levels

    def __len__(self):
        return len(self.items)

    def read_many(self, indices):
        self.calls.append(list(indices))
        return [(dict(self.items[i].items()), {"source": "list"}) for i in indices]

    def close(self):
        self.closed = True

    def __repr__(self):
        return f"ListReader(n={len(self.items)})"


def energies(batch: Batch) -> list[int]:
    return batch.energy.flatten().long().tolist()


def shift(data: AtomicData, metadata: dict) -> tuple[AtomicData, dict]:
    data.positions = data.positions + 100.0
    metadata["shifted"] = True
    return data, metadata


@pytest.fixture
def items():
    return [make_structure(i) for i in range(10)]


# ------------------------------------------------------------------ Dataset
def test_getitem_returns_atomic_data_and_metadata_is_separate(items):
    ds = Dataset(ListReader(items))
    assert isinstance(ds, BatchDatasetProtocol)
    assert len(ds) == 10
    data = ds[4]
    assert isinstance(data, AtomicData)
    assert data == items[4]
    data, meta = ds.get_with_metadata(-1)
    assert data == items[9]
    assert meta == {"source": "list", "index": 9}


def test_out_of_range_index_names_index_and_source(items):
    ds = Dataset(ListReader(items))
    with pytest.raises(IndexError, match=r"Index 10 .*ListReader\(n=10\)"):
        ds[10]
    with pytest.raises(IndexError, match="-11"):
        ds.load_batches([[0, -11]])


def test_load_batches_reads_once_and_keeps_request_order(items):
    reader = ListReader(items)
    ds = Dataset(reader)
    batches = ds.load_batches([[4, 2, 0], [1], [9, -1]])
    assert reader.calls == [[4, 2, 0, 1, 9, 9]]
    assert [energies(b) for b in batches] == [[4, 2, 0], [1], [9, 9]]
    assert torch.equal(batches[0].positions, torch.cat([items[i].positions for i in (4, 2, 0)]))
    assert ds.get_batch([3]).num_graphs == 1


@pytest.mark.parametrize("skip_validation", [False, True])
def test_transforms_run_on_every_path(items, skip_validation):
    # reference quirk: skip_validation skipped per-sample transforms when loading batches
    ds = Dataset(ListReader(items), transforms=[shift], skip_validation=skip_validation)
    assert ds[0].positions.min() >= 100
    assert ds.get_with_metadata(0)[1]["shifted"] is True
    batch = ds.load_batches([[0, 1]])[0]
    assert batch.positions.min() >= 100
    assert ds.read_many([2])[0][1]["shifted"] is True


def test_transform_error_names_the_structure(items):
    def broken(data: AtomicData, metadata: dict):
        if metadata["index"] == 3:
            raise ValueError("bad structure")
        return data, metadata

    ds = Dataset(ListReader(items), transforms=[broken])
    ds.load_batches([[0, 1]])
    with pytest.raises(RuntimeError, match="structure 3") as info:
        ds.load_batches([[2, 3]])
    assert "bad structure" in str(info.value)


def test_invalid_labels_raise_with_index_unless_validation_is_skipped(items):
    items[5] = make_structure(5)
    bad = dict(items[5].items())
    bad["energy"] = torch.tensor([[float("nan")]])

    class BadReader(ListReader):
        def read_many(self, indices):
            return [(bad if i == 5 else dict(self.items[i].items()), {}) for i in indices]

    with pytest.raises(ValueError, match=r"structure 5.*NaN"):
        Dataset(BadReader(items)).get_batch([4, 5])
    batch = Dataset(BadReader(items), skip_validation=True).get_batch([4, 5])
    assert torch.isnan(batch.energy[1]).all()


def test_reader_with_only_read_or_load_sample_is_accepted(items):
    class ReadOnly:
        def __len__(self):
            return len(items)

        def read(self, index):
            return dict(items[index].items()), {"one": index}

    class LoadSample:
        def __len__(self):
            return len(items)

        def _load_sample(self, index):
            return dict(items[index].items())

    assert Dataset(ReadOnly()).get_with_metadata(2)[1] == {"one": 2, "index": 2}
    assert energies(Dataset(LoadSample()).get_batch([1, 2])) == [1, 2]


def test_constructor_errors(items):
    with pytest.raises(TypeError, match="read_many"):
        Dataset(object())
    with pytest.raises(TypeError, match="Sequence"):
        Dataset(ListReader(items), transforms=shift)

    def batch_transform(batch: Batch) -> Batch:
        return batch

    with pytest.raises(TypeError, match="batch_transforms"):
        Dataset(ListReader(items), transforms=[batch_transform])
    with pytest.raises(TypeError, match="device"):
        Dataset(ListReader(items), device=3)


def test_device_is_applied_to_items_and_batches(items):
    ds = Dataset(ListReader(items), device="cpu")
    assert ds.target_device == torch.device("cpu")
    assert ds[0].device.type == "cpu"
    assert ds.get_batch([0, 1]).device.type == "cpu"
    assert Dataset(ListReader(items), device="auto").target_device is not None


def test_custom_fields_keep_their_level_in_batches(items):
    for i, data in enumerate(items):
        data.add_system_property("weight", torch.tensor([float(i)]))
    ds = Dataset(ListReader(items, field_levels={"weight": "system"}))
    batch = ds.get_batch([1, 2, 3])
    assert batch.level_of("weight") == "system"
    assert batch.weight.flatten().tolist() == [1.0, 2.0, 3.0]


def test_get_metadata_and_field_names(items):
    class WithMetadata(ListReader):
        field_names = ["atomic_numbers", "positions"]

        def get_metadata(self, index):
            return (99, 0)

    assert Dataset(WithMetadata(items)).get_metadata(1) == (99, 0)
    assert Dataset(ListReader(items)).get_metadata(2) == (3, 0)
    assert Dataset(WithMetadata(items)).field_names == ["atomic_numbers", "positions"]

    def add_tag(data: AtomicData, metadata: dict):
        data.add_system_property("tag", torch.tensor([1.0]))
        return data, metadata

    names = Dataset(ListReader(items), transforms=[add_tag]).field_names
    assert "tag" in names and "energy" in names


def test_close_and_context_manager_close_the_reader(items):
    reader = ListReader(items)
    with Dataset(reader) as ds:
        ds[0]
    assert reader.closed


def test_plain_torch_dataloader_works_with_collate_from_data_list(items):
    ds = Dataset(ListReader(items))
    loader = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=Batch.from_data_list)
    assert [energies(b) for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    seeds_style = torch.utils.data.DataLoader(
        ds, batch_size=3, shuffle=False, collate_fn=lambda s: Batch.from_data_list(list(s))
    )
    assert sum(b.num_graphs for b in seeds_style) == 10


# ---------------------------------------------------------- InMemoryDataset
def test_in_memory_from_data_list_serves_index_selects(items):
    ds = InMemoryDataset(data_list=items, chunk_size=3)
    assert isinstance(ds, BatchDatasetProtocol)
    assert len(ds) == 10
    assert ds[7] == items[7]
    expected = Batch.from_data_list([items[i] for i in (8, 1, 1)])
    got = ds.load_batches([[8, 1, 1], [0]])
    assert torch.equal(got[0].positions, expected.positions)
    assert energies(got[0]) == [8, 1, 1] and energies(got[1]) == [0]
    assert ds.get_metadata(2) == (3, 0)
    assert ds.get_with_metadata(-1)[1] == {"index": 9}


def test_in_memory_from_reader_closes_it_even_on_error(items):
    reader = ListReader(items)
    ds = InMemoryDataset(reader=reader, chunk_size=4)
    assert reader.closed and len(reader.calls) == 3
    assert energies(ds.get_batch([9, 0])) == [9, 0]

    def explode(batch: Batch) -> Batch:
        raise RuntimeError("no")

    failing = ListReader(items)
    with pytest.raises(RuntimeError):
        InMemoryDataset(reader=failing, batch_transforms=[explode])
    assert failing.closed


def test_in_memory_transforms_run_once_per_structure(items):
    calls = []

    def count(data: AtomicData, metadata: dict):
        calls.append(metadata["index"])
        return data, metadata

    def tag_batch(batch: Batch) -> Batch:
        batch.add_key("chunk", torch.ones(batch.num_graphs), level="system")
        return batch

    ds = InMemoryDataset(data_list=items, transforms=[count], batch_transforms=[tag_batch])
    ds.load_batches([[0, 1], [2]])
    ds[3]
    assert calls == list(range(10))
    assert ds.get_batch([5]).chunk.tolist() == [1.0]


def test_in_memory_from_batch_and_source_errors(items):
    batch = Batch.from_data_list(items)
    ds = InMemoryDataset(batch)
    assert ds.in_memory_batch is batch and len(ds) == 10
    with pytest.raises(ValueError, match="exactly one"):
        InMemoryDataset()
    with pytest.raises(ValueError, match="exactly one"):
        InMemoryDataset(batch, data_list=items)
    with pytest.raises(ValueError, match="chunk_size"):
        InMemoryDataset(data_list=items, chunk_size=0)
    with pytest.raises(ValueError, match="empty"):
        InMemoryDataset(reader=ListReader([]))
    with pytest.raises(ValueError, match="empty batch"):
        ds.load_batches([[]])


def test_in_memory_field_names_list_only_stored_fields(items):
    # reference quirk: every declared AtomicData field was listed, set or not
    names = InMemoryDataset(data_list=items).field_names
    assert names == sorted(["atomic_numbers", "positions", "energy", "forces"])


def test_readers_declaring_validated_output_skip_revalidation(items):
    class Trusted(ListReader):
        validates = True

    bad = dict(items[0].items())
    bad["energy"] = torch.tensor([[float("inf")]])
    trusted, plain = Trusted(items), ListReader(items)
    trusted.read_many = plain.read_many = lambda idx: [(bad, {}) for _ in idx]
    assert Dataset(trusted).skip_validation is True
    assert torch.isinf(Dataset(trusted)[0].energy).all()
    with pytest.raises(ValueError, match="NaN or inf"):
        Dataset(plain)[0]
    with pytest.raises(ValueError, match="NaN or inf"):
        Dataset(trusted, skip_validation=False)[0]


def test_transforms_do_not_modify_atomic_data_held_by_the_reader(items):
    class ObjectReader(ListReader):
        def read_many(self, indices):
            return [(self.items[i], {}) for i in indices]

    before = items[2].positions.clone()
    ds = Dataset(ObjectReader(items), transforms=[shift])
    ds.get_batch([2, 2])
    ds[2]
    assert torch.equal(items[2].positions, before)
