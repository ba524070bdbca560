"""The checkpoint store never deletes or overwrites what is not its own.

Crafted manifests, symlinked folders, roots without a manifest, a second writer (a real
process), a write that fails (a real file-size limit in a subprocess): each is refused or
reported with a clear error, and everything already on disk stays intact.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import _checkpoint_support as C
import pytest

from nvalchemi.training.checkpoint import (
    CheckpointLockError,
    CheckpointManifest,
    CheckpointRootError,
    load_checkpoint,
    save_checkpoint,
)
from nvalchemi.training.hooks.checkpoint import CheckpointHook


def _two_checkpoints(root: Path) -> dict:
    models, _, _ = C.linear_components()
    save_checkpoint(root, models)
    save_checkpoint(root, models)
    return models


def _edit_manifest(root: Path, edit) -> None:
    data = json.loads((root / "manifest.json").read_text())
    edit(data)
    (root / "manifest.json").write_text(json.dumps(data))


def test_a_crafted_entry_path_never_makes_retention_delete_the_root(tmp_path):
    root = tmp_path / "ckpt"
    models = _two_checkpoints(root)
    (root / "precious.txt").write_text("mine")
    _edit_manifest(root, lambda d: d["checkpoints"][0].update(path="."))
    with pytest.warns(RuntimeWarning, match=r"Not deleting checkpoint 0: .*'\.' leaves"):
        assert save_checkpoint(root, models, keep_last=1) == 2
    assert (root / "precious.txt").read_text() == "mine"
    assert [e.index for e in CheckpointManifest.read(root).checkpoints] == [2]
    assert not (root / "checkpoints" / "1").exists()  # the real drop was deleted
    assert load_checkpoint(root).checkpoint_index == 2


def test_retention_never_follows_a_symlinked_checkpoint_folder(tmp_path):
    root = tmp_path / "ckpt"
    models = _two_checkpoints(root)
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    folder = root / "checkpoints" / "0"
    shutil.rmtree(folder)
    folder.symlink_to(victim, target_is_directory=True)
    with pytest.warns(RuntimeWarning, match=r"checkpoints/0 is a symbolic link"):
        save_checkpoint(root, models, keep_last=1)
    assert (victim / "thesis.tex").read_text() == "years of work" and folder.is_symlink()


def test_retention_never_deletes_through_a_symlinked_checkpoints_directory(tmp_path):
    root, real = tmp_path / "ckpt", tmp_path / "scratch"
    real.mkdir()
    root.mkdir()
    (root / "checkpoints").symlink_to(real, target_is_directory=True)
    models, _, _ = C.linear_components()
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        for _ in range(3):
            save_checkpoint(root, models, keep_last=1)
    assert sorted(p.name for p in real.iterdir()) == ["0", "1", "2"]


@pytest.mark.parametrize("content", ["foreign", "own_without_manifest", "user_files"])
def test_a_root_without_manifest_but_with_content_is_refused_and_left_alone(tmp_path, content):
    root = tmp_path / "ckpt"
    models, _, _ = C.linear_components()
    if content == "foreign":
        (root / "checkpoints" / "1000").mkdir(parents=True)
        (root / "checkpoints" / "1000" / "weights.bin").write_bytes(b"not ours")
    elif content == "own_without_manifest":
        _two_checkpoints(root)
        (root / "manifest.json").unlink()
    else:
        root.mkdir()
        (root / "notes.md").write_text("my data")
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    with pytest.raises(CheckpointRootError, match=r"has no manifest.json but holds") as info:
        save_checkpoint(root, models)
    if content == "own_without_manifest":
        assert "manifest.json was lost" in str(info.value)
    else:
        assert "not an nvalchemi checkpoint directory" in str(info.value)
    assert "nothing was written or deleted" in str(info.value)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before


def test_an_interrupted_first_save_does_not_block_the_next_one(tmp_path):
    root = tmp_path / "ckpt"
    leftover = root / "checkpoints" / ".tmp-0-1-abcdef12"
    leftover.mkdir(parents=True)
    (leftover / ".nvalchemi-checkpoint").touch()
    models, _, _ = C.linear_components()
    assert save_checkpoint(root, models) == 0
    assert not leftover.exists()


def test_a_first_save_killed_before_its_manifest_does_not_block_the_next_one(tmp_path):
    """The folder was renamed into place, the manifest never written (a SIGKILL between)."""
    root = tmp_path / "ckpt"
    models, _, _ = C.linear_components()
    save_checkpoint(root, models)
    (root / "manifest.json").unlink()  # what the kill left: checkpoints/0 and the lock file
    kept = sorted(str(p.relative_to(root)) for p in (root / "checkpoints" / "0").rglob("*"))
    with pytest.warns(RuntimeWarning, match="first save was interrupted"):
        assert save_checkpoint(root, models) == 0
    manifest = CheckpointManifest.read(root)
    (entry,) = manifest.checkpoints
    assert entry.path != "checkpoints/0" and (root / entry.path).is_dir()  # written beside it
    after = sorted(str(p.relative_to(root)) for p in (root / "checkpoints" / "0").rglob("*"))
    assert after == kept  # the interrupted folder is left as it was


HOLDER = """
import sys, time
from nvalchemi.training.checkpoint import CheckpointStore
with CheckpointStore(sys.argv[1]).lock():
    print("locked", flush=True)
    time.sleep(300)
"""


def test_a_second_writer_process_is_refused_naming_the_holder_and_a_dead_one_is_stale(tmp_path):
    root = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        models, _, _ = C.linear_components()
        host = socket.gethostname()
        with pytest.raises(CheckpointLockError, match=rf"pid {holder.pid} on {host}, since 20"):
            save_checkpoint(root, models)
        strategy = C.strategy(num_steps=2, hooks=[CheckpointHook(root, step_interval=1)])
        with pytest.raises(CheckpointLockError, match="Stop the other run"):
            strategy.run(C.batches())
        assert strategy.step_count == 0  # refused at setup, before any training
        assert not (root / "manifest.json").exists()
    finally:
        holder.kill()  # SIGKILL: the lock file stays behind, the lock itself is gone
        holder.wait(timeout=30)
    assert (root / ".nvalchemi.lock").exists()
    assert save_checkpoint(root, models) == 0


FULL_DISK = """
import json, resource, signal, sys
import torch
from nvalchemi.training.checkpoint import CheckpointWriteError, load_checkpoint, save_checkpoint

root = sys.argv[1]
model = torch.nn.Linear(200, 100)  # weights.pt is about 80 kB
save_checkpoint(root, {"main": (model, None)})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # a full disk for larger files
try:
    save_checkpoint(root, {"main": (model, None)})
except CheckpointWriteError as exc:
    print(json.dumps({"error": str(exc), "errno": exc.errno,
                      "latest": load_checkpoint(root).checkpoint_index}))
"""


def test_a_failing_write_names_the_checkpoint_and_path_and_keeps_the_previous_one(tmp_path):
    root = tmp_path / "ckpt"
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(root)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["latest"] == 0 and out["errno"] == 27  # EFBIG
    assert "Could not write checkpoint 1 to" in out["error"] and str(root) in out["error"]
    assert "checkpoint 0 is still the latest loadable one" in out["error"]
    assert [p.name for p in (root / "checkpoints").iterdir()] == ["0"]  # no partial folder
