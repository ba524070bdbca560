"""Run test code in other processes: N gloo ranks, torchrun, or one plain script.

Parent side (in a test)::

    from _ranks import run_ranks

    results = run_ranks(Path(__file__).with_name("_my_ranks.py"), args=[str(tmp_path)])
    results[0]["loss"], results[1]["loss"]

Child side (the rank script)::

    from _ranks import init_group, report, teardown

    rank = init_group()          # gloo, from what run_ranks put in the environment
    ...
    report(rank=rank, loss=1.0)  # one ``RESULT {json}`` line
    teardown()                   # barrier, then destroy the group

``rendezvous="file"`` (the default) meets through a file in a fresh temporary
directory: no TCP port to race for when tests run side by side. ``"tcp"`` sets the
torchrun variables (``MASTER_ADDR``/``MASTER_PORT`` on a free port) for tests of
env-var launching; ``"none"`` sets no rank variables at all (the caller's ``env``
says everything, e.g. Slurm variables).

Importable as ``_ranks`` from tests and from the processes started here
(``pythonpath`` in pyproject.toml; :func:`clean_env` sets ``PYTHONPATH``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Mirrors [tool.pytest.ini_options] pythonpath: what the processes started here import from.
IMPORT_PATHS = [REPO_ROOT] + [
    REPO_ROOT / "tests" / area for area in ("", "training", "hooks", "distributed")
]
INIT_METHOD_VAR = "NVALCHEMI_TEST_INIT_METHOD"
_RESULT = "RESULT "
_TAIL = 8000
_LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "NVALCHEMI_DIST_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"}
_LAUNCHER_NAMES |= {"MASTER_PORT", INIT_METHOD_VAR}

Env = Mapping[str, str] | Callable[[int], Mapping[str, str]] | None


# --------------------------------------------------------------------------- parent side
def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (only for env-var launch tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(extra: Mapping[str, str] | None = None, *, cpu_only: bool = True) -> dict[str, str]:
    """This environment without launcher variables, one thread (no GPU), plus ``extra``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCHER_NAMES and not key.startswith(_LAUNCHER_PREFIXES)
    }
    paths = [str(p) for p in IMPORT_PATHS] + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a hung rank prints its stacks when aborted
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the rank tests exercise gloo on CPU
    env.update(extra or {})
    return env


def _command(target: str | Path, args: Sequence[str]) -> list[str]:
    """``python script args`` for a path, ``python -c code args`` for source text."""
    if isinstance(target, Path):
        return [sys.executable, str(target), *map(str, args)]
    return [sys.executable, "-c", target, *map(str, args)]


def _tails(outputs: Mapping[int, str]) -> str:
    return "\n".join(
        f"----- rank {rank} output (tail):\n{text[-_TAIL:]}" for rank, text in outputs.items()
    )


