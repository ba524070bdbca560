"""The strategy payload: a ``TrainingStrategy``'s configuration as JSON, checked in one place.

:class:`StrategyPayload` is the shape of ``TrainingStrategy.to_spec_dict()`` (and of the
``strategy`` section of a job file): optimizer configs, duration, devices, the loss, model
specs, the call mode, the training function, the non-finite policy, ``compile`` and the
fine-tuning keys. One pydantic model validates both (types, ranges, unknown keys: every
error at once, each with its field path; a job file may also write ``devices: cpu``);
:meth:`StrategyPayload.resolve` then resolves every dotted path through the import
allow-list of :mod:`nvalchemi._serialization` and builds what can be built without a model
or data -- the loss, the optimizer configs (each optimizer and scheduler is built on a dummy
parameter, so ``lr: -1`` is caught), the devices, the training function, the module patches
and the model classes -- again reporting every problem at once as
:class:`~nvalchemi._errors.FieldError` lines naming the field and the fix.
:meth:`StrategyPayload.build` is the one builder of a strategy from a payload
(``TrainingStrategy.from_spec_dict`` and job files alike); :func:`to_spec_dict` writes one.

Example:
    >>> payload = StrategyPayload.model_validate({
    ...     "optimizer_configs": {"main": [{"cls_path": "nvalchemi.training.optimizers.OptimizerConfig",
    ...                                     "optimizer_cls": "torch.optim.Adam",
    ...                                     "optimizer_kwargs": {"lr": 1e-3}}]},
    ...     "loss_fn_spec": {"cls_path": "nvalchemi.training.losses.terms.EnergyMSELoss"},
    ...     "devices": "cpu", "num_steps": 10})
    >>> resolved = payload.resolve()
    >>> type(resolved.loss_fn).__name__, [str(d) for d in resolved.devices]
    ('EnergyMSELoss', ['cpu'])
"""

from __future__ import annotations

import difflib
import json
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from torch import nn

from nvalchemi._errors import FieldError, field_path, validation_lines
from nvalchemi._serialization import UnsafeImportError, import_path, object_to_path
from nvalchemi.training.model_spec import model_spec_for
from nvalchemi.training.optimizers import OptimizerConfig
from nvalchemi.training.spec import BaseSpec, create_model_spec_from_json

__all__ = [
    "DEFAULT_TRAINING_FN",
    "FINETUNE_KEYS",
    "ResolvedStrategy",
    "StrategyPayload",
    "build_loss",
    "build_optimizer_configs",
    "combined_error",
    "parse_spec",
    "spec_error",
    "strategy_class",
    "from_checkpoint_dict",
    "from_spec_dict",
    "to_checkpoint_dict",
    "to_spec_dict",
    "with_timestamps",
]

DEFAULT_TRAINING_FN = "nvalchemi.training.strategy.default_training_fn"
FINETUNE_KEYS = (
    "module_patches",
    "freeze_patterns",
    "trainable_patterns",
    "freeze_mode",
    "new_heads",
)
_UNSAFE_FIX = (
    "name classes from nvalchemi.*, torch.nn.*, torch.optim.* (the import allow-list); for "
    "your own code list its module in the job's `imports:` (or pass --allow-import PKG); or "
    "pass --trust if you wrote this job file yourself"
)
_GENERIC_FIX = (
    "correct the value named above (`nvalchemi-training schema template` prints a complete, "
    "valid job)"
)
_MISSING_ATTR = re.compile(r"Cannot import '([\w.]+)': '([\w.]+)' has no attribute '(\w+)'")
_KWARGS = re.compile(
    r"(?:Invalid|Missing required) (optimizer|scheduler) kwargs for \w+: (\[[^\]]*\])"
)
_TORCH_NAMES = {"learning rate": "lr", "epsilon": "eps", "beta parameter": "betas"}
_REQUIRED = ("optimizer_configs", "devices", "loss_fn_spec")
_WRITTEN = {"written_by_to_spec_dict": True}
"""Validation context of a spec ``to_spec_dict`` wrote: no job-file shorthand is accepted."""


