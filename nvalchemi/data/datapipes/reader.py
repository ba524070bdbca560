"""``Reader``: the storage side of the data pipeline (one sample -> tensors + metadata).

A reader turns an index into ``(fields, metadata)`` where ``fields`` is a
``dict[str, Tensor]`` of CPU tensors (the fields of one ``AtomicData``) and
``metadata`` a plain dict (``"index"`` and whatever the backend adds, such as the
source file). Datasets turn the fields into ``AtomicData``; readers do no device
work. Subclasses implement ``__len__`` and at least one of ``_load_sample`` or
``_load_many_samples`` (the latter lets a backend merge reads).

Example:
    >>> import torch
    >>> class Squares(Reader):
    ...     def __len__(self):
    ...         return 3
    ...     def _load_sample(self, index):
    ...         return {"x": torch.tensor([index * index])}
    >>> with Squares() as reader:
    ...     fields, meta = reader.read(2)
    >>> fields["x"].item(), meta
    (4, {'index': 2})
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Reader", "ReaderProtocol"]

_log = logging.getLogger(__name__)

Sample = tuple[dict[str, torch.Tensor], dict[str, Any]]


@runtime_checkable
class ReaderProtocol(Protocol):
    """What datasets need from a reader: batched reads, a length, and ``close``."""

    def read_many(self, indices: Sequence[int]) -> list[Sample]: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


class Reader:
    """Base class of storage readers.

    Args:
        pin_memory: pin every returned tensor (for asynchronous copies to a GPU).
        include_index_in_metadata: add ``metadata["index"]`` (the requested index).
        coordinated_subsampling: stored for samplers that coordinate subsampling
            across readers; unused by the base class.

    Index checking is the concrete reader's job (raise ``IndexError`` naming the
    index and the length).
    """

    def __init__(
        self,
        *,
        pin_memory: bool = False,
        include_index_in_metadata: bool = True,
        coordinated_subsampling: Any = None,
    ) -> None:
        self.pin_memory = bool(pin_memory)
        self.include_index_in_metadata = bool(include_index_in_metadata)
        self.coordinated_subsampling = coordinated_subsampling

    # ------------------------------------------------------------- subclass hooks
    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must implement __len__.")

    def _overrides(self, name: str) -> bool:
        return getattr(type(self), name) is not getattr(Reader, name)

    def _load_sample(self, index: int) -> dict[str, torch.Tensor]:
        """Fields of one sample; defaults to ``_load_many_samples([index])``."""
        if not self._overrides("_load_many_samples"):
            raise NotImplementedError(
                f"{type(self).__name__} must implement _load_sample or _load_many_samples."
            )
        out = self._load_many_samples([index])
        if len(out) != 1:
            raise RuntimeError(
                f"{type(self).__name__}._load_many_samples([{index}]) returned {len(out)} "
                "samples; expected 1."
            )
        return out[0]

    def _load_many_samples(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Fields of several samples in the requested order; defaults to a loop."""
        if not self._overrides("_load_sample"):
            raise NotImplementedError(
                f"{type(self).__name__} must implement _load_sample or _load_many_samples."
            )
        return [self._load_sample(i) for i in indices]

    def _get_sample_metadata(self, index: int) -> dict[str, Any]:
        """Backend metadata of one sample (e.g. its source file); default empty."""
        return {}

    # ----------------------------------------------------------------- public API
    def _finish(self, index: int, fields: dict[str, torch.Tensor]) -> Sample:
        metadata = dict(self._get_sample_metadata(index))
        if self.include_index_in_metadata:
            metadata.setdefault("index", index)
        if self.pin_memory and torch.cuda.is_available():
            fields = {k: v.pin_memory() for k, v in fields.items()}
        return fields, metadata

    def read(self, index: int) -> Sample:
        """``(fields, metadata)`` of sample ``index``."""
        return self._finish(index, self._load_sample(index))

    __getitem__ = read

    def read_many(self, indices: Sequence[int]) -> list[Sample]:
        """``[(fields, metadata), ...]`` of several samples, in the requested order."""
        indices = [int(i) for i in indices]
        if not indices:
            return []
        loaded = self._load_many_samples(indices)
        if len(loaded) != len(indices):
            raise RuntimeError(
                f"{type(self).__name__}._load_many_samples returned {len(loaded)} samples "
                f"for {len(indices)} indices."
            )
        return [self._finish(i, fields) for i, fields in zip(indices, loaded)]

    def __iter__(self) -> Iterator[Sample]:
        for index in range(len(self)):
            try:
                yield self.read(index)
            except Exception as exc:
                _log.error("Sample %d of %r failed: %s", index, self, exc)
                raise RuntimeError(f"Sample {index} failed with exception: {exc}") from exc

    @property
    def field_levels(self) -> dict[str, str]:
        """Level (``"atom"``, ``"edge"``, ``"system"``) of fields the backend knows."""
        return {}

    @property
    def field_names(self) -> list[str]:
        """Names of the fields of sample 0 (``[]`` when empty)."""
        if len(self) == 0:
            return []
        return list(self._load_sample(0))

    def read_data(self, index: int) -> Any:
        """Sample ``index`` as an ``AtomicData`` (metadata dropped)."""
        from nvalchemi.data.atomic_data import AtomicData

        fields, _ = self.read(index)
        levels = self.field_levels
        return AtomicData(**fields, field_levels={k: levels[k] for k in fields if k in levels})

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release files and handles (no-op by default)."""

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        try:
            size = len(self)
        except Exception:
            size = "?"
        return f"{type(self).__name__}(len={size}, pin_memory={self.pin_memory})"
