"""Fine-tuning: ModulePatchHook, TrainableParameterHook and FineTuningStrategy entry points."""

from __future__ import annotations

import gc
import json
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import run_ranks
from _training_support import StageHook, make_batches
from torch import nn

from nvalchemi.models.demo import DemoModel, DemoModelWrapper
from nvalchemi.training import (
    EnergyMSELoss,
    ForceMSELoss,
    OptimizerConfig,
    TrainingStage,
    TrainingStrategy,
    create_model_spec,
    save_checkpoint,
)
from nvalchemi.training.checkpoint import UnsafeCheckpointError, load_model_from_checkpoint
from nvalchemi.training.finetune import FineTuningStrategy
from nvalchemi.training.hooks import GradientClipHook
from nvalchemi.training.hooks.finetune import ModulePatchHook, TrainableParameterHook

H = 8
BODY = ("embedding", "coord_embedding", "joint_mlp")


def demo(seed: int = 0, dtype: torch.dtype = torch.float32) -> DemoModelWrapper:
    torch.manual_seed(seed)
    return DemoModelWrapper(DemoModel(num_atom_types=10, hidden_dim=H)).to(dtype)


def adamw(lr: float = 1e-2, **kwargs: Any) -> OptimizerConfig:
    return OptimizerConfig(torch.optim.AdamW, {"lr": lr, **kwargs})


def make(model: nn.Module | dict | None = None, cls=TrainingStrategy, **overrides: Any):
    kwargs: dict[str, Any] = {
        "models": model if model is not None else demo(),
        "optimizer_configs": adamw(),
        "loss_fn": EnergyMSELoss() + ForceMSELoss(),
        "num_steps": 2,
    }
    kwargs.update(overrides)
    return cls(**kwargs)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(model: nn.Module, before: dict[str, torch.Tensor]) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def optimized_ids(strategy: Any) -> set[int]:
    return {id(p) for o in strategy._optimizers for g in o.param_groups for p in g["params"]}


def spec_linear(out_features: int = 1):
    return create_model_spec(nn.Linear, in_features=H, out_features=out_features)


# ---------------------------------------------------------------------------- ModulePatchHook
def test_patch_replaces_an_existing_child_and_adds_a_missing_one():
    model = demo()
    old = model.model.projection
    extra = nn.Linear(H, 2)
    make(
        model,
        hooks=[ModulePatchHook({"main.model.projection": spec_linear(), "main.extra": extra})],
    )
    assert model.model.projection is not old and isinstance(model.model.projection, nn.Linear)
    assert model.extra is extra


def test_patch_takes_the_dtype_of_the_module_it_replaces():
    model = demo(dtype=torch.float64)
    make(model, hooks=[ModulePatchHook({"main.model.projection": spec_linear()})])
    assert model.model.projection.weight.dtype == torch.float64


def test_same_module_for_two_targets_warns_that_parameters_are_shared():
    shared = nn.Linear(H, 1)
    patches = {"main.model.projection": shared, "main.model.second": shared}
    with pytest.warns(UserWarning, match="parameters will be shared"):
        make(hooks=[ModulePatchHook(patches)])


def test_missing_parent_is_named_and_nothing_is_patched():
    model = demo()
    old = model.model.projection
    patches = {"main.model.projection": spec_linear(), "main.model.nothere.head": spec_linear()}
    with pytest.raises(AttributeError, match="missing parent component 'nothere'"):
        make(model, hooks=[ModulePatchHook(patches)])
    assert model.model.projection is old


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        ("main", ValueError, "must have the form"),
        ("other.model.projection", KeyError, "unknown model key 'other'"),
        ("main.model.num_atom_types.x", TypeError, "not an nn.Module"),
        ("main.model.hidden_dim", TypeError, "only modules can be replaced"),
    ],
)
def test_bad_targets_are_rejected(target, error, match):
    with pytest.raises(error, match=match):
        make(hooks=[ModulePatchHook({target: spec_linear()})])


