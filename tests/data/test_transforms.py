"""Compose: classification by type hints, order, errors."""

from __future__ import annotations

import pytest
import torch

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.transforms import Compose


def _data(n: int = 2) -> AtomicData:
    return AtomicData(atomic_numbers=torch.ones(n, dtype=torch.int64), positions=torch.zeros(n, 3))


def add_x(data: AtomicData, metadata: dict) -> tuple[AtomicData, dict]:
    data.positions = data.positions + torch.tensor([1.0, 0.0, 0.0])
    metadata.setdefault("order", []).append("x")
    return data, metadata


def double(data: AtomicData, metadata: dict) -> tuple[AtomicData, dict]:
    data.positions = data.positions * 2
    metadata.setdefault("order", []).append("double")
    return data, metadata


def scale_batch(batch: Batch) -> Batch:
    batch.positions = batch.positions * 3
    return batch


def test_empty_compose_is_identity_for_samples_and_batches():
    compose = Compose([])
    data, meta = _data(), {"a": 1}
    assert compose(data, meta) == (data, meta)
    batch = Batch.from_data_list([_data()])
    assert compose(batch) is batch
    assert not compose.is_batch


def test_sample_transforms_apply_left_to_right_and_thread_metadata():
    out, meta = Compose([add_x, double])(_data(), {})
    assert out.positions[:, 0].tolist() == [2.0, 2.0]  # (0 + 1) * 2, not 0 * 2 + 1
    assert meta["order"] == ["x", "double"]


def test_one_argument_sample_transform_is_called_with_data_only():
    def shift(data: AtomicData) -> AtomicData:
        data.positions = data.positions + 5
        return data

    out, meta = Compose([shift, add_x])(_data(), {"keep": True})
    assert out.positions[0].tolist() == [6.0, 5.0, 5.0]
    assert meta["keep"] is True


def test_transforms_are_stored_as_tuple_and_repr_lists_them():
    compose = Compose([add_x, double])
    assert compose.transforms == (add_x, double)
    assert repr(compose).startswith("Compose([<function add_x")


def test_non_callable_raises_type_error_naming_index():
    with pytest.raises(TypeError, match=r"transform\[1\]"):
        Compose([add_x, 3])


def test_exception_is_wrapped_with_index_and_cause():
    def boom(data: AtomicData, metadata: dict):
        raise KeyError("missing")

    with pytest.raises(RuntimeError, match=r"transform\[1\].*KeyError") as info:
        Compose([add_x, boom])(_data(), {})
    assert isinstance(info.value.__cause__, KeyError)


def test_returning_none_is_an_error():
    def forgot(data: AtomicData, metadata: dict):
        data.positions = data.positions + 1

    with pytest.raises(RuntimeError, match="returned None"):
        Compose([forgot])(_data(), {})


def test_batch_composition_is_detected_and_applied():
    compose = Compose([scale_batch, lambda b: b])
    assert compose.is_batch
    batch = Batch.from_data_list([_data(), _data(1)])
    batch.positions = torch.ones(3, 3)
    assert compose(batch).positions.sum().item() == 27.0


def test_batch_composition_rejects_a_structure():
    with pytest.raises(TypeError, match="batch composition"):
        Compose([scale_batch])(_data(), {})


def test_mixing_sample_and_batch_transforms_is_rejected():
    with pytest.raises(TypeError, match="cannot mix"):
        Compose([add_x, scale_batch])


def test_unsupported_annotation_is_rejected():
    def wrong(data: int) -> int:
        return data

    with pytest.raises(TypeError, match=r"transform\[0\]"):
        Compose([wrong])


def test_untyped_callables_adopt_the_typed_kind():
    assert Compose([lambda b: b, scale_batch]).is_batch
    assert not Compose([lambda d, m: (d, m), add_x]).is_batch


def test_callable_objects_are_classified_by_their_call_method():
    class BatchScaler:
        def __call__(self, batch: Batch) -> Batch:
            return batch

    class Sampler:
        def __call__(self, data: AtomicData, metadata: dict) -> tuple[AtomicData, dict]:
            metadata["seen"] = True
            return data, metadata

    assert Compose([BatchScaler()]).is_batch
    compose = Compose([Sampler()])
    assert not compose.is_batch
    assert compose(_data(), {})[1] == {"seen": True}


def test_any_annotation_counts_as_untyped():
    from typing import Any

    def passthrough(data: Any, metadata: Any = None) -> Any:
        return data, metadata

    assert Compose([passthrough, scale_batch]).is_batch
    assert not Compose([passthrough, add_x]).is_batch
