"""Batch: collation, missing labels, routing, selection, splitting and devices."""

import pickle

import numpy as np
import pytest
import torch

from nvalchemi.data import AtomicData, Batch


def molecule(n=2, energy=-1.0, with_edges=True):
    fields = {
        "atomic_numbers": torch.full((n,), 1),
        "positions": torch.randn(n, 3),
        "energy": torch.tensor(energy),
        "forces": torch.randn(n, 3),
    }
    if with_edges:
        src = torch.arange(n)
        fields["neighbor_list"] = torch.stack([src, (src + 1) % n], 1)
        fields["neighbor_list_shifts"] = torch.zeros(n, 3, dtype=torch.int64)
    return AtomicData(**fields)


def crystal(n=3, energy=-2.0):
    src = torch.arange(n)
    return AtomicData(
        atomic_numbers=torch.full((n,), 29),
        positions=torch.randn(n, 3),
        cell=torch.eye(3) * 3.0,
        pbc=[True, True, True],
        energy=torch.tensor(energy),
        forces=torch.randn(n, 3),
        stress=torch.randn(3, 3),
        neighbor_list=torch.stack([src, (src + 1) % n], 1),
        neighbor_list_shifts=torch.ones(n, 3, dtype=torch.int64),
    )


def test_empty_list_rejected():
    with pytest.raises(ValueError, match="empty data list"):
        Batch.from_data_list([])


def test_counts_and_indices():
    batch = Batch.from_data_list([molecule(2), crystal(3), molecule(4)])
    assert batch.num_graphs == len(batch) == batch.batch_size == 3
    assert batch.num_nodes == 9 and batch.num_edges == 9
    assert batch.batch_idx.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert batch.ptr.tolist() == [0, 2, 5, 9]
    assert batch.num_nodes_per_graph.tolist() == [2, 3, 4]
    assert batch.num_edges_per_graph.tolist() == [2, 3, 4]
    assert batch.num_nodes_list == [2, 3, 4]
    assert batch.edge_batch_idx.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert batch.max_num_nodes == 4
    assert batch.batch_idx.dtype == torch.int64


def test_neighbor_list_is_offset_to_global_indices():
    a, b = molecule(2), crystal(3)
    batch = Batch.from_data_list([a, b])
    assert torch.equal(batch.neighbor_list[:2], a.neighbor_list)
    assert torch.equal(batch.neighbor_list[2:], b.neighbor_list + 2)


def test_system_fields_stack_one_row_per_system():
    batch = Batch.from_data_list([crystal(), crystal()])
    assert batch.energy.shape == (2, 1)
    assert batch.cell.shape == (2, 3, 3)
    assert batch.pbc.shape == (2, 3)
    assert batch.stress.shape == (2, 3, 3)


def test_crystals_and_molecules_collate_with_missing_labels_filled():
    batch = Batch.from_data_list([crystal(), molecule()])
    assert batch.pbc.tolist() == [[True] * 3, [False] * 3]
    assert torch.equal(batch.cell[1], torch.zeros(3, 3))
    assert torch.isnan(batch.stress[1]).all() and torch.isfinite(batch.stress[0]).all()


def test_missing_non_label_field_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"'neighbor_list'.*structures \[1\]"):
        Batch.from_data_list([molecule(), molecule(with_edges=False)])


