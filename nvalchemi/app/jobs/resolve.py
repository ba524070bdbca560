"""Read a job file and resolve everything it names: a checked job, or one paragraph of errors.

:func:`load_job` reads and validates a job file and calls :func:`check_job`, which resolves
every dotted path through the import allow-list (the strategy by
:meth:`StrategyPayload.resolve`, the hooks by :func:`build_hooks`) and checks that the
models produce every output the loss needs, without building a model or reading data.
Every error is a :class:`~nvalchemi._errors.FieldError` naming the job field and the fix.

Example:
    >>> from nvalchemi.app.jobs import TrainingJobSpec
    >>> job = TrainingJobSpec.model_validate(TrainingJobSpec.template())
    >>> resolved = check_job(job)
    >>> type(resolved.loss_fn).__name__, [type(h).__name__ for h, _ in resolved.hooks]
    ('ComposedLossFunction', ['CheckpointHook', 'EMAHook', 'GradientClipHook'])
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError, validation_lines
from nvalchemi.app.jobs.paths import resolve_job_paths
from nvalchemi.app.jobs.spec import (
    RuntimeHookSpec,
    TrainingJobSpec,
    read_job_file,
    stage_name,
)
from nvalchemi.training.strategy_payload import combined_error, parse_spec, spec_error

__all__ = [
    "ResolvedJob",
    "allow_user_code",
    "build_hooks",
    "check_job",
    "check_outputs",
    "load_job",
    "validate_job_data",
]

_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_DEFAULT_OUTPUTS = {"mace": ("energy", "forces")}  # MACEWrapper's default active outputs


@dataclass
class ResolvedJob:
    """What :func:`check_job` found: built loss, optimizer configs, hooks, model classes."""

    loss_fn: Any = None
    optimizer_configs: dict[str, list[Any]] = field(default_factory=dict)
    model_classes: dict[str, type] = field(default_factory=dict)
    hooks: list[tuple[Any, str | None]] = field(default_factory=list)
    devices: list[Any] = field(default_factory=list)


def allow_user_code(
    modules: Sequence[str],
    directory: str | Path,
    field: str = "imports",
    *,
    own_only: bool = False,
) -> None:
    """Let specs and checkpoints name ``modules`` (a job's ``imports:``, ``--allow-import``),
    found in ``directory`` or the working directory (appended to ``sys.path``).

    With ``own_only`` (a job file's ``imports:`` without ``--trust``) each module must be
    the user's own: a package or module directly in ``directory`` or the working directory,
    neither the standard library nor an installed package; else a :class:`FieldError`
    naming the entry. Nothing is imported here.
    """
    from nvalchemi._serialization import allow_import_path, own_module_problem

    if not modules:
        return
    folders = [str(Path(directory).resolve()), str(Path.cwd())]
    for folder in folders:
        if folder not in sys.path:
            sys.path.append(folder)
    for i, name in enumerate(modules):
        if not isinstance(name, str) or not _MODULE.fullmatch(name):
            raise FieldError(
                f"{name!r} is not a module name",
                field=f"{field}[{i}]",
                fix="list dotted module names such as common or mypkg.models",
            )
        problem = own_module_problem(name, folders) if own_only else None
        if problem is not None:
            raise FieldError(
                f"{name!r} is not your own code: {problem}; a job file's imports name only "
                f"modules of yours next to the job file ({folders[0]}) or in the working "
                f"directory ({folders[1]})",
                field=f"{field}[{i}]",
                fix="remove it; to trust another package, pass --allow-import "
                f"{name.partition('.')[0]} yourself (or --trust if you wrote this job file)",
            )
    for name in modules:
        allow_import_path(name)


def validate_job_data(data: dict[str, Any], where: str) -> TrainingJobSpec:
    """``TrainingJobSpec`` from a mapping; a :class:`FieldError` listing every bad field
    in the order of ``data``."""
    from pydantic import ValidationError

    try:
        return TrainingJobSpec.model_validate(data)
    except ValidationError as exc:
        lines = validation_lines(exc, data)
        count = f"{len(lines)} errors: " if len(lines) > 1 else ""
        raise FieldError(
            f"{where} is not a valid job: {count}" + "; ".join(lines),
            fix="correct the field(s) named above (`nvalchemi-training schema dump` prints "
            "the schema)",
        ) from None


def load_job(
    path: str | Path,
    *,
    trust: bool = False,
    allow_imports: Sequence[str] = (),
    minutes: float | None = None,
) -> tuple[TrainingJobSpec, ResolvedJob]:
    """Parse, validate and resolve the job file at ``path`` (its relative paths are taken
    relative to the file; its ``imports:`` and ``allow_imports`` pass the trust rule).

    ``minutes`` (``--minutes``) replaces the job's time budget before it is validated, so
    it also gives a job without a length its length.
    """
    try:
        data = read_job_file(path)
    except FileNotFoundError as exc:
        raise FieldError(
            str(exc).split(";")[0],
            fix="check the path, or create a job with `nvalchemi-training train init ... "
            "--out job.yaml`",
        ) from None
    except ValueError as exc:
        message = str(exc)
        fix = (
            "write the job as one mapping (`nvalchemi-training schema template` prints one)"
            if "must hold a mapping" in message
            else "correct the syntax at the line and column given (JSON: double-quoted keys, "
            "no trailing commas; YAML: closed brackets, consistent indentation)"
        )
        raise FieldError(message, fix=fix) from None
    data = resolve_job_paths(data, Path(path).parent)
    if minutes is not None and isinstance(data, dict):
        data = {**data, "minutes": minutes}
    job = validate_job_data(data, str(path))
    allow_user_code(job.imports, Path(path).parent, own_only=not trust)
    allow_user_code(list(allow_imports), Path(path).parent, field="--allow-import")
    return job, check_job(job, trust=trust)


def _stage(value: Any, where: str) -> Any:
    from nvalchemi.training.stages import TrainingStage

    try:
        return TrainingStage[stage_name(value)]
    except ValueError:
        raise FieldError(
            f"unknown stage {value!r}",
            field=where,
            fix=f"use one of {list(TrainingStage.__members__)}",
        ) from None


def build_hooks(entries: list[RuntimeHookSpec], trust: bool) -> list[tuple[Any, str | None]]:
    """``(hook, stage name or None)`` for every ``source.hooks`` entry (one per stage)."""
    from nvalchemi.hooks.protocol import CheckpointableHook, Hook
    from nvalchemi.training.hooks.update import is_update_hook
    from nvalchemi.training.stages import TrainingStage

    out = []
    for i, entry in enumerate(entries):
        where = f"source.hooks[{i}]"
        for stage in entry.stages or [None]:
            spec = parse_spec(entry.spec, f"{where}.spec", trust)
            _check_hook_class(spec.target(), spec.cls_path, f"{where}.spec.cls_path")
            kwargs = {}
            if "stage" in spec.kwargs:
                kwargs["stage"] = _stage(spec.kwargs["stage"], f"{where}.spec.stage")
            try:
                hook = spec.build(**kwargs)
            except Exception as exc:
                raise spec_error(f"{where}.spec", exc) from None
            if stage is not None:
                try:
                    hook.stage = TrainingStage[stage]
                except (AttributeError, TypeError, ValueError) as exc:
                    raise spec_error(
                        f"{where}.stages", exc, "this hook chooses its own stages; drop 'stages'"
                    ) from None
            if not (isinstance(hook, (Hook, CheckpointableHook)) or is_update_hook(hook)):
                raise FieldError(
                    f"spec built {type(hook).__name__}, which does not satisfy Hook, "
                    "CheckpointableHook, or TrainingUpdateHook",
                    field=f"{where}.spec.cls_path",
                    fix="name a hook class (see nvalchemi.training.hooks)",
                )
            out.append((hook, stage))
    return out


def _check_hook_class(target: Any, path: str, where: str) -> None:
    """Refuse a hook spec whose class cannot make a hook, before it is called.

    A hook is a class whose instances are callable (``__call__(ctx, stage)``) or carry
    checkpointed state (``state_dict``/``load_state_dict``); a classmethod factory is
    judged by its class.
    """
    owner = getattr(target, "__self__", None)
    cls = target if isinstance(target, type) else owner if isinstance(owner, type) else None
    members = set() if cls is None else {n for k in cls.__mro__[:-1] for n in vars(k)}
    if "__call__" in members or {"state_dict", "load_state_dict"} <= members:
        return
    raise FieldError(
        f"{path!r} is not a hook class (a hook's instances are called as hook(ctx, stage)); "
        "nothing was built",
        field=where,
        fix="name a hook class (see nvalchemi.training.hooks)",
    )


def _judge_strategy_specs(job: TrainingJobSpec, trust: bool) -> list[FieldError]:
    """Every spec of ``job.strategy`` read against what receives it, before any is built:
    models and module patches are modules, the loss a loss, each optimizer entry an
    ``OptimizerConfig`` (nested specs: their parameter's annotation)."""
    import torch

    from nvalchemi.spec import create_model_spec_from_json
    from nvalchemi.training.losses.base import BaseLossFunction, ComposedLossFunction
    from nvalchemi.training.optimizers import OptimizerConfig
    from nvalchemi.training.strategy_payload import with_timestamps

    payload = job.strategy
    optimizer = (OptimizerConfig, "nvalchemi.training.optimizers.OptimizerConfig")
    loss = ((BaseLossFunction, ComposedLossFunction), "a loss, e.g. a ComposedLossFunction")
    module = (torch.nn.Module, "a model class (an nn.Module)")
    entries: list[tuple[str, Any, tuple[Any, str]]] = []
    for key, specs in (payload.optimizer_configs or {}).items():
        entries += [
            (f"strategy.optimizer_configs.{key}[{i}]", data, optimizer)
            for i, data in enumerate(specs)
        ]
    if payload.loss_fn_spec is not None:
        entries.append(("strategy.loss_fn_spec", payload.loss_fn_spec, loss))
    for group in ("model_specs", "module_patches"):
        entries += [
            (f"strategy.{group}.{key}", data, module)
            for key, data in getattr(payload, group).items()
        ]
    problems = []
    for where, data, (expect, wanted) in entries:
        if not isinstance(data, dict) or "cls_path" not in data:
            continue  # the resolver names what is missing
        try:
            create_model_spec_from_json(with_timestamps(data), trust=trust, expect=expect)
        except RuntimeError as exc:  # the wrong kind of class
            fix = f"name {wanted} at the key given (nested keys: the class the parameter takes)"
            problems.append(spec_error(where, exc, fix))
        except Exception as exc:
            problems.append(spec_error(where, exc))
    return problems


def _needed_outputs(loss_fn: Any) -> dict[str, str]:
    """``{output: loss component}`` for every model output the loss reads."""
    components = getattr(loss_fn, "components", None) or [loss_fn]
    out = {}
    for component in components:
        key = getattr(component, "prediction_key", None)
        if isinstance(key, str) and key.startswith("predicted_"):
            out.setdefault(key.removeprefix("predicted_"), type(component).__name__)
    return out


def _declared_outputs(job: TrainingJobSpec, resolved: ResolvedJob) -> tuple[set[str], str] | None:
    """``(outputs the model computes, the job field that sets them)``, when the job says."""
    if job.workflow == "train":
        spec = job.strategy.model_specs.get("main")
        cls = resolved.model_classes.get("main")
        if spec is None or cls is None:
            return None
        where = "strategy.model_specs.main.active_outputs"
        if "active_outputs" in spec:
            return set(spec["active_outputs"]), where
        try:
            default = inspect.signature(cls).parameters["active_outputs"].default
        except (KeyError, TypeError, ValueError):
            return None  # a model without that switch: it decides itself
        return (None if default is inspect.Parameter.empty else set(default)), where
    if job.source.active_outputs is not None:
        return set(job.source.active_outputs), "source.active_outputs"
    default = _DEFAULT_OUTPUTS.get(job.source.model)
    return (set(default), "source.active_outputs") if default else None


def check_outputs(job: TrainingJobSpec, resolved: ResolvedJob) -> None:
    """Refuse a job whose loss needs a model output the model is not set to compute
    (a :class:`FieldError` naming the output, the loss term and the field to set)."""
    declared = _declared_outputs(job, resolved)
    if declared is None or declared[0] is None or resolved.loss_fn is None:
        return
    outputs, where = declared
    missing = {k: v for k, v in _needed_outputs(resolved.loss_fn).items() if k not in outputs}
    if not missing:
        return
    names = ", ".join(f"'{k}' (for {v})" for k, v in missing.items())
    wanted = sorted(outputs | set(missing), key=["energy", "forces", "stress"].index)
    raise FieldError(
        f"the loss needs the model output(s) {names}, but the model computes only "
        f"{sorted(outputs)}",
        field=where,
        fix=f"set {where} to {wanted} (`train init --stress` writes it), or drop the loss term",
    )


def check_job(job: TrainingJobSpec, *, trust: bool = False) -> ResolvedJob:
    """Resolve and check every dotted path of ``job`` (no model built, no data read);
    one :class:`FieldError` names the hooks' first problem and every strategy problem."""
    problems = []
    resolved = ResolvedJob()
    try:  # source comes before strategy in a job file: so do its problems
        resolved.hooks = build_hooks(job.source.hooks, trust)
    except FieldError as exc:
        problems.append(exc)
    judged = _judge_strategy_specs(job, trust)
    if judged:
        raise combined_error(problems + judged)
    try:
        strategy = job.strategy.resolve(trust=trust)
        resolved.loss_fn = strategy.loss_fn
        resolved.optimizer_configs = strategy.optimizer_configs
        resolved.devices = strategy.devices
        resolved.model_classes = strategy.model_classes
    except FieldError as exc:
        problems.append(exc)
    if problems:
        raise combined_error(problems)
    check_outputs(job, resolved)
    return resolved
