"""``nvalchemi-training export``: a checkpoint to a torch-only file, with the run's record."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from nvalchemi.app.export import export_checkpoint, read_run_record
from nvalchemi.models import NvalchemiCalculator
from nvalchemi.models.export import read_export_metadata

from ._support import TRAIN, assert_user_error, invoke

TIGHT = {"rtol": 1e-10, "atol": 1e-12}


def _structures(count=3):
    """Structures of the elements the tiny run's model knows (its first training ones)."""
    from ase.io import read

    return read(TRAIN, index=f":{count}")


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    """The tiny trained run exported by the command (float64), and its metadata."""
    out = tmp_path_factory.mktemp("export") / "potential.pt"
    result = invoke("export", trained_run["checkpoints"], out, "--dtype", "float64")
    assert result.exit_code == 0, result.output
    return out, read_export_metadata(out), result


def test_the_command_writes_a_file_and_says_how_it_was_checked(exported):
    out, info, result = exported
    assert out.is_file()
    assert f"exported:   {out}" in result.stderr
    assert "self-check: eager and exported agree on 4 structures" in result.stderr
    assert "NvalchemiCalculator.from_export" in result.stderr
    assert info["dtype"] == "float64" and info["self_check"]["tolerance"] == 1e-10
    assert max(info["self_check"]["max_relative_error"].values()) <= 1e-10
    assert "train.extxyz" in info["self_check"]["source"]  # the run's own data


def test_metadata_records_the_model_checkpoint_data_and_final_errors(trained_run, exported):
    _, info, _ = exported
    checkpoints = trained_run["checkpoints"]
    manifest = json.loads((checkpoints / "manifest.json").read_text())
    latest = manifest["checkpoint_index"]
    entry = next(e for e in manifest["checkpoints"] if e["index"] == latest)
    spec = json.loads((checkpoints / entry["path"] / "models" / "main" / "spec.json").read_text())
    model = info["model"]
    assert model["spec"] == spec and model["checkpoint_index"] == latest
    assert model["weights"] == "ema"  # the tiny job keeps an EMA
    assert info["training"]["step"] == entry["step_count"] == 4
    [data] = info["training"]["data"]
    assert data["role"] == "training" and data["path"] == str(TRAIN)
    assert data["sha256"] == hashlib.sha256(TRAIN.read_bytes()).hexdigest()
    assert info["training"]["dataset"]["max_structures"] == 16
    final = json.loads((trained_run["run_dir"] / "final_evaluation.json").read_text())
    assert info["training"]["final_evaluation"]["metrics"] == final["metrics"]
    assert info["units"]["forces"] == "eV/Å" and info["versions"]["torch"] == torch.__version__


def test_the_export_equals_the_calculator_on_the_checkpoint(trained_run, exported):
    out, _, _ = exported
    for atoms in _structures():
        ours, reference = atoms.copy(), atoms.copy()
        ours.calc = NvalchemiCalculator.from_export(out)
        reference.calc = NvalchemiCalculator.from_checkpoint(
            trained_run["checkpoints"], dtype=torch.float64
        )
        np.testing.assert_allclose(
            ours.get_potential_energy(), reference.get_potential_energy(), **TIGHT
        )
        np.testing.assert_allclose(ours.get_forces(), reference.get_forces(), **TIGHT)
        np.testing.assert_allclose(ours.get_stress(), reference.get_stress(), **TIGHT)


def test_live_weights_float32_and_a_check_file(trained_run, tmp_path):
    from ase.io import write

    out, check = tmp_path / "live.pt", tmp_path / "check.extxyz"
    write(check, _structures(5))
    result = invoke(
        "export", trained_run["checkpoints"], out, "--live", "--dtype", "float32", "--check", check
    )
    assert result.exit_code == 0, result.output
    info = read_export_metadata(out)
    assert info["model"]["weights"] == "live" and info["dtype"] == "float32"
    assert info["self_check"]["tolerance"] == 1e-4
    assert info["self_check"]["source"] == f"--check {check}"
    assert len(info["self_check"]["structures"]) == 5
    atoms = _structures(1)[0]
    live, ema = atoms.copy(), atoms.copy()
    live.calc = NvalchemiCalculator.from_export(out)
    ema.calc = NvalchemiCalculator.from_checkpoint(trained_run["checkpoints"], use_ema=True)
    assert abs(live.get_potential_energy() - ema.get_potential_energy()) > 1e-6


def test_an_older_checkpoint_has_its_own_step_and_no_final_errors(trained_run, tmp_path):
    info = export_checkpoint(trained_run["checkpoints"], tmp_path / "0.pt", checkpoint_index=0)
    assert info["model"]["checkpoint_index"] == 0 and info["training"]["step"] == 2
    assert info["training"]["final_evaluation"] is None  # those errors are the last model's


def test_refusals_are_user_errors_and_write_nothing(trained_run, tmp_path):
    checkpoints = trained_run["checkpoints"]
    result = invoke("export", checkpoints, tmp_path / "m.pt2", "--format", "aoti")
    assert_user_error(result, "--format: 'aoti'", "not provided yet", fix="torchscript")
    result = invoke("export", tmp_path, tmp_path / "m.pt")
    assert_user_error(result, "CHECKPOINT", "no manifest.json", fix="checkpoint root")
    foreign = tmp_path / "mine.pt"
    foreign.write_bytes(b"not a model")
    result = invoke("export", checkpoints, foreign)
    assert_user_error(result, "OUT:", "not an nvalchemi export", fix="another output path")
    assert foreign.read_bytes() == b"not a model"
    from ase import Atoms
    from ase.io import write

    write(tmp_path / "oxygen.extxyz", Atoms("O2", positions=[[0, 0, 0], [0, 0, 1.2]]))
    result = invoke("export", checkpoints, tmp_path / "m.pt", "--check", tmp_path / "oxygen.extxyz")
    assert_user_error(result, "--check", "Z=[8]", fix="model's elements")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.pt", "oxygen.extxyz"]


def test_a_quickstart_run_records_the_bundled_splits_and_test_errors(tmp_path):
    from nvalchemi.data.bundled import bundled_split_path

    (tmp_path / "quickstart.json").write_text(json.dumps({"recipe": {"max_train": 40}}))
    metrics = {"num_structures": 3, "forces_mae": 0.03}
    (tmp_path / "test_metrics.json").write_text(json.dumps({"metrics": metrics}))
    record = read_run_record(tmp_path)
    assert record.kind == "quickstart" and record.dataset == {"max_train": 40}
    assert record.training_files == [bundled_split_path("train")]
    assert record.check_files == [bundled_split_path("val")]
    assert record.evaluation == {"on": "test split", "weights": "ema", "metrics": metrics}
    assert {e["role"] for e in record.data_entries()} == {"training", "validation", "test"}
    assert read_run_record(tmp_path / "elsewhere").kind is None
