"""A loss on a batch: targets from the batch, graph metadata, :func:`compute_supervised_loss`.

The training and validation loops evaluate their loss through
:func:`compute_supervised_loss`: it assembles the targets (from the batch by default, or
with a :class:`LossTargetAssemblyProtocol`) and passes the batch's graph metadata,
per-structure ``loss_weight`` and ``missing_labels`` to every leaf.

:class:`~nvalchemi.training.losses.ComposedLossFunction` and its output type are defined in
:mod:`nvalchemi.training.losses.base` (leaves and their sums are one algebra); this module
also exports them under the import path that specs and job files name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from nvalchemi.training.losses.base import (
    BaseLossFunction,
    ComposedLossFunction,
    ComposedLossOutput,
    loss_component_to_spec,
    weight_field,
)

# Specs written before the weight product moved to the weights module name it here.
from nvalchemi.training.losses.schedules import _ProductWeight as _ProductWeight

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


def _batch_value(batch: Any, key: str) -> Any:
    """Field ``key`` of a ``Batch`` or a mapping (else attribute ``key``); ``None`` if absent."""
    get = getattr(batch, "get", None)  # a Mapping or a Batch: no exception for a missing key
    if callable(get):
        return get(key)
    try:
        return getattr(batch, key, None)
    except (KeyError, ValueError):
        return None


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
    for key in loss_target_keys(loss_fn) if target_keys is None else target_keys:
        value = _batch_value(batch, key)
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
    them, its per-structure ``loss_weight``, the weights of the loss's labels
    (``label_weights={"forces": batch.forces_weight, ...}``), its ``missing_labels`` (the
    structures without each label, known at collation), and ``atomic_numbers`` when a leaf
    weights atoms by element, to every leaf. ``batch`` is a ``Batch``, a
    mapping, or any object with those names as attributes.

    >>> import torch
    >>> from nvalchemi.training.losses import EnergyMSELoss
    >>> batch = {"energy": torch.tensor([[1.0], [2.0]])}
    >>> out = compute_supervised_loss(
    ...     EnergyMSELoss(), {"predicted_energy": torch.tensor([[1.0], [4.0]])}, batch)
    >>> float(out["total_loss"]), out["per_component_weight"]
    (2.0, {'EnergyMSELoss': 1.0})
    """
    if type(loss_fn) is not ComposedLossFunction:
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
        get = batch.get
        weight, missing = get("loss_weight"), batch.missing_labels
    except AttributeError:  # a mapping, or another object carrying the same names
        meta = {k: v for k in _GRAPH_METADATA if (v := _batch_value(batch, k)) is not None}
        weight, missing = _batch_value(batch, "loss_weight"), _batch_value(batch, "missing_labels")

        def get(key: str) -> Any:
            return _batch_value(batch, key)

    else:
        if meta["batch_idx"] is None or meta["num_nodes_per_graph"] is None:
            meta = {k: v for k, v in meta.items() if v is not None}
    if weight is not None:
        meta["loss_weight"] = weight
    if missing:
        meta["missing_labels"] = missing
    fields, elements = _weight_needs(loss_fn)
    labels = None
    for label, field in fields:  # a few dict reads; nothing when the data has no weights
        value = get(field)
        if value is not None:
            labels = {} if labels is None else labels
            labels[label] = value
    if labels is not None:
        meta["label_weights"] = labels
    if elements:
        meta["atomic_numbers"] = get("atomic_numbers")
    return loss_fn(predictions, targets, step=step, epoch=epoch, **meta)


def _weight_needs(loss_fn: ComposedLossFunction) -> tuple[tuple[tuple[str, str], ...], bool]:
    """``((label, its weight field), ...)`` of ``loss_fn``'s targets, and whether a leaf weights
    atoms by element (then it needs ``atomic_numbers``). Cached on the composition."""
    key = tuple(
        (getattr(c, "target_key", None), c.__dict__.get("_element_weights"))
        for c in loss_fn.components
    )
    cached = loss_fn.__dict__.get("_weight_needs")
    if cached is not None and cached[0] == key:
        return cached[1]
    labels = tuple(dict.fromkeys(label for label, _ in key if isinstance(label, str)))
    needs = (
        tuple((label, weight_field(label)) for label in labels),
        any(elements is not None for _, elements in key),
    )
    loss_fn.__dict__["_weight_needs"] = (key, needs)
    return needs
