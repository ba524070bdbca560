"""Helpers of :mod:`nvalchemi.training.finetune`: job payloads, recipe reuse, plain weights.

* :func:`rehydrate_payload` turns a job file's ``strategy`` payload (spec dumps) into
  constructor arguments;
* :func:`apply_reuse` takes the loss and optimizer recipe from a checkpoint's metadata;
* :func:`load_plain_weights` loads a ``state_dict`` (file or mapping) into a model.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvalchemi.training.optimizers import OptimizerConfig
from nvalchemi.training.spec import create_model_spec_from_json

__all__ = [
    "apply_reuse",
    "load_patches",
    "load_plain_weights",
    "pattern_tuple",
    "reject_new_run_conflicts",
    "rehydrate_payload",
]

_COUNTERS = (
    "step_count",
    "global_step_count",
    "batch_count",
    "epoch_count",
    "epoch_step_count",
    "epoch",
    "runtime_state",
)
_STATE_KEYS = ("state_dict", "model_state_dict", "model")


def pattern_tuple(value: Any, field: str) -> tuple[str, ...]:
    """Patterns as a tuple (``None`` -> ``()``, one string -> 1-tuple); ``ValueError`` otherwise."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise ValueError(f"{field} must be a list of pattern strings; got {value!r}.")
    return tuple(value)


def load_patches(value: Any, trust: bool) -> dict[str, Any]:
    """``module_patches`` with spec JSON dicts rehydrated (allow-listed unless ``trust``)."""
    if not value:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"'module_patches' must map targets to module specs; got {type(value).__name__}."
        )
    out: dict[str, Any] = {}
    for target, patch in value.items():
        if isinstance(patch, Mapping):
            try:
                patch = create_model_spec_from_json(patch, trust=trust)
            except Exception as exc:
                raise ValueError(f"module_patches[{target!r}] is not a valid spec: {exc}") from exc
        out[target] = patch
    return out


def reject_new_run_conflicts(kwargs: Mapping[str, Any], who: str) -> None:
    """``ValueError`` for counters or a non-empty ``model_specs`` in a new run's kwargs."""
    counters = sorted(k for k in _COUNTERS if k in kwargs)
    if counters:
        raise ValueError(
            f"{who} starts a new run at step 0; got {counters}. To continue a run use "
            "FineTuningStrategy.load_checkpoint(...) / TrainingStrategy.load_checkpoint(...)."
        )
    if kwargs.get("model_specs"):
        raise ValueError(
            f"{who} supplies the models itself; remove 'model_specs' from the strategy payload "
            f"(got {sorted(kwargs['model_specs'])})."
        )


def apply_reuse(
    kwargs: dict[str, Any],
    meta: Mapping[str, Any] | None,
    use_loss: bool,
    use_opt: bool,
    lr: float | None,
    trust: bool,
) -> None:
    """Fill ``loss_fn``/``optimizer_configs`` from the checkpoint's recipe (flags win)."""
    from nvalchemi.training._strategy_spec import _optimizer_configs

    wanted = [
        name for name, flag in (("loss_fn", use_loss), ("optimizer_configs", use_opt)) if flag
    ]
    if not wanted:
        return
    if meta is None:
        raise ValueError(
            f"Cannot reuse original {', '.join(wanted)} because checkpoint has no strategy "
            "metadata."
        )
    if use_loss:
        _drop_overridden(kwargs, ("loss_fn", "loss_fn_spec"), "use_original_loss")
        if "loss_fn_spec" not in meta:
            raise ValueError(
                "Cannot reuse original loss_fn: the checkpoint's strategy metadata has no "
                "loss_fn_spec. Pass loss_fn=... instead."
            )
        kwargs["loss_fn"] = _build_loss(meta["loss_fn_spec"], trust, "checkpoint loss_fn_spec")
    if use_opt:
        _drop_overridden(kwargs, ("optimizer_configs",), "use_original_opt_class")
        configs = _optimizer_configs(meta.get("optimizer_configs") or {}, trust)
        if not configs:
            raise ValueError(
                "Cannot reuse original optimizer_configs: the checkpoint's strategy metadata "
                "has none. Pass optimizer_configs=... instead."
            )
        if lr is not None:
            configs = {k: [_with_lr(c, float(lr)) for c in v] for k, v in configs.items()}
        kwargs["optimizer_configs"] = configs