def test_patching_after_optimizers_exist_raises():
    strategy = make()
    strategy.train_batch(make_batches(1)[0])
    strategy.close()
    with pytest.raises(RuntimeError, match="before optimizers are built"):
        strategy.register_hook(ModulePatchHook({"main.model.projection": spec_linear()}))


def test_later_registrations_never_reapply_patches():
    model = demo()
    hook = ModulePatchHook({"main.model.projection": spec_linear()})
    strategy = make(model, hooks=[hook])
    patched = model.model.projection
    strategy.register_hook(GradientClipHook(max_norm=1.0))  # an update hook
    strategy.register_hook(StageHook(TrainingStage.AFTER_BATCH))
    assert model.model.projection is patched
    hook.on_register(strategy)  # even a repeated registration leaves its own work alone
    assert model.model.projection is patched
    strategy.run(make_batches(2))
    assert model.model.projection is patched


def test_patched_model_checkpoint_rebuilds_with_its_patches(tmp_path):
    model = demo()
    no_bias = create_model_spec(nn.Linear, in_features=H, out_features=1, bias=False)
    strategy = make(model, hooks=[ModulePatchHook({"main.model.projection": no_bias})])
    strategy.run(make_batches(2))
    strategy.save_checkpoint(tmp_path)  # the unpatched spec would not fit these weights
    loaded = load_model_from_checkpoint(tmp_path)  # untrusted load of the patched spec
    assert loaded.model.projection.bias is None
    assert torch.equal(loaded.model.projection.weight, model.model.projection.weight)


# ---------------------------------------------------------------------------- TrainableParameterHook
def test_hook_needs_a_pattern():
    with pytest.raises(ValueError, match="requires freeze_patterns, trainable_patterns, or both"):
        TrainableParameterHook()


def test_every_pattern_must_match_and_errors_show_qualified_names():
    with pytest.raises(ValueError) as info:
        make(hooks=[TrainableParameterHook(freeze_patterns=("main.model.projection",))])
    text = str(info.value)
    assert "freeze_patterns pattern 'main.model.projection' did not match" in text
    assert "main.model.projection.weight" in text  # example names
    assert "'main.model.projection.*'" in text  # the hint for a module name
    with pytest.raises(ValueError, match=r"trainable_patterns pattern 'main\.nope\.\*'"):
        make(hooks=[TrainableParameterHook(trainable_patterns=("main.nope.*",))])


def test_freeze_patterns_freeze_during_the_run_and_restore_afterwards():
    model = demo()
    before = snapshot(model)
    seen: list[bool] = []
    probe = StageHook(
        TrainingStage.AFTER_BACKWARD,
        lambda ctx: seen.append(model.model.joint_mlp[0].weight.requires_grad),
    )
    hook = TrainableParameterHook(freeze_patterns=("main.model.joint_mlp.*",))
    strategy = make(model, hooks=[hook, probe])
    strategy.run(make_batches(2))
    assert seen == [False, False]
    assert {n.split(".")[1] for n in changed(model, before)} == {
        "embedding",
        "coord_embedding",
        "projection",
    }
    assert all(p.requires_grad for p in model.parameters())  # restored


def test_trainable_patterns_alone_are_an_allow_list():
    model = demo()
    before = snapshot(model)
    strategy = make(
        model, hooks=[TrainableParameterHook(trainable_patterns=("main.model.projection.*",))]
    )
    strategy.run(make_batches(2))
    assert changed(model, before) == {"model.projection.weight", "model.projection.bias"}
    assert optimized_ids(strategy) == {id(p) for p in model.model.projection.parameters()}


def test_trainable_patterns_unfreeze_parameters_frozen_beforehand():
    model = demo()
    for p in model.model.projection.parameters():
        p.requires_grad_(False)
    before = snapshot(model)
    hook = TrainableParameterHook(
        freeze_patterns=("main.model.*",), trainable_patterns=("main.model.projection.*",)
    )
    make(model, hooks=[hook]).run(make_batches(2))
    assert changed(model, before) == {"model.projection.weight", "model.projection.bias"}
    assert not any(p.requires_grad for p in model.model.projection.parameters())  # as before


