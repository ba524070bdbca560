"""Warnings about a job that is valid but probably not what you want, each with its fix.

:func:`job_warnings` inspects a job without loading models or data (``spec report``).
:func:`check_horizons` tells whether a fixed-length schedule covers the steps a run trains
(``--num-steps`` changes the run's length, not the schedule's: a cosine climbs back up,
``OneCycleLR`` fails).

Example:
    >>> from nvalchemi.app.jobs import TrainingJobSpec
    >>> job = TrainingJobSpec.template()
    >>> job["dataset"]["path"] = "missing.extxyz"
    >>> [(w.check, w.field) for w in job_warnings(TrainingJobSpec.model_validate(job))][:1]
    [('Missing local path', 'dataset.path')]
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError
from nvalchemi.app.jobs.scaffold import CHECKPOINT_HOOK
from nvalchemi.app.jobs.spec import TrainingJobSpec

__all__ = ["Horizon", "JobWarning", "check_horizons", "job_warnings", "scheduler_horizons"]


@dataclass(frozen=True)
class JobWarning:
    """One finding: ``level`` ("info", "warning" or "danger"), what and where, and the fix."""

    level: str
    check: str
    message: str
    field: str | None = None
    fix: str | None = None


def _local_paths(job: TrainingJobSpec) -> list[tuple[str, str]]:
    paths = [("dataset.path", p) for p in job.dataset.all_paths]
    paths += [("dataset.validation_path", p) for p in job.dataset.validation_paths]
    if job.source.checkpoint_path:
        paths.append(("source.checkpoint_path", job.source.checkpoint_path))
    if job.source.mace and job.source.mace.atomic_energies_path:
        paths.append(("source.mace.atomic_energies_path", job.source.mace.atomic_energies_path))
    return [(field, p) for field, p in paths if "://" not in p]


def _optimizer_entries(job: TrainingJobSpec) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"strategy.optimizer_configs.{key}[{i}]", e)
        for key, entries in (job.strategy.optimizer_configs or {}).items()
        for i, e in enumerate(entries)
    ]


def _max_lr(job: TrainingJobSpec) -> tuple[float, str] | None:
    rates = []
    for where, entry in _optimizer_entries(job):
        for block, key in (("optimizer_kwargs", "lr"), ("scheduler_kwargs", "max_lr")):
            value = (entry.get(block) or {}).get(key)
            if isinstance(value, (int, float)):
                rates.append((float(value), f"{where}.{block}.{key}"))
    return max(rates) if rates else None


def _checkpoint_hooks(job: TrainingJobSpec) -> list[tuple[int, dict[str, Any]]]:
    return [
        (i, h.spec)
        for i, h in enumerate(job.source.hooks)
        if h.spec.get("cls_path") == CHECKPOINT_HOOK
    ]


def _devices(job: TrainingJobSpec) -> Iterator[JobWarning]:
    devices = [str(d) for d in job.strategy.devices]
    if any(d.startswith("cuda") for d in devices):
        import torch

        if not torch.cuda.is_available():
            yield JobWarning(
                "danger",
                "Device selection",
                f"devices {devices} ask for CUDA, which is not available here",
                "strategy.devices",
                "set strategy.devices to ['cpu'], or run on a GPU machine",
            )
        return
    yield JobWarning(
        "info",
        "Device selection",
        f"training runs on {devices[0]} (no GPU requested)",
        "strategy.devices",
    )


def _dtype(job: TrainingJobSpec) -> Iterator[JobWarning]:
    """Likely model/label dtype mismatch under the strict loss dtype policy."""
    loss = job.strategy.loss_fn_spec or {}
    if loss.get("dtype_policy") not in (None, "strict"):
        return
    labels = f"float{job.dataset.dtype[-2:]}"
    if job.source.model == "mace":
        model = "float64 (mace-torch models usually are)"
        mismatch = labels != "float64"
    else:
        dtypes = {
            str(spec.get("dtype")).removeprefix("torch.")
            for spec in job.strategy.model_specs.values()
            if spec.get("dtype")
        }
        model = ", ".join(sorted(dtypes))
        mismatch = bool(dtypes) and dtypes != {labels}
    if not mismatch:
        return
    yield JobWarning(
        "warning",
        "Loss dtype",
        f"model outputs are {model} but labels read from extxyz/db files are {labels} "
        "(dataset.dtype) and the loss is strict",
        "strategy.loss_fn_spec.dtype_policy",
        "set it to target_to_prediction (train init --loss-dtype-policy), or set dataset.dtype",
    )


def _length(job: TrainingJobSpec) -> Iterator[JobWarning]:
    payload = job.strategy
    fixed = payload.num_steps is not None or payload.num_epochs is not None
    if job.minutes is None:
        return
    if fixed:
        which = "num_steps" if payload.num_steps is not None else "num_epochs"
        yield JobWarning(
            "info",
            "Time budget",
            f"the job has a fixed length (strategy.{which}) and minutes: {job.minutes:g}; the "
            "fixed length wins and the budget only caps the run (a warning says so when "
            "the first steps show that it is too short)",
            f"strategy.{which}",
            f"set strategy.{which} to null to fit the run to the budget",
        )
        return
    fitted = [
        w
        for w, e in _optimizer_entries(job)
        if str(e.get("scheduler_cls", "")).endswith("WarmupCosineLR")
    ]
    others = [w for w, e in _optimizer_entries(job) if e.get("scheduler_cls") and w not in fitted]
    yield JobWarning(
        "info",
        "Time budget",
        f"the run's length is fitted to {job.minutes:g} min after timing its first steps "
        "(validation and checkpoints included)"
        + ("; so is the learning-rate schedule (WarmupCosineLR)" if fitted else ""),
        "minutes",
        "spec run --minutes M overrides it",
    )
    if others:
        yield JobWarning(
            "warning",
            "Schedule not fitted",
            f"the scheduler of {others[0]} has a fixed length: it is not fitted to the budget",
            f"{others[0]}.scheduler_cls",
            "use nvalchemi.training.time_budget.WarmupCosineLR (what train init writes)",
        )


def _checkpoints(job: TrainingJobSpec) -> Iterator[JobWarning]:
    hooks = _checkpoint_hooks(job)
    out_dir = job.output.checkpoint_dir
    if not out_dir and not hooks:
        yield JobWarning(
            "warning",
            "Restart checkpoints",
            "no CheckpointHook in source.hooks: the run cannot be resumed",
            "source.hooks",
            "add a CheckpointHook (train init writes one)",
        )
        return
    if not hooks:
        yield JobWarning(
            "warning",
            "Checkpoint hook",
            f"output.checkpoint_dir is {out_dir} but source.hooks has no CheckpointHook, so "
            "nothing is written there",
            "source.hooks",
            "add a CheckpointHook writing there",
        )
        return
    index, first = hooks[0]
    if out_dir and all(Path(str(h.get("checkpoint_dir"))) != Path(out_dir) for _, h in hooks):
        yield JobWarning(
            "warning",
            "Checkpoint hook",
            f"the CheckpointHook writes to {first.get('checkpoint_dir')}, not to "
            f"output.checkpoint_dir ({out_dir})",
            f"source.hooks[{index}].spec.checkpoint_dir",
            "make the two paths the same",
        )
    source = job.source.checkpoint_path
    if source and any(
        Path(str(h.get("checkpoint_dir"))).resolve() == Path(source).resolve() for _, h in hooks
    ):
        yield JobWarning(
            "danger",
            "Checkpoint overwrite",
            f"the CheckpointHook writes into the source checkpoint {source}",
            f"source.hooks[{index}].spec.checkpoint_dir",
            "use a new output directory",
        )


def _fine_tune(job: TrainingJobSpec) -> Iterator[JobWarning]:
    source, payload = job.source, job.strategy
    freeze, trainable = job.patterns
    if source.model == "mace" and source.compile_model:
        yield JobWarning(
            "warning",
            "MACE compile",
            "compile_model=true: torch.compile makes a MACE model inference-only (its "
            "parameters frozen), so a fine-tune trains the model uncompiled and ignores it",
            "source.compile_model",
            "remove it (MACEWrapper.from_checkpoint(..., compile_model=True) is for inference)",
        )
    if not (freeze or trainable):
        yield JobWarning(
            "warning",
            "Full model update",
            "no freeze/trainable patterns: every parameter of the pretrained model trains",
            "strategy.trainable_patterns",
            "e.g. --trainable-pattern 'main.readout.*'",
        )
    if not (trainable or payload.module_patches):
        yield JobWarning(
            "info",
            "No adaptation boundary",
            "no trainable patterns or module patches: consider training only the readout",
            "strategy.trainable_patterns",
            "e.g. --trainable-pattern 'main.readout.*'",
        )
    peak = _max_lr(job)
    if peak is not None and peak[0] > 1e-4:
        yield JobWarning(
            "warning",
            "Learning rate",
            f"peak learning rate {peak[0]:g} is high for fine-tuning (> 1e-4); pretrained "
            "features may be destroyed",
            peak[1],
            "lower it to 1e-5 .. 1e-4",
        )
    if source.model == "custom":
        yield JobWarning(
            "info",
            "Custom model reload",
            "the model is rebuilt from strategy.model_specs and its weights are read from "
            f"{source.checkpoint_path} (a state dict, loaded without pickle)",
            "source.checkpoint_path",
        )
    yield from _dropped_outputs(job)
    if source.model == "mace":
        yield JobWarning(
            "warning",
            "Pickle file",
            "MACE model files are Python pickles: spec run needs --trust to load them",
            "source.checkpoint_path",
            "pass --trust",
        )


def _dropped_outputs(job: TrainingJobSpec) -> Iterator[JobWarning]:
    """Outputs the source checkpoint was trained on that the fine-tune's loss leaves out."""
    from nvalchemi.app.jobs.finetune import loss_terms, read_source_recipe

    source = job.source
    path = source.checkpoint_path
    if source.model != "native-checkpoint" or source.use_original_loss or not path:
        return
    if "://" in path or not Path(path).is_dir():
        return  # "Missing local path" says so
    try:
        recipe = read_source_recipe(path, source.checkpoint_index)
    except (OSError, ValueError):
        return  # spec run names what is wrong with the checkpoint
    kept = loss_terms(job.strategy.loss_fn_spec)
    for output, (term, weight) in loss_terms(recipe.loss_fn_spec).items():
        if output in kept:
            continue
        how = f"weight {weight:g}" if isinstance(weight, (int, float)) else str(weight)
        yield JobWarning(
            "warning",
            "Dropped output",
            f"the source checkpoint was trained on {output} ({term}, {how}) but this "
            f"fine-tune's loss has no {output} term: its {output} predictions are no longer "
            "trained and may drift",
            "strategy.loss_fn_spec",
            f"add a {term} term back to the loss"
            + (
                " (finetune init checkpoint --stress writes it; the data needs stress labels)"
                if output == "stress"
                else ""
            ),
        )


