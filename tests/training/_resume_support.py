"""The fork server the crash/resume tests talk to, and helpers to compare runs."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("_resume_worker.py")


class ForkServer:
    """Talks to ``_resume_worker.py serve`` (JSON lines over pipes, with timeouts)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)
        assert self._read(120)["ready"]

    def _read(self, timeout: float) -> dict:
        if not self.selector.select(timeout):
            raise TimeoutError("fork server did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("fork server exited")
        return json.loads(line)

    def _send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def start(self, job: dict, log: Path) -> int:
        self._send({"cmd": "run", "job": job, "log": str(log)})
        return self._read(30)["pid"]

    def wait(self, pid: int, timeout: float = 120, log: Path | None = None) -> int:
        self._send({"cmd": "wait", "pid": pid})
        try:
            return self._read(timeout)["exitcode"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._read(10)
            raise AssertionError(f"training process timed out; log:\n{_text(log)}") from None

    def run(self, job: dict, log: Path) -> int:
        return self.wait(self.start(job, log), log=log)

    def close(self) -> None:
        self.proc.kill()  # idle and holding no files: no need for a slow interpreter exit
        self.proc.wait(timeout=10)


def _text(path: Path | None) -> str:
    return path.read_text() if path is not None and path.exists() else ""


def _job(tmp: Path, name: str, mode: str, **extra) -> dict:
    return {
        "root": str(tmp / "ckpt"),
        "loss_file": str(tmp / f"{name}.loss"),
        "final_file": str(tmp / f"{name}.final.pt"),
        "mode": mode,
        **extra,
    }


def _losses(path: Path) -> list[tuple[int, str]]:
    if not path.exists():
        return []
    return [(int(a), b) for a, b in (line.split() for line in path.read_text().splitlines())]


def _wait_for(predicate, timeout: float = 60.0, poll: float = 0.002) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(poll)


def _bytes_equal(a: dict, b: dict) -> bool:
    """Bitwise equality of two state dicts (NaN entries compare equal to themselves)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and a[k].reshape(-1).view(torch.uint8).equal(b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def _assert_same_final(reference: Path, resumed: Path) -> None:
    ref, res = torch.load(reference, weights_only=True), torch.load(resumed, weights_only=True)
    assert ref.keys() == res.keys()
    for key in ref:
        assert _bytes_equal(ref[key], res[key]), f"final {key} weights differ"
