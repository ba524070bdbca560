"""Scaffolded job specs for ``train init``, ``finetune init`` and ``schema template``.

Every payload is produced from real objects (``loss.to_spec().model_dump()``,
``OptimizerConfig.to_spec()``), so a scaffold always round-trips through
``spec run``. The loss and the PaiNN settings come from
:mod:`nvalchemi.training.cli.recipe`.

Example:
    >>> job = scaffold_job("train", "custom", datasets=["data/train.extxyz"],
    ...                    output_dir="runs/x", lr=1e-3, num_epochs=5, device="cpu")
    >>> job.workflow, job.strategy["num_epochs"], job.strategy["devices"]
    ('train', 5, ['cpu'])
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nvalchemi.training.cli.job_spec import TrainingJobSpec
from nvalchemi.training.cli.recipe import QUICKSTART

__all__ = ["checkpoint_hook_entry", "hook_entry", "scaffold_job", "scaffold_payload"]

CHECKPOINT_HOOK = "nvalchemi.training.hooks.checkpoint.CheckpointHook"
EMA_HOOK = "nvalchemi.training.hooks.ema.EMAHook"
CLIP_HOOK = "nvalchemi.training.hooks.gradients.GradientClipHook"
DEFAULT_TRAINING_FN = "nvalchemi.training.strategy.default_training_fn"
_NAMES = {
    ("train", "custom"): "train-from-scratch",
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
        CHECKPOINT_HOOK, checkpoint_dir=checkpoint_dir, keep_last=QUICKSTART.keep_last,
        **cadence, **extra,
    )  # fmt: skip


def _scheduler(lr: float, num_steps: int | None, has_validation: bool) -> dict[str, Any]:
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
    weight_decay: float = 1e-6,
    trunk_lr: tuple[float, str | None] | None = None,
    head_pattern: str | None = None,
) -> dict[str, Any]:
    """A complete ``strategy`` payload (AdamW, per-atom energy + force MSE, one device).

    ``trunk_lr=(scale, head)``: the trained head (``head``, else the first) learns at
    ``lr`` and everything else at ``scale * lr`` (a parameter group); ``scale == 0``
    trains only the head (a trainable pattern). ``head_pattern`` names the head's
    parameters (relative to the model); default PaiNN's: ``readout.*`` for the first
    head, ``head_readouts.<head>.*`` for added ones.
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
    config = OptimizerConfig(
        optimizer_cls=torch.optim.AdamW,
        optimizer_kwargs={"lr": base_lr, "weight_decay": weight_decay},
        param_groups=groups,
        **_scheduler(base_lr, num_steps, has_validation),
    )
    loss = QUICKSTART.loss_fn(dtype_policy=dtype_policy)
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


def painn_model_spec(cutoff: float | None = None) -> dict[str, Any]:
    """The recipe's PaiNN as a model spec (data-dependent arguments fitted at run time)."""
    from nvalchemi.models.painn import PaiNN
    from nvalchemi.training.spec import create_model_spec

    kwargs = QUICKSTART.model_kwargs()
    if cutoff is not None:
        kwargs["cutoff"] = float(cutoff)
    return create_model_spec(PaiNN, **kwargs).model_dump()


def scaffold_job(
    workflow: str,
    model: str,
    *,
    datasets: list[str],
    output_dir: str,
    lr: float,
    num_steps: int | None = 1000,
    num_epochs: int | None = None,
    device: str = "cpu",
    dtype_policy: str = "strict",
    trainable_patterns: tuple[str, ...] = (),
    freeze_patterns: tuple[str, ...] = (),
    validation_datasets: tuple[str, ...] = (),
    val_fraction: float | None = None,
    validation_every_epochs: int | None = None,
    validation_every_steps: int | None = None,
    batch_size: int = 8,
    source: dict[str, Any] | None = None,
    model_specs: dict[str, Any] | None = None,
    name: str | None = None,
    finetune: dict[str, Any] | None = None,
    trunk_lr: tuple[float, str | None] | None = None,
) -> TrainingJobSpec:
    """A complete job; ``source`` holds the model-specific source keys, ``finetune`` the
    job's ``finetune`` block and ``trunk_lr`` see :func:`scaffold_payload`."""
    has_validation = bool(validation_datasets) or val_fraction is not None
    checkpoint_dir = str(Path(output_dir) / "checkpoints")
    hooks = [
        checkpoint_hook_entry(
            checkpoint_dir, every_n_steps=validation_every_steps, keep_best=has_validation
        )
    ]
    if workflow == "train" and model_specs:
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
    data: dict[str, Any] = {
        "name": name or _NAMES.get((workflow, model), f"{workflow}-{model}"),
        "workflow": workflow,
        "source": {"model": model, **(source or {}), "hooks": hooks},
        "dataset": dataset,
        "output": {"run_dir": output_dir, "checkpoint_dir": checkpoint_dir},
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
            trunk_lr=trunk_lr,
            # mace-torch heads share the readout layers: "the head" is every readout
            head_pattern="model.readouts.*" if model == "mace" else None,
        ),
    }
    if finetune is not None:
        data["finetune"] = dict(finetune)
    if has_validation:
        cadence = (
            {"every_n_steps": validation_every_steps}
            if validation_every_steps
            else {"every_n_epochs": validation_every_epochs or 1}
        )
        data["validation"] = cadence
    return TrainingJobSpec.model_validate(data)
