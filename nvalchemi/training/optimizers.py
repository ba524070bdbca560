"""Optimizer/scheduler recipes and the helpers that build and step them.

>>> import torch
>>> config = OptimizerConfig(
...     optimizer_cls=torch.optim.AdamW,
...     optimizer_kwargs={"lr": 1e-4, "weight_decay": 1e-5},
...     scheduler_cls="torch.optim.lr_scheduler.StepLR",
...     scheduler_kwargs={"step_size": 100},
... )
>>> pairs = setup_optimizers(torch.nn.Linear(3, 1), config)   # {"main": [(AdamW, StepLR)]}

Several optimizers per model split its parameters explicitly: ``parameters`` takes fnmatch
patterns over parameter names relative to the model (``None``: every trainable parameter not
claimed by another config of that model), and ``param_groups`` sets per-group options:

>>> configs = [
...     OptimizerConfig(optimizer_cls=torch.optim.Adam, optimizer_kwargs={"lr": 1e-3},
...                     parameters=["head.*"]),
...     OptimizerConfig(optimizer_cls=torch.optim.SGD, optimizer_kwargs={"lr": 1e-2},
...                     param_groups=[{"params": ["*.bias"], "weight_decay": 0.0}]),
... ]
"""

from __future__ import annotations

import fnmatch
import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Annotated, Any

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    WrapValidator,
    model_validator,
)
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from nvalchemi._serialization import (
    SerializableClass,
    SerializableOptionalClass,
    import_path,
    object_to_path,
)
from nvalchemi.training.errors import add_note
from nvalchemi.training.spec import BaseSpec, create_model_spec

__all__ = [
    "OptSchedPair",
    "OptimizerConfig",
    "SchedulerMetricAdapter",
    "is_metric_scheduler",
    "iter_qualified_named_parameters",
    "setup_optimizers",
    "step_lr_schedulers",
    "step_metric_schedulers",
    "step_optimizers",
    "zero_gradients",
]

OptSchedPair = tuple[Optimizer, LRScheduler | ReduceLROnPlateau | None]
SchedulerMetricAdapter = Callable[[Mapping[str, Any]], float] | str | None


def _load_adapter(value: Any) -> Any:
    if isinstance(value, Mapping) and "__type__" in value:
        return import_path(value["__type__"])
    if value is None or isinstance(value, str) or callable(value):
        return value
    raise ValueError(
        "scheduler_metric_adapter must be a validation-summary key, a callable(summary) -> "
        f"float, or None; got {type(value).__name__}"
    )


def _dump_adapter(value: Any) -> Any:
    return value if value is None or isinstance(value, str) else {"__type__": object_to_path(value)}


def _importable_class(value: Any, handler: Any) -> Any:
    """Resolve a class or dotted path; a bad path says it must resolve to an importable class."""
    try:
        return handler(value)
    except ValidationError as exc:
        if not isinstance(value, str):
            raise
        why = "; ".join(str(e.get("msg", "")).removeprefix("Value error, ") for e in exc.errors())
        if "must resolve to an importable class" in why:
            raise ValueError(why) from None
        raise ValueError(f"{value!r} must resolve to an importable class: {why}") from None


_ORDINARY = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _check_kwargs(
    label: str, cls: type, kwargs: Mapping[str, Any], *, groups: bool = False
) -> None:
    """Validate ``cls(first_positional, **kwargs)`` against the constructor signature."""
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return  # uninspectable (C extension); the constructor will complain itself
    if params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]  # params / optimizer, supplied by build()
    accepted = sorted(p.name for p in params if p.kind in _ORDINARY)
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise ValueError(
                f"Invalid {label} kwargs for {cls.__name__}: {unknown}; {cls.__name__} accepts "
                f"{accepted}."
            )
    if not groups:
        missing = [
            p.name
            for p in params
            if p.kind in _ORDINARY and p.default is p.empty and p.name not in kwargs
        ]
        if missing:
            raise ValueError(
                f"Missing required {label} kwargs for {cls.__name__}: {missing}; add them to "
                f"{label}_kwargs."
            )


