"""Resolve the dotted paths of a job: loss, optimizers, models, hooks, ``training_fn``.

:func:`check_job` resolves everything a job names through the import allow-list of
:mod:`nvalchemi._serialization` (``trust=False`` unless the user passes ``--trust``),
builds the loss and the runtime hooks, and checks the model specs' keyword arguments
against their classes -- without building a model or loading data. Errors name the
job field (``strategy.optimizer_configs.main[0]``) and the fix.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nvalchemi.training.cli._errors import CLIError
from nvalchemi.training.cli.job_spec import RuntimeHookSpec, TrainingJobSpec, with_timestamps

__all__ = ["ResolvedJob", "build_hooks", "check_job", "parse_spec"]

_UNSAFE_FIX = (
    "name classes from nvalchemi.*, torch.nn.*, torch.optim.* (the import allow-list); for "
    "your own code list its module in the job's `imports:` (or pass --allow-import PKG); or "
    "pass --trust if you wrote this job file yourself"
)


@dataclass
class ResolvedJob:
    """What :func:`check_job` found: built loss, optimizer configs, hooks, model classes."""

    loss_fn: Any = None
    optimizer_configs: dict[str, list[Any]] = field(default_factory=dict)
    model_classes: dict[str, type] = field(default_factory=dict)
    hooks: list[tuple[Any, str | None]] = field(default_factory=list)
    devices: list[Any] = field(default_factory=list)


_GENERIC_FIX = (
    "correct the value named above (`nvalchemi-training schema template` prints a complete, "
    "valid job)"
)
_MISSING_ATTR = re.compile(r"Cannot import '([\w.]+)': '([\w.]+)' has no attribute '(\w+)'")
_KWARGS = re.compile(
    r"(?:Invalid|Missing required) (optimizer|scheduler) kwargs for \w+: (\[[^\]]*\])"
)


def _spelling_fix(message: str) -> str | None:
    """A fix for an unresolvable dotted path, with the closest name when one is close."""
    match = _MISSING_ATTR.search(message)
    markers = ("Could not resolve cls_path", "importable class", "Cannot import")
    if match is None and not any(marker in message for marker in markers):
        return None
    fix = "check the spelling and the import path of the class"
    if match is not None:
        module = sys.modules.get(match.group(2))  # already imported by the failed lookup
        names = [n for n in dir(module) if not n.startswith("_")] if module else []
        close = difflib.get_close_matches(match.group(3), names, n=1)
        if close:
            fix = f"did you mean '{match.group(2)}.{close[0]}'? Otherwise {fix}"
    return f"{fix} (`nvalchemi-training schema template` prints a job with valid class paths)"


def _pydantic_fail(where: str, exc: Any, fix: str | None) -> CLIError:
    """One paragraph from a pydantic ``ValidationError``: field paths and messages only."""
    from nvalchemi.training.cli._errors import _validation_lines

    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {}
    loc = ".".join(str(part) for part in first.get("loc", ()) if part != "__root__")
    message = "; ".join(_validation_lines(exc)) if len(errors) > 1 else ""
    if not message:
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    field = f"{where}.{loc}" if loc else where
    kwargs = _KWARGS.search(message)
    if kwargs is not None and not loc:
        field = f"{where}.{kwargs.group(1)}_kwargs"
        names = re.findall(r"'(\w+)'", kwargs.group(2))
        if len(names) == 1:
            field = f"{field}.{names[0]}"
        if fix is None and message.startswith("Invalid"):
            fix = "remove or respell the keyword(s); the accepted ones are listed"
        elif fix is None:
            fix = f"add them to {kwargs.group(1)}_kwargs"
    return CLIError(message, field=field, fix=fix or _spelling_fix(message) or _GENERIC_FIX)


def _fail(where: str, exc: BaseException, fix: str | None = None) -> CLIError:
    from pydantic import ValidationError

    from nvalchemi._serialization import UnsafeImportError

    if isinstance(exc, ValidationError):
        return _pydantic_fail(where, exc, fix)
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, UnsafeImportError):
        return CLIError(message, field=where, fix=fix or _UNSAFE_FIX)
    return CLIError(message, field=where, fix=fix or _spelling_fix(message) or _GENERIC_FIX)


_TORCH_NAMES = {"learning rate": "lr", "epsilon": "eps", "beta parameter": "betas"}


def _check_values(config: Any, where: str) -> None:
    """Build the optimizer (and scheduler) on a dummy parameter: bad values fail here.

    ``lr: -1`` passes the signature check but not ``torch.optim``'s range checks; the
    error names the keyword it is about (``...optimizer_kwargs.lr``).
    """
    import torch

    try:
        config.build([torch.nn.Parameter(torch.zeros(1))], where=where)
    except Exception as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        lowered = message.lower()
        for label, kwargs in (
            ("optimizer_kwargs", config.optimizer_kwargs),
            ("scheduler_kwargs", config.scheduler_kwargs),
        ):
            names = [n for n in kwargs if re.search(rf"\b{re.escape(n)}\b", message)]
            names += [n for text, n in _TORCH_NAMES.items() if text in lowered and n in kwargs]
            if names:
                value = kwargs[names[0]]
                raise CLIError(
                    message,
                    field=f"{where}.{label}.{names[0]}",
                    fix=f"give {names[0]} a valid value (got {value!r}; e.g. lr > 0)"
                    if names[0] == "lr"
                    else f"give {names[0]} a valid value (got {value!r})",
                ) from None
        raise CLIError(
            message, field=where, fix="fix optimizer_kwargs / scheduler_kwargs (types and ranges)"
        ) from None


def parse_spec(data: Any, where: str, trust: bool) -> Any:
    """A ``BaseSpec`` from a job's spec dict (``CLIError`` naming ``where`` on failure)."""
    from nvalchemi.training.spec import create_model_spec_from_json

    if not isinstance(data, Mapping):
        raise CLIError(
            f"expected a spec object with 'cls_path'; got {type(data).__name__}", field=where
        )
    data = with_timestamps(data)
    try:
        return create_model_spec_from_json(data, trust=trust)
    except Exception as exc:
        raise _fail(where, exc) from None


