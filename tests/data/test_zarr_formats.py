"""Stores written by earlier versions still read, take appends, and upgrade by defragmenting.

``stores/format2.tar.xz`` is a store written by the previous release's ``data convert``
(format 2: one file per chunk, raw positions, no per-array records): the first four
validation structures with neighbour lists for a 3 Å cutoff, structure 1 soft-deleted.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from ase.io import read

from nvalchemi.data import AtomicData
from nvalchemi.data.bundled import BUNDLED_DIR
from nvalchemi.data.io._zarr_common import FORMAT, FORMAT_V2
from nvalchemi.data.io.zarr import AtomicDataZarrReader, AtomicDataZarrWriter
from nvalchemi.data.neighbors import neighbor_list_for_system

STORES = Path(__file__).parent / "stores"
KEPT = [0, 2, 3]  # frames of val.extxyz still active in the store


@pytest.fixture
def old_store(tmp_path):
    with tarfile.open(STORES / "format2.tar.xz") as archive:
        archive.extractall(tmp_path, filter="data")
    return tmp_path / "format2.zarr"


def _assert_frames(reader, frames):
    assert len(reader) == len(frames)
    for (fields, _), atoms in zip(reader.read_many(range(len(frames))), frames):
        assert np.allclose(fields["positions"].numpy(), atoms.positions, atol=1e-5)
        assert np.allclose(fields["forces"].numpy(), atoms.get_forces(), atol=1e-5)
        assert float(fields["energy"]) == pytest.approx(atoms.get_potential_energy(), rel=1e-6)
        pairs, shifts = neighbor_list_for_system(atoms.positions, atoms.cell.array, atoms.pbc, 3.0)
        got = sorted(
            map(tuple, np.hstack([fields["neighbor_list"], fields["neighbor_list_shifts"]]))
        )
        assert got == sorted(map(tuple, np.hstack([pairs, shifts])))


def test_a_format_2_store_reads_as_written_and_checks_clean(old_store):
    root = zarr.open_group(str(old_store), mode="r")
    assert root.attrs["format"] == FORMAT_V2 and root["core/positions"].shards is None
    reader = AtomicDataZarrReader(str(old_store))
    assert reader.every_chunk_written  # format 2 writes every chunk: absence is damage
    frames = read(BUNDLED_DIR / "val.extxyz", index=":4")
    _assert_frames(reader, [frames[k] for k in KEPT])
    report = reader.verify()
    assert report["problems"] == [] and report["warnings"] == []


def test_appends_keep_the_old_layout_and_defragment_upgrades_it(old_store):
    frames = read(BUNDLED_DIR / "val.extxyz", index=":6")
    extra = []
    for atoms in frames[4:6]:
        data = AtomicData.from_atoms(atoms)
        pairs, shifts = neighbor_list_for_system(atoms.positions, atoms.cell.array, atoms.pbc, 3.0)
        data.neighbor_list = torch.from_numpy(pairs)
        data.neighbor_list_shifts = torch.from_numpy(shifts)
        data.info["neighbor_list_cutoff"], data.info["neighbor_list_half_list"] = 3.0, False
        extra.append(data)
    writer = AtomicDataZarrWriter(str(old_store))
    writer.append(extra)
    expected = [frames[k] for k in KEPT] + frames[4:6]
    _assert_frames(AtomicDataZarrReader(str(old_store)), expected)
    root = zarr.open_group(str(old_store), mode="r")
    assert root.attrs["format"] == FORMAT_V2 and root["core/positions"].shards is None

    writer.defragment()  # the upgrade: rewritten in today's layout
    root = zarr.open_group(str(old_store), mode="r")
    assert root.attrs["format"] == FORMAT
    assert root["core/positions"].shards is not None
    assert (
        json.loads((old_store / "core" / "forces" / "zarr.json").read_text())["attributes"]["field"]
        == "forces"
    )
    upgraded = AtomicDataZarrReader(str(old_store))
    _assert_frames(upgraded, expected)
    assert upgraded.verify()["problems"] == []
