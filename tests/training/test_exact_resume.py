"""Killed, crashed and preempted training processes resume exactly (bitwise on CPU).

Real processes: ``_resume_worker.py serve`` is a fork server that imports torch once;
each training run is a forked child that this test kills with SIGKILL or SIGTERM.
A run trains a tiny PaiNN with shuffling, EMA, StepLR, validation and checkpoints; its
per-step losses (as ``float.hex``) and final weights are compared with an
uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from _resume_support import ForkServer, _assert_same_final, _job, _losses, _text, _wait_for

from nvalchemi.training.checkpoint import CheckpointManifest, load_checkpoint

SEED = int(os.environ.get("NVALCHEMI_RESUME_TEST_SEED", "20240531"))


@pytest.fixture(scope="module")
def server():
    srv = ForkServer()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def references(server, tmp_path_factory):
    """Uninterrupted runs: ``{mode: (losses, final weights file)}``."""
    out = {}
    for mode in ("steps", "epochs"):
        tmp = tmp_path_factory.mktemp(f"reference-{mode}")
        job = _job(tmp, "ref", mode)
        assert server.run(job, tmp / "ref.log") == 0, _text(tmp / "ref.log")
        out[mode] = (_losses(Path(job["loss_file"])), Path(job["final_file"]))
    assert len(out["steps"][0]) == 14 and len(out["epochs"][0]) == 12
    return out


def _latest_step(root: Path) -> int:
    manifest = CheckpointManifest.read(root)
    return manifest.entry("latest").step_count


@pytest.mark.parametrize("mode", ["steps", "epochs"])
def test_sigkill_at_random_step_then_resume_matches_uninterrupted_run(
    server, references, tmp_path, mode
):
    ref_losses, ref_final = references[mode]
    rng = random.Random(f"{SEED}-{mode}")
    first_checkpoint = 4 if mode == "steps" else 5  # saved when that step begins
    kill_at = rng.randint(first_checkpoint, len(ref_losses) - 1)
    first = _job(tmp_path, "first", mode, pause_at_step=kill_at)
    pid = server.start(first, tmp_path / "first.log")
    paused = Path(first["loss_file"] + ".paused")
    _wait_for(lambda: paused.exists(), timeout=120)
    os.kill(pid, signal.SIGKILL)
    assert server.wait(pid) == -signal.SIGKILL

    resume_from = _latest_step(tmp_path / "ckpt")
    assert 0 < resume_from <= kill_at, (kill_at, resume_from)
    second = _job(tmp_path, "second", mode, resume=True)
    assert server.run(second, tmp_path / "second.log") == 0, _text(tmp_path / "second.log")

    before = [x for x in _losses(Path(first["loss_file"])) if x[0] <= resume_from]
    after = _losses(Path(second["loss_file"]))
    assert after[0][0] == resume_from + 1, f"kill at {kill_at} (seed {SEED})"
    assert before + after == ref_losses, f"kill at {kill_at} (seed {SEED})"
    assert _losses(Path(first["loss_file"])) == ref_losses[:kill_at]
    _assert_same_final(ref_final, Path(second["final_file"]))


def test_kills_inside_saves_always_leave_the_previous_checkpoint_loadable(
    server, references, tmp_path
):
    ref_losses, ref_final = references["steps"]
    rng = random.Random(f"{SEED}-saves")
    folder = tmp_path / "ckpt" / "checkpoints"
    seen: dict[int, str] = {}
    kills = 0
    for attempt in range(3):
        job = _job(tmp_path, f"run{attempt}", "steps", resume=True, slow_writes=0.02)
        pid = server.start(job, tmp_path / f"run{attempt}.log")
        finished = Path(job["final_file"])

        def saving(finished: Path = finished) -> bool:
            if finished.exists():  # a slow machine let an earlier attempt get near the end
                return True
            return folder.is_dir() and any(p.name.startswith(".tmp-") for p in folder.iterdir())

        _wait_for(saving, timeout=120, poll=0.001)
        if finished.exists():
            assert server.wait(pid) == 0, _text(tmp_path / f"run{attempt}.log")
            break
        time.sleep(rng.uniform(0.0, 0.3))  # a save writes ~12 files with 20 ms pauses
        os.kill(pid, signal.SIGKILL)
        status = server.wait(pid)
        assert status in (-signal.SIGKILL, 0)  # 0: it ended before the signal came
        kills += status == -signal.SIGKILL
        for step, value in _losses(Path(job["loss_file"])):
            assert value == dict(ref_losses)[step], f"step {step} of attempt {attempt}"
            seen[step] = value
        if (tmp_path / "ckpt" / "manifest.json").exists():
            loaded = load_checkpoint(tmp_path / "ckpt", map_location="cpu")
            entry = loaded["manifest"].entry("latest")
            assert loaded["strategy"].step_count == entry.step_count
            for item in entry.files:
                assert (tmp_path / "ckpt" / entry.path / item).is_file()
    assert kills >= 1  # at least one kill landed while a checkpoint was being written
    final = _job(tmp_path, "final", "steps", resume=True)
    assert server.run(final, tmp_path / "final.log") == 0, _text(tmp_path / "final.log")
    for step, value in _losses(Path(final["loss_file"])):
        assert value == dict(ref_losses)[step]
    _assert_same_final(ref_final, Path(final["final_file"]))
    for entry in CheckpointManifest.read(tmp_path / "ckpt").checkpoints:
        for item in entry.files:  # every listed checkpoint is complete
            assert (tmp_path / "ckpt" / entry.path / item).is_file()


def test_sigterm_checkpoints_exits_75_and_resumes_exactly(server, references, tmp_path):
    from nvalchemi.training.preemption import PREEMPTION_EXIT_CODE

    ref_losses, ref_final = references["steps"]
    first = _job(tmp_path, "first", "steps", preempt=True, step_delay=0.05)
    pid = server.start(first, tmp_path / "first.log")
    _wait_for(lambda: len(_losses(Path(first["loss_file"]))) >= 5, timeout=120)
    os.kill(pid, signal.SIGTERM)
    assert server.wait(pid) == PREEMPTION_EXIT_CODE == 75, _text(tmp_path / "first.log")

    written = _losses(Path(first["loss_file"]))
    stopped_at = written[-1][0]
    assert stopped_at < len(ref_losses)
    assert _latest_step(tmp_path / "ckpt") == stopped_at  # the step it stopped after
    second = _job(tmp_path, "second", "steps", resume=True)
    assert server.run(second, tmp_path / "second.log") == 0, _text(tmp_path / "second.log")
    assert written + _losses(Path(second["loss_file"])) == ref_losses
    _assert_same_final(ref_final, Path(second["final_file"]))