def with_timestamps(value: Any) -> Any:
    """Fill ``timestamp`` into every spec dict (with ``cls_path``) that lacks it.

    Hand-written job files may leave timestamps out; spec loaders require the key.
    """
    if isinstance(value, dict):
        out = {k: with_timestamps(v) for k, v in value.items()}
        if isinstance(out.get("cls_path"), str):
            out.setdefault("timestamp", "")
        return out
    if isinstance(value, list):
        return [with_timestamps(v) for v in value]
    return value


# ---------------------------------------------------------------------- error messages
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


def _pydantic_error(where: str, exc: Any, fix: str | None) -> FieldError:
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {}
    loc = field_path(first.get("loc", ()))
    message = "; ".join(validation_lines(exc)) if len(errors) > 1 else ""
    if not message:
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    target = f"{where}.{loc}" if loc else where
    kwargs = _KWARGS.search(message)
    if kwargs is not None and not loc:
        target = f"{where}.{kwargs.group(1)}_kwargs"
        names = re.findall(r"'(\w+)'", kwargs.group(2))
        if len(names) == 1:
            target = f"{target}.{names[0]}"
        if fix is None and message.startswith("Invalid"):
            fix = "remove or respell the keyword(s); the accepted ones are listed"
        elif fix is None:
            fix = f"add them to {kwargs.group(1)}_kwargs"
    return FieldError(message, field=target, fix=fix or _spelling_fix(message) or _GENERIC_FIX)


def spec_error(where: str, exc: BaseException, fix: str | None = None) -> FieldError:
    """``exc`` (from resolving or building something at ``where``) as a :class:`FieldError`."""
    if isinstance(exc, FieldError):
        return exc
    if isinstance(exc, ValidationError):
        return _pydantic_error(where, exc, fix)
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, UnsafeImportError):
        return FieldError(message, field=where, fix=fix or _UNSAFE_FIX)
    return FieldError(message, field=where, fix=fix or _spelling_fix(message) or _GENERIC_FIX)


def parse_spec(data: Any, where: str, trust: bool = False) -> Any:
    """A ``BaseSpec`` from a spec dict (:class:`FieldError` naming ``where`` on failure)."""
    if not isinstance(data, Mapping):
        raise FieldError(
            f"expected a spec object with 'cls_path'; got {type(data).__name__}",
            field=where,
            fix="write a mapping with cls_path and the keyword arguments",
        )
    try:
        return create_model_spec_from_json(with_timestamps(dict(data)), trust=trust)
    except Exception as exc:
        raise spec_error(where, exc) from None


def _check_values(config: Any, where: str) -> Any:
    """Build the optimizer (and scheduler) on a dummy parameter: bad values fail here.

    ``lr: -1`` passes the signature check but not ``torch.optim``'s range checks; the
    error names the keyword it is about (``...optimizer_kwargs.lr``).
    """
    try:
        config.build([torch.nn.Parameter(torch.zeros(1))], where=where)
        return config
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
                hint = " (e.g. lr > 0)" if names[0] == "lr" else ""
                raise FieldError(
                    message,
                    field=f"{where}.{label}.{names[0]}",
                    fix=f"give {names[0]} a valid value (got {value!r}{hint})",
                ) from None
        raise FieldError(
            message, field=where, fix="fix optimizer_kwargs / scheduler_kwargs (types and ranges)"
        ) from None


def build_loss(data: Any, where: str, trust: bool = False) -> Any:
    """The loss function a ``loss_fn_spec`` describes (:class:`FieldError` naming ``where``)."""
    try:
        return parse_spec(data, where, trust).build()
    except Exception as exc:
        raise spec_error(where, exc) from None


def build_optimizer_config(entry: Any, where: str, trust: bool = False) -> OptimizerConfig:
    """The :class:`OptimizerConfig` one ``optimizer_configs`` entry describes."""
    try:
        return OptimizerConfig.from_spec(parse_spec(entry, where, trust))
    except Exception as exc:
        raise spec_error(where, exc) from None


