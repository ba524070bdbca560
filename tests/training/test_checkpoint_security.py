"""Crafted checkpoints are refused with a clear error and execute nothing.

Every attack writes a marker file if it runs; the tests assert the marker never appears.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import _checkpoint_support as C
import pytest
import torch

from nvalchemi._serialization import UnsafeImportError, trusted_imports
from nvalchemi.checkpoint_files import build_model
from nvalchemi.training import TrainingStrategy, create_model_spec
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
    with pytest.raises(UnsafeImportError, match="neither a class nor a callable marked safe"):
        load_checkpoint(root)
    mace = {
        "cls_path": "nvalchemi.models.mace.MACEWrapper.from_checkpoint",
        "timestamp": "t",
        "checkpoint_path": str(marker),
    }
    (folder / "models" / "main" / "spec.json").write_text(json.dumps(mace))
    with pytest.raises(UnsafeImportError, match="loads pickled files"):
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


def test_user_models_load_once_their_module_is_imported_and_never_import_it(tmp_path, monkeypatch):
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
    monkeypatch.chdir(package)  # your own code: a module in the working directory
    import ckpt_custom_model

    model = ckpt_custom_model.Custom(width=3)
    save_checkpoint(tmp_path / "ckpt", {"main": (model, None)})
    del sys.modules["ckpt_custom_model"]  # as in a fresh process that has not imported it
    with pytest.raises(
        UnsafeImportError, match=r"spec\.json.*import your module 'ckpt_custom_model'"
    ):
        load_model_from_checkpoint(tmp_path / "ckpt")
    assert "ckpt_custom_model" not in sys.modules  # the refusal imported nothing
    import ckpt_custom_model

    loaded = load_model_from_checkpoint(tmp_path / "ckpt")
    assert type(loaded).__name__ == "Custom" and loaded.width == 3
    assert torch.equal(loaded.layer.weight, model.layer.weight)
    del sys.modules["ckpt_custom_model"]


# ------------------------------------------ factories that unpickle files (audit P2)
_ALIAS = "nvalchemi.models.MACEWrapper.from_checkpoint"  # lazy re-export of mace.MACEWrapper
_FROM_MACE = "nvalchemi.training.finetune.FineTuningStrategy.from_mace"


@pytest.fixture
def evil_file(saved):
    """A plain ``torch.save`` of a payload: fully unpickling it would create the marker."""
    _, folder, marker = saved
    path = folder.parent.parent / "evil.pt"
    torch.save(Payload(marker), path)
    return path


def _attack(variant: str, evil: Path) -> tuple[dict, str]:
    """The spec edit of each audited variant and the key the refusal must name."""
    if variant == "A_top_alias":
        return {"cls_path": _ALIAS, "checkpoint_path": str(evil)}, "cls_path"
    if variant == "B_nested_from_mace":
        return {"model": {"cls_path": _FROM_MACE, "timestamp": "t", "source": str(evil)}}, (
            "model.cls_path"
        )
    return {"model": {"cls_path": _ALIAS, "timestamp": "t", "checkpoint_path": str(evil)}}, (
        "model.cls_path"
    )


_LOADERS = {
    "load_checkpoint": lambda root: load_checkpoint(root),
    "load_model_from_checkpoint": lambda root: load_model_from_checkpoint(root),
    "load_checkpoint(model_names)": lambda root: load_checkpoint(root, model_names=["main"]),
    "strategy_load_checkpoint": lambda root: strategy_load_checkpoint(TrainingStrategy, root),
}


@pytest.mark.parametrize("loader", sorted(_LOADERS))
@pytest.mark.parametrize("variant", ["A_top_alias", "B_nested_from_mace", "C_nested_alias"])
def test_specs_reaching_pickle_loaders_are_refused_without_trust(saved, evil_file, variant, loader):
    root, folder, marker = saved
    spec_file = folder / "models" / "main" / "spec.json"
    edit, key = _attack(variant, evil_file)
    _edit_json(spec_file, lambda d: d.update(edit))
    with pytest.raises(UnsafeImportError) as info:
        _LOADERS[loader](root)
    message = str(info.value)
    assert str(spec_file) in message and f"key {key!r}" in message
    assert "trust=True" in message and "pickled files" in message
    assert not marker.exists()


def test_pickle_loader_named_as_a_value_or_in_strategy_json_is_refused(saved, evil_file):
    root, folder, marker = saved
    spec_file = folder / "models" / "main" / "spec.json"
    original = spec_file.read_text()
    _edit_json(spec_file, lambda d: d.update(extra={"__type__": _ALIAS}))
    with pytest.raises(UnsafeImportError, match=r"key 'extra\.__type__'.*pickled files"):
        load_checkpoint(root)
    spec_file.write_text(original)
    evil = {"cls_path": _ALIAS, "timestamp": "t", "checkpoint_path": str(evil_file)}
    _edit_json(folder / "strategy.json", lambda d: d.update(loss_fn_spec=evil))
    with pytest.raises(ValueError, match="pickled files"):
        strategy_load_checkpoint(TrainingStrategy, root)
    assert not marker.exists()


def test_strategy_json_may_not_call_a_loader_that_reaches_a_pickle_file(saved, evil_file):
    # load_checkpoint(adapter="mace") would fully unpickle the file it is pointed at
    root, folder, marker = saved
    evil = {
        "cls_path": "nvalchemi.training.checkpoint.load_checkpoint",
        "timestamp": "t",
        "root_folder": str(evil_file),
        "adapter": "mace",
    }
    _edit_json(folder / "strategy.json", lambda d: d.update(loss_fn_spec=evil))
    with pytest.raises(ValueError, match="neither a class nor a callable marked safe"):
        strategy_load_checkpoint(TrainingStrategy, root)
    assert not marker.exists()


def test_untrusted_nested_specs_may_call_only_classes(saved):
    root, folder, marker = saved
    spec_file = folder / "models" / "main" / "spec.json"
    # An allow-listed classmethod that is not marked safe (it reads a file, weights_only).
    reader = {"cls_path": "nvalchemi.models.demo.DemoModelWrapper.from_checkpoint", "path": "x"}
    _edit_json(spec_file, lambda d: d.update(reader))
    with pytest.raises(UnsafeImportError, match=r"key 'cls_path'.*neither a class nor"):
        load_model_from_checkpoint(root)
    _edit_json(spec_file, lambda d: d.update(cls_path="nvalchemi.models.demo.DemoModelWrapper"))
    writer = {"cls_path": "nvalchemi.training.checkpoint.save_checkpoint", "timestamp": "t"}
    _edit_json(spec_file, lambda d: d.update(model={**writer, "root_folder": str(marker)}))
    with pytest.raises(UnsafeImportError, match=r"key 'model\.cls_path'.*neither a class nor"):
        load_model_from_checkpoint(root)
    assert not marker.exists()


def test_pickle_loader_reached_through_a_safe_factory_refuses_to_run(tmp_path):
    from nvalchemi.models.mace import MACEWrapper
    from nvalchemi.training.hooks.finetune import PatchedModule

    marker = tmp_path / "marker"
    torch.save(Payload(marker), tmp_path / "evil.pt")
    inner = create_model_spec(
        MACEWrapper.from_checkpoint, checkpoint_path=str(tmp_path / "evil.pt")
    )
    chain = create_model_spec(PatchedModule.from_patches, model=inner, paths=[], modules=[])
    with pytest.raises(UnsafeImportError, match=r"Refusing to run .*from_checkpoint"):
        build_model(chain, None)
    assert not marker.exists()
    missing = create_model_spec(MACEWrapper.from_checkpoint, checkpoint_path="none")
    with warnings.catch_warnings(), trusted_imports():  # trust lifts the guard: the call runs
        warnings.simplefilter("ignore")
        with pytest.raises((FileNotFoundError, ImportError)):
            build_model(missing, None)


def test_mace_file_checkpoints_need_trust_and_mace_kwargs_ones_do_not(tmp_path):
    pytest.importorskip("mace", reason="mace-torch is not installed (optional extra [mace])")
    from nvalchemi.models.mace import MACEWrapper

    tiny = {"atomic_numbers": [29], "r_max": 3.0, "num_bessel": 4, "max_ell": 1}
    tiny |= {"num_interactions": 1, "hidden_irreps": "4x0e", "MLP_irreps": "4x0e"}
    tiny |= {"correlation": 1, "radial_MLP": [8], "seed": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = MACEWrapper.from_mace_kwargs(**tiny)
        save_checkpoint(tmp_path / "kwargs", {"main": (built, None)})
        again = load_model_from_checkpoint(tmp_path / "kwargs")  # marked safe: no trust needed
        built.export_model(tmp_path / "tiny.model")
        from_file = MACEWrapper.from_checkpoint(tmp_path / "tiny.model")
        save_checkpoint(tmp_path / "file", {"main": (from_file, None)})
        spec_file = tmp_path / "file" / "checkpoints" / "0" / "models" / "main" / "spec.json"
        assert json.loads(spec_file.read_text())["cls_path"].endswith("from_checkpoint")
        with pytest.raises(UnsafeImportError, match=r"key 'cls_path'.*trust=True"):
            load_model_from_checkpoint(tmp_path / "file")
        trusted = load_model_from_checkpoint(tmp_path / "file", trust=True)
    assert isinstance(again, MACEWrapper) and isinstance(trusted, MACEWrapper)
    for model in (again, trusted):
        for name, value in built.state_dict().items():
            assert torch.equal(model.state_dict()[name], value), name


def test_class_arguments_naming_functions_or_pickle_loaders_are_refused(tmp_path, monkeypatch):
    from nvalchemi import _serialization as ser

    package = tmp_path / "site"
    package.mkdir()
    (package / "ckpt_class_arg_model.py").write_text(
        "import torch\n"
        "class WithFactory(torch.nn.Module):\n"
        "    def __init__(self, factory: type = torch.nn.Linear):\n"
        "        super().__init__()\n"
        "        self.factory = factory\n"
        "        self.layer = torch.nn.Linear(2, 1)\n"
    )
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.setattr(ser, "_ALLOWED", {*ser._ALLOWED, "ckpt_class_arg_model"})
    import ckpt_class_arg_model

    save_checkpoint(tmp_path / "ckpt", {"main": (ckpt_class_arg_model.WithFactory(), None)})
    spec_file = tmp_path / "ckpt" / "checkpoints" / "0" / "models" / "main" / "spec.json"
    assert json.loads(spec_file.read_text())["factory"] == "torch.nn.modules.linear.Linear"
    assert isinstance(
        load_model_from_checkpoint(tmp_path / "ckpt"), ckpt_class_arg_model.WithFactory
    )
    for value, pattern in (
        ("nvalchemi.training.checkpoint.save_checkpoint", "key 'factory'.*neither a class nor"),
        (_ALIAS, "pickled files"),
    ):
        _edit_json(spec_file, lambda d, value=value: d.update(factory=value))
        with pytest.raises(UnsafeImportError, match=pattern) as info:
            load_model_from_checkpoint(tmp_path / "ckpt")
        assert str(spec_file) in str(info.value)


# ---------------------------------------------------------------------------- the whole list
_CRAFTED = [
    "os.system",
    "subprocess.run",
    "subprocess.Popen",
    "builtins.exec",
    "builtins.eval",
    "builtins.open",
    "shutil.rmtree",
    "importlib.import_module",
    "torch.load",
    "nv_not_imported_user_module.Model",
]


@pytest.mark.parametrize("target", _CRAFTED)
@pytest.mark.parametrize(
    "where", ["model", "nested", "type_value", "optimizer", "loss", "training_fn"]
)
def test_crafted_paths_are_refused_naming_the_file_and_key_and_run_nothing(saved, target, where):
    root, folder, marker = saved
    evil = {"cls_path": target, "timestamp": "t", "path": str(marker)}
    model_spec = folder / "models" / "main" / "spec.json"
    if where == "model":
        _edit_json(model_spec, lambda d: d.update(evil))
        load, file, key = (lambda: load_checkpoint(root)), model_spec, "cls_path"
    elif where == "nested":
        _edit_json(model_spec, lambda d: d.update(model=evil))
        load, file, key = (lambda: load_checkpoint(root)), model_spec, "model.cls_path"
    elif where == "type_value":
        _edit_json(model_spec, lambda d: d.update(extra={"__type__": target}))
        load, file, key = (lambda: load_checkpoint(root)), model_spec, "extra.__type__"
    elif where == "optimizer":
        file = folder / "optimizers" / "main_optimizer" / "spec.json"
        file.write_text(json.dumps(evil))
        load, key = (lambda: load_checkpoint(root, model_names=["main"])), "cls_path"
    elif where == "loss":
        file = folder / "strategy.json"
        _edit_json(file, lambda d: d.update(loss_fn_spec=evil))
        load, key = (lambda: strategy_load_checkpoint(TrainingStrategy, root)), "loss_fn_spec"
    else:
        file = folder / "strategy.json"
        _edit_json(file, lambda d: d.update(training_fn=target))
        load, key = (lambda: strategy_load_checkpoint(TrainingStrategy, root)), "training_fn"
    with pytest.raises(ValueError, match=r"Refusing|allow-list") as info:
        load()
    text = str(info.value)
    assert repr(target) in text or target in text
    assert key in text and (str(file) in text or where in ("loss", "training_fn"))
    assert not marker.exists() and "nv_not_imported_user_module" not in sys.modules


# ------------------------------- nested specs are judged against the receiving parameter
_READER = '''
import pathlib


class Reader:
    """Your own class whose constructor acts on a file the spec names."""

    def __init__(self, filename: str = "x"):
        pathlib.Path(filename).touch()
'''


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.parametrize(
    "nested",
    ["ckpt_reader_module.Reader", "torch.nn.modules.linear.Linear", "builtins.dict"],
)
def test_a_nested_spec_of_the_wrong_type_is_refused_before_anything_is_built(
    saved, tmp_path, monkeypatch, nested, trust
):
    root, folder, marker = saved
    (tmp_path / "ckpt_reader_module.py").write_text(_READER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)  # your own module: it passes the trust rule
    import ckpt_reader_module  # noqa: F401

    spec_file = folder / "models" / "main" / "spec.json"
    evil = {"cls_path": nested, "timestamp": "t", "filename": str(marker)}
    if nested == "torch.nn.modules.linear.Linear":
        evil = {"cls_path": nested, "timestamp": "t", "in_features": 1, "out_features": 1}
    _edit_json(spec_file, lambda d: d.update(model=evil))  # DemoModelWrapper(model: DemoModel)
    try:
        for load in (
            lambda: load_model_from_checkpoint(root, trust=trust),
            lambda: load_checkpoint(root, trust=trust),
        ):
            with pytest.raises(
                RuntimeError, match=r"expected DemoModel.*Nothing was built"
            ) as info:
                load()
            assert f"{spec_file}, key 'model.cls_path'" in str(info.value)
            assert repr(nested) in str(info.value)
    finally:
        sys.modules.pop("ckpt_reader_module", None)
    assert not marker.exists()
