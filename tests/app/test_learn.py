"""The active-learning loop: selection, labelling workers, ``learn`` end to end with EMT,
and SIGKILL in every phase then resume (no label lost, none computed twice, the same
final state as an uninterrupted run)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from _ranks import clean_env

from nvalchemi._errors import FieldError
from nvalchemi.app.learn.explore import engine_of, explore
from nvalchemi.app.learn.label import check_labeller, label_structures, labelled_structures
from nvalchemi.app.learn.select import bands, select, uncertainty
from nvalchemi.app.learn.spec import ExploreSpec, LabelSpec, LearnTrainSpec, SelectSpec
from nvalchemi.app.learn.store import LearnStore

from ._support import TEST, TINY_PAINN, TRAIN, VAL, invoke, is_png, tiny_job, write_job

DRIVER = Path(__file__).with_name("_learn_driver.py")


def _data(folder: Path) -> dict[str, Path]:
    """Small labelled files and two 8-atom bulk start structures, from the bundled data."""
    from ase.io import read, write

    folder.mkdir(parents=True, exist_ok=True)
    out = {name: folder / f"{name}.extxyz" for name in ("train", "val", "test", "starts")}
    write(out["train"], read(TRAIN, index=":24"))
    write(out["val"], read(VAL, index=":8"))
    write(out["test"], read(TEST, index=":6"))
    val = read(VAL, index=":")
    starts = [a for a in val if len(a) == 8 and a.info.get("config_type") == "bulk"][:2]
    write(out["starts"], starts)
    return out


def _start_job(tmp: Path, data: dict[str, Path]) -> Path:
    """A tiny committee ``train`` job (2 members, 6 steps) on ``data``."""
    job = tiny_job(tmp, "--committee", "2", num_steps=6)
    main = job["strategy"]["model_specs"]["main"]
    for key in TINY_PAINN:
        main.pop(key)
    main["members"][0].update(TINY_PAINN)
    job["dataset"].update({"path": str(data["train"]), "validation_path": str(data["val"])})
    job["dataset"].pop("val_fraction", None)
    job["dataset"].pop("max_structures", None)
    job.pop("validation", None)
    return write_job(tmp / "start.json", job)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Data files and a trained tiny committee checkpoint, shared (read only)."""
    tmp = tmp_path_factory.mktemp("learn-start")
    data = _data(tmp / "data")
    path = _start_job(tmp, data)
    result = invoke("spec", "run", path, "--no-report")
    assert result.exit_code == 0, result.output
    return {"data": data, "checkpoint": tmp / "run" / "checkpoints"}


def _learn_job(tmp: Path, data: dict[str, Path], start: dict, **changes) -> Path:
    job = {
        "name": "tiny",
        "work_dir": str(tmp / "work"),
        "iterations": 2,
        "imports": ["ase.calculators.emt", "_learn_labeller"],
        "start": {**start, "test": [str(data["test"])]},
        "explore": {
            "structures": [str(data["starts"])],
            "temperatures": [800.0],
            "steps": 12,
            "every": 3,
        },
        "select": {"trust_lo": 1e-6, "trust_hi": 1e6, "max_structures": 3},
        "label": {"calculator": "ase.calculators.emt.EMT", "workers": 2},
        "train": {"steps": 4, "batch_size": 4, "checkpoint_every": 2},
    }
    for block, values in changes.items():
        if isinstance(values, dict) and block in job:
            job[block].update(values)
        else:
            job[block] = values
    path = tmp / "learn.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _from_checkpoint(trained) -> dict:
    data = trained["data"]
    return {
        "checkpoint": str(trained["checkpoint"]),
        "train": [str(data["train"])],
        "validation": [str(data["val"])],
    }


# --------------------------------------------------------------------------- selection
class _Select:
    trust_lo, trust_hi, max_structures, min_distance = 0.1, 0.5, 2, 0.05
    method, score = "deviation", "forces"


