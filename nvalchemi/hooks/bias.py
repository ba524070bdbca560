"""A fixed bias potential added to the model's energy and forces: :class:`BiasedPotentialHook`.

Training on top of a known physical baseline (a short-range repulsion, a dispersion
correction, an umbrella or wall potential in sampling) means the model learns only what
the baseline misses: after the model runs, the hook adds the bias's energy and forces
to what the model predicted, so the loss compares *model + bias* with the labels and
the gradients reach the model through the sum.

Example:
    >>> import torch
    >>> from types import SimpleNamespace
    >>> def wall(batch):  # harmonic wall pushing atoms back below z = 1 Å
    ...     over = (batch.positions[:, 2] - 1.0).clamp(min=0.0)
    ...     energy = torch.zeros(batch.num_graphs).index_add(0, batch.batch_idx, 0.5 * over**2)
    ...     forces = torch.zeros_like(batch.positions)
    ...     forces[:, 2] = -over
    ...     return energy.unsqueeze(-1), forces
    >>> from nvalchemi.data import AtomicData, Batch
    >>> batch = Batch.from_data_list([AtomicData(atomic_numbers=torch.tensor([1]),
    ...                                          positions=torch.tensor([[0.0, 0.0, 3.0]]))])
    >>> predictions = {"predicted_energy": torch.zeros(1, 1), "predicted_forces": torch.zeros(1, 3)}
    >>> BiasedPotentialHook(wall)(SimpleNamespace(batch=batch, predictions=predictions))
    >>> predictions["predicted_energy"].item(), predictions["predicted_forces"].tolist()
    (2.0, [[0.0, 0.0, -2.0]])
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from enum import Enum
from typing import Any

import torch

from nvalchemi.hooks.protocol import runs_at

__all__ = ["BiasedPotentialHook"]

DEFAULT_STAGE_NAMES = frozenset({"AFTER_FORWARD", "AFTER_COMPUTE"})
"""Stages the hook runs at when no stage is given: right after the model (training, dynamics)."""

BiasFunction = Callable[[Any], "tuple[torch.Tensor, torch.Tensor | None]"]


class BiasedPotentialHook:
    """Add ``bias_fn(batch)``'s energy ``[B, 1]`` and forces ``[V, 3]`` after the model call.

    In training the sums go into ``ctx.predictions`` (``predicted_energy`` and
    ``predicted_forces``, or the keys given), replacing the entries of that mapping
    out of place: the model's own tensors are not modified and the loss sees
    *model + bias*. Where a context has no predictions (a dynamics engine that writes
    its results to the batch) they are added to ``batch.energy`` and ``batch.forces``.

    Args:
        bias_fn: ``batch -> (energy, forces)``; ``energy`` of shape ``[B, 1]`` (or
            ``[B]``), ``forces`` of shape ``[V, 3]`` or ``None`` for an energy-only bias.
            Give forces explicitly (``-dE/dr``): the hook does not differentiate the bias.
        frequency: run every ``frequency`` steps.
        stage: the stage to run at (``None``: right after the model, ``AFTER_FORWARD`` in
            training or a dynamics engine's ``AFTER_COMPUTE``).
        energy_key, forces_key: the prediction keys to add to.

    Raises:
        ValueError: (when called) the bias has the wrong shape, or there is nothing to
            add it to; the message names the key and both shapes.
    """

    def __init__(
        self,
        bias_fn: BiasFunction,
        *,
        frequency: int = 1,
        stage: Enum | None = None,
        energy_key: str = "predicted_energy",
        forces_key: str = "predicted_forces",
    ) -> None:
        if not callable(bias_fn):
            raise TypeError(f"BiasedPotentialHook: bias_fn must be callable; got {bias_fn!r}")
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(
                f"BiasedPotentialHook: frequency must be an int >= 1; got {frequency!r}"
            )
        self.bias_fn = bias_fn
        self.frequency = frequency
        self.stage = stage
        self.energy_key = energy_key
        self.forces_key = forces_key

    def __repr__(self) -> str:
        name = getattr(self.bias_fn, "__name__", type(self.bias_fn).__name__)
        return f"BiasedPotentialHook({name}, frequency={self.frequency}, stage={self.stage})"

    def _runs_on_stage(self, stage: Enum) -> bool:
        return runs_at(self.stage, stage, DEFAULT_STAGE_NAMES)

    def __call__(self, ctx: Any, stage: Enum | None = None) -> None:
        batch = getattr(ctx, "batch", None)
        if batch is None:
            return
        energy, forces = self.bias_fn(batch)
        predictions = getattr(ctx, "predictions", None)
        if isinstance(predictions, MutableMapping):
            target, keys = predictions, (self.energy_key, self.forces_key)
        else:
            target, keys = batch, ("energy", "forces")
        _add(target, keys[0], energy, (batch.num_graphs, 1), "energy")
        if forces is not None:
            _add(target, keys[1], forces, (batch.num_nodes, 3), "forces")


def _add(target: Any, key: str, bias: torch.Tensor, shape: tuple[int, int], what: str) -> None:
    if not isinstance(bias, torch.Tensor):
        raise TypeError(
            f"BiasedPotentialHook: bias_fn must return tensors; its {what} is {type(bias).__name__}"
        )
    if bias.dim() == 1 and what == "energy":
        bias = bias.unsqueeze(-1)
    if tuple(bias.shape) != shape:
        raise ValueError(
            f"BiasedPotentialHook: the bias {what} has shape {tuple(bias.shape)}; expected "
            f"{shape} for this batch"
        )
    current = target.get(key)
    if current is None:
        raise ValueError(
            f"BiasedPotentialHook: nothing to add the bias {what} to: {key!r} is missing "
            "(the model does not predict it; set energy_key/forces_key, or return no forces)"
        )
    target[key] = current + bias.to(dtype=current.dtype, device=current.device).reshape(
        current.shape
    )