def build_optimizer_configs(
    raw: Any, trust: bool = False, where: str = "optimizer_configs"
) -> dict[str, list[OptimizerConfig]]:
    """``{model key: [OptimizerConfig, ...]}`` from serialized ``optimizer_configs``.

    Key ``"0"`` (written by old versions) becomes ``"main"``.
    """
    if not isinstance(raw, Mapping):
        raise FieldError(
            f"must map model keys to lists of optimizer specs; got {type(raw).__name__}",
            field=where,
            fix="write {model key: [OptimizerConfig spec, ...]}",
        )
    out: dict[str, list[OptimizerConfig]] = {}
    for key, entries in raw.items():
        if not isinstance(entries, list):
            raise FieldError(
                f"must be a list of optimizer specs; got {type(entries).__name__}",
                field=f"{where}.{key}",
                fix="write [OptimizerConfig spec, ...]",
            )
        built = [
            build_optimizer_config(e, f"{where}.{key}[{i}]", trust) for i, e in enumerate(entries)
        ]
        out["main" if key == "0" else key] = built
    return out


# ---------------------------------------------------------------------- the payload
@dataclass
class ResolvedStrategy:
    """What :meth:`StrategyPayload.resolve` built: loss, optimizer configs, devices, ..."""

    loss_fn: Any = None
    optimizer_configs: dict[str, list[Any]] = field(default_factory=dict)
    devices: list[Any] = field(default_factory=list)
    training_fn: Any = None
    model_classes: dict[str, type] = field(default_factory=dict)
    module_patches: dict[str, BaseSpec] = field(default_factory=dict)


