"""Loss functions: the leaf contract and weighted sums of leaves.

A **leaf** (:class:`BaseLossFunction`) maps ``(prediction, target, **metadata)`` to a
scalar. A **composition** (:class:`ComposedLossFunction`) is a flat list of leaves with a
weight each (a float or a :class:`~nvalchemi.training.losses.LossWeightSchedule`); ``+``
and ``*`` on leaves and compositions build one, so the two classes are one algebra and
live in one module:

>>> from nvalchemi.training.losses import EnergyMSELoss, ForceMSELoss, LinearWeight
>>> loss_fn = 1.0 * EnergyMSELoss() + LinearWeight(start=0.0, end=10.0, num_steps=100) * ForceMSELoss()
>>> loss_fn.weight_factors(step=50)
{'EnergyMSELoss': 0.1666..., 'ForceMSELoss': 0.8333...}

By default (``normalize_weights=True``) the resolved weights are divided by their sum at
every call, so only their ratios matter.

A leaf's ``forward`` runs ``align_dtypes -> validate -> normalize -> mask ->
compute_residual -> reduce``; subclasses implement ``compute_residual`` and override the
other steps when they need to.

Which entries count:

* **Missing labels** are known at collation: ``Batch.missing_labels`` maps a label to the
  ``(B,)`` mask of the structures that lack it (``compute_supervised_loss`` passes it as the
  ``missing_labels=`` keyword; a leaf called by hand takes a mapping or its own ``(B,)``
  mask). A structure without the label contributes nothing and is not counted: its
  ``per_sample_loss`` entry is NaN and its ``per_sample_valid`` entry ``False``.
* **Non-finite targets** propagate (a NaN target gives a NaN loss, so the non-finite loss
  check sees it) unless ``ignore_nonfinite=True``, which masks them: masked entries are left
  out of the mean, a structure whose entries are all masked counts as 0 in a mean over
  structures, and its ``per_sample_loss`` entry is 0.

When nothing is missing, masked or weighted (the common case) no masking work is done at
all: ``forward`` goes straight to :meth:`BaseLossFunction.unmasked_loss` (for the built-in
leaves one fused ``F.mse_loss``-style call where the loss is a plain mean, the autograd
graph of a hand-written loss), and per-sample values are computed only when read.

Weights (see ``docs/weights.md``). A structure's weight in a leaf is the product of

* its ``loss_weight`` (one float per structure, shape ``(B,)`` or ``(B, 1)``; all terms),
* the weight of the leaf's label, the batch field ``<target_key>_weight`` (``energy_weight``,
  ``forces_weight``, ``stress_weight``; ``compute_supervised_loss`` passes them as the
  ``label_weights=`` mapping),

and force leaves weight each atom by its element (``element_weights``). Every mean is a
weighted mean that divides by the sum of the weights of what it counts: a mean over
structures is ``sum_i w_i l_i / sum_i w_i``, a mean over atoms or components weights each
entry by its structure's (and its element's) weight in the numerator and the denominator.
So only ratios matter: a weight of 2 on every structure changes nothing, a weight of 2 on
one structure doubles its share against the others, and 0 removes it (a batch whose
weights are all 0 has loss 0). Structures without the label and masked entries stay out
as before. ``per_sample_loss`` stays unweighted by structure weights. Without weights
nothing extra is computed.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal, TypedDict, get_args

import torch
from torch import nn

from nvalchemi._serialization import init_kwargs_from_attrs
from nvalchemi.training.losses.schedules import (
    LossWeightSchedule,
    Weight,
    check_weight,
    is_weight,
    resolve_weight,
    scale_weight,
)
from nvalchemi.training.spec import BaseSpec, create_model_spec

__all__ = [
    "BaseLossFunction",
    "ComposedLossFunction",
    "ComposedLossOutput",
    "DTypePolicy",
    "ReductionContext",
    "assert_same_shape",
    "loss_component_to_spec",
]

DTypePolicy = Literal["strict", "prediction_to_target", "target_to_prediction"]
"""How a loss treats a prediction/target dtype mismatch: raise, or cast one side."""

_POLICIES: tuple[str, ...] = get_args(DTypePolicy)
# Modules whose mask/compute_residual/reduce accept ``valid=None`` ("every entry counts").
_OWN_MODULES = frozenset({__name__, "nvalchemi.training.losses.terms"})


def check_dtype_policy(value: Any, *, allow_none: bool = True) -> str | None:
    """Validate a :data:`DTypePolicy` value (``None`` means "not set")."""
    if (value is None and allow_none) or value in _POLICIES:
        return value
    raise ValueError(
        "dtype_policy must be one of 'strict', 'prediction_to_target', or "
        f"'target_to_prediction'; got {value!r}"
    )


def cast_for_policy(
    pred: torch.Tensor, target: torch.Tensor, policy: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a dtype policy: cast predictions to the labels' dtype or the other way round."""
    if pred.dtype == target.dtype or policy in (None, "strict"):
        return pred, target
    if policy == "prediction_to_target":
        return pred.to(target.dtype), target
    return pred, target.to(pred.dtype)


