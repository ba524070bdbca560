"""Runtime helpers around a training run: devices, train/eval modes, freezing, loaders.

These are the small pieces :class:`~nvalchemi.training.TrainingStrategy` uses at the
start of ``run()``; they also work on their own.

Example:
    >>> import torch
    >>> models = {"student": torch.nn.Linear(2, 1), "teacher": torch.nn.Linear(2, 1)}
    >>> with freeze_unconfigured_models(models, {"student": []}):
    ...     models["teacher"].weight.requires_grad, models["teacher"].training
    (False, False)
    >>> models["teacher"].weight.requires_grad, models["teacher"].training
    (True, True)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nvalchemi.distributed.runtime import get_world_size, is_distributed_initialized

__all__ = [
    "configure_dataloader",
    "configure_parallelism",
    "evaluating",
    "freeze_unconfigured_models",
    "move_to_devices",
    "rehome_optimizer_state",
    "train_configured_models",
    "training_world_size",
    "unwrap_model",
]

ModelsLike = nn.Module | Mapping[str, nn.Module]


def training_world_size(distributed_manager: Any = None) -> int:
    """How many processes train together (what ``global_step_count`` counts in).

    The manager's world size when one is given; else the process group's; else 1, even
    when launcher variables (torchrun/``srun``) name more ranks: processes that never
    joined a group train alone.
    """
    if distributed_manager is None and not is_distributed_initialized():
        return 1
    return get_world_size(distributed_manager)


def unwrap_model(module: nn.Module) -> nn.Module:
    """The user's module inside ``DistributedDataParallel``/``DataParallel`` wrappers."""
    while isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        module = module.module
    return module


def _modes(module: nn.Module) -> list[tuple[nn.Module, bool]]:
    # Every submodule's flag: restoring only the top-level one with .train(flag) would
    # overwrite submodules deliberately kept in another mode (e.g. a frozen BatchNorm).
    return [(m, m.training) for m in module.modules()]


def _restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    for module, training in modes:
        module.training = training


@contextmanager
def evaluating(model: nn.Module, outputs: set[str] | None = None) -> Iterator[None]:
    """``model`` in eval mode computing ``outputs`` (its ``model_config.active_outputs``,
    for a model that has one; ``None`` keeps them); on exit, also after an exception,
    every module's mode and the active outputs are what they were."""
    config = getattr(model, "model_config", None)
    previous = None if config is None else config.active_outputs
    modes = _modes(model)
    if config is not None and outputs is not None:
        config.active_outputs = outputs
    model.eval()
    try:
        yield
    finally:
        _restore_modes(modes)
        if config is not None:
            config.active_outputs = previous


@contextmanager
def freeze_unconfigured_models(
    models: Mapping[str, nn.Module], optimizer_configs: Mapping[str, Any]
) -> Iterator[None]:
    """Put models absent from ``optimizer_configs`` in eval mode with frozen parameters.

    On exit every module's mode and every parameter's ``requires_grad`` are restored,
    also after an exception. Parameters shared with a configured model are left alone.
    """
    trainable_ids = {
        id(p) for key, m in models.items() if key in optimizer_configs for p in m.parameters()
    }
    modes: list[tuple[nn.Module, bool]] = []
    flags: list[tuple[nn.Parameter, bool]] = []
    for key, model in models.items():
        if key in optimizer_configs:
            continue
        modes.extend(_modes(model))
        for param in model.parameters():
            if id(param) not in trainable_ids:
                flags.append((param, param.requires_grad))
                param.requires_grad_(False)
        model.eval()
    try:
        yield
    finally:
        _restore_modes(modes)
        for param, requires_grad in flags:
            param.requires_grad_(requires_grad)


@contextmanager
def train_configured_models(
    models: Mapping[str, nn.Module], optimizer_configs: Mapping[str, Any]
) -> Iterator[None]:
    """Put the models present in ``optimizer_configs`` in training mode; restore on exit."""
    modes: list[tuple[nn.Module, bool]] = []
    for key, model in models.items():
        if key in optimizer_configs:
            modes.extend(_modes(model))
            model.train()
    try:
        yield
    finally:
        _restore_modes(modes)


def move_to_devices(
    models: ModelsLike, devices: Sequence[torch.device | str], *, non_blocking: bool = False
) -> ModelsLike:
    """Move one model, or named models, to their devices (in place); return the same shape.

    One device is used for every model; otherwise ``devices`` pairs with the models
    in insertion order.

    Raises:
        ValueError: ``devices`` is empty, or its length is neither 1 nor the number of models.
    """
    devices = [torch.device(d) for d in devices]
    if isinstance(models, (Mapping, nn.ModuleDict)):
        if len(devices) not in (1, len(models)):
            raise ValueError(
                f"devices must have length 1 or len(models)={len(models)}; got {len(devices)}."
            )
        targets = devices * len(models) if len(devices) == 1 else devices
        for model, device in zip(models.values(), targets):
            _move(model, device, non_blocking)
        return models
    if len(devices) != 1:
        raise ValueError(f"A single model needs exactly one device; got {len(devices)}: {devices}.")
    _move(models, devices[0], non_blocking)
    return models


