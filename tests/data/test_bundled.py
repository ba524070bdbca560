"""The bundled EMT data set: shipped files, splits, labels and deterministic regeneration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ase.calculators.calculator import PropertyNotImplementedError
from ase.calculators.emt import EMT

from nvalchemi.data import emt_generator
from nvalchemi.data.bundled import (
    BUNDLED_DIR,
    bundled_split_path,
    bundled_summary,
    load_bundled_atoms,
    regenerate,
)

REPO = Path(__file__).resolve().parents[2]
SPLITS = ("train", "val", "test")


@pytest.fixture(scope="module")
def shipped() -> dict[str, list]:
    return {split: load_bundled_atoms(split) for split in SPLITS}


def _all(shipped: dict[str, list]) -> list:
    return [atoms for split in SPLITS for atoms in shipped[split]]


def test_split_files_exist_in_bundled_dir():
    for split in SPLITS:
        path = bundled_split_path(split)
        assert path.parent == BUNDLED_DIR
        assert path.is_file() and path.stat().st_size > 0


def test_shipped_size_is_a_few_megabytes():
    total = sum(bundled_split_path(s).stat().st_size for s in SPLITS)
    assert total < 8 * 1024**2


def test_splits_are_disjoint_and_have_no_duplicates(shipped):
    hashes = {s: [emt_generator.structure_hash(a) for a in shipped[s]] for s in SPLITS}
    for split in SPLITS:
        assert len(set(hashes[split])) == len(hashes[split]), f"duplicate in {split}"
    assert not set(hashes["train"]) & set(hashes["val"])
    assert not set(hashes["train"]) & set(hashes["test"])
    assert not set(hashes["val"]) & set(hashes["test"])


def test_splits_are_stratified_80_10_10_by_family(shipped):
    counts = emt_generator.family_counts(emt_generator.DEFAULT_NUM_STRUCTURES)
    for family, total in counts.items():
        per_split = {s: sum(a.info["config_type"] == family for a in shipped[s]) for s in SPLITS}
        assert sum(per_split.values()) == total
        assert per_split["val"] == round(0.1 * total)
        assert per_split["test"] == round(0.1 * total)


def test_labels_are_present_finite_and_physical(shipped):
    for atoms in _all(shipped):
        energy = atoms.get_potential_energy()
        forces = atoms.get_forces()
        assert np.isfinite(energy)
        assert forces.shape == (len(atoms), 3) and np.isfinite(forces).all()
        assert -0.5 < energy / len(atoms) < 2.0, atoms.info["structure_id"]
        assert np.linalg.norm(forces, axis=1).max() <= emt_generator.MAX_FORCE
        if atoms.pbc.any():
            stress = atoms.get_stress(voigt=False)
            assert stress.shape == (3, 3) and np.isfinite(stress).all()
            np.testing.assert_allclose(stress, stress.T, atol=1e-12)


def test_every_family_is_in_every_split(shipped):
    for split in SPLITS:
        assert {a.info["config_type"] for a in shipped[split]} == set(emt_generator.FAMILIES)


def test_clusters_are_open_boundary_without_stress(shipped):
    clusters = [a for a in _all(shipped) if a.info["config_type"] == "cluster"]
    assert clusters
    for atoms in clusters:
        assert not atoms.pbc.any()
        assert "stress" not in atoms.calc.results
        with pytest.raises(PropertyNotImplementedError):
            atoms.get_stress()
    others = [a for a in _all(shipped) if a.info["config_type"] != "cluster"]
    assert all("stress" in a.calc.results for a in others)


def test_families_cover_slab_boundaries_and_triclinic_cells(shipped):
    structures = _all(shipped)
    slab_pbc = {
        tuple(bool(p) for p in a.pbc)
        for a in structures
        if a.info["config_type"].startswith("surface")
    }
    assert slab_pbc == {(True, True, False), (True, True, True)}
    shear = [a for a in structures if a.info["config_type"] == "strain_shear"]
    triclinic = [
        a
        for a in shear
        if np.abs(a.cell.angles() - 90.0).min() > 1e-3
        and np.ptp(a.cell.lengths()) > 1e-3
        and len(set(np.round(a.cell.angles(), 3))) == 3
    ]
    assert len(triclinic) >= 0.95 * len(shear)


def test_stress_is_in_ase_sign_convention(shipped):
    compressed = next(
        a
        for a in shipped["train"]
        if a.info["config_type"] == "strain_iso" and a.info["strain"] < -0.03
    )
    stored = compressed.get_stress()
    fresh = compressed.copy()
    fresh.calc = EMT()
    np.testing.assert_allclose(stored, fresh.get_stress(), atol=1e-8)
    # Compressed crystals push outward: negative (compressive) stress in ASE's convention.
    assert stored[:3].mean() < 0
    # Independent of ASE's stress code: sigma_xx = (1/V) dE/d(eps_xx).
    step = 1e-5
    energies = []
    for sign in (1, -1):
        strained = fresh.copy()
        strained.set_cell(
            np.asarray(fresh.cell) @ (np.eye(3) + np.diag([sign * step, 0, 0])), scale_atoms=True
        )
        strained.calc = EMT()
        energies.append(strained.get_potential_energy())
    finite_difference = (energies[0] - energies[1]) / (2 * step) / fresh.get_volume()
    np.testing.assert_allclose(stored[0], finite_difference, rtol=1e-4, atol=1e-7)


def test_shipped_files_match_the_generator(shipped):
    by_id = {a.info["structure_id"]: a for a in _all(shipped)}
    for family in emt_generator.FAMILIES:
        for index in (0, 1):
            made = emt_generator.make_structure(family, index)
            stored = by_id[made.info["structure_id"]]
            np.testing.assert_array_equal(stored.numbers, made.numbers)
            np.testing.assert_allclose(stored.positions, made.positions, atol=1e-7)
            np.testing.assert_allclose(stored.cell[:], made.cell[:], atol=1e-7)
            np.testing.assert_array_equal(stored.pbc, made.pbc)
            assert stored.get_potential_energy() == pytest.approx(
                made.get_potential_energy(), abs=1e-7
            )
            np.testing.assert_allclose(stored.get_forces(), made.get_forces(), atol=1e-6)


def test_regeneration_is_deterministic(tmp_path):
    script = REPO / "scripts" / "generate_emt_dataset.py"
    first, second = tmp_path / "cli", tmp_path / "api"
    run = subprocess.run(
        [sys.executable, str(script), "--out", str(first), "--num-structures", "60"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr
    assert "structures" in run.stdout
    regenerate(second, num_structures=60, progress=None)
    for split in SPLITS:
        assert (first / f"{split}.extxyz").read_bytes() == (second / f"{split}.extxyz").read_bytes()
    loaded = [a for s in SPLITS for a in load_bundled_atoms(s, directory=first)]
    assert len(loaded) == 60
    assert {a.info["config_type"] for a in loaded} == set(emt_generator.FAMILIES)


def test_summary_counts(shipped):
    summary = bundled_summary()
    assert summary["num_structures"] == emt_generator.DEFAULT_NUM_STRUCTURES
    for split in SPLITS:
        assert summary["splits"][split]["structures"] == len(shipped[split])
        assert summary["splits"][split]["atoms"] == sum(len(a) for a in shipped[split])
    counts = emt_generator.family_counts(emt_generator.DEFAULT_NUM_STRUCTURES)
    assert {f: sum(c.values()) for f, c in summary["families"].items()} == counts
    assert summary["elements"] == sorted(emt_generator.ELEMENTS)
    periodic = sum(a.pbc.any() for a in _all(shipped))
    assert summary["labels"] == {
        "energy": summary["num_structures"],
        "forces": summary["num_structures"],
        "stress": periodic,
    }
    low, high = summary["num_atoms_range"]
    assert low == min(len(a) for a in _all(shipped)) and high == max(len(a) for a in _all(shipped))
    assert 0 < summary["max_force"] <= emt_generator.MAX_FORCE


def test_unknown_split_and_missing_files_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="validation"):
        bundled_split_path("validation")
    with pytest.raises(FileNotFoundError, match="regenerate"):
        bundled_split_path("train", directory=tmp_path)


def test_too_few_structures_is_rejected():
    with pytest.raises(ValueError, match="num_structures"):
        emt_generator.family_counts(3)
