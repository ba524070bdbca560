"""The built-in leaf losses for energies, forces and stresses.

Shapes follow the batch layout: energies ``(B, 1)`` (or ``(B,)``), forces ``(V, 3)`` over the
concatenated atoms of the batch, stresses ``(B, 3, 3)``. Per-graph reductions take
``batch_idx``/``num_graphs``/``num_nodes_per_graph`` keyword metadata (``compute_supervised_loss``
passes them from the batch; a ``batch=`` keyword is used as a fallback source).

Missing labels (NaN targets) are always masked; a structure with no label contributes nothing
and is not counted in any mean (its ``per_sample_loss`` entry is NaN and its
``per_sample_valid`` entry ``False``); an all-missing batch gives 0 with zero gradient.

Per-structure loss weights: a ``loss_weight=`` keyword (the batch's ``loss_weight`` field,
``(B,)`` or ``(B, 1)``) multiplies each structure's term, and each atom's force term by its
structure's weight, inside the same mean (not renormalised by the weights' sum): weight 2
counts a structure twice, 0 drops it. See :mod:`nvalchemi.training.losses.base`.

>>> import torch
>>> loss = EnergyMSELoss()
>>> float(loss(torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [float("nan")]])))
1.0
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from nvalchemi.training.losses.base import (
    BaseLossFunction,
    DTypePolicy,
    ReductionContext,
    graph_loss_weight,
    weight_rows,
)
from nvalchemi.training.losses.reductions import per_graph_sum

__all__ = [
    "EnergyHuberLoss",
    "EnergyMAELoss",
    "EnergyMSELoss",
    "ForceHuberLoss",
    "ForceL2NormLoss",
    "ForceMSELoss",
    "StressHuberLoss",
    "StressMSELoss",
]


def _metadata(loss: BaseLossFunction, kwargs: dict[str, Any], name: str, required: bool = True):
    value = kwargs.get(name)
    if value is None and kwargs.get("batch") is not None:
        value = getattr(kwargs["batch"], name, None)
    if value is None and required:
        raise ValueError(
            f"{type(loss).__name__} requires {name}=... metadata; pass it as a keyword argument "
            f"(compute_supervised_loss passes batch.{name}) or pass batch=<Batch>."
        )
    return value


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not delta > 0:
        raise ValueError(f"Huber delta must be a positive number, got {delta!r}")
    return delta


def _huber(pred: torch.Tensor, target: torch.Tensor, delta: float) -> torch.Tensor:
    """``0.5 r**2`` for ``|r| < delta`` else ``delta * (|r| - delta / 2)`` (PyTorch convention)."""
    return F.huber_loss(pred, target, reduction="none", delta=delta)


def _graph_balanced(
    loss: BaseLossFunction,
    item_sum: torch.Tensor,
    item_count: torch.Tensor,
    batch_idx: torch.Tensor | None = None,
    num_graphs: int | None = None,
    loss_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over labelled graphs of each graph's mean residual over its labelled entries.

    ``loss_weight`` (``(B,)``) scales each graph's term inside that mean.
    """
    if batch_idx is not None:
        item_sum = per_graph_sum(item_sum, batch_idx, num_graphs)
        item_count = per_graph_sum(item_count, batch_idx, num_graphs)
    per_graph = item_sum / item_count.clamp_min(1)
    labelled = item_count > 0
    loss.record_per_sample(per_graph, labelled)
    if loss_weight is not None:
        per_graph = per_graph * weight_rows(loss, loss_weight, per_graph)
    return per_graph.sum() / labelled.sum().clamp_min(1)


# ------------------------------------------------------------------------------- energy