def _frames(deviations, rattle=True):
    from ase.build import bulk

    frames = []
    for i, deviation in enumerate(deviations):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        if rattle:
            atoms.rattle(0.1 + 0.05 * i, seed=i)
        atoms.info["max_force_deviation"] = deviation
        frames.append(atoms)
    return frames


def test_select_takes_the_most_uncertain_candidates_between_the_trust_levels():
    frames = _frames([0.05, 0.2, 0.45, 0.3, 0.7, float("nan")])
    chosen, counts = select(frames, _Select(), seed=0)
    assert counts == {"accurate": 1, "candidate": 3, "failed": 2, "selected": 2}
    assert chosen == [2, 3]  # deviations 0.45 and 0.3: the band's top two
    assert bands(frames, _Select()) == {"accurate": 1, "candidate": 3, "failed": 2}


def test_select_skips_near_duplicates_and_random_draws_from_every_frame():
    settings = _Select()
    settings.max_structures = 5
    same = _frames([0.2, 0.3, 0.4], rattle=False)  # one structure three times
    chosen, _ = select(same, settings, seed=0)
    assert chosen == [2]
    settings.method, settings.min_distance = "random", 0.0
    frames = _frames([0.01, 0.2, 0.9, 0.3])
    chosen, _ = select(frames, settings, seed=3)
    assert sorted(chosen) == [0, 1, 2, 3] and chosen == select(frames, settings, seed=3)[0]
    assert chosen != select(frames, settings, seed=4)[0]


def _copper(a=3.6, seed=0, deviation=0.3, energy_std=0.0):
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=a, cubic=True)
    atoms.rattle(0.02, seed=seed)
    atoms.info.update(max_force_deviation=deviation, energy_std=energy_std)
    return atoms


def test_diverse_selection_spreads_its_picks_weighted_by_uncertainty():
    # three frames of one structure (0.009-0.023 apart) and an expanded cell (1.16 away)
    frames = [
        _copper(seed=0, deviation=0.40),
        _copper(seed=1, deviation=0.39),
        _copper(seed=2, deviation=0.38),
        _copper(a=3.9, seed=3, deviation=0.2),
    ]
    settings = _Select()
    settings.min_distance = 0.01
    settings.method = "deviation"
    assert select(frames, settings, seed=0)[0] == [0, 1]  # the two most uncertain
    settings.method = "diverse"
    assert select(frames, settings, seed=0)[0] == [0, 3]  # the most uncertain, then far
    settings.max_structures = 4
    # then the farther of the two left (0.023 x 0.38 > 0.013 x 0.39); frame 1 is within
    # min_distance of frame 2, a near-duplicate
    assert select(frames, settings, seed=0)[0] == [0, 3, 2]
    frames[3].info["max_force_deviation"] = 0.6  # above trust_hi: not a candidate
    assert select(frames, settings, seed=0)[0] == [0, 2]


def test_the_energy_spread_joins_the_score_over_its_median():
    frames = [
        _copper(seed=0, deviation=0.4, energy_std=0.04),
        _copper(a=3.7, seed=1, deviation=0.2, energy_std=0.4),
        _copper(a=3.8, seed=2, deviation=0.3, energy_std=0.08),
    ]
    np.testing.assert_allclose(uncertainty(frames), [0.4, 0.2, 0.3])
    # medians: forces 0.3, energy per atom 0.08 / 4 = 0.02
    np.testing.assert_allclose(
        uncertainty(frames, "forces+energy"), [0.4 / 0.3 + 0.5, 0.2 / 0.3 + 5.0, 1.0 + 1.0]
    )
    settings = _Select()
    settings.max_structures = 1
    assert select(frames, settings, seed=0)[0] == [0]
    settings.score = "forces+energy"
    assert select(frames, settings, seed=0)[0] == [1]
    del frames[2].info["energy_std"]
    with pytest.raises(ValueError, match="frame 2 has no info\\['energy_std'\\]"):
        select(frames, settings, seed=0)


def test_trust_levels_must_be_ordered():
    with pytest.raises(ValueError, match="must exceed"):
        SelectSpec(trust_lo=0.5, trust_hi=0.2)


