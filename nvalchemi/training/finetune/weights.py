"""A plain ``state_dict`` loaded into your model: :func:`load_plain_weights`.

What :meth:`FineTuningStrategy.from_pretrained_weights
<nvalchemi.training.finetune.FineTuningStrategy.from_pretrained_weights>` reads: a file
(``torch.load(weights_only=True)``, no pickled code runs) or a mapping, unpacked from the
usual containers, with key prefixes renamed and DDP's ``module.`` stripped.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvalchemi.checkpoint_files import safe_torch_load

__all__ = ["load_plain_weights"]

_STATE_KEYS = ("state_dict", "model_state_dict", "model")


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
    def tensors(value: Any) -> bool:
        return (
            isinstance(value, Mapping)
            and bool(value)
            and all(isinstance(v, torch.Tensor) for v in value.values())
        )

    if isinstance(raw, Mapping):
        for inner in (raw, *(raw.get(key) for key in _STATE_KEYS)):
            if tensors(inner):
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
