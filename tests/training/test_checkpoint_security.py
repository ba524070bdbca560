"""Crafted checkpoints are refused with a clear error and execute nothing.

Every attack writes a marker file if it runs; the tests assert the marker never appears.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import _checkpoint_support as C
import pytest
import torch

from nvalchemi._serialization import UnsafeImportError
from nvalchemi.training import TrainingStrategy
from nvalchemi.training.checkpoint import (
    UnsafeCheckpointError,
    load_checkpoint,
    load_model_from_checkpoint,
    save_checkpoint,
    strategy_load_checkpoint,
)


class Payload:
    """Unpickling this calls ``os.system`` (what a malicious .pt file would carry)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def saved(tmp_path):
    """A strategy checkpoint root, its latest checkpoint directory and a marker path."""
    strategy = C.strategy(num_steps=1)
    strategy.run(C.batches(1))
    save_checkpoint(tmp_path / "ckpt", strategy)
    return tmp_path / "ckpt", tmp_path / "ckpt" / "checkpoints" / "0", tmp_path / "marker"


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_model_spec_naming_os_system_is_refused(saved):
    root, folder, marker = saved
    command = {"cls_path": "os.system", "timestamp": "t", "command": f"touch {marker}"}
    (folder / "models" / "main" / "spec.json").write_text(json.dumps(command))
    for load in (
        lambda: load_checkpoint(root),
        lambda: strategy_load_checkpoint(TrainingStrategy, root),
        lambda: load_model_from_checkpoint(root),
        lambda: load_checkpoint(root, model_names=["main"]),
    ):
        with pytest.raises(UnsafeImportError, match=r"Refusing to import 'os\.system'"):
            load()
    assert not marker.exists()


def test_nested_spec_and_type_values_naming_os_system_are_refused(saved):
    root, folder, marker = saved
    evil = {"cls_path": "os.system", "timestamp": "t", "command": f"touch {marker}"}
    _edit_json(folder / "models" / "main" / "spec.json", lambda d: d.update(model=evil))
    with pytest.raises(UnsafeImportError, match=r"os\.system"):
        load_checkpoint(root)
    _edit_json(
        folder / "models" / "main" / "spec.json",
        lambda d: d.update(model={**d["model"], "cls_path": "nvalchemi.models.demo.DemoModel"}),
    )
    _edit_json(
        folder / "models" / "main" / "spec.json",
        lambda d: d.update(extra={"__type__": "os.system"}),
    )
    with pytest.raises(UnsafeImportError, match=r"os\.system"):
        load_checkpoint(root)
    assert not marker.exists()


@pytest.mark.parametrize("key", ["strategy_cls", "training_fn"])
def test_strategy_class_or_training_fn_naming_os_system_is_refused(saved, key):
    root, folder, marker = saved
    _edit_json(folder / "strategy.json", lambda d: d.update({key: "os.system"}))
    with pytest.raises(ValueError, match=r"os\.system.*(allow-list|Refusing)"):
        strategy_load_checkpoint(TrainingStrategy, root)
    assert not marker.exists()


def test_loss_and_optimizer_specs_naming_foreign_callables_are_refused(saved):
    root, folder, marker = saved
    evil = {"cls_path": "subprocess.call", "timestamp": "t", "args": ["touch", str(marker)]}
    (folder / "optimizers" / "main_optimizer" / "spec.json").write_text(json.dumps(evil))
    with pytest.raises(UnsafeImportError, match=r"subprocess\.call"):
        load_checkpoint(root, model_names=["main"])
    _edit_json(folder / "strategy.json", lambda d: d.update(loss_fn_spec=evil))
    with pytest.raises(ValueError, match=r"subprocess\.call"):
        strategy_load_checkpoint(TrainingStrategy, root)
    assert not marker.exists()


def test_allow_listed_functions_that_are_not_models_are_refused(saved):
    root, folder, marker = saved
    writer = {
        "cls_path": "nvalchemi.training.checkpoint.save_checkpoint",
        "timestamp": "t",
        "root_folder": str(marker),
    }
    (folder / "models" / "main" / "spec.json").write_text(json.dumps(writer))
    with pytest.raises(ValueError, match="not a subclass of Module"):
        load_checkpoint(root)
    mace = {
        "cls_path": "nvalchemi.models.mace.MACEWrapper.from_checkpoint",
        "timestamp": "t",
        "checkpoint_path": str(marker),
    }
    (folder / "models" / "main" / "spec.json").write_text(json.dumps(mace))
    with pytest.raises(ValueError, match="loads pickled files"):
        load_checkpoint(root)
    assert not marker.exists()


@pytest.mark.parametrize(
    "relative",
    [
        "models/main/weights.pt",
        "optimizers/main_optimizer/state.pt",
        "schedulers/main_scheduler/state.pt",
        "rng/rank_0.pt",
        "hooks.pt",
    ],
)
def test_pickle_payload_in_a_tensor_file_is_refused_even_with_trust(saved, relative):
    root, folder, marker = saved
    torch.save({"weight": Payload(marker)}, folder / relative)
    with pytest.raises(UnsafeCheckpointError, match=rf"Refusing to load .*{Path(relative).name}"):
        load_checkpoint(root, trust=True)
    assert not marker.exists()
    if relative == "models/main/weights.pt":
        with pytest.raises(UnsafeCheckpointError):
            load_model_from_checkpoint(root, use_ema=False, trust=True)
        assert not marker.exists()


def test_spec_may_not_grant_itself_trust(saved):
    root, folder, _ = saved
    _edit_json(folder / "models" / "main" / "spec.json", lambda d: d.update(trust=True))
    with pytest.raises(UnsafeImportError, match="may not grant trust"):
        load_checkpoint(root)


def test_models_outside_the_allow_list_load_only_with_trust(tmp_path, monkeypatch):
    package = tmp_path / "site"
    package.mkdir()
    (package / "ckpt_custom_model.py").write_text(
        "import torch\n"
        "class Custom(torch.nn.Module):\n"
        "    def __init__(self, width: int = 2):\n"
        "        super().__init__()\n"
        "        self.width = width\n"
        "        self.layer = torch.nn.Linear(width, 1)\n"
    )
    monkeypatch.syspath_prepend(str(package))
    import ckpt_custom_model

    model = ckpt_custom_model.Custom(width=3)
    save_checkpoint(tmp_path / "ckpt", {"main": (model, None)})
    with pytest.raises(UnsafeImportError, match="allow_import_path"):
        load_model_from_checkpoint(tmp_path / "ckpt")
    loaded = load_model_from_checkpoint(tmp_path / "ckpt", trust=True)
    assert isinstance(loaded, ckpt_custom_model.Custom) and loaded.width == 3
    assert torch.equal(loaded.layer.weight, model.layer.weight)
