"""``data convert`` + ``data stats`` round trip, and ``evaluate`` on a trained checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ase.io import read

from nvalchemi.app.evaluation import Evaluation
from nvalchemi.data.io.zarr import AtomicDataZarrReader

from ._support import TEST, VAL, assert_user_error, invoke, is_png


def test_convert_then_stats_round_trip(tmp_path):
    store = tmp_path / "val.zarr"
    result = invoke(
        "data", "convert", VAL, store, "--cutoff", 4.5, "--max-structures", 20, "--chunk-size", 8
    )
    assert result.exit_code == 0, result.output
    assert "Wrote 20 structures" in result.stderr and "cutoff 4.5 Å" in result.stderr
    reader = AtomicDataZarrReader(str(store))
    fields, meta = reader.read(3)
    assert len(reader) == 20
    assert "neighbor_list" in fields and meta["neighbor_list_cutoff"] == 4.5
    reference = read(VAL, index=3)
    assert np.allclose(fields["positions"].numpy(), reference.positions, atol=1e-5)
    reader.close()

    from_store = invoke("data", "stats", store, "--json")
    from_file = invoke("data", "stats", VAL, "--max-structures", 20, "--json")
    assert from_store.exit_code == 0 and from_file.exit_code == 0, from_store.output
    a, b = json.loads(from_store.stdout), json.loads(from_file.stdout)
    assert a["structures"] == b["structures"] == 20
    assert a["atoms"] == b["atoms"] and a["elements"] == b["elements"]
    assert a["labels"]["energy"] == 20 and a["labels"]["forces"] == 20
    assert a["energy_per_atom"]["mean"] == pytest.approx(b["energy_per_atom"]["mean"], rel=1e-5)
    assert set(a["reference_energies"]) == set(a["elements"])
    assert "suggested per-element reference energies" in from_store.stderr


def test_stats_reference_energies_reproduce_a_linear_data_set(tmp_path):
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    e0 = {"Cu": -3.5, "Au": -2.0}
    frames = []
    for n_cu, n_au in [(2, 1), (1, 3), (4, 0), (2, 2)]:
        atoms = Atoms(
            "Cu" * n_cu + "Au" * n_au, positions=np.arange(3 * (n_cu + n_au)).reshape(-1, 3) * 1.7
        )
        energy = n_cu * e0["Cu"] + n_au * e0["Au"]
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=np.zeros((len(atoms), 3)))
        frames.append(atoms)
    path = tmp_path / "linear.extxyz"
    write(path, frames, format="extxyz")
    result = invoke("data", "stats", path, "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["reference_energies"] == pytest.approx(e0, abs=1e-5)


def test_convert_refuses_an_existing_store(tmp_path):
    store = tmp_path / "x.zarr"
    store.mkdir()
    result = invoke("data", "convert", VAL, store, "--max-structures", 2)
    assert_user_error(result, "OUTPUT", "already exists", "--overwrite")
    assert (
        invoke("data", "convert", VAL, store, "--max-structures", 2, "--overwrite").exit_code == 0
    )


def test_evaluate_prints_metrics_writes_parity_plots_and_json(tmp_path, trained_run):
    out = tmp_path / "eval"
    result = invoke(
        "evaluate",
        trained_run["checkpoints"],
        "--dataset",
        TEST,
        "--max-structures",
        8,
        "--out-dir",
        out,
        "--json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    metrics = report["metrics"]
    assert metrics["num_structures"] == 8
    for key in ("energy_per_atom_mae", "energy_per_atom_rmse", "forces_mae", "forces_rmse"):
        assert np.isfinite(metrics[key]) and metrics[key] >= 0
    assert metrics["energy_per_atom_rmse"] >= metrics["energy_per_atom_mae"]
    assert report["per_element"] and all(v["atoms"] > 0 for v in report["per_element"].values())
    assert sum(v["atoms"] for v in report["per_element"].values()) == metrics["num_atoms"]
    for name in ("parity_energy_per_atom.png", "parity_forces.png"):
        assert is_png(out / name)
    for title in (
        "Evaluation: 8 structures",
        "energy per atom",
        "Errors per element",
        "Errors per structure type (config_type)",
        "Force errors by reference force",
    ):
        assert title in result.stderr
    assert sum(g["structures"] for g in report["by_group"].values()) == 8
    assert report["units"]["forces"] == "eV/Å"


def test_evaluation_metrics_ignore_missing_labels():
    evaluation = Evaluation(
        energy_per_atom_pred=np.array([1.0, 2.0]),
        energy_per_atom_ref=np.array([1.5, np.nan]),
        forces_pred=np.zeros((2, 3)),
        forces_ref=np.array([[1.0, 0, 0], [0, 0, -2.0]]),
        species=np.array([29, 79]),
        num_atoms=2,
    )
    metrics = evaluation.metrics()
    assert metrics["energy_per_atom_mae"] == pytest.approx(0.5)
    assert metrics["forces_mae"] == pytest.approx(0.5)
    assert metrics["forces_rmse"] == pytest.approx(np.sqrt(5 / 6))
    assert evaluation.per_element()["Au"]["forces_mae"] == pytest.approx(2 / 3)


def test_ase_database_converts_and_trains_like_extxyz(tmp_path):
    from ase.db import connect

    frames = read(VAL, index=":6")
    db = tmp_path / "val.db"
    with connect(db) as connection:
        for atoms in frames:
            connection.write(atoms)
    result = invoke("data", "stats", db, "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["structures"] == 6 and stats["labels"]["forces"] == 6
    assert invoke("data", "convert", db, tmp_path / "db.zarr").exit_code == 0
    assert len(AtomicDataZarrReader(str(tmp_path / "db.zarr"))) == 6