# --------------------------------------------------------------------------- exploring
ENGINES = [
    "ase",
    pytest.param(
        "torch-sim",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("torch_sim") is None, reason="torch-sim missing"
        ),
    ),
]


def _tiny_committee():
    from nvalchemi.models import PaiNN
    from nvalchemi.models.committee import Committee
    from nvalchemi.spec import create_model_spec

    member = create_model_spec(
        PaiNN, **TINY_PAINN, elements=[29, 79], dtype=torch.float64, atomic_energies=[-3, -3]
    )
    return Committee([member], size=2, seed=3).eval()


def _starts():
    from ase.build import bulk, fcc111

    cu = bulk("Cu", "fcc", a=3.6, cubic=True)
    slab = fcc111("Au", size=(2, 2, 2), vacuum=5.0, a=4.08)
    slab.info = {"config_type": "slab"}
    return [cu, slab]


@pytest.mark.parametrize("engine", ENGINES)
def test_explore_keeps_frames_with_the_committees_deviation_at_them(engine):
    from nvalchemi.models import CommitteeCalculator

    committee, starts = _tiny_committee(), _starts()
    settings = ExploreSpec(structures=[], temperatures=[300, 900], steps=9, every=3, engine=engine)
    select_settings = SelectSpec(trust_lo=1e-6, trust_hi=1e6)
    frames, runs = explore(committee, starts, settings, select_settings, seed=1, iteration=2)
    assert [(r["start"], r["temperature_K"]) for r in runs] == [
        (0, 300.0),
        (0, 900.0),
        (1, 300.0),
        (1, 900.0),
    ]
    assert all(r["ended"] == "steps" and r["frames"] == 3 and r["steps"] == 9 for r in runs)
    assert [(f.info["learn_run"], f.info["learn_step"]) for f in frames] == [
        (run, step) for run in range(4) for step in (3, 6, 9)
    ]
    for frame in frames:  # the recorded deviation is the committee's at the frame
        start = starts[runs[frame.info["learn_run"]]["start"]]
        assert frame.pbc.tolist() == start.pbc.tolist()
        assert np.array_equal(frame.cell.array, start.cell.array)
        assert frame.info.get("config_type") == start.info.get("config_type")
        assert not np.allclose(frame.positions, start.positions)  # it moved
        atoms = frame.copy()
        atoms.calc = CommitteeCalculator(committee)
        expected = atoms.calc.get_property("max_force_deviation", atoms)
        assert frame.info["max_force_deviation"] == pytest.approx(expected, rel=1e-9)
        expected = atoms.calc.get_property("energy_std", atoms)
        assert frame.info["energy_std"] == pytest.approx(expected, rel=1e-6, abs=1e-12)
    again, _ = explore(committee, starts, settings, select_settings, seed=1, iteration=2)
    assert all(np.array_equal(a.positions, b.positions) for a, b in zip(frames, again))
    other, _ = explore(committee, starts, settings, select_settings, seed=1, iteration=3)
    assert not np.array_equal(frames[0].positions, other[0].positions)


@pytest.mark.parametrize("engine", ENGINES)
def test_explore_ends_a_trajectory_at_a_high_deviation_or_a_model_error(engine):
    from ase.build import bulk

    committee = _tiny_committee()
    silver = bulk("Ag", "fcc", a=4.1, cubic=True)  # an element the committee does not know
    starts = [*_starts(), silver]
    settings = ExploreSpec(
        structures=[], temperatures=[600], steps=9, every=3, engine=engine, stop_deviation=1e-9
    )
    select_settings = SelectSpec(trust_lo=1e-6, trust_hi=1e6)
    frames, runs = explore(committee, starts, settings, select_settings, seed=0, iteration=0)
    assert [r["ended"] for r in runs[:2]] == ["deviation", "deviation"]
    assert [r["frames"] for r in runs] == [1, 1, 0] and len(frames) == 2
    assert "Ag" in runs[2]["ended"] and runs[2]["steps"] == 0