class StrategyPayload(BaseModel):
    """The configuration of a ``TrainingStrategy`` (or ``FineTuningStrategy``) as JSON.

    Spec dicts (``optimizer_configs`` entries, ``loss_fn_spec``, ``model_specs``,
    ``module_patches``) hold a ``cls_path`` and constructor keyword arguments (a
    ``BaseSpec`` dump); they are resolved by :meth:`resolve`, not here.
    """

    model_config = ConfigDict(extra="forbid", title="strategy")

    optimizer_configs: dict[str, list[dict[str, Any]]] | None = Field(
        default=None,
        description="{model key: [OptimizerConfig spec, ...]}: optimizer, its kwargs, an "
        "optional scheduler and parameter patterns",
    )
    num_epochs: int | None = Field(default=None, ge=1, description="length in passes over the data")
    num_steps: int | None = Field(default=None, ge=1, description="length in optimizer steps")
    epoch_step_modifier: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    devices: list[str] = Field(
        default_factory=lambda: ["cpu"], description="e.g. ['cpu'], ['cuda']"
    )
    loss_fn_spec: dict[str, Any] | None = Field(
        default=None, description="the loss as a spec (e.g. a ComposedLossFunction dump)"
    )
    model_specs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="{model key: model spec} (create_model_spec dumps)"
    )
    single_model_input: bool = True
    training_fn: str = Field(default=DEFAULT_TRAINING_FN, description="dotted path of training_fn")
    nonfinite_loss: Literal["raise", "skip", "ignore"] = "raise"
    nonfinite_check_interval: int = Field(default=100, ge=1)
    max_consecutive_skips: int | None = Field(default=100, ge=1)
    compile: bool = False
    compile_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="torch.compile options (mode, dynamic, ...)"
    )
    module_patches: dict[str, dict[str, Any]] = Field(default_factory=dict)
    freeze_patterns: list[str] = Field(default_factory=list, description="fnmatch patterns")
    trainable_patterns: list[str] = Field(default_factory=list, description="fnmatch patterns")
    freeze_mode: Literal["requires_grad", "optimizer_only"] = "requires_grad"
    new_heads: dict[str, str | None] = Field(default_factory=dict)

    @field_validator("devices", mode="before")
    @classmethod
    def _one_device(cls, value: Any, info: ValidationInfo) -> Any:
        written = bool(info.context and info.context.get("written_by_to_spec_dict"))
        return [value] if isinstance(value, str) and not written else value

    @field_validator("single_model_input", "compile", mode="before")
    @classmethod
    def _a_bool(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, bool):  # no "yes" -> True
            raise ValueError(f"'{info.field_name}' must be a bool")
        return value

    @field_validator("new_heads", "module_patches", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("freeze_patterns", "trainable_patterns", mode="before")
    @classmethod
    def _pattern_list(cls, value: Any) -> Any:
        return [] if value is None else [value] if isinstance(value, str) else value

    @field_validator("optimizer_configs", "loss_fn_spec", "model_specs", "module_patches")
    @classmethod
    def _timestamps(cls, value: Any) -> Any:
        return with_timestamps(value)

    @model_validator(mode="after")
    def _one_length(self) -> StrategyPayload:
        if self.num_epochs is not None and self.num_steps is not None:
            raise ValueError(
                "strategy needs exactly one of num_epochs and num_steps (set the other to null)"
            )
        if self.optimizer_configs is not None:
            for key, entries in self.optimizer_configs.items():
                if not entries:
                    raise ValueError(
                        f"optimizer_configs.{key} must be a non-empty list of optimizer specs"
                    )
        if not self.devices:
            raise ValueError("devices must name at least one device, e.g. ['cpu']")
        return self

    def as_spec_dict(self, *, finetuning: bool = True) -> dict[str, Any]:
        """The payload as ``TrainingStrategy.from_spec_dict`` reads it.

        ``finetuning=False`` leaves out the fine-tuning keys (a ``TrainingStrategy`` has
        none); unset optimizer configs / loss (reused from a checkpoint) are left out.
        """
        data = self.model_dump(mode="json")
        for key in ("optimizer_configs", "loss_fn_spec"):
            if data.get(key) is None:
                data.pop(key)
        if not finetuning:
            for key in FINETUNE_KEYS:
                data.pop(key, None)
        return data

    @classmethod
    def of_spec_dict(cls, spec: Any) -> StrategyPayload:
        """Validate a spec :func:`to_spec_dict` wrote (``ValueError`` naming each bad field).

        Stricter than a job file: ``optimizer_configs``, ``devices`` and ``loss_fn_spec`` are
        required and ``devices`` is a list.
        """
        if not isinstance(spec, Mapping):
            raise ValueError(f"from_spec_dict: spec must be a mapping; got {type(spec).__name__}.")
        missing = [key for key in _REQUIRED if key not in spec]
        if missing:
            raise ValueError(
                f"from_spec_dict: spec is missing required key(s) {missing}; write it with "
                "TrainingStrategy.to_spec_dict()."
            )
        try:
            return cls.model_validate(dict(spec), context=_WRITTEN)
        except ValidationError as exc:
            raise FieldError(
                "from_spec_dict: " + "; ".join(validation_lines(exc, dict(spec))),
                fix="write the spec with TrainingStrategy.to_spec_dict()",
            ) from None

    # ------------------------------------------------------------------ resolution
    def resolve(self, *, trust: bool = False, prefix: str = "strategy") -> ResolvedStrategy:
        """Resolve and build everything the payload names (no model built, no data read).

        Raises:
            FieldError: every problem found, in the order of the payload's fields, each
                naming its field (``strategy.optimizer_configs.main[0].optimizer_kwargs.lr``)
                and the fix.
        """
        problems: list[FieldError] = []
        resolved = self._resolved(trust, prefix, problems, check_values=True)
        where = f"{prefix}." if prefix else ""
        for key, data in self.model_specs.items():
            cls = _attempt(problems, self._model_class, data, f"{where}model_specs.{key}", trust)
            if cls is not None:
                resolved.model_classes[key] = cls
        if problems:
            raise combined_error(problems)
        return resolved

    def _resolved(
        self,
        trust: bool,
        prefix: str,
        problems: list[FieldError],
        *,
        check_values: bool = False,
        training_fn: bool = True,
    ) -> ResolvedStrategy:
        """Everything but the models, each problem added to ``problems``."""
        resolved = ResolvedStrategy()
        where = f"{prefix}." if prefix else ""
        if self.optimizer_configs is not None:
            for key, entries in self.optimizer_configs.items():
                configs = []
                for i, entry in enumerate(entries):
                    at = f"{where}optimizer_configs.{key}[{i}]"
                    config = _attempt(problems, build_optimizer_config, entry, at, trust)
                    if config is not None and check_values:
                        config = _attempt(problems, _check_values, config, at)
                    if config is not None:
                        configs.append(config)
                resolved.optimizer_configs["main" if key == "0" else key] = configs
        if self.loss_fn_spec is not None:
            at = f"{where}loss_fn_spec"
            resolved.loss_fn = _attempt(problems, build_loss, self.loss_fn_spec, at, trust)
        resolved.devices = _attempt(problems, self._devices, self.devices, f"{where}devices") or []
        if training_fn:
            resolved.training_fn = _attempt(
                problems, self._training_fn, self.training_fn, f"{where}training_fn", trust
            )
        for target, data in self.module_patches.items():
            spec = _attempt(problems, parse_spec, data, f"{where}module_patches.{target}", trust)
            if spec is not None:
                resolved.module_patches[target] = spec
        return resolved

    # ------------------------------------------------------------------ the builder
    def build(
        self,
        cls: type,
        *,
        models: Any = None,
        hooks: list[Any] | None = None,
        training_fn: Any = None,
        trust: bool = False,
        **overrides: Any,
    ) -> Any:
        """The strategy ``cls`` this payload describes; runtime arguments win over it.

        ``models`` (one module or a mapping) replace the payload's model specs of the same
        keys; the others are rebuilt from their specs (a spec that does not build is left
        out with a warning). The fine-tuning keys go to classes that have those fields.

        Raises:
            FieldError: every problem resolving the payload, each with its field.
            ValueError: no ``training_fn`` (passed or in the payload), no models.
        """
        if training_fn is None and "training_fn" not in self.model_fields_set:
            raise ValueError(
                "from_spec_dict: no training_fn was supplied and the spec does not contain one; "
                "pass training_fn=..."
            )
        problems: list[FieldError] = []
        resolved = self._resolved(trust, "", problems, training_fn=training_fn is None)
        if problems:
            raise combined_error(problems)
        runtime_single = isinstance(models, nn.Module) and not isinstance(models, nn.ModuleDict)
        if models is None:
            runtime: dict[str, nn.Module] = {}
        elif runtime_single:
            runtime = {"main": models}
        elif isinstance(models, (Mapping, nn.ModuleDict)):
            runtime = dict(models.items())
        else:
            raise ValueError(
                f"from_spec_dict: models must be an nn.Module or a mapping of them; got "
                f"{type(models).__name__}."
            )
        missing = {k: v for k, v in self.model_specs.items() if k not in runtime}
        merged = {**_rebuild_models(missing, trust), **runtime}
        if not merged:
            raise ValueError(
                "from_spec_dict: no models; the spec has no rebuildable 'model_specs' and no "
                "models= were passed. Pass models=... (the model(s) to train)."
            )
        single = set(merged) == {"main"} and (
            runtime_single if models is not None else self.single_model_input
        )
        kwargs: dict[str, Any] = {
            "models": merged["main"] if single else merged,
            "optimizer_configs": resolved.optimizer_configs,
            "num_epochs": self.num_epochs,
            "num_steps": self.num_steps,
            "epoch_step_modifier": self.epoch_step_modifier,
            "devices": resolved.devices,
            "loss_fn": resolved.loss_fn,
            "training_fn": training_fn if training_fn is not None else resolved.training_fn,
            "hooks": list(hooks or []),
            "nonfinite_loss": self.nonfinite_loss,
            "nonfinite_check_interval": self.nonfinite_check_interval,
            "max_consecutive_skips": self.max_consecutive_skips,
            "compile": self.compile,
            "compile_kwargs": dict(self.compile_kwargs),
        }
        if "module_patches" in getattr(cls, "model_fields", {}):
            kwargs.update(
                new_heads=dict(self.new_heads),
                module_patches=resolved.module_patches,
                freeze_patterns=tuple(self.freeze_patterns),
                trainable_patterns=tuple(self.trainable_patterns),
                freeze_mode=self.freeze_mode,
            )
        kwargs.update(overrides)
        return cls(**kwargs)

    @staticmethod
    def _devices(devices: list[str], where: str) -> list[Any]:
        try:
            return [torch.device(d) for d in devices]
        except (TypeError, RuntimeError) as exc:
            raise spec_error(where, exc, "use 'cpu', 'cuda' or 'cuda:0'") from None

    @staticmethod
    def _training_fn(path: str, where: str, trust: bool) -> Any:
        fn = import_path(path, trust=trust)
        if not callable(fn):
            raise FieldError(
                f"{path!r} is not callable",
                field=where,
                fix="name a function (model, batch) -> predictions",
            )
        return fn

    @staticmethod
    def _model_class(data: dict[str, Any], where: str, trust: bool) -> type:
        spec = parse_spec(data, where, trust)
        target = spec.target()
        unknown = [name for name in spec.kwargs if not spec.accepts_kwarg(name)]
        if unknown:
            raise FieldError(
                f"{spec.cls_path} does not accept keyword(s) {unknown}",
                field=where,
                fix="remove them or fix their spelling",
            )
        return target


def _attempt(problems: list[FieldError], fn: Any, data: Any, where: str, *args: Any) -> Any:
    """``fn(data, where, *args)``, or ``None`` with the problem (naming ``where``) recorded."""
    try:
        return fn(data, where, *args)
    except Exception as exc:  # each problem as a FieldError naming its field
        problems.append(spec_error(where, exc))
        return None


def _rebuild_models(specs: Mapping[str, Any], trust: bool) -> dict[str, nn.Module]:
    out = {}
    for key, data in specs.items():
        try:
            model = create_model_spec_from_json(data, trust=trust).build()
        except Exception as exc:
            warnings.warn(
                f"Omitting model {key!r}: its spec does not build: {exc}", UserWarning, stacklevel=4
            )
            continue
        if not isinstance(model, nn.Module):
            warnings.warn(
                f"Omitting model {key!r}: its spec built {type(model).__name__}, not an nn.Module.",
                UserWarning,
                stacklevel=4,
            )
            continue
        out[key] = model
    return out


# ---------------------------------------------------------------------- writing a payload
def to_spec_dict(strategy: Any) -> dict[str, Any]:
    """The payload of ``strategy``, JSON-ready: :meth:`StrategyPayload.build` rebuilds it.

    Fine-tuning fields are written for strategies that have them; ``compile`` and
    ``compile_kwargs`` only when set (older readers know neither).

    Raises:
        TypeError: a module patch is an ``nn.Module`` instance (pass a BaseSpec).
    """
    spec: dict[str, Any] = {
        "optimizer_configs": {
            key: [config.to_spec().model_dump() for config in configs]
            for key, configs in strategy.optimizer_configs.items()
        },
        "num_epochs": strategy.num_epochs,
        "num_steps": strategy.num_steps,
        "epoch_step_modifier": strategy.epoch_step_modifier,
        "devices": [str(device) for device in strategy.devices],
        "loss_fn_spec": strategy.loss_fn.to_spec().model_dump(),
        "model_specs": _model_specs(strategy.models),
        "single_model_input": strategy.single_model_input,
        "nonfinite_loss": strategy.nonfinite_loss,
        "nonfinite_check_interval": strategy.nonfinite_check_interval,
        "max_consecutive_skips": strategy.max_consecutive_skips,
    }
    if strategy.compile or strategy.compile_kwargs:
        spec["compile"] = strategy.compile
        spec["compile_kwargs"] = _json_compile_kwargs(strategy.compile_kwargs)
    path = _importable_path(strategy.training_fn)
    if path is None:
        warnings.warn(
            f"Omitting non-importable training_fn from spec: {strategy.training_fn!r}. Define it "
            "at module level to make the spec restartable, or pass training_fn= when loading.",
            UserWarning,
            stacklevel=3,
        )
    else:
        spec["training_fn"] = path
    if "module_patches" in type(strategy).model_fields:
        spec.update(
            new_heads=dict(strategy.new_heads),
            module_patches=_patch_specs(strategy.module_patches),
            freeze_patterns=list(strategy.freeze_patterns),
            trainable_patterns=list(strategy.trainable_patterns),
            freeze_mode=strategy.freeze_mode,
        )
    return spec


def to_checkpoint_dict(strategy: Any) -> dict[str, Any]:
    """``strategy.to_spec_dict()`` plus ``strategy_cls`` and ``runtime_state`` (no file I/O)."""
    spec = strategy.to_spec_dict()
    spec["strategy_cls"] = object_to_path(type(strategy))
    spec["runtime_state"] = strategy.runtime_state()
    return spec


# ---------------------------------------------------------------------- reading a payload
def strategy_class(path: Any, trust: bool = False) -> type:
    """The strategy class a checkpoint's ``strategy_cls`` names (through the allow-list)."""
    if not isinstance(path, str):
        raise ValueError(f"'strategy_cls' must be a dotted-path string; got {path!r}.")
    try:
        target = import_path(path, trust=trust)
    except Exception as exc:
        raise ValueError(f"'strategy_cls' {path!r} cannot be imported: {exc}") from exc
    if not (isinstance(target, type) and callable(getattr(target, "from_spec_dict", None))):
        raise ValueError(f"'strategy_cls' {path!r} is not a TrainingStrategy class.")
    return target


def from_spec_dict(
    cls: type,
    spec: Mapping[str, Any],
    *,
    models: Any = None,
    hooks: list[Any] | None = None,
    training_fn: Any = None,
    trust: bool = False,
    **overrides: Any,
) -> Any:
    """Rebuild a strategy from :func:`to_spec_dict` output; runtime arguments win over it.

    Validated by :meth:`StrategyPayload.of_spec_dict`, built by :meth:`StrategyPayload.build`;
    dotted paths resolve through the import allow-list (``trust=True`` lifts it for files
    you wrote yourself).
    """
    return StrategyPayload.of_spec_dict(spec).build(
        cls, models=models, hooks=hooks, training_fn=training_fn, trust=trust, **overrides
    )


def from_checkpoint_dict(
    cls: type,
    spec: Mapping[str, Any],
    *,
    models: Any = None,
    hooks: list[Any] | None = None,
    training_fn: Any = None,
    trust: bool = False,
    **overrides: Any,
) -> Any:
    """Rebuild the saved strategy class from :func:`to_checkpoint_dict` output, with its counters.

    ``strategy_cls`` must resolve (through the allow-list) to ``cls`` or a subclass.
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"from_spec_dict: spec must be a mapping; got {type(spec).__name__}.")
    spec = dict(spec)
    path, state = spec.pop("strategy_cls", None), spec.pop("runtime_state", {})
    target = cls if path is None else strategy_class(path, trust)
    if not issubclass(target, cls):
        raise ValueError(f"'strategy_cls' {path!r} must resolve to a {cls.__name__} subclass.")
    if not isinstance(state, Mapping):
        raise ValueError(f"'runtime_state' must be a mapping; got {type(state).__name__}.")
    strategy = target.from_spec_dict(
        spec, models=models, hooks=hooks, training_fn=training_fn, trust=trust, **overrides
    )
    strategy.load_runtime_state(state)
    return strategy


def _patch_specs(patches: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for target, patch in patches.items():
        if not isinstance(patch, BaseSpec):
            raise TypeError(
                f"module_patches[{target!r}] is a {type(patch).__name__} instance, which "
                "cannot be serialized; pass a BaseSpec (create_model_spec(cls, **kwargs)) "
                "to make the strategy restartable."
            )
        out[target] = patch.model_dump()
    return out


def _model_specs(models: Mapping[str, nn.Module]) -> dict[str, Any]:
    out = {}
    for key, model in models.items():
        try:
            spec = model_spec_for(model, strict=True)
            out[key] = spec.model_dump()
        except (TypeError, ValueError) as exc:
            warnings.warn(f"Omitting model spec for {key!r}: {exc}", UserWarning, stacklevel=4)
    return out


def _json_compile_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``compile_kwargs`` that JSON can hold; others (a backend callable) are left out."""
    out = {}
    for key, value in kwargs.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            warnings.warn(
                f"Omitting compile_kwargs[{key!r}] ({type(value).__name__}) from the spec: "
                "it is not JSON. Pass it again when loading (compile_kwargs=...).",
                UserWarning,
                stacklevel=4,
            )
            continue
        out[key] = value
    return out


def _importable_path(fn: Any) -> str | None:
    try:
        path = object_to_path(fn)
        return path if import_path(path, trust=True) is fn else None
    except Exception:
        return None


def combined_error(problems: list[FieldError]) -> FieldError:
    """One :class:`FieldError` for several (their lines joined); the only one if one."""
    flat = [part for p in problems for part in getattr(p, "parts", None) or [p]]
    if len(flat) == 1:
        return flat[0]
    text = "; ".join(f"({i}) {p}" for i, p in enumerate(flat, 1))
    error = FieldError(f"{len(flat)} problems: {text}", fix="correct each field named above")
    error.parts = flat
    return error