def _patterns(value: Any, where: str) -> list[str]:
    patterns = [value] if isinstance(value, str) else value
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"{where} must be a pattern string or a list of them, got {value!r}")
    return list(patterns)


class OptimizerConfig(BaseModel):
    """How to build one optimizer (and optionally its LR scheduler) for one model.

    Args:
        optimizer_cls: optimizer class, or its dotted path (allow-listed).
        optimizer_kwargs: constructor keywords, checked against ``optimizer_cls``.
        scheduler_cls: optional LR scheduler class (or dotted path).
        scheduler_kwargs: constructor keywords for the scheduler.
        scheduler_metric_adapter: for ``ReduceLROnPlateau``-style schedulers: validation
            summary key, callable ``summary -> float``, or ``None`` (``"total_loss"``).
        parameters: fnmatch patterns over parameter names relative to the model selecting the
            parameters of this optimizer; ``None`` takes every trainable parameter that no other
            config of the same model claims.
        param_groups: ``[{"params": patterns, <option>: value, ...}, ...]`` per-group options;
            parameters matching no group form a last group with ``optimizer_kwargs`` only.

    The first two may be given positionally: ``OptimizerConfig(torch.optim.Adam, {"lr": 1e-3})``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    optimizer_cls: Annotated[SerializableClass, WrapValidator(_importable_class)]
    optimizer_kwargs: dict[str, Any] = Field(default_factory=dict)
    scheduler_cls: Annotated[SerializableOptionalClass, WrapValidator(_importable_class)] = None
    scheduler_kwargs: dict[str, Any] = Field(default_factory=dict)
    scheduler_metric_adapter: Annotated[
        Any, BeforeValidator(_load_adapter), PlainSerializer(_dump_adapter)
    ] = None
    parameters: list[str] | None = None
    param_groups: list[dict[str, Any]] | None = None

    def __init__(self, *args: Any, **data: Any) -> None:
        names = ("optimizer_cls", "optimizer_kwargs", "scheduler_cls", "scheduler_kwargs")
        if len(args) > len(names):
            raise TypeError(f"OptimizerConfig takes at most {len(names)} positional arguments")
        for name, value in zip(names, args):
            if name in data:
                raise TypeError(f"OptimizerConfig got multiple values for {name!r}")
            data[name] = value
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(
                    f"Unknown OptimizerConfig argument(s) {unknown}; optimizer options such as lr "
                    "belong in optimizer_kwargs={...} (scheduler options in scheduler_kwargs)."
                )
        return data

    @model_validator(mode="after")
    def _validate(self) -> OptimizerConfig:
        if self.scheduler_cls is None:
            if self.scheduler_kwargs:
                raise ValueError(
                    "scheduler_kwargs provided but scheduler_cls is None; set scheduler_cls or "
                    f"drop them. Got: {sorted(self.scheduler_kwargs)}"
                )
            if self.scheduler_metric_adapter is not None:
                raise ValueError("scheduler_metric_adapter provided but scheduler_cls is None.")
        else:
            _check_kwargs("scheduler", self.scheduler_cls, self.scheduler_kwargs)
        _check_kwargs("optimizer", self.optimizer_cls, self.optimizer_kwargs)
        if self.parameters is not None:
            self.parameters = _patterns(self.parameters, "parameters")
        for i, group in enumerate(self.param_groups or []):
            if "params" not in group:
                raise ValueError(f"param_groups[{i}] needs a 'params' entry with name patterns")
            _patterns(group["params"], f"param_groups[{i}]['params']")
            options = {k: v for k, v in group.items() if k != "params"}
            _check_kwargs(f"param_groups[{i}] optimizer", self.optimizer_cls, options, groups=True)
        return self

    def build(self, params: Iterable[Any], *, where: str = "OptimizerConfig") -> OptSchedPair:
        """``(optimizer_cls(params, **optimizer_kwargs), scheduler or None)``.

        A constructor error gets a note naming ``where`` (e.g.
        ``"optimizer_configs['main'][0]"``), the class and its keyword arguments.
        """
        try:
            optimizer = self.optimizer_cls(params, **self.optimizer_kwargs)
        except Exception as exc:
            add_note(
                exc,
                f"raised while building optimizers: {where} optimizer "
                f"{_class_path(self.optimizer_cls)}(params, **{self.optimizer_kwargs!r}); fix "
                "optimizer_kwargs (values of the right type and range).",
            )
            raise
        if self.scheduler_cls is None:
            return optimizer, None
        try:
            scheduler = self.scheduler_cls(optimizer, **self.scheduler_kwargs)
        except Exception as exc:
            add_note(
                exc,
                f"raised while building optimizers: {where} scheduler "
                f"{_class_path(self.scheduler_cls)}(optimizer, **{self.scheduler_kwargs!r}); fix "
                "scheduler_kwargs.",
            )
            raise
        return optimizer, scheduler

    def param_groups_for(self, named: list[tuple[str, nn.Parameter]]) -> list[Any]:
        """Split this config's ``(name, parameter)`` list into optimizer parameter groups."""
        if not self.param_groups:
            return [p for _, p in named]
        owner: dict[str, int] = {}
        for gi, group in enumerate(self.param_groups):
            for pattern in _patterns(group["params"], "params"):
                hits = [n for n, _ in named if fnmatch.fnmatchcase(n, pattern)]
                if not hits:
                    raise ValueError(
                        f"param_groups[{gi}] pattern {pattern!r} matches none of this optimizer's "
                        f"parameters: {[n for n, _ in named][:10]}"
                    )
                for name in hits:
                    if owner.setdefault(name, gi) != gi:
                        raise ValueError(
                            f"Parameter {name!r} matches param_groups[{owner[name]}] and "
                            f"param_groups[{gi}]; each parameter may be in one group."
                        )
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [p for n, p in named if owner.get(n) == gi],
            }
            for gi, g in enumerate(self.param_groups)
        ]
        rest = [p for n, p in named if n not in owner]
        return [*groups, {"params": rest}] if rest else groups

    def to_spec(self) -> BaseSpec:
        """Spec with classes as dotted paths (a callable metric adapter must be importable)."""
        adapter = self.scheduler_metric_adapter
        if adapter is not None and not isinstance(adapter, str):
            try:
                object_to_path(adapter)
            except TypeError as exc:
                raise TypeError(
                    f"scheduler_metric_adapter {adapter!r} cannot be serialized: {exc} Use a "
                    "summary key string or a module-level function."
                ) from None
        return create_model_spec(OptimizerConfig, **self.model_dump())

    @classmethod
    def from_spec(cls, spec: BaseSpec) -> OptimizerConfig:
        """Build a config from :meth:`to_spec` output (``TypeError`` if it is something else)."""
        config = spec.build()
        if not isinstance(config, cls):
            raise TypeError(
                f"Spec {spec.cls_path} built {type(config).__name__}, not {cls.__name__}"
            )
        return config