def test_optimizer_only_mode_keeps_gradients_but_not_updates_and_clears_them():
    model = demo()
    grads: list[torch.Tensor] = []
    probe = StageHook(
        TrainingStage.AFTER_BACKWARD,
        lambda ctx: grads.append(model.model.joint_mlp[0].weight.grad.clone()),
    )
    hook = TrainableParameterHook(
        freeze_patterns=("main.model.joint_mlp.*",), freeze_mode="optimizer_only"
    )
    strategy = make(model, hooks=[hook, probe], optimizer_configs=adamw(lr=0.0, weight_decay=0.0))
    batch = make_batches(1)[0]
    strategy.train_batch(batch)
    strategy.train_batch(batch)
    strategy.close()
    assert torch.count_nonzero(grads[0]) > 0
    assert torch.equal(grads[0], grads[1])  # cleared at the zeroing point, not accumulated
    assert not optimized_ids(strategy) & {id(p) for p in model.model.joint_mlp.parameters()}


def test_direct_optimizer_filter_clears_stale_gradients_on_the_lean_path():
    model = demo()
    strategy = make(model, optimizer_configs=adamw(lr=0.0, weight_decay=0.0))
    names = {f"main.{n}" for n, _ in model.named_parameters() if "projection" in n}
    strategy.set_optimizer_parameter_filter(names)
    batch = make_batches(1)[0]
    strategy.train_batch(batch)
    first = model.model.joint_mlp[0].weight.grad.clone()
    strategy.train_batch(batch)
    strategy.close()
    assert torch.equal(first, model.model.joint_mlp[0].weight.grad)
    assert optimized_ids(strategy) == {id(p) for p in model.model.projection.parameters()}


def test_registration_after_optimizers_warns_and_filters_the_rebuilt_optimizers():
    model = demo()
    strategy = make(model)
    strategy.train_batch(make_batches(1)[0])
    strategy.close()
    with pytest.warns(UserWarning, match="registered after optimizers were built"):
        strategy.register_hook(
            TrainableParameterHook(trainable_patterns=("main.model.projection.*",))
        )
    strategy.train_batch(make_batches(1)[0])
    strategy.close()
    assert optimized_ids(strategy) == {id(p) for p in model.model.projection.parameters()}


@pytest.mark.filterwarnings("ignore:Grad strides do not match bucket view strides")
def test_patterns_still_match_after_ddp_wraps_the_model_at_setup():
    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = demo()
        before = snapshot(model)

        def wrap(ctx):
            models = ctx.workflow.models
            if not isinstance(models["main"], nn.parallel.DistributedDataParallel):
                models["main"] = nn.parallel.DistributedDataParallel(models["main"])

        hook = TrainableParameterHook(
            freeze_patterns=("main.model.joint_mlp.*", "main.model.embedding.*")
        )
        strategy = make(model, hooks=[hook, StageHook(TrainingStage.SETUP, wrap)], num_steps=3)
        strategy.run(make_batches(3))
        assert isinstance(strategy.models["main"], nn.parallel.DistributedDataParallel)
        assert {n.split(".")[1] for n in changed(model, before)} == {
            "coord_embedding",
            "projection",
        }
        # registered on the already wrapped model, the same wrapper-free patterns match
        late = TrainableParameterHook(trainable_patterns=("main.model.projection.*",))
        allowed = late.apply(strategy)
        assert allowed == {"main.model.projection.weight", "main.model.projection.bias"}
    finally:
        # The test's own DDP wrapper goes first: its reducer holds the group, and a gloo
        # group destroyed with the reducer (the GIL held) can deadlock with a worker thread
        # freeing a finished collective (seen once in a full run); destroy_process_group
        # releases the GIL.
        strategy = model = None
        gc.collect()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- FineTuningStrategy
def test_generated_hooks_come_first():
    user = StageHook(TrainingStage.AFTER_BATCH)
    strategy = make(
        cls=FineTuningStrategy,
        module_patches={"main.model.projection": spec_linear()},
        trainable_patterns=("main.model.projection.*",),
        hooks=[user],
    )
    assert isinstance(strategy.hooks[0], ModulePatchHook)
    assert isinstance(strategy.hooks[1], TrainableParameterHook)
    assert strategy.hooks[2] is user


