"""JSON specs of a :class:`~nvalchemi.training.TrainingStrategy` (``to_spec_dict`` and back).

A spec holds what rebuilds the job: optimizer configs, duration, devices, the loss, model
specs (best effort), the call mode, the ``training_fn`` path and, when set, ``compile`` and
``compile_kwargs`` (absent for the default ``compile=False``). Hooks, counters, the
validation config and the distributed manager are runtime objects and are not stored;
checkpoints add ``strategy_cls`` and ``runtime_state``.

Dotted paths read from a spec go through the import allow-list of
:mod:`nvalchemi._serialization` (``trust=True`` lifts it for files you wrote yourself).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from nvalchemi._serialization import import_path, object_to_path
from nvalchemi.training.model_spec import model_spec_for
from nvalchemi.training.optimizers import OptimizerConfig
from nvalchemi.training.spec import create_model_spec_from_json

__all__ = ["from_checkpoint_dict", "from_spec_dict", "to_checkpoint_dict", "to_spec_dict"]

_REQUIRED = ("optimizer_configs", "devices", "loss_fn_spec")


def to_spec_dict(strategy: Any) -> dict[str, Any]:
    """JSON-ready dict that :func:`from_spec_dict` turns back into an equivalent strategy."""
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
    if strategy.compile or strategy.compile_kwargs:  # absent by default: older readers
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
    return spec


def to_checkpoint_dict(strategy: Any) -> dict[str, Any]:
    """``strategy.to_spec_dict()`` plus ``strategy_cls`` and ``runtime_state`` (no file I/O).

    Calls the method so subclasses (``FineTuningStrategy``) contribute their fields.
    """
    spec = strategy.to_spec_dict()
    spec["strategy_cls"] = object_to_path(type(strategy))
    spec["runtime_state"] = strategy.runtime_state()
    return spec


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
    import json

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
    """Build ``cls`` from :func:`to_spec_dict` output; runtime arguments override the spec."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"from_spec_dict: spec must be a mapping; got {type(spec).__name__}.")
    missing = [key for key in _REQUIRED if key not in spec]
    if missing:
        raise ValueError(
            f"from_spec_dict: spec is missing required key(s) {missing}; write it with "
            "TrainingStrategy.to_spec_dict()."
        )
    model_specs = spec.get("model_specs", {})
    if not isinstance(model_specs, Mapping):
        raise ValueError(f"'model_specs' must be a mapping; got {type(model_specs).__name__}.")
    if "single_model_input" in spec and not isinstance(spec["single_model_input"], bool):
        raise ValueError(
            f"'single_model_input' must be a bool; got {spec['single_model_input']!r}."
        )
    configs = _optimizer_configs(spec["optimizer_configs"], trust)
    devices = spec["devices"]
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        raise ValueError(f"'devices' must be a list of device strings; got {devices!r}.")
    loss_spec = spec["loss_fn_spec"]
    if not isinstance(loss_spec, Mapping):
        raise ValueError(f"'loss_fn_spec' must be a mapping (a loss spec); got {loss_spec!r}.")
    try:
        loss_fn = create_model_spec_from_json(loss_spec, trust=trust).build()
    except Exception as exc:
        raise ValueError(f"'loss_fn_spec' does not build a loss function: {exc}") from exc
    if training_fn is None:
        if "training_fn" not in spec:
            raise ValueError(
                "from_spec_dict: no training_fn was supplied and the spec does not contain one; "
                "pass training_fn=..."
            )
        path = spec["training_fn"]
        if not isinstance(path, str):
            raise ValueError(f"'training_fn' must be a dotted-path string; got {path!r}.")
        try:
            training_fn = import_path(path, trust=trust)
        except Exception as exc:
            raise ValueError(f"'training_fn' path {path!r} cannot be imported: {exc}") from exc
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
    missing_models = {k: v for k, v in model_specs.items() if k not in runtime}
    merged = {**_rebuild_models(missing_models, trust), **runtime}
    if not merged:
        raise ValueError(
            "from_spec_dict: no models; the spec has no rebuildable 'model_specs' and no models= "
            "were passed. Pass models=... (the model(s) to train)."
        )
    if models is not None:
        single = runtime_single and set(merged) == {"main"}
    else:
        single = spec.get("single_model_input", True) and set(merged) == {"main"}
    kwargs: dict[str, Any] = {
        "models": merged["main"] if single else merged,
        "optimizer_configs": configs,
        "num_epochs": spec.get("num_epochs"),
        "num_steps": spec.get("num_steps"),
        "epoch_step_modifier": spec.get("epoch_step_modifier", 1.0),
        "devices": devices,
        "loss_fn": loss_fn,
        "training_fn": training_fn,
        "hooks": list(hooks or []),
    }
    for key in ("nonfinite_loss", "nonfinite_check_interval", "max_consecutive_skips"):
        if key in spec:
            kwargs[key] = spec[key]
    if "compile" in spec:
        if not isinstance(spec["compile"], bool):
            raise ValueError(f"'compile' must be a bool; got {spec['compile']!r}.")
        kwargs["compile"] = spec["compile"]
    if "compile_kwargs" in spec:
        if not isinstance(spec["compile_kwargs"], Mapping):
            raise ValueError(
                f"'compile_kwargs' must be a mapping of torch.compile options; got "
                f"{spec['compile_kwargs']!r}."
            )
        kwargs["compile_kwargs"] = dict(spec["compile_kwargs"])
    kwargs.update(overrides)
    return cls(**kwargs)


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
    """Rebuild the saved strategy class from a checkpoint dict and restore its counters."""
    target = cls
    path = spec.get("strategy_cls")
    if path is not None:
        if not isinstance(path, str):
            raise ValueError(f"'strategy_cls' must be a dotted-path string; got {path!r}.")
        try:
            target = import_path(path, trust=trust)
        except Exception as exc:
            raise ValueError(f"'strategy_cls' {path!r} cannot be imported: {exc}") from exc
        if not (isinstance(target, type) and issubclass(target, cls)):
            raise ValueError(f"'strategy_cls' {path!r} must resolve to a {cls.__name__} subclass.")
    strategy = target.from_spec_dict(
        spec, models=models, hooks=hooks, training_fn=training_fn, trust=trust, **overrides
    )
    state = spec.get("runtime_state", {})
    if not isinstance(state, Mapping):
        raise ValueError(f"'runtime_state' must be a mapping; got {type(state).__name__}.")
    strategy.load_runtime_state(state)
    return strategy


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


def _optimizer_configs(raw: Any, trust: bool) -> dict[str, list[OptimizerConfig]]:
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"'optimizer_configs' must map model keys to lists of optimizer specs; got {raw!r}."
        )
    out: dict[str, list[OptimizerConfig]] = {}
    for key, entries in raw.items():
        if not isinstance(key, str) or not isinstance(entries, list):
            raise ValueError(
                f"'optimizer_configs' entry {key!r} must map a str key to a list of optimizer "
                f"specs; got {type(entries).__name__}."
            )
        built = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, Mapping):
                raise ValueError(
                    f"optimizer_configs[{key!r}][{i}] must be a mapping; got {entry!r}."
                )
            try:
                built.append(
                    OptimizerConfig.from_spec(create_model_spec_from_json(entry, trust=trust))
                )
            except Exception as exc:
                raise ValueError(
                    f"optimizer_configs[{key!r}][{i}] does not build an OptimizerConfig: {exc}"
                ) from exc
        out["main" if key == "0" else key] = built
    return out
