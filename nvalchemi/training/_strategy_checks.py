"""Checks and normalisation behind :class:`~nvalchemi.training.TrainingStrategy`'s fields.

Construction-time only: optimizer-config shapes, ``training_fn`` call shapes, hook
uniqueness, ``DO_*`` slot claims and hook dependencies, saved RNG states.
"""

from __future__ import annotations

import base64
import inspect
import sys
import typing
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nvalchemi.training.hooks.update import TrainingUpdateOrchestrator, _hook_claims_stage
from nvalchemi.training.optimizers import OptimizerConfig
from nvalchemi.training.stages import TrainingStage

__all__: list[str] = []

_DO_STAGES = (TrainingStage.DO_BACKWARD, TrainingStage.DO_OPTIMIZER_STEP)


def _decode_rng_state(value: Any) -> torch.Tensor | None:
    if value is None:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (TypeError, ValueError):
        raw = b""
    if not raw:
        raise ValueError(
            "runtime_state['epoch_rng_state'] must be the base64 string runtime_state() "
            f"wrote; got {str(value)[:40]!r}. Remove the entry to resume without it."
        )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _normalize_configs(configs: Any, single: bool) -> Any:
    if configs is None:
        return {}
    if isinstance(configs, (OptimizerConfig, list, tuple)):
        if not single:
            raise ValueError(
                "Unkeyed optimizer_configs require single-model input; key them by model name, "
                "e.g. optimizer_configs={'student': [OptimizerConfig(...)]}."
            )
        configs = {"main": configs}
    if isinstance(configs, Mapping):
        out = {}
        for key, value in configs.items():
            key = "main" if key == 0 else key
            out[key] = [value] if isinstance(value, OptimizerConfig) else value
        return out
    return configs


def _resolve_dotted(path: str) -> Any:
    import importlib.util

    from nvalchemi._serialization import UnsafeImportError, import_path

    if "." not in path:
        raise ValueError(f"training_fn {path!r}: expected 'module.attribute'.")
    top = path.split(".")[0]
    if top not in sys.modules and importlib.util.find_spec(top) is None:
        raise ValueError(f"training_fn {path!r}: module {top!r} not found.")
    try:
        return import_path(path)  # the trust rule: a string never imports a new module
    except UnsafeImportError as exc:
        raise ValueError(f"training_fn {path!r}: {exc} Or pass the function itself.") from None
    except (AttributeError, ImportError, ValueError) as exc:
        raise ValueError(
            f"training_fn {path!r} has no attribute or cannot be imported: {exc}"
        ) from None


def _check_call_shape(fn: Any, single: bool) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(object(), object())
    except TypeError:
        raise ValueError(
            "training_fn must accept exactly the two arguments (model_or_models, batch); "
            f"{getattr(fn, '__name__', fn)!r} has signature {signature}."
        ) from None
    params = list(signature.parameters.values())
    if not params or params[0].kind not in (
        params[0].POSITIONAL_ONLY,
        params[0].POSITIONAL_OR_KEYWORD,
    ):
        return
    annotation = _first_annotation(fn, params[0])
    kind = _annotation_kind(annotation)
    name = getattr(fn, "__name__", repr(fn))
    if single and kind == "mapping":
        raise ValueError(
            f"training_fn {name!r} annotates its first parameter as a mapping of models, but "
            "this is a single-model strategy (models=model passes one module). Pass "
            "models={'name': model} or annotate the parameter as a module."
        )
    if not single and kind == "module":
        raise ValueError(
            f"training_fn {name!r} annotates its first parameter as a single model, but this "
            "strategy has named models (a dict is passed). Pass models=model for single-model "
            "training, or annotate the parameter as a mapping (dict[str, nn.Module])."
        )


def _first_annotation(fn: Any, param: inspect.Parameter) -> Any:
    try:
        hints = typing.get_type_hints(fn)
        if param.name in hints:
            return hints[param.name]
    except Exception:
        pass
    return param.annotation


def _annotation_kind(annotation: Any) -> str | None:
    if annotation is inspect.Parameter.empty or annotation is Any or isinstance(annotation, str):
        return None
    origin = typing.get_origin(annotation)
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        kinds = {_annotation_kind(a) for a in typing.get_args(annotation) if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    target = origin or annotation
    if not isinstance(target, type):
        return None
    if issubclass(target, (Mapping, nn.ModuleDict)) or target is dict:
        return "mapping"
    if issubclass(target, nn.Module) or _is_model_mixin(target):
        return "module"
    return None


def _is_model_mixin(target: type) -> bool:
    """Whether ``target`` is ``BaseModelMixin`` or a subclass (a model type, not a mapping)."""
    from nvalchemi.models.base import BaseModelMixin  # models is a lower layer

    return issubclass(target, BaseModelMixin)


def _check_unique(hooks: list[Any]) -> None:
    seen: set[int] = set()
    duplicates = []
    for hook in hooks:
        if id(hook) in seen:
            duplicates.append(type(hook).__name__)
        seen.add(id(hook))
    if duplicates:
        raise ValueError(
            f"hooks must not contain duplicate hook instances; repeated: {duplicates}. Create "
            "a separate instance for each registration."
        )


def _check_do_claims(hooks: list[Any], candidate: Any = None, stage: Any = None) -> None:
    for do_stage in _DO_STAGES:
        claimants = [
            h
            for h in hooks
            if (h is candidate and stage is not None and stage == do_stage)
            or _hook_claims_stage(h, do_stage)
        ]
        if len(claimants) > 1:
            names = ", ".join(type(h).__name__ for h in claimants)
            hint = (
                " Implement the plain hook as a TrainingUpdateHook so the orchestrator runs it."
                if any(isinstance(h, TrainingUpdateOrchestrator) for h in claimants)
                else " Keep one replacement hook per slot."
            )
            raise ValueError(
                f"At most one hook may claim {do_stage.name}; got {len(claimants)}: {names}.{hint}"
            )


def _validate_dependencies(hooks: list[Any]) -> None:
    for hook in hooks:
        check = getattr(hook, "_validate_registered_hooks", None)
        if callable(check):
            check(list(hooks))
