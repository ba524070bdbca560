"""One load path: loading a strategy checkpoint reads every file once and restores the
counters once, and the models layer reads a checkpoint without the training package."""

from __future__ import annotations

import builtins
import collections
import os
import subprocess
import sys

import _checkpoint_support as C
import torch

from nvalchemi.training import TrainingStrategy


def test_a_strategy_load_reads_every_file_once_and_restores_the_counters_once(
    tmp_path, monkeypatch
):
    saved = C.strategy(num_steps=2)
    saved.run(C.batches(2))
    saved.save_checkpoint(tmp_path)
    root = str(tmp_path)
    reads: collections.Counter = collections.Counter()
    real_open, real_os_open, real_load = builtins.open, os.open, torch.load

    def counting_open(path, *args, **kwargs):
        if str(path).startswith(root):
            reads[str(path)] += 1
        return real_open(path, *args, **kwargs)

    def counting_os_open(path, *args, **kwargs):  # the safe reads open files this way
        if str(path).startswith(root):
            reads[str(path)] += 1
        return real_os_open(path, *args, **kwargs)

    def counting_load(source, *args, **kwargs):
        if isinstance(source, (str, os.PathLike)):  # an open file was counted when opened
            reads[f"torch.load {source}"] += 1
        return real_load(source, *args, **kwargs)

    restored = []
    real_restore = TrainingStrategy.load_runtime_state
    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(os, "open", counting_os_open)
    monkeypatch.setattr(torch, "load", counting_load)
    monkeypatch.setattr(
        TrainingStrategy,
        "load_runtime_state",
        lambda self, state: restored.append(dict(state)) or real_restore(self, state),
    )
    loaded = TrainingStrategy.load_checkpoint(tmp_path)
    assert loaded.step_count == 2 and len(restored) == 1
    names = {key.rsplit("/", 1)[-1] for key in reads}
    assert {"manifest.json", "strategy.json", "spec.json", "weights.pt"} <= names
    assert set(reads.values()) == {1}, reads


def test_the_models_layer_reads_a_checkpoint_without_the_training_package(tmp_path):
    strategy = C.strategy(num_steps=1)
    strategy.run(C.batches(1))
    strategy.save_checkpoint(tmp_path)
    code = (
        "import sys; from nvalchemi.checkpoint_files import load_model_from_checkpoint;"
        f"m = load_model_from_checkpoint({str(tmp_path)!r}, use_ema=False);"
        "print(type(m).__name__, any(k.startswith('nvalchemi.training') for k in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["DemoModelWrapper", "False"], out.stderr
