"""MultiDataset: index maps, metadata, routing of mixed batches."""

from __future__ import annotations

import pytest
import torch

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.datapipes.dataloader import DataLoader
from nvalchemi.data.datapipes.dataset import Dataset, InMemoryDataset
from nvalchemi.data.datapipes.multidataset import DATASET_INDEX_METADATA_KEY, MultiDataset
from nvalchemi.data.datapipes.samplers import MultiDatasetBatchSampler


def structure(z: int, tag: float, *, stress: bool = False) -> AtomicData:
    n = z % 3 + 1
    fields = {}
    if stress:
        fields["stress"] = torch.eye(3) * tag
    return AtomicData(
        atomic_numbers=torch.full((n,), z),
        positions=torch.full((n, 3), float(tag)),
        energy=torch.tensor(float(tag)),
        **fields,
    )


class ListReader:
    def __init__(self, items):
        self.items = items
        self.calls: list[list[int]] = []
        self.closed = False

    def __len__(self):
        return len(self.items)

    def read_many(self, indices):
        self.calls.append(list(indices))
        return [(dict(self.items[i].items()), {"src_index": i}) for i in indices]

    def close(self):
        self.closed = True


def tags(batch: Batch) -> list[float]:
    return batch.energy.flatten().tolist()


@pytest.fixture
def parts():
    first = [structure(1, 100 + i) for i in range(3)]
    second = [structure(8, 200 + i) for i in range(4)]
    return first, second


def test_global_and_local_index_maps(parts):
    multi = MultiDataset(Dataset(ListReader(parts[0])), Dataset(ListReader(parts[1])))
    assert len(multi) == 7 and multi.offsets == [0, 3]
    assert multi.to_local_index(0) == (0, 0)
    assert multi.to_local_index(3) == (1, 0)
    assert multi.to_local_index(-1) == (1, 3)
    assert multi.to_global_index(1, 2) == 5
    assert multi.to_global_index(-1, -1) == 6
    with pytest.raises(IndexError):
        multi.to_local_index(7)
    with pytest.raises(IndexError):
        multi.to_global_index(0, 3)
    with pytest.raises(IndexError):
        multi.to_global_index(2, 0)


def test_items_come_from_the_right_child_with_dataset_index(parts):
    multi = MultiDataset(Dataset(ListReader(parts[0])), InMemoryDataset(data_list=parts[1]))
    assert multi[4] == parts[1][1]
    data, meta = multi.get_with_metadata(1)
    assert data == parts[0][1]
    assert meta == {"src_index": 1, "index": 1, DATASET_INDEX_METADATA_KEY: 0}
    assert multi.get_with_metadata(6)[1][DATASET_INDEX_METADATA_KEY] == 1
    assert multi.get_metadata(3) == (parts[1][0].num_nodes, 0)


def test_single_child_requests_are_delegated_with_local_indices(parts):
    readers = ListReader(parts[0]), ListReader(parts[1])
    multi = MultiDataset(*(Dataset(r) for r in readers))
    for r in readers:
        r.calls.clear()  # the strict field-name check read one structure of each
    batches = multi.load_batches([[5, 3], [6]])
    assert readers[0].calls == []
    assert readers[1].calls == [[2, 0, 3]]
    assert [tags(b) for b in batches] == [[202.0, 200.0], [203.0]]


def test_mixed_batches_read_each_child_once_and_keep_request_order(parts):
    readers = ListReader(parts[0]), ListReader(parts[1])
    multi = MultiDataset(*(Dataset(r) for r in readers), output_strict=False)
    request = [[4, 0, 5, 1], [2], [6, 3]]
    batches = multi.load_batches(request)
    assert readers[0].calls == [[0, 1, 2]]
    assert readers[1].calls == [[1, 2, 3, 0]]
    for indices, batch in zip(request, batches):
        expected = Batch.from_data_list([multi[i] for i in indices])
        assert tags(batch) == tags(expected)
        assert torch.equal(batch.positions, expected.positions)
        assert torch.equal(batch.atomic_numbers, expected.atomic_numbers)
        assert torch.equal(batch.batch_idx, expected.batch_idx)


def test_mixes_dataset_and_in_memory_children(parts):
    multi = MultiDataset(InMemoryDataset(data_list=parts[0]), Dataset(ListReader(parts[1])))
    batch = multi.get_batch([6, 2, 3])
    assert tags(batch) == [203.0, 102.0, 200.0]


