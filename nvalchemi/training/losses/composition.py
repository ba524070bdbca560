"""Weighted sums of leaf losses, target assembly, and loss serialization.

A :class:`ComposedLossFunction` is a flat list of leaves with a weight each (a float or a
:class:`~nvalchemi.training.losses.LossWeightSchedule`). Operators build the same thing:

>>> from nvalchemi.training.losses import EnergyMSELoss, ForceMSELoss, LinearWeight
>>> loss_fn = 1.0 * EnergyMSELoss() + LinearWeight(start=0.0, end=10.0, num_steps=100) * ForceMSELoss()
>>> loss_fn.weight_factors(step=50)
{'EnergyMSELoss': 0.1666..., 'ForceMSELoss': 0.8333...}

By default (``normalize_weights=True``) the resolved weights are divided by their sum at
every call, so only their ratios matter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypedDict

import torch
from torch import nn

from nvalchemi._serialization import init_kwargs_from_attrs
from nvalchemi.training.losses.base import (
    BaseLossFunction,
    DTypePolicy,
    cast_for_policy,
    check_dtype_policy,
    per_sample_values,
)
from nvalchemi.training.losses.schedules import LossWeightSchedule
from nvalchemi.training.spec import BaseSpec, create_model_spec

__all__ = [
    "ComposedLossFunction",
    "ComposedLossOutput",
    "LossTargetAssemblyProtocol",
    "as_composed_loss",
    "assemble_loss_targets",
    "compute_supervised_loss",
    "loss_component_to_spec",
    "loss_target_keys",
]

Weight = float | LossWeightSchedule


def is_weight(value: Any) -> bool:
    """A number (not a bool) or a :class:`LossWeightSchedule`."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (numbers.Real, LossWeightSchedule))


@dataclasses.dataclass(frozen=True)
class _ProductWeight:
    """Lazy product of two weights (a schedule scaled by a number or by another schedule)."""

    left: Any
    right: Any

    @property
    def per_epoch(self) -> bool:
        return any(getattr(w, "per_epoch", False) for w in (self.left, self.right))

    def __call__(self, step: int, epoch: int) -> float:
        def value(w: Any) -> float:
            return float(w) if isinstance(w, numbers.Real) else w(step, epoch)

        return value(self.left) * value(self.right)

    def to_spec(self) -> BaseSpec:
        return create_model_spec(_ProductWeight, left=self.left, right=self.right)


def _scale(weight: Any, factor: Any) -> Any:
    if isinstance(factor, numbers.Real) and factor == 1.0:
        return weight
    if isinstance(weight, numbers.Real) and weight == 1.0:
        return float(factor) if isinstance(factor, numbers.Real) else factor
    if isinstance(weight, numbers.Real) and isinstance(factor, numbers.Real):
        return float(weight) * float(factor)
    return _ProductWeight(weight, factor)


def _check_weight(index: int, weight: Any) -> Any:
    if weight is None:
        return 1.0
    if not is_weight(weight):
        raise TypeError(
            f"weights[{index}] must be a float or LossWeightSchedule (per_epoch, "
            f"__call__(step, epoch), to_spec()), got {type(weight).__name__}."
        )
    if isinstance(weight, numbers.Real):
        if not math.isfinite(weight):
            raise ValueError(
                f"weights[{index}]: weight {weight} is not finite; use a finite number."
            )
        return float(weight)
    return weight


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
            weight = _check_weight(i, weight)
            if isinstance(component, ComposedLossFunction):
                leaves.extend(component.components)
                flat.extend(_scale(w, weight) for w in component._weights)
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

    def _resolve(self, name: str, weight: Any, step: int, epoch: int | None) -> float:
        if isinstance(weight, float):
            return weight
        if weight.per_epoch and epoch is None:
            raise ValueError(
                f"epoch must be provided when the {name} loss weight schedule has per_epoch=True. "
                "Pass epoch=... to the loss call."
            )
        try:
            value = weight(step, 0 if epoch is None else epoch)
        except TypeError as exc:
            raise TypeError(
                f"{name}: weight schedule {type(weight).__name__} does not satisfy the "
                f"LossWeightSchedule contract __call__(step, epoch) -> float: {exc}"
            ) from exc
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"{name}: weight schedule {type(weight).__name__} returned "
                f"{type(value).__name__}; LossWeightSchedule.__call__ must return float."
            )
        if not math.isfinite(value):
            raise ValueError(f"{name}: weight schedule returned {value}, which is not finite.")
        return float(value)

    def _resolved_weights(self, step: int, epoch: int | None) -> tuple[list[float], list[float]]:
        raw = [
            w if type(w) is float else self._resolve(n, w, step, epoch)
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
        for name, leaf, weight in zip(self._names, self._modules["components"], effective):
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
            if total is None:
                total = value if weight == 1.0 else value * weight
            else:
                total = torch.add(total, value, alpha=weight)
        return {
            "total_loss": total,
            "per_component_unweighted": unweighted,
            "per_component_weight": effective_by_name,
            "per_component_raw_weight": raw_by_name,
            "per_component_sample": _per_sample_dict(samples),
        }

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
                    f"({self.normalize_weights} and {other.normalize_weights}); set the same "
                    "value on both first."
                )
            policy = policy if policy is not None else other._dtype_policy
        return ComposedLossFunction(
            [self, other], normalize_weights=self.normalize_weights, dtype_policy=policy
        )

    def __radd__(self, other: Any) -> Any:
        if isinstance(other, numbers.Real) and not isinstance(other, bool) and other == 0:
            return self
        return NotImplemented

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


