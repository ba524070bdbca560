"""Checks of what a run trains on, made once: the dataloader given to ``run`` and its first batch.

A wrong dataloader (``run(42)``, a loader that yields single ``AtomicData``) or data
in another floating dtype than the model otherwise fails deep inside the first
forward ("'int' object is not iterable", "ForceMSELoss requires batch_idx", "mat1 and
mat2 must have the same dtype"). These checks run before it, once per run, and cost
a few attribute reads (no device sync); each error names the dataloader, what it
gave, and the fix.

Example:
    >>> check_dataloader([1, 2])  # any iterable passes; its batches are checked later
    >>> check_dataloader(42)
    Traceback (most recent call last):
    ...
    TypeError: TrainingStrategy.run(dataloader): got int (42), which is not an iterable of batches. Fix: pass a loader of Batch objects: nvalchemi.data.DataLoader(dataset, batch_size=8), or torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=Batch.from_data_list).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nvalchemi.models.base import BaseModelMixin
from nvalchemi.training.runtime import unwrap_model

__all__ = [
    "check_dataloader",
    "check_first_batch",
    "describe_loader",
    "dtype_error",
    "loader_error",
]

_LOADER_FIX = (
    "pass a loader of Batch objects: nvalchemi.data.DataLoader(dataset, batch_size=8), or "
    "torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=Batch.from_data_list)"
)


def describe_loader(loader: Any) -> str:
    """``DataLoader(collate_fn=default_collate)``-style name of a dataloader, for messages."""
    name = type(loader).__name__
    collate = getattr(loader, "collate_fn", None)
    if collate is not None:
        label = getattr(collate, "__qualname__", None) or type(collate).__name__
        return f"{name}(collate_fn={label})"
    return name


def check_dataloader(dataloader: Any) -> None:
    """Refuse, before anything runs, what cannot be a dataloader (``TypeError`` with the fix)."""
    from nvalchemi.data import AtomicData, Batch  # light

    if isinstance(dataloader, (Batch, AtomicData)):
        raise TypeError(
            f"TrainingStrategy.run(dataloader): got one {type(dataloader).__name__}, not a "
            "dataloader. Fix: train on it with strategy.train_batch(batch), or pass a list "
            f"of batches (run([batch])), or {_LOADER_FIX}."
        )
    iterable = hasattr(dataloader, "__iter__") or hasattr(dataloader, "__getitem__")
    if dataloader is None or isinstance(dataloader, (str, bytes, numbers.Number)) or not iterable:
        shown = repr(dataloader)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(
            f"TrainingStrategy.run(dataloader): got {type(dataloader).__name__} ({shown}), "
            f"which is not an iterable of batches. Fix: {_LOADER_FIX}."
        )


def check_first_batch(
    batch: Any, models: Any, *, default_training_fn: bool, dataloader: Any = None
) -> None:
    """Check the first batch of a run before its forward (``TypeError`` naming the fix).

    * single structures instead of a ``Batch`` (an ``AtomicData``, or a list of them:
      a torch ``DataLoader`` without ``collate_fn=Batch.from_data_list``);
    * with the default ``training_fn`` (``default_training_fn=True``), a floating dtype of the batch that differs
      from the model's parameters, unless the model is an nvalchemi model (those cast
      their inputs to their own dtype).
    """
    from nvalchemi.data import Batch  # light

    source = "the dataloader"
    if dataloader is not None:
        source = f"the dataloader {describe_loader(dataloader)}"
    structures = _structures_in(batch)
    if structures is not None:
        raise TypeError(
            f"{source} yielded {structures} instead of a Batch (structures collated into "
            "one graph with batch_idx and ptr). Fix: collate with "
            "torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=Batch.from_data_list), "
            "or use nvalchemi.data.DataLoader(dataset, batch_size=8)."
        )
    if batch is None or isinstance(batch, (str, bytes, numbers.Number)):
        raise TypeError(
            f"{source} yielded {type(batch).__name__} ({batch!r}) instead of a Batch. "
            f"Fix: {_LOADER_FIX}."
        )
    if isinstance(batch, Batch) and default_training_fn:  # custom batches: a custom training_fn
        _check_dtype(batch, models, source)


def _structures_in(batch: Any) -> str | None:
    from nvalchemi.data import AtomicData  # light

    if isinstance(batch, AtomicData):
        return "one AtomicData"
    sequence = isinstance(batch, Sequence) and not isinstance(batch, (str, bytes))
    if sequence and batch and all(isinstance(item, AtomicData) for item in batch):
        return f"a {type(batch).__name__} of {len(batch)} AtomicData"
    return None


def _check_dtype(batch: Any, models: Any, source: str) -> None:
    found = _dtype_mismatch(batch, models)
    if found is not None and not isinstance(found[2], BaseModelMixin):  # those cast inputs
        raise TypeError(
            _dtype_message(source, *found, "its first forward would fail on mixed dtypes")
        )


_DTYPE_FAILURE = re.compile(r"dtype|scalar type|type \(\w+\) and")


def dtype_error(exc: BaseException, batch: Any, models: Any, stage: str) -> TypeError | None:
    """A clearer error for a step that failed on data of another dtype than a model (or ``None``).

    Custom training functions and models that do not cast their inputs fail in torch
    ("mat1 and mat2 must have the same dtype"); nvalchemi models cast them, and a loss
    then finds predictions and labels in two dtypes. Either way the batch's dtype and
    the model's are what to change.
    """
    if not isinstance(exc, (RuntimeError, ValueError)) or not _DTYPE_FAILURE.search(str(exc)):
        return None
    found = _dtype_mismatch(batch, models)
    if found is None:
        return None
    text = " ".join(str(exc).split())
    return TypeError(_dtype_message("the dataloader", *found, f"{stage} failed: {text}"))


def _dtype_mismatch(batch: Any, models: Any) -> tuple[Any, str, nn.Module, Any] | None:
    """``(positions dtype, model name, model, parameter dtype)`` if they differ, else ``None``."""
    positions = getattr(batch, "positions", None)
    if not isinstance(positions, torch.Tensor) or not positions.dtype.is_floating_point:
        return None
    if isinstance(models, Mapping):
        name = "main" if "main" in models or len(models) != 1 else next(iter(models))
        model = models.get(name)
    else:
        name, model = "main", models
    model = unwrap_model(model) if model is not None else None
    if not isinstance(model, nn.Module):
        return None
    dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), None)
    if dtype is None or dtype == positions.dtype:
        return None
    return positions.dtype, name, model, dtype


def _dtype_message(
    source: str, data: Any, name: str, model: nn.Module, dtype: Any, consequence: str
) -> str:
    wanted, given = str(dtype).removeprefix("torch."), str(data).removeprefix("torch.")
    convert = {"float64": "model.double()", "float32": "model.float()"}.get(
        given, f"model.to({data})"
    )
    return (
        f"{source} yielded a batch of {given} positions but model {name!r} "
        f"({type(model).__name__}) has {wanted} parameters; {consequence}. Fix: read the data "
        f"as {wanted} (dtype={dtype} of the reader or dataset, e.g. ASEReader(..., "
        f"dtype={dtype}); dataset.dtype: {wanted} in a job file), or convert the model: "
        f"{convert} before building the strategy."
    )


def loader_error(exc: BaseException, dataloader: Any) -> TypeError | None:
    """A clearer error for torch's collate failure on ``AtomicData`` (else ``None``).

    ``torch.utils.data.DataLoader`` without ``collate_fn`` cannot stack ``AtomicData``
    and says only "default_collate: batch must contain tensors, ... found AtomicData".
    """
    text = str(exc)
    if isinstance(exc, TypeError) and "collate" in text and "AtomicData" in text:
        return TypeError(
            f"the dataloader {describe_loader(dataloader)} cannot collate AtomicData "
            f"({' '.join(text.split())}). Fix: DataLoader(dataset, batch_size=8, "
            "collate_fn=Batch.from_data_list), or use nvalchemi.data.DataLoader."
        )
    return None