def test_fresh_head_trains_while_the_body_stays_bitwise_frozen(tmp_path):
    model = demo()
    body = {n: p.detach().clone() for n, p in model.named_parameters() if "projection" not in n}
    strategy = make(
        model,
        cls=FineTuningStrategy,
        module_patches={"main.model.projection": spec_linear()},
        trainable_patterns=("main.model.projection.*",),
        num_steps=3,
    )
    head = model.model.projection
    head_before = snapshot(head)
    strategy.run(make_batches(3))
    assert model.model.projection is head and changed(head, head_before) == {"weight", "bias"}
    assert all(torch.equal(p, body[n]) for n, p in model.named_parameters() if n in body)
    strategy.save_checkpoint(tmp_path)
    resumed = FineTuningStrategy.load_checkpoint(tmp_path)
    assert resumed.step_count == 3
    resumed_model = resumed.models["main"]
    assert torch.equal(resumed_model.model.projection.weight, head.weight)
    assert optimized_ids(resumed) == {id(p) for p in resumed_model.model.projection.parameters()}
    state = resumed._optimizers[0].state_dict()["state"]
    assert len(state) == 2 and all(int(s["step"]) == 3 for s in state.values())


def test_spec_round_trip_keeps_the_fine_tuning_fields():
    strategy = make(
        cls=FineTuningStrategy,
        module_patches={"main.model.projection": spec_linear()},
        freeze_patterns=("main.model.joint_mlp.*",),
        trainable_patterns=("main.model.joint_mlp.3.*",),
        freeze_mode="optimizer_only",
        training_fn="nvalchemi.training.strategy.default_training_fn",
    )
    spec = json.loads(json.dumps(strategy.to_spec_dict()))
    rebuilt = FineTuningStrategy.from_spec_dict(spec, models=demo(1))
    patch = rebuilt.module_patches["main.model.projection"]
    assert patch.cls_path.endswith("Linear") and patch.kwargs == spec_linear().kwargs
    assert rebuilt.freeze_patterns == ("main.model.joint_mlp.*",)
    assert rebuilt.trainable_patterns == ("main.model.joint_mlp.3.*",)
    assert rebuilt.freeze_mode == "optimizer_only"
    assert [type(h).__name__ for h in rebuilt.hooks] == [
        "ModulePatchHook",
        "TrainableParameterHook",
    ]
    plain = FineTuningStrategy.from_spec_dict({**spec, "module_patches": None}, models=demo())
    assert plain.module_patches == {} and plain.freeze_mode == "optimizer_only"


def test_direct_module_patches_cannot_be_serialized():
    strategy = make(
        cls=FineTuningStrategy, module_patches={"main.model.projection": nn.Linear(H, 1)}
    )
    with pytest.raises(TypeError, match="BaseSpec"):
        strategy.to_spec_dict()


def test_load_checkpoint_rejects_a_plain_training_checkpoint(tmp_path):
    make().save_checkpoint(tmp_path)
    with pytest.raises(TypeError, match="from_pretrained_checkpoint"):
        FineTuningStrategy.load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------- from_pretrained_checkpoint
@pytest.fixture
def pretrained(tmp_path) -> tuple[Path, DemoModelWrapper]:
    model = demo()
    strategy = make(model, optimizer_configs=adamw(2e-3, weight_decay=1e-4), num_steps=3)
    strategy.run(make_batches(3))
    strategy.save_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt", model


def test_from_pretrained_checkpoint_starts_a_new_run_on_the_cpu(pretrained):
    root, source = pretrained
    strategy = FineTuningStrategy.from_pretrained_checkpoint(
        root,
        loss_fn=EnergyMSELoss(),
        optimizer_configs=adamw(1e-3),
        num_steps=2,
        freeze_patterns=("main.model.joint_mlp.*",),
    )
    assert (strategy.step_count, strategy.batch_count, strategy.epoch_count) == (0, 0, 0)
    model = strategy.models["main"]
    assert model is not source and strategy.single_model_input
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), source.parameters()))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    strategy.run(make_batches(2))
    assert strategy.step_count == 2