def metadata(loss: Any, kwargs: Mapping[str, Any], name: str, required: bool = True) -> Any:
    """Keyword metadata ``name`` of a loss call, else the ``batch=`` keyword's attribute."""
    value = kwargs.get(name)
    if value is None and kwargs.get("batch") is not None:
        value = getattr(kwargs["batch"], name, None)
    if value is None and required:
        raise ValueError(
            f"{type(loss).__name__} requires {name}=... metadata; pass it as a keyword argument "
            f"(compute_supervised_loss passes batch.{name}) or pass batch=<Batch>."
        )
    return value


def weight_field(label: str) -> str:
    """The batch field holding the per-structure weight of ``label``: ``"<label>_weight"``.

    >>> weight_field("forces"), weight_field("energy")
    ('forces_weight', 'energy_weight')
    """
    return _WEIGHT_FIELDS.get(label) or _WEIGHT_FIELDS.setdefault(label, f"{label}_weight")


_WEIGHT_FIELDS: dict[str, str] = {}


def _structure_weights(loss: Any, name: str, weight: Any) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(
            f"{type(loss).__name__}: {name} must be a floating tensor of shape "
            f"(num_graphs,) or (num_graphs, 1); got {got}. Store one float per structure."
        )
    if weight.ndim == 2 and weight.shape[1] == 1:
        weight = weight.reshape(-1)
    if weight.ndim != 1:
        raise ValueError(
            f"{type(loss).__name__}: {name} must have shape (num_graphs,) or "
            f"(num_graphs, 1); got shape {tuple(weight.shape)}."
        )
    return weight