def test_each_iteration_explores_the_next_start_structures_of_every_file(tmp_path):
    from types import SimpleNamespace

    from ase.build import bulk
    from ase.io import write

    from nvalchemi.app.learn.loop import start_structures

    files = []
    for name, count in (("a", 5), ("b", 2)):
        files.append(tmp_path / f"{name}.extxyz")
        structures = [bulk("Cu", "fcc", a=3.5 + 0.01 * k) for k in range(count)]
        for k, atoms in enumerate(structures):
            atoms.info["which"] = f"{name}{k}"
        write(files[-1], structures)

    def explored(iteration, per_file):
        explore = SimpleNamespace(structures=[str(f) for f in files], max_structures=per_file)
        job = SimpleNamespace(explore=explore)
        return [a.info["which"] for a in start_structures(job, iteration)]

    assert explored(0, 2) == ["a0", "a1", "b0", "b1"]
    assert explored(1, 2) == ["a2", "a3", "b0", "b1"]
    assert explored(2, 2) == ["a4", "a0", "b0", "b1"]  # in turn, wrapping around
    assert explored(3, None) == ["a0", "a1", "a2", "a3", "a4", "b0", "b1"]  # every one


def test_explore_engine_auto_is_torch_sim_when_installed():
    from nvalchemi._optional import OptionalDependency

    auto = engine_of(ExploreSpec(structures=[]))
    assert auto == ("torch-sim" if OptionalDependency.TORCH_SIM.is_available() else "ase")
    assert engine_of(ExploreSpec(structures=[], engine="ase")) == "ase"


