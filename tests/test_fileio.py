"""Atomic writes: a failed write leaves the target as it was and nothing behind."""

from __future__ import annotations

import doctest

import pytest

import nvalchemi._fileio as fileio
from nvalchemi._fileio import atomic_path, replace_dir, temporary_sibling, write_atomic


def test_docstring_examples_run():
    result = doctest.testmod(fileio, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "metrics.json"
    write_atomic(target, b"old")

    def half_then_fail(handle):
        handle.write(b"ne")
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        write_atomic(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_atomic_path_hands_out_a_sibling_with_the_targets_suffix(tmp_path):
    target = tmp_path / "sub" / "train.extxyz.gz"
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.endswith(".extxyz.gz")
        assert tmp.name.startswith(".") and not target.exists()
        tmp.write_bytes(b"frames")
    assert target.read_bytes() == b"frames" and not tmp.exists()

    with pytest.raises(ValueError), atomic_path(target) as tmp:
        tmp.write_bytes(b"partial")
        raise ValueError("writer failed")
    assert target.read_bytes() == b"frames" and not tmp.exists()


def test_temporary_siblings_are_unique_and_hidden(tmp_path):
    names = {temporary_sibling(tmp_path / "store.zarr", "converting").name for _ in range(20)}
    assert len(names) == 20
    assert all(n.startswith(".converting-") and n.endswith("-store.zarr") for n in names)


def _store(path, content):
    (path / "meta").mkdir(parents=True)
    (path / "meta" / "chunk").write_text(content)
    return path


def test_replace_dir_swaps_a_finished_directory_in_and_removes_only_the_old_one(tmp_path):
    target = _store(tmp_path / "data.zarr", "old")
    (tmp_path / "unrelated").write_text("keep")
    new = _store(temporary_sibling(target), "new")
    replace_dir(new, target)
    assert (target / "meta" / "chunk").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.zarr", "unrelated"]

    fresh = tmp_path / "fresh.zarr"
    replace_dir(_store(temporary_sibling(fresh), "first"), fresh)
    assert (fresh / "meta" / "chunk").read_text() == "first"


def test_replace_dir_puts_the_old_directory_back_when_the_new_one_cannot_move_in(tmp_path):
    target = _store(tmp_path / "data.zarr", "old")
    with pytest.raises(FileNotFoundError):
        replace_dir(tmp_path / "never-written", target)
    assert (target / "meta" / "chunk").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.zarr"]