def _drop_overridden(kwargs: dict[str, Any], keys: tuple[str, ...], flag: str) -> None:
    given = [k for k in keys if kwargs.pop(k, None) is not None]
    if given:
        warnings.warn(
            f"{flag}=True: ignoring the {' and '.join(given)} passed as well; the checkpoint's "
            f"recipe is used. Set {flag}=False to use yours.",
            UserWarning,
            stacklevel=4,
        )


def _with_lr(config: OptimizerConfig, lr: float) -> OptimizerConfig:
    fields = {name: getattr(config, name) for name in OptimizerConfig.model_fields}
    old = config.optimizer_kwargs.get("lr")
    fields["optimizer_kwargs"] = {**config.optimizer_kwargs, "lr": lr}
    if config.param_groups:
        factor = lr / old if isinstance(old, (int, float)) and old else None
        fields["param_groups"] = [
            {**g, "lr": (g["lr"] * factor if factor is not None else lr)} if "lr" in g else dict(g)
            for g in config.param_groups
        ]
    return OptimizerConfig(**fields)


def _build_loss(spec: Any, trust: bool, where: str) -> Any:
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where} must be a loss spec mapping; got {type(spec).__name__}.")
    try:
        return create_model_spec_from_json(spec, trust=trust).build()
    except Exception as exc:
        raise ValueError(f"{where} does not build a loss function: {exc}") from exc


def rehydrate_payload(kwargs: Mapping[str, Any], trust: bool, who: str) -> dict[str, Any]:
    """Turn job-payload keys (spec dumps) into constructor arguments."""
    from nvalchemi.training._strategy_spec import _optimizer_configs

    out = dict(kwargs)
    out.pop("model_specs", None)
    out.pop("single_model_input", None)  # the call mode follows the models supplied
    if "loss_fn_spec" in out:
        spec = out.pop("loss_fn_spec")
        if out.get("loss_fn") is not None:
            raise ValueError(f"{who}: pass loss_fn or loss_fn_spec, not both.")
        out["loss_fn"] = _build_loss(spec, trust, "loss_fn_spec")
    configs = out.get("optimizer_configs")
    if isinstance(configs, Mapping) and any(
        isinstance(v, list) and any(isinstance(c, Mapping) for c in v) for v in configs.values()
    ):
        out["optimizer_configs"] = _optimizer_configs(configs, trust)
    if "module_patches" in out:
        out["module_patches"] = load_patches(out["module_patches"], trust)
    missing = [k for k in ("loss_fn", "optimizer_configs") if out.get(k) is None]
    if missing:
        reuse = {"loss_fn": "use_original_loss", "optimizer_configs": "use_original_opt_class"}
        asks = [
            f"{k}=..." + (f" (or {reuse[k]}=True)" if who == "from_pretrained_checkpoint" else "")
            for k in missing
        ]
        raise ValueError(f"{who} needs {' and '.join(asks)}.")
    return out


# ---------------------------------------------------------------------------- plain weights
def load_plain_weights(
    model: Any,
    weights: str | os.PathLike | Mapping[str, Any],
    *,
    strict: bool,
    key_map: Mapping[str, str] | None,
    model_key: str | None,
) -> None:
    """Load a ``state_dict`` file (``weights_only``) or mapping into ``model`` (see the caller)."""
    target = _weights_target(model, model_key)
    if isinstance(weights, (str, os.PathLike)):
        from nvalchemi.training.checkpoint.store import safe_torch_load

        where = str(weights)
        raw = safe_torch_load(Path(weights), "cpu")
    elif isinstance(weights, Mapping):
        where, raw = "the given mapping", weights
    else:
        raise TypeError(
            f"weights must be a file path or a state_dict mapping; got {type(weights).__name__}."
        )
    state = _remap_keys(_find_state_dict(raw, where), key_map, target)
    _load_weights(target, state, strict, where)


