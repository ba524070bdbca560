"""save_checkpoint / load_checkpoint: layout, manifest versions, specs, retention, safe reads."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import _checkpoint_support as C
import pytest
import torch
from pydantic import ValidationError

from nvalchemi.training import TrainingStage, TrainingStrategy, create_model_spec
from nvalchemi.training import checkpoint as ckpt
from nvalchemi.training.checkpoint import (
    CheckpointManifest,
    load_checkpoint,
    load_model_from_checkpoint,
    read_strategy_metadata,
    save_checkpoint,
    strategy_load_checkpoint,
    strategy_restore_checkpoint,
)
from nvalchemi.training.checkpoint.store import UPGRADES
from nvalchemi.training.errors import NonFiniteLossError
from nvalchemi.training.hooks.early_stopping import EarlyStoppingHook


def _trained(num_steps: int = 3, **kwargs):
    strategy = C.strategy(num_steps=num_steps, **kwargs)
    strategy.run(C.batches())
    return strategy


# ---------------------------------------------------------------------------- components
def test_component_checkpoints_use_one_directory_per_index_and_a_versioned_manifest(tmp_path):
    models, optimizers, schedulers = C.linear_components()
    assert save_checkpoint(tmp_path, models, optimizers, schedulers) == 0
    assert save_checkpoint(tmp_path, models, optimizers, schedulers) == 1
    for rel in (
        "models/main/spec.json",
        "models/main/weights.pt",
        "optimizers/opt/spec.json",
        "optimizers/opt/state.pt",
        "schedulers/sched/state.pt",
        "associations.json",
    ):
        assert (tmp_path / "checkpoints" / "1" / rel).is_file(), rel
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert list(data)[:6] == [
        "schema_version",
        "checkpoint_index",
        "models",
        "optimizers",
        "schedulers",
        "associations",
    ]
    assert data["schema_version"] == 2 and data["checkpoint_index"] == 1
    assert data["models"] == ["main"] and data["associations"]["main"]["optimizers"] == ["opt"]
    assert data["associations"]["main"]["scheduler_optimizers"] == {"sched": "opt"}
    assert [e["index"] for e in data["checkpoints"]] == [0, 1]


def test_component_checkpoint_loads_as_manifest_with_object_spec_pairs(tmp_path):
    models, optimizers, schedulers = C.linear_components()
    save_checkpoint(tmp_path, models, optimizers, schedulers)
    loaded = load_checkpoint(tmp_path)
    assert isinstance(loaded, CheckpointManifest)
    layer, spec = loaded.models["main"]
    assert spec.cls_path == "torch.nn.modules.linear.Linear"
    assert C.same_state(layer.state_dict(), models["main"][0].state_dict())
    optimizer, _ = loaded.optimizers["opt"]
    assert optimizer.param_groups[0]["params"][0] is layer.weight
    assert optimizer.state_dict()["state"][0]["momentum_buffer"].equal(
        optimizers["opt"][0].state_dict()["state"][0]["momentum_buffer"]
    )
    scheduler, _ = loaded.schedulers["sched"]
    assert scheduler.optimizer is optimizer and scheduler.last_epoch == 1
    assert loaded.model_dump()["models"] == ["main"]


def test_model_names_loads_those_models_and_their_optimizers_only(tmp_path):
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    models = {"a": (a, None), "b": (b, None)}
    optimizers = {
        "oa": torch.optim.SGD(a.parameters(), lr=0.1),
        "ob": torch.optim.SGD(b.parameters(), lr=0.2),
    }
    save_checkpoint(tmp_path, models, optimizers)
    loaded = load_checkpoint(tmp_path, model_names=["b"])
    assert isinstance(loaded, CheckpointManifest)  # restricted to b and its optimizer
    assert set(loaded.models) == {"b"} and set(loaded.optimizers) == {"ob"}
    model, spec = loaded.models["b"]
    assert torch.equal(model.weight, b.weight) and spec.cls_path.endswith("Linear")
    assert loaded.optimizers["ob"][0].param_groups[0]["lr"] == 0.2
    with pytest.raises(KeyError, match=r"Unknown model\(s\) \['c'\]. Available: \['a', 'b'\]"):
        load_checkpoint(tmp_path, model_names=["c"])


def test_changed_spec_is_refused_naming_the_fields_unless_allowed_and_recorded(tmp_path):
    models, optimizers, _ = C.linear_components()
    save_checkpoint(tmp_path, models, optimizers)
    changed = {
        "opt": (optimizers["opt"][0], create_model_spec(torch.optim.SGD, lr=0.5, momentum=0.9))
    }
    with pytest.raises(ValueError, match=r"Differing fields: optimizers/opt\.lr: 0\.1 -> 0\.5"):
        save_checkpoint(tmp_path, models, changed)
    assert CheckpointManifest.read(tmp_path).checkpoint_index == 0
    assert save_checkpoint(tmp_path, models, changed, allow_spec_changes=True) == 1
    (event,) = [h for h in CheckpointManifest.read(tmp_path).history if h["event"] == "spec_change"]
    assert event["changes"] == [{"field": "optimizers/opt.lr", "old": 0.1, "new": 0.5}]


# ---------------------------------------------------------------------------- manifest
def test_manifest_serializes_sorted_name_lists_and_round_trips(tmp_path):
    manifest = CheckpointManifest(
        checkpoint_index=3, models={"b": None, "a": None}, optimizers=["z", "y"]
    )
    dumped = manifest.model_dump(mode="json")
    assert dumped["models"] == ["a", "b"] and dumped["optimizers"] == ["y", "z"]
    manifest.write(tmp_path)
    assert CheckpointManifest.read(tmp_path).model_dump(mode="json") == dumped


def test_newer_schema_versions_are_refused_and_malformed_manifests_raise(tmp_path):
    (tmp_path / "manifest.json").write_text(
        json.dumps({"schema_version": 99, "checkpoint_index": 0, "models": []})
    )
    with pytest.raises(ValueError, match="newer than supported"):
        CheckpointManifest.read(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 2, "models": []}))
    with pytest.raises(ValidationError):
        CheckpointManifest.read(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"manifest\.json"):
        CheckpointManifest.read(tmp_path / "missing")


def test_upgrade_steps_are_ordered_and_reach_the_current_version():
    versions = [v for v, _ in UPGRADES]
    assert versions == sorted(versions) == list(range(len(versions)))
    assert versions[-1] + 1 == ckpt.CURRENT_SCHEMA_VERSION


def _write_reference_layout(root: Path, version: int | None) -> TrainingStrategy:
    """A checkpoint root as the reference (schema 1, or 0 without a version) wrote it."""
    hook = EarlyStoppingHook(patience=5)
    hook.best, hook.bad_epochs = 0.25, 2
    strategy = _trained(num_steps=2, hooks=[hook])
    model = strategy.unwrapped_models()["main"]
    optimizer, scheduler = strategy._optimizers[0], strategy._lr_schedulers[0]
    meta = strategy.to_checkpoint_dict()
    for kind, name, obj, spec in (
        ("models", "main", model, meta["model_specs"]["main"]),
        (
            "optimizers",
            "main_optimizer",
            optimizer,
            {"cls_path": "torch.optim.adam.Adam", "timestamp": "t", "lr": 0.01},
        ),
        (
            "schedulers",
            "main_scheduler",
            scheduler,
            {
                "cls_path": "torch.optim.lr_scheduler.StepLR",
                "timestamp": "t",
                "step_size": 2,
                "gamma": 0.5,
            },
        ),
    ):
        folder = root / kind / name
        (folder / "checkpoints").mkdir(parents=True)
        (folder / "spec.json").write_text(json.dumps(spec))
        for index in (0, 1):
            torch.save(obj.state_dict(), folder / "checkpoints" / f"{index}.pt")
    (root / "strategy" / "checkpoints").mkdir(parents=True)
    (root / "strategy" / "checkpoints" / "1.json").write_text(json.dumps(meta))
    (root / "strategy.json").write_text(json.dumps(meta))
    (root / "hooks" / "checkpoints").mkdir(parents=True)
    key = "nvalchemi.training.hooks.early_stopping.EarlyStoppingHook:0"
    torch.save({key: hook.state_dict()}, root / "hooks" / "checkpoints" / "1.pt")
    manifest = {
        "checkpoint_index": 1,
        "models": ["main"],
        "optimizers": ["main_optimizer"],
        "schedulers": ["main_scheduler"],
        "associations": {
            "main": {"optimizers": ["main_optimizer"], "schedulers": ["main_scheduler"]}
        },
    }
    if version is not None:
        manifest = {"schema_version": version, **manifest}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return strategy


@pytest.mark.parametrize("version", [None, 1])
def test_reference_layout_checkpoints_are_upgraded_loaded_and_extended(tmp_path, version):
    saved = _write_reference_layout(tmp_path, version)
    manifest = CheckpointManifest.read(tmp_path)
    assert manifest.schema_version == 2 and [e.index for e in manifest.checkpoints] == [0, 1]
    assert manifest.entry(1).layout == 1 and manifest.entry(1).kind == "strategy"
    assert manifest.entry(0).kind == "components" and manifest.entry(1).step_count == 2

    hook = EarlyStoppingHook(patience=5)
    loaded = load_checkpoint(tmp_path, hooks=[hook])
    strategy = loaded["strategy"]
    assert strategy.step_count == 2 and (hook.best, hook.bad_epochs) == (0.25, 2)
    assert C.same_state(
        C.params(strategy.unwrapped_models()["main"]), C.params(saved.unwrapped_models()["main"])
    )
    assert strategy._optimizers[0].state_dict()["state"][0]["step"] == 2

    assert save_checkpoint(tmp_path, strategy) == 2  # the next save writes schema 2
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert data["schema_version"] == 2 and data["checkpoints"][-1]["path"] == "checkpoints/2"
    assert any(h["event"] == "upgraded" and h["from"] == 1 for h in data["history"])
    old = load_checkpoint(tmp_path, checkpoint_index=0)  # components-only reference index
    assert isinstance(old, CheckpointManifest)


# ---------------------------------------------------------------------------- retention
def test_keep_last_and_keep_best_retention_with_latest_and_best_resolution(tmp_path):
    models, optimizers, _ = C.linear_components()
    for value in (5.0, 1.0, 4.0, 3.0, 6.0, 2.5):
        save_checkpoint(tmp_path, models, optimizers, keep_last=2, keep_best=1, metric=value)
    manifest = CheckpointManifest.read(tmp_path)
    assert [e.index for e in manifest.checkpoints] == [1, 4, 5]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "4", "5"]
    assert manifest.entry("best").index == 1 and manifest.entry("latest").index == 5
    assert manifest.entry(-1).index == 5
    with pytest.raises(KeyError, match=r"available: \[1, 4, 5\]"):
        manifest.entry(2)
    best = load_checkpoint(tmp_path, checkpoint_index="best")
    assert best.checkpoint_index == 5  # the manifest itself is the latest one
    assert load_model_from_checkpoint(tmp_path, checkpoint_index="best", use_ema=False) is not None


def test_best_without_metrics_is_a_clear_error(tmp_path):
    models, _, _ = C.linear_components()
    save_checkpoint(tmp_path, models)
    with pytest.raises(ValueError, match="no checkpoint in this root has a validation metric"):
        load_checkpoint(tmp_path, checkpoint_index="best")


def test_explicit_index_replaces_that_checkpoint_through_a_new_directory(tmp_path):
    models, _, _ = C.linear_components(seed=0)
    save_checkpoint(tmp_path, models, checkpoint_index=0)
    new_models, _, _ = C.linear_components(seed=1)
    assert save_checkpoint(tmp_path, new_models, checkpoint_index=0) == 0
    (entry,) = CheckpointManifest.read(tmp_path).checkpoints
    assert entry.path != "checkpoints/0" and not (tmp_path / "checkpoints" / "0").exists()
    layer, _ = load_checkpoint(tmp_path).models["main"]
    assert C.same_state(layer.state_dict(), new_models["main"][0].state_dict())


def test_leftovers_of_interrupted_saves_are_removed_and_foreign_folders_kept(tmp_path):
    models, _, _ = C.linear_components()
    save_checkpoint(tmp_path, models)
    folder = tmp_path / "checkpoints"
    interrupted = folder / ".tmp-1-123-abc"  # a save killed before its rename
    (interrupted / "models").mkdir(parents=True)
    (interrupted / ".nvalchemi-checkpoint").touch()
    renamed = folder / "7"  # renamed into place, killed before the manifest named it
    renamed.mkdir()
    (renamed / ".nvalchemi-checkpoint").touch()
    foreign = folder / "1"  # not written by nvalchemi: never deleted, never overwritten
    (foreign / "data.txt").parent.mkdir()
    (foreign / "data.txt").write_text("keep me")
    assert load_checkpoint(tmp_path).checkpoint_index == 0
    assert save_checkpoint(tmp_path, models) == 1
    assert not interrupted.exists() and not renamed.exists()
    assert (foreign / "data.txt").read_text() == "keep me"
    entry = CheckpointManifest.read(tmp_path).entry(1)
    assert entry.path.startswith("checkpoints/1.") and (tmp_path / entry.path / "models").is_dir()


# ---------------------------------------------------------------------------- strategies
def test_strategy_checkpoint_writes_recipe_counters_and_named_components(tmp_path):
    strategy = _trained()
    assert save_checkpoint(tmp_path, strategy) == 0  # positional strategy form
    folder = tmp_path / "checkpoints" / "0"
    meta = json.loads((folder / "strategy.json").read_text())
    assert meta["strategy_cls"] == "nvalchemi.training.strategy.TrainingStrategy"
    assert meta["runtime_state"]["step_count"] == 3
    for rel in (
        "optimizers/main_optimizer/state.pt",
        "schedulers/main_scheduler/state.pt",
        "rng/rank_0.pt",
    ):
        assert (folder / rel).is_file(), rel
    assert read_strategy_metadata(tmp_path)["runtime_state"]["step_count"] == 3
    entry = CheckpointManifest.read(tmp_path).entry("latest")
    assert entry.kind == "strategy" and entry.step_count == 3 and entry.reason == "manual"


def test_two_configs_of_one_model_are_numbered(tmp_path):
    from nvalchemi.training import EnergyMSELoss, OptimizerConfig

    configs = [
        OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}, parameters=["model.projection.*"]),
        OptimizerConfig(torch.optim.SGD, {"lr": 1e-2}),
    ]
    strategy = TrainingStrategy(
        models=C.demo_model(), optimizer_configs=configs, loss_fn=EnergyMSELoss(), num_steps=1
    )
    save_checkpoint(tmp_path, strategy=strategy)  # before any run: fresh optimizers
    assert CheckpointManifest.read(tmp_path).entry(0).optimizers == [
        "main_optimizer_0",
        "main_optimizer_1",
    ]
    loaded = strategy_load_checkpoint(TrainingStrategy, tmp_path)
    assert [type(o).__name__ for o in loaded._optimizers] == ["Adam", "SGD"]


def test_loaded_strategy_continues_counters_and_optimizer_state(tmp_path):
    strategy = _trained(num_steps=3)
    save_checkpoint(tmp_path, strategy)
    result = load_checkpoint(tmp_path)
    loaded = result["strategy"]
    assert result["checkpoint_index"] == 0 and result["source"] == {
        "format": "native",
        "path": str(tmp_path),
    }
    assert (loaded.step_count, loaded.batch_count, loaded.epoch_count) == (3, 3, 1)
    assert loaded._lr_schedulers[0].last_epoch == 3
    loaded.num_steps = 4
    loaded.run(C.batches())
    assert loaded.step_count == 4
    assert loaded._optimizers[0].state_dict()["state"][0]["step"] == 4  # Adam continued
    assert save_checkpoint(tmp_path, loaded) == 1


def test_resume_is_exact_in_process(tmp_path):
    reference = _trained(num_steps=4)
    first = C.strategy(num_steps=2)
    first.run(C.batches())
    save_checkpoint(tmp_path, first)
    resumed = strategy_load_checkpoint(TrainingStrategy, tmp_path)
    resumed.num_steps = 4
    resumed.run(C.batches())
    assert C.same_state(
        C.params(resumed.unwrapped_models()["main"]), C.params(reference.unwrapped_models()["main"])
    )


def test_component_only_checkpoints_are_rejected_by_strategy_load(tmp_path):
    models, _, _ = C.linear_components()
    save_checkpoint(tmp_path, models)
    with pytest.raises(ValueError, match="requires a checkpoint saved from a TrainingStrategy"):
        strategy_load_checkpoint(TrainingStrategy, tmp_path)


def test_map_location_overrides_the_recorded_devices(tmp_path):
    save_checkpoint(tmp_path, _trained())
    folder = tmp_path / "checkpoints" / "0"
    meta = json.loads((folder / "strategy.json").read_text())
    meta["devices"] = ["cuda:0"]
    (folder / "strategy.json").write_text(json.dumps(meta))
    loaded = strategy_load_checkpoint(TrainingStrategy, tmp_path, map_location="cpu")
    assert loaded.devices == [torch.device("cpu")]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="map_location='cpu'"):
            strategy_load_checkpoint(TrainingStrategy, tmp_path)


def test_save_argument_errors():
    with pytest.raises(ValueError, match=r"requires models=\.\.\. or strategy=\.\.\."):
        save_checkpoint("unused")
    with pytest.raises(TypeError, match="expects a TrainingStrategy"):
        save_checkpoint("unused", strategy=object())


def test_validator_failures_are_wrapped_naming_validator_model_and_path(tmp_path):
    save_checkpoint(tmp_path, _trained())

    def no_demo(name, entry, model):
        raise RuntimeError("not allowed")

    with pytest.raises(
        ValueError, match=r"validator 'no_demo' failed for model 'main' loaded from .*not allowed"
    ):
        load_checkpoint(tmp_path, validators=[no_demo])
    assert load_checkpoint(tmp_path, validators={"finite": ckpt.check_finite_weights})["strategy"]


def test_learning_rate_change_on_resume_needs_an_override_and_is_recorded(tmp_path):
    save_checkpoint(tmp_path, _trained(num_steps=3, lr=1e-2))
    live = C.strategy(lr=1e-3)
    with pytest.raises(ValueError, match=r"optimizers/main_optimizer\.lr: 0\.01 -> 0\.001"):
        strategy_restore_checkpoint(live, tmp_path)
    strategy_restore_checkpoint(live, tmp_path, allow_spec_changes=True)
    group = live._optimizers[0].param_groups[0]
    assert group["initial_lr"] == 1e-3 and group["lr"] == pytest.approx(
        1e-3 * 0.5
    )  # StepLR position kept

    resumed = strategy_load_checkpoint(
        TrainingStrategy, tmp_path, overrides={"optimizer_kwargs": {"lr": 1e-4}, "num_steps": 5}
    )
    assert resumed.num_steps == 5 and resumed._lr_schedulers[0].base_lrs == [1e-4]
    assert resumed._optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5e-4)
    save_checkpoint(tmp_path, resumed)
    events = {h["event"]: h for h in CheckpointManifest.read(tmp_path).history}
    assert events["resume_overrides"]["overrides"] == {
        "optimizer_kwargs": {"lr": 1e-4},
        "num_steps": 5,
    }
    assert events["spec_change"]["changes"] == [
        {"field": "optimizers/main_optimizer.lr", "old": 0.01, "new": 0.0001}
    ]
    fresh = C.strategy(lr=2e-2)  # an unrelated run may not reuse the root silently
    with pytest.raises(ValueError, match=r"Differing fields: optimizers/main_optimizer\.lr"):
        save_checkpoint(tmp_path, fresh)


def test_nonfinite_run_never_overwrites_good_checkpoints(tmp_path):
    strategy = _trained()
    save_checkpoint(tmp_path, strategy)
    refused = []

    class SaveAfterBatch:  # a save after a non-finite step, before any periodic check
        frequency, stage = 1, TrainingStage.AFTER_BATCH

        def __call__(self, ctx, stage):
            with pytest.raises(NonFiniteLossError):
                save_checkpoint(tmp_path, ctx.workflow)
            refused.append(ctx.step_count)

    strategy.register_hook(SaveAfterBatch())
    strategy.num_steps = strategy.step_count + 1
    strategy.run(C.batches(1, nan=True))
    assert refused == [strategy.step_count]
    assert [e.index for e in CheckpointManifest.read(tmp_path).checkpoints] == [0]


def test_hook_state_that_cannot_load_safely_is_refused_at_save_naming_the_hook(tmp_path):
    import numpy as np

    class NumpyState:
        frequency, stage = 1, None

        def _runs_on_stage(self, stage):
            return False

        def __call__(self, ctx, stage):
            pass

        def state_dict(self):
            return {"table": np.zeros(3)}

        def load_state_dict(self, state):
            pass

    strategy = C.strategy(hooks=[NumpyState()])
    with pytest.raises(
        TypeError, match=r"hook 'NumpyState' state_dict\['table'\] holds a numpy.ndarray"
    ):
        save_checkpoint(tmp_path, strategy)


def test_component_names_and_manifest_paths_must_stay_inside_the_root(tmp_path):
    layer = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="not a valid checkpoint component name"):
        save_checkpoint(tmp_path, {"../evil": (layer, None)})
    save_checkpoint(tmp_path, {"main": (layer, None)})
    data = json.loads((tmp_path / "manifest.json").read_text())
    data["checkpoints"][0]["path"] = "../../etc"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="leaves the checkpoint directory"):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------- safe reads
def test_every_torch_load_uses_weights_only(tmp_path, monkeypatch):
    from nvalchemi.training.hooks.ema import EMAHook

    strategy = C.strategy(hooks=[EMAHook(decay=0.5), EarlyStoppingHook()])
    strategy.run(C.batches())
    save_checkpoint(tmp_path, strategy)
    models, optimizers, schedulers = C.linear_components()
    save_checkpoint(tmp_path / "components", models, optimizers, schedulers)
    calls = []
    real = torch.load

    def recording(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording)
    load_checkpoint(tmp_path, hooks=[EMAHook(decay=0.5), EarlyStoppingHook()])
    load_model_from_checkpoint(tmp_path)
    load_checkpoint(tmp_path / "components")
    assert len(calls) >= 9 and all(flag is True for flag in calls)


_MODULES = [
    "checkpoint/__init__.py",
    "checkpoint/store.py",
    "checkpoint/parts.py",
    "checkpoint/save.py",
    "checkpoint/load.py",
    "checkpoint/rng.py",
    "_checkpoint.py",
    "preemption.py",
    "hooks/checkpoint.py",
]


@pytest.mark.parametrize("name", _MODULES)
def test_checkpoint_modules_import_no_pickle_and_load_tensors_weights_only(name):
    import nvalchemi.training as training

    tree = ast.parse((Path(training.__file__).parent / name).read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not {"pickle", "cloudpickle", "dill", "marshal"} & {
                n.split(".")[0] for n in names
            }
        is_call = isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "load"
        if is_call and getattr(node.func.value, "id", None) == "torch":
            kwargs = {k.arg: k.value for k in node.keywords}
            assert isinstance(kwargs.get("weights_only"), ast.Constant)
            assert kwargs["weights_only"].value is True


# ---------------------------------------------------------------------------- models to use
def test_load_model_from_checkpoint_prefers_ema_weights(tmp_path):
    from nvalchemi.training.hooks.ema import EMAHook

    ema = EMAHook(decay=0.5)
    strategy = C.strategy(hooks=[ema])
    strategy.run(C.batches())
    save_checkpoint(tmp_path, strategy)
    averaged = {
        k.removeprefix("module."): v
        for k, v in ema.get_averaged_model().state_dict().items()
        if k != "n_averaged"
    }
    model = load_model_from_checkpoint(tmp_path, map_location="cpu")
    assert not model.training and C.same_state(C.params(model), averaged)
    raw = load_model_from_checkpoint(tmp_path, use_ema=False)
    assert C.same_state(C.params(raw), C.params(strategy.unwrapped_models()["main"]))
    assert not C.same_state(C.params(raw), averaged)


def test_seed_resume_pattern_runs_as_written(tmp_path):
    strategy = _trained(num_steps=2)
    strategy.save_checkpoint(tmp_path)
    strategy = TrainingStrategy.load_checkpoint(str(tmp_path), map_location="cpu")
    strategy.num_steps = 3
    strategy.run(C.batches())
    assert strategy.step_count == 3


def test_adapter_arguments_are_checked(tmp_path):
    with pytest.raises(
        ValueError, match=r"Unsupported checkpoint adapter 'onnx'; supported: \['mace'\]"
    ):
        load_checkpoint(tmp_path, adapter="onnx")
    with pytest.raises(ValueError, match="Unknown adapter_kwargs"):
        load_checkpoint(tmp_path / "x.model", adapter="mace", adapter_kwargs={"bogus": 1})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "x.model", adapter="mace")
    with pytest.raises(ValueError, match="cannot restore into a strategy"):
        load_checkpoint(tmp_path, adapter="mace", strategy=C.strategy())


def test_resuming_without_the_saved_hooks_or_validation_warns(tmp_path):
    from nvalchemi.training import ValidationConfig
    from nvalchemi.training.hooks.checkpoint import CheckpointHook

    hook = CheckpointHook(tmp_path, step_interval=10)
    strategy = C.strategy(num_steps=2, hooks=[hook, EarlyStoppingHook()])
    strategy.validation_config = ValidationConfig(validation_data=C.batches(1))
    strategy.run(C.batches())
    with pytest.warns(UserWarning) as record:
        TrainingStrategy.load_checkpoint(tmp_path)
    messages = " | ".join(str(w.message) for w in record)
    assert "hooks ['CheckpointHook', 'EarlyStoppingHook']" in messages
    assert "has no validation_config" in messages


# ---------------------------------------------------------------------------- reference behaviours
def test_validators_are_called_with_the_model_name_its_entry_and_everything_loaded(tmp_path):
    models, optimizers, _ = C.linear_components()
    save_checkpoint(tmp_path, {**models, "other": (torch.nn.Linear(1, 1), None)}, optimizers)
    calls = []

    def record(name, entry, loaded):
        calls.append(
            (name, sorted(entry), sorted(loaded["models"]), entry is loaded["models"][name])
        )
        assert loaded["strategy"] is None and loaded["checkpoint_index"] == 0
        assert loaded["source"] == {"format": "native", "path": str(tmp_path)}
        assert loaded["manifest"].checkpoint_index == 0

    load_checkpoint(tmp_path, validators=[record])
    assert calls == [
        (
            "main",
            ["metadata", "model", "optimizers", "schedulers", "spec"],
            ["main", "other"],
            True,
        ),
        (
            "other",
            ["metadata", "model", "optimizers", "schedulers", "spec"],
            ["main", "other"],
            True,
        ),
    ]


def test_a_strategy_load_gives_validators_the_whole_result_with_optimizers_and_schedulers(
    tmp_path,
):
    saved = C.strategy(num_steps=2)
    saved.run(C.batches(2))
    saved.save_checkpoint(tmp_path)
    seen = {}

    def record(name, entry, loaded):
        seen.update(name=name, entry=entry, loaded=loaded)

    result = load_checkpoint(tmp_path, validators=[record])
    loaded, entry = seen["loaded"], seen["entry"]
    assert loaded is result and entry is result["models"]["main"]
    assert loaded["strategy"] is result["strategy"] and loaded["manifest"] is not None
    assert loaded["source"] == {"format": "native", "path": str(tmp_path)}
    (optimizer,) = entry["optimizers"].values()
    (scheduler,) = entry["schedulers"].values()
    live_optimizer = result["strategy"].ensure_optimizers()[0][0]
    assert optimizer["optimizer"] is live_optimizer
    assert optimizer["spec"].cls_path == "torch.optim.adam.Adam"
    assert scheduler["scheduler"].optimizer is live_optimizer
    assert scheduler["scheduler"].last_epoch == 2  # the restored state


def test_the_mace_adapter_warns_that_the_file_must_be_trusted(tmp_path):
    pytest.importorskip("mace")
    bogus = tmp_path / "model.model"
    bogus.write_bytes(b"not a pickle")
    trusted = pytest.warns(UserWarning, match="pickle loader.*load only trusted MACE model files")
    with trusted, pytest.raises(Exception):  # whatever mace's loader raises on junk
        load_checkpoint(bogus, adapter="mace")


def test_checkpoint_hook_keeps_its_cadence_with_train_batch_outside_run(tmp_path):
    from nvalchemi.training.hooks.checkpoint import CheckpointHook

    strategy = C.strategy(hooks=[CheckpointHook(tmp_path, step_interval=2, async_save=False)])
    for batch in C.batches(3) + C.batches(2, seed=1):
        strategy.train_batch(batch)
    steps = [e.step_count for e in CheckpointManifest.read(tmp_path).checkpoints]
    assert steps == [2, 4]  # written right after the batch, before the session ends
    strategy.close()


class _Batches:
    """A sized re-iterable the loop cannot position (no set_epoch_step, no sampler)."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.filterwarnings("ignore:The saved run used hooks")
def test_resuming_mid_epoch_names_a_loader_whose_order_cannot_be_replayed(tmp_path):
    from nvalchemi.training.hooks.checkpoint import CheckpointHook

    hook = CheckpointHook(tmp_path, step_interval=1, async_save=False)
    C.strategy(num_steps=None, num_epochs=2, hooks=[hook]).run(_Batches(C.batches(3)))
    manifest = CheckpointManifest.read(tmp_path)
    middle = next(e.index for e in manifest.checkpoints if e.epoch_step_count == 2)
    resumed = TrainingStrategy.load_checkpoint(tmp_path, checkpoint_index=middle)
    with pytest.warns(UserWarning, match=r"batch order of the dataloader \(_Batches\) may differ"):
        resumed.run(_Batches(C.batches(3)))
    again = TrainingStrategy.load_checkpoint(tmp_path, checkpoint_index=middle)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a list of batches replays exactly: no warning
        again.run(C.batches(3))
