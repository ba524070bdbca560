"""Exact resume for every loader people shuffle with, at every kill point (bitwise on CPU).

Loader kinds: torch ``DataLoader(shuffle=True)`` without and with an explicit
``generator``, ``RandomSampler(generator=...)``, a seeded ``DistributedSampler`` and our
``DataLoader``; each with 0 and 2 worker processes. A tiny PaiNN trains 3 epochs of 4
batches with AdamW + StepLR.

* Every kill point: the reference run checkpoints after every step (including the epoch
  boundaries); a fresh forked process resumes from each of those checkpoints in turn and
  must reproduce the reference's remaining losses and final weights bit for bit.
* Real kills: a run checkpointing every 3 steps is SIGKILLed at a random step and resumed
  in a new process.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
from _resume_support import ForkServer, _assert_same_final, _losses, _text, _wait_for

from nvalchemi.training.checkpoint import CheckpointManifest

KINDS = ("shuffle", "generator", "random_sampler", "distributed", "ours")
SEED = int(os.environ.get("NVALCHEMI_RESUME_TEST_SEED", "20240531"))


@pytest.fixture(scope="module")
def server():
    srv = ForkServer()
    yield srv
    srv.close()


def _job(tmp: Path, kind: str, workers: int, mode: str, name: str, **extra) -> dict:
    return {
        "loader": kind,
        "workers": workers,
        "mode": mode,
        "root": str(tmp / f"{name}-ckpt"),
        "loss_file": str(tmp / f"{name}.loss"),
        "final_file": str(tmp / f"{name}.final.pt"),
        **extra,
    }


@pytest.fixture(scope="module")
def references(server, tmp_path_factory):
    """One uninterrupted run per loader kind and worker count, checkpointed at every step."""
    out = {}
    for kind in KINDS:
        for workers in (0, 2):
            tmp = tmp_path_factory.mktemp(f"{kind}-{workers}")
            job = _job(tmp, kind, workers, "reference", "ref")
            assert server.run(job, tmp / "ref.log") == 0, _text(tmp / "ref.log")
            assert len(_losses(Path(job["loss_file"]))) == 12
            out[kind, workers] = (tmp, job)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_resume_from_every_checkpoint_is_bitwise_identical(server, references, kind, workers):
    tmp, job = references[kind, workers]
    (tmp / "scratch").mkdir(exist_ok=True)
    check = {
        **job,
        "mode": "resume_all",
        "scratch": str(tmp / "scratch"),
        "result_file": str(tmp / "resume_all.json"),
    }
    assert server.run(check, tmp / "resume_all.log") == 0, _text(tmp / "resume_all.log")
    results = json.loads(Path(check["result_file"]).read_text())
    assert [r["step"] for r in results] == list(range(1, 13))
    assert {r["epoch_step"] for r in results} >= {0, 1, 2, 3}  # boundaries and mid-epoch
    wrong = [r for r in results if not (r["losses"] and r["final"])]
    assert not wrong, f"{kind} with {workers} workers diverged after resuming from {wrong}"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_sigkill_then_resume_matches_the_uninterrupted_run(
    server, references, tmp_path, kind, workers
):
    _, reference = references[kind, workers]
    ref_losses = _losses(Path(reference["loss_file"]))
    kill_at = random.Random(f"{SEED}-{kind}-{workers}").randint(4, 11)
    first = _job(tmp_path, kind, workers, "train", "run", pause_at_step=kill_at)
    pid = server.start(first, tmp_path / "first.log")
    _wait_for(lambda: Path(first["loss_file"] + ".paused").exists(), timeout=120)
    os.kill(pid, signal.SIGKILL)
    assert server.wait(pid) == -signal.SIGKILL
    resumed_from = CheckpointManifest.read(Path(first["root"])).entry("latest").step_count
    assert resumed_from == (kill_at - 1) // 3 * 3  # a due save is written at the next batch
    second = {
        **first,
        "mode": "resume",
        "pause_at_step": None,
        "loss_file": str(tmp_path / "second.loss"),
        "final_file": str(tmp_path / "second.pt"),
    }
    assert server.run(second, tmp_path / "second.log") == 0, _text(tmp_path / "second.log")
    assert _losses(Path(first["loss_file"])) == ref_losses[:kill_at]
    after = _losses(Path(second["loss_file"]))
    assert after[0][0] == resumed_from + 1
    assert ref_losses[:resumed_from] + after == ref_losses, f"kill at {kill_at} (seed {SEED})"
    _assert_same_final(Path(reference["final_file"]), Path(second["final_file"]))
