"""The leaf-loss contract: :class:`BaseLossFunction` and its template ``forward``.

A leaf loss maps ``(prediction, target, **metadata)`` to a scalar. ``forward`` runs
``align_dtypes -> validate -> normalize -> mask -> compute_residual -> reduce``; subclasses
implement ``compute_residual`` and override the other steps when they need to.

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

Per-structure loss weights: when the batch carries a ``loss_weight`` field (one float per
structure, shape ``(B,)`` or ``(B, 1)``; ``compute_supervised_loss`` passes it as the
``loss_weight=`` keyword), every leaf multiplies each structure's contribution by its
weight, and per-atom terms (forces) by the weight of their structure. The normalisation is
unchanged (a mean over structures, atoms or components of ``w * l``, not divided by the
sum of the weights), so a weight of 2 doubles that structure's share of the loss and of
the gradient, and 0 removes it. ``per_sample_loss`` stays unweighted. Without the field
nothing extra is computed.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import torch
from torch import nn

if TYPE_CHECKING:
    from nvalchemi.training.losses.composition import ComposedLossFunction
    from nvalchemi.training.spec import BaseSpec

__all__ = ["BaseLossFunction", "DTypePolicy", "ReductionContext", "assert_same_shape"]

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


def graph_loss_weight(loss: Any, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The per-structure ``loss_weight`` of the call as a flat ``(B,)`` tensor, or ``None``.

    Read from the ``loss_weight=`` keyword, else from a ``batch=`` keyword's field.
    """
    weight = kwargs.get("loss_weight")
    if weight is None and kwargs.get("batch") is not None:
        batch = kwargs["batch"]
        weight = batch.get("loss_weight") if hasattr(batch, "get") else None
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(
            f"{type(loss).__name__}: loss_weight must be a floating tensor of shape "
            f"(num_graphs,) or (num_graphs, 1); got {got}. Store one float per structure."
        )
    if weight.ndim == 2 and weight.shape[1] == 1:
        weight = weight.reshape(-1)
    if weight.ndim != 1:
        raise ValueError(
            f"{type(loss).__name__}: loss_weight must have shape (num_graphs,) or "
            f"(num_graphs, 1); got shape {tuple(weight.shape)}."
        )
    return weight


def missing_structures(loss: Any, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """``(B,)`` bool mask of the structures that lack this loss's target, or ``None``.

    From the ``missing_labels=`` keyword (a mapping of label name to mask, as
    ``Batch.missing_labels``, or the leaf's own mask), else from a ``batch=`` keyword.
    """
    missing = kwargs.get("missing_labels")
    if missing is None and kwargs.get("batch") is not None:
        missing = getattr(kwargs["batch"], "missing_labels", None)
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
    """Whether a call may mask or weight entries: a missing-label mask for this loss's target,
    a ``loss_weight``, or a ``batch=`` keyword that could carry either."""
    if kwargs.get("loss_weight") is not None or kwargs.get("batch") is not None:
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
    the batch's per-structure loss weights ``(B,)`` (numerator only); ``"missing"``, the
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
    (the structures without each label) and ``loss_weight`` (one float per structure); see
    the module docstring. A ``batch=`` keyword is a fallback source for all of them.

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
            _defined_here(cls, m) for m in ("align_dtypes", "validate", "normalize")
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

        Also records the batch's ``loss_weight`` (``ctx["loss_weight"]``).
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

        ``ctx["loss_weight"]`` (per-structure loss weights) scales the numerator only.
        """
        counts = ctx.get("weights")
        loss_weight = ctx.get("loss_weight")
        if valid is None and counts is None and loss_weight is None:
            return residual.mean() if residual.numel() else residual.sum()
        weight = None if valid is None else valid.to(residual.dtype)
        if counts is not None:
            counts = counts.expand_as(residual)
            weight = counts if weight is None else weight * counts
        if weight is None:
            total = max(residual.numel(), 1)
        else:
            total = weight.sum()
            total = torch.where(total > 0, total, 1.0)
        if loss_weight is not None:
            rows = self.graph_rows(loss_weight.to(residual.dtype), residual, ctx, kwargs)
            weight = rows if weight is None else weight * rows
        return (residual * weight).sum() / total

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
        from nvalchemi.training.losses.composition import ComposedLossFunction

        if isinstance(other, ComposedLossFunction):
            return ComposedLossFunction(
                [self, other],
                weights=[1.0, 1.0],
                normalize_weights=other.normalize_weights,
                dtype_policy=other.dtype_policy,
            )
        if isinstance(other, BaseLossFunction):
            return ComposedLossFunction([self, other])
        return NotImplemented

    def __radd__(self, other: Any) -> Any:
        if isinstance(other, (int, float)) and not isinstance(other, bool) and other == 0:
            return self  # lets sum([loss_a, loss_b]) start from 0
        return NotImplemented

    def __mul__(self, other: Any) -> ComposedLossFunction:
        from nvalchemi.training.losses.composition import ComposedLossFunction, is_weight

        if not is_weight(other):
            return NotImplemented
        return ComposedLossFunction([self], weights=[other])

    __rmul__ = __mul__

    def to_spec(self) -> BaseSpec:
        """Spec that rebuilds this leaf (see ``loss_component_to_spec``)."""
        from nvalchemi.training.losses.composition import loss_component_to_spec

        return loss_component_to_spec(self)

    def extra_repr(self) -> str:
        from nvalchemi._serialization import init_kwargs_from_attrs

        kwargs = init_kwargs_from_attrs(self)
        kwargs["dtype_policy"] = self._dtype_policy
        return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
