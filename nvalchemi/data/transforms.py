"""Composition of data transforms: per-structure (sample) or per-batch.

A *sample* transform receives one structure and its metadata and returns them,
``f(data: AtomicData, metadata: dict) -> (AtomicData, dict)``; a one-argument
``f(data: AtomicData) -> AtomicData`` is accepted too. A *batch* transform
receives and returns a whole batch, ``f(batch: Batch) -> Batch``.
:class:`Compose` chains either kind left to right and finds out which kind it
holds from the type hint of each callable's first parameter.

Example:
    >>> import torch
    >>> from nvalchemi.data import AtomicData
    >>> from nvalchemi.data.transforms import Compose
    >>> def centre(data: AtomicData) -> AtomicData:
    ...     data.positions = data.positions - data.positions.mean(0)
    ...     return data
    >>> def tag(data: AtomicData, metadata: dict) -> tuple[AtomicData, dict]:
    ...     metadata["centred"] = True
    ...     return data, metadata
    >>> compose = Compose([centre, tag])
    >>> data = AtomicData(atomic_numbers=torch.tensor([1, 1]),
    ...                   positions=torch.tensor([[0.0, 0, 0], [2.0, 0, 0]]))
    >>> out, meta = compose(data, {})
    >>> out.positions[:, 0].tolist(), meta
    ([-1.0, 1.0], {'centred': True})
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal

from nvalchemi.data.atomic_data import AtomicData
from nvalchemi.data.batch import Batch

__all__ = ["Compose"]

TransformKind = Literal["sample", "batch"]


def _first_positional(fn: Callable) -> tuple[list[inspect.Parameter], Any]:
    """Positional parameters of ``fn`` and the object whose annotations describe them."""
    hint_source: Any = fn
    plain = inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isbuiltin(fn)
    if not plain and not isinstance(fn, type):
        hint_source = type(fn).__call__
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return [], hint_source
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return positional, hint_source


def _classify(index: int, fn: Callable) -> TransformKind | None:
    """Kind of ``fn`` from its first parameter's type hint (``None`` when untyped)."""
    positional, hint_source = _first_positional(fn)
    if not positional:
        return None
    try:
        hints = typing.get_type_hints(hint_source)
    except Exception:  # unresolvable forward references: treat as untyped
        hints = {}
    annotation = hints.get(positional[0].name)
    if annotation is None or annotation is Any or annotation is object:
        return None  # untyped in effect
    if isinstance(annotation, type) and issubclass(annotation, AtomicData):
        return "sample"
    if isinstance(annotation, type) and issubclass(annotation, Batch):
        return "batch"
    raise TypeError(
        f"Compose: transform[{index}] ({fn!r}) has its first parameter annotated as "
        f"{annotation!r}; annotate it as AtomicData (sample transform) or Batch (batch "
        "transform), or leave it unannotated."
    )


def _takes_metadata(fn: Callable) -> bool:
    """Whether a sample transform takes ``(data, metadata)`` rather than ``(data)``."""
    positional, _ = _first_positional(fn)
    if not positional:
        return True  # *args or an opaque builtin: pass both
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    return len(positional) >= 2


class Compose:
    """Apply transforms left to right; an empty composition is the identity.

    Each callable's first parameter annotation decides its kind: ``AtomicData``
    (sample transform) or ``Batch`` (batch transform). Unannotated callables adopt
    the kind of their typed siblings; mixing kinds is a ``TypeError``. A
    composition without typed callables has sample semantics but also accepts a
    batch.

    Call it as ``compose(data, metadata) -> (data, metadata)`` for structures or
    ``compose(batch) -> batch`` for batches. Transforms must return their output.
    An exception from transform ``i`` is re-raised as ``RuntimeError`` naming
    ``transform[i]`` with the original exception as ``__cause__``.

    Attributes:
        transforms: the callables, as a tuple in application order.
        is_batch: True when this is a batch composition.
    """

    __slots__ = ("_kind", "_with_metadata", "is_batch", "transforms")

    def __init__(self, transforms: Iterable[Callable]) -> None:
        if isinstance(transforms, Compose):
            transforms = transforms.transforms
        self.transforms = tuple(transforms)
        kind: TransformKind | None = None
        first_typed = -1
        for i, fn in enumerate(self.transforms):
            if not callable(fn):
                raise TypeError(
                    f"Compose: transform[{i}] is not callable (got {type(fn).__name__})."
                )
            this = _classify(i, fn)
            if this is None:
                continue
            if kind is None:
                kind, first_typed = this, i
            elif this != kind:
                raise TypeError(
                    f"Compose: cannot mix sample and batch transforms: transform[{first_typed}] "
                    f"is a {kind} transform but transform[{i}] is a {this} transform. Put "
                    "sample transforms on the Dataset and batch transforms on the DataLoader."
                )
        self._kind = kind
        self.is_batch = kind == "batch"
        self._with_metadata = tuple(_takes_metadata(fn) for fn in self.transforms)

    @property
    def kind(self) -> TransformKind | None:
        """``"sample"`` or ``"batch"`` from the type hints; ``None`` when nothing is typed."""
        return self._kind

    def __len__(self) -> int:
        return len(self.transforms)

    def __bool__(self) -> bool:
        return bool(self.transforms)

    def __call__(self, data: Any, metadata: dict[str, Any] | None = None) -> Any:
        if isinstance(data, Batch) and metadata is None:
            return self._apply_batch(data)
        if self.is_batch:
            raise TypeError(
                f"Compose: this is a batch composition; call it with a Batch, not "
                f"{type(data).__name__}."
            )
        return self._apply_sample(data, {} if metadata is None else metadata)

    def _apply_batch(self, batch: Batch) -> Batch:
        if self._kind == "sample":
            raise TypeError("Compose: this is a sample composition; call it with (data, metadata).")
        for i, fn in enumerate(self.transforms):
            try:
                batch = fn(batch)
            except Exception as exc:
                raise RuntimeError(
                    f"Compose: transform[{i}] ({fn!r}) raised {type(exc).__name__}: {exc}"
                ) from exc
            if batch is None:
                raise RuntimeError(
                    f"Compose: transform[{i}] ({fn!r}) returned None; transforms must return "
                    "the (possibly modified) batch."
                )
        return batch

    def _apply_sample(
        self, data: AtomicData, metadata: dict[str, Any]
    ) -> tuple[AtomicData, dict[str, Any]]:
        for i, (fn, with_metadata) in enumerate(zip(self.transforms, self._with_metadata)):
            try:
                out = fn(data, metadata) if with_metadata else fn(data)
            except Exception as exc:
                raise RuntimeError(
                    f"Compose: transform[{i}] ({fn!r}) raised {type(exc).__name__}: {exc}"
                ) from exc
            if isinstance(out, tuple) and len(out) == 2:
                data, metadata = out
            elif out is None:
                raise RuntimeError(
                    f"Compose: transform[{i}] ({fn!r}) returned None; sample transforms must "
                    "return (data, metadata) (or data, for one-argument transforms)."
                )
            else:
                data = out
        return data, metadata

    def __repr__(self) -> str:
        return f"Compose({list(self.transforms)!r})"
