"""Neighbour lists built for the models when the batches come without them.

A model that declares a ``NeighborConfig`` (PaiNN, MACE) reads ``neighbor_list`` (or
``neighbor_matrix``) from the batch. With a plain ``torch.utils.data.DataLoader`` of
``Batch`` objects nobody computed them, and the model would stop at step 0 with a
``KeyError``. The strategy builds them instead, on the training device, with the
batched builder (:func:`nvalchemi.data.neighbors.compute_neighbors`: one pass of torch
operations over the whole batch, on the GPU for a CUDA batch):

* training decides once per run, at the first batch: a batch without the list field
  turns the builder on (it then runs at ``BEFORE_FORWARD`` of every step, before the
  strategy's own hooks); a batch that carries lists costs nothing per step;
* validation asks :meth:`TrainingStrategy.neighbor_list_builders
  <nvalchemi.training.TrainingStrategy.neighbor_list_builders>` and builds for each
  validation batch that lacks them.

A list already in the batch is left alone (the model checks its stamp itself). A
registered ``NeighborListHook`` means the user manages lists: nothing is added.

Example:
    >>> import torch
    >>> from types import SimpleNamespace
    >>> from nvalchemi.data import AtomicData, Batch
    >>> mol = AtomicData(atomic_numbers=torch.tensor([1, 1]),
    ...                  positions=torch.tensor([[0.0, 0, 0], [0.7, 0, 0]]))
    >>> batch = Batch.from_data_list([mol])
    >>> builder = NeighborListBuilder(cutoff=1.0, half_list=False, format="coo")
    >>> builder(SimpleNamespace(batch=batch))
    >>> batch.neighbor_list.tolist(), builder.builds
    ([[0, 1], [1, 0]], 1)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from nvalchemi.models.base import BaseModelMixin
from nvalchemi.training.runtime import unwrap_model

__all__ = ["NeighborListBuilder", "builders_for"]

_FIELD = {"coo": "neighbor_list", "matrix": "neighbor_matrix"}


class NeighborListBuilder:
    """Compute a batch's neighbour lists at ``BEFORE_FORWARD`` when it has none.

    Args:
        cutoff: cutoff in Å (the largest of the models that share the list).
        half_list: each pair once instead of both directions.
        format: ``"coo"`` or ``"matrix"``.

    Attributes:
        builds: batches it built lists for.
    """

    frequency = 1

    def __init__(self, cutoff: float, half_list: bool, format: str) -> None:
        self.cutoff, self.half_list, self.format = float(cutoff), bool(half_list), str(format)
        self.field = _FIELD[self.format]
        self.builds = 0

    def __repr__(self) -> str:
        return (
            f"NeighborListBuilder(cutoff={self.cutoff}, half_list={self.half_list}, "
            f"format={self.format!r})"
        )

    def missing(self, batch: Any) -> bool:
        """Whether ``batch`` lacks the list field (a ``Batch``; other objects never do)."""
        from nvalchemi.data import Batch  # light

        return isinstance(batch, Batch) and self.field not in batch

    def __call__(self, ctx: Any, stage: Any = None) -> None:
        batch = getattr(ctx, "batch", None)
        if not self.missing(batch):
            return
        from nvalchemi.data.neighbors import compute_neighbors  # light

        compute_neighbors(batch, self.cutoff, half_list=self.half_list, format=self.format)
        self.builds += 1


def builders_for(models: Iterable[nn.Module]) -> tuple[NeighborListBuilder, ...]:
    """One builder per list format the models' ``NeighborConfig`` ask for (``()`` if none).

    Models sharing a format share one list at the largest cutoff (models ignore pairs
    beyond their own). Models that want the same format as half and full lists cannot
    share one: none is built for that format, and the model's own error explains it.
    """

    wanted: dict[str, list[Any]] = {}
    for model in models:
        model = unwrap_model(model)
        config = getattr(model, "model_config", None) if isinstance(model, BaseModelMixin) else None
        neighbors = getattr(config, "neighbor_config", None)
        if neighbors is None:
            continue
        fmt = str(getattr(neighbors.format, "value", neighbors.format)).lower()
        wanted.setdefault(fmt, []).append(neighbors)
    out = []
    for fmt, configs in wanted.items():
        if fmt not in _FIELD or len({bool(c.half_list) for c in configs}) != 1:
            continue
        cutoff = max(float(c.cutoff) for c in configs)
        out.append(NeighborListBuilder(cutoff, bool(configs[0].half_list), fmt))
    return tuple(out)
