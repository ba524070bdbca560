"""The zarr store: layout, round trips, correct appends, delete/defragment, custom arrays."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import zarr
from ase.build import bulk, molecule

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.io.zarr import (
    AtomicDataZarrReader,
    AtomicDataZarrWriter,
    ZarrArrayConfig,
    ZarrWriteConfig,
)
from nvalchemi.data.neighbors import NeighborListTransform, compute_neighbors

CUTOFF = 3.0


def crystal(seed: int, lists: bool = True) -> AtomicData:
    rng = np.random.default_rng(seed)
    atoms = bulk("Cu", "fcc", a=3.6) * (1, 1, 1 + seed % 3)
    atoms.rattle(0.05, seed=seed)
    n = len(atoms)
    data = AtomicData.from_atoms(atoms)
    data.energy = torch.tensor([[-float(seed)]], dtype=torch.float64)
    data.forces = torch.as_tensor(rng.normal(size=(n, 3)), dtype=torch.float32)
    data.stress = torch.as_tensor(rng.normal(size=(1, 3, 3)), dtype=torch.float32)
    data.charges = torch.as_tensor(rng.normal(size=n), dtype=torch.float32)
    data.dipole = torch.as_tensor(rng.normal(size=(1, 3)), dtype=torch.float32)
    data.virial = torch.as_tensor(rng.normal(size=(1, 3, 3)), dtype=torch.float32)
    return NeighborListTransform(CUTOFF)(data, {})[0] if lists else data


def water(seed: int = 0, lists: bool = True) -> AtomicData:
    atoms = molecule("H2O")
    atoms.rattle(0.01, seed=seed)
    data = AtomicData.from_atoms(atoms)
    data.energy = torch.tensor([[1.0 + seed]], dtype=torch.float64)
    data.forces = torch.zeros(3, 3)
    data.charges = torch.tensor([-0.8, 0.4, 0.4])
    data.dipole = torch.zeros(1, 3)
    return NeighborListTransform(CUTOFF)(data, {})[0] if lists else data


def samples(n=6, lists=True):
    return [water(k, lists) if k % 3 == 2 else crystal(k, lists) for k in range(n)]


def assert_same(got: dict, want: AtomicData, where=""):
    """Exactly the fields of ``want`` come back, bit for bit and with their dtypes."""
    assert set(got) == set(want.keys()), where
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{where} {key}"
        assert got[key].dtype == value.dtype


@pytest.fixture
def path(tmp_path):
    return tmp_path / "store.zarr"


# ------------------------------------------------------------------------ layout
def test_layout_matches_the_spec(path):
    data = samples(4)
    AtomicDataZarrWriter(path).write(data)
    root = zarr.open_group(str(path), mode="r")
    assert set(root.group_keys()) == {"meta", "core", "custom"}
    meta = root["meta"]
    atoms = [d.num_nodes for d in data]
    edges = [d.num_edges for d in data]
    assert meta["atoms_ptr"][:].tolist() == [0, *np.cumsum(atoms).tolist()]
    assert meta["edges_ptr"][:].tolist() == [0, *np.cumsum(edges).tolist()]
    assert meta["samples_mask"][:].all() and meta["samples_mask"].shape == (4,)
    assert meta["atoms_mask"].shape == (sum(atoms),) and meta["edges_mask"].shape == (sum(edges),)
    assert root.attrs["num_samples"] == 4
    core = root.attrs["fields"]["core"]
    assert core["positions"] == core["forces"] == core["atomic_numbers"] == "atom"
    assert core["energy"] == core["cell"] == core["pbc"] == core["stress"] == "system"
    assert core["neighbor_list"] == core["neighbor_list_shifts"] == "edge"
    assert root.attrs["fields"]["custom"] == {}
    assert root.attrs["neighbor_list"] == {"cutoff": CUTOFF, "half_list": False}
    assert root["core/neighbor_list"].shape == (sum(edges), 2)
    assert root["core/energy"].shape == (4, 1) and root["core/energy"].dtype == np.float64
    assert root["core/cell"].shape == (4, 3, 3) and root["core/pbc"].shape == (4, 3)
    # neighbour lists are store-global
    stored = root["core/neighbor_list"][:]
    batch = Batch.from_data_list(data)
    assert np.array_equal(stored, batch.neighbor_list.numpy())


def test_store_without_lists_has_zero_edge_pointers(path):
    AtomicDataZarrWriter(path).write(samples(2, lists=False))
    root = zarr.open_group(str(path), mode="r")
    assert root["meta/edges_ptr"][:].tolist() == [0, 0, 0]
    assert root.attrs["neighbor_list"] is None


# --------------------------------------------------------------------- round trip
def test_every_field_round_trips(path):
    data = samples(6)
    AtomicDataZarrWriter(path).write(data)
    reader = AtomicDataZarrReader(path)
    assert len(reader) == 6
    for k, want in enumerate(data):
        fields, meta = reader.read(k)
        assert_same(fields, want, f"sample {k}")
        assert meta["index"] == k and meta["physical_index"] == str(k)
        assert meta["neighbor_list_cutoff"] == CUTOFF
    assert reader.get_metadata(2) == (3, data[2].num_edges)
    assert set(reader.field_levels) == set(reader.field_names)


def test_read_many_equals_read_with_duplicates_negatives_and_any_order(path):
    AtomicDataZarrWriter(path).write(samples(7))
    reader = AtomicDataZarrReader(path)
    order = [5, 0, 5, -1, 3, 2, 6, 1]
    many = reader.read_many(order)
    for index, (fields, meta) in zip(order, many):
        single, _ = reader.read(index)
        assert meta["index"] == index
        assert single.keys() == fields.keys()
        for key in single:
            assert torch.equal(single[key], fields[key])
    many[0][0]["positions"].add_(1.0)  # duplicates do not alias each other
    assert not torch.equal(many[0][0]["positions"], many[2][0]["positions"])
    assert reader.read_many([]) == []


def test_samples_build_atomic_data_and_batches(path):
    data = samples(5)
    AtomicDataZarrWriter(path).write(data)
    reader = AtomicDataZarrReader(path)
    rebuilt = [reader.read_data(i) for i in range(5)]
    batch = Batch.from_data_list(rebuilt)
    expected = Batch.from_data_list(data)
    assert torch.equal(batch.neighbor_list, expected.neighbor_list)
    assert torch.equal(batch.positions, expected.positions)


def test_batch_input_and_dict_store():
    store: dict = {}
    batch = Batch.from_data_list(samples(3, lists=False))
    compute_neighbors(batch, CUTOFF)
    AtomicDataZarrWriter(store).write(batch)
    with pytest.raises(FileExistsError):
        AtomicDataZarrWriter(store).write(batch)
    reader = AtomicDataZarrReader(store)
    assert len(reader) == 3
    assert reader.read(0)[1]["neighbor_list_cutoff"] == CUTOFF
    assert torch.equal(reader.read(1)[0]["neighbor_list"], batch[1].neighbor_list)


def test_dataset_over_the_store_reuses_stored_lists(path, monkeypatch):
    import nvalchemi.data.neighbors as nb
    from nvalchemi.data.datapipes.dataset import Dataset

    data = samples(5)
    AtomicDataZarrWriter(path).write(data)
    reader = AtomicDataZarrReader(path)
    assert reader.validates is True
    calls = []
    monkeypatch.setattr(nb, "_run_vesin", lambda *a: calls.append(a))
    dataset = Dataset(reader, transforms=[NeighborListTransform(CUTOFF)])
    for k in (4, 2, 0):
        sample = dataset[k]
        assert sample.info["neighbor_list_cutoff"] == CUTOFF
        assert_same(dict(sample.items()), data[k])
    assert calls == []  # the stamp in the store's metadata says the lists fit


# ------------------------------------------------------------------------- append
def test_append_offsets_neighbour_lists_by_the_stored_atoms(path):
    data = samples(6)
    writer = AtomicDataZarrWriter(path)
    writer.write(data[:3])
    writer.append(data[3:5])
    writer.append(data[5])
    reader = AtomicDataZarrReader(path)
    assert len(reader) == 6
    for k, want in enumerate(data):
        assert_same(reader.read(k)[0], want, f"sample {k}")
    stored = zarr.open_group(str(path), mode="r")["core/neighbor_list"][:]
    assert np.array_equal(stored, Batch.from_data_list(data).neighbor_list.numpy())


def test_append_fills_missing_labels_like_a_batch_would(path):
    writer = AtomicDataZarrWriter(path)
    writer.write([crystal(0)])
    writer.append([water(1)])  # no stress, virial, cell, pbc
    root = zarr.open_group(str(path), mode="r")
    assert np.isnan(root["core/stress"][1]).all() and not root["core/pbc"][1].any()
    fields, _ = AtomicDataZarrReader(path).read(1)
    assert_same(fields, water(1))  # NaN labels and zero cell/pbc read back as absent


def _snapshot(path):
    root = zarr.open_group(str(path), mode="r")
    arrays = {
        f"{g}/{k}": root[g][k][...].copy()
        for g in ("meta", "core", "custom")
        for k in root[g].array_keys()
    }
    return dict(root.attrs), arrays


def assert_unchanged(path, before):
    attrs, arrays = _snapshot(path)
    assert attrs == before[0]
    assert arrays.keys() == before[1].keys()
    for key, value in arrays.items():
        assert np.array_equal(value, before[1][key], equal_nan=value.dtype.kind == "f"), key


def test_append_with_a_new_field_is_rejected_and_writes_nothing(path):
    writer = AtomicDataZarrWriter(path)
    writer.write(samples(2))
    before = _snapshot(path)
    extra = [crystal(4), crystal(5)]
    for data in extra:
        data.add_node_property("spin_label", torch.ones(data.num_nodes))
    with pytest.raises(ValueError, match=r"fields \['spin_label'\] that the store does not have"):
        writer.append(extra)
    assert_unchanged(path, before)


def test_append_missing_a_non_label_field_is_rejected(path):
    writer = AtomicDataZarrWriter(path)
    writer.write(samples(2))
    before = _snapshot(path)
    with pytest.raises(ValueError, match="'neighbor_list' is missing"):
        writer.append([crystal(3, lists=False)])
    assert_unchanged(path, before)


def test_append_with_other_dtype_or_cutoff_is_rejected(path):
    writer = AtomicDataZarrWriter(path)
    writer.write(samples(2))
    before = _snapshot(path)
    with pytest.raises(ValueError, match="'positions' has dtype float64, stored as float32"):
        writer.append([crystal(3).to(dtype=torch.float64)])
    other = NeighborListTransform(2.5)(crystal(3, lists=False), {})[0]
    with pytest.raises(ValueError, match="built with"):
        writer.append([other])
    assert_unchanged(path, before)


def test_append_and_write_preconditions(path, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AtomicDataZarrWriter(tmp_path / "missing.zarr").append(samples(1))
    writer = AtomicDataZarrWriter(path)
    with pytest.raises(ValueError, match="No data provided"):
        writer.write([])
    writer.write(samples(1))
    with pytest.raises(FileExistsError, match="already exists"):
        writer.write(samples(1))
    writer.append([])  # no-op
    assert AtomicDataZarrReader(path).__len__() == 1
    empty_dir = tmp_path / "made_by_mkdtemp"
    empty_dir.mkdir()
    AtomicDataZarrWriter(empty_dir).write(samples(1))
    assert len(AtomicDataZarrReader(empty_dir)) == 1


def test_an_interrupted_append_leaves_the_store_readable_and_appendable(path, monkeypatch):
    import nvalchemi.data.io.zarr as zarr_io

    data = samples(5)
    writer = AtomicDataZarrWriter(path)
    writer.write(data[:2])
    real_extend = zarr_io._extend

    def crash_on_pointers(array, old_rows, values):
        if array.basename == "atoms_ptr":
            raise OSError("disk full")
        real_extend(array, old_rows, values)

    monkeypatch.setattr(zarr_io, "_extend", crash_on_pointers)
    with pytest.raises(OSError, match="disk full"):
        writer.append(data[2:4])  # core arrays already grew
    monkeypatch.setattr(zarr_io, "_extend", real_extend)
    reader = AtomicDataZarrReader(path)
    assert len(reader) == 2
    assert_same(reader.read(1)[0], data[1])
    writer.append(data[4:])
    reader.refresh()
    assert len(reader) == 3
    assert_same(reader.read(2)[0], data[4])


def test_lists_of_unknown_settings_clear_the_store_stamp(path):
    writer = AtomicDataZarrWriter(path)
    writer.write([crystal(0)])
    unstamped = crystal(1)
    unstamped.info.clear()
    writer.append([unstamped])
    reader = AtomicDataZarrReader(path)
    assert "neighbor_list_cutoff" not in reader.read(0)[1]


# ------------------------------------------------------------------------- custom
def test_custom_arrays_at_every_level(path):
    data = samples(3)
    writer = AtomicDataZarrWriter(path)
    writer.write(data)
    atoms = sum(d.num_nodes for d in data)
    edges = sum(d.num_edges for d in data)
    writer.add_custom("weight", torch.tensor([1.0, 2.0, 3.0]), "system")
    writer.add_custom("tag", np.arange(atoms, dtype=np.int32), "atom")
    writer.add_custom("bond", np.ones((edges, 2), dtype=np.float32), "edge")
    reader = AtomicDataZarrReader(path)
    assert reader.field_levels["weight"] == "system" and reader.field_levels["bond"] == "edge"
    fields, _ = reader.read(1)
    assert fields["weight"].tolist() == [2.0]
    start = data[0].num_nodes
    assert fields["tag"].tolist() == list(range(start, start + data[1].num_nodes))
    assert fields["bond"].shape == (data[1].num_edges, 2)
    with pytest.raises(ValueError, match="needs 3 rows"):
        writer.add_custom("bad", np.ones(2), "system")
    with pytest.raises(ValueError, match="level must be one of"):
        writer.add_custom("bad", np.ones(3), "graph")
    with pytest.raises(ValueError, match="overwrite=True"):
        writer.add_custom("weight", np.ones(3), "system")
    writer.add_custom("weight", np.ones(3, dtype=np.float32), "system", overwrite=True)
    # Appending needs the custom arrays as fields of the samples.
    with pytest.raises(ValueError, match="'weight' is missing"):
        writer.append([crystal(7)])
    new = crystal(7)
    new.add_system_property("weight", torch.tensor([5.0]))
    new.add_node_property("tag", torch.zeros(new.num_nodes, dtype=torch.int32))
    new.add_edge_property("bond", torch.zeros(new.num_edges, 2))
    writer.append([new])
    reader.refresh()
    assert reader.read(3)[0]["weight"].tolist() == [5.0]


# ----------------------------------------------------------- delete / defragment
def test_soft_delete_hides_samples_and_zeroes_them(path):
    data = samples(6)
    writer = AtomicDataZarrWriter(path)
    writer.write(data)
    reader = AtomicDataZarrReader(path)
    writer.delete([1, -2])  # physical indices 1 and 4
    assert len(reader) == 6  # until refreshed
    reader.refresh()
    assert len(reader) == 4
    kept = [0, 2, 3, 5]
    for logical, physical in enumerate(kept):
        fields, meta = reader.read(logical)
        assert meta["physical_index"] == str(physical)
        assert_same(fields, data[physical])
    root = zarr.open_group(str(path), mode="r")
    assert root["meta/samples_mask"][:].tolist() == [True, False, True, True, False, True]
    a0, a1 = root["meta/atoms_ptr"][1], root["meta/atoms_ptr"][2]
    assert not root["meta/atoms_mask"][a0:a1].any()
    assert not root["core/positions"][a0:a1].any()
    with pytest.raises(IndexError, match="out of range"):
        writer.delete([6])


def test_defragment_renumbers_neighbour_lists(path):
    data = samples(6)
    writer = AtomicDataZarrWriter(path)
    writer.write(data)
    writer.delete(torch.tensor([0, 3]))
    writer.defragment()
    reader = AtomicDataZarrReader(path)
    kept = [1, 2, 4, 5]
    assert len(reader) == 4
    for logical, physical in enumerate(kept):
        fields, meta = reader.read(logical)
        assert meta["physical_index"] == str(logical)
        assert_same(fields, data[physical])
    root = zarr.open_group(str(path), mode="r")
    stored = root["core/neighbor_list"][:]
    assert np.array_equal(
        stored, Batch.from_data_list([data[k] for k in kept]).neighbor_list.numpy()
    )
    assert root.attrs["num_samples"] == 4 and root["meta/samples_mask"][:].all()


def test_defragment_of_an_all_deleted_store_then_append(path):
    writer = AtomicDataZarrWriter(path)
    writer.write(samples(2))
    writer.delete([0, 1])
    writer.defragment()
    reader = AtomicDataZarrReader(path)
    assert len(reader) == 0 and reader.field_names == []
    writer.append(samples(3))
    reader.refresh()
    assert len(reader) == 3
    assert_same(reader.read(2)[0], samples(3)[2])


def test_defragment_in_memory_with_a_new_config():
    store: dict = {}
    writer = AtomicDataZarrWriter(store)
    writer.write(samples(4))
    writer.delete([2])
    writer.defragment({"core": {"compressors": [zarr.codecs.ZstdCodec(level=1)]}})
    root = zarr.open_group(zarr.storage.MemoryStore(store), mode="r")
    assert any("Zstd" in type(c).__name__ for c in root["core/positions"].compressors)
    reader = AtomicDataZarrReader(store)
    assert len(reader) == 3
    assert_same(reader.read(2)[0], samples(4)[3])


# ------------------------------------------------------------ reader lifecycle
def test_refresh_sees_appends_and_closed_reader_errors(path):
    writer = AtomicDataZarrWriter(path)
    writer.write(samples(2))
    reader = AtomicDataZarrReader(path)
    writer.append(samples(3)[2:])
    reader.refresh()
    assert len(reader) == 3
    reader.close()
    with pytest.raises(RuntimeError, match="closed"):
        reader.read(0)
    with pytest.raises(RuntimeError, match="closed"):
        reader.refresh()


def test_reader_errors(path, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AtomicDataZarrReader(tmp_path / "nothing.zarr")
    root = zarr.open_group(str(tmp_path / "odd.zarr"), mode="w")
    root.require_group("core")
    with pytest.raises(ValueError, match="missing 'meta' group"):
        AtomicDataZarrReader(tmp_path / "odd.zarr")
    AtomicDataZarrWriter(path).write(samples(3))
    reader = AtomicDataZarrReader(path)
    with pytest.raises(IndexError, match=r"Index 3 is out of range .* 3 active samples"):
        reader.read(3)
    with pytest.raises(IndexError, match="-4"):
        reader.read_many([0, -4])


def test_reader_pickles_for_worker_processes(path):
    AtomicDataZarrWriter(path).write(samples(3))
    reader = AtomicDataZarrReader(path)
    reader.read(0)
    clone = pickle.loads(pickle.dumps(reader))
    assert_same(clone.read(2)[0], samples(3)[2])


# ------------------------------------------------------------------------ configs
def test_compressed_sharded_and_chunked_stores_read_the_same(tmp_path):
    data = samples(9)
    config = {
        "core": {"compressors": [zarr.codecs.ZstdCodec(level=1)], "chunk_size": 4},
        "meta": {"chunk_size": 8, "shard_size": 16},
        "field_overrides": {"neighbor_list": {"chunk_size": 16, "shard_size": 64}},
    }
    AtomicDataZarrWriter(tmp_path / "c.zarr", config).write(data[:5])
    AtomicDataZarrWriter(tmp_path / "c.zarr", config).append(data[5:])
    AtomicDataZarrWriter(tmp_path / "raw.zarr", ZarrWriteConfig()).write(data)
    packed = AtomicDataZarrReader(tmp_path / "c.zarr")
    raw = AtomicDataZarrReader(tmp_path / "raw.zarr")
    assert {rows.mode for rows in packed._arrays.values()} == {"decode"}  # shards too: direct
    assert packed._arrays["neighbor_list"].per_shard == 4
    assert {rows.mode for rows in raw._arrays.values()} <= {"raw", "decode"}  # direct reads
    root = zarr.open_group(str(tmp_path / "c.zarr"), mode="r")
    assert root["core/positions"].chunks[0] == 4
    assert root["core/neighbor_list"].shards[0] == 64
    order = [8, 0, 3, 4, 5, 1, 7]
    for (a, _), (b, _), k in zip(packed.read_many(order), raw.read_many(order), order):
        assert_same(a, data[k])
        assert_same(b, data[k])


def test_chunk_boundaries_in_direct_reads(tmp_path):
    data = samples(8)
    config = ZarrWriteConfig(core=ZarrArrayConfig(chunk_size=5), meta=ZarrArrayConfig(chunk_size=3))
    AtomicDataZarrWriter(tmp_path / "s.zarr", config).write(data)
    reader = AtomicDataZarrReader(tmp_path / "s.zarr")
    assert all(rows.mode != "zarr" for rows in reader._arrays.values())
    for (fields, _), k in zip(reader.read_many(list(range(8))), range(8)):
        assert_same(fields, data[k])


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of"):
        ZarrArrayConfig(chunk_size=3, shard_size=4)
    with pytest.raises(ValueError):
        ZarrArrayConfig(chunk_size=0)
    with pytest.raises(TypeError, match="ZarrWriteConfig"):
        AtomicDataZarrWriter({}, config=3)
    config = ZarrWriteConfig.model_validate(
        {"core": {"chunk_size": 10}, "field_overrides": {"energy": {"chunk_size": 2}}}
    )
    assert config.for_array("core", "energy").chunk_size == 2
    assert config.for_array("core", "forces").chunk_size == 10
    with pytest.raises(ValueError, match="write_empty_chunks"):  # every chunk is written
        ZarrArrayConfig(write_empty_chunks=False)


# ------------------------------------------------------------- damage and compactness
def _chunk_files(path, array):
    return sorted(p for p in (path / array / "c").rglob("*") if p.is_file())


def test_a_missing_chunk_names_the_store_the_array_and_the_samples(tmp_path):
    path = tmp_path / "s.zarr"
    data = [crystal(k, lists=False) for k in range(40)]
    AtomicDataZarrWriter(path, {"core": {"chunk_size": 16}}).write(data)
    (path / "core" / "energy" / "c" / "1" / "0").unlink()  # rows 16..31: an interrupted copy
    reader = AtomicDataZarrReader(path)  # opening reads only the index arrays
    assert_same(reader.read(3)[0], data[3])
    with pytest.raises(
        ValueError,
        match=r"damaged: chunk file core/energy/c/1/0 is missing .*"
        r"array core/energy, rows 16-31: samples 16-31\)",
    ) as info:
        reader.read(20)
    assert str(path) in str(info.value) and "data check" in str(info.value)
    atom_rows = reader._atoms_ptr
    (path / "core" / "forces" / "c" / "0" / "0").unlink()
    reader = AtomicDataZarrReader(path)
    last = int(np.searchsorted(atom_rows, 16, side="left"))
    with pytest.raises(ValueError, match=rf"core/forces, rows 0-15: samples 0-{last - 1}\)"):
        reader.read_many([0, 1])


def test_chunks_of_zeros_are_written_so_absence_always_means_damage(path):
    molecules = [water(k, lists=False) for k in range(3)]  # zero forces and dipoles
    AtomicDataZarrWriter(path).write(molecules)
    for name in ("forces", "dipole"):
        assert _chunk_files(path, f"core/{name}"), name
    assert _chunk_files(path, "meta/edges_ptr")  # all zeros: no neighbour lists
    AtomicDataZarrWriter(path).append([water(9, lists=False)])
    AtomicDataZarrWriter(path).delete([0])  # zeroes the rows of sample 0
    report = AtomicDataZarrReader(path).verify()
    assert report["problems"] == [] and report["chunks"] > 0
    assert report["absent_may_be_zeros"] is False


def test_absurd_sample_counts_in_the_metadata_are_a_clear_error(path):
    AtomicDataZarrWriter(path).write(samples(3))
    root = zarr.open_group(str(path), mode="r+")
    root.attrs["num_samples"] = 10**12
    with pytest.raises(
        ValueError,
        match=r"claims 1,000,000,000,000 samples but meta/atoms_ptr "
        r"has 4 rows",
    ):
        AtomicDataZarrReader(path)
    root.attrs["num_samples"] = -1
    with pytest.raises(ValueError, match=r"num_samples attribute .* is -1"):
        AtomicDataZarrReader(path)
    root.attrs["num_samples"] = 3
    root["core/energy"].resize((2, 1))
    with pytest.raises(
        ValueError,
        match=r"array core/energy has 2 rows but the store's 3 samples "
        r"need 3",
    ):
        AtomicDataZarrReader(path)


def test_an_array_listed_in_the_metadata_but_absent_is_damage(path):
    import shutil

    AtomicDataZarrWriter(path).write(samples(3))
    shutil.rmtree(path / "core" / "stress")
    with pytest.raises(ValueError, match=r"lists core arrays \['stress'\] that are not in the"):
        AtomicDataZarrReader(path)


def test_verify_reports_missing_truncated_and_undecodable_chunks(tmp_path):
    path = tmp_path / "s.zarr"
    data = [crystal(k, lists=False) for k in range(20)]
    blosc = {"chunk_size": 8, "compressors": [zarr.codecs.BloscCodec()]}
    config = {"core": {"chunk_size": 8}, "field_overrides": {"pbc": blosc}}
    AtomicDataZarrWriter(path, config).write(data)
    reader = AtomicDataZarrReader(path)
    assert reader._arrays["positions"].mode == "raw"
    assert reader._arrays["pbc"].mode == "decode"
    (path / "core" / "positions" / "c" / "1" / "0").write_bytes(b"\0" * 10)
    (path / "core" / "pbc" / "c" / "0" / "0").write_bytes(b"not blosc")
    (path / "core" / "stress" / "c" / "2" / "0" / "0").unlink()
    problems = AtomicDataZarrReader(path).verify()["problems"]
    assert len(problems) == 3, problems
    assert any("core/positions/c/1/0 has 10 bytes" in p for p in problems)
    assert any("core/pbc/c/0/0 cannot be decoded" in p and "samples 0-7" in p for p in problems)
    assert any("core/stress/c/2/0/0 is missing" in p and "samples 16-19" in p for p in problems)
    with pytest.raises(ValueError, match="core/pbc/c/0/0 cannot be decoded"):
        AtomicDataZarrReader(path).read(0)


def test_stores_of_format_1_and_the_reference_layout_still_read(path):
    """Stores written before (raw, 1 MiB chunks, zero chunks left out) and by zarr's defaults."""
    data = [water(k, lists=False) for k in range(3)] + [crystal(5, lists=False)]
    batch = Batch.from_data_list(data)
    counts = np.array([d.num_nodes for d in data])
    root = zarr.open_group(str(path), mode="w")  # what the reference writes: zarr defaults
    meta, core = root.require_group("meta"), root.require_group("core")
    root.require_group("custom")
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    for name, values in (
        ("atoms_ptr", ptr),
        ("edges_ptr", np.zeros(5, np.int64)),
        ("samples_mask", np.ones(4, bool)),
        ("atoms_mask", np.ones(ptr[-1], bool)),
        ("edges_mask", np.ones(0, bool)),
    ):
        meta.create_array(name, data=values)
    levels = {}
    for key, _ in batch:
        core.create_array(key, data=batch[key].numpy())  # int64 atomic numbers, zstd
        levels[key] = batch.level_of(key)
    root.attrs.update({"num_samples": 4, "fields": {"core": levels, "custom": {}}})
    assert not _chunk_files(path, "meta/edges_ptr")  # zeros were never written
    reader = AtomicDataZarrReader(path)
    assert reader._arrays["positions"].mode == "decode"  # zstd chunks read directly
    for (fields, _), want in zip(reader.read_many([3, 0, 1, 2]), [data[3], *data[:3]]):
        assert_same(fields, want)
    report = reader.verify()
    assert report["absent_may_be_zeros"] is True


