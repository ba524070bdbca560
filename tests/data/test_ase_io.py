"""ASEReader (lazy extxyz and ASE databases), write_extxyz, and errors on bad input."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from ase.build import bulk, molecule
from ase.calculators.singlepoint import SinglePointCalculator

import nvalchemi.data.io.ase as ase_io
from nvalchemi.data import AtomicData
from nvalchemi.data.io.ase import ASEReader, scan_extxyz, write_extxyz


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NVALCHEMI_CACHE_DIR", str(tmp_path / "cache"))


def labelled(seed: int, periodic: bool = True):
    rng = np.random.default_rng(seed)
    atoms = bulk("Cu", "fcc", a=3.6) * (1, 1, 1 + seed % 3) if periodic else molecule("CH4")
    atoms.rattle(0.05, seed=seed)
    results = {"energy": -float(seed), "forces": rng.normal(size=(len(atoms), 3))}
    if periodic:
        results["stress"] = rng.normal(size=6) * 0.01
    atoms.calc = SinglePointCalculator(atoms, **results)
    atoms.info["config_type"] = "bulk" if periodic else "molecule"
    return atoms


def structures(n=6):
    return [
        AtomicData.from_atoms(labelled(k, periodic=k % 3 != 2), dtype=torch.float64)
        for k in range(n)
    ]


@pytest.fixture
def xyz(tmp_path) -> Path:
    return write_extxyz(tmp_path / "data.extxyz", structures())


def test_round_trip_through_extxyz(xyz):
    reader = ASEReader(xyz, dtype=torch.float64)
    assert len(reader) == 6
    for k, original in enumerate(structures()):
        data = reader.read_data(k)
        for key in ("atomic_numbers", "positions", "energy", "forces"):
            assert torch.allclose(data[key].double(), original[key].double()), (k, key)
        assert ("stress" in data) == ("stress" in original)
        if "stress" in data:
            assert torch.allclose(data.stress, original.stress)
        assert ("cell" in data) == (k % 3 != 2)


def test_read_returns_tensors_and_metadata_naming_the_source(xyz):
    fields, meta = ASEReader(xyz).read(4)
    assert set(fields) >= {"atomic_numbers", "positions", "energy", "forces"}
    assert fields["positions"].dtype == torch.float32
    assert meta == {
        "index": 4,
        "source_file": str(xyz),
        "frame": 4,
        "info": {"config_type": "bulk"},
    }
    data, meta = ASEReader(xyz, as_atomic_data=True).read(0)
    assert isinstance(data, AtomicData) and data.info["config_type"] == "bulk"


def test_reading_is_lazy_one_frame_per_read(xyz, monkeypatch):
    import ase.io

    parsed = []
    real_read = ase.io.read
    monkeypatch.setattr(ase.io, "read", lambda *a, **k: parsed.append(1) or real_read(*a, **k))
    reader = ASEReader(xyz)
    assert parsed == []
    reader.read(5)
    reader.read(-1)
    assert len(parsed) == 2


def test_frame_index_is_cached_on_disk(xyz, monkeypatch):
    ASEReader(xyz)
    monkeypatch.setattr(ase_io, "scan_extxyz", lambda *a: pytest.fail("rescanned"))
    assert len(ASEReader(xyz)) == 6


def test_scan_finds_frame_offsets_and_tolerates_blank_lines_and_crlf(tmp_path):
    text = "1\nc\nH 0 0 0\n\n2\r\nc\r\nH 0 0 0\r\nH 0 0 1\r\n"
    path = tmp_path / "x.xyz"
    path.write_bytes(text.encode())
    offsets, lines = scan_extxyz(path)
    assert offsets.tolist() == [0, 13, len(text)]
    assert lines.tolist() == [1, 5]
    path.write_text("1\nc\nH 0 0 0")  # no final newline
    assert scan_extxyz(path)[0].tolist() == [0, 11]


def test_index_selection_and_several_files(tmp_path):
    a = write_extxyz(tmp_path / "a.xyz", structures(4))
    b = write_extxyz(tmp_path / "b.xyz", structures(3))
    both = ASEReader([a, b])
    assert len(both) == 7
    assert both.read(5)[1]["source_file"] == str(b) and both.read(5)[1]["frame"] == 1
    assert len(ASEReader(a, index="1:3")) == 2
    assert ASEReader(a, index="1:3").read(0)[1]["frame"] == 1
    assert len(ASEReader(a, index=[3, 0])) == 2
    assert len(ASEReader(a, index=-1)) == 1


def test_compressed_extxyz_is_read_by_index(tmp_path):
    plain = write_extxyz(tmp_path / "p.xyz", structures(4))
    gz = tmp_path / "p.xyz.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = ASEReader(plain), ASEReader(gz)
    assert len(b) == 4
    assert torch.equal(a.read(3)[0]["forces"], b.read(3)[0]["forces"])
    write_extxyz(tmp_path / "w.extxyz.gz", structures(2))
    assert len(ASEReader(tmp_path / "w.extxyz.gz")) == 2


def test_ase_database_by_row_id_with_custom_keys(tmp_path):
    from ase.db import connect

    path = tmp_path / "data.db"
    db = connect(str(path))
    for k in range(3):
        atoms = labelled(k)
        db.write(
            atoms, REF_energy=10.0 + k, tag="x", data={"REF_forces": np.full((len(atoms), 3), k)}
        )
    db.delete([2])  # ids need not be contiguous
    reader = ASEReader(path, required_labels=("energy", "forces", "stress"))
    assert len(reader) == 2
    assert float(reader.read(1)[0]["energy"]) == pytest.approx(-2.0)
    custom = ASEReader(path, energy_key="REF_energy", forces_key="REF_forces")
    fields, meta = custom.read(1)
    assert float(fields["energy"]) == 12.0 and float(fields["forces"][0, 0]) == 2.0
    assert meta["info"]["tag"] == "x"


def test_calculator_labels_of_extxyz_and_trajectory_frames_are_read(tmp_path, xyz):
    from ase.io import write

    # extxyz labels arrive as SinglePointCalculator results valid for the frame
    assert ASEReader(xyz, required_labels=("energy", "forces")).read_data(1).energy is not None
    # other ASE formats are read whole; each frame keeps its calculator's labels
    frames = [labelled(k) for k in range(2)]
    write(tmp_path / "frames.traj", frames)
    reader = ASEReader(tmp_path / "frames.traj", required_labels=("energy", "forces", "stress"))
    data = reader.read_data(1)
    assert data.energy.item() == pytest.approx(-1.0)
    assert np.allclose(data.forces.numpy(), frames[1].calc.results["forces"], atol=1e-6)


def test_pickled_reader_reads_in_another_process_style(xyz):
    import pickle

    reader = ASEReader(xyz)
    reader.read(0)
    clone = pickle.loads(pickle.dumps(reader))
    assert torch.equal(clone.read(2)[0]["positions"], reader.read(2)[0]["positions"])


@pytest.mark.parametrize("as_atomic_data", [False, True])
def test_dataset_over_the_reader(xyz, as_atomic_data):
    from nvalchemi.data.datapipes.dataset import Dataset

    reader = ASEReader(xyz, dtype=torch.float64, as_atomic_data=as_atomic_data)
    assert reader.validates is True
    dataset = Dataset(reader)
    original = structures()
    for k in (5, 0):
        data, meta = dataset.get_with_metadata(k)
        assert torch.allclose(data.forces, original[k].forces.double())
        assert meta["frame"] == k


def test_write_extxyz_accepts_a_batch(tmp_path):
    from nvalchemi.data import Batch

    path = write_extxyz(tmp_path / "b.xyz", Batch.from_data_list(structures(3)))
    assert len(ASEReader(path)) == 3
    with pytest.raises(ValueError, match="nothing to write"):
        write_extxyz(tmp_path / "e.xyz", [])


# --------------------------------------------------------------------- bad input
FRAME = (
    '2\nLattice="3 0 0 0 3 0 0 0 3" Properties=species:S:1:pos:R:3:forces:R:3 '
    'energy={e} pbc="T T T"\n'
    "Cu 0 0 0 {f} 0 0\nCu 1.5 1.5 0 0 0 0\n"
)


def write(tmp_path, text: str, name="bad.xyz") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_malformed_atom_count_names_file_frame_and_line(tmp_path):
    path = write(tmp_path, FRAME.format(e=1, f=0) + "two\ncomment\n")
    with pytest.raises(ValueError, match=r"bad\.xyz: frame 1 \(line 5\) is malformed"):
        ASEReader(path)


def test_missing_atom_line_also_points_at_the_previous_frame(tmp_path):
    short = FRAME.format(e=2, f=0).replace("Cu 1.5 1.5 0 0 0 0\n", "")  # 2 atoms, 1 line
    path = write(tmp_path, FRAME.format(e=1, f=0) + short + FRAME.format(e=3, f=0))
    # frame 1 swallows frame 2's count line, so the error surfaces at frame 2's comment
    with pytest.raises(ValueError, match=r"frame 2 \(line 9\) is malformed") as err:
        ASEReader(path)
    assert "previous frame 1 (line 5) may have more or fewer atom lines than its count of 2" in (
        str(err.value)
    )
    first = write(tmp_path, "two\ncomment\n", "first.xyz")
    with pytest.raises(ValueError, match="frame 0") as err:
        ASEReader(first)
    assert "previous frame" not in str(err.value)


def test_truncated_file_names_the_last_frame(tmp_path):
    text = FRAME.format(e=1, f=0) + FRAME.format(e=2, f=0)
    path = write(tmp_path, text.rsplit("Cu 1.5", 1)[0])
    with pytest.raises(ValueError, match=r"bad\.xyz: frame 1 \(line 5\) is truncated"):
        ASEReader(path)


def test_empty_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"empty\.xyz: the file contains no structures"):
        ASEReader(write(tmp_path, "", "empty.xyz"))
    with pytest.raises(ValueError, match="no structures"):
        ASEReader(write(tmp_path, "\n\n", "blank.xyz"))


def test_missing_file_and_unknown_label(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.xyz"):
        ASEReader(tmp_path / "nope.xyz")
    with pytest.raises(ValueError, match="Unknown required labels"):
        ASEReader(write(tmp_path, FRAME.format(e=1, f=0)), required_labels=("enthalpy",))


NO_FORCES = '2\nLattice="3 0 0 0 3 0 0 0 3" Properties=species:S:1:pos:R:3 energy=2 pbc="T T T"\n'
NO_FORCES += "Cu 0 0 0\nCu 1.5 1.5 0\n"


def test_frame_without_a_required_label_names_file_and_frame(tmp_path):
    path = write(tmp_path, FRAME.format(e=1, f=0) + NO_FORCES)
    reader = ASEReader(path, required_labels=("energy", "forces"))
    reader.read(0)
    with pytest.raises(ValueError, match=r"bad\.xyz: frame 1: required label 'forces' is missing"):
        reader.read(1)
    assert len(ASEReader(path, required_labels=("energy",)).read_many([0, 1])) == 2
    renamed = ASEReader(path, required_labels=("energy",), energy_key="REF_energy")
    with pytest.raises(ValueError, match=r"frame 0: required label 'energy'.*'REF_energy'"):
        renamed.read(0)


@pytest.mark.parametrize("energy, force", [("nan", 0), (1, "inf"), ("-inf", 0)])
def test_nan_or_inf_labels_name_file_and_frame(tmp_path, energy, force):
    text = FRAME.format(e=1, f=0) + FRAME.format(e=energy, f=force)
    reader = ASEReader(write(tmp_path, text))
    reader.read(0)
    with pytest.raises(ValueError, match=r"bad\.xyz: frame 1: .*NaN or inf"):
        reader.read(1)


def test_wrong_shapes_name_file_and_frame(tmp_path):
    short_row = FRAME.format(e=1, f=0).replace("Cu 1.5 1.5 0 0 0 0", "Cu 1.5 1.5 0 0 0")
    reader = ASEReader(write(tmp_path, FRAME.format(e=1, f=0) + short_row))
    with pytest.raises(ValueError, match=r"bad\.xyz: frame 1 \(line 5\) cannot be parsed"):
        reader.read(1)
    bad_stress = FRAME.format(e=1, f=0).replace('pbc="T T T"', 'stress="1 2 3 4 5" pbc="T T T"')
    reader = ASEReader(write(tmp_path, bad_stress, "stress.xyz"))
    with pytest.raises(ValueError, match=r"stress\.xyz: frame 0 .*stress"):
        reader.read(0)


def test_out_of_range_index_names_the_file(xyz):
    reader = ASEReader(xyz)
    with pytest.raises(IndexError, match=r"Index 6 is out of range for .*data\.extxyz with 6"):
        reader.read(6)
    with pytest.raises(IndexError, match="-7"):
        reader.read(-7)
    with pytest.raises(IndexError, match="out of range"):
        ASEReader(xyz, index=10)
    with pytest.raises(ValueError, match="selects no structures"):
        ASEReader(xyz, index="4:2")


def test_bundled_dataset_is_readable():
    from nvalchemi.data import bundled

    try:
        path = bundled.bundled_split_path("val")
    except FileNotFoundError:
        pytest.skip("bundled data set not generated")
    reader = ASEReader(path, required_labels=("energy", "forces"))
    assert len(reader) > 0
    for index in (0, len(reader) // 2, -1):
        data = reader.read_data(index)
        assert data.forces.shape == (data.num_nodes, 3)