def graph_loss_weight(loss: Any, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The weight of every structure in this loss, a flat ``(B,)`` tensor, or ``None``.

    The product of the structure's ``loss_weight`` (all its terms) and the weight of this
    loss's label (``label_weights[target_key]``, the batch field ``<target_key>_weight``,
    e.g. ``forces_weight``); ``None`` when neither is given. Read from the ``loss_weight=``
    and ``label_weights=`` keywords, else from a ``batch=`` keyword's fields.
    """
    weight = kwargs.get("loss_weight")
    label = getattr(loss, "target_key", None)
    labels = kwargs.get("label_weights")
    own = labels.get(label) if isinstance(labels, Mapping) and label is not None else None
    batch = kwargs.get("batch")
    if batch is not None and hasattr(batch, "get"):
        if weight is None:
            weight = batch.get("loss_weight")
        if own is None and labels is None and label is not None:
            own = batch.get(weight_field(label))
    if weight is not None:
        weight = _structure_weights(loss, "loss_weight", weight)
    if own is not None:
        own = _structure_weights(loss, weight_field(str(label)), own)
        weight = own if weight is None else weight * own.to(weight.dtype)
    return weight


def missing_structures(loss: Any, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """``(B,)`` bool mask of the structures that lack this loss's target, or ``None``.

    From the ``missing_labels=`` keyword (a mapping of label name to mask, as
    ``Batch.missing_labels``, or the leaf's own mask), else from a ``batch=`` keyword.
    """
    missing = metadata(loss, kwargs, "missing_labels", required=False)
    if missing is None or isinstance(missing, torch.Tensor):
        mask = missing
    elif isinstance(missing, Mapping):
        mask = missing.get(getattr(loss, "target_key", None))
    else:
        raise TypeError(
            f"{type(loss).__name__}: missing_labels must be a mapping of label name to a (B,) "
            f"bool tensor (Batch.missing_labels) or one (B,) bool tensor; got "
            f"{type(missing).__name__}."
        )
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.ndim != 1:
        raise ValueError(
            f"{type(loss).__name__}: the missing-label mask of target_key="
            f"{getattr(loss, 'target_key', None)!r} must be a (B,) bool tensor; got dtype "
            f"{mask.dtype} and shape {tuple(mask.shape)}."
        )
    return mask


def masked_or_weighted(loss: Any, kwargs: Mapping[str, Any]) -> bool:
    """Whether a call may mask or weight entries: a missing-label mask or a label weight for
    this loss's target, a ``loss_weight``, or a ``batch=`` keyword that could carry them."""
    if kwargs.get("loss_weight") is not None or kwargs.get("batch") is not None:
        return True
    labels = kwargs.get("label_weights")
    if labels and getattr(loss, "target_key", None) in labels:
        return True
    missing = kwargs.get("missing_labels")
    if isinstance(missing, Mapping):
        return getattr(loss, "target_key", None) in missing
    return missing is not None


def per_sample_values(source: Any, valid: torch.Tensor | None) -> torch.Tensor:
    """Materialise recorded per-structure values: NaN where ``valid`` is ``False``."""
    with torch.no_grad():
        values = (source if isinstance(source, torch.Tensor) else source()).detach().reshape(-1)
        return values if valid is None else torch.where(valid, values, torch.nan)


class ReductionContext(dict):
    """Per-call data shared between ``normalize``, ``mask`` and ``reduce``.

    Conventional keys: ``"weights"``, per-sample weights (e.g. ``(B, 1)`` atom counts) that
    weight both the numerator and the denominator of the default mean; ``"loss_weight"``,
    the weight of every structure in this loss ``(B,)`` (numerator and denominator, like
    ``"weights"``); ``"missing"``, the
    ``(B,)`` mask of structures without the target; ``"padded"``, whether atom-level
    values come in the padded ``(B, N_max, ...)`` layout.
    """


def assert_same_shape(
    pred: torch.Tensor,
    target: torch.Tensor,
    *,
    name: str,
    prediction_key: str | None = None,
    target_key: str | None = None,
    strict: bool = False,
) -> None:
    """Raise ``ValueError`` unless ``pred`` and ``target`` have one dtype and matching shapes.

    ``strict=True`` requires identical shapes; otherwise broadcastable shapes are accepted.
    """
    if pred.dtype == target.dtype and (
        pred.shape == target.shape or (not strict and _broadcastable(pred, target))
    ):
        return
    pk = f"prediction_key={prediction_key!r}" if prediction_key else "prediction"
    tk = f"target_key={target_key!r}" if target_key else "target"
    if pred.dtype != target.dtype:
        raise ValueError(
            f"{name}: prediction and target dtype mismatch; {pk} has dtype {pred.dtype}, {tk} has "
            f"dtype {target.dtype} (expected the prediction in {target.dtype}). Cast one of them, "
            "or set dtype_policy='prediction_to_target' (cast predictions to the label dtype) or "
            "dtype_policy='target_to_prediction' (cast labels to the prediction dtype) on the "
            "loss or its composition."
        )
    shapes = f"{pk} has shape {tuple(pred.shape)}, {tk} has shape {tuple(target.shape)}"
    if strict:
        raise ValueError(
            f"{name}: prediction and target shape must match exactly for elementwise loss; "
            f"{shapes} (expected the prediction in the target's shape {tuple(target.shape)})."
        )
    raise ValueError(f"{name}: prediction and target shape mismatch; {shapes}.")


def _broadcastable(pred: torch.Tensor, target: torch.Tensor) -> bool:
    try:
        torch.broadcast_shapes(pred.shape, target.shape)
    except RuntimeError:
        return False
    return True


def _defined_here(cls: type, method: str) -> bool:
    return getattr(cls, method).__module__ in _OWN_MODULES


_PLAIN = ReductionContext()  # the context of an unmasked, unweighted call (never written)


class BaseLossFunction(nn.Module, abc.ABC):
    """Stateless leaf loss. Subclasses implement :meth:`compute_residual`.

    Leaves carry no weight; combine them with ``+`` and ``*`` (weights, schedules) into a
    :class:`~nvalchemi.training.losses.ComposedLossFunction`.

    Args:
        dtype_policy: ``"strict"`` raises on a dtype mismatch, ``"prediction_to_target"`` /
            ``"target_to_prediction"`` cast. ``None`` (default) behaves as ``"strict"`` but lets
            a composition's policy apply; an explicit value overrides the composition's.

    Keyword metadata (passed by ``compute_supervised_loss`` from the batch): ``batch_idx``,
    ``num_graphs``, ``num_nodes_per_graph``, and when the batch has them ``missing_labels``
    (the structures without each label), ``loss_weight`` (one float per structure) and
    ``label_weights`` (``{label: (B,) weights}``); see the module docstring. A ``batch=`` keyword is a fallback source for all of them.

    The ``valid`` mask handed to :meth:`compute_residual` and :meth:`reduce` is ``None`` when
    every entry counts. A subclass that overrides ``mask``, ``compute_residual`` or ``reduce``
    outside this package always receives a boolean tensor instead (the reference contract),
    and one that overrides any template step always runs all of them.

    Attributes:
        requires_eval_grad: whether evaluating the loss needs autograd (force/stress losses
            need gradients of the energy). Every built-in leaf declares it.
        label_level: ``"system"`` (one row per structure) or ``"atom"`` (one row per atom);
            ``None`` infers it from the target's leading dimension.
        per_sample_loss: detached per-structure values of the last call, or ``None``; NaN
            for a structure without the label. Built-in leaves compute it on first read.
        per_sample_valid: boolean ``(B,)`` mask of the structures that had the label in the
            last call (``None`` with ``per_sample_loss``). A NaN in ``per_sample_loss`` where
            this is ``True`` is a real non-finite value (e.g. a diverged prediction).
    """

    requires_eval_grad: ClassVar[bool | None] = None
    label_level: ClassVar[Literal["system", "atom"] | None] = None
    _valid_tensor: ClassVar[bool] = True  # mask/compute_residual/reduce need a tensor mask
    _direct: ClassVar[bool] = False  # the unmasked case may skip the template steps

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._valid_tensor = not all(
            _defined_here(cls, m) for m in ("mask", "compute_residual", "reduce")
        )
        cls._direct = not cls._valid_tensor and all(
            _defined_here(cls, m) for m in ("forward", "align_dtypes", "validate", "normalize")
        )

    def __init__(self, *, dtype_policy: DTypePolicy | None = None) -> None:
        super().__init__()
        self._dtype_policy = check_dtype_policy(dtype_policy)
        state = self.__dict__
        state["_per_sample"] = state["_per_sample_source"] = state["_per_sample_valid"] = None

    @property
    def dtype_policy(self) -> str:
        """The effective policy of this leaf on its own (``"strict"`` when unset)."""
        return self._dtype_policy or "strict"

    @dtype_policy.setter
    def dtype_policy(self, value: DTypePolicy | None) -> None:
        self._dtype_policy = check_dtype_policy(value)

    @property
    def per_sample_loss(self) -> torch.Tensor | None:
        state = self.__dict__
        value = state.get("_per_sample")
        if value is None and state.get("_per_sample_source") is not None:
            value = per_sample_values(state["_per_sample_source"], state["_per_sample_valid"])
            state["_per_sample"], state["_per_sample_source"] = value, None
        return value

    @per_sample_loss.setter
    def per_sample_loss(self, value: torch.Tensor | None) -> None:
        self.__dict__["_per_sample"] = value
        self.__dict__["_per_sample_source"] = None

    @property
    def per_sample_valid(self) -> torch.Tensor | None:
        valid = self.__dict__.get("_per_sample_valid")
        if valid is None:
            values = self.per_sample_loss
            if isinstance(values, torch.Tensor):
                valid = torch.ones(values.shape, dtype=torch.bool, device=values.device)
                self.__dict__["_per_sample_valid"] = valid
        return valid

    @per_sample_valid.setter
    def per_sample_valid(self, value: torch.Tensor | None) -> None:
        self.__dict__["_per_sample_valid"] = value

    def __getstate__(self) -> dict[str, Any]:
        self.per_sample_loss  # noqa: B018 - run a pending computation (it may hold methods)
        return super().__getstate__()

    # -- template ------------------------------------------------------------------------

    def forward(self, pred: torch.Tensor, target: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Scalar loss of ``pred`` against ``target``; ``kwargs`` carry batch metadata."""
        state = self.__dict__
        state["_per_sample"] = state["_per_sample_source"] = state["_per_sample_valid"] = None
        if (
            self._direct
            and pred.dtype == target.dtype
            and pred.shape == target.shape
            and not state.get("ignore_nonfinite", False)
            and not masked_or_weighted(self, kwargs)
        ):
            # The common case (nothing missing, masked or weighted): straight to the loss
            # (one fused call where it is a plain mean), no normalize/mask work in between.
            loss = self.unmasked_loss(pred, target, _PLAIN, kwargs)
            if loss is not None:
                return loss
        pred, target = self.align_dtypes(pred, target)
        self.validate(pred, target)
        pred, target, ctx = self.normalize(pred, target, **kwargs)
        valid = self.mask(pred, target, ctx, **kwargs)
        if valid is None:
            if not self._valid_tensor:
                loss = self.unmasked_loss(pred, target, ctx, kwargs)
                if loss is not None:
                    return loss
                return self.reduce(self.compute_residual(pred, target, None), None, ctx, **kwargs)
            valid = torch.ones(target.shape, dtype=torch.bool, device=target.device)
        # Zero masked labels before the residual: a NaN there would turn the (zero) upstream
        # gradient of the masked residual into NaN.
        target = torch.where(valid, target, 0.0)
        residual = torch.where(valid, self.compute_residual(pred, target, valid), 0.0)
        return self.reduce(residual, valid, ctx, **kwargs)

    def align_dtypes(
        self, pred: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply this leaf's dtype policy."""
        return cast_for_policy(pred, target, self._dtype_policy)

    def validate(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        """Require one dtype and identical shapes."""
        if pred.dtype != target.dtype or pred.shape != target.shape:
            assert_same_shape(
                pred,
                target,
                name=type(self).__name__,
                prediction_key=getattr(self, "prediction_key", None),
                target_key=getattr(self, "target_key", None),
                strict=True,
            )

    def normalize(
        self, pred: torch.Tensor, target: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor, ReductionContext]:
        """Rescale inputs before the residual (e.g. per-atom energies); identity by default.

        Also records the weight of every structure in this loss (``ctx["loss_weight"]``,
        see :func:`graph_loss_weight`).
        """
        ctx = ReductionContext()
        weight = graph_loss_weight(self, kwargs)
        if weight is not None:
            ctx["loss_weight"] = weight
        return pred, target, ctx

    def mask(
        self, pred: torch.Tensor, target: torch.Tensor, ctx: ReductionContext, **kwargs: Any
    ) -> torch.Tensor | None:
        """Entries that count, or ``None`` when all do.

        Structures without the label (the batch's missing-label mask) are out; with
        ``ignore_nonfinite`` so are non-finite targets. Sets ``ctx["missing"]``.
        """
        missing = missing_structures(self, kwargs)
        present = None
        if missing is not None:
            ctx["missing"] = missing
            present = self.graph_rows(~missing, target, ctx, kwargs).expand(target.shape)
        if getattr(self, "ignore_nonfinite", False):
            finite = torch.isfinite(target)
            return finite if present is None else finite & present
        return present

    def unmasked_loss(
        self,
        pred: torch.Tensor,
        target: torch.Tensor,
        ctx: ReductionContext,
        kwargs: Mapping[str, Any],
    ) -> torch.Tensor | None:
        """The loss when every entry counts, computed directly, or ``None``.

        Built-in leaves return e.g. ``F.mse_loss(pred, target)`` where the loss is a plain
        mean (the autograd graph of a hand-written loss) and record their per-sample
        values lazily; ``None`` (the default) falls back to ``compute_residual`` and
        ``reduce``. ``ctx`` may carry ``"loss_weight"``.
        """
        return None

    @abc.abstractmethod
    def compute_residual(
        self, pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor | None
    ) -> torch.Tensor:
        """Elementwise residual (masked entries are zeroed afterwards)."""

    def reduce(
        self,
        residual: torch.Tensor,
        valid: torch.Tensor | None,
        ctx: ReductionContext,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Mean of ``residual`` over valid entries, weighted by ``ctx["weights"]`` if present.

        ``ctx["loss_weight"]`` (per-structure weights) weights each structure's entries in
        the numerator and the denominator alike: ``sum(w * r) / sum(w)``.
        """
        counts = ctx.get("weights")
        loss_weight = ctx.get("loss_weight")
        if valid is None and counts is None and loss_weight is None:
            return residual.mean() if residual.numel() else residual.sum()
        weight = None if valid is None else valid.to(residual.dtype)
        if counts is not None:
            counts = counts.expand_as(residual)
            weight = counts if weight is None else weight * counts
        if loss_weight is not None:
            rows = self.graph_rows(loss_weight.to(residual.dtype), residual, ctx, kwargs)
            weight = rows if weight is None else weight * rows
        if weight is None:
            return residual.sum() / max(residual.numel(), 1)
        weight = weight.expand_as(residual)
        total = weight.sum()
        return (residual * weight).sum() / torch.where(total > 0, total, 1.0)

    # -- helpers for subclasses ----------------------------------------------------------

    def graph_rows(
        self, values: torch.Tensor, like: torch.Tensor, ctx: ReductionContext, kwargs: Any
    ) -> torch.Tensor:
        """Per-structure ``values`` ``(B,)`` broadcastable against ``like``'s rows.

        Structure-level targets (and the padded atom layout, ``ctx["padded"]``) have a row per
        structure; flat atom-level targets are mapped through ``batch_idx``.
        """
        level = self.label_level
        if level is None:
            level = "system" if like.shape[0] == values.shape[0] else "atom"
        if level == "atom" and not ctx.get("padded", False):
            batch_idx = metadata(self, kwargs, "batch_idx")
            if batch_idx.shape != (like.shape[0],):
                raise ValueError(
                    f"{type(self).__name__}: batch_idx must have shape ({like.shape[0]},), one "
                    f"entry per row of target_key={getattr(self, 'target_key', None)!r}; got "
                    f"shape {tuple(batch_idx.shape)}."
                )
            values = values.index_select(0, batch_idx.to(values.device))
        elif values.shape[0] != like.shape[0]:
            raise ValueError(
                f"{type(self).__name__}: expected one value per structure of target_key="
                f"{getattr(self, 'target_key', None)!r} (shape ({like.shape[0]},)); got shape "
                f"{tuple(values.shape)}."
            )
        return values.to(like.device).reshape(-1, *([1] * (like.ndim - 1)))

    def record_per_sample(
        self, values: torch.Tensor | Callable[[], torch.Tensor], valid: torch.Tensor | None
    ) -> None:
        """Store per-structure ``values`` (``(B,)``) with NaN where ``valid`` is ``False``.

        ``values`` may be a function computing them from detached tensors (holding the
        step's autograd graph until the next call would cost memory and time): it runs when
        ``per_sample_loss`` is first read, so a training step that reads no per-sample
        values pays nothing. Sync-free (no host reads), so it is safe on the hot path.
        """
        state = self.__dict__
        state["_per_sample"] = None
        state["_per_sample_source"] = (
            values.detach() if isinstance(values, torch.Tensor) else values
        )
        state["_per_sample_valid"] = None if valid is None else valid.reshape(-1)

    # -- algebra and serialization -------------------------------------------------------

    def __add__(self, other: Any) -> ComposedLossFunction:
        if isinstance(other, ComposedLossFunction):
            return ComposedLossFunction(
                [self, other],
                normalize_weights=other.normalize_weights,
                dtype_policy=other.dtype_policy,
            )
        if isinstance(other, BaseLossFunction):
            return ComposedLossFunction([self, other])
        return NotImplemented

    def __radd__(self, other: Any) -> Any:
        return _zero_plus(self, other)

    def __mul__(self, other: Any) -> ComposedLossFunction:
        if not is_weight(other):
            return NotImplemented
        return ComposedLossFunction([self], weights=[other])

    __rmul__ = __mul__

    def to_spec(self) -> BaseSpec:
        """Spec that rebuilds this leaf (see :func:`loss_component_to_spec`)."""
        return loss_component_to_spec(self)

    def extra_repr(self) -> str:
        kwargs = init_kwargs_from_attrs(self)
        kwargs["dtype_policy"] = self._dtype_policy
        return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _zero_plus(loss: Any, other: Any) -> Any:
    """``0 + loss`` is ``loss``, so ``sum([loss_a, loss_b])`` works."""
    if isinstance(other, numbers.Real) and not isinstance(other, bool) and other == 0:
        return loss
    return NotImplemented


# ------------------------------------------------------------------------ compositions
def _unique_names(components: Sequence[nn.Module]) -> list[str]:
    names = [type(c).__name__ for c in components]
    counts, seen = Counter(names), Counter()
    out = []
    for name in names:
        if counts[name] > 1:
            out.append(f"{name}_{seen[name]}")
            seen[name] += 1
        else:
            out.append(name)
    return out


class ComposedLossOutput(TypedDict):
    """Result of a :class:`ComposedLossFunction` call (all five keys always present)."""

    total_loss: torch.Tensor
    per_component_unweighted: dict[str, torch.Tensor]
    per_component_weight: dict[str, float]  # effective (after normalization)
    per_component_raw_weight: dict[str, float]  # before normalization
    # effective weight * per-structure values; NaN for a structure without a label. Detached,
    # and computed when first read (a training step nobody reports on does no per-sample work)
    per_component_sample: dict[str, torch.Tensor]


class ComposedLossFunction(nn.Module):
    """Weighted sum of leaf losses.

    Args:
        components: leaves or compositions; nested compositions are flattened (their
            weights multiplied by the parent's; their own flags dropped).
        weights: one float or schedule per component (``None`` entries and ``weights=None``
            mean 1.0).
        normalize_weights: divide the resolved weights by their sum at every call.
        dtype_policy: policy for leaves that did not set their own (``None`` = strict).

    >>> from nvalchemi.training.losses import EnergyMSELoss, ForceMSELoss
    >>> loss_fn = ComposedLossFunction([EnergyMSELoss(), ForceMSELoss()], weights=[1.0, 10.0],
    ...                                normalize_weights=False)
    """

    def __init__(
        self,
        components: Sequence[BaseLossFunction | ComposedLossFunction],
        *,
        weights: Sequence[Weight | None] | None = None,
        normalize_weights: bool = True,
        dtype_policy: DTypePolicy | None = None,
    ) -> None:
        super().__init__()
        components = list(components)
        if not components:
            raise ValueError("components must contain at least one loss term")
        if weights is None:
            weights = [1.0] * len(components)
        if len(weights) != len(components):
            raise ValueError(
                f"weights has length {len(weights)} but components has length "
                f"{len(components)}; lengths must match."
            )
        leaves, flat = [], []
        for i, (component, weight) in enumerate(zip(components, weights)):
            weight = check_weight(i, weight)
            if isinstance(component, ComposedLossFunction):
                leaves.extend(component.components)
                flat.extend(scale_weight(w, weight) for w in component._weights)
            elif isinstance(component, BaseLossFunction):
                leaves.append(component)
                flat.append(weight)
            else:
                raise TypeError(
                    f"components[{i}] must be a BaseLossFunction or ComposedLossFunction, "
                    f"got {type(component).__name__}"
                )
        self.components = nn.ModuleList(leaves)
        self._weights: list[Any] = flat
        self._names = _unique_names(leaves)
        self.normalize_weights = bool(normalize_weights)
        self._dtype_policy = check_dtype_policy(dtype_policy)

    @property
    def dtype_policy(self) -> str | None:
        """Policy applied to leaves without their own (``None``: strict)."""
        return self._dtype_policy

    @dtype_policy.setter
    def dtype_policy(self, value: DTypePolicy | None) -> None:
        self._dtype_policy = check_dtype_policy(value)

    @property
    def component_names(self) -> list[str]:
        """Names used in outputs: class names, suffixed ``_0``, ``_1``, ... when repeated."""
        return list(self._names)

    @property
    def weights(self) -> list[Any]:
        """The (unresolved) weight of each component: floats and schedules."""
        return list(self._weights)

    def requires_eval_grad(self) -> bool:
        """Whether evaluating this loss needs autograd (any leaf declares True).

        Raises ``ValueError`` when no leaf declares True and some leaf leaves it undeclared.
        """
        flags = [getattr(c, "requires_eval_grad", None) for c in self.components]
        if any(f is True for f in flags):
            return True
        unknown = [n for n, f in zip(self._names, flags) if f is None]
        if unknown:
            raise ValueError(
                "Cannot infer whether evaluating this loss requires gradients for component(s): "
                f"{unknown}. Set the class attribute requires_eval_grad = True/False on them."
            )
        return False

    # -- weights -------------------------------------------------------------------------

    def _resolved_weights(self, step: int, epoch: int | None) -> tuple[list[float], list[float]]:
        raw = [
            w if type(w) is float else resolve_weight(n, w, step, epoch)
            for n, w in zip(self._names, self._weights)
        ]
        if not self.normalize_weights:
            return raw, raw
        total = sum(raw)
        if not (math.isfinite(total) and total > 0):
            raise ValueError(
                "ComposedLossFunction: cannot normalize weights whose sum is not strictly positive "
                f"(sum={total}). Resolved weights at step={step}, epoch={epoch}: "
                f"{dict(zip(self._names, raw))}. Use positive weights or normalize_weights=False."
            )
        return raw, [w / total for w in raw]

    def _weight_dicts(
        self, step: int, epoch: int | None
    ) -> tuple[list[float], dict[str, float], dict[str, float]]:
        """Effective weights, ``{name: effective}`` and ``{name: raw}`` at ``(step, epoch)``.

        Constant (float) weights are resolved once and reused while they and
        ``normalize_weights`` stay the same.
        """
        cache = self.__dict__.get("_constant_weights")
        if cache is not None and cache[0] == self.normalize_weights and cache[1] == self._weights:
            return cache[2], cache[3].copy(), cache[4].copy()
        raw, effective = self._resolved_weights(step, epoch)
        out = effective, dict(zip(self._names, effective)), dict(zip(self._names, raw))
        if all(type(w) is float for w in self._weights):
            self.__dict__["_constant_weights"] = (self.normalize_weights, list(self._weights), *out)
            return out[0], out[1].copy(), out[2].copy()
        return out

    def current_weight(self, step: int = 0, epoch: int | None = None) -> list[float]:
        """Effective weight of each component at ``(step, epoch)``."""
        return self._resolved_weights(step, epoch)[1]

    def weight_factors(self, step: int = 0, epoch: int | None = None) -> dict[str, float]:
        """``{component name: effective weight}`` at ``(step, epoch)``."""
        return dict(zip(self._names, self.current_weight(step, epoch)))

    # -- forward -------------------------------------------------------------------------

    def forward(
        self,
        predictions: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        *,
        step: int = 0,
        epoch: int | None = None,
        **kwargs: Any,
    ) -> ComposedLossOutput:
        """Evaluate every component on ``predictions[prediction_key]`` vs ``targets[target_key]``.

        ``kwargs`` (``batch_idx``, ``num_graphs``, ``num_nodes_per_graph``,
        ``missing_labels``, ``loss_weight``, ...) go to leaves. ``per_component_sample`` is
        computed when first read.
        """
        effective, effective_by_name, raw_by_name = self._weight_dicts(step, epoch)
        policy = self._dtype_policy
        unweighted: dict[str, torch.Tensor] = {}
        samples: list[tuple[str, Any, Any, float]] = []
        total = None
        for name, leaf, weight in zip(self._names, self.components, effective):
            try:
                pred = predictions[leaf.prediction_key]
                target = targets[leaf.target_key]
            except (AttributeError, KeyError, TypeError):
                pred, target = self._inputs(name, leaf, predictions, targets)
            if type(pred) is not torch.Tensor or type(target) is not torch.Tensor:
                pred, target = self._inputs(name, leaf, predictions, targets)
            if policy is not None and leaf._dtype_policy is None:
                pred, target = cast_for_policy(pred, target, policy)
            state = leaf.__dict__
            state["_per_sample"] = state["_per_sample_source"] = state["_per_sample_valid"] = None
            value = leaf(pred, target, **kwargs)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must return a torch.Tensor, got {type(value).__name__}")
            unweighted[name] = value
            source = state.get("_per_sample_source")
            if source is not None:  # recorded by the leaf, computed when first read
                samples.append((name, source, state.get("_per_sample_valid"), weight))
            else:
                sample = state.get("_per_sample")  # set directly (e.g. by a custom forward)
                if sample is not None:
                    if not isinstance(sample, torch.Tensor):
                        raise TypeError(f"{name}.per_sample_loss must be a torch.Tensor or None")
                    _check_sample(name, sample)
                    samples.append((name, sample, None, weight))
            total = _weighted_sum(total, value, weight)
        return _output(total, unweighted, effective_by_name, raw_by_name, samples)

    @staticmethod
    def _inputs(name, leaf, predictions, targets) -> tuple[torch.Tensor, torch.Tensor]:
        result = []
        for kind, mapping in (("prediction", predictions), ("target", targets)):
            key = getattr(leaf, f"{kind}_key", None)
            if key is None:
                raise AttributeError(
                    f"{name} cannot be used in ComposedLossFunction without a {kind}_key attribute."
                )
            if key not in mapping:
                raise KeyError(
                    f"{name}: {kind} mapping is missing key {key!r} (its {kind}_key); available "
                    f"{kind} keys: {sorted(mapping)}."
                )
            value = mapping[key]
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{name}: {kind} {key!r} must resolve to torch.Tensor, got "
                    f"{type(value).__name__}."
                )
            result.append(value)
        return result[0], result[1]

    # -- algebra -------------------------------------------------------------------------

    def __mul__(self, other: Any) -> ComposedLossFunction:
        if isinstance(other, LossWeightSchedule):
            raise TypeError(
                "Multiplying a ComposedLossFunction by a LossWeightSchedule is not supported. "
                "Scale each component individually (e.g. schedule * EnergyMSELoss()) and "
                f"compose the results, or multiply by a float; got {type(other).__name__}."
            )
        if not is_weight(other):
            return NotImplemented
        return ComposedLossFunction(
            [self],
            weights=[other],
            normalize_weights=self.normalize_weights,
            dtype_policy=self._dtype_policy,
        )

    __rmul__ = __mul__

    def __add__(self, other: Any) -> ComposedLossFunction:
        if not isinstance(other, (BaseLossFunction, ComposedLossFunction)):
            return NotImplemented
        policy = self._dtype_policy
        if isinstance(other, ComposedLossFunction):
            if other.normalize_weights != self.normalize_weights:
                raise ValueError(
                    "Cannot add ComposedLossFunctions with mismatched normalize_weights "
                    f"(self={self.normalize_weights}, other={other.normalize_weights}). Set the "
                    "same value on both first, or build the combination explicitly with "
                    "ComposedLossFunction(..., normalize_weights=...)."
                )
            policy = policy if policy is not None else other._dtype_policy
        return ComposedLossFunction(
            [self, other], normalize_weights=self.normalize_weights, dtype_policy=policy
        )

    def __radd__(self, other: Any) -> Any:
        return _zero_plus(self, other)

    # -- serialization -------------------------------------------------------------------

    def to_spec(self) -> BaseSpec:
        """Spec with leaf specs, weights (floats/schedule specs), flags; rebuilds exactly."""
        return create_model_spec(
            ComposedLossFunction,
            components=[loss_component_to_spec(c) for c in self.components],
            weights=list(self._weights),
            normalize_weights=self.normalize_weights,
            dtype_policy=self._dtype_policy,
        )

    def extra_repr(self) -> str:
        return f"num_components={len(self.components)}, normalize_weights={self.normalize_weights}"


def _weighted_sum(total: torch.Tensor | None, value: torch.Tensor, weight: float) -> torch.Tensor:
    """``total + weight * value`` (``total`` ``None`` for the first term), one op per term."""
    if total is None:
        return value if weight == 1.0 else value * weight
    return total + value if weight == 1.0 else torch.add(total, value, alpha=weight)


def _output(
    total: torch.Tensor,
    unweighted: dict[str, torch.Tensor],
    effective_by_name: dict[str, float],
    raw_by_name: dict[str, float],
    samples: list[tuple[str, Any, Any, float]],
) -> ComposedLossOutput:
    return {
        "total_loss": total,
        "per_component_unweighted": unweighted,
        "per_component_weight": effective_by_name,
        "per_component_raw_weight": raw_by_name,
        "per_component_sample": _PerSampleValues(samples),
    }


def _check_sample(name: str, sample: torch.Tensor) -> None:
    if sample.ndim != 1:
        raise ValueError(
            f"{name}.per_sample_loss must be a 1-D tensor of shape (B,), got {tuple(sample.shape)}"
        )


class _PerSampleValues(dict):
    """``{component: effective weight * per-structure values}``, computed on first use.

    A plain ``dict`` to its readers; the values are only computed when something reads them
    (a reporter, validation), so a training step that nobody reports on does no per-sample
    work. Pickles and copies as a plain ``dict``.
    """

    __slots__ = ("_pending",)

    def __init__(self, pending: list[tuple[str, Any, Any, float]]) -> None:
        self._pending = pending or None  # (dict.__new__ made the empty dict)

    def _fill(self) -> None:
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        for name, source, valid, weight in pending:
            sample = per_sample_values(source, valid)
            _check_sample(name, sample)
            dict.__setitem__(self, name, sample if weight == 1.0 else weight * sample)

    def __reduce__(self) -> tuple[Any, ...]:
        self._fill()
        return dict, (dict(self.items()),)


def _filling(method: Any) -> Any:
    def wrapper(self: _PerSampleValues, *args: Any, **kwargs: Any) -> Any:
        self._fill()
        return method(self, *args, **kwargs)

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


for _method in (
    "__contains__",
    "__delitem__",
    "__eq__",
    "__getitem__",
    "__ior__",
    "__iter__",
    "__len__",
    "__ne__",
    "__or__",
    "__repr__",
    "__reversed__",
    "__ror__",
    "__setitem__",
    "clear",
    "copy",
    "get",
    "items",
    "keys",
    "pop",
    "popitem",
    "setdefault",
    "update",
    "values",
):
    setattr(_PerSampleValues, _method, _filling(getattr(dict, _method)))
_PerSampleValues.__reduce_ex__ = lambda self, protocol: self.__reduce__()  # type: ignore[method-assign]
del _method


def loss_component_to_spec(leaf: BaseLossFunction) -> BaseSpec:
    """Spec of one leaf loss from its same-named constructor attributes."""
    if isinstance(leaf, ComposedLossFunction):
        raise TypeError(
            "loss_component_to_spec accepts only leaf BaseLossFunction objects; use "
            "ComposedLossFunction spec serialization (loss_fn.to_spec()) for compositions."
        )
    if not isinstance(leaf, BaseLossFunction):
        raise TypeError(
            f"loss_component_to_spec expects a BaseLossFunction, got {type(leaf).__name__}"
        )
    kwargs = init_kwargs_from_attrs(leaf)
    if "dtype_policy" in kwargs:  # store only an explicit policy, so the default stays "unset"
        kwargs["dtype_policy"] = leaf._dtype_policy
        if leaf._dtype_policy is None:
            del kwargs["dtype_policy"]
    return create_model_spec(type(leaf), **kwargs)