def test_source_device_is_not_reused_without_map_location(tmp_path):
    strategy = make(devices=["cuda"])  # recorded device; models stay on the CPU here
    strategy.ensure_optimizers()
    strategy.save_checkpoint(tmp_path)
    loaded = FineTuningStrategy.from_pretrained_checkpoint(
        tmp_path, use_original_loss=True, use_original_opt_class=True, num_steps=1
    )
    assert {p.device.type for p in loaded.models["main"].parameters()} == {"cpu"}
    assert loaded.devices == [torch.device("cpu")]


def test_reuse_with_lr_override_keeps_other_optimizer_kwargs(pretrained):
    root, _ = pretrained
    strategy = FineTuningStrategy.from_pretrained_checkpoint(
        root, use_original_loss=True, use_original_opt_class=True, num_steps=1
    )
    (config,) = strategy.optimizer_configs["main"]
    assert config.optimizer_cls is torch.optim.AdamW
    assert config.optimizer_kwargs == {"lr": 1e-5, "weight_decay": 1e-4}
    assert [type(t).__name__ for t in strategy.loss_fn.components] == [
        "EnergyMSELoss",
        "ForceMSELoss",
    ]
    kept = FineTuningStrategy.from_pretrained_checkpoint(
        root, use_original_loss=True, use_original_opt_class=True, optimizer_lr=None, num_steps=1
    )
    assert kept.optimizer_configs["main"][0].optimizer_kwargs["lr"] == 2e-3


def test_reuse_flags_win_over_payload_keys(pretrained):
    root, _ = pretrained
    template = make(
        cls=FineTuningStrategy,
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 0.5}),
        loss_fn=EnergyMSELoss(),
        trainable_patterns=("main.model.projection.*",),
        training_fn="nvalchemi.training.strategy.default_training_fn",
    )
    payload = json.loads(json.dumps(template.to_spec_dict()))
    payload["model_specs"] = {}  # as a CLI job file for a native checkpoint has it
    with pytest.warns(UserWarning) as record:
        strategy = FineTuningStrategy.from_pretrained_checkpoint(
            root, use_original_loss=True, use_original_opt_class=True, **payload
        )
    messages = " ".join(str(w.message) for w in record)
    assert "use_original_loss=True: ignoring the loss_fn_spec" in messages
    assert "use_original_opt_class=True: ignoring the optimizer_configs" in messages
    assert strategy.optimizer_configs["main"][0].optimizer_cls is torch.optim.AdamW
    assert len(strategy.loss_fn.components) == 2
    assert strategy.trainable_patterns == ("main.model.projection.*",)
    own = FineTuningStrategy.from_pretrained_checkpoint(root, **payload)  # no flags: the payload
    assert own.optimizer_configs["main"][0].optimizer_cls is torch.optim.SGD
    assert len(own.loss_fn.components) == 1


def _student_fn(models: dict, batch: Any) -> dict[str, torch.Tensor]:
    return {"predicted_energy": models["student"](batch)["energy"]}


def test_multi_model_checkpoints_keep_their_names(tmp_path):
    models = {"student": demo(0), "teacher": demo(1)}
    source = make(
        models,
        optimizer_configs={"student": [adamw(2e-3)]},
        loss_fn=EnergyMSELoss(),
        training_fn=_student_fn,
    )
    source.run(make_batches(2))
    source.save_checkpoint(tmp_path)
    strategy = FineTuningStrategy.from_pretrained_checkpoint(
        tmp_path,
        use_original_loss=True,
        use_original_opt_class=True,
        training_fn=_student_fn,
        num_steps=1,
    )
    assert set(strategy.models) == {"student", "teacher"} and not strategy.single_model_input
    assert list(strategy.optimizer_configs) == ["student"]
    teacher = strategy.models["teacher"]
    assert all(
        torch.equal(a, b) for a, b in zip(teacher.parameters(), models["teacher"].parameters())
    )
    strategy.run(make_batches(1))