# ---------------------------------------------------------------------------- training
def _learning_rates(settings: LearnTrainSpec) -> list[float]:
    from nvalchemi.app.learn.train import _optimizer

    optimizer, schedule = _optimizer(settings).build([torch.nn.Parameter(torch.zeros(1))])
    rates = []
    for _ in range(settings.steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


def test_the_fine_tune_warms_up_over_its_share_of_the_steps_then_decays():
    cold = _learning_rates(LearnTrainSpec(steps=10, lr=1e-3))
    assert cold[0] == pytest.approx(1e-3) and cold == sorted(cold, reverse=True)
    warm = _learning_rates(LearnTrainSpec(steps=10, lr=1e-3, warmup=0.2))
    assert warm[0] == pytest.approx(5e-5)  # 5 % of lr
    assert max(warm) == pytest.approx(1e-3) and warm.index(max(warm)) == 2  # 0.2 x 10 steps
    assert warm[2:] == sorted(warm[2:], reverse=True) and warm[-1] < 1e-4


# --------------------------------------------------------------------------- labelling
def _label(tmp_path, calculator, structures, workers=2):
    settings = LabelSpec(calculator=calculator, workers=workers)
    paths = {i: tmp_path / "labels" / f"{i}.json" for i in range(len(structures))}
    label_structures(structures, paths.__getitem__, settings, imports=["_learn_labeller"])
    return {i: json.loads(p.read_text()) for i, p in paths.items()}


def test_failed_labels_are_recorded_and_skipped(tmp_path):
    from ase.build import bulk

    structures = [bulk("Cu", "fcc", a=3.6, cubic=True), bulk("Cu", "fcc", a=3.6, cubic=True) * 2]
    records = _label(tmp_path, "_learn_labeller.PickyEMT", structures)
    assert records[0]["error"].startswith("RuntimeError: SCF did not converge")
    assert len(records[1]["forces"]) == 32 and len(records[1]["stress"]) == 6
    labelled, failures = labelled_structures(structures, records)
    assert len(labelled) == 1 and failures == [{"index": 0, "error": records[0]["error"]}]
    assert labelled[0].get_potential_energy() == pytest.approx(records[1]["energy"])


def test_a_worker_that_dies_fails_its_structure_and_a_new_one_goes_on(tmp_path):
    from ase.build import bulk

    cells = [bulk("Cu", "fcc", a=3.6, cubic=True) * 2, bulk("Cu", "fcc", a=3.6, cubic=True)]
    structures = [cells[1], cells[0], cells[1], cells[0]]
    records = _label(tmp_path, "_learn_labeller.CrashingEMT", structures, workers=1)
    assert "died (exit status 3)" in records[0]["error"] and "error" in records[2]
    assert "energy" in records[1] and "energy" in records[3]


def test_the_labeller_must_pass_the_trust_rule():
    with pytest.raises(FieldError, match=r"imports: \[ase.calculators.lj\]"):
        check_labeller("ase.calculators.lj.LennardJones", imports=[])
    with pytest.raises(FieldError, match="cannot import"):
        check_labeller("ase.calculators.emt.NoSuchCalculator", imports=["ase.calculators.emt"])


def test_one_learn_process_per_work_dir(tmp_path):
    with (
        LearnStore(tmp_path).locked(),
        pytest.raises(FieldError, match="another learn process"),
        LearnStore(tmp_path).locked(),
    ):
        pass


# --------------------------------------------------------------------------- end to end
def test_learn_runs_two_iterations_with_emt_from_a_train_job(tmp_path):
    data = _data(tmp_path / "data")
    start = {"job": str(_start_job(tmp_path, data))}
    result = invoke("learn", _learn_job(tmp_path, data, start), "--json")
    assert result.exit_code == 0, result.output
    reports = json.loads(result.stdout)
    work = tmp_path / "work"
    assert [r["iteration"] for r in reports] == [0, 1]
    for report in reports:
        frames = 2 * 4  # two start structures, 12 steps, a frame every 3
        assert sum(report["bands"].values()) == frames
        assert report["selected"] == report["labelled"] == 3 and report["failed"] == 0
        assert report["test"]["forces_mae"] > 0 and "forces" in report["uncertainty"]["overall"]
        assert set(report["seconds"]) == {"explore", "select", "label", "train", "md_check"}
        # the default MD check: short, at 900 K, one structure per group of the test data
        check = report["md_check"]
        assert check["settings"]["temperatures_K"] == [900.0] and check["runs"] >= 1
        assert 0 <= check["stable"] <= check["runs"] and check["groups"]
    explored = json.loads((work / "iterations" / "0000" / "explore.json").read_text())
    assert explored["engine"] == engine_of(ExploreSpec(structures=[]))  # auto
    assert reports[1]["labels"] == reports[0]["labels"] + 3 == 24 + 6
    assert reports[1]["model"].endswith("iterations/0001/checkpoints")
    train = json.loads((work / "iterations" / "0001" / "train.json").read_text())
    assert train["calibration_factors"]["forces"] > 0
    assert is_png(work / "learning_curve.png")
    assert "Active learning: per iteration" in result.stderr and "MD stable" in result.stderr
    # a finished run does nothing more when called again
    again = invoke("learn", tmp_path / "learn.yaml")
    assert again.exit_code == 0, again.output
    assert "done" not in again.stderr.split("Active learning")[0]


# ------------------------------------------------------------------------------ kills
def _start_driver(job: Path, env: dict, pause: str = "", marker: Path | None = None):
    args = [sys.executable, str(DRIVER), str(job)]
    if pause:
        args += [pause, str(marker)]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _run_driver(job: Path, env: dict) -> None:
    process = _start_driver(job, env)
    out, _ = process.communicate(timeout=240)
    assert process.returncode == 0, out.decode()[-4000:]


def _kill_when_paused(process, marker: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if process.poll() is not None:
            raise AssertionError(process.stdout.read().decode()[-4000:])
        assert time.monotonic() < deadline, "the run never reached its pause point"
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    process.stdout.close()
    marker.unlink()


def _final_state(work: Path) -> dict:
    from nvalchemi.training.checkpoint import load_model_from_checkpoint

    iterations = sorted((work / "iterations").iterdir())
    labels = {
        f"{it.name}/{p.name}": json.loads(p.read_text())
        for it in iterations
        for p in sorted((it / "labels").glob("*.json"))
    }
    files = {
        f"{it.name}/{name}": (it / name).read_text()
        for it in iterations
        for name in ("candidates.extxyz", "selected.extxyz", "labelled.extxyz")
    }
    model = load_model_from_checkpoint(iterations[-1] / "checkpoints", use_ema=True)
    reports = json.loads((work / "report.json").read_text())
    for report in reports:
        report.pop("seconds"), report.pop("model")
    return {"labels": labels, "files": files, "state": model.state_dict(), "reports": reports}


@pytest.mark.slow
def test_sigkill_in_every_phase_then_resume_loses_and_repeats_no_label(trained, tmp_path):
    start = _from_checkpoint(trained)
    label = {"calculator": "_learn_labeller.CountingEMT", "workers": 1}
    results = {}
    for name in ("reference", "killed"):
        folder = tmp_path / name
        folder.mkdir()
        # 6 steps, a checkpoint every 2: killed after step 5, the one of step 2 is on disk
        train = {"steps": 6, "checkpoint_every": 2}
        md_check = {"temperatures_K": [900.0], "nvt_ps": 0.02, "nve_ps": 0.02}
        job = _learn_job(
            folder, trained["data"], start, label=label, train=train, md_check=md_check
        )
        calls, marker = folder / "calls.txt", folder / "paused"
        env = clean_env({"LEARN_CALLS": str(calls), "LEARN_MARKER": str(marker)})
        if name == "reference":
            _run_driver(job, env)
        else:
            store = LearnStore(folder / "work")
            for pause, phase in (("0:explore:1", "explore"), ("0:select:0", "select")):
                _kill_when_paused(_start_driver(job, env, pause, marker), marker)
                assert (store.state()["iteration"], store.state()["phase"]) == (0, phase)
            # label: kill while the 5th labelling call (iteration 1's 2nd) is in flight
            process = _start_driver(job, {**env, "LEARN_PAUSE_CALL": "5"})
            _kill_when_paused(process, marker)
            assert (store.state()["iteration"], store.state()["phase"]) == (1, "label")
            stored = sorted((folder / "work" / "iterations" / "0001" / "labels").glob("*.json"))
            assert len(stored) == 1  # the first label of the iteration, nothing of the 2nd
            _kill_when_paused(_start_driver(job, env, "1:train:5", marker), marker)
            assert (store.state()["iteration"], store.state()["phase"]) == (1, "train")
            assert (store.checkpoints(1) / "manifest.json").is_file()  # resumed from it
            _run_driver(job, env)
        lines = calls.read_text().splitlines()
        assert len(lines) == 6  # 3 labels per iteration, each computed exactly once
        assert len(set(lines)) == 6
        results[name] = _final_state(folder / "work")
    reference, killed = results["reference"], results["killed"]
    assert killed["labels"] == reference["labels"]
    assert killed["files"] == reference["files"]
    assert killed["reports"] == reference["reports"]
    torch.testing.assert_close(killed["state"], reference["state"], rtol=0, atol=0, equal_nan=True)
    assert np.isfinite(reference["reports"][-1]["test"]["forces_mae"])
    assert reference["reports"][-1]["md_check"]["runs"] >= 1  # the same MD check, too


def test_the_example_learn_job_and_its_start_job_are_valid():
    from nvalchemi.app.jobs import load_job
    from nvalchemi.app.learn import read_learn_job

    job = read_learn_job(Path(__file__).parents[2] / "examples" / "learn" / "learn.yaml")
    assert Path(job.start.job).is_file() and all(Path(p).is_file() for p in job.start.test)
    assert job.imports == ["ase.calculators.emt"] and job.label.workers == 2
    start, _ = load_job(job.start.job)
    assert start.strategy.model_specs["main"]["size"] == 4
    check_labeller(job.label.calculator, job.imports)


def test_a_bad_learn_job_names_its_fields(tmp_path):
    from nvalchemi.app.learn import read_learn_job

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"work_dir": "w", "start": {}, "explore": {}, "select": {}}))
    with pytest.raises(FieldError) as found:
        read_learn_job(path)
    for field in ("start", "explore.structures", "select.trust_lo", "label"):
        assert field in str(found.value)
