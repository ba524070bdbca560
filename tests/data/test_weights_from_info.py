"""Weights read from extxyz/db info with MACE's keys, config_type weights, groups (issue 29)."""

import json

import pytest
import torch
from ase.build import bulk, fcc111
from ase.calculators.emt import EMT
from ase.io import write

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.groups import group_counts, info_labels
from nvalchemi.data.inspect import data_statistics
from nvalchemi.data.io.ase import ASEReader, write_extxyz
from nvalchemi.data.sources import SubsetReader, open_reader
from nvalchemi.data.weights import weights_from_info


def labelled(atoms, **info):
    atoms.calc = EMT()
    atoms.get_potential_energy()
    atoms.info.update(info)
    return atoms


def frames():
    cell = bulk("Cu", "fcc", a=3.6, cubic=True)
    slab = fcc111("Cu", (2, 2, 2), vacuum=5.0)
    slab.info.clear()
    return [
        labelled(cell.copy(), config_type="bulk", config_weight=2.0, config_forces_weight=0.5),
        labelled(cell.copy(), config_type="bulk"),
        labelled(slab.copy(), config_type="slab111", config_energy_weight=0.0),
        labelled(slab.copy(), config_type="slab111", stress_weight=3.0),  # an alias
        labelled(cell.copy()),  # no config_type
    ]


@pytest.fixture
def extxyz(tmp_path):
    path = tmp_path / "data.extxyz"
    write(path, frames())
    return path


def test_mace_keys_and_aliases_become_weight_fields(extxyz):
    reader = ASEReader(extxyz)
    first, second, third, fourth = (reader.read_data(i) for i in range(4))
    assert first.loss_weight.tolist() == [[2.0]] and first.forces_weight.tolist() == [[0.5]]
    assert "config_weight" not in first.info and first.info["config_type"] == "bulk"
    assert "loss_weight" not in second  # no weight: nothing stored, nothing to compute
    assert third.energy_weight.tolist() == [[0.0]]
    assert fourth.stress_weight.tolist() == [[3.0]]
    batch = Batch.from_data_list([first, second, third, fourth])
    assert batch.loss_weight.reshape(-1).tolist() == [2.0, 1.0, 1.0, 1.0]  # absent: 1
    assert batch.energy_weight.reshape(-1).tolist() == [1.0, 1.0, 0.0, 1.0]


def test_config_type_weights_multiply_the_structure_weight(extxyz):
    reader = ASEReader(extxyz, config_type_weights={"slab111": 3.0, "bulk": 0.5})
    weights = [
        float(d.loss_weight) if "loss_weight" in d else 1.0
        for d in (reader.read_data(i) for i in range(len(reader)))
    ]
    assert weights == [1.0, 0.5, 3.0, 3.0, 1.0]  # 2.0 * 0.5 for the first; unlisted: 1
    with pytest.raises(ValueError, match=r"config_type_weights\['bulk'\] = -1"):
        ASEReader(extxyz, config_type_weights={"bulk": -1})


def test_bad_weights_name_the_file_the_frame_and_the_key(tmp_path):
    path = tmp_path / "bad.extxyz"
    write(path, [labelled(bulk("Cu", cubic=True)), labelled(bulk("Cu", cubic=True))])
    text = path.read_text().splitlines()
    second = 2 + 4 + 1  # the second frame's comment line (4 atoms each)
    text[second] += " config_forces_weight=-2"
    path.write_text("\n".join(text) + "\n")
    reader = ASEReader(path)
    reader.read_data(0)
    with pytest.raises(ValueError, match=r"bad\.extxyz: frame 1: .*config_forces_weight.*-2"):
        reader.read_data(1)
    with pytest.raises(ValueError, match=r"config_weight=2.0, loss_weight=3.0 give two weights"):
        weights_from_info({"config_weight": 2.0, "loss_weight": 3.0})
    with pytest.raises(ValueError, match=r"info\['config_weight'\] = nan is not a weight"):
        weights_from_info({"config_weight": float("nan")})


def test_weights_round_trip_through_extxyz_and_an_ase_database(extxyz, tmp_path):
    data = [ASEReader(extxyz).read_data(i) for i in range(5)]
    again = ASEReader(write_extxyz(tmp_path / "again.extxyz", data))
    assert again.read_data(0).loss_weight.tolist() == [[2.0]]
    assert again.read_data(0).forces_weight.tolist() == [[0.5]]
    from ase.db import connect

    db = connect(tmp_path / "data.db")
    for atoms in frames():
        db.write(atoms, **{k: v for k, v in atoms.info.items()})
    from_db = ASEReader(tmp_path / "data.db")
    assert from_db.read_data(0).loss_weight.tolist() == [[2.0]]
    assert from_db.read_data(2).energy_weight.tolist() == [[0.0]]
    assert info_labels([from_db]) == ["bulk", "bulk", "slab111", "slab111", None]


def test_groups_come_from_the_comment_lines_of_files_and_subsets(extxyz):
    reader = open_reader(extxyz)
    labels = info_labels([reader, SubsetReader(reader, [4, 2])])
    assert labels == ["bulk", "bulk", "slab111", "slab111", None, None, "slab111"]
    assert group_counts(labels) == {"slab111": 3, "(none)": 2, "bulk": 2}


def test_data_stats_shows_groups_and_weights(extxyz):
    stats = data_statistics([open_reader(extxyz)])
    assert stats["groups"] == {"bulk": 2, "slab111": 2, "(none)": 1}
    assert stats["weights"]["loss_weight"] == {"structures": 1, "min": 1.0, "max": 2.0}
    assert stats["weights"]["energy_weight"]["structures"] == 1
    assert data_statistics([open_reader(extxyz)], group_by="nope")["groups"] == {}


def test_data_stats_cli_prints_the_group_table(extxyz):
    from click.testing import CliRunner

    from nvalchemi.app.cli import main

    result = CliRunner().invoke(main, ["data", "stats", str(extxyz), "--json"])
    assert result.exit_code == 0, result.output
    assert "Groups (config_type)" in result.output and "slab111" in result.output
    assert "loss_weight: 1 structures weighted other than 1" in result.output
    payload = json.loads(result.output[result.output.index("{") :])
    assert payload["groups"]["slab111"] == 2


def test_a_weight_of_1_is_not_stored():
    atoms = labelled(bulk("Cu", cubic=True), config_weight=1.0, config_forces_weight=1)
    data = AtomicData.from_atoms(atoms)
    assert "loss_weight" not in data and "forces_weight" not in data
    assert torch.equal(data.positions, torch.as_tensor(atoms.positions, dtype=torch.float32))
