"""How to rebuild a model before loading its weights: :func:`model_spec_for`.

A checkpoint stores weights; to restore them into a fresh process the model must be
rebuilt first. :func:`model_spec_for` returns a :class:`~nvalchemi.training.spec.BaseSpec`
for a module:

1. the module's own ``checkpoint_spec()`` when it defines one and returns a spec;
2. otherwise constructor introspection: every ``__init__`` parameter is read from the
   attribute of the same name (so store constructor arguments as ``self.<name>``);
   ``nn.Module`` arguments are described the same way, recursively.

A generated spec is proven to rebuild the right class once per class and arguments
(on the ``meta`` device, so no memory is allocated) and the verdict is cached: saving
a checkpoint every few hundred steps does not build a model each time.

Example:
    >>> import torch
    >>> spec = model_spec_for(torch.nn.Linear(3, 2, bias=False))
    >>> spec.cls_path, spec.kwargs["in_features"]
    ('torch.nn.modules.linear.Linear', 3)
    >>> spec.build()
    Linear(in_features=3, out_features=2, bias=False)
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import torch
from torch import nn

from nvalchemi.training.runtime import unwrap_model
from nvalchemi.training.spec import BaseSpec, create_model_spec

__all__ = ["model_spec_for"]

# (class, canonical JSON of the kwargs) -> None when the spec rebuilt the class, else the reason.
_VERIFIED: dict[tuple[type, str], str | None] = {}
_VERIFIED_MAX = 256


def model_spec_for(module: nn.Module, *, strict: bool = False) -> BaseSpec | None:
    """A spec that rebuilds ``module`` (weights not included), or ``None`` if none exists.

    DDP/DataParallel wrappers are looked through. With ``strict=True`` a module that
    cannot be described raises ``ValueError`` naming the reason instead of returning
    ``None``; a ``checkpoint_spec()`` returning something other than a spec or
    ``None`` raises ``TypeError`` in both modes.
    """
    try:
        return _spec(unwrap_model(module), path=type(unwrap_model(module)).__name__)
    except ValueError:
        if strict:
            raise
        return None


def _spec(module: nn.Module, path: str) -> BaseSpec:
    custom = getattr(module, "checkpoint_spec", None)
    if callable(custom):
        spec = custom()
        if spec is not None:
            if not isinstance(spec, BaseSpec):
                raise TypeError(
                    f"{type(module).__name__}.checkpoint_spec() must return a BaseSpec or None; "
                    f"got {type(spec).__name__}."
                )
            return spec
    spec = _introspect(module, path)
    _verify(spec, module, path)
    return spec


def _introspect(module: nn.Module, path: str) -> BaseSpec:
    cls = type(module)
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{path}: cannot read the signature of {cls.__name__}.__init__: {exc}"
        ) from None
    kwargs: dict[str, Any] = {}
    for name, param in list(params.items())[1:]:  # skip self
        if param.kind is param.VAR_KEYWORD:
            continue
        if param.kind is param.VAR_POSITIONAL:
            raise ValueError(
                f"{path}: {cls.__name__}.__init__ takes *{name}, which cannot be recovered from "
                "attributes; define checkpoint_spec() on the model instead."
            )
        if param.kind is param.POSITIONAL_ONLY:
            raise ValueError(
                f"{path}: {cls.__name__}.__init__ has positional-only parameter {name!r}; "
                "define checkpoint_spec() on the model instead."
            )
        # A same-named parameter/buffer (nn.Linear's ``bias``) is state, not the argument.
        is_state = module._parameters.get(name) is not None or module._buffers.get(name) is not None
        if is_state or not hasattr(module, name):
            if param.default is param.empty:
                raise ValueError(
                    f"{path}: constructor argument {name!r} of {cls.__name__} is not stored as "
                    f"attribute self.{name}; store it there or define checkpoint_spec()."
                )
            continue
        kwargs[name] = _value(getattr(module, name), f"{path}.{name}")
    try:
        return create_model_spec(cls, **kwargs)
    except TypeError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _value(value: Any, path: str) -> Any:
    if isinstance(value, nn.Module) and not isinstance(value, (nn.ModuleList, nn.ModuleDict)):
        return _spec(unwrap_model(value), path)
    if isinstance(value, (list, tuple, nn.ModuleList)):
        items = [_value(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, (dict, nn.ModuleDict)):
        return {k: _value(v, f"{path}[{k!r}]") for k, v in value.items()}
    return value


def _verify(spec: BaseSpec, module: nn.Module, path: str) -> None:
    layout = _layout(module)
    try:
        kwargs = json.dumps(_without_timestamps(spec.model_dump()), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: constructor arguments are not JSON-serializable: {exc}") from exc
    key = (type(module), kwargs, layout)
    if key not in _VERIFIED:
        if len(_VERIFIED) >= _VERIFIED_MAX:
            _VERIFIED.clear()
        _VERIFIED[key] = _rebuild_problem(spec, type(module), layout)
    problem = _VERIFIED[key]
    if problem is not None:
        raise ValueError(f"{path}: {problem}")


def _layout(module: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((name, tuple(t.shape)) for name, t in module.state_dict().items())


def _without_timestamps(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_timestamps(v) for k, v in value.items() if k != "timestamp"}
    if isinstance(value, list):
        return [_without_timestamps(v) for v in value]
    return value


def _rebuild_problem(spec: BaseSpec, cls: type, layout: tuple) -> str | None:
    """``None`` when ``spec`` rebuilds ``cls`` with the same weights layout; else why not."""
    errors = []
    for device in ("meta", "cpu"):  # meta allocates nothing; some constructors need real data
        try:
            with torch.device(device):
                built = spec.build()
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if not isinstance(built, cls):
            return f"the generated spec built {type(built).__name__}, not {cls.__name__}"
        if _layout(built) != layout:
            return (
                f"the generated spec rebuilds {cls.__name__} with different weights (names or "
                "shapes) than the live model; define checkpoint_spec() on the model."
            )
        return None
    return f"the generated spec does not rebuild {cls.__name__} ({errors[-1]})"