def _move(model: nn.Module, device: torch.device, non_blocking: bool) -> None:
    # Skip the call when everything is already there: Module.to() walks every tensor.
    if any(t.device != device for t in itertools.chain(model.parameters(), model.buffers())):
        model.to(device, non_blocking=non_blocking)


def rehome_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Move an optimizer's per-parameter state to the devices of its parameters.

    ``load_state_dict`` places state where the parameters were at load time; a model
    moved afterwards would leave e.g. Adam moments behind. A CPU ``step`` counter of a
    non-capturable, non-fused optimizer stays on the CPU (PyTorch's own placement).
    """
    for group in optimizer.param_groups:
        step_follows = bool(group.get("capturable") or group.get("fused"))
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if not isinstance(value, torch.Tensor) or value.device == param.device:
                    continue
                if key == "step" and not step_follows and value.device.type == "cpu":
                    continue
                state[key] = value.to(param.device)


def configure_dataloader(
    dataset: Any,
    *,
    batch_size: int,
    shuffle: bool | None = None,
    sampler: Any = None,
    batch_sampler: Any = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **loader_kwargs: Any,
) -> torch.utils.data.DataLoader:
    """A ``torch.utils.data.DataLoader`` that collates ``AtomicData`` into a ``Batch``.

    ``collate_fn=None`` collates ``AtomicData`` items with ``Batch.from_data_list`` and
    anything else with torch's ``default_collate``. ``shuffle=None`` shuffles unless a
    sampler or batch sampler is given. Other keywords (``num_workers``, ``pin_memory``,
    ``drop_last`` ...) go to the loader.

    Raises:
        ValueError: ``shuffle=True`` together with a ``sampler`` or ``batch_sampler``, or
            a ``batch_sampler`` together with ``batch_size``/``sampler`` choices it overrides.
    """
    if shuffle and (sampler is not None or batch_sampler is not None):
        raise ValueError(
            "configure_dataloader: shuffle=True is incompatible with sampler/batch_sampler; "
            "let the sampler shuffle (e.g. DistributedSampler(shuffle=True)) and pass "
            "shuffle=None."
        )
    if batch_sampler is not None and sampler is not None:
        raise ValueError("configure_dataloader: pass either sampler or batch_sampler, not both.")
    if batch_sampler is not None:
        loader_kwargs["batch_sampler"] = batch_sampler
    else:
        shuffle = sampler is None if shuffle is None else bool(shuffle)
        loader_kwargs.update(batch_size=batch_size, shuffle=shuffle, sampler=sampler)
    return torch.utils.data.DataLoader(
        dataset, collate_fn=collate_fn or _collate_atomic_data, **loader_kwargs
    )


def _collate_atomic_data(items: list[Any]) -> Any:
    from nvalchemi.data import AtomicData, Batch  # light

    items = list(items)
    if items and all(isinstance(item, AtomicData) for item in items):
        return Batch.from_data_list(items)
    return torch.utils.data.default_collate(items)


def configure_parallelism(
    models: ModelsLike,
    *,
    strategy: str = "none",
    optimizer_configs: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    distributed_manager: Any = None,
    **ddp_kwargs: Any,
) -> ModelsLike:
    """Wrap models for data parallelism; return the same shape.

    ``strategy="none"`` returns ``models`` unchanged. ``strategy="ddp"`` wraps each
    model (only those in ``optimizer_configs`` when given) in
    ``DistributedDataParallel`` when more than one process is running, and is a no-op
    otherwise. ``ddp_kwargs`` go to ``DistributedDataParallel``.

    Raises:
        ValueError: an unknown ``strategy``.
    """
    if strategy == "none":
        return models
    if strategy != "ddp":
        raise ValueError(
            f"Unsupported parallelism strategy {strategy!r}; supported: ['none', 'ddp']."
        )

    if (
        not is_distributed_initialized(distributed_manager)
        or get_world_size(distributed_manager) <= 1
    ):
        return models

    def wrap(model: nn.Module) -> nn.Module:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model
        kwargs = dict(ddp_kwargs)
        target = torch.device(device) if device is not None else None
        if target is not None and target.type == "cuda" and "device_ids" not in kwargs:
            kwargs["device_ids"] = [target]
        return nn.parallel.DistributedDataParallel(model, **kwargs)

    if isinstance(models, (Mapping, nn.ModuleDict)):
        wrapped = dict(models.items())
        for key, model in wrapped.items():
            if optimizer_configs is None or key in optimizer_configs:
                wrapped[key] = wrap(model)
        return wrapped
    return wrap(models)
