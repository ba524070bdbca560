"""The PaiNN training recipe for the bundled EMT data set, in one place.

:class:`PaiNNRecipe` holds every number the quickstart (and ``train init --model
painn``, and ``examples/train_painn_bundled.py``) uses: model size, cutoff, optimizer,
schedule, loss weights, EMA, batch size, epochs. :data:`QUICKSTART` is the default;
:data:`QUICK` is a tiny variant for smoke tests (``quickstart --quick``). Change a
default here and every entry point follows.

The builders turn a recipe into real objects: :meth:`PaiNNRecipe.model_kwargs`,
:meth:`PaiNNRecipe.loss_fn`, :meth:`PaiNNRecipe.optimizer_config` (AdamW with a
``OneCycleLR`` warm-up + cosine decay over the run).

Example:
    >>> from nvalchemi.training.cli.recipe import QUICKSTART
    >>> QUICKSTART.cutoff, QUICKSTART.replace(epochs=3).epochs
    (5.0, 3)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["QUICK", "QUICKSTART", "PaiNNRecipe"]


@dataclass(frozen=True)
class PaiNNRecipe:
    """Every setting of a PaiNN training run on the bundled EMT data.

    Loss: ``energy_weight * MSE(energy per atom) + force_weight * MSE(force components)``.
    Learning rate: linear warm-up from ``lr / 25`` over ``warmup_fraction`` of the run,
    then cosine decay to ``lr * final_lr_fraction`` (``torch.optim.lr_scheduler.OneCycleLR``).
    """

    # model
    cutoff: float = 5.0
    hidden_channels: int = 32
    num_interactions: int = 2
    num_rbf: int = 16
    cutoff_fn: str = "cosine"
    # data
    batch_size: int = 8
    max_train: int | None = None
    max_val: int | None = None
    max_test: int | None = None
    # optimisation
    epochs: int = 12
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_fraction: float = 0.03
    final_lr_fraction: float = 0.01
    energy_weight: float = 10.0
    force_weight: float = 1.0
    ema_decay: float = 0.995
    grad_clip_norm: float | None = 10.0
    # run
    log_every_n_steps: int = 20
    keep_last: int = 3
    seed: int = 0

    def replace(self, **changes: Any) -> PaiNNRecipe:
        """A copy with ``changes`` applied (``None`` values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def model_kwargs(self) -> dict[str, Any]:
        """``PaiNN`` keyword arguments (data-dependent ones are fitted by ``from_data``)."""
        return {
            "cutoff": self.cutoff,
            "hidden_channels": self.hidden_channels,
            "num_interactions": self.num_interactions,
            "num_rbf": self.num_rbf,
            "cutoff_fn": self.cutoff_fn,
        }

    def loss_fn(self, dtype_policy: str | None = None) -> Any:
        """Per-atom energy MSE plus force MSE, with raw (unnormalized) weights."""
        from nvalchemi.training.losses import ComposedLossFunction, EnergyMSELoss, ForceMSELoss

        return ComposedLossFunction(
            [EnergyMSELoss(per_atom=True), ForceMSELoss()],
            weights=[self.energy_weight, self.force_weight],
            normalize_weights=False,
            dtype_policy=dtype_policy,
        )

    def optimizer_config(self, total_steps: int | None) -> Any:
        """AdamW; with ``total_steps`` a OneCycleLR warm-up + cosine schedule over them."""
        import torch

        from nvalchemi.training.optimizers import OptimizerConfig

        kwargs = {"lr": self.lr, "weight_decay": self.weight_decay}
        if total_steps is None:
            return OptimizerConfig(torch.optim.AdamW, kwargs)
        return OptimizerConfig(
            torch.optim.AdamW,
            kwargs,
            torch.optim.lr_scheduler.OneCycleLR,
            {
                "max_lr": self.lr,
                # one spare step: the schedule must never be stepped past its end
                "total_steps": int(total_steps) + 1,
                "pct_start": self.warmup_fraction,
                "anneal_strategy": "cos",
                "div_factor": 25.0,
                "final_div_factor": 1.0 / (25.0 * self.final_lr_fraction),
                "cycle_momentum": False,
            },
        )


QUICKSTART = PaiNNRecipe()
"""The quickstart default: a few minutes on 2 CPU cores."""

QUICK = PaiNNRecipe(
    hidden_channels=8,
    num_interactions=1,
    num_rbf=8,
    cutoff=4.5,
    batch_size=8,
    max_train=48,
    max_val=16,
    max_test=16,
    epochs=2,
    log_every_n_steps=2,
)
"""A tiny run for smoke tests and CI (seconds)."""