def parse_loss(payload: Mapping[str, Any], trust: bool) -> Any:
    """The loss function built from ``strategy.loss_fn_spec``."""
    spec = parse_spec(payload["loss_fn_spec"], "strategy.loss_fn_spec", trust)
    try:
        return spec.build()
    except Exception as exc:
        raise _fail("strategy.loss_fn_spec", exc) from None


def parse_optimizer_configs(payload: Mapping[str, Any], trust: bool) -> dict[str, list[Any]]:
    """``{model key: [OptimizerConfig, ...]}`` from ``strategy.optimizer_configs``."""
    from nvalchemi.training.optimizers import OptimizerConfig

    raw = payload["optimizer_configs"]
    if not isinstance(raw, Mapping) or not raw:
        raise CLIError(
            "must map model keys to lists of optimizer specs, e.g. {'main': [...]}",
            field="strategy.optimizer_configs",
        )
    out: dict[str, list[Any]] = {}
    for key, entries in raw.items():
        if not isinstance(entries, list) or not entries:
            raise CLIError(
                "must be a non-empty list of optimizer specs",
                field=f"strategy.optimizer_configs.{key}",
            )
        configs = []
        for i, entry in enumerate(entries):
            where = f"strategy.optimizer_configs.{key}[{i}]"
            spec = parse_spec(entry, where, trust)
            try:
                config = OptimizerConfig.from_spec(spec)
            except Exception as exc:
                raise _fail(where, exc) from None
            _check_values(config, where)
            configs.append(config)
        out[key] = configs
    return out


