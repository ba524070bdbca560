"""``data check`` / ``data stats`` against stores whose arrays were swapped or edited on disk.

Stores written now record in each array's own ``zarr.json`` which field it holds (and its
level and unit); stores written before did not, so for them the pointer totals, the masks
and the plausibility of every structure (atoms present, no two atoms closer than a
floor) have to find the swap.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import zarr
from ase.io import read, write

from nvalchemi.data import AtomicData
from nvalchemi.data.io.zarr import AtomicDataZarrReader, AtomicDataZarrWriter, StoreDamagedError

from ._support import VAL, assert_user_error, invoke


@pytest.fixture
def store(tmp_path):
    source = tmp_path / "in.extxyz"
    write(source, read(VAL, index=":8"), format="extxyz")
    path = tmp_path / "good.zarr"
    assert invoke("data", "convert", source, path).exit_code == 0
    return path


def _copy(store, name):
    target = store.with_name(name)
    shutil.copytree(store, target)
    return target


def _swap(group, a, b):
    """Swap two array directories, as a careless copy or a hand edit might."""
    tmp = group / ".swap"
    (group / a).rename(tmp)
    (group / b).rename(group / a)
    tmp.rename(group / b)


def _as_written_before(store):
    """Drop the per-array records (field, level, unit): a store as written before them."""
    for path in store.rglob("zarr.json"):
        meta = json.loads(path.read_text())
        if meta.get("node_type") == "array":
            meta["attributes"] = {}
            path.write_text(json.dumps(meta))
    return store


def _assert_refused(store, *fragments):
    for command in ("check", "stats"):
        result = invoke("data", command, store)
        assert_user_error(result, str(store), *fragments, fix="copy it again")
        assert "Error: mean" not in result.stderr
    with pytest.raises(StoreDamagedError):  # what training opens: refused as well
        AtomicDataZarrReader(str(store))


def test_swapped_pointer_arrays_are_refused_by_check_stats_and_the_reader(store):
    swapped = _copy(store, "pointers.zarr")
    _swap(swapped / "meta", "atoms_ptr", "edges_ptr")
    _assert_refused(swapped, "meta/atoms_ptr holds 'edges_ptr'", "swapped")
    old = _as_written_before(swapped)  # no records: the masks no longer match the pointers
    _assert_refused(old, "meta/edges_ptr counts", "meta/edges_mask has 0 rows")


def test_positions_swapped_with_forces_are_refused(store):
    swapped = _copy(store, "posforce.zarr")
    _swap(swapped / "core", "positions", "forces")
    _assert_refused(swapped, "array core/forces holds 'positions'")


def test_positions_swapped_with_forces_in_an_older_store_fail_the_distance_floor(store):
    swapped = _as_written_before(_copy(store, "posforce-old.zarr"))
    _swap(swapped / "core", "positions", "forces")
    result = invoke("data", "check", swapped)
    assert result.exit_code == 1, result.stderr
    assert "duplicate atoms" in result.stderr and "Å apart" in result.stderr, result.stderr
    assert "hold another array" in result.stderr
    assert "problem(s) found" in result.stderr
    assert invoke("data", "check", store).exit_code == 0  # the intact store passes


def test_a_field_with_the_wrong_shape_or_unit_is_named(store):
    swapped = _as_written_before(_copy(store, "cellpbc.zarr"))
    _swap(swapped / "core", "cell", "pbc")
    _assert_refused(
        swapped, "array core/cell has rows of shape [3]", "cell needs [n_systems, 3, 3]"
    )
    nm = _copy(store, "nm.zarr")
    meta_path = nm / "core" / "positions" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["unit"] = "nm"
    meta_path.write_text(json.dumps(meta))
    _assert_refused(nm, "array core/positions is in nm; positions must be in Å")


def test_structures_without_atoms_are_problems_and_stats_still_reports(tmp_path):
    empty = AtomicData(
        atomic_numbers=torch.zeros(0, dtype=torch.long),
        positions=torch.zeros(0, 3),
        energy=torch.tensor([[1.0]]),
    )
    pair = AtomicData(
        atomic_numbers=torch.tensor([29, 29]),
        positions=torch.tensor([[0.0, 0, 0], [2.5, 0, 0]]),
        energy=torch.tensor([[-3.0]]),
    )
    path = tmp_path / "empty.zarr"
    AtomicDataZarrWriter(str(path)).write([empty, pair, empty])
    result = invoke("data", "check", path)
    assert result.exit_code == 1
    assert "structure 0 has no atoms" in result.stderr
    assert "structure 2 has no atoms" in result.stderr
    result = invoke("data", "stats", path, "--json")
    assert result.exit_code == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["energy_per_atom"]["mean"] == pytest.approx(-1.5)


def test_every_pointer_total_of_an_intact_store_matches_its_arrays(store):
    """The records and totals pass for what the writer writes, also after appends."""
    reader = AtomicDataZarrReader(str(store))
    report = reader.verify()
    assert report["problems"] == [] and report["warnings"] == []
    root = zarr.open_group(str(store), mode="r")
    assert dict(root["core"]["forces"].attrs) == {
        "field": "forces",
        "level": "atom",
        "unit": "eV/Å",
    }
    assert dict(root["meta"]["atoms_ptr"].attrs)["level"] == "pointer"
    atoms = int(np.asarray(root["meta"]["atoms_ptr"][-1]))
    assert root["core"]["positions"].shape[0] == atoms == root["meta"]["atoms_mask"].shape[0]
