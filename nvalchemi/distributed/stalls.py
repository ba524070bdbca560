"""Which rank stalled, and in which collective: heartbeats and the message of a failed collective.

A collective that times out tells the waiting ranks only that *somebody* did not
come. So every rank of a process group created by
:class:`~nvalchemi.distributed.DistributedManager` runs a :class:`Heartbeat`: a daemon
thread that posts the time to the group's key-value store every few seconds (one
tiny store write, nothing on the training path). A rank that is stopped
(``SIGSTOP``), swapping, or stuck in a hung device or file-system call stops
posting, and so does a rank that died (killed by ``SIGKILL`` or the out-of-memory
killer, crashed); a rank that is busy elsewhere (another code path, a longer data set)
keeps posting. When a collective fails,
:func:`~nvalchemi.distributed.runtime.explain_collective_failure` watches the heartbeats
for two intervals (:func:`silent_ranks`: a rank that died a moment ago has a recent
heartbeat, but no new one) and adds a note to the exception
(:func:`collective_failure_note`) that names the collective, the silent rank(s) (dead,
when the process group also lost its connection; or says that every rank is alive),
the timeout and what to check.

The note starts with ``nvalchemi:``; the CLI prints it instead of the bare
"Timed out waiting 600000ms for send operation to complete".
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Heartbeat",
    "collective_failure_note",
    "heartbeat_interval",
    "is_collective_failure",
    "silent_ranks",
]

DEFAULT_TIMEOUT_S = 600.0
"""Default bound of every collective (10 minutes; PyTorch's own is 30 minutes for gloo)."""

_KEY = "nvalchemi/heartbeat/"
_FAILURE_TEXTS = (
    "timed out",
    "timeout",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "[gloo",
    "nccl",
)
# Where the training loop says it was (its note), and the collective that runs there.
# The process group lost a peer's connection: that process ended (or closed the group).
_PEER_GONE_TEXTS = ("connection closed by peer", "connection reset by peer", "broken pipe")
_STAGES = (
    ("the backward pass", "the gradient all-reduce of DistributedDataParallel (backward pass)"),
    ("DO_BACKWARD", "the gradient all-reduce of DistributedDataParallel (backward pass)"),
    ("the forward pass", "DistributedDataParallel's forward (buffer broadcast)"),
    ("SETUP", "the setup of DistributedDataParallel (parameter broadcast from rank 0)"),
    ("AFTER_BATCH", "a hook's collective after the step (preemption, time-budget agreement)"),
    ("AFTER_VALIDATION", "a collective after validation"),
    ("validation", "the validation metrics all-reduce"),
    ("non-finite", "the agreement on non-finite losses"),
    ("loading the next batch", "a collective in the dataloader"),
)


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats for a process-group timeout (a tenth of it, 1 to 10 s).

    A rank counts as silent after three missed heartbeats, well inside the timeout.
    """
    return min(10.0, max(1.0, float(timeout_s) / 10.0))


class Heartbeat:
    """A daemon thread posting this rank's time to ``store`` every ``interval`` seconds.

    ``store`` should be a connection of its own (``store.clone()``): it is used from the
    thread only.
    """

    def __init__(self, store: Any, rank: int, world_size: int, interval: float) -> None:
        self.store = store
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.interval = float(interval)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvalchemi-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._post()
        self._thread.start()
        return self

    def _post(self) -> bool:
        try:
            self.store.set(f"{_KEY}{self.rank}", repr(time.time()))
        except Exception:  # the group is being torn down, or the store host is gone
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self._post():
                return

    def stop(self) -> None:
        """Stop posting, and wait for a post in flight (up to one interval).

        A daemon thread still inside a store call when the interpreter exits is killed
        in C++ code, which aborts the process ("terminate called without an active
        exception").
        """
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval)


def silent_ranks(
    store: Any,
    world_size: int,
    interval: float,
    *,
    rank: int | None = None,
    watch_s: float | None = None,
    wait_s: float = 3.0,
) -> dict[int, float | None] | None:
    """``{rank: seconds since its last heartbeat}`` of the ranks that post no new heartbeat.

    Reads every rank's heartbeat, then watches for up to ``watch_s`` seconds (default:
    two intervals and a second) for each to post a new one: a rank that does is alive,
    however recent its previous heartbeat (a rank killed a moment ago has a recent one
    too). The watch ends as soon as every rank but ``rank`` (this one) has posted.
    ``None`` for a rank that never posted; ``None`` overall when the store does not
    answer within ``wait_s`` (it is hosted by rank 0 or the launcher, which may be the
    one that stalled).
    """
    watch_s = 2 * float(interval) + 1.0 if watch_s is None else float(watch_s)
    try:
        reader = store.clone()
        reader.set_timeout(datetime.timedelta(seconds=wait_s))

        def read(r: int) -> float | None:
            key = f"{_KEY}{r}"
            return float(reader.get(key).decode()) if reader.check([key]) else None

        first = {r: read(r) for r in range(world_size) if r != rank}
        quiet = set(first)
        deadline = time.monotonic() + watch_s
        while quiet and time.monotonic() < deadline:
            time.sleep(min(0.2 * interval, max(deadline - time.monotonic(), 0.0)))
            quiet = {r for r in quiet if read(r) in (None, first[r])}
        now = time.time()
        return {r: None if first[r] is None else now - first[r] for r in sorted(quiet)}
    except Exception:
        return None


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a failed collective (a timeout or a lost peer)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(part in text for part in _FAILURE_TEXTS) and (
        "gloo" in text or "nccl" in text or "timed out" in text or "c10d" in text
    )


def _collective_name(exc: BaseException, operation: str | None) -> str:
    if operation:
        return operation
    notes = " ".join(getattr(exc, "__notes__", []) or [])
    for marker, name in _STAGES:
        if marker in notes:
            return name
    return "a collective operation"


def _peer_gone(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(part in text for part in _PEER_GONE_TEXTS)


def _rank_text(silent: dict[int, float | None] | None, rank: int, peer_gone: bool) -> str:
    if silent is None:
        return (
            "the rendezvous store did not answer either, so the rank (or launcher) hosting "
            "it, usually rank 0, is the one that stalled or died"
        )
    others = {r: age for r, age in silent.items() if r != rank}
    if not others:
        if peer_gone:
            return (
                "every other rank is still running (their heartbeats go on), but one closed "
                "its connection: it left the process group (an error on that rank, or it "
                "finished early); check the logs of the others"
            )
        return (
            "every other rank is alive (their heartbeats go on), so at least one of them "
            "is busy elsewhere instead of joining: a rank-dependent code path, an extra batch, "
            "or a slow step on one rank (e.g. rank-0-only work)"
        )
    if peer_gone:
        dead = ", ".join(
            f"rank {r} (never posted)"
            if age is None
            else f"rank {r} (last heartbeat {age:.0f} s ago)"
            for r, age in sorted(others.items())
        )
        return (
            f"{dead} died: the process group lost its connection and no heartbeat came since "
            "(killed: out of memory, SIGKILL, a lost node; or crashed); check its log and its node"
        )
    names = ", ".join(
        f"rank {r} (never)" if age is None else f"rank {r} ({age:.0f} s ago)"
        for r, age in sorted(others.items())
    )
    return (
        f"no heartbeat from {names}: stalled (stopped, swapping, a hung GPU or file system) or "
        "dead; check its log and its node"
    )


def collective_failure_note(
    exc: BaseException,
    *,
    operation: str | None,
    rank: int,
    world_size: int,
    timeout_s: float | None,
    heartbeat: Heartbeat | None,
    timeout_env: str,
) -> str:
    """The ``nvalchemi:`` note for a failed collective: which one, which rank(s), the bound."""
    if heartbeat is None:  # a group made elsewhere: no heartbeats to read
        who = "another rank most likely exited, crashed or stalled; check the logs of the others"
    else:
        silent = silent_ranks(heartbeat.store, world_size, heartbeat.interval, rank=rank)
        who = _rank_text(silent, rank, _peer_gone(exc))
    timeout = f"{timeout_s:g} s" if timeout_s else "the process-group timeout"
    return (
        f"nvalchemi: {_collective_name(exc, operation)} failed on rank {rank} of {world_size} "
        f"(each collective waits at most {timeout}): {who}. "
        f"The bound is --dist-timeout in the CLI, distributed.timeout_s in a job file, "
        f"DistributedManager.initialize(timeout_s=...) or {timeout_env} (default "
        f"{DEFAULT_TIMEOUT_S:g} s); raise it only for legitimately long pauses."
    )