def parse_devices(payload: Mapping[str, Any]) -> list[Any]:
    import torch

    devices = payload["devices"]
    if isinstance(devices, str):
        devices = [devices]
    if not isinstance(devices, list) or not devices:
        raise CLIError("must be a list of device strings such as ['cpu']", field="strategy.devices")
    try:
        return [torch.device(d) for d in devices]
    except (TypeError, RuntimeError) as exc:
        raise _fail("strategy.devices", exc, "use 'cpu', 'cuda' or 'cuda:0'") from None


def _check_training_fn(payload: Mapping[str, Any], trust: bool) -> None:
    from nvalchemi._serialization import import_path

    path = payload.get("training_fn", "nvalchemi.training.strategy.default_training_fn")
    if not isinstance(path, str):
        raise CLIError("must be a dotted path string", field="strategy.training_fn")
    try:
        fn = import_path(path, trust=trust)
    except Exception as exc:
        raise _fail("strategy.training_fn", exc) from None
    if not callable(fn):
        raise CLIError(f"{path!r} is not callable", field="strategy.training_fn")


def _check_model_specs(payload: Mapping[str, Any], trust: bool) -> dict[str, type]:
    specs = payload.get("model_specs") or {}
    if not isinstance(specs, Mapping):
        raise CLIError("must map model keys to model specs", field="strategy.model_specs")
    classes = {}
    for key, data in specs.items():
        where = f"strategy.model_specs.{key}"
        spec = parse_spec(data, where, trust)
        target = spec.target()
        unknown = [name for name in spec.kwargs if not spec.accepts_kwarg(name)]
        if unknown:
            raise CLIError(
                f"{spec.cls_path} does not accept keyword(s) {unknown}",
                field=where,
                fix="remove them or fix their spelling",
            )
        classes[key] = target
    patches = payload.get("module_patches") or {}
    if not isinstance(patches, Mapping):
        raise CLIError("must map module paths to specs", field="strategy.module_patches")
    for target, data in patches.items():
        parse_spec(data, f"strategy.module_patches.{target}", trust)
    return classes


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
            kwargs = {}
            if "stage" in spec.kwargs:
                value = spec.kwargs["stage"]
                try:
                    kwargs["stage"] = (
                        TrainingStage(value)
                        if isinstance(value, int)
                        else TrainingStage[str(value).removeprefix("TrainingStage.")]
                    )
                except (KeyError, ValueError):
                    raise CLIError(
                        f"unknown stage {value!r}", field=f"{where}.spec.stage"
                    ) from None
            try:
                hook = spec.build(**kwargs)
            except Exception as exc:
                raise _fail(f"{where}.spec", exc) from None
            if stage is not None:
                try:
                    hook.stage = TrainingStage[stage]
                except (AttributeError, TypeError, ValueError) as exc:
                    raise _fail(
                        f"{where}.stages", exc, "this hook chooses its own stages; drop 'stages'"
                    ) from None
            if not (isinstance(hook, (Hook, CheckpointableHook)) or is_update_hook(hook)):
                raise CLIError(
                    f"spec built {type(hook).__name__}, which does not satisfy Hook, "
                    "CheckpointableHook, or TrainingUpdateHook",
                    field=f"{where}.spec.cls_path",
                )
            out.append((hook, stage))
    return out


def check_job(job: TrainingJobSpec, *, trust: bool = False) -> ResolvedJob:
    """Resolve and check every dotted path of ``job`` (no model built, no data read)."""
    payload = job.strategy
    resolved = ResolvedJob()
    if "loss_fn_spec" in payload:
        resolved.loss_fn = parse_loss(payload, trust)
    if "optimizer_configs" in payload:
        resolved.optimizer_configs = parse_optimizer_configs(payload, trust)
    resolved.devices = parse_devices(payload)
    _check_training_fn(payload, trust)
    resolved.model_classes = _check_model_specs(payload, trust)
    resolved.hooks = build_hooks(job.source.hooks, trust)
    return resolved
