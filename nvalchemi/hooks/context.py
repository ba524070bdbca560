"""The context objects engines hand to hooks.

Engines build one context per run and update it in place between stages, so
hooks must not keep a context beyond their call and expect it to stay the same
(copy what you need). Contexts use ``__slots__``: assigning an unknown
attribute raises ``AttributeError`` instead of silently creating it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from nvalchemi.data import Batch

__all__ = ["DynamicsContext", "HookContext", "TrainContext"]


@dataclass(kw_only=True, slots=True, eq=False)
class HookContext:
    """What every hook sees: the batch, the model, the rank and the engine.

    Example:
        >>> ctx = HookContext(batch=None)
        >>> ctx.global_rank, ctx.model
        (0, None)
    """

    batch: Batch | None
    """The batch being processed (``None`` at stages outside the batch loop)."""
    model: nn.Module | None = None
    """The engine's primary model."""
    global_rank: int = 0
    """Rank of this process among all processes (0 in a single process)."""
    workflow: Any = field(default=None, repr=False)
    """Back-reference to the engine running the hooks."""


@dataclass(kw_only=True, slots=True, eq=False)
class DynamicsContext(HookContext):
    """Context of a simulation engine (steps and a per-system convergence mask)."""

    step_count: int = 0
    converged_mask: Tensor | None = None


@dataclass(kw_only=True, slots=True, eq=False)
class TrainContext(HookContext):
    """Context of a training run, updated in place by the strategy.

    Tensor fields hold device tensors; reading a scalar from them (``float(ctx.loss)``)
    synchronises with the device, so do it only at the steps you report on.

    Loss visibility: ``loss``/``losses``/``predictions`` are ``None`` at
    ``BEFORE_TRAINING``, ``BEFORE_EPOCH``, ``BEFORE_BATCH`` and until the batch computes
    them; ``loss``/``losses`` are live (attached to the graph) at ``AFTER_LOSS`` and
    ``BEFORE_BACKWARD``, detached from ``AFTER_BACKWARD`` on (also at ``AFTER_EPOCH``
    and ``AFTER_VALIDATION``, where they are the last training batch's), and ``None``
    at ``AFTER_TRAINING``.

    Example:
        >>> ctx = TrainContext(batch=None, step_count=3)
        >>> ctx.optimizers, ctx.predictions
        ([], None)
    """

    step_count: int = 0
    """Optimizer steps completed by this process."""
    global_step_count: int = 0
    """Optimizer steps completed across all data-parallel processes."""
    batch_count: int = 0
    """Batches consumed, including batches whose optimizer step was skipped."""
    epoch_step_count: int = 0
    """Batches consumed in the current epoch."""
    epoch: int = 0
    """Current epoch (the strategy's ``epoch_count``)."""
    epoch_length: int | None = None
    """Batches per epoch of the loader being trained on (``None`` when unknown: an
    unsized loader, or ``train_batch``). Gradient accumulation closes its window at
    the last batch of an epoch (``epoch_step_count == epoch_length - 1``)."""
    predictions: Mapping[str, Tensor] | None = None
    """Outputs of ``training_fn`` for the current batch (set at ``AFTER_FORWARD``)."""
    loss: Tensor | None = None
    """Total loss of the current batch (live or detached, see the class docstring)."""
    losses: Mapping[str, Tensor] | None = None
    """Per-component losses (a ``ComposedLossOutput``)."""
    grad_norm: Tensor | None = None
    """Total gradient norm before clipping, published by a clipping hook."""
    models: Mapping[str, nn.Module] | None = None
    """The strategy's named models (the same mapping, not a copy)."""
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    """Runtime optimizers, flattened over models."""
    lr_schedulers: list[Any] = field(default_factory=list)
    """Schedulers aligned with ``optimizers`` (``None`` where an optimizer has none)."""
    gradients: Mapping[str, Tensor] | None = None
    """Optional gradient snapshot published by a hook."""
    grad_scaler: torch.amp.GradScaler | None = None
    """Set by the mixed-precision hook when fp16 loss scaling is active."""
    validation: Mapping[str, Any] | None = None
    """Latest validation summary (the strategy's ``last_validation``)."""

    def clear_step_outputs(self) -> None:
        """Forget the per-batch outputs (predictions, losses, gradient norm).

        Called by the training loop at the start of a batch so that hooks never
        see the previous batch's tensors (and those tensors can be freed).
        """
        self.predictions = None
        self.loss = None
        self.losses = None
        self.grad_norm = None
        self.gradients = None
