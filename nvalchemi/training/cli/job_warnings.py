"""Warnings about a job that is valid but probably not what the user wants.

:func:`job_warnings` inspects a :class:`TrainingJobSpec` (and what
:func:`~nvalchemi.training.cli.payload.check_job` resolved) without loading models or
data, and returns ``(level, check, message)`` rows for ``spec report``.

Example:
    >>> from nvalchemi.training.cli.scaffold import scaffold_job
    >>> job = scaffold_job("train", "custom", datasets=["missing.extxyz"], output_dir="runs/x",
    ...                    lr=1e-3, device="cpu")
    >>> [w.check for w in job_warnings(job)][:2]
    ['Missing local path', 'Validation data']
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvalchemi.training.cli.job_spec import TrainingJobSpec

__all__ = ["JobWarning", "job_warnings"]

CHECKPOINT_HOOK = "nvalchemi.training.hooks.checkpoint.CheckpointHook"


@dataclass(frozen=True)
class JobWarning:
    level: str  # "info", "warning" or "danger"
    check: str
    message: str


def _local_paths(job: TrainingJobSpec) -> list[tuple[str, str]]:
    paths = [("dataset", p) for p in job.dataset.all_paths]
    paths += [("dataset.validation_path", p) for p in job.dataset.validation_paths]
    if job.source.checkpoint_path:
        paths.append(("source.checkpoint_path", job.source.checkpoint_path))
    if job.source.mace and job.source.mace.atomic_energies_path:
        paths.append(("source.mace.atomic_energies_path", job.source.mace.atomic_energies_path))
    return [(field, p) for field, p in paths if "://" not in p]


def _max_lr(job: TrainingJobSpec) -> float | None:
    rates = []
    for entries in (job.strategy.get("optimizer_configs") or {}).values():
        for entry in entries if isinstance(entries, list) else []:
            lr = (entry.get("optimizer_kwargs") or {}).get("lr")
            if isinstance(lr, (int, float)):
                rates.append(float(lr))
            max_lr = (entry.get("scheduler_kwargs") or {}).get("max_lr")
            if isinstance(max_lr, (int, float)):
                rates.append(float(max_lr))
    return max(rates) if rates else None


def _checkpoint_hooks(job: TrainingJobSpec) -> list[dict[str, Any]]:
    return [h.spec for h in job.source.hooks if h.spec.get("cls_path") == CHECKPOINT_HOOK]


def _devices(job: TrainingJobSpec) -> list[JobWarning]:
    devices = [str(d) for d in job.strategy.get("devices") or []]
    if not devices:
        return []
    if any(d.startswith("cuda") for d in devices):
        import torch

        if not torch.cuda.is_available():
            return [
                JobWarning(
                    "danger",
                    "Device selection",
                    f"devices {devices} ask for CUDA, which is not available here; set "
                    "strategy.devices to ['cpu'] or run on a GPU machine",
                )
            ]
        return []
    return [
        JobWarning("info", "Device selection", f"training runs on {devices[0]} (no GPU requested)")
    ]


def _dtype(job: TrainingJobSpec) -> list[JobWarning]:
    """Likely model/label dtype mismatch under the strict loss dtype policy."""
    loss = job.strategy.get("loss_fn_spec") or {}
    if loss.get("dtype_policy") not in (None, "strict"):
        return []
    labels = f"float{job.dataset.dtype[-2:]}"
    if job.source.model == "mace":
        model = "float64 (mace-torch models usually are)"
        mismatch = labels != "float64"
    else:
        dtypes = {
            str(spec.get("dtype")).removeprefix("torch.")
            for spec in (job.strategy.get("model_specs") or {}).values()
            if isinstance(spec, dict) and spec.get("dtype")
        }
        model = ", ".join(sorted(dtypes))
        mismatch = bool(dtypes) and dtypes != {labels}
    if not mismatch:
        return []
    return [
        JobWarning(
            "warning",
            "Loss dtype",
            f"model outputs are {model} but labels read from extxyz/db files are {labels} "
            "(dataset.dtype) and the loss is strict: set --loss-dtype-policy "
            "target_to_prediction (or dataset.dtype)",
        )
    ]


def job_warnings(job: TrainingJobSpec) -> list[JobWarning]:
    """Every warning that applies to ``job`` (empty when it looks fine)."""
    out: list[JobWarning] = []
    for field, path in _local_paths(job):
        if not Path(path).exists():
            out.append(
                JobWarning("danger", "Missing local path", f"{field}: {path} does not exist")
            )
    source, payload = job.source, job.strategy
    freeze, trainable = job.patterns
    finetune = job.workflow == "finetune"
    if finetune and source.model == "mace" and source.compile_model:
        out.append(
            JobWarning(
                "warning",
                "MACE compile",
                "compile_model=true is not supported by this build's MACEWrapper; it is ignored",
            )
        )
    if finetune and not (freeze or trainable):
        out.append(
            JobWarning(
                "warning",
                "Full model update",
                "no freeze/trainable patterns: every parameter of the pretrained model trains",
            )
        )
    if finetune and not (trainable or payload.get("module_patches")):
        out.append(
            JobWarning(
                "info",
                "No adaptation boundary",
                "no trainable patterns or module patches: consider training only the readout, "
                "e.g. --trainable-pattern 'main.readout.*'",
            )
        )
    max_lr = _max_lr(job)
    if finetune and max_lr is not None and max_lr > 1e-4:
        out.append(
            JobWarning(
                "warning",
                "Learning rate",
                f"peak learning rate {max_lr:g} is high for fine-tuning (> 1e-4); pretrained "
                "features may be destroyed",
            )
        )
    if not job.dataset.has_validation:
        out.append(
            JobWarning(
                "warning",
                "Validation data",
                "no validation data: set dataset.validation_path or dataset.val_fraction to "
                "track generalization and keep a best checkpoint",
            )
        )
    hooks = _checkpoint_hooks(job)
    if not job.output.checkpoint_dir and not hooks:
        out.append(
            JobWarning(
                "warning",
                "Restart checkpoints",
                "no CheckpointHook in source.hooks: the run cannot be resumed",
            )
        )
    elif not hooks:
        out.append(
            JobWarning(
                "warning",
                "Checkpoint hook",
                f"output.checkpoint_dir is {job.output.checkpoint_dir} but source.hooks has no "
                "CheckpointHook, so nothing is written there; add one",
            )
        )
    elif job.output.checkpoint_dir and all(
        Path(str(h.get("checkpoint_dir"))) != Path(job.output.checkpoint_dir) for h in hooks
    ):
        out.append(
            JobWarning(
                "warning",
                "Checkpoint hook",
                f"the CheckpointHook writes to {hooks[0].get('checkpoint_dir')}, not to "
                f"output.checkpoint_dir ({job.output.checkpoint_dir})",
            )
        )
    if source.checkpoint_path and any(
        Path(str(h.get("checkpoint_dir"))).resolve() == Path(source.checkpoint_path).resolve()
        for h in hooks
    ):
        out.append(
            JobWarning(
                "danger",
                "Checkpoint overwrite",
                f"the CheckpointHook writes into the source checkpoint {source.checkpoint_path}; "
                "use a new output directory",
            )
        )
    if source.use_original_opt_class:
        out.append(
            JobWarning(
                "info",
                "Optimizer reuse",
                "optimizer/scheduler classes and kwargs come from the checkpoint; lr is set "
                f"to source.optimizer_lr={source.optimizer_lr}",
            )
        )
    if source.use_original_loss:
        out.append(JobWarning("info", "Loss reuse", "the loss comes from the checkpoint"))
    if job.workflow == "train" and not payload.get("model_specs"):
        out.append(
            JobWarning(
                "danger",
                "Model spec",
                "strategy.model_specs is empty: spec run has no model to train; scaffold with "
                "`train init --model painn` or add a create_model_spec(...) dump",
            )
        )
    if finetune and source.model == "custom":
        out.append(
            JobWarning(
                "info",
                "Custom model reload",
                "the model is rebuilt from strategy.model_specs and its weights are read from "
                f"{source.checkpoint_path} (a state dict, loaded without pickle)",
            )
        )
    if finetune and source.model == "mace":
        out.append(
            JobWarning(
                "warning",
                "Pickle file",
                "MACE model files are Python pickles: spec run needs --trust to load them",
            )
        )
    out.extend(_dtype(job))
    out.extend(_devices(job))
    return out
