"""The built-in leaf losses for energies, forces and stresses.

Shapes follow the batch layout: energies ``(B, 1)`` (or ``(B,)``), forces ``(N, 3)`` over the
concatenated atoms of the batch or padded ``(B, N_max, 3)``, stresses ``(B, 3, 3)``. Per-graph
reductions take ``batch_idx``/``num_graphs``/``num_nodes_per_graph`` keyword metadata
(``compute_supervised_loss`` passes them from the batch; a ``batch=`` keyword is used as a
fallback source). Padded forces need ``num_nodes_per_graph``: atom counts ``(B,)`` or a node
mask ``(B, N_max)``; every force loss gives the same value in both layouts.

Which entries count (missing labels, ``ignore_nonfinite``) and how weights (a structure's
``loss_weight`` and ``<label>_weight``, force ``element_weights``) enter every mean (each a
weighted mean divided by the sum of the weights): see :mod:`nvalchemi.training.losses.base`.

>>> import torch
>>> loss = EnergyMSELoss()
>>> float(loss(torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [2.0]])))
1.0
>>> missing = torch.tensor([False, True])  # structure 1 has no energy label
>>> float(loss(torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [float("nan")]]),
...            missing_labels=missing))
1.0
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from nvalchemi.training.losses.base import (
    BaseLossFunction,
    DTypePolicy,
    ReductionContext,
    metadata,
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


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not delta > 0:
        raise ValueError(f"Huber delta must be a positive number, got {delta!r}")
    return delta


def _mean_over_structures(
    loss: BaseLossFunction, sums: torch.Tensor, counts: torch.Tensor, ctx: ReductionContext
) -> torch.Tensor:
    """Mean over the labelled structures of each structure's mean over its counted entries.

    A structure without the label (``ctx["missing"]``) is left out; one whose entries are all
    masked counts as 0. With ``ctx["loss_weight"]`` the mean is weighted:
    ``sum_i w_i l_i / sum_i w_i`` over the labelled structures.
    """
    per_graph = sums / torch.where(counts > 0, counts, 1.0)
    missing = ctx.get("missing")
    loss.record_per_sample(per_graph, None if missing is None else ~missing)
    weight = ctx.get("loss_weight")
    if weight is None:
        if missing is None:
            return per_graph.sum() / max(per_graph.shape[0], 1)
        return per_graph.sum() / (~missing).sum().clamp_min(1)
    weight = weight.to(per_graph.dtype)
    if missing is not None:
        weight = torch.where(missing, 0.0, weight)
    total = weight.sum()
    return (per_graph * weight).sum() / torch.where(total > 0, total, 1.0)


def _atom_means(
    residual: torch.Tensor,
    batch_idx: torch.Tensor,
    atoms: torch.Tensor,
    components: int,
    atom_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-structure means over atoms and components of per-atom residuals.

    ``atoms``: each structure's atom count, at least 1 (with ``atom_weight``, the positive
    sum of its atoms' weights, which then weight the residuals).
    """
    values = residual.sum(-1)
    if atom_weight is not None:
        values = values * atom_weight
    sums = per_graph_sum(values, batch_idx, atoms.shape[0])
    return sums / (atoms * components).to(sums.dtype)