# ----------------------------------------------------------------------------- helpers


def _unwrap(module: nn.Module) -> nn.Module:
    """The user's module inside DDP/DataParallel/torch.compile wrappers (stable names)."""
    while True:
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
        elif isinstance(getattr(module, "_orig_mod", None), nn.Module):
            module = module._orig_mod
        else:
            return module


def _as_model_dict(models: nn.Module | Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    if isinstance(models, (nn.ModuleDict, Mapping)):
        return dict(models.items())
    if isinstance(models, nn.Module):
        return {"main": models}
    raise TypeError(
        f"models must be an nn.Module or a mapping of them, got {type(models).__name__}"
    )


def iter_qualified_named_parameters(
    models: nn.Module | Mapping[str, nn.Module],
) -> Iterator[tuple[str, nn.Parameter]]:
    """Yield ``("<model key>.<parameter name>", parameter)``; a bare module is ``"main"``.

    Names are taken inside DDP/DataParallel/``torch.compile`` wrappers, so they do not change
    when a model is wrapped.
    """
    for key, model in _as_model_dict(models).items():
        for name, param in _unwrap(model).named_parameters():
            yield f"{key}.{name}", param


def _as_config_dict(configs: Any, model_keys: list[str]) -> dict[str, list[OptimizerConfig]]:
    if isinstance(configs, (OptimizerConfig, list, tuple)):
        if len(model_keys) != 1:
            raise ValueError(
                "Unkeyed optimizer_configs require single-model input; key them by model name, "
                f"e.g. {{{model_keys[0]!r}: [OptimizerConfig(...)]}}"
            )
        configs = {model_keys[0]: configs}
    if not isinstance(configs, Mapping):
        raise TypeError(
            f"optimizer_configs must be an OptimizerConfig, list or dict, got {configs!r}"
        )
    out = {}
    for key, value in configs.items():
        key = "main" if key == 0 else key
        value = [value] if isinstance(value, OptimizerConfig) else list(value)
        if not value or not all(isinstance(c, OptimizerConfig) for c in value):
            raise ValueError(
                f"optimizer_configs[{key!r}] must contain at least one OptimizerConfig."
            )
        out[key] = value
    return out


def _claim(key: str, configs: list[OptimizerConfig], named: list[tuple[str, Any]]) -> list[list]:
    """Assign each trainable parameter of one model to exactly one config."""
    names = [n for n, _ in named]
    owner: dict[str, int] = {}
    for i, config in enumerate(configs):
        for pattern in config.parameters or []:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise ValueError(
                    f"optimizer_configs[{key!r}][{i}].parameters pattern {pattern!r} matches no "
                    f"trainable parameter of model {key!r}; trainable names include {names[:10]}"
                )
            for name in hits:
                if owner.setdefault(name, i) != i:
                    raise ValueError(
                        f"Parameter '{key}.{name}' is claimed by optimizer_configs[{key!r}]"
                        f"[{owner[name]}] and [{i}]; a parameter may belong to one optimizer only. "
                        "Narrow the `parameters` patterns."
                    )
    open_configs = [i for i, c in enumerate(configs) if c.parameters is None]
    unclaimed = [n for n in names if n not in owner]
    if len(open_configs) > 1:
        example = f" (e.g. '{key}.{unclaimed[0]}')" if unclaimed else ""
        raise ValueError(
            f"optimizer_configs[{key!r}][{open_configs[0]}] and [{open_configs[1]}] both leave "
            f"`parameters` unset, so both would claim the same parameters{example}. Give all but "
            "one of them explicit `parameters` patterns."
        )
    if open_configs:
        owner.update(dict.fromkeys(unclaimed, open_configs[0]))
    elif unclaimed:
        warnings.warn(
            f"Trainable parameters of model {key!r} matched by no OptimizerConfig will not be "
            f"updated: {unclaimed[:10]}",
            UserWarning,
            stacklevel=3,
        )
    selected = [[(n, p) for n, p in named if owner.get(n) == i] for i in range(len(configs))]
    for i, chosen in enumerate(selected):
        if not chosen:
            raise ValueError(
                f"optimizer_configs[{key!r}][{i}] has no parameters: all trainable parameters are "
                "claimed by the other configs of this model."
            )
    return selected


def setup_optimizers(
    models: nn.Module | Mapping[str, nn.Module],
    optimizer_configs: Any,
    *,
    allowed_parameter_names: Iterable[str] | None = None,
) -> dict[str, list[OptSchedPair]]:
    """Build ``{model key: [(optimizer, scheduler | None), ...]}`` from the configs.

    Only parameters with ``requires_grad`` (and, if given, whose qualified name
    ``"<key>.<name>"`` is in ``allowed_parameter_names``) are optimized; each goes to exactly
    one optimizer (see :class:`OptimizerConfig` ``parameters``). Models without configs get
    nothing.
    """
    models = _as_model_dict(models)
    configs = _as_config_dict(optimizer_configs, list(models))
    allowed = None if allowed_parameter_names is None else set(allowed_parameter_names)
    result: dict[str, list[OptSchedPair]] = {}
    for key, model_configs in configs.items():
        if key not in models:
            raise ValueError(
                f"optimizer_configs key {key!r} is not present in models; available model keys: "
                f"{sorted(models)}"
            )
        named = [
            (name, p)
            for name, p in _unwrap(models[key]).named_parameters()
            if p.requires_grad and (allowed is None or f"{key}.{name}" in allowed)
        ]
        if not named:
            suffix = " after optimizer parameter filtering" if allowed is not None else ""
            raise ValueError(
                f"Configured model {key!r} has no trainable parameters (requires_grad=True{suffix})."
            )
        selected = _claim(key, model_configs, named)
        result[key] = [
            c.build(c.param_groups_for(s), where=f"optimizer_configs[{key!r}][{i}]")
            for i, (c, s) in enumerate(zip(model_configs, selected))
        ]
    return result


def _class_path(cls: Any) -> str:
    try:
        return object_to_path(cls)
    except Exception:
        return getattr(cls, "__qualname__", repr(cls))


def is_metric_scheduler(scheduler: Any) -> bool:
    """Whether ``scheduler`` steps on a validation metric (``ReduceLROnPlateau`` and subclasses)."""
    return isinstance(scheduler, ReduceLROnPlateau)


def _is_metric_scheduler_class(scheduler_cls: Any) -> bool:
    """Whether instances of ``scheduler_cls`` step on a validation metric (``None``: no)."""
    return isinstance(scheduler_cls, type) and issubclass(scheduler_cls, ReduceLROnPlateau)


def zero_gradients(optimizers: Iterable[Optimizer]) -> None:
    """``zero_grad(set_to_none=True)`` on every optimizer."""
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)


