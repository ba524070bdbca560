"""Scaffolded jobs: what ``train init``, ``finetune init`` and ``TrainingJobSpec.template()`` write.

A training job is the quickstart recipe (:mod:`nvalchemi.app.jobs.recipe`) on your
data: PaiNN fitted to the data, AdamW with a schedule fitted to a time budget, energy +
force (+ stress) MSE, EMA, clipping, validation and checkpoints. Payloads are made from
real objects (``loss.to_spec()``), so a scaffold always round-trips through ``spec run``.

Example:
    >>> job = scaffold_job("train", "custom", datasets=["data/train.extxyz"],
    ...                    output_dir="runs/x", num_epochs=5, device="cpu")
    >>> job["workflow"], job["strategy"]["num_epochs"], job["strategy"]["devices"]
    ('train', 5, ['cpu'])
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nvalchemi.app.jobs.recipe import QUICKSTART
from nvalchemi.training.strategy_payload import DEFAULT_TRAINING_FN

__all__ = [
    "IN_MEMORY_BYTES",
    "checkpoint_hook_entry",
    "hook_entry",
    "painn_model_spec",
    "scaffold_job",
    "scaffold_payload",
]

CHECKPOINT_HOOK = "nvalchemi.training.hooks.checkpoint.CheckpointHook"
EMA_HOOK = "nvalchemi.training.hooks.ema.EMAHook"
CLIP_HOOK = "nvalchemi.training.hooks.gradients.GradientClipHook"
IN_MEMORY_BYTES = 1 << 30
"""Training files up to this size (in total) are loaded into memory."""

_NAMES = {
    ("finetune", "native-checkpoint"): "native-checkpoint-fine-tune",
    ("finetune", "mace"): "mace-fine-tune",
    ("finetune", "custom"): "custom-fine-tune",
}


def hook_entry(cls_path: str, stages: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
    """A ``source.hooks`` entry: ``{"spec": {"cls_path": ..., **kwargs}, "stages": [...]}``."""
    spec = {"cls_path": cls_path, "timestamp": datetime.now(UTC).isoformat(), **kwargs}
    return {"spec": spec, "stages": list(stages)} if stages else {"spec": spec}


def checkpoint_hook_entry(
    checkpoint_dir: str, *, every_n_steps: int | None, keep_best: bool
) -> dict[str, Any]:
    """A ``CheckpointHook`` entry: every epoch (or every N steps), last 3 (+ best) kept."""
    cadence = {"step_interval": every_n_steps} if every_n_steps else {"epoch_interval": 1}
    extra = {"keep_best": 1} if keep_best else {}
    return hook_entry(
        CHECKPOINT_HOOK,
        checkpoint_dir=checkpoint_dir,
        keep_last=QUICKSTART.keep_last,
        **cadence,
        **extra,
    )


def _fine_tune_scheduler(lr: float, num_steps: int | None, has_validation: bool) -> dict:
    import torch

    if num_steps is not None:
        return {
            "scheduler_cls": torch.optim.lr_scheduler.CosineAnnealingLR,
            "scheduler_kwargs": {"T_max": int(num_steps), "eta_min": lr * 0.01},
        }
    if has_validation:
        return {
            "scheduler_cls": torch.optim.lr_scheduler.ReduceLROnPlateau,
            "scheduler_kwargs": {"factor": 0.5, "patience": 5},
        }
    return {}


def scaffold_payload(
    *,
    lr: float,
    num_steps: int | None,
    num_epochs: int | None,
    device: str,
    dtype_policy: str = "strict",
    trainable_patterns: tuple[str, ...] = (),
    freeze_patterns: tuple[str, ...] = (),
    model_specs: dict[str, Any] | None = None,
    has_validation: bool = False,
    schedule_steps: int | None = None,
    stress: bool = False,
    weight_decay: float | None = None,
    trunk_lr: tuple[float, str | None] | None = None,
    head_pattern: str | None = None,
    committee: int | None = None,
) -> dict[str, Any]:
    """A complete ``strategy`` payload (AdamW, per-atom energy + force (+ stress) MSE).

    Training jobs (``model_specs`` given) get the recipe's ``WarmupCosineLR`` over
    ``schedule_steps``; fine-tunes cosine decay over ``num_steps`` (or ``ReduceLROnPlateau``
    with validation data). ``trunk_lr=(scale, head)``: the trained head (parameters
    ``head_pattern``, default PaiNN's) learns at ``lr``, the rest at ``scale * lr``.
    ``committee=N``: the loss of an N-member committee (each member's loss, averaged).
    """
    import torch

    from nvalchemi.training.optimizers import OptimizerConfig

    if num_epochs is not None:
        num_steps = None
    groups = None
    base_lr = lr
    if trunk_lr is not None:
        scale, head = trunk_lr
        pattern = head_pattern or ("readout.*" if head is None else f"head_readouts.{head}.*")
        if scale == 0:
            trainable_patterns = (*trainable_patterns, f"main.{pattern}")
        else:
            groups = [{"params": [pattern], "lr": lr}]
            base_lr = lr * scale
    if model_specs:
        recipe = QUICKSTART.replace(lr=lr, weight_decay=weight_decay)
        config = recipe.optimizer_config(schedule_steps or num_steps)
    else:
        config = OptimizerConfig(
            optimizer_cls=torch.optim.AdamW,
            optimizer_kwargs={
                "lr": base_lr,
                "weight_decay": 1e-6 if weight_decay is None else weight_decay,
            },
            param_groups=groups,
            **_fine_tune_scheduler(base_lr, num_steps, has_validation),
        )
    loss = QUICKSTART.loss_fn(dtype_policy=dtype_policy, stress=stress)
    if committee:
        from nvalchemi.app.committee import committee_loss

        loss = committee_loss(loss, committee)
    return {
        "optimizer_configs": {"main": [config.to_spec().model_dump()]},
        "num_epochs": num_epochs,
        "num_steps": num_steps,
        "epoch_step_modifier": 1.0,
        "devices": [device],
        "loss_fn_spec": loss.to_spec().model_dump(),
        "model_specs": dict(model_specs or {}),
        "single_model_input": True,
        "training_fn": DEFAULT_TRAINING_FN,
        "module_patches": {},
        "freeze_patterns": list(freeze_patterns),
        "trainable_patterns": list(trainable_patterns),
        "freeze_mode": "requires_grad",
    }


def painn_model_spec(cutoff: float | None = None, *, stress: bool = False) -> dict[str, Any]:
    """The recipe's PaiNN as a model spec (data-dependent arguments fitted at run time)."""
    from nvalchemi.models.painn import PaiNN
    from nvalchemi.training.spec import create_model_spec

    kwargs = QUICKSTART.model_kwargs()
    if cutoff is not None:
        kwargs["cutoff"] = float(cutoff)
    if stress:
        kwargs["active_outputs"] = ["energy", "forces", "stress"]
    return create_model_spec(PaiNN, **kwargs).model_dump()


def _steps_of(
    num_epochs: int, structures: int | None, val_fraction: float | None, batch_size: int
) -> int | None:
    if not structures:
        return None
    kept = structures - (round(structures * val_fraction) if val_fraction else 0)
    return num_epochs * math.ceil(max(kept, 1) / batch_size)


def scaffold_job(
    workflow: str,
    model: str,
    *,
    datasets: list[str],
    output_dir: str,
    lr: float = QUICKSTART.lr,
    minutes: float | None = None,
    num_steps: int | None = None,
    num_epochs: int | None = None,
    device: str = "cpu",
    dtype_policy: str = "strict",
    trainable_patterns: tuple[str, ...] = (),
    freeze_patterns: tuple[str, ...] = (),
    validation_datasets: tuple[str, ...] = (),
    val_fraction: float | None = None,
    validation_every_epochs: int | None = None,
    validation_every_steps: int | None = None,
    batch_size: int | str = QUICKSTART.batch_size,
    max_atoms: int | None = None,
    max_edges: int | None = None,
    in_memory: bool | None = None,
    structures: int | None = None,
    stress: bool = False,
    source: dict[str, Any] | None = None,
    model_specs: dict[str, Any] | None = None,
    name: str | None = None,
    notes: str | None = None,
    finetune: dict[str, Any] | None = None,
    trunk_lr: tuple[float, str | None] | None = None,
    committee: int | None = None,
) -> dict[str, Any]:
    """A complete job as a dict.

    ``minutes`` (a time budget) or ``num_steps`` / ``num_epochs`` set the length;
    ``structures`` (the training set's size) gives a ``num_epochs`` job its schedule's exact
    length; ``in_memory=None`` loads files under :data:`IN_MEMORY_BYTES` into memory.
    ``committee=N``: ``model_specs`` holds an N-member committee (the loss is its loss).
    """
    has_validation = bool(validation_datasets) or val_fraction is not None
    checkpoint_dir = str(Path(output_dir) / "checkpoints")
    hooks = [
        checkpoint_hook_entry(
            checkpoint_dir, every_n_steps=validation_every_steps, keep_best=has_validation
        )
    ]
    training = workflow == "train" and bool(model_specs)
    if training:
        hooks.append(hook_entry(EMA_HOOK, decay=QUICKSTART.ema_decay))
        if QUICKSTART.grad_clip_norm:
            hooks.append(hook_entry(CLIP_HOOK, max_norm=QUICKSTART.grad_clip_norm))
    dataset: dict[str, Any] = {"batch_size": batch_size}
    if len(datasets) == 1:
        dataset["path"] = datasets[0]
    else:
        dataset["paths"] = list(datasets)
    if validation_datasets:
        dataset["validation_path"] = (
            validation_datasets[0] if len(validation_datasets) == 1 else list(validation_datasets)
        )
    if val_fraction is not None:
        dataset["val_fraction"] = val_fraction
    for key, value in (("max_atoms", max_atoms), ("max_edges", max_edges)):
        if value is not None:
            dataset[key] = value
    if in_memory is None:
        in_memory = _total_bytes([*datasets, *validation_datasets]) <= IN_MEMORY_BYTES
    if in_memory:
        dataset["in_memory"] = True
    if num_steps is None and num_epochs is None and minutes is None:
        minutes = QUICKSTART.minutes if training else None
        num_steps = None if training else 1000
    schedule_steps = None
    if training and num_epochs is not None and isinstance(batch_size, int):
        schedule_steps = _steps_of(num_epochs, structures, val_fraction, batch_size)
    data: dict[str, Any] = {
        "name": name or _NAMES.get((workflow, model), f"{workflow}-{_model_name(model_specs)}"),
        "workflow": workflow,
        "source": {"model": model, **(source or {}), "hooks": hooks},
        "dataset": dataset,
        "output": {
            "run_dir": output_dir,
            "checkpoint_dir": checkpoint_dir,
            "log_every_n_steps": QUICKSTART.log_every_n_steps,
        },
        "strategy": scaffold_payload(
            lr=lr,
            num_steps=num_steps,
            num_epochs=num_epochs,
            device=device,
            dtype_policy=dtype_policy,
            trainable_patterns=trainable_patterns,
            freeze_patterns=freeze_patterns,
            model_specs=model_specs,
            has_validation=has_validation,
            schedule_steps=schedule_steps,
            stress=stress,
            trunk_lr=trunk_lr,
            committee=committee,
            # mace-torch heads share the readout layers: "the head" is every readout
            head_pattern="model.readouts.*" if model == "mace" else None,
        ),
    }
    if minutes is not None:
        data["minutes"] = float(minutes)
    if notes:
        data["notes"] = notes
    if finetune is not None:
        data["finetune"] = dict(finetune)
    if has_validation:
        data["validation"] = (
            {"every_n_steps": validation_every_steps}
            if validation_every_steps
            else {"every_n_epochs": validation_every_epochs or 1}
        )
    return data


def _model_name(model_specs: dict[str, Any] | None) -> str:
    """``"painn"`` for a job training the built-in PaiNN (the class name, lower case)."""
    path = ((model_specs or {}).get("main") or {}).get("cls_path")
    return str(path).rsplit(".", 1)[-1].lower() if path else "custom"


def _total_bytes(paths: list[str]) -> int:
    total = 0
    for path in map(Path, paths):
        if path.is_file():
            total += path.stat().st_size
        elif path.is_dir():
            total += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        else:
            return IN_MEMORY_BYTES + 1  # unknown (a URI, a missing file): do not assume
    return total


def template_job(workflow: str = "train", model: str = "custom") -> dict[str, Any]:
    """A template job with placeholder paths (``schema template``): PaiNN with a 10-minute
    budget, or a 1000-step fine-tune of a ``model`` source."""
    common = {
        "datasets": ["data/train.extxyz"],
        "device": "cpu",
        "in_memory": True,
        "validation_datasets": ("data/valid.extxyz",),
    }
    if workflow == "train":
        return scaffold_job(
            "train",
            "custom",
            output_dir="runs/train",
            minutes=10.0,
            model_specs={"main": painn_model_spec()},
            source={"fit_to_data": True},
            **common,
        )
    if model not in ("native-checkpoint", "mace", "custom"):
        raise ValueError(f"unknown model source {model!r}; use native-checkpoint, mace or custom")
    source, patterns = {
        "native-checkpoint": (
            {"checkpoint_path": "runs/pretrain/checkpoints"},
            ("main.readout.*",),
        ),
        "custom": ({"checkpoint_path": "runs/pretrain/model.pt"}, ()),
        "mace": (
            {"checkpoint_path": "models/mace.model", "compile_model": False},
            ("main.model.readouts.*",),
        ),
    }[model]
    return scaffold_job(
        "finetune",
        model,
        output_dir="runs/finetune",
        lr=1e-5,
        num_steps=1000,
        source=source,
        trainable_patterns=patterns,
        **common,
    )
