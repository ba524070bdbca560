"""Duplicate atoms (two atoms at one place): ``data check``, ``stats`` and ``convert`` name them."""

from __future__ import annotations

import json

from ase.io import read, write

from ._support import VAL, assert_user_error, invoke


def _with_close_atoms(path):
    frames = read(VAL, index=":6")
    frames[3].positions[5] = frames[3].positions[2] + [0.0, 0.0, 0.02]  # a duplicate
    frames[4].positions[1] = frames[4].positions[0] + [0.3, 0.0, 0.0]  # implausible
    write(path, frames, format="extxyz")
    return path


def test_check_names_the_structure_and_the_pair(tmp_path):
    source = _with_close_atoms(tmp_path / "dup.extxyz")
    result = invoke("data", "check", source, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)[0]
    assert report["problems"] == [
        "structure 3: atoms 2 and 5 are 0.02 Å apart: duplicate atoms (below 0.1 Å); remove one "
        "of them or drop the structure (when many structures show this, their positions hold "
        "another array, e.g. the forces)"
    ]
    assert any("structure 4: atoms 0 and 1 are 0.3 Å apart" in w for w in report["warnings"])


def test_stats_names_the_structure_and_the_pair(tmp_path):
    source = _with_close_atoms(tmp_path / "dup.extxyz")
    result = invoke("data", "stats", source, "--json")
    assert result.exit_code == 0, result.stderr
    assert "warning: structure 3: atoms 2 and 5 are 0.02 Å apart: duplicate atoms" in (
        " ".join(result.stderr.split())
    )
    pairs = json.loads(result.stdout)["close_pairs"]
    assert [(p["structure"], p["atoms"]) for p in pairs] == [(3, [2, 5]), (4, [0, 1])]
    assert abs(pairs[0]["distance"] - 0.02) < 1e-6


def test_convert_refuses_duplicates_naming_file_frame_and_pair_and_writes_nothing(tmp_path):
    source = _with_close_atoms(tmp_path / "dup.extxyz")
    result = invoke("data", "convert", source, tmp_path / "out.zarr")
    assert_user_error(
        result, "INPUT", "dup.extxyz: frame 3: atoms 2 and 5 are 0.02 Å apart", fix="remove one"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dup.extxyz"]


def test_convert_warns_of_implausibly_close_atoms_and_writes_the_store(tmp_path):
    frames = read(VAL, index=":4")
    frames[1].positions[1] = frames[1].positions[0] + [0.3, 0.0, 0.0]
    write(tmp_path / "close.extxyz", frames, format="extxyz")
    result = invoke("data", "convert", tmp_path / "close.extxyz", tmp_path / "out.zarr")
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stderr.split())
    assert "warning: " in text and "close.extxyz: frame 1: atoms 0 and 1 are 0.3 Å apart" in text
    assert (tmp_path / "out.zarr").is_dir()