class _EnergyLoss(BaseLossFunction):
    requires_eval_grad = False
    _atom_weighted: ClassVar[bool] = True

    def _store(self, target_key: str, prediction_key: str, per_atom: bool, ignore_nonfinite: bool):
        self.target_key, self.prediction_key = target_key, prediction_key
        self.per_atom, self.ignore_nonfinite = bool(per_atom), bool(ignore_nonfinite)

    def normalize(self, pred, target, **kwargs):
        ctx = ReductionContext()
        weight = graph_loss_weight(self, kwargs)
        if weight is not None:
            ctx["loss_weight"] = weight_rows(self, weight, pred)
        if not self.per_atom:
            return pred, target, ctx
        counts = torch.as_tensor(_metadata(self, kwargs, "num_nodes_per_graph"), device=pred.device)
        if counts.ndim == 2:  # (B, V_max) padded node mask
            counts = counts.sum(-1)
        if counts.ndim != 1 or counts.shape[0] != pred.shape[0]:
            raise ValueError(
                f"{type(self).__name__}: num_nodes_per_graph must have shape (B,) with "
                f"B={pred.shape[0]} energies, got {tuple(counts.shape)}"
            )
        counts = counts.to(pred.dtype).clamp_min(1).reshape(-1, *([1] * (pred.ndim - 1)))
        if self._atom_weighted:
            ctx["weights"] = counts
        return pred / counts, target / counts, ctx

    def reduce(self, residual, valid, ctx, **kwargs):
        if residual.ndim == 1 or (residual.ndim == 2 and residual.shape[1] == 1):
            self.record_per_sample(residual, valid)
        return super().reduce(residual, valid, ctx)