def test_small_stores_are_small_and_chunks_follow_the_content(tmp_path):
    data = samples(4, lists=False)
    AtomicDataZarrWriter(tmp_path / "s.zarr").write(data)
    size = sum(p.stat().st_size for p in (tmp_path / "s.zarr").rglob("*") if p.is_file())
    assert size < 100_000  # 1 MiB per array (about 13 MB) before
    root = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    assert root["core/atomic_numbers"].dtype == np.uint8  # read back as int64
    config = ZarrArrayConfig()
    assert config.chunk_rows((10**6, 3), 4) == (16 << 10) // 12  # the byte target
    assert config.chunk_rows((10**6, 3, 3), 4, level="system") == (4 << 10) // 36
    assert config.chunk_rows((100, 3), 4) == 128  # the data, rounded up to a power of two
    assert config.chunk_rows((10**6,), 1, compressed=True) == (16 << 10)
    # shards: what the first write holds (rounded up), at most 64 MiB decoded
    assert config.shard_rows((100, 3), 4, 128) == 128
    assert config.shard_rows((10**6, 3), 4, 1365) == 1365 * 769
    assert config.shard_rows((10**8, 3), 4, 1365) == 1365 * ((64 << 20) // (12 * 1365))
    assert ZarrArrayConfig(chunk_size=8).shard_rows((10**6, 3), 4, 8) is None  # reference's
    noise = np.random.default_rng(0).integers(0, 256, size=10**5, dtype=np.uint8)
    assert config.array_kwargs(noise)["compressors"] is None  # raw: nothing to gain
    kwargs = config.array_kwargs(np.ones(10**5, bool))  # masks, indices: compressed
    assert kwargs["compressors"][0].cname.value == "lz4hc" and kwargs["shards"] == (2**17,)
    assert ZarrArrayConfig(compressors=None).array_kwargs(np.ones(9, bool))["compressors"] is None


def test_appends_to_a_format_1_store_keep_its_dtypes(path):
    AtomicDataZarrWriter(path, {"core": {"compressors": None}}).write(samples(2))
    root = zarr.open_group(str(path), mode="r+")
    numbers = root["core/atomic_numbers"][:].astype(np.int64)
    del root["core/atomic_numbers"]
    root["core"].create_array("atomic_numbers", data=numbers)
    root.attrs["format"] = "nvalchemi-atomicdata-zarr/1"
    AtomicDataZarrWriter(path).append(samples(3)[2:])
    reader = AtomicDataZarrReader(path)
    assert zarr.open_group(str(path), mode="r")["core/atomic_numbers"].dtype == np.int64
    assert_same(reader.read(2)[0], samples(3)[2])


def test_defragment_refuses_a_damaged_store_instead_of_baking_in_zeros(path):
    data = samples(4, lists=False)
    writer = AtomicDataZarrWriter(path)
    writer.write(data)
    writer.delete([1])
    (path / "core" / "positions" / "c" / "0" / "0").unlink()
    with pytest.raises(ValueError, match=r"Cannot defragment .*core/positions/c/0/0 .*is missing"):
        writer.defragment()
    assert (path / "meta" / "samples_mask").is_dir()  # the store was left as it was