def job_warnings(job: TrainingJobSpec) -> list[JobWarning]:
    """Every warning that applies to ``job`` (empty when it looks fine), in file order."""
    return list(_warnings(job))


def _warnings(job: TrainingJobSpec) -> Iterator[JobWarning]:
    for field, path in _local_paths(job):
        if not Path(path).exists():
            yield JobWarning(
                "danger",
                "Missing local path",
                f"{path} does not exist",
                field,
                "check the path (relative paths are relative to the job file)",
            )
    if job.workflow == "finetune":
        yield from _fine_tune(job)
    if not job.dataset.has_validation:
        yield JobWarning(
            "warning",
            "Validation data",
            "no validation data: nothing tracks generalization and no best checkpoint is kept",
            "dataset.val_fraction",
            "set dataset.validation_path or dataset.val_fraction",
        )
    yield from _checkpoints(job)
    if job.source.use_original_opt_class:
        yield JobWarning(
            "info",
            "Optimizer reuse",
            "optimizer/scheduler classes and kwargs come from the checkpoint; lr is set to "
            f"source.optimizer_lr={job.source.optimizer_lr}",
            "source.use_original_opt_class",
        )
    if job.source.use_original_loss:
        yield JobWarning(
            "info",
            "Loss reuse",
            "the loss comes from the checkpoint",
            "source.use_original_loss",
        )
    if job.workflow == "train" and not job.strategy.model_specs:
        yield JobWarning(
            "danger",
            "Model spec",
            "strategy.model_specs is empty: spec run has no model to train",
            "strategy.model_specs",
            "scaffold with `train init --model painn`, or add a create_model_spec(...) dump",
        )
    yield from _length(job)
    yield from _dtype(job)
    yield from _devices(job)