class EnergyMSELoss(_EnergyLoss):
    """Mean squared energy error.

    ``per_atom=True`` compares energies per atom and weights each structure by its atom count:
    ``sum_i N_i (dE_i / N_i)**2 / sum_i N_i``.
    """

    def __init__(
        self,
        *,
        target_key: str = "energy",
        prediction_key: str = "predicted_energy",
        per_atom: bool = False,
        ignore_nonfinite: bool = False,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__(dtype_policy=dtype_policy)
        self._store(target_key, prediction_key, per_atom, ignore_nonfinite)

    def compute_residual(self, pred, target, valid):
        return (pred - target) ** 2


class EnergyMAELoss(_EnergyLoss):
    """Mean absolute energy error; per atom and atom-count weighted by default."""

    def __init__(
        self,
        *,
        target_key: str = "energy",
        prediction_key: str = "predicted_energy",
        per_atom: bool = True,
        ignore_nonfinite: bool = True,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__(dtype_policy=dtype_policy)
        self._store(target_key, prediction_key, per_atom, ignore_nonfinite)

    def compute_residual(self, pred, target, valid):
        return (pred - target).abs()


class EnergyHuberLoss(_EnergyLoss):
    """Huber loss of (per-atom) energies; a plain mean over structures (MACE-style)."""

    _atom_weighted = False

    def __init__(
        self,
        *,
        target_key: str = "energy",
        prediction_key: str = "predicted_energy",
        per_atom: bool = True,
        delta: float = 0.01,
        ignore_nonfinite: bool = True,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__(dtype_policy=dtype_policy)
        self._store(target_key, prediction_key, per_atom, ignore_nonfinite)
        self.delta = _check_delta(delta)

    def compute_residual(self, pred, target, valid):
        return _huber(pred, target, self.delta)


# ------------------------------------------------------------------------------- forces


class _ForceLoss(BaseLossFunction):
    requires_eval_grad = True

    def _store(self, target_key, prediction_key, normalize_by_atom_count, ignore_nonfinite):
        self.target_key, self.prediction_key = target_key, prediction_key
        self.normalize_by_atom_count = bool(normalize_by_atom_count)
        self.ignore_nonfinite = bool(ignore_nonfinite)

    def reduce(self, residual, valid, ctx, **kwargs):
        weight = graph_loss_weight(self, kwargs)
        if not self.normalize_by_atom_count:
            if weight is not None:
                batch_idx = _metadata(self, kwargs, "batch_idx")
                ctx["loss_weight"] = weight_rows(self, weight, residual, batch_idx)
            return super().reduce(residual, valid, ctx)
        return _graph_balanced(
            self,
            residual.sum(-1),
            valid.sum(-1).to(residual.dtype),
            _metadata(self, kwargs, "batch_idx"),
            _metadata(self, kwargs, "num_graphs", required=False),
            weight,
        )


class ForceMSELoss(_ForceLoss):
    """Mean squared force error over components, for dense ``(V, 3)`` forces.

    ``normalize_by_atom_count=True`` (default) averages within each structure first, then over
    structures, so large structures do not dominate (needs ``batch_idx``).
    """

    def __init__(
        self,
        *,
        target_key: str = "forces",
        prediction_key: str = "predicted_forces",
        normalize_by_atom_count: bool = True,
        ignore_nonfinite: bool = False,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__(dtype_policy=dtype_policy)
        self._store(target_key, prediction_key, normalize_by_atom_count, ignore_nonfinite)

    def compute_residual(self, pred, target, valid):
        return (pred - target) ** 2


class ForceHuberLoss(ForceMSELoss):
    """Componentwise Huber force loss; a global mean over components by default."""

    def __init__(
        self,
        *,
        target_key: str = "forces",
        prediction_key: str = "predicted_forces",
        normalize_by_atom_count: bool = False,
        delta: float = 0.01,
        ignore_nonfinite: bool = True,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__(
            target_key=target_key,
            prediction_key=prediction_key,
            normalize_by_atom_count=normalize_by_atom_count,
            ignore_nonfinite=ignore_nonfinite,
            dtype_policy=dtype_policy,
        )
        self.delta = _check_delta(delta)

    def compute_residual(self, pred, target, valid):
        return _huber(pred, target, self.delta)


class ForceL2NormLoss(_ForceLoss):
    """Mean Euclidean norm of the per-atom force error (an atom is labelled if all 3 are)."""

    def __init__(
        self,
        *,
        target_key: str = "forces",
        prediction_key: str = "predicted_forces",
        normalize_by_atom_count: bool = True,
        ignore_nonfinite: bool = True,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__(dtype_policy=dtype_policy)
        self._store(target_key, prediction_key, normalize_by_atom_count, ignore_nonfinite)

    def mask(self, pred, target, ctx, **kwargs):
        return super().mask(pred, target, ctx).all(-1, keepdim=True)

    def compute_residual(self, pred, target, valid):
        return torch.linalg.vector_norm(pred - target, dim=-1, keepdim=True)


# ------------------------------------------------------------------------------- stress


class StressMSELoss(BaseLossFunction):
    """Mean squared stress error: per-structure mean over components, then mean over structures."""

    requires_eval_grad = True

    def __init__(
        self,
        *,
        target_key: str = "stress",
        prediction_key: str = "predicted_stress",
        ignore_nonfinite: bool = False,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__(dtype_policy=dtype_policy)
        self.target_key, self.prediction_key = target_key, prediction_key
        self.ignore_nonfinite = bool(ignore_nonfinite)

    def compute_residual(self, pred, target, valid):
        return (pred - target) ** 2

    def reduce(self, residual, valid, ctx, **kwargs):
        per_graph = residual.reshape(residual.shape[0], -1).sum(1)
        count = valid.reshape(valid.shape[0], -1).sum(1).to(residual.dtype)
        return _graph_balanced(self, per_graph, count, loss_weight=graph_loss_weight(self, kwargs))


class StressHuberLoss(StressMSELoss):
    """Componentwise Huber stress loss, reduced like :class:`StressMSELoss`."""

    def __init__(
        self,
        *,
        target_key: str = "stress",
        prediction_key: str = "predicted_stress",
        delta: float = 0.01,
        ignore_nonfinite: bool = True,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__(
            target_key=target_key,
            prediction_key=prediction_key,
            ignore_nonfinite=ignore_nonfinite,
            dtype_policy=dtype_policy,
        )
        self.delta = _check_delta(delta)

    def compute_residual(self, pred, target, valid):
        return _huber(pred, target, self.delta)
