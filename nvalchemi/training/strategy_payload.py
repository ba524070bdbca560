"""The strategy payload: a ``TrainingStrategy``'s configuration as JSON, checked in one place.

:class:`StrategyPayload` is the shape of ``TrainingStrategy.to_spec_dict()`` (and of the
``strategy`` section of a job file): optimizer configs, duration, devices, the loss, model
specs, the call mode, the training function, the non-finite policy and the fine-tuning
keys. Validating it checks types, ranges and unknown keys (pydantic, every error at
once, each with its field path); :meth:`StrategyPayload.resolve` then resolves every
dotted path through the import allow-list of :mod:`nvalchemi._serialization` and builds
what can be built without a model or data -- the loss, the optimizer configs (each
optimizer and scheduler is built on a dummy parameter, so ``lr: -1`` is caught), the
devices, the training function and the model classes -- again reporting every problem
at once as :class:`~nvalchemi._errors.FieldError` lines naming the field and the fix.

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
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nvalchemi._errors import FieldError, field_path, validation_lines

__all__ = [
    "DEFAULT_TRAINING_FN",
    "FINETUNE_KEYS",
    "ResolvedStrategy",
    "StrategyPayload",
    "combined_error",
    "parse_spec",
    "spec_error",
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
    from pydantic import ValidationError

    from nvalchemi._serialization import UnsafeImportError

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
    from nvalchemi.training.spec import create_model_spec_from_json

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
                hint = " (e.g. lr > 0)" if names[0] == "lr" else ""
                raise FieldError(
                    message,
                    field=f"{where}.{label}.{names[0]}",
                    fix=f"give {names[0]} a valid value (got {value!r}{hint})",
                ) from None
        raise FieldError(
            message, field=where, fix="fix optimizer_kwargs / scheduler_kwargs (types and ranges)"
        ) from None


# ---------------------------------------------------------------------- the payload
@dataclass
class ResolvedStrategy:
    """What :meth:`StrategyPayload.resolve` built: loss, optimizer configs, devices, ..."""

    loss_fn: Any = None
    optimizer_configs: dict[str, list[Any]] = field(default_factory=dict)
    devices: list[Any] = field(default_factory=list)
    training_fn: Any = None
    model_classes: dict[str, type] = field(default_factory=dict)


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
    module_patches: dict[str, dict[str, Any]] = Field(default_factory=dict)
    freeze_patterns: list[str] = Field(default_factory=list, description="fnmatch patterns")
    trainable_patterns: list[str] = Field(default_factory=list, description="fnmatch patterns")
    freeze_mode: Literal["requires_grad", "optimizer_only"] = "requires_grad"
    new_heads: dict[str, str | None] = Field(default_factory=dict)

    @field_validator("devices", mode="before")
    @classmethod
    def _one_device(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

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

    # ------------------------------------------------------------------ resolution
    def resolve(self, *, trust: bool = False, prefix: str = "strategy") -> ResolvedStrategy:
        """Resolve and build everything the payload names (no model built, no data read).

        Raises:
            FieldError: every problem found, in the order of the payload's fields, each
                naming its field (``strategy.optimizer_configs.main[0].optimizer_kwargs.lr``)
                and the fix.
        """
        resolved = ResolvedStrategy()
        problems: list[FieldError] = []

        def attempt(fn: Any, data: Any, where: str) -> Any:
            try:
                return fn(data, where, trust)
            except Exception as exc:  # each problem as a FieldError naming its field
                problems.append(spec_error(where, exc))
                return None

        where = f"{prefix}." if prefix else ""
        if self.optimizer_configs is not None:
            for key, entries in self.optimizer_configs.items():
                configs = [
                    attempt(self._optimizer, entry, f"{where}optimizer_configs.{key}[{i}]")
                    for i, entry in enumerate(entries)
                ]
                resolved.optimizer_configs[key] = [c for c in configs if c is not None]
        if self.loss_fn_spec is not None:
            resolved.loss_fn = attempt(self._loss, self.loss_fn_spec, f"{where}loss_fn_spec")
        resolved.devices = attempt(self._devices, self.devices, f"{where}devices") or []
        resolved.training_fn = attempt(self._training_fn, self.training_fn, f"{where}training_fn")
        for key, data in self.model_specs.items():
            cls = attempt(self._model_class, data, f"{where}model_specs.{key}")
            if cls is not None:
                resolved.model_classes[key] = cls
        for target, data in self.module_patches.items():
            attempt(parse_spec, data, f"{where}module_patches.{target}")
        if problems:
            raise combined_error(problems)
        return resolved

    @staticmethod
    def _optimizer(entry: dict[str, Any], where: str, trust: bool) -> Any:
        from nvalchemi.training.optimizers import OptimizerConfig

        config = OptimizerConfig.from_spec(parse_spec(entry, where, trust))
        _check_values(config, where)
        return config

    @staticmethod
    def _loss(data: dict[str, Any], where: str, trust: bool) -> Any:
        return parse_spec(data, where, trust).build()

    @staticmethod
    def _devices(devices: list[str], where: str, trust: bool) -> list[Any]:
        import torch

        try:
            return [torch.device(d) for d in devices]
        except (TypeError, RuntimeError) as exc:
            raise spec_error(where, exc, "use 'cpu', 'cuda' or 'cuda:0'") from None

    @staticmethod
    def _training_fn(path: str, where: str, trust: bool) -> Any:
        from nvalchemi._serialization import import_path

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


def combined_error(problems: list[FieldError]) -> FieldError:
    """One :class:`FieldError` for several (their lines joined); the only one if one."""
    flat = [part for p in problems for part in getattr(p, "parts", None) or [p]]
    if len(flat) == 1:
        return flat[0]
    text = "; ".join(f"({i}) {p}" for i, p in enumerate(flat, 1))
    error = FieldError(f"{len(flat)} problems: {text}", fix="correct each field named above")
    error.parts = flat
    return error