def _ratio(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``sums / counts`` where something counted, else 0."""
    return sums / torch.where(counts > 0, counts, 1.0)


# ------------------------------------------------------------------------------- energy


class _EnergyLoss(BaseLossFunction):
    requires_eval_grad = False
    label_level = "system"
    _atom_weighted: ClassVar[bool] = True

    def _store(self, target_key: str, prediction_key: str, per_atom: bool, ignore_nonfinite: bool):
        self.target_key, self.prediction_key = target_key, prediction_key
        self.per_atom, self.ignore_nonfinite = bool(per_atom), bool(ignore_nonfinite)

    def normalize(self, pred, target, **kwargs):
        pred, target, ctx = super().normalize(pred, target, **kwargs)
        if not self.per_atom:
            return pred, target, ctx
        counts = torch.as_tensor(metadata(self, kwargs, "num_nodes_per_graph"), device=pred.device)
        if counts.ndim not in (1, 2):
            raise ValueError(
                f"{type(self).__name__}: num_nodes_per_graph must be a 1-D count tensor or a 2-D "
                f"padded node mask; got shape {tuple(counts.shape)}."
            )
        if counts.shape[0] != pred.shape[0]:
            raise ValueError(
                f"{type(self).__name__}: num_nodes_per_graph leading dimension "
                f"({counts.shape[0]}) must match energy batch size ({pred.shape[0]}); "
                f"target_key={self.target_key!r} has shape {tuple(target.shape)}, one energy "
                "per structure, and num_nodes_per_graph holds one atom count per structure."
            )
        if counts.ndim == 2:  # (B, V_max) padded node mask
            counts = counts.sum(-1)
        counts = counts.to(pred.dtype).clamp_min(1).reshape(-1, *([1] * (pred.ndim - 1)))
        if self._atom_weighted:
            ctx["weights"] = counts
        return pred / counts, target / counts, ctx

    def compute_residual(self, pred, target, valid):
        return self._pointwise(pred, target, "none")

    def unmasked_loss(self, pred, target, ctx, kwargs):
        if self.per_atom or "loss_weight" in ctx:
            return None
        if pred.ndim == 1 or (pred.ndim == 2 and pred.shape[1] == 1):
            # record_per_sample, inlined (the hot path); detached: never keep the step's graph
            self.__dict__["_per_sample_source"] = functools.partial(
                self._pointwise, pred.detach(), target, "none"
            )
        return self._pointwise(pred, target, "mean")

    def reduce(self, residual, valid, ctx, **kwargs):
        if residual.ndim == 1 or (residual.ndim == 2 and residual.shape[1] == 1):
            missing = ctx.get("missing")
            self.record_per_sample(residual, None if missing is None else ~missing)
        return super().reduce(residual, valid, ctx, **kwargs)


class EnergyMSELoss(_EnergyLoss):
    """Mean squared energy error.

    ``per_atom=True`` compares energies per atom and weights each structure by its atom count:
    ``sum_i N_i (dE_i / N_i)**2 / sum_i N_i``. Each structure's weight (``loss_weight`` times
    ``energy_weight``) multiplies its ``N_i`` in both sums (see the module docstring).
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

    def _pointwise(self, pred, target, reduction):
        return F.mse_loss(pred, target, reduction=reduction)


class EnergyMAELoss(_EnergyLoss):
    """Mean absolute energy error; per atom and atom-count weighted by default.

    Each structure's weight (``loss_weight`` times ``energy_weight``) multiplies its
    ``N_i`` in both sums.
    """

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

    def _pointwise(self, pred, target, reduction):
        return F.l1_loss(pred, target, reduction=reduction)


class EnergyHuberLoss(_EnergyLoss):
    """Huber loss of (per-atom) energies; a plain mean over structures (MACE-style).

    With weights (``loss_weight`` times ``energy_weight``) a weighted mean over structures.
    """

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

    def _pointwise(self, pred, target, reduction):
        return F.huber_loss(pred, target, reduction=reduction, delta=self.delta)


# ------------------------------------------------------------------------------- forces


def _element_weight_table(
    name: str, weights: Mapping[str | int, float] | None
) -> dict[str, float] | None:
    """``{element symbol: weight}`` from symbols or atomic numbers, checked."""
    if weights is None:
        return None
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{name}: element_weights must map elements (symbols or atomic numbers) to "
            f"weights, e.g. {{'H': 0.5}}; got {type(weights).__name__}."
        )
    from ase.data import atomic_numbers, chemical_symbols  # light; only with element weights

    out: dict[str, float] = {}
    for key, value in weights.items():
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        if isinstance(key, int) and not isinstance(key, bool) and 0 < key < len(chemical_symbols):
            symbol = chemical_symbols[key]
        elif isinstance(key, str) and key in atomic_numbers and key != "X":
            symbol = key
        else:
            raise ValueError(
                f"{name}: element_weights has an unknown element {key!r}; use element symbols "
                "('Cu') or atomic numbers (29)."
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: element_weights[{key!r}] must be a number; got {value!r}.")
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"{name}: element_weights[{key!r}] must be finite and >= 0; got {value!r}."
            )
        out[symbol] = float(value)
    return out