# ---------------------------------------------------------------------- schedule lengths
_KEYS = ("T_max", "total_steps", "total_iters")
_AFTER = {
    "CosineAnnealingLR": "the learning rate climbs back up along the cosine",
    "LinearLR": "the learning rate stays at its end value",
    "ConstantLR": "the learning rate stays at its end value",
    "PolynomialLR": "the learning rate stays at its end value",
    "WarmupCosineLR": "the learning rate stays at its end value",
}


@dataclass(frozen=True)
class Horizon:
    """A scheduler that ends after ``steps`` scheduler steps (``key`` in its kwargs)."""

    where: str
    scheduler: str
    key: str
    steps: int


def scheduler_horizons(optimizer_configs: Mapping[str, Any]) -> list[Horizon]:
    """Fixed horizons of the schedulers in ``optimizer_configs`` (job payload or saved recipe).

    Example:
        >>> configs = {"main": [{"scheduler_cls": "torch.optim.lr_scheduler.CosineAnnealingLR",
        ...                      "scheduler_kwargs": {"T_max": 10}}]}
        >>> [h.steps for h in scheduler_horizons(configs)]
        [10]
    """
    out = []
    for key, entries in (optimizer_configs or {}).items():
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            if not isinstance(entry, Mapping) or not entry.get("scheduler_cls"):
                continue
            kwargs = entry.get("scheduler_kwargs") or {}
            where = f"strategy.optimizer_configs.{key}[{i}].scheduler_kwargs"
            cls = entry["scheduler_cls"]
            name = (
                cls.rsplit(".", 1)[-1]
                if isinstance(cls, str)
                else getattr(cls, "__name__", str(cls))
            )
            for horizon_key in _KEYS:
                value = kwargs.get(horizon_key)
                if isinstance(value, int) and not isinstance(value, bool):
                    out.append(Horizon(where, name, horizon_key, value))
                    break
            else:
                epochs, per_epoch = kwargs.get("epochs"), kwargs.get("steps_per_epoch")
                if isinstance(epochs, int) and isinstance(per_epoch, int):
                    out.append(Horizon(where, name, "epochs * steps_per_epoch", epochs * per_epoch))
    return out