def test_reuse_needs_strategy_metadata(tmp_path):
    save_checkpoint(tmp_path, models={"main": (demo(), None)})  # components only
    with pytest.raises(
        ValueError, match="Cannot reuse original loss_fn, optimizer_configs because"
    ):
        FineTuningStrategy.from_pretrained_checkpoint(
            tmp_path, use_original_loss=True, use_original_opt_class=True, num_steps=1
        )
    strategy = FineTuningStrategy.from_pretrained_checkpoint(
        tmp_path, loss_fn=EnergyMSELoss(), optimizer_configs=adamw(), num_steps=1
    )
    assert strategy.step_count == 0


def test_from_pretrained_checkpoint_rejects_models_counters_and_missing_recipe(pretrained):
    root, _ = pretrained
    with pytest.raises(ValueError, match="loads models from checkpoint_dir"):
        FineTuningStrategy.from_pretrained_checkpoint(root, models=demo(), num_steps=1)
    with pytest.raises(ValueError, match="starts a new run at step 0"):
        FineTuningStrategy.from_pretrained_checkpoint(
            root, use_original_loss=True, use_original_opt_class=True, num_steps=1, step_count=5
        )
    with pytest.raises(ValueError, match=r"use_original_loss=True"):
        FineTuningStrategy.from_pretrained_checkpoint(root, optimizer_configs=adamw(), num_steps=1)


def test_validators_check_the_loaded_models(pretrained):
    root, _ = pretrained

    def reject(name, entry, model):
        raise ValueError("not this one")

    with pytest.raises(ValueError, match="validator 'reject' failed for model 'main'"):
        FineTuningStrategy.from_pretrained_checkpoint(
            root,
            validators=[reject],
            use_original_loss=True,
            use_original_opt_class=True,
            num_steps=1,
        )


# ---------------------------------------------------------------------------- plain weights
def test_from_a_plain_state_dict_file_with_a_key_map(tmp_path):
    source = demo(3)
    source.export_model(tmp_path / "inner.pt", as_state_dict=True)  # keys without "model."
    model = demo(4)
    strategy = FineTuningStrategy.from_pretrained_weights(
        model,
        tmp_path / "inner.pt",
        key_map={"": "model."},
        loss_fn=EnergyMSELoss(),
        optimizer_configs=adamw(),
        trainable_patterns=("main.model.projection.*",),
        num_steps=1,
    )
    assert strategy.models["main"] is model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), source.parameters()))
    strategy.run(make_batches(1))


def test_plain_weights_strictness_containers_and_ddp_prefixes(tmp_path):
    source = demo(3)
    kwargs = {"loss_fn": EnergyMSELoss(), "optimizer_configs": adamw(), "num_steps": 1}
    with pytest.raises(ValueError, match=r"missing keys \['model\.coord_embedding"):
        FineTuningStrategy.from_pretrained_weights(demo(), source.model.state_dict(), **kwargs)
    prefixed = {f"module.{k}": v for k, v in source.state_dict().items()}
    torch.save({"state_dict": prefixed, "epoch": 3}, tmp_path / "lightning.pt")
    model = demo()
    FineTuningStrategy.from_pretrained_weights(model, tmp_path / "lightning.pt", **kwargs)
    assert torch.equal(model.model.projection.weight, source.model.projection.weight)
    partial = {k: v for k, v in source.state_dict().items() if "projection" not in k}
    with pytest.warns(UserWarning, match="strict=False"):
        FineTuningStrategy.from_pretrained_weights(demo(), partial, strict=False, **kwargs)


class _Payload:  # a pickled object: must never be unpickled
    pass