def test_strict_field_names_must_agree(parts):
    with_stress = [structure(8, 300 + i, stress=True) for i in range(2)]
    with pytest.raises(ValueError, match="stress"):
        MultiDataset(Dataset(ListReader(parts[0])), Dataset(ListReader(with_stress)))
    loose = MultiDataset(
        Dataset(ListReader(parts[0])), Dataset(ListReader(with_stress)), output_strict=False
    )
    batch = loose.get_batch([0, 3])
    assert torch.isnan(batch.stress[0]).all()
    assert torch.equal(batch.stress[1], torch.eye(3) * 300)


def test_constructor_errors(parts):
    with pytest.raises(ValueError, match="at least one"):
        MultiDataset()
    with pytest.raises(TypeError, match="dataset 1"):
        MultiDataset(Dataset(ListReader(parts[0])), [1, 2, 3])


def test_empty_batch_is_rejected(parts):
    multi = MultiDataset(Dataset(ListReader(parts[0])), Dataset(ListReader(parts[1])))
    with pytest.raises(ValueError, match="empty batch"):
        multi.load_batches([[0, 4], []])


def test_child_returning_wrong_count_is_reported(parts):
    class Short(InMemoryDataset):
        def load_batches(self, lists, *, device=None):
            return super().load_batches(lists[:-1], device=device)

    multi = MultiDataset(Dataset(ListReader(parts[0])), Short(data_list=parts[1]))
    with pytest.raises(RuntimeError, match="dataset 1 returned 1 batches"):
        multi.load_batches([[0, 3], [1, 4]])


def test_close_closes_every_child(parts):
    readers = ListReader(parts[0]), ListReader(parts[1])
    with MultiDataset(*(Dataset(r) for r in readers)):
        pass
    assert all(r.closed for r in readers)


def test_loader_with_balanced_batch_sampler():
    first = [structure(i + 1, i) for i in range(4)]
    second = [structure(i + 1, 10 + i) for i in range(6)]
    multi = MultiDataset(Dataset(ListReader(first)), Dataset(ListReader(second)))
    sampler = MultiDatasetBatchSampler.balanced(
        multi, batch_size=4, num_batches=2, replacement=False, shuffle=False
    )
    loader = DataLoader(multi, batch_sampler=sampler)
    assert [b.atomic_numbers.unique_consecutive().tolist() for b in loader] == [
        [1, 2, 1, 2],
        [3, 4, 3, 4],
    ]


def test_plain_torch_dataloader_over_multidataset(parts):
    multi = MultiDataset(Dataset(ListReader(parts[0])), InMemoryDataset(data_list=parts[1]))
    loader = torch.utils.data.DataLoader(
        multi, batch_size=4, collate_fn=lambda s: Batch.from_data_list(list(s))
    )
    assert [tags(b) for b in loader] == [[100.0, 101.0, 102.0, 200.0], [201.0, 202.0, 203.0]]


def test_loss_weights_and_heads_are_attached_per_dataset_in_request_order():
    a = InMemoryDataset(data_list=[structure(1, float(i)) for i in range(3)])
    b = InMemoryDataset(data_list=[structure(8, 10.0 + i) for i in range(2)])
    multi = MultiDataset(a, b, loss_weights=[1.0, 0.5], head_indices=[2, 0])
    batch = multi.get_batch([3, 0, 4, 1])
    assert batch["loss_weight"].shape == (4, 1)  # one float per structure, as energies
    assert batch["loss_weight"].reshape(-1).tolist() == [0.5, 1.0, 0.5, 1.0]
    assert batch["loss_weight"].dtype == batch["positions"].dtype
    assert batch["head"].tolist() == [0, 2, 0, 2] and batch["head"].dtype == torch.int64
    single = multi.get_batch([4, 3])  # one child only: the fast path attaches them too
    assert single["loss_weight"].reshape(-1).tolist() == [0.5, 0.5]
    item = multi[1]
    assert item["loss_weight"].tolist() == [[1.0]] and item["head"].tolist() == [2]
    assert "loss_weight" not in a[1]  # the child's own structure is not changed
    loaded = next(iter(DataLoader(multi, batch_size=5)))
    assert sorted(loaded["loss_weight"].reshape(-1).tolist()) == [0.5, 0.5, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss_weights": [1.0]}, ValueError, "1 entries for 2 datasets"),
        ({"loss_weights": [1.0, -1.0]}, ValueError, "non-negative"),
        ({"loss_weights": [1.0, "x"]}, TypeError, "must be a number"),
        ({"head_indices": [0, 1.5]}, TypeError, "must be an integer"),
    ],
)
def test_bad_per_dataset_values_are_named(kwargs, error, match):
    a = InMemoryDataset(data_list=[structure(1, 0.0)])
    with pytest.raises(error, match=match):
        MultiDataset(a, a, **kwargs)
