"""The PaiNN training recipe for the bundled EMT data set, in one place.

:class:`PaiNNRecipe` holds every number the quickstart, ``train init --model painn`` and
``examples/train_painn_bundled.py`` use; :data:`QUICKSTART` is the default, :data:`QUICK`
a tiny variant for smoke tests. Its builders (:meth:`~PaiNNRecipe.model_kwargs`,
:meth:`~PaiNNRecipe.loss_fn`, :meth:`~PaiNNRecipe.optimizer_config`) make real objects.

How the numbers were chosen (``scripts/tune_painn.py``, 2 CPU cores): a small model that
sees many epochs beats a larger one in a budget of minutes (hidden 32 over 64 at 5 and
14 minutes); weight decay, a larger energy weight (30) or a 5.5 Å cutoff did not help.

Example:
    >>> from nvalchemi.app.jobs.recipe import QUICKSTART
    >>> QUICKSTART.cutoff, QUICKSTART.replace(epochs=3).epochs
    (5.0, 3)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["PLACEHOLDER_STEPS", "QUICK", "QUICKSTART", "PaiNNRecipe"]


@dataclass(frozen=True)
class PaiNNRecipe:
    """Every setting of a PaiNN training run on the bundled EMT data.

    Loss: ``energy_weight * MSE(energy per atom) + force_weight * MSE(force components)``
    (eV/atom, eV/Å), plus ``stress_weight * MSE(stress components)`` (eV/Å³) when the
    data has stress. Learning rate: warm-up from ``lr / 25`` over ``warmup_fraction`` of
    the run, then cosine decay to ``lr * final_lr_fraction``
    (:class:`~nvalchemi.training.time_budget.WarmupCosineLR`).
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
    epochs: int | None = None
    """A fixed number of epochs (``None``: fit the run to ``minutes``)."""
    minutes: float = 5.0
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_fraction: float = 0.03
    final_lr_fraction: float = 0.01
    energy_weight: float = 10.0
    force_weight: float = 1.0
    stress_weight: float = 100.0
    """An error of 1 meV/Å³ (0.16 GPa) in every stress component costs as much as one of
    10 meV/Å in every force component. On the bundled data (2 cores, same load) weight 100
    halved the stress error (3.1 -> 1.3 meV/Å³) for 5 % on the force error; 1000 cost
    a third more force error."""
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

    def loss_fn(self, dtype_policy: str | None = None, *, stress: bool = False) -> Any:
        """Per-atom energy MSE plus force MSE (plus stress MSE), with raw weights."""
        from nvalchemi.training.losses import (
            ComposedLossFunction,
            EnergyMSELoss,
            ForceMSELoss,
            StressMSELoss,
        )

        terms, weights = (
            [EnergyMSELoss(per_atom=True), ForceMSELoss()],
            [self.energy_weight, self.force_weight],
        )
        if stress:
            terms.append(StressMSELoss())
            weights.append(self.stress_weight)
        return ComposedLossFunction(
            terms, weights=weights, normalize_weights=False, dtype_policy=dtype_policy
        )

    def optimizer_config(self, total_steps: int | None) -> Any:
        """AdamW with a warm-up + cosine schedule over ``total_steps`` (``None``: a placeholder
        length that a ``TimeBudgetHook`` fits to the budget)."""
        import torch

        from nvalchemi.training.optimizers import OptimizerConfig
        from nvalchemi.training.time_budget import WarmupCosineLR

        return OptimizerConfig(
            torch.optim.AdamW,
            {"lr": self.lr, "weight_decay": self.weight_decay},
            WarmupCosineLR,
            {
                "total_steps": int(total_steps or PLACEHOLDER_STEPS),
                "warmup_fraction": self.warmup_fraction,
                "initial_fraction": 1.0 / 25.0,
                "final_fraction": self.final_lr_fraction,
            },
        )


PLACEHOLDER_STEPS = 1000
"""Schedule length written into jobs whose length is fitted to a time budget at run time."""

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
    minutes=1.0,
    log_every_n_steps=2,
)
"""A tiny run for smoke tests and CI (seconds)."""