def test_plain_weights_file_with_pickled_objects_is_refused(tmp_path):
    torch.save({"weights": _Payload()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError):
        FineTuningStrategy.from_pretrained_weights(
            demo(),
            tmp_path / "evil.pt",
            loss_fn=EnergyMSELoss(),
            optimizer_configs=adamw(),
            num_steps=1,
        )


def _mace_batch():
    from ase.build import bulk
    from ase.calculators.emt import EMT

    from nvalchemi.data import AtomicData, Batch
    from nvalchemi.data.neighbors import compute_neighbors

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.numbers[1] = 79
    atoms.rattle(0.05, seed=0)
    atoms.calc = EMT()
    atoms.get_potential_energy(), atoms.get_forces()  # from_atoms reads stored results
    data = AtomicData.from_atoms(atoms, dtype=torch.float64)
    batch = Batch.from_data_list([data])
    compute_neighbors(batch, cutoff=3.0)
    return batch


def test_from_a_mace_model_file_and_a_mace_state_dict(tmp_path):
    pytest.importorskip("mace", reason="mace-torch is not installed (optional extra [mace])")
    from nvalchemi.models import MACEWrapper

    tiny = {
        "atomic_numbers": [29, 79],
        "r_max": 3.0,
        "num_bessel": 4,
        "max_ell": 1,
        "num_interactions": 1,
        "hidden_irreps": "4x0e",
        "MLP_irreps": "4x0e",
        "correlation": 1,
        "radial_MLP": [8],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = MACEWrapper.from_mace_kwargs(seed=0, **tiny)
        source.export_model(tmp_path / "tiny.model")
        source.export_model(tmp_path / "tiny_state.pt", as_state_dict=True)
        strategy = FineTuningStrategy.from_mace(
            tmp_path / "tiny.model",
            loss_fn=EnergyMSELoss() + ForceMSELoss(),
            optimizer_configs=adamw(1e-2),
            trainable_patterns=("main.model.readouts.*",),
            num_steps=2,
        )
        model = strategy.models["main"]
        before = snapshot(model)
        strategy.run([_mace_batch()] * 2)
        moved = changed(model, before)
        assert moved and all(n.startswith("model.readouts.") for n in moved)
        target = MACEWrapper.from_mace_kwargs(seed=1, **tiny)
        FineTuningStrategy.from_pretrained_weights(
            target,
            tmp_path / "tiny_state.pt",
            key_map={"": "model."},
            loss_fn=EnergyMSELoss(),
            optimizer_configs=adamw(),
            num_steps=1,
        )
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), source.parameters()))


# ---------------------------------------------------------------------------- two DDP ranks
_RANK = textwrap.dedent(
    """
    import torch
    from _ranks import init_group, report, teardown
    from _training_support import make_batches
    from nvalchemi.models.demo import DemoModel, DemoModelWrapper
    from nvalchemi.training import EnergyMSELoss, OptimizerConfig, TrainingStage

    class StageHookLike:  # records whether the model is DDP-wrapped while training
        frequency, stage = 1, TrainingStage.AFTER_BATCH
        def __init__(self, out):
            self.out = out
        def __call__(self, ctx, stage):
            self.out.append(
                isinstance(ctx.models["main"], torch.nn.parallel.DistributedDataParallel))
    from nvalchemi.training.finetune import FineTuningStrategy
    from nvalchemi.training.hooks import DDPHook
    rank = init_group()
    torch.manual_seed(0)
    model = DemoModelWrapper(DemoModel(num_atom_types=10, hidden_dim=8))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped = []
    strategy = FineTuningStrategy(
        models=model, loss_fn=EnergyMSELoss(), num_steps=3,
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-2}),
        trainable_patterns=("main.model.projection.*",),
        freeze_patterns=("main.model.*",),
        hooks=[DDPHook(), StageHookLike(wrapped)])
    strategy.run(make_batches(6)[rank::2])  # a list: each rank passes its own shard
    assert wrapped == [True, True, True], wrapped
    moved = sorted(n for n, p in model.named_parameters() if not torch.equal(p, before[n]))
    weight = model.model.projection.weight.detach().flatten()[:3].tolist()
    report(rank=rank, moved=moved, weight=weight)
    teardown()
    """
)


@pytest.mark.slow
@pytest.mark.distributed
def test_trainable_patterns_under_two_ddp_ranks():
    results = run_ranks(_RANK)
    for result in results:
        assert result["moved"] == ["model.projection.bias", "model.projection.weight"]
    assert results[0]["weight"] == results[1]["weight"]  # gradients were all-reduced
