"""The default layout: arrays in shard files, small compressed chunks, read directly.

A random read decodes one small chunk per field wherever the sample lies, so reads
cost the same in a store of ten thousand or a million structures; damage to a shard
(truncated, lost) names the store, the array and the samples, as for chunk files.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from nvalchemi.data import AtomicData
from nvalchemi.data.io.zarr import AtomicDataZarrReader, AtomicDataZarrWriter, StoreDamagedError


def structures(count: int, seed: int = 0) -> list[AtomicData]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        atoms = 4 + k % 5
        out.append(
            AtomicData(
                atomic_numbers=torch.randint(1, 90, (atoms,), generator=g),
                positions=5 * torch.rand(atoms, 3, generator=g),
                cell=(5.0 + k % 3) * torch.eye(3).unsqueeze(0),
                pbc=torch.ones(1, 3, dtype=torch.bool),
                energy=torch.randn(1, 1, generator=g, dtype=torch.float64),
                forces=torch.randn(atoms, 3, generator=g),
            )
        )
    return out


def _same(fields, data):
    for key, value in data.items():
        assert torch.equal(fields[key], value), key


@pytest.fixture
def store(tmp_path):
    """600 structures in shards of 64 rows (many shards), written in three parts."""
    data = structures(600)
    config = {"core": {"shard_size": 64}, "meta": {"shard_size": 64}}
    path = tmp_path / "s.zarr"
    writer = AtomicDataZarrWriter(str(path), config)
    writer.write(data[:250])
    writer.append(data[250:400])
    writer.append(data[400:])
    return path, data


def test_the_default_layout_is_sharded_compressed_and_small(tmp_path):
    data = structures(300)
    path = tmp_path / "d.zarr"
    AtomicDataZarrWriter(str(path)).write(data)
    root = zarr.open_group(str(path), mode="r")
    positions = root["core/positions"]
    assert positions.shards is not None and positions.chunks[0] < positions.shards[0]
    assert positions.compressors[0].cname.value == "lz4hc"
    files = [p for p in (path / "core" / "positions").rglob("*") if p.is_file()]
    assert len(files) == 2  # zarr.json and one shard
    reader = AtomicDataZarrReader(str(path), cache_bytes=0)
    assert {rows.mode for rows in reader._arrays.values()} <= {"decode", "raw"}
    assert all(rows.per_shard for rows in reader._arrays.values())
    for k in np.random.default_rng(0).permutation(300)[:60].tolist():
        _same(reader.read(k)[0], data[k])


def test_reads_across_many_shards_match_what_was_written(store):
    path, data = store
    reader = AtomicDataZarrReader(str(path), cache_bytes=0)
    assert reader._arrays["positions"].per_shard >= 1
    assert len(list((path / "core" / "positions" / "c").iterdir())) > 10  # many shards
    order = np.random.default_rng(1).permutation(len(data)).tolist()
    for (fields, _), k in zip(reader.read_many(order[:200]), order[:200]):
        _same(fields, data[k])
    for k in order[200:260]:
        _same(reader.read(k)[0], data[k])
    everything = reader.read_many(range(len(data)))  # runs spanning shard boundaries
    for (fields, _), want in zip(everything, data):
        _same(fields, want)
    assert reader.verify()["problems"] == []


def test_compressed_arrays_are_kept_whole_smallest_first_within_the_budget(store):
    path, data = store
    sizes = {
        key: rows.decoded_bytes
        for key, rows in AtomicDataZarrReader(str(path))._arrays.items()
        if rows.mode == "decode"
    }
    assert len(sizes) >= 3, sizes
    largest = max(sizes, key=sizes.get)
    budget = sum(sizes.values()) - sizes[largest]  # everything but the largest fits
    reader = AtomicDataZarrReader(str(path), cache_bytes=budget)
    order = np.random.default_rng(2).permutation(len(data)).tolist()
    for k in order[:100]:
        _same(reader.read(k)[0], data[k])
    chunked = [key for key in sizes if reader._arrays[key]._whole is None]
    assert len(chunked) == 1 and sizes[chunked[0]] == sizes[largest], chunked  # one left out
    assert reader._arrays[chunked[0]]._last is not None  # a chunk per read, the last kept
    for key in set(sizes) - set(chunked):
        assert reader._arrays[key]._whole.nbytes == sizes[key], key
    nothing = AtomicDataZarrReader(str(path), cache_bytes=0)
    for k in order[:20]:
        _same(nothing.read(k)[0], data[k])
    assert all(rows._whole is None for rows in nothing._arrays.values())


def test_a_truncated_or_lost_shard_names_the_array_and_the_samples(store):
    path, data = store
    shard = path / "core" / "forces" / "c" / "3" / "0"  # rows 192-255
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2])  # a copy cut short
    reader = AtomicDataZarrReader(str(path))
    _same(reader.read(0)[0], data[0])  # the other shards still read
    with pytest.raises(StoreDamagedError, match=r"shard file core/forces/c/3/0 has a damaged "
                       r"index .*array core/forces, rows 192-"):  # fmt: skip
        reader.read_many(range(len(data)))
    problems = reader.verify()["problems"]
    assert len(problems) == 1 and "core/forces/c/3/0" in problems[0], problems
    shard.unlink()  # lost altogether
    reader = AtomicDataZarrReader(str(path))
    with pytest.raises(StoreDamagedError, match=r"shard file core/forces/c/3/0 is missing"):
        reader.read_many(range(len(data)))
