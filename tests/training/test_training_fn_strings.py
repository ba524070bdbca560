"""A ``training_fn`` named by a string: the caller's own code from Python, never from a file.

``TrainingStrategy(training_fn="pkg.mod.fn")`` in a script imports the module as Python
would (the caller wrote it); the same string in a checkpoint's ``strategy.json`` passes
the trust rule only, which imports nothing new.
"""

from __future__ import annotations

import json
import sys
import textwrap

import _checkpoint_support as C
import pytest
import torch

from nvalchemi.training import EnergyMSELoss, FineTuningStrategy, OptimizerConfig
from nvalchemi.training.checkpoint import load_checkpoint

MODULE = """
open({marker!r}, "w").close()
from nvalchemi.training import default_training_fn

def training_fn(model, batch):
    return default_training_fn(model, batch)
"""


def _module(tmp_path, monkeypatch, name: str):
    marker = tmp_path / f"{name}.imported"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE.format(marker=str(marker))))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return marker


def test_a_training_fn_string_given_in_python_imports_the_callers_module(tmp_path, monkeypatch):
    marker = _module(tmp_path, monkeypatch, "nv_own_fn_module")
    strategy = C.strategy(num_steps=1, training_fn="nv_own_fn_module.training_fn")
    assert marker.exists() and strategy.training_fn is sys.modules["nv_own_fn_module"].training_fn
    strategy.run(C.batches(1))
    assert strategy.step_count == 1
    model = C.demo_model()
    finetune = FineTuningStrategy.from_pretrained_weights(
        model,
        model.state_dict(),
        training_fn="nv_own_fn_module.training_fn",
        loss_fn=EnergyMSELoss(),
        num_steps=1,
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
    )
    assert finetune.training_fn is strategy.training_fn
    with pytest.raises(ValueError, match="module 'nv_missing_module' not found"):
        C.strategy(num_steps=1, training_fn="nv_missing_module.training_fn")


def test_a_training_fn_string_in_a_checkpoint_imports_nothing(tmp_path, monkeypatch):
    marker = _module(tmp_path, monkeypatch, "nv_file_fn_module")
    root = tmp_path / "ckpt"
    C.strategy(num_steps=1).save_checkpoint(root)
    (path,) = root.glob("checkpoints/*/strategy.json")
    data = json.loads(path.read_text())
    data["training_fn"] = "nv_file_fn_module.training_fn"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="nv_file_fn_module"):
        load_checkpoint(root)
    assert not marker.exists() and "nv_file_fn_module" not in sys.modules