class _ForceLoss(BaseLossFunction):
    requires_eval_grad = True
    label_level = "atom"

    def _store(
        self, target_key, prediction_key, normalize_by_atom_count, ignore_nonfinite, elements
    ):
        self.target_key, self.prediction_key = target_key, prediction_key
        self.normalize_by_atom_count = bool(normalize_by_atom_count)
        self.ignore_nonfinite = bool(ignore_nonfinite)
        self.element_weights = elements

    @property
    def element_weights(self) -> dict[str, float] | None:
        """``{element symbol: weight}`` of every atom's force error (unlisted elements: 1)."""
        return self.__dict__.get("_element_weights")

    @element_weights.setter
    def element_weights(self, value: Mapping[str | int, float] | None) -> None:
        state = self.__dict__
        state["_element_weights"] = _element_weight_table(type(self).__name__, value)
        state["_element_tables"] = {}
        # weighted atoms take the template path (normalize reads the atoms' elements)
        state["_direct"] = state["_element_weights"] is None and type(self)._direct

    def element_weight_of(self, atomic_numbers: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The element weight of every atom (flattened), in ``like``'s dtype and device."""
        from ase.data import atomic_numbers as numbers_of  # light; only with element weights

        key = (like.device, like.dtype)
        table = self.__dict__["_element_tables"].get(key)
        if table is None:
            table = torch.ones(119, dtype=like.dtype)
            for symbol, value in (self.element_weights or {}).items():
                table[numbers_of[symbol]] = value
            table = self.__dict__["_element_tables"].setdefault(key, table.to(like.device))
        return table[atomic_numbers.to(device=like.device, dtype=torch.long).reshape(-1)]

    def normalize(self, pred, target, **kwargs):
        pred, target, ctx = super().normalize(pred, target, **kwargs)
        if target.ndim == 3:
            ctx["padded"] = True
            ctx["node_mask"] = self._node_mask(target, kwargs)
        elif target.ndim != 2:
            raise ValueError(
                f"{type(self).__name__}: target_key={self.target_key!r} must have shape (N, 3) "
                f"(atoms of the batch) or (B, N_max, 3) (padded); got shape {tuple(target.shape)}."
            )
        if self.element_weights is not None:
            ctx["weights"] = self._element_rows(target, ctx, kwargs)
        return pred, target, ctx

    def _element_rows(self, target, ctx, kwargs) -> torch.Tensor:
        """Element weights in the layout of ``target``: ``(N, 1)`` or ``(B, N_max, 1)``."""
        weights = self.element_weight_of(metadata(self, kwargs, "atomic_numbers"), target)
        if not ctx.get("padded", False):
            if weights.shape[0] != target.shape[0]:
                raise ValueError(
                    f"{type(self).__name__}: atomic_numbers must hold one entry per atom of "
                    f"target_key={self.target_key!r} ({target.shape[0]}); got {weights.shape[0]}."
                )
            return weights[:, None]
        real = ctx["node_mask"][..., 0]
        if weights.shape[0] == real.numel():  # padded (B, N_max) atomic numbers
            return weights.reshape(*real.shape, 1)
        if weights.shape[0] != int(real.sum()):
            raise ValueError(
                f"{type(self).__name__}: atomic_numbers must be padded like "
                f"target_key={self.target_key!r} ({tuple(real.shape)}) or hold one entry per "
                f"real atom ({int(real.sum())}); got {weights.shape[0]} entries."
            )
        padded = torch.ones(real.shape, dtype=weights.dtype, device=weights.device)
        padded[real] = weights
        return padded[..., None]

    def _node_mask(self, target: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """``(B, N_max, 1)`` mask of the real atoms of a padded layout."""
        b, width = target.shape[0], target.shape[1]
        nodes = metadata(self, kwargs, "num_nodes_per_graph")
        nodes = torch.as_tensor(nodes, device=target.device)
        name = type(self).__name__
        expected = (
            f"padded target_key={self.target_key!r} of shape {tuple(target.shape)} needs "
            f"num_nodes_per_graph as atom counts of shape ({b},) or a node mask of shape "
            f"({b}, {width})"
        )
        if nodes.ndim == 2:
            if nodes.shape[0] != b:
                raise ValueError(
                    f"{name}: padded node mask batch dimension ({nodes.shape[0]}) must match "
                    f"force batch size ({b}); {expected}."
                )
            if nodes.shape[1] != width:
                raise ValueError(
                    f"{name}: padded node mask width ({nodes.shape[1]}) must match force max "
                    f"nodes ({width}) for padded force tensors; {expected}."
                )
            return nodes.to(torch.bool)[..., None]
        if nodes.ndim != 1 or nodes.is_floating_point():
            raise ValueError(
                f"{name}: num_nodes_per_graph must be a 1-D count tensor or a 2-D padded node "
                f"mask; {expected}, got shape {tuple(nodes.shape)} ({nodes.dtype})."
            )
        if nodes.shape[0] != b:
            raise ValueError(
                f"{name}: num_nodes_per_graph length ({nodes.shape[0]}) must match force batch "
                f"size ({b}); {expected}."
            )
        return (torch.arange(width, device=target.device) < nodes[:, None])[..., None]

    def mask(self, pred, target, ctx, **kwargs):
        valid = super().mask(pred, target, ctx, **kwargs)
        node_mask = ctx.get("node_mask")
        if node_mask is not None:
            node_mask = node_mask.expand(target.shape)
            valid = node_mask if valid is None else valid & node_mask
        return valid

    def _pointwise(
        self, pred: torch.Tensor, target: torch.Tensor, reduction: str
    ) -> torch.Tensor | None:
        return None

    def unmasked_loss(self, pred, target, ctx, kwargs):
        if target.ndim != 2:
            return None  # the padded layout always masks its padding
        if self.normalize_by_atom_count:
            residual = self.compute_residual(pred, target, None)
            batch_idx, num_graphs = self._graph_metadata(kwargs)
            return self._balanced_mean(residual, batch_idx, num_graphs, ctx, kwargs)
        if "loss_weight" in ctx or "weights" in ctx:
            return None
        return self._pointwise(pred, target, "mean")

    def reduce(self, residual, valid, ctx, **kwargs):
        atom_weight = ctx.get("weights")
        if ctx.get("padded", False):
            weighted, counted = residual, valid.to(residual.dtype)
            if atom_weight is not None:
                weighted, counted = residual * atom_weight, counted * atom_weight
            sums, counts = weighted.sum((1, 2)), counted.sum((1, 2))
            if self.normalize_by_atom_count:
                return _mean_over_structures(self, sums, counts, ctx)
            missing = ctx.get("missing")
            self.record_per_sample(
                functools.partial(_ratio, sums.detach(), counts),
                None if missing is None else ~missing,
            )
            return super().reduce(residual, valid, ctx, **kwargs)
        if not self.normalize_by_atom_count:
            return super().reduce(residual, valid, ctx, **kwargs)
        batch_idx, num_graphs = self._graph_metadata(kwargs)
        if valid is not None:
            counted = valid.to(residual.dtype)
            if atom_weight is not None:
                residual, counted = residual * atom_weight, counted * atom_weight
            sums = per_graph_sum(residual.sum(-1), batch_idx, num_graphs)
            counts = per_graph_sum(counted.sum(-1), batch_idx, num_graphs)
            return _mean_over_structures(self, sums, counts, ctx)
        return self._balanced_mean(residual, batch_idx, num_graphs, ctx, kwargs)

    def _graph_metadata(self, kwargs: dict[str, Any]) -> tuple[torch.Tensor, int]:
        """``batch_idx`` and ``num_graphs`` of flat forces: keywords first, then ``batch=``."""
        return metadata(self, kwargs, "batch_idx"), int(metadata(self, kwargs, "num_graphs"))

    def _balanced_mean(self, residual, batch_idx, num_graphs, ctx, kwargs) -> torch.Tensor:
        """Mean over structures of each one's mean over its components, nothing masked.

        The per-atom residuals times per-atom scales ``1 / (components * B * atoms of the
        structure)`` (with weights: ``w_i a_j / (components * sum_i w_i * sum_{j in i} a_j)``
        for structure weights ``w`` and element weights ``a``), summed: the value of the
        per-structure means with no per-structure tensors in the autograd graph (the scales
        need no gradient).
        """
        if batch_idx.shape != (residual.shape[0],):
            raise ValueError(
                f"{type(self).__name__}: batch_idx must have shape ({residual.shape[0]},), one "
                f"entry per atom of target_key={self.target_key!r}; got shape "
                f"{tuple(batch_idx.shape)}."
            )
        batch_idx = batch_idx.to(residual.device)
        components = residual.shape[-1]
        atom_weight = ctx.get("weights")
        if atom_weight is not None:  # sum of the element weights of each structure's atoms
            atom_weight = atom_weight.reshape(-1).to(residual.dtype)
            per_structure = per_graph_sum(atom_weight, batch_idx, num_graphs)
            per_structure = torch.where(per_structure > 0, per_structure, 1.0)
        else:
            # Only an explicit keyword (the batch's own counts, passed by
            # compute_supervised_loss): flat forces never read batch.num_nodes_per_graph, so
            # explicit batch_idx/num_graphs always win over a batch= keyword.
            atoms = kwargs.get("num_nodes_per_graph")
            if atoms is None:
                atoms = torch.bincount(batch_idx, minlength=num_graphs)
            elif atoms.ndim != 1 or atoms.shape[0] != num_graphs:
                raise ValueError(
                    f"{type(self).__name__}: num_nodes_per_graph length ({atoms.shape[0]}) "
                    f"must match force batch size ({num_graphs}); it holds one atom count per "
                    f"structure, shape ({num_graphs},), got shape {tuple(atoms.shape)}."
                )
            per_structure = atoms.clamp_min(1)
        self.record_per_sample(
            functools.partial(
                _atom_means, residual.detach(), batch_idx, per_structure, components, atom_weight
            ),
            None,
        )
        weight = ctx.get("loss_weight")
        if weight is None:
            # 1 / (components * B * atoms of the structure), for every atom
            scale = torch.reciprocal(per_structure * (components * max(num_graphs, 1)))
        else:
            total = weight.sum()
            scale = weight / (per_structure * components * torch.where(total > 0, total, 1.0))
        scale = scale.to(residual.dtype).index_select(0, batch_idx)
        if atom_weight is not None:
            scale = scale * atom_weight
        return (residual * scale.unsqueeze(1)).sum()


class ForceMSELoss(_ForceLoss):
    """Mean squared force error over components, for ``(N, 3)`` or padded ``(B, N_max, 3)``.

    ``normalize_by_atom_count=True`` (default) averages within each structure first, then over
    structures, so large structures do not dominate (needs ``batch_idx`` and ``num_graphs``
    for ``(N, 3)``). Weights: each structure's weight (``loss_weight`` times
    ``forces_weight``) weights its atoms, ``element_weights`` (``{"H": 0.5}``; unlisted
    elements 1, needs ``atomic_numbers``) each atom; every mean divides by the sum of the
    weights (see :mod:`nvalchemi.training.losses.base`).

    >>> import torch
    >>> forces = torch.tensor([[1.0, 0, 0], [0, 0, 0], [3.0, 0, 0]])  # H, H, O
    >>> loss = ForceMSELoss(element_weights={"O": 2.0})
    >>> float(loss(torch.zeros(3, 3), forces, batch_idx=torch.tensor([0, 0, 0]), num_graphs=1,
    ...            atomic_numbers=torch.tensor([1, 1, 8])))  # (1 + 0 + 2 * 9) / (3 * (1 + 1 + 2))
    1.583...
    """

    def __init__(
        self,
        *,
        target_key: str = "forces",
        prediction_key: str = "predicted_forces",
        normalize_by_atom_count: bool = True,
        ignore_nonfinite: bool = False,
        element_weights: Mapping[str | int, float] | None = None,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__(dtype_policy=dtype_policy)
        self._store(
            target_key, prediction_key, normalize_by_atom_count, ignore_nonfinite, element_weights
        )

    def _pointwise(self, pred, target, reduction):
        return F.mse_loss(pred, target, reduction=reduction)

    def compute_residual(self, pred, target, valid):
        return self._pointwise(pred, target, "none")


class ForceHuberLoss(ForceMSELoss):
    """Componentwise Huber force loss; a global mean over components by default.

    Weighted like :class:`ForceMSELoss` (structure weights, ``element_weights``).
    """

    def __init__(
        self,
        *,
        target_key: str = "forces",
        prediction_key: str = "predicted_forces",
        normalize_by_atom_count: bool = False,
        delta: float = 0.01,
        ignore_nonfinite: bool = True,
        element_weights: Mapping[str | int, float] | None = None,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__(
            target_key=target_key,
            prediction_key=prediction_key,
            normalize_by_atom_count=normalize_by_atom_count,
            ignore_nonfinite=ignore_nonfinite,
            element_weights=element_weights,
            dtype_policy=dtype_policy,
        )
        self.delta = _check_delta(delta)

    def _pointwise(self, pred, target, reduction):
        return F.huber_loss(pred, target, reduction=reduction, delta=self.delta)


class ForceL2NormLoss(_ForceLoss):
    """Mean Euclidean norm of the per-atom force error (an atom counts if all 3 components do).

    Weighted like :class:`ForceMSELoss` (structure weights, ``element_weights``).
    """

    def __init__(
        self,
        *,
        target_key: str = "forces",
        prediction_key: str = "predicted_forces",
        normalize_by_atom_count: bool = True,
        ignore_nonfinite: bool = True,
        element_weights: Mapping[str | int, float] | None = None,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__(dtype_policy=dtype_policy)
        self._store(
            target_key, prediction_key, normalize_by_atom_count, ignore_nonfinite, element_weights
        )

    def mask(self, pred, target, ctx, **kwargs):
        valid = super().mask(pred, target, ctx, **kwargs)
        return None if valid is None else valid.all(-1, keepdim=True)

    def compute_residual(self, pred, target, valid):
        return torch.linalg.vector_norm(pred - target, dim=-1, keepdim=True)


# ------------------------------------------------------------------------------- stress


class StressMSELoss(BaseLossFunction):
    """Mean squared stress error: per-structure mean over components, then mean over structures.

    With weights (``loss_weight`` times ``stress_weight``) a weighted mean over structures.
    """

    requires_eval_grad = True
    label_level = "system"

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

    def _pointwise(self, pred: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
        return F.mse_loss(pred, target, reduction=reduction)

    def compute_residual(self, pred, target, valid):
        return self._pointwise(pred, target, "none")

    def unmasked_loss(self, pred, target, ctx, kwargs):
        # Every structure has the same number of components: the mean of the per-structure
        # means is the mean over all components.
        if "loss_weight" in ctx:
            return None
        self.record_per_sample(functools.partial(self._row_means, pred.detach(), target), None)
        return self._pointwise(pred, target, "mean")

    def _row_means(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._pointwise(pred, target, "none").reshape(pred.shape[0], -1).mean(1)

    def reduce(self, residual, valid, ctx, **kwargs):
        rows = residual.reshape(residual.shape[0], -1)
        if valid is None:
            self.record_per_sample(functools.partial(torch.mean, rows.detach(), 1), None)
            return super().reduce(residual, None, ctx, **kwargs)
        counts = valid.reshape(valid.shape[0], -1).sum(1).to(residual.dtype)
        return _mean_over_structures(self, rows.sum(1), counts, ctx)


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

    def _pointwise(self, pred, target, reduction):
        return F.huber_loss(pred, target, reduction=reduction, delta=self.delta)
