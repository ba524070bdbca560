"""Weights and balanced sampling in job files: ``config_type_weights``, ``dataset.balance``."""

from __future__ import annotations

import json

import pytest
from ase.build import bulk, fcc111
from ase.calculators.emt import EMT
from ase.io import write

from ._support import TRAIN, assert_user_error, invoke, tiny_job, write_job


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """12 bulk cells and 4 slabs (one with config_weight 2), EMT labels."""
    out = tmp_path_factory.mktemp("mixed") / "mixed.extxyz"
    frames = []
    for i in range(16):
        if i % 4 == 3:
            atoms = fcc111("Cu", (2, 2, 2), vacuum=4.0)
            atoms.info.clear()
            atoms.info["config_type"] = "slab"
        else:
            atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
            atoms.info["config_type"] = "bulk"
        atoms.rattle(0.05, seed=i)
        atoms.calc = EMT()
        atoms.get_potential_energy()
        if i == 3:
            atoms.info["config_weight"] = 2.0
        frames.append(atoms)
    write(out, frames)
    return out


def _job(tmp_path, data, **dataset):
    job = tiny_job(tmp_path)
    job["dataset"].pop("paths", None)
    job["dataset"].update(path=str(data), **dataset)
    return write_job(tmp_path / "job.json", job)


def test_a_job_with_type_weights_and_balanced_groups_runs(tmp_path, mixed):
    job = _job(tmp_path, mixed, config_type_weights={"slab": 3.0}, balance={"alpha": 0.0})
    result = invoke("spec", "run", job, "--no-report")
    assert result.exit_code == 0, result.output
    assert "balanced sampling by config_type (alpha 0)" in result.stderr
    # the 12 training structures of the split hold 2 slabs: half the draws
    assert "slab 2->6, bulk 10->6" in result.stderr


def test_balance_packs_budget_batches_too(tmp_path, mixed):
    job = _job(tmp_path, mixed, balance=True, max_atoms=40, batch_size=8)
    result = invoke("spec", "run", job, "--no-report")
    assert result.exit_code == 0, result.output
    assert "balanced sampling by config_type (alpha 0.5)" in result.stderr


def test_weights_and_groups_that_cannot_apply_are_refused(tmp_path, mixed):
    job = _job(tmp_path, mixed, config_type_weights={"slab": -1.0})
    assert_user_error(invoke("spec", "run", job), "config_type_weights", "-1")
    job = _job(tmp_path, mixed, balance={"group_by": "family"})
    assert_user_error(
        invoke("spec", "run", job, "--no-report"),
        "dataset.balance.group_by",
        "'family'",
        fix="data stats",
    )
    store = tmp_path / "mixed.zarr"
    assert invoke("data", "convert", mixed, store).exit_code == 0
    job = _job(tmp_path, store, config_type_weights={"slab": 3.0})
    assert_user_error(
        invoke("spec", "run", job, "--no-report"), "zarr store", "config_type_weights"
    )


def test_train_init_leaves_balanced_sampling_off(tmp_path):
    """The measured decision (docs/weights.md): balancing helped the bundled clusters' forces
    by 27 %, short of the 30 % that turns it on by default, so the scaffold leaves it out
    even for data with rare config_types."""
    out = tmp_path / "job.json"
    result = invoke(
        "train", "init", "--dataset", TRAIN, "--output-dir", tmp_path / "run", "--out", out
    )
    assert result.exit_code == 0, result.output
    dataset = json.loads(out.read_text())["dataset"]
    assert "balance" not in dataset and "config_type_weights" not in dataset


def test_optional_blocks_written_as_flags():
    from nvalchemi.app.jobs.spec import BalanceSpec, DatasetSpec, EvaluationSpec, MDCheckSpec

    on = DatasetSpec(path=str(TRAIN), balance=True)
    assert on.balance == BalanceSpec() and on.balance.alpha == 0.5
    assert DatasetSpec(path=str(TRAIN), balance=False).balance is None
    assert DatasetSpec(path=str(TRAIN), balance={"alpha": 0}).balance.alpha == 0
    assert EvaluationSpec(md=True).md == MDCheckSpec()
    assert EvaluationSpec(md=False).md is None