def step_optimizers(optimizers: Iterable[Optimizer]) -> None:
    """``step()`` every optimizer (its step hooks and LR-scheduler bookkeeping run as usual)."""
    for optimizer in optimizers:
        optimizer.step()


def step_lr_schedulers(schedulers: Iterable[Any]) -> None:
    """``step()`` every time-based scheduler (``None`` and metric-driven ones are skipped)."""
    for scheduler in schedulers:
        if scheduler is not None and not is_metric_scheduler(scheduler):
            scheduler.step()


def _extract_scheduler_metric(adapter: SchedulerMetricAdapter, summary: Mapping[str, Any]) -> float:
    if callable(adapter):
        return float(adapter(summary))
    key = "total_loss" if adapter is None else adapter
    if key not in summary:
        raise KeyError(
            f"Scheduler metric key {key!r} not found in validation summary; available keys: "
            f"{sorted(summary)}"
        )
    value = summary[key]
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def step_metric_schedulers(
    schedulers: Iterable[Any],
    adapters: Iterable[SchedulerMetricAdapter],
    summary: Mapping[str, Any],
) -> None:
    """Step each metric-driven scheduler with the metric its adapter picks from ``summary``."""
    schedulers, adapters = list(schedulers), list(adapters)
    if len(schedulers) != len(adapters):
        raise ValueError(
            f"step_metric_schedulers got {len(schedulers)} schedulers but {len(adapters)} adapters"
        )
    for scheduler, adapter in zip(schedulers, adapters):
        if scheduler is not None and is_metric_scheduler(scheduler):
            scheduler.step(_extract_scheduler_metric(adapter, summary))