def check_horizons(
    optimizer_configs: Mapping[str, Any],
    num_steps: int,
    *,
    warn: bool = True,
    resume: bool = False,
) -> list[str]:
    """Warn (if ``warn``) about schedules shorter than ``num_steps``; returns the texts.

    ``resume``: the configs are a checkpoint's (the schedule's state is restored from it,
    so the fix is a new run or fine-tune rather than an edit of the job).

    Raises:
        FieldError: a ``OneCycleLR`` shorter than ``num_steps`` (torch would stop the run
            with an error once the schedule is used up).
    """
    messages = []
    for h in scheduler_horizons(optimizer_configs):
        if h.steps >= num_steps:
            continue
        field = f"{h.where}.{h.key.split(' ')[0]}"
        fix = f"set {field} to {num_steps} in the job"
        if resume:
            fix = (
                f"start a new run (or `finetune init checkpoint`) with {field} = {num_steps}: "
                "a resumed run keeps the schedule saved in its checkpoint"
            )
        if h.scheduler == "OneCycleLR":
            raise FieldError(
                f"the OneCycleLR schedule ends after {h.key} = {h.steps} steps but the run "
                f"trains {num_steps} (--num-steps); torch fails at step {h.steps + 1}",
                field=field,
                fix=f"{fix}, or train at most {h.steps} steps",
            )
        after = _AFTER.get(h.scheduler, "the schedule is used up")
        text = (
            f"{h.where}: the {h.scheduler} schedule ends at step {h.steps} ({h.key} = "
            f"{h.steps}) but the run trains {num_steps} steps (--num-steps {num_steps}); "
            f"after step {h.steps} {after}. For a complete schedule, {fix}."
        )
        if warn:
            warnings.warn(text, UserWarning, stacklevel=2)
        messages.append(text)
    return messages
