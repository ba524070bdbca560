"""The Reader base class: the load hooks, metadata, iteration errors, lifecycle."""

from __future__ import annotations

import pytest
import torch

from nvalchemi.data.datapipes.reader import Reader, ReaderProtocol


class SampleReader(Reader):
    """Implements only _load_sample."""

    def __init__(self, n=3, fail_at=None, **kwargs):
        super().__init__(**kwargs)
        self.n, self.fail_at = n, fail_at

    def __len__(self):
        return self.n

    def _load_sample(self, index):
        if index == self.fail_at:
            raise ValueError(f"bad sample {index}")
        return {
            "atomic_numbers": torch.tensor([1, 8]),
            "positions": torch.full((2, 3), float(index)),
        }


class ManyReader(Reader):
    """Implements only _load_many_samples and records its calls."""

    def __init__(self, n=4, broken=False):
        super().__init__()
        self.n, self.calls, self.broken = n, [], broken

    def __len__(self):
        return self.n

    def _load_many_samples(self, indices):
        self.calls.append(list(indices))
        out = [{"x": torch.tensor([i])} for i in indices]
        return out + out if self.broken else out

    def _get_sample_metadata(self, index):
        return {"source_file": "many.bin"}


def test_read_returns_fields_and_metadata_with_the_index():
    fields, meta = SampleReader().read(2)
    assert fields["positions"][0, 0].item() == 2.0
    assert meta == {"index": 2}
    assert SampleReader()[1][1] == {"index": 1}
    _, meta = SampleReader(include_index_in_metadata=False).read(1)
    assert meta == {}


def test_read_routes_through_load_many_samples_once():
    reader = ManyReader()
    assert reader.read(3)[0]["x"].item() == 3
    pairs = reader.read_many([2, 0, 2])
    assert [p[0]["x"].item() for p in pairs] == [2, 0, 2]
    assert [p[1] for p in pairs] == [{"source_file": "many.bin", "index": i} for i in (2, 0, 2)]
    assert reader.calls == [[3], [2, 0, 2]]
    assert reader.read_many([]) == []


def test_count_mismatch_from_the_hook_is_an_error():
    with pytest.raises(RuntimeError, match="returned 2"):
        ManyReader(broken=True).read(0)
    with pytest.raises(RuntimeError, match="returned 4 samples for 2"):
        ManyReader(broken=True).read_many([0, 1])


def test_a_reader_without_either_hook_raises_not_implemented():
    class Empty(Reader):
        def __len__(self):
            return 1

    with pytest.raises(NotImplementedError, match="_load_sample or _load_many_samples"):
        Empty().read(0)
    with pytest.raises(NotImplementedError):
        Empty().read_many([0])
    with pytest.raises(NotImplementedError, match="__len__"):
        len(Reader())


def test_iteration_yields_every_sample_and_wraps_errors_with_the_index():
    assert [m["index"] for _, m in SampleReader(n=3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="Sample 1 failed with exception: bad sample 1") as info:
        list(SampleReader(n=3, fail_at=1))
    assert isinstance(info.value.__cause__, ValueError)


def test_field_names_levels_and_read_data():
    assert SampleReader().field_names == ["atomic_numbers", "positions"]
    assert SampleReader(n=0).field_names == []
    assert SampleReader().field_levels == {}
    data = SampleReader().read_data(2)
    assert data.num_nodes == 2 and float(data.positions[0, 0]) == 2.0


def test_pin_memory_pins_when_cuda_exists():
    fields, _ = SampleReader(pin_memory=True).read(0)
    assert fields["positions"].is_pinned() == torch.cuda.is_available()


def test_context_manager_closes_and_repr():
    closed = []

    class Closing(SampleReader):
        def close(self):
            closed.append(True)

    with Closing() as reader:
        assert repr(reader) == "Closing(len=3, pin_memory=False)"
    assert closed == [True]
    assert Reader(coordinated_subsampling={"k": 2}).coordinated_subsampling == {"k": 2}


def test_readers_satisfy_the_protocol():
    assert isinstance(SampleReader(), ReaderProtocol)
    assert not isinstance(object(), ReaderProtocol)