def run_ranks(
    target: str | Path,
    world_size: int = 2,
    *,
    args: Sequence[str] = (),
    env: Env = None,
    timeout: float = 120.0,
    rendezvous: str = "file",
    wait_for: Sequence[int] | None = None,
) -> list[dict]:
    """Run ``target`` (a script path, or Python source) as ``world_size`` ranks.

    Returns each waited-for rank's last ``RESULT {json}`` line, in rank order.
    ``env`` adds variables (a mapping, or ``rank -> mapping``). ``wait_for`` (default:
    every rank) names the ranks whose results matter; the others are killed once
    those have finished. Fails with every rank's output tail if a waited-for rank
    hangs past ``timeout`` seconds, exits non-zero or reports nothing.
    """
    if rendezvous not in ("file", "tcp", "none"):
        raise ValueError(f"rendezvous must be 'file', 'tcp' or 'none'; got {rendezvous!r}")
    wait_for = tuple(range(world_size)) if wait_for is None else tuple(wait_for)
    scratch = tempfile.mkdtemp(prefix="nvalchemi_ranks_")
    shared: dict[str, str] = {}
    if rendezvous == "file":
        shared[INIT_METHOD_VAR] = f"file://{scratch}/rendezvous"
    elif rendezvous == "tcp":
        shared.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))

    def rank_env(rank: int) -> dict[str, str]:
        values = dict(shared)
        if rendezvous != "none":
            values.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        values.update((env(rank) if callable(env) else env) or {})
        return clean_env(values)

    procs = [
        subprocess.Popen(
            _command(target, args),
            env=rank_env(rank),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    outputs: dict[int, str] = {}
    failure = None
    try:
        for rank in wait_for:
            try:
                remaining = max(deadline - time.monotonic(), 0.1)
                outputs[rank], _ = procs[rank].communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                failure = f"rank {rank} did not finish within {timeout} s (hang?)"
                break
    finally:
        hung = [proc for proc in procs if proc.poll() is None]
        if failure is not None:  # every thread's stack (PYTHONFAULTHANDLER) before the kill
            for proc in hung:
                proc.send_signal(signal.SIGABRT)
            for proc in hung:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        for rank, proc in enumerate(procs):
            if proc.poll() is None:
                proc.kill()
            if rank not in outputs:
                outputs[rank] = _drain(proc)
        shutil.rmtree(scratch, ignore_errors=True)
    results = []
    for rank in wait_for if failure is None else ():
        lines = [line for line in outputs[rank].splitlines() if line.startswith(_RESULT)]
        if procs[rank].returncode != 0 or not lines:
            failure = (
                f"rank {rank} exited with {procs[rank].returncode} and {len(lines)} RESULT lines"
            )
            break
        results.append(json.loads(lines[-1][len(_RESULT) :]))
    if failure is not None:
        name = target.name if isinstance(target, Path) else "<code>"
        raise AssertionError(f"{name}: {failure}\n{_tails(outputs)}")
    return results


def _drain(proc: subprocess.Popen) -> str:
    """What a finished or killed process wrote (bounded: a stray grandchild may hold the pipe)."""
    try:
        return proc.communicate(timeout=10)[0] or ""
    except subprocess.TimeoutExpired:
        return "<output not collected>"


def run_torchrun(
    args: Sequence[str], *, cwd: Path, nproc: int = 2, timeout: float = 240.0, env=None
) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone`` with ``nproc`` CPU ranks; must exit 0."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return run_python([*launcher, *args], cwd=cwd, timeout=timeout, env=clean_env(env))


def run_python(
    args: Sequence[str], *, cwd: Path | None = None, timeout: float = 240.0, env=None
) -> subprocess.CompletedProcess:
    """``python args`` (one thread, no launcher variables, ``env`` added); must exit 0."""
    proc = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env=env if env is not None else clean_env(cpu_only=False),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n----- stdout:\n{proc.stdout[-_TAIL:]}"
        f"\n----- stderr:\n{proc.stderr[-_TAIL:]}"
    )
    return proc


# --------------------------------------------------------------------------- child side
def init_group(backend: str = "gloo", **options: object) -> int:
    """Join the process group ``run_ranks`` set up; return this rank.

    ``options`` go to ``torch.distributed.init_process_group`` (e.g. ``timeout``).
    """
    import torch.distributed as dist

    init_method = os.environ.get(INIT_METHOD_VAR, "env://")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, **options
    )
    return rank


def report(**values: object) -> None:
    """Print the one ``RESULT {json}`` line the parent reads."""
    print(_RESULT + json.dumps(values), flush=True)


def teardown() -> None:
    """Barrier, destroy the default group, then leave without interpreter finalisation.

    gloo's worker threads may still hold references to Python tensors; finalising the
    interpreter under them aborts the process (SIGABRT, "terminate called without an
    active exception") now and then on a loaded machine, after the rank reported its
    result. Call it last.
    """
    import gc
    import sys

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
