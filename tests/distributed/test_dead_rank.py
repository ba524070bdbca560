"""A rank killed with ``SIGKILL``: the others name it as dead, not "every rank is alive".

Real processes: two gloo ranks launched by environment variables, ``all_reduce`` in a
loop; rank 1 is killed; rank 0's failed collective carries the note.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from _ranks import clean_env, free_port

pytestmark = pytest.mark.distributed

_RANK = """
import os, sys, time
from pathlib import Path
import torch
from nvalchemi.distributed import DistributedManager, all_reduce
DistributedManager.initialize(backend="gloo", timeout_s=10)  # heartbeats every second
rank = DistributedManager().rank
Path(sys.argv[1], f"ready.{rank}").write_text(str(os.getpid()))
try:
    while True:  # training steps
        all_reduce(torch.ones(1))
        time.sleep(0.01)
except RuntimeError as exc:
    print("NOTE", *getattr(exc, "__notes__", []), flush=True)
    os._exit(3)
"""


def test_a_sigkilled_rank_is_named_as_dead(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(tmp_path)],
                env=clean_env(env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        deadline = time.monotonic() + 240  # generous: a shared machine
        ready = [tmp_path / f"ready.{rank}" for rank in range(2)]
        while not all(path.is_file() for path in ready):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
        os.kill(procs[1].pid, signal.SIGKILL)
        output = procs[0].communicate(timeout=240)[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert procs[0].returncode == 3, output
    note = next(line for line in output.splitlines() if line.startswith("NOTE"))
    assert "all_reduce() failed on rank 0 of 2" in note, note
    assert "rank 1 (last heartbeat" in note and "died" in note, note
    assert "alive" not in note, note
