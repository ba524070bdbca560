"""Heartbeats name the silent rank; failed collectives get a note that says which and where."""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from nvalchemi.distributed.stalls import (
    Heartbeat,
    collective_failure_note,
    heartbeat_interval,
    is_collective_failure,
    silent_ranks,
)


def _store():
    return dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False
    )


def test_silent_ranks_are_those_that_post_no_new_heartbeat():
    store = _store()
    beat = Heartbeat(store.clone(), 0, 3, interval=0.2).start()
    store.set("nvalchemi/heartbeat/2", repr(time.time() - 60))  # posted once, a minute ago
    silent = silent_ranks(store, 3, 0.2, watch_s=3)  # generous: rank 0 posts every 0.2 s
    assert set(silent) == {1, 2} and silent[1] is None and silent[2] > 50
    beat.stop()  # what SIGKILL or SIGSTOP does to a rank's thread
    assert not beat._thread.is_alive()  # no store call left in flight (one would abort exit)
    # a rank killed a moment ago: its last heartbeat is recent, but no new one comes
    silent = silent_ranks(store, 3, 0.2, rank=1, watch_s=1)
    assert 0 in silent and silent[0] < 60 and 1 not in silent  # this rank (1) is not judged


def test_the_note_names_the_collective_the_silent_rank_and_the_bound():
    store = _store()
    exc = RuntimeError(
        "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms "
        "for recv operation to complete"
    )
    exc.add_note("raised during training at stage DO_BACKWARD (step 3, ...)")
    assert is_collective_failure(exc) and not is_collective_failure(ValueError("timed out"))
    beat = Heartbeat(store.clone(), 0, 2, interval=1.0)  # this rank's: watch 3 s for others
    note = collective_failure_note(
        exc, operation=None, rank=0, world_size=2, timeout_s=5, heartbeat=beat, timeout_env="X"
    )
    assert note.startswith("nvalchemi: the gradient all-reduce of DistributedDataParallel")
    assert "failed on rank 0 of 2 (each collective waits at most 5 s)" in note
    assert "no heartbeat from rank 1 (never)" in note and "--dist-timeout" in note
    other = Heartbeat(store.clone(), 1, 2, interval=0.2).start()  # rank 1 alive, posting
    try:
        alive = collective_failure_note(
            exc,
            operation="nvalchemi.distributed.barrier()",
            rank=0,
            world_size=2,
            timeout_s=5,
            heartbeat=beat,
            timeout_env="X",
        )
        assert "barrier()" in alive and "every other rank is alive" in alive
        closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1")
        left = collective_failure_note(
            closed,
            operation=None,
            rank=0,
            world_size=2,
            timeout_s=5,
            heartbeat=beat,
            timeout_env="X",
        )
        assert "still running" in left and "closed its connection" in left
    finally:
        other.stop()
    dead = collective_failure_note(
        closed, operation=None, rank=0, world_size=2, timeout_s=5, heartbeat=beat, timeout_env="X"
    )
    assert "rank 1 (last heartbeat" in dead and "died" in dead and "alive" not in dead


def test_heartbeats_are_a_tenth_of_the_timeout_within_1_to_10_s():
    assert [heartbeat_interval(t) for t in (2, 50, 600, 3600)] == [1.0, 5.0, 10.0, 10.0]