def _per_sample_dict(pending: list[tuple[str, Any, Any, float]]) -> _PerSampleValues:
    samples = _PerSampleValues()
    samples._pending = pending or None
    return samples


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


def as_composed_loss(loss_fn: Any) -> ComposedLossFunction:
    """A composition as is; a leaf as a one-component composition; else ``TypeError``."""
    if isinstance(loss_fn, ComposedLossFunction):
        return loss_fn
    if isinstance(loss_fn, BaseLossFunction):
        return ComposedLossFunction([loss_fn])
    raise TypeError(
        f"Expected a BaseLossFunction or ComposedLossFunction, got {type(loss_fn).__name__}"
    )


def loss_target_keys(loss_fn: BaseLossFunction | ComposedLossFunction) -> tuple[str, ...]:
    """Unique ``target_key`` of every component, in order."""
    leaves = loss_fn.components if isinstance(loss_fn, ComposedLossFunction) else [loss_fn]
    return tuple(
        dict.fromkeys(getattr(c, "target_key", None) for c in leaves if hasattr(c, "target_key"))
    )


class LossTargetAssemblyProtocol(Protocol):
    """Builds the target mapping a loss is evaluated against."""

    def __call__(
        self,
        loss_fn: ComposedLossFunction,
        predictions: Mapping[str, torch.Tensor],
        batch: Any,
        *,
        workflow: Any = None,
        target_keys: Sequence[str] | None = None,
        batch_label: str = "Batch",
    ) -> Mapping[str, torch.Tensor]: ...


def _field(batch: Any, key: str) -> Any:
    get = getattr(batch, "get", None)  # a Mapping or a Batch: no exception for a missing key
    if callable(get):
        value = get(key)
    else:
        try:
            value = getattr(batch, key, None)
        except (KeyError, ValueError):
            value = None
    return value if isinstance(value, torch.Tensor) else None


def assemble_loss_targets(
    loss_fn: ComposedLossFunction,
    predictions: Mapping[str, torch.Tensor],
    batch: Any,
    *,
    workflow: Any = None,
    target_keys: Sequence[str] | None = None,
    batch_label: str = "Batch",
) -> dict[str, torch.Tensor]:
    """Default target assembler: each target from the batch, else from ``predictions``.

    The predictions fallback serves distillation, e.g.
    ``EnergyMSELoss(prediction_key="student_energy", target_key="teacher_energy")``.
    """
    targets = {}
    get = getattr(batch, "get", None)  # a Mapping or a Batch: no exception for a missing key
    if not callable(get):
        get = functools.partial(_field, batch)
    for key in loss_target_keys(loss_fn) if target_keys is None else target_keys:
        value = get(key)
        if not isinstance(value, torch.Tensor):
            value = None
        if value is None and isinstance(predictions, Mapping):
            value = predictions.get(key)
        if value is None:
            leaves = loss_fn.components if isinstance(loss_fn, ComposedLossFunction) else [loss_fn]
            users = [type(c).__name__ for c in leaves if getattr(c, "target_key", None) == key]
            raise KeyError(
                f"Loss target {key!r} (target_key of {', '.join(users) or 'the loss'}) not found: "
                f"{batch_label} has no field {key!r} and the predictions mapping has no key "
                f"{key!r}. Add the label to the data, return it from training_fn, or pass a "
                "custom loss_target_assembler."
            )
        targets[key] = value
    return targets


_GRAPH_METADATA = ("batch_idx", "num_graphs", "num_nodes_per_graph")


def compute_supervised_loss(
    loss_fn: BaseLossFunction | ComposedLossFunction,
    predictions: Mapping[str, torch.Tensor],
    batch: Any,
    *,
    step: int = 0,
    epoch: int | None = None,
    workflow: Any = None,
    target_assembler: LossTargetAssemblyProtocol = assemble_loss_targets,
    target_keys: Sequence[str] | None = None,
    batch_label: str = "Batch",
) -> ComposedLossOutput:
    """Assemble targets and evaluate ``loss_fn`` with the batch's graph metadata.

    Passes ``batch_idx``, ``num_graphs`` and ``num_nodes_per_graph``; when the batch has
    them, its per-structure ``loss_weight`` and its ``missing_labels`` (the structures
    without each label, known at collation) to every leaf.
    """
    loss_fn = as_composed_loss(loss_fn)
    targets = target_assembler(
        loss_fn,
        predictions,
        batch,
        workflow=workflow,
        target_keys=target_keys,
        batch_label=batch_label,
    )
    try:  # a Batch (the training loop's case): three attribute reads
        meta = {
            "batch_idx": batch.batch_idx,
            "num_graphs": batch.num_graphs,
            "num_nodes_per_graph": batch.num_nodes_per_graph,
        }
        weight, missing = batch.get("loss_weight"), batch.missing_labels
    except AttributeError:
        meta = None
    if meta is not None:
        if meta["batch_idx"] is None or meta["num_nodes_per_graph"] is None:
            meta = {k: v for k, v in meta.items() if v is not None}
    elif isinstance(batch, Mapping):
        meta = {k: batch[k] for k in _GRAPH_METADATA if batch.get(k) is not None}
        weight, missing = batch.get("loss_weight"), batch.get("missing_labels")
    else:
        meta = {}
        for key in _GRAPH_METADATA:
            value = getattr(batch, key, None)
            if value is not None:
                meta[key] = value
        get = getattr(batch, "get", None)
        weight = get("loss_weight") if callable(get) else getattr(batch, "loss_weight", None)
        missing = getattr(batch, "missing_labels", None)
    if weight is not None:
        meta["loss_weight"] = weight
    if missing:
        meta["missing_labels"] = missing
    return loss_fn(predictions, targets, step=step, epoch=epoch, **meta)
