"""An interrupted ``data convert`` leaves nothing behind (real signals to a real process).

``SIGTERM`` (and ``SIGINT``) stop it cleanly at the next chunk: the partial store is
removed, the output is not created. ``SIGKILL`` cannot be handled: the partial store
stays, marked as the killed process's, and the next conversion in that folder removes it
(and only such leftovers: a running conversion's and unmarked directories stay).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ase.io import read, write

from ._support import TRAIN, VAL

HOLD_MARKER = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, json.dumps({"mark": "nvalchemi data convert", "pid": os.getpid()}).encode())
print("held", flush=True)
time.sleep(120)
"""


def _start_convert(source: Path, output: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    env.pop("NVALCHEMI_DEBUG", None)
    command = [sys.executable, "-m", "nvalchemi.training.cli", "data", "convert"]
    return subprocess.Popen(
        [*command, str(source), str(output), "--chunk-size", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _partial_stores(folder: Path) -> list[Path]:
    return sorted(folder.glob(".converting-*"))


def _wait_until_writing(process: subprocess.Popen, folder: Path) -> Path:
    """The partial store, once it holds samples (the conversion is under way)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        stores = [p for p in _partial_stores(folder) if p.is_dir()]
        if stores and (stores[0] / "meta" / "atoms_ptr").is_dir():
            return stores[0]
        time.sleep(0.05)
    process.kill()
    raise AssertionError("the conversion never started writing")


@pytest.fixture(scope="module")
def long_input(tmp_path_factory) -> Path:
    """600 structures written one per append: many seconds of work to interrupt."""
    path = tmp_path_factory.mktemp("long") / "long.extxyz"
    write(path, read(TRAIN, index=":600"), format="extxyz")
    return path


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_removes_the_partial_store(tmp_path, long_input, signum):
    output = tmp_path / "out.zarr"
    process = _start_convert(long_input, output)
    _wait_until_writing(process, tmp_path)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr
    name = signal.Signals(signum).name
    assert f"Stopped by {name}: {output} was not written" in " ".join(stderr.split())
    assert "Traceback" not in stderr
    assert _partial_stores(tmp_path) == [] and not output.exists()


def test_the_next_convert_removes_what_a_killed_one_left_and_nothing_else(tmp_path, long_input):
    process = _start_convert(long_input, tmp_path / "out.zarr")
    partial = _wait_until_writing(process, tmp_path)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    marker = partial.with_name(partial.name + ".owner")
    assert partial.is_dir() and marker.is_file()  # what SIGKILL leaves
    assert json.loads(marker.read_text())["pid"] == process.pid

    foreign = tmp_path / ".converting-0badcafe-mine.zarr"  # no marker: not provably ours
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    running = tmp_path / ".converting-12345678-busy.zarr"  # a conversion still running
    running.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_MARKER, str(running) + ".owner"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        small = tmp_path / "small.extxyz"
        write(small, read(VAL, index=":3"), format="extxyz")
        result = subprocess.run(
            [sys.executable, "-m", "nvalchemi.training.cli", "data", "convert", small,
             tmp_path / "small.zarr"],
            capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        text = " ".join(result.stderr.split())
        assert f"Removed {partial}, the partial store of a conversion that was killed" in text
        assert not partial.exists() and not marker.exists()
        assert (foreign / "keep.txt").read_text() == "mine"
        assert running.is_dir() and Path(str(running) + ".owner").is_file()
    finally:
        holder.kill()
        holder.wait(timeout=30)
