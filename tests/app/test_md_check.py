"""The MD check: unstable potentials are caught, a physical one passes, and the numbers
reach the JSON, the command line's table and the learning curves."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _reference_models import AttractionOnlyModel, EMTModel
from ase.build import bulk, fcc100
from ase.calculators.emt import EMT
from ase.cluster import Octahedron
from ase.io import write

from nvalchemi.app.md_check import (
    FAILURE_KINDS,
    MDCheckHook,
    MDCheckSettings,
    draw_structures,
    md_check,
    run_md_check,
)
from nvalchemi.data.sources import open_reader

from ._support import invoke, is_png, tiny_job, write_job

ENGINES = [
    pytest.param(
        "torch-sim",
        marks=pytest.mark.skipif(
            not __import__("importlib").util.find_spec("torch_sim"), reason="torch-sim missing"
        ),
    ),
    "ase",
]
QUICK = {"temperatures_K": [600.0], "nvt_ps": 0.1, "nve_ps": 0.2, "check_every": 5}


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """Cu: a bulk cell, a slab periodic in-plane only (pbc T, T, F) and a 13-atom cluster,
    each labelled by its config_type."""
    crystal = bulk("Cu", "fcc", a=3.6, cubic=True)
    slab = fcc100("Cu", (2, 2, 2), vacuum=2.0)
    assert slab.pbc.tolist() == [True, True, False]
    cluster = Octahedron("Cu", length=3, cutoff=1, latticeconstant=3.6)
    for atoms, kind in ((crystal, "bulk"), (slab, "slab"), (cluster, "cluster")):
        atoms.info["config_type"] = kind
        atoms.rattle(0.02, seed=len(atoms))
        atoms.calc = EMT()  # labels, so that evaluate has errors to show
        atoms.get_forces()
    path = tmp_path_factory.mktemp("md") / "cu.extxyz"
    write(path, [crystal, slab, cluster], format="extxyz")
    return path


def _readers(path):
    return [open_reader(path)]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_potential_without_repulsion_fails_every_run_and_says_when(small_data, engine):
    settings = MDCheckSettings(engine=engine, **QUICK)
    result = md_check(AttractionOnlyModel(depth=2.0), _readers(small_data), settings)
    groups = result.by_group()
    assert set(groups) == {"bulk", "slab", "cluster"}
    planned = settings.nvt_ps + settings.nve_ps
    for entry in groups.values():
        assert entry["runs"] == 1 and entry["stable"] == 0
        assert 0 < entry["first_failure_ps"] < planned
        assert entry["nve_drift_meV_per_atom_ps"] is None  # no stable run, no drift
        assert set(entry["failures"]) <= set(FAILURE_KINDS) and sum(entry["failures"].values()) == 1
        assert entry["closest_pair_A"] < result.min_distance  # they fell onto each other
    assert result.scalars()["stable_fraction"] == 0.0


@pytest.mark.parametrize("engine", ENGINES)
def test_emt_stays_physical_with_a_small_nve_drift(small_data, engine):
    result = md_check(EMTModel(), _readers(small_data), MDCheckSettings(engine=engine, **QUICK))
    assert result.engine == engine
    for group, entry in result.by_group().items():
        assert entry["stable"] == entry["runs"] == 1, (group, entry)
        assert entry["first_failure_ps"] is None
        assert entry["nve_drift_meV_per_atom_ps"] < 0.5, (group, entry)
        assert entry["closest_pair_A"] > result.min_distance
    for run in result.runs:  # NVT for 0.1 ps, then NVE continued from where it ended
        assert run.times_ps[-1] == pytest.approx(0.3)
        assert run.times_ps[run.nve_start] == pytest.approx(0.1)
    # Heated towards 600 K from a structure at rest (small cells: large fluctuations).
    assert 350 < np.mean([run.temperatures[1:].mean() for run in result.runs]) < 900


def test_temperatures_are_ases_kinetic_temperature():
    from nvalchemi.app.md_check import MDRun

    atoms = bulk("Cu", cubic=True) * (2, 2, 2)
    atoms.set_momenta(np.random.default_rng(0).normal(size=(len(atoms), 3)))
    run = MDRun("bulk", 0, 300.0, len(atoms))
    run.record(0.0, 0.0, atoms.get_kinetic_energy())
    assert run.temperatures[0] == pytest.approx(atoms.get_temperature(), rel=1e-6)


def test_the_report_holds_the_numbers_per_group_and_the_plot_is_written(small_data, tmp_path):
    settings = MDCheckSettings(engine="ase", temperatures_K=[300, 600], nvt_ps=0.02, nve_ps=0.02)
    result = md_check(EMTModel(), _readers(small_data), settings)
    report = json.loads(json.dumps(result.report()))  # JSON-ready
    assert report["runs"] == 6 and report["stable"] == 6
    assert list(report["groups"]) == ["bulk", "cluster", "slab"]
    for entry in report["groups"].values():
        assert {"runs", "stable", "nve_drift_meV_per_atom_ps", "first_failure_ps"} <= set(entry)
        assert entry["runs"] == 2  # one structure at two temperatures
    assert report["settings"]["temperatures_K"] == [300.0, 600.0]
    assert report["min_distance_bound_A"] == pytest.approx(0.7 * report["data_min_distance_A"])
    pytest.importorskip("matplotlib")
    assert is_png(result.plot(tmp_path / "md.png"))


def test_structures_are_drawn_per_group_with_a_seed(small_data):
    readers = _readers(small_data)
    first = draw_structures(readers, MDCheckSettings(structures_per_group=5))
    assert sorted(first.groups) == ["bulk", "cluster", "slab"]  # at most what a group has
    assert first.data_min_distance == pytest.approx(
        min(np.min(a.get_all_distances(mic=True)[np.triu_indices(len(a), 1)]) for a in first.atoms),
        rel=1e-9,
    )
    small = draw_structures(readers, MDCheckSettings(max_atoms=8))
    assert [len(a) for a in small.atoms] == [4, 13, 8]  # the cluster has none <= 8: smallest


def test_torch_sim_gets_slabs_as_periodic_cells_with_vacuum_and_the_same_energy():
    from nvalchemi.app.md_check import as_fully_periodic

    slab = fcc100("Cu", (2, 2, 3), vacuum=None)  # pbc T, T, F and no third cell vector
    slab.rattle(0.05, seed=3)
    periodic = as_fully_periodic(slab, cutoff=5.0)
    assert periodic.pbc.all() and periodic.cell[2] @ [0, 0, 1] > 5.0 + 6.0
    np.testing.assert_allclose(periodic.cell[:2], slab.cell[:2])
    slab.calc, periodic.calc = EMT(), EMT()
    assert periodic.get_potential_energy() == pytest.approx(slab.get_potential_energy(), 1e-12)


class _RefusesGold(EMTModel):
    def forward(self, data, **kwargs):
        if bool((data["atomic_numbers"] == 79).any()):
            raise ValueError("no gold here")
        return super().forward(data, **kwargs)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_model_error_fails_only_the_structure_that_raised(tmp_path, engine):
    copper, gold = bulk("Cu", cubic=True), bulk("Au", cubic=True)
    copper.info["config_type"], gold.info["config_type"] = "copper", "gold"
    write(tmp_path / "two.extxyz", [copper, gold], format="extxyz")
    settings = MDCheckSettings(engine=engine, temperatures_K=[300], nvt_ps=0.02, nve_ps=0.02)
    result = md_check(_RefusesGold(), _readers(tmp_path / "two.extxyz"), settings)
    groups = result.by_group()
    assert groups["copper"]["stable"] == 1
    assert groups["gold"]["failures"] == {"error": 1} and groups["gold"]["first_failure_ps"] == 0
    assert "no gold here" in result.report()["failed_runs"][0]["reason"]


def test_the_check_leaves_the_models_mode_and_the_random_stream_alone(small_data):
    structures = draw_structures(_readers(small_data), MDCheckSettings())
    model = AttractionOnlyModel().train()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    run_md_check(model, structures, MDCheckSettings(nvt_ps=0.01, nve_ps=0.01))
    assert torch.equal(torch.rand(3), expected)
    assert model.training


def _workflow(model):
    return SimpleNamespace(
        unwrapped_models=lambda: {"main": model}, inference_model=None, devices=["cpu"]
    )


def test_the_hook_checks_every_k_validations_and_adds_its_scalars(small_data):
    from nvalchemi.hooks.reporting import extract_validation_scalars

    settings = {"temperatures_K": [600], "nvt_ps": 0.2, "nve_ps": 0.05}
    hook = MDCheckHook(str(small_data), every_n_validations=2, settings=settings)
    ctx = SimpleNamespace(workflow=_workflow(AttractionOnlyModel(depth=2.0)))
    summaries = []
    for _ in range(4):
        ctx.validation = {"forces_mae": 0.1}
        hook(ctx, SimpleNamespace(name="AFTER_VALIDATION"))
        summaries.append(ctx.validation)
    assert ["md" in s for s in summaries] == [True, False, True, False]  # the 1st and 3rd
    scalars = extract_validation_scalars(summaries[2])
    assert scalars["validation/md/stable_fraction"] == 0.0
    assert 0 < scalars["validation/md/first_failure_ps"] < 0.25
    assert {"validation/md/runs", "validation/md/survival_fraction"} <= set(scalars)
    assert MDCheckHook(str(small_data)).settings == MDCheckSettings().short()
    resumed = MDCheckHook(str(small_data), every_n_validations=2)
    resumed.load_state_dict(hook.state_dict())
    assert resumed.validations == 4


def test_evaluate_md_prints_the_table_and_writes_the_json(trained_run, small_data, tmp_path):
    result = invoke(
        "evaluate",
        trained_run["checkpoints"],
        "--dataset",
        small_data,
        "--md",
        "--md-temperatures",
        "300",
        "--md-nvt-ps",
        "0.01",
        "--md-nve-ps",
        "0.01",
        "--out-dir",
        tmp_path,
        "--json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["md"]
    assert report["settings"]["temperatures_K"] == [300.0]
    text = result.stderr.split("MD check (", 1)[1]  # the table after the error tables
    assert "NVE drift meV/atom/ps" in text and "first failure ps" in text
    for group, entry in report["groups"].items():
        row = next(line for line in text.splitlines() if line.startswith(f"│ {group} "))
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[1:3] == [str(entry["runs"]), str(entry["stable"])]
    if "plots" in json.loads(result.stdout):
        assert is_png(tmp_path / "md_check.png")


def test_bad_md_options_are_named(trained_run, small_data):
    from ._support import assert_user_error

    result = invoke(
        "evaluate",
        trained_run["checkpoints"],
        "--dataset",
        small_data,
        "--md",
        "--md-temperatures",
        "hot",
    )
    assert_user_error(result, "--md-temperatures", fix="--md-temperatures 300,900")
    result = invoke(
        "evaluate",
        trained_run["checkpoints"],
        "--dataset",
        small_data,
        "--md",
        "--md-temperatures",
        "-10",
    )
    assert_user_error(result, "--md-temperatures", "> 0 K")


def test_a_job_runs_the_check_at_the_end_and_the_curves_show_it(tmp_path):
    job = tiny_job(tmp_path, num_steps=4)
    job["validation"] = {"every_n_steps": 2}
    job["evaluation"] = {
        "md": {
            "temperatures_K": [300],
            "nvt_ps": 0.02,
            "nve_ps": 0.02,
            "max_atoms": 16,
            "every_n_validations": 1,
        }
    }
    path = write_job(tmp_path / "job.json", job)
    result = invoke("spec", "run", path, "--no-report")
    assert result.exit_code == 0, result.output
    final = json.loads((tmp_path / "run" / "final_evaluation.json").read_text())
    assert "metrics" in final and final["md"]["runs"] >= 1
    assert "MD check" in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    curve = [r for r in rows if "validation/md/stable_fraction" in r]
    assert [r["step"] for r in curve] == [2, 4]  # the check ran at every validation
    assert all("validation/forces_mae_eV_per_A" in r for r in curve)  # on the validation rows


def test_an_exported_style_potential_runs_the_check_through_torch_sim(small_data):
    pytest.importorskip("torch_sim")
    from nvalchemi.models.export import Potential

    potential = Potential(EMTModel())
    settings = MDCheckSettings(engine="torch-sim", temperatures_K=[300], nvt_ps=0.02, nve_ps=0.02)
    result = md_check(potential, _readers(small_data), settings)
    assert result.scalars()["stable_fraction"] == 1.0
    with pytest.raises(TypeError, match="engine='torch-sim'"):
        md_check(potential, _readers(small_data), settings.model_copy(update={"engine": "ase"}))


def test_the_modules_examples_run():
    import doctest

    import nvalchemi.app.md_check as module

    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.distributed
def test_a_ddp_run_reports_the_checks_curves_and_one_final_check(tmp_path):
    from _ranks import run_torchrun

    job = tiny_job(tmp_path, num_steps=2, structures=16)
    job["validation"] = {"every_n_steps": 1}
    job["evaluation"] = {
        "md": {"temperatures_K": [300], "nvt_ps": 0.01, "nve_ps": 0.01, "every_n_validations": 1}
    }
    path = write_job(tmp_path / "job.json", job)
    args = ["-m", "nvalchemi.training.cli", "spec", "run", path, "--ddp-backend", "gloo"]
    result = run_torchrun(args, cwd=tmp_path)  # exit code 0 is checked by run_torchrun
    assert result.stderr.count("MD check (") == 1  # the final check: rank 0 only
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "validation/md/stable_fraction" in r] == [1, 2]
    final = json.loads((tmp_path / "run" / "final_evaluation.json").read_text())
    assert final["md"]["runs"] >= 1


def test_without_torch_sim_auto_uses_ase_and_asking_for_it_names_the_extra(small_data, monkeypatch):
    import sys

    from nvalchemi._optional import OptionalDependencyError

    monkeypatch.setitem(sys.modules, "torch_sim", None)  # as if it were not installed
    settings = MDCheckSettings(temperatures_K=[300], nvt_ps=0.01, nve_ps=0.01)
    assert md_check(EMTModel(), _readers(small_data), settings).engine == "ase"
    with pytest.raises(OptionalDependencyError, match=r"nvalchemi-training\[md\]"):
        md_check(
            EMTModel(), _readers(small_data), settings.model_copy(update={"engine": "torch-sim"})
        )
