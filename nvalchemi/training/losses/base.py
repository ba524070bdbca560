"""The leaf-loss contract: :class:`BaseLossFunction` and its template ``forward``.

A leaf loss maps ``(prediction, target, **metadata)`` to a scalar. ``forward`` runs
``align_dtypes -> validate -> normalize -> mask -> compute_residual -> reduce``; subclasses
implement ``compute_residual`` and override the other steps when they need to.

NaN targets are missing labels (the data layer fills absent labels with NaN): they are
always masked out, so a structure without a label contributes nothing and is not counted.
``ignore_nonfinite=True`` additionally masks ``inf`` targets. Per-structure values follow
the same convention: a structure without a label gets NaN in ``per_sample_loss`` and
``False`` in ``per_sample_valid``, so per-sample statistics skip it too.

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


def graph_loss_weight(loss: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
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


def weight_rows(
    loss: Any, weight: torch.Tensor, like: torch.Tensor, batch_idx: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-structure ``weight`` ``(B,)`` broadcast to the rows of ``like``.

    Rows are structures (``like.shape[0] == B``) unless ``batch_idx`` maps atoms to them.
    """
    if batch_idx is not None:
        if batch_idx.shape[0] != like.shape[0]:
            raise ValueError(
                f"{type(loss).__name__}: batch_idx has {batch_idx.shape[0]} entries but the "
                f"target has {like.shape[0]} rows."
            )
        weight = weight.to(like.device).index_select(0, batch_idx.to(like.device))
    elif weight.shape[0] != like.shape[0]:
        raise ValueError(
            f"{type(loss).__name__}: loss_weight has shape {tuple(weight.shape)} but the "
            f"target has {like.shape[0]} structures; expected shape ({like.shape[0]},)."
        )
    return weight.to(device=like.device, dtype=like.dtype).reshape(-1, *([1] * (like.ndim - 1)))


class ReductionContext(dict):
    """Per-call data shared between ``normalize`` and ``reduce``.

    Conventional keys: ``"weights"``, per-sample weights (e.g. ``(B, 1)`` atom counts) that
    weight both the numerator and the denominator of the default mean; ``"loss_weight"``,
    per-row loss weights (the batch's ``loss_weight`` broadcast to the residual's rows) that
    weight only the numerator.
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
    pk = f"prediction_key={prediction_key!r}" if prediction_key else "prediction"
    tk = f"target_key={target_key!r}" if target_key else "target"
    if pred.dtype != target.dtype:
        raise ValueError(
            f"{name}: prediction and target dtype mismatch; {pk} has dtype {pred.dtype}, {tk} has "
            f"dtype {target.dtype}. Cast one of them, or set dtype_policy='prediction_to_target' "
            "(cast predictions to the label dtype) or dtype_policy='target_to_prediction' (cast "
            "labels to the prediction dtype) on the loss or its composition."
        )
    if strict:
        if pred.shape != target.shape:
            raise ValueError(
                f"{name}: prediction and target shape must match exactly for elementwise loss; "
                f"{pk} has shape {tuple(pred.shape)}, {tk} has shape {tuple(target.shape)}."
            )
        return
    try:
        torch.broadcast_shapes(pred.shape, target.shape)
    except RuntimeError:
        raise ValueError(
            f"{name}: prediction and target shape mismatch; {pk} has shape {tuple(pred.shape)}, "
            f"{tk} has shape {tuple(target.shape)}."
        ) from None


class BaseLossFunction(nn.Module, abc.ABC):
    """Stateless leaf loss. Subclasses implement :meth:`compute_residual`.

    Leaves carry no weight; combine them with ``+`` and ``*`` (weights, schedules) into a
    :class:`~nvalchemi.training.losses.ComposedLossFunction`.

    Args:
        dtype_policy: ``"strict"`` raises on a dtype mismatch, ``"prediction_to_target"`` /
            ``"target_to_prediction"`` cast. ``None`` (default) behaves as ``"strict"`` but lets
            a composition's policy apply; an explicit value overrides the composition's.

    Keyword metadata (passed by ``compute_supervised_loss`` from the batch): ``batch_idx``,
    ``num_graphs``, ``num_nodes_per_graph`` and, when the batch has it, ``loss_weight``
    (one float per structure; see the module docstring).

    Attributes:
        requires_eval_grad: whether evaluating the loss needs autograd (force/stress losses
            need gradients of the energy). Every built-in leaf declares it.
        per_sample_loss: detached per-structure values of the last call, or ``None``; NaN
            for a structure with no labelled entry.
        per_sample_valid: boolean ``(B,)`` mask of the structures that had a label in the
            last call (``None`` with ``per_sample_loss``). A NaN in ``per_sample_loss`` where
            this is ``True`` is a real non-finite value (e.g. a diverged prediction).
    """

    requires_eval_grad: ClassVar[bool | None] = None

    def __init__(self, *, dtype_policy: DTypePolicy | None = None) -> None:
        super().__init__()
        self._dtype_policy = check_dtype_policy(dtype_policy)
        self.per_sample_loss: torch.Tensor | None = None
        self.per_sample_valid: torch.Tensor | None = None

    @property
    def dtype_policy(self) -> str:
        """The effective policy of this leaf on its own (``"strict"`` when unset)."""
        return self._dtype_policy or "strict"

    @dtype_policy.setter
    def dtype_policy(self, value: DTypePolicy | None) -> None:
        self._dtype_policy = check_dtype_policy(value)

    # -- template ------------------------------------------------------------------------

    def forward(self, pred: torch.Tensor, target: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Scalar loss of ``pred`` against ``target``; ``kwargs`` carry batch metadata."""
        self.per_sample_loss = self.per_sample_valid = None
        pred, target = self.align_dtypes(pred, target)
        self.validate(pred, target)
        pred, target, ctx = self.normalize(pred, target, **kwargs)
        valid = self.mask(pred, target, ctx, **kwargs)
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
        """Rescale inputs before the residual (e.g. per-atom energies); identity by default."""
        return pred, target, ReductionContext()

    def mask(
        self, pred: torch.Tensor, target: torch.Tensor, ctx: ReductionContext, **kwargs: Any
    ) -> torch.Tensor:
        """Boolean mask of labelled entries: not NaN (and finite with ``ignore_nonfinite``)."""
        if getattr(self, "ignore_nonfinite", False):
            return torch.isfinite(target)
        return ~torch.isnan(target)

    @abc.abstractmethod
    def compute_residual(
        self, pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """Elementwise residual (masked entries are zeroed afterwards)."""

    def reduce(
        self, residual: torch.Tensor, valid: torch.Tensor, ctx: ReductionContext, **kwargs: Any
    ) -> torch.Tensor:
        """Mean of ``residual`` over valid entries, weighted by ``ctx["weights"]`` if present.

        ``ctx["loss_weight"]`` (per-row loss weights) scales the numerator only.
        """
        weight = valid.to(residual.dtype)
        if "weights" in ctx:
            weight = weight * ctx["weights"].expand_as(residual)
        total = weight.sum()
        if "loss_weight" in ctx:
            weight = weight * ctx["loss_weight"]
        return (residual * weight).sum() / torch.where(total > 0, total, 1.0)

    def record_per_sample(self, values: torch.Tensor, valid: torch.Tensor) -> None:
        """Store per-structure ``values`` (``(B,)``) with NaN where ``valid`` is ``False``.

        Sync-free (no host reads), so it is safe on the training hot path.
        """
        valid = valid.reshape(-1)
        values = values.detach().reshape(-1)
        self.per_sample_loss = torch.where(valid, values, torch.nan)
        self.per_sample_valid = valid

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