def test_mixed_label_dtypes_is_an_error_naming_the_field():
    a = molecule()
    b = molecule()
    b.energy = torch.tensor([[1.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'energy' has dtype torch.float32 in structure 0"):
        Batch.from_data_list([a, b])


def test_float64_labels_stay_float64():
    a = molecule()
    a.energy = torch.tensor([[1.0]], dtype=torch.float64)
    b = molecule()
    b.energy = torch.tensor([[2.0]], dtype=torch.float64)
    batch = Batch.from_data_list([a, b])
    assert batch.energy.dtype == torch.float64 and batch.positions.dtype == torch.float32


def test_round_trip_to_data_list_drops_filled_labels():
    items = [crystal(3), molecule(2), crystal(4)]
    out = Batch.from_data_list(items).to_data_list()
    assert len(out) == 3
    for original, back in zip(items, out):
        assert original == back
    assert out[1].stress is None and out[1].cell is None


def test_get_data_negative_and_out_of_range():
    batch = Batch.from_data_list([molecule(2), crystal(3)])
    assert batch[-1].num_nodes == 3
    with pytest.raises(IndexError, match="out of range"):
        batch.get_data(2)


@pytest.mark.parametrize(
    "index",
    [[2, 0], torch.tensor([2, 0]), np.array([2, 0]), torch.tensor([True, False, True])],
)
def test_index_select_matches_collating_the_selection(index):
    items = [molecule(2), crystal(3), molecule(4)]
    batch = Batch.from_data_list(items)
    selected = batch[index]
    order = [2, 0] if not isinstance(index, torch.Tensor) or index.dtype != torch.bool else [0, 2]
    expected = Batch.from_data_list([items[i] for i in order])
    for key, value in expected:
        assert torch.equal(selected[key], value), key
    assert selected.batch_idx.tolist() == expected.batch_idx.tolist()


def test_index_select_slice_and_errors():
    batch = Batch.from_data_list([molecule(2), crystal(3), molecule(4)])
    assert batch[1:].num_graphs == 2
    with pytest.raises(IndexError, match="empty"):
        batch.index_select([])
    with pytest.raises(IndexError, match="float"):
        batch.index_select(torch.tensor([0.0]))
    with pytest.raises(IndexError, match="Unsupported"):
        batch.index_select(object())


def test_append_offsets_edges_and_leaves_other_untouched():
    first = Batch.from_data_list([molecule(2)])
    second = Batch.from_data_list([crystal(3)])
    before = second.neighbor_list.clone()
    first.append(second)
    assert first.num_graphs == 2 and first.num_nodes == 5
    assert torch.equal(first.neighbor_list[2:], before + 2)
    assert torch.equal(second.neighbor_list, before)
    assert torch.isnan(first.stress[0]).all()
    with pytest.raises(ValueError):
        first.append(first)


def test_assignment_routes_by_known_name_then_shape():
    batch = Batch.from_data_list([molecule(2), crystal(3)])
    batch.forces = torch.zeros(5, 3)
    assert batch.level_of("forces") == "atom"
    batch.charge = torch.zeros(2, 1)
    assert batch.level_of("charge") == "system"
    batch.node_embeddings = torch.zeros(5, 4)
    assert batch.level_of("node_embeddings") == "atom"
    batch.weight = torch.ones(2)
    assert batch.level_of("weight") == "system"
    with pytest.raises(ValueError, match="needs a leading dimension of 5"):
        batch.forces = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="Cannot tell the level"):
        batch.custom = torch.zeros(7)


def test_non_tensor_assignment_is_a_plain_attribute():
    batch = Batch.from_data_list([molecule()])
    batch.note = "hello"
    assert batch.note == "hello" and "note" not in batch


def test_add_key_per_system_values():
    batch = Batch.from_data_list([molecule(2), crystal(3)])
    batch.add_key("tag", [torch.ones(1, 2), torch.zeros(1, 2)], level="system")
    assert batch.tag.shape == (2, 2)
    batch.add_key("q", [torch.ones(2), torch.zeros(3)], level="node")
    assert batch.q.tolist() == [1, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="overwrite=True"):
        batch.add_key("q", torch.ones(5), level="node")
    assert batch[1].tag.shape == (1, 2)


def test_custom_keys_survive_selection_and_split():
    a, b = molecule(2), crystal(3)
    a.add_system_property("weight", torch.tensor(2.0))
    b.add_system_property("weight", torch.tensor(3.0))
    a.add_node_property("q", torch.ones(2))
    b.add_node_property("q", torch.zeros(3))
    batch = Batch.from_data_list([a, b])
    back = batch.index_select([1, 0]).to_data_list()
    assert back[0].weight.tolist() == [3.0] and back[1].q.tolist() == [1.0, 1.0]


def test_set_edges_replaces_the_edge_level():
    batch = Batch.from_data_list([molecule(2), crystal(3)])
    batch.set_edges(
        torch.tensor([[0, 1], [2, 3], [3, 4], [4, 2]]),
        torch.zeros(4, 3, dtype=torch.int64),
        torch.tensor([1, 3]),
    )
    assert batch.num_edges == 4
    assert batch.edge_batch_idx.tolist() == [0, 1, 1, 1]
    assert batch[1].neighbor_list.tolist() == [[0, 1], [1, 2], [2, 0]]


def test_to_shares_on_same_device_and_casts_dtype():
    batch = Batch.from_data_list([molecule(), crystal()])
    same = batch.to("cpu")
    assert same.positions is batch.positions and same is not batch
    double = batch.to(dtype=torch.float64)
    assert double.positions.dtype == torch.float64 and double.atomic_numbers.dtype == torch.int64
    assert batch.positions.dtype == torch.float32


def test_clone_is_deep():
    batch = Batch.from_data_list([molecule()])
    copy = batch.clone()
    copy.positions.add_(1)
    assert not torch.equal(copy.positions, batch.positions)


def test_pickle_round_trip_for_worker_processes():
    batch = Batch.from_data_list([molecule(2), crystal(3)])
    back = pickle.loads(pickle.dumps(batch))
    for key, value in batch:
        assert torch.equal(back[key], value) or torch.isnan(value).any()
    assert back.batch_idx.tolist() == batch.batch_idx.tolist()


def test_access_errors_and_repr():
    batch = Batch.from_data_list([molecule()])
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        _ = batch.nonexistent
    with pytest.raises(KeyError):
        _ = batch["nonexistent"]
    assert repr(batch) == "Batch(num_graphs=1, num_nodes=2, num_edges=2, device=cpu)"
    assert Batch().num_graphs == 0


def test_batch_cat_of_batches():
    a = Batch.from_data_list([molecule(2), crystal(3)])
    b = Batch.from_data_list([crystal(4)])
    merged = Batch.cat([a, b])
    direct = Batch.from_data_list([*a.to_data_list(), *b.to_data_list()])
    assert torch.equal(merged.neighbor_list, direct.neighbor_list)
    assert merged.num_nodes_list == [2, 3, 4]


def test_pin_memory_and_model_dump():
    batch = Batch.from_data_list([molecule()])
    assert batch.pin_memory() is batch
    dump = batch.model_dump()
    assert dump["num_graphs"] == 1 and "positions" in dump and "batch_idx" in dump


def test_neighbor_list_stamps_follow_the_edges():
    a, b = molecule(2), crystal(3)
    for item in (a, b):
        item.info["neighbor_list_cutoff"] = 5.0
        item.info["neighbor_list_half_list"] = False
    batch = Batch.from_data_list([a, b])
    assert batch.__dict__["_neighbor_list_cutoff"] == 5.0
    for derived in (batch.to(dtype=torch.float64), batch.clone(), batch[[1, 0]]):
        assert derived.__dict__["_neighbor_list_cutoff"] == 5.0
    c = crystal(3)
    c.info["neighbor_list_cutoff"] = 4.0
    assert "_neighbor_list_cutoff" not in Batch.from_data_list([a, c]).__dict__
    batch.set_edges(torch.tensor([[0, 1]]), None, torch.tensor([1, 0]))
    assert "_neighbor_list_cutoff" not in batch.__dict__


def test_equal_batches_compare_equal_with_nan_filled_labels():
    items = [molecule(2), crystal(3)]  # the molecule's stress is filled with NaN
    batch = Batch.from_data_list(items)
    assert batch.stress.isnan().any()
    assert batch == Batch.from_data_list(items)
    assert batch == pickle.loads(pickle.dumps(batch)) and batch == batch.clone()
    assert batch != Batch.from_data_list(items[::-1])  # other order, other counts
    moved = batch.clone()
    moved.positions.add_(1e-3)
    assert batch != moved
    assert batch != batch.to(dtype=torch.float64)
    extra = batch.clone()
    extra.add_key("weight", torch.ones(2), level="system")
    assert batch != extra and batch != "not a batch"
    with pytest.raises(TypeError, match="unhashable"):
        hash(batch)


def test_atomic_data_equality_treats_nan_as_equal():
    def item(x: float) -> AtomicData:  # unvalidated data (e.g. split from a batch) may hold NaN
        return AtomicData(
            atomic_numbers=torch.tensor([1]),
            positions=torch.zeros(1, 3),
            forces=torch.tensor([[float("nan"), x, 0.0]]),
            validate=False,
        )

    assert item(1.0) == item(1.0)
    assert item(1.0) != item(2.0)
