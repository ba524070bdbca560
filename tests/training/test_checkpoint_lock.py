"""The writer lock of a checkpoint root: never a way into other files, never lost by a copy.

Real processes hold and probe the lock: one that copies its own root (which opens and
closes the lock file) still excludes a second writer, and a forked child outliving a
killed writer does not keep the root locked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import _checkpoint_support as C
import pytest

from nvalchemi.training.checkpoint import (
    CheckpointLockError,
    CheckpointRootError,
    load_checkpoint,
    save_checkpoint,
)
from nvalchemi.training.hooks.checkpoint import CheckpointHook

DATA = "energy,forces\n" * 20


def _root_with_a_checkpoint(tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "ckpt"
    models, _, _ = C.linear_components()
    save_checkpoint(root, models)
    (root / ".nvalchemi.lock").unlink()
    return root, models


def test_a_lock_file_that_is_a_symlink_to_data_is_refused_and_the_data_is_untouched(tmp_path):
    root, models = _root_with_a_checkpoint(tmp_path)
    data = tmp_path / "train.csv"
    data.write_text(DATA)
    (root / ".nvalchemi.lock").symlink_to(data)
    with pytest.raises(CheckpointRootError, match=r"\.nvalchemi\.lock as the writer lock"):
        save_checkpoint(root, models)
    strategy = C.strategy(num_steps=1, hooks=[CheckpointHook(root, step_interval=1)])
    with pytest.raises(CheckpointRootError, match="Nothing was written"):
        strategy.run(C.batches(1))
    assert data.read_text() == DATA
    assert load_checkpoint(root).checkpoint_index == 0


@pytest.mark.parametrize("kind", ["hard link", "other content"])
def test_a_lock_file_that_is_not_a_lock_record_is_never_written(tmp_path, kind):
    root, models = _root_with_a_checkpoint(tmp_path)
    data = tmp_path / "train.csv"
    data.write_text(DATA)
    lock = root / ".nvalchemi.lock"
    if kind == "hard link":
        os.link(data, lock)
        match = "2 hard links"
    else:
        lock.write_text(DATA)
        match = "not a lock record"
    with pytest.raises(CheckpointRootError, match=match):
        save_checkpoint(root, models)
    assert data.read_text() == DATA and lock.read_text() == DATA


def test_a_lock_file_left_by_an_earlier_run_is_reused(tmp_path):
    root, models = _root_with_a_checkpoint(tmp_path)
    (root / ".nvalchemi.lock").write_text('{"pid": 1, "host": "h", "since": "2020"}')
    assert save_checkpoint(root, models) == 1
    (root / ".nvalchemi.lock").write_text("")  # a writer killed before recording itself
    assert save_checkpoint(root, models) == 2


COPIES_ITS_ROOT = """
import shutil, sys, time
from nvalchemi.training.checkpoint import CheckpointStore
with CheckpointStore(sys.argv[1]).lock():
    shutil.copytree(sys.argv[1], sys.argv[2])  # opens and closes the lock file
    print("copied", flush=True)
    time.sleep(300)
"""


def test_a_writer_that_copies_its_root_keeps_the_lock(tmp_path):
    root = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", COPIES_ITS_ROOT, str(root), str(tmp_path / "copy")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "copied"
        assert (tmp_path / "copy" / ".nvalchemi.lock").is_file()
        models, _, _ = C.linear_components()
        with pytest.raises(CheckpointLockError, match=rf"pid {holder.pid} on "):
            save_checkpoint(root, models)
        assert not (root / "manifest.json").exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)


FORKS_A_CHILD = """
import os, sys, time
from nvalchemi.training.checkpoint import CheckpointStore
with CheckpointStore(sys.argv[1]).lock():
    child = os.fork()
    if child == 0:  # like a DataLoader worker: lives on after its parent is killed
        time.sleep(300)
        os._exit(0)
    print(child, flush=True)
    time.sleep(300)
"""


def test_a_forked_child_outliving_a_killed_writer_does_not_keep_the_lock(tmp_path):
    root = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", FORKS_A_CHILD, str(root)], stdout=subprocess.PIPE, text=True
    )
    child = None
    try:
        child = int(holder.stdout.readline())
        holder.kill()
        holder.wait(timeout=30)
        os.kill(child, 0)  # still alive
        models, _, _ = C.linear_components()
        assert save_checkpoint(root, models) == 0
    finally:
        holder.kill()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
