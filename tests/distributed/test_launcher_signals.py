"""``python -m nvalchemi.distributed.torchrun`` under a scheduler's signals: real processes.

Slurm's ``#SBATCH --signal=USR1@180`` (and ``scancel``'s ``SIGTERM``) reach every task of
the job step, i.e. the launcher. The launcher passes them on to its workers, which
checkpoint and exit with 75; the launcher then exits with 75 too, and leaves no worker
behind. Each test sends the signal to the launcher's process only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _ranks import clean_env, free_port
from app._support import tiny_job, write_job

from nvalchemi.distributed.torchrun import PREEMPTED, worker_pids

pytestmark = pytest.mark.distributed

LAUNCHER = [sys.executable, "-m", "nvalchemi.distributed.torchrun"]
WAIT_S = 240  # generous: the machine may be shared by other test runs


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    """The launcher; its output (and its workers') goes to ``cwd/launcher.log``."""
    with open(cwd / "launcher.log", "w") as log:  # a file: an orphan would hold a pipe open
        return subprocess.Popen(
            [*LAUNCHER, *args],
            cwd=cwd,
            env=clean_env({"COLUMNS": "200"}),
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _wait_until(condition, launcher: subprocess.Popen, cwd: Path, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return
        if launcher.poll() is not None:
            break
        time.sleep(0.1)
    launcher.kill()
    launcher.wait()
    log = (cwd / "launcher.log").read_text()[-4000:]
    raise AssertionError(f"{what}: never happened (launcher: {launcher.returncode})\n{log}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _finish(launcher: subprocess.Popen, workers: list[int], cwd: Path) -> tuple[int, str]:
    """The launcher's exit status and output; no worker may outlive it (they are killed)."""
    try:
        launcher.wait(timeout=WAIT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        orphans = [pid for pid in workers if _alive(pid)]
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
    output = (cwd / "launcher.log").read_text()
    assert not orphans, f"workers {orphans} outlived the launcher (orphans)\n{output[-4000:]}"
    return launcher.returncode, output


@pytest.mark.slow
def test_sigusr1_to_the_launcher_checkpoints_the_cli_run_and_exits_75(tmp_path):
    job = tiny_job(tmp_path, num_steps=100_000, structures=16, checkpoint_every=1000)
    job["output"]["plots"] = False
    path = write_job(tmp_path / "job.json", job)
    args = ["--standalone", "--nproc_per_node=2", "-m", "nvalchemi.training.cli"]
    launcher = _start(
        [*args, "spec", "run", str(path), "--no-report", "--ddp-backend", "gloo"], tmp_path
    )
    metrics = tmp_path / "run" / "metrics.jsonl"

    def training() -> bool:
        return metrics.is_file() and len(metrics.read_text().splitlines()) >= 3

    _wait_until(training, launcher, tmp_path, "training under the launcher")
    workers = worker_pids(launcher.pid)
    assert len(workers) == 2, workers
    launcher.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=USR1@180` does to the step
    code, output = _finish(launcher, workers, tmp_path)

    assert code == PREEMPTED == 75, output[-4000:]
    assert "passed it on to the workers" in output and "job can requeue" in output
    # the run stopped at a checkpoint: `spec resume` continues from its last step
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    last_step = max(row["step"] for row in rows if row["kind"] == "train")
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "manifest.json").read_text())
    assert manifest["checkpoints"][-1]["step_count"] == last_step, manifest["checkpoints"]


_PREEMPTIBLE_WORKER = """
import os, signal, sys, time
from nvalchemi.distributed import DistributedManager, all_agree, barrier
DistributedManager.initialize(backend="gloo", timeout_s=120)
received = []
signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
with open(sys.argv[1] + f".{DistributedManager().rank}", "w") as ready:
    ready.write(str(os.getpid()))
while not all_agree(bool(received)):  # a training step, then the ranks' agreement
    time.sleep(0.05)
open(sys.argv[1] + f".saved{DistributedManager().rank}", "w").close()  # the checkpoint
barrier()
sys.exit(75)
"""


def test_sigterm_to_the_launcher_reaches_the_workers_and_their_75_comes_back(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_PREEMPTIBLE_WORKER)
    mark = tmp_path / "mark"
    launcher = _start(["--standalone", "--nproc_per_node=2", str(script), str(mark)], tmp_path)
    marks = [Path(f"{mark}.{rank}") for rank in range(2)]

    def started() -> bool:
        return all(m.is_file() and m.read_text() for m in marks)

    _wait_until(started, launcher, tmp_path, "workers")
    workers = [int(m.read_text()) for m in marks]
    assert sorted(workers) == sorted(worker_pids(launcher.pid))
    launcher.send_signal(signal.SIGTERM)
    code, output = _finish(launcher, workers, tmp_path)
    assert code == 75, output[-4000:]  # plain torchrun: 1, after stopping the workers itself
    assert "received SIGTERM; passed it on to the workers" in output
    assert all(Path(f"{mark}.saved{rank}").is_file() for rank in range(2)), output[-4000:]


def test_a_signal_before_the_workers_start_exits_75_with_nothing_to_save(tmp_path):
    port = free_port()
    (tmp_path / "noop.py").write_text("")
    # a second node that never comes: the launcher waits in the rendezvous, no worker yet
    args = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d"]
    args += [f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=never", "noop.py"]
    launcher = _start(args, tmp_path)

    def listening() -> bool:  # the rendezvous store is up: the agent waits for the peer
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    _wait_until(listening, launcher, tmp_path, "the rendezvous")
    launcher.send_signal(signal.SIGUSR1)
    code, output = _finish(launcher, [], tmp_path)
    assert code == 75, output[-4000:]
    assert "while no worker was running: nothing to checkpoint" in output, output[-4000:]