def _weights_target(model: Any, model_key: str | None) -> nn.Module:
    if isinstance(model, nn.Module) and not isinstance(model, nn.ModuleDict):
        if model_key not in (None, "main"):
            raise ValueError(f"model_key={model_key!r} needs a mapping of models.")
        return model
    if not isinstance(model, (Mapping, nn.ModuleDict)) or not model:
        raise TypeError(
            f"model must be an nn.Module or a mapping of them; got {type(model).__name__}."
        )
    if model_key is None:
        if "main" in model:
            model_key = "main"
        elif len(model) == 1:
            model_key = next(iter(model))
        else:
            raise ValueError(
                f"model_key=... must name the model that receives the weights; models: "
                f"{sorted(model)}."
            )
    if model_key not in model:
        raise KeyError(f"model_key {model_key!r} is not in models {sorted(model)}.")
    return model[model_key]


def _find_state_dict(raw: Any, where: str) -> dict[str, torch.Tensor]:
    if isinstance(raw, Mapping) and raw and all(isinstance(v, torch.Tensor) for v in raw.values()):
        return dict(raw)
    if isinstance(raw, Mapping):
        for key in _STATE_KEYS:
            inner = raw.get(key)
            if (
                isinstance(inner, Mapping)
                and inner
                and all(isinstance(v, torch.Tensor) for v in inner.values())
            ):
                return dict(inner)
        keys = sorted(map(str, raw))[:10]
        raise ValueError(
            f"{where} is not a state_dict: expected a mapping of parameter names to tensors (or "
            f"one under {list(_STATE_KEYS)}); top-level keys: {keys}."
        )
    raise ValueError(f"{where} holds a {type(raw).__name__}, not a state_dict mapping.")


def _remap_keys(
    state: dict[str, torch.Tensor], key_map: Mapping[str, str] | None, target: nn.Module
) -> dict[str, torch.Tensor]:
    if key_map:
        prefixes = sorted(key_map, key=len, reverse=True)
        remapped = {}
        for key, value in state.items():
            for old in prefixes:
                if key.startswith(old):
                    key = key_map[old] + key[len(old) :]
                    break
            remapped[key] = value
        state = remapped
    own = target.state_dict()
    if (
        state
        and all(k.startswith("module.") for k in state)
        and not any(k.startswith("module.") for k in own)
    ):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state


def _load_weights(
    target: nn.Module, state: dict[str, torch.Tensor], strict: bool, where: str
) -> None:
    own = target.state_dict()
    mismatched = [
        f"{k}: {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and tuple(v.shape) != tuple(own[k].shape)
    ]
    if mismatched:
        raise ValueError(
            f"Weights from {where} do not fit {type(target).__name__}: shape mismatch for "
            f"{mismatched[:8]}. Build the model with the architecture the weights belong to."
        )
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        raise ValueError(
            f"Weights from {where} do not match {type(target).__name__}: missing keys "
            f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected keys "
            f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}. Rename prefixes with "
            "key_map={'old.': 'new.'}, or pass strict=False to load the matching keys only."
        )
    if missing or unexpected:
        warnings.warn(
            f"Loaded weights from {where} with strict=False: {len(missing)} model keys kept "
            f"their initial values (e.g. {missing[:3]}), {len(unexpected)} weights unused "
            f"(e.g. {unexpected[:3]}).",
            UserWarning,
            stacklevel=4,
        )
    target.load_state_dict(state, strict=False)
