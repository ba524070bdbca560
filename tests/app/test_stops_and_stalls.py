"""Runs that are stopped or stall: real processes and real signals.

* ``SIGTERM`` while a run is set up: a message that nothing needs resuming, exit 75;
* a rank stopped with ``SIGSTOP``: the other names it, and the collective, within the
  timeout (``--dist-timeout`` / ``distributed.timeout_s``) plus a few seconds;
* preemption under torchrun: ``python -m nvalchemi.distributed.torchrun`` keeps the
  workers' exit status 75, which plain torchrun turns into 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _ranks import clean_env, free_port

from nvalchemi.distributed.manager import _resolve_timeout
from nvalchemi.distributed.stalls import DEFAULT_TIMEOUT_S
from nvalchemi.distributed.torchrun import PREEMPTED
from nvalchemi.training.preemption import PREEMPTION_EXIT_CODE

from ._support import tiny_job, write_job

CLI = [sys.executable, "-m", "nvalchemi.training.cli"]


def _wait_for_rows(path: Path, rows: int, procs: list[subprocess.Popen], limit: float = 180):
    """Wait until ``path`` (metrics.jsonl) has ``rows`` lines: training is under way."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= rows:
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    raise AssertionError(f"training did not start: {[p.poll() for p in procs]}")


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=30)


def test_the_default_collective_timeout_is_bounded_and_documented(monkeypatch):
    monkeypatch.delenv("NVALCHEMI_DIST_TIMEOUT_S", raising=False)
    assert _resolve_timeout(None).total_seconds() == DEFAULT_TIMEOUT_S == 600
    monkeypatch.setenv("NVALCHEMI_DIST_TIMEOUT_S", "42")
    assert _resolve_timeout(None).total_seconds() == 42
    assert _resolve_timeout(7).total_seconds() == 7  # the argument wins
    docs = (Path(__file__).parents[2] / "docs" / "distributed.md").read_text()
    assert "600 s" in docs and "--dist-timeout" in docs and "distributed.timeout_s" in docs


