"""``data convert`` never destroys its input or anything not ours; ``data check`` finds damage."""

from __future__ import annotations

import json

import numpy as np
from ase.io import read, write

from nvalchemi.data.io.zarr import AtomicDataZarrReader

from ._support import VAL, assert_user_error, invoke


def _small_extxyz(path, count=6):
    write(path, read(VAL, index=f":{count}"), format="extxyz")
    return path


def _tree(path):
    """Every file under ``path`` with its bytes (what must survive a refused command)."""
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_convert_refuses_to_overwrite_its_own_input(tmp_path):
    source = _small_extxyz(tmp_path / "same.extxyz")
    before = source.read_bytes()
    result = invoke("data", "convert", source, source, "--overwrite")
    assert_user_error(result, "OUTPUT", "is the input", fix="new path")
    assert source.read_bytes() == before


def test_convert_refuses_an_output_that_contains_or_lies_inside_an_input(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    source = _small_extxyz(data / "tiny.extxyz")
    before = _tree(tmp_path)
    result = invoke("data", "convert", source, data, "--overwrite")
    assert_user_error(result, "OUTPUT", "contains the input", fix="new path")
    result = invoke("data", "convert", source, source / "inside.zarr", "--overwrite")
    assert_user_error(result, "OUTPUT", "is inside the input")
    assert _tree(tmp_path) == before


def test_overwrite_replaces_only_a_store(tmp_path):
    source = _small_extxyz(tmp_path / "in.extxyz")
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    result = invoke("data", "convert", source, folder, "--overwrite")
    assert_user_error(result, "OUTPUT", "not a zarr store", fix="another path")
    assert (folder / "notes.txt").read_text() == "mine"
    plain = tmp_path / "plain.zarr"
    plain.write_text("a file")
    assert_user_error(invoke("data", "convert", source, plain, "--overwrite"), "is a file")
    assert plain.read_text() == "a file"


def test_overwrite_swaps_in_a_complete_store_and_a_failed_one_changes_nothing(tmp_path):
    source = _small_extxyz(tmp_path / "in.extxyz")
    store = tmp_path / "out.zarr"
    assert invoke("data", "convert", source, store, "--max-structures", 2).exit_code == 0
    result = invoke("data", "convert", source, store, "--overwrite")
    assert result.exit_code == 0, result.output
    assert len(AtomicDataZarrReader(str(store))) == 6
    bad = tmp_path / "bad.extxyz"
    frames = read(VAL, index=":3")
    frames[2].numbers[1] = 0  # ASE's dummy atom "X": refused by AtomicData
    write(bad, frames, format="extxyz")
    before = _tree(store)
    result = invoke("data", "convert", bad, store, "--overwrite")
    assert result.exit_code == 1
    assert "atom 1" in result.stderr and "1..118" in result.stderr, result.stderr
    assert _tree(store) == before  # the previous store, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.extxyz", "in.extxyz", "out.zarr"]


def test_check_reads_every_chunk_and_names_what_is_missing(tmp_path):
    source = _small_extxyz(tmp_path / "in.extxyz")
    store = tmp_path / "copy.zarr"
    assert invoke("data", "convert", source, store).exit_code == 0
    ok = invoke("data", "check", store, source, "--json")
    assert ok.exit_code == 0, ok.output
    reports = json.loads(ok.stdout)
    assert [r["problems"] for r in reports] == [[], []]
    assert reports[0]["structures_valid"] == 6 and reports[0]["chunks"] > 0
    (store / "core" / "energy" / "c" / "0" / "0").unlink()  # an interrupted rsync
    damaged = invoke("data", "check", store)
    assert_user_error(damaged, "core/energy/c/0/0 is missing", "samples 0-5", fix="copy")
    stats = invoke("data", "stats", store)
    assert_user_error(stats, str(store), "damaged", "array core/energy", "data check")


def test_check_lists_invalid_structures_of_any_source(tmp_path):
    frames = read(VAL, index=":4")
    frames[1].numbers[0] = 0
    frames[3].numbers[2] = 0
    path = tmp_path / "x.extxyz"
    write(path, frames, format="extxyz")
    result = invoke("data", "check", path)
    assert_user_error(result, "2 problem(s)")
    assert "structure 1:" in result.stderr and "structure 3:" in result.stderr


def test_stores_of_an_older_format_warn_that_absent_chunks_read_as_zeros(tmp_path):
    import zarr

    source = _small_extxyz(tmp_path / "in.extxyz")
    store = tmp_path / "old.zarr"
    assert invoke("data", "convert", source, store).exit_code == 0
    root = zarr.open_group(str(store), mode="r+")
    root.attrs["format"] = "nvalchemi-atomicdata-zarr/1"
    (store / "core" / "forces" / "c" / "0" / "0").unlink()
    reader = AtomicDataZarrReader(str(store))
    assert not reader.every_chunk_written
    assert np.all(reader.read(0)[0]["forces"].numpy() == 0)  # what format 1 meant
    for command in ("check", "stats"):
        result = invoke("data", command, store)
        assert result.exit_code == 0, result.output
        assert "warning:" in result.stderr and "cannot be told from chunks lost" in result.stderr


def test_stats_of_a_store_claiming_absurd_counts_names_store_and_array(tmp_path):
    import zarr

    source = _small_extxyz(tmp_path / "in.extxyz")
    store = tmp_path / "s.zarr"
    assert invoke("data", "convert", source, store).exit_code == 0
    zarr.open_group(str(store), mode="r+").attrs["num_samples"] = 10**12
    result = invoke("data", "stats", store)
    assert_user_error(result, str(store), "meta/atoms_ptr has 7 rows")
    assert "Unable to allocate" not in result.stderr