def test_sigterm_during_setup_says_nothing_needs_resuming_and_exits_75(tmp_path):
    job = tiny_job(tmp_path, num_steps=5, structures=2000)  # minutes of setup, scaled down
    path = write_job(tmp_path / "job.json", job)
    proc = subprocess.Popen(
        [*CLI, "spec", "run", path, "--no-report"],
        env=clean_env({"COLUMNS": "200"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("data:"):  # printed as the data is being opened
                os.kill(proc.pid, signal.SIGTERM)
                break
        output = proc.stdout.read()
        assert proc.wait(timeout=120) == PREEMPTION_EXIT_CODE == 75, output
    finally:
        _stop_all([proc])
    assert "Stopped by SIGTERM while setting up" in output
    assert "before the first training step" in output and "nothing needs resuming" in output
    assert "Traceback" not in output and "step 1/" not in output
    assert not (tmp_path / "run" / "checkpoints" / "manifest.json").exists()


@pytest.mark.parametrize("command", ["run", "resume"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_while_the_job_is_checked_gets_the_message_too(tmp_path, signum, command):
    """The signal arrives while the job file's own module is imported (job checks), seconds
    before any data is read: the handlers are in place from the command's start."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "nv_stop_on_import.py").write_text(
        "import os\n"
        f"os.kill(os.getpid(), {int(signum)})  # what a scheduler does at the wrong moment\n"
        "from nvalchemi.training import default_training_fn as training_fn\n"
    )
    job = tiny_job(tmp_path, num_steps=2)
    job["imports"] = ["nv_stop_on_import"]
    job["strategy"]["training_fn"] = "nv_stop_on_import.training_fn"
    path = write_job(project / "job.json", job)
    args = ["run", path] if command == "run" else ["resume", tmp_path, "--spec", path]
    proc = subprocess.run(
        [*CLI, "spec", *args, "--no-report"] if command == "run" else [*CLI, "spec", *args],
        env=clean_env({"COLUMNS": "200"}),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    name = signal.Signals(signum).name
    assert proc.returncode == PREEMPTION_EXIT_CODE, (proc.returncode, proc.stderr)
    assert f"Stopped by {name} while setting up" in proc.stderr, proc.stderr
    assert "nothing needs resuming" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.distributed
def test_a_stalled_rank_is_named_with_the_collective_within_the_timeout(tmp_path):
    job = tiny_job(tmp_path, num_steps=100_000, structures=16)
    job["output"]["plots"] = False
    job["distributed"] = {"timeout_s": 30}  # the job file's bound; --dist-timeout wins
    path = write_job(tmp_path / "job.json", job)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "COLUMNS": "400",
        }
        procs.append(
            subprocess.Popen(
                [
                    *CLI,
                    "spec",
                    "run",
                    path,
                    "--no-report",
                    "--ddp-backend",
                    "gloo",
                    "--dist-timeout",
                    "5",
                ],
                env=clean_env(env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        _wait_for_rows(tmp_path / "run" / "metrics.jsonl", 3, procs)
        os.kill(procs[1].pid, signal.SIGSTOP)
        code = procs[0].wait(timeout=120)
        output = procs[0].stdout.read()
    finally:
        _stop_all(procs)
    assert code == 1, output
    # the collective waited 5 s (--dist-timeout, over the job's 30 s): PyTorch's own words
    assert "Timed out waiting 5000ms" in output, output
    message = [line for line in output.splitlines() if line.startswith("Error: ")][-1]
    assert "failed on rank 0 of 2 (each collective waits at most 5 s)" in message, message
    assert "no heartbeat from rank 1" in message and "stalled" in message, message
    assert "all-reduce" in message or "agreement" in message or "collective" in message
    assert "This may be a bug" not in message and "--dist-timeout" in message


# --------------------------------------------------------------------------- requeue on 75
_EXIT_WITH = """
import os, sys, time
from pathlib import Path
from nvalchemi.distributed import DistributedManager, barrier
DistributedManager.initialize(backend="gloo", timeout_s=60)
rank = DistributedManager().rank
Path(f"pid.{rank}").write_text(str(os.getpid()))
barrier()
DistributedManager.cleanup()
codes = [int(code) for code in sys.argv[1:3]]

def running(pid):  # neither gone nor a zombie
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

if codes[rank] == 75 and codes[1 - rank] != 75:
    other = int(Path(f"pid.{1 - rank}").read_text())
    while running(other):  # its error is seen first (torchrun then stops this rank)
        time.sleep(0.05)
sys.exit(codes[rank])
"""


def _launch(
    module: str, script: Path, codes: tuple[int, int], cwd: Path
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            module,
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            *map(str, codes),
        ],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.mark.distributed
def test_the_torchrun_wrapper_keeps_exit_status_75_for_a_requeue_script(tmp_path):
    script = tmp_path / "exit_with.py"
    script.write_text(_EXIT_WITH)
    assert PREEMPTED == PREEMPTION_EXIT_CODE
    plain = _launch("torch.distributed.run", script, (75, 75), tmp_path)
    assert plain.returncode == 1  # what breaks `[ $? -eq 75 ] && scontrol requeue`
    wrapped = _launch("nvalchemi.distributed.torchrun", script, (75, 75), tmp_path)
    assert wrapped.returncode == 75, wrapped.stderr[-2000:]
    assert "exiting with it so the job can requeue" in wrapped.stderr
    failed = _launch("nvalchemi.distributed.torchrun", script, (75, 3), tmp_path)
    assert failed.returncode == 1  # a real failure is not a preemption
    assert _launch("nvalchemi.distributed.torchrun", script, (0, 0), tmp_path).returncode == 0


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(p) for p in text]
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_preemption_under_the_wrapper_checkpoints_and_exits_75(tmp_path):
    job = tiny_job(tmp_path, num_steps=100_000, structures=16, checkpoint_every=1000)
    job["output"]["plots"] = False
    path = write_job(tmp_path / "job.json", job)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nvalchemi.distributed.torchrun",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "nvalchemi.training.cli",
            "spec",
            "run",
            str(path),
            "--no-report",
            "--ddp-backend",
            "gloo",
        ],
        env=clean_env({"COLUMNS": "200"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for_rows(tmp_path / "run" / "metrics.jsonl", 3, [proc])
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        for pid in workers:  # what `#SBATCH --signal=USR1@180` does to the job step
            os.kill(pid, signal.SIGUSR1)
        code = proc.wait(timeout=120)
        output = proc.stdout.read()
    finally:
        _stop_all([proc])
    assert code == 75, output[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "manifest.json").is_file()
