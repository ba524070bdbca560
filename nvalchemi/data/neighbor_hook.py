"""``NeighborListHook``: build the neighbour lists of ``ctx.batch`` before the model runs.

The hook runs at ``TrainingStage.BEFORE_FORWARD`` (and at a dynamics engine's
``BEFORE_COMPUTE``) unless given another stage. It leaves a batch alone when the
batch already carries a valid list for the same cutoff (built by
:func:`~nvalchemi.data.neighbors.compute_neighbors`, or in the loader by
:class:`~nvalchemi.data.neighbors.NeighborListTransform` once the collated batch
carries the stamp), and otherwise computes the lists of the whole batch with
:func:`~nvalchemi.data.neighbors.compute_neighbors`: one pass of torch operations on
the batch's device (a CUDA batch stays on the GPU), vesin for large structures on the
CPU. A structure whose list would explode (a cell in the wrong units) is refused
with an error naming it. It is a plain Python hook: no ``torch.compile``, nothing
to warm up.

It lives in the data layer, next to the neighbour lists it maintains, so that models
(``BaseModelMixin.make_neighbor_hooks``) can build it without importing
:mod:`nvalchemi.hooks`; its documented import path is
:mod:`nvalchemi.hooks.neighbor_list` (or ``nvalchemi.hooks``).

Example:
    >>> from types import SimpleNamespace
    >>> from nvalchemi.hooks.neighbor_list import NeighborListHook
    >>> hook = NeighborListHook(SimpleNamespace(cutoff=5.0, half_list=False, format="coo"))
    >>> hook.frequency, hook.cutoff
    (1, 5.0)
"""

from __future__ import annotations

import weakref
from enum import Enum
from typing import Any

import torch

from nvalchemi.data._neighbor_stamps import remember_positions
from nvalchemi.data._vesin import vesin_method
from nvalchemi.data.neighbors import compute_neighbors, has_neighbor_list, resolve_neighbor_options

__all__ = ["NeighborListHook"]

# Stage names (not enums: data may not import nvalchemi.training) the hook runs at
# when no explicit stage is given.
DEFAULT_STAGE_NAMES = frozenset({"BEFORE_FORWARD", "BEFORE_COMPUTE"})


class NeighborListHook:
    """Compute neighbour lists for ``ctx.batch`` when it lacks a valid one.

    Args:
        config: a ``NeighborConfig``-like object (``cutoff``, ``half_list``,
            ``format``) or a cutoff in Å.
        skin: Verlet skin in Å. With ``skin > 0`` lists are built out to
            ``cutoff + skin`` and, while the *same* batch object is seen again
            (dynamics), reused until some atom has moved more than ``skin / 2`` or the
            cell changed. Checking that reads a value from the device, so keep
            ``skin = 0`` for training, where every step brings a new batch.
        max_neighbors: minimum width of the ``"matrix"`` format.
        stage: the stage to run at; ``None`` runs at any stage named
            ``BEFORE_FORWARD`` (training) or ``BEFORE_COMPUTE`` (dynamics).
        method: vesin algorithm, ``"auto"`` (default) or ``"cell_list"``
            (``"naive"``/``"brute_force"`` map to ``"auto"``).

    Attributes:
        builds: number of lists built; ``skips`` batches that already had one;
        ``reuses`` skin reuses.
    """

    frequency: int = 1

    def __init__(
        self,
        config: Any,
        skin: float = 0.0,
        max_neighbors: int | None = None,
        stage: Enum | None = None,
        method: str | None = None,
    ) -> None:
        self.config = config
        self.cutoff, self.half_list, self.format = resolve_neighbor_options(config=config)
        skin = float(skin)
        if not skin >= 0.0:
            raise ValueError(f"NeighborListHook skin must be >= 0 Å; got {skin}.")
        if max_neighbors is not None and (
            isinstance(max_neighbors, bool)
            or not isinstance(max_neighbors, int)
            or max_neighbors < 1
        ):
            raise ValueError(
                f"max_neighbors must be a positive int or None; got {max_neighbors!r}."
            )
        self.skin = skin
        self.max_neighbors = max_neighbors
        self.stage = stage
        self.method = method
        self.vesin_method = vesin_method(method)
        self.frequency = 1
        self.builds = 0
        self.skips = 0
        self.reuses = 0
        self._reference: tuple | None = None

    def __repr__(self) -> str:
        return (
            f"NeighborListHook(cutoff={self.cutoff}, half_list={self.half_list}, "
            f"format={self.format!r}, skin={self.skin}, stage={self.stage})"
        )

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reference": None}  # weak references do not pickle

    def _runs_on_stage(self, stage: Enum) -> bool:
        if self.stage is not None:
            return stage == self.stage
        return getattr(stage, "name", None) in DEFAULT_STAGE_NAMES

    def __call__(self, ctx: Any, stage: Enum | None = None) -> None:
        batch = getattr(ctx, "batch", None)
        if batch is None:
            return
        if has_neighbor_list(batch, self.cutoff, half_list=self.half_list, format=self.format):
            # A stamp that came with the batch (loader, unpickling) is trusted once; from
            # now on moving the atoms in place invalidates it.
            prefix = "_neighbor_matrix" if self.format == "matrix" else "_neighbor_list"
            if batch.__dict__.get(prefix + "_positions") is None:
                remember_positions(batch, self.format)
            self.skips += 1
            return
        if self.skin > 0.0 and self._within_skin(batch):
            self.reuses += 1
            return
        compute_neighbors(
            batch,
            self.cutoff + self.skin,
            half_list=self.half_list,
            format=self.format,
            max_neighbors=self.max_neighbors,
            method=self.vesin_method,
        )
        self._restamp(batch)
        self.builds += 1
        if self.skin > 0.0:
            cell = batch.cell.detach().clone() if "cell" in batch else None
            self._reference = (weakref.ref(batch), batch.positions.detach().clone(), cell)

    def _restamp(self, batch: Any) -> None:
        # The list reaches cutoff + skin; it is valid for the configured cutoff.
        prefix = "_neighbor_matrix" if self.format == "matrix" else "_neighbor_list"
        object.__setattr__(batch, prefix + "_cutoff", self.cutoff)

    def _within_skin(self, batch: Any) -> bool:
        """Same batch object, same cell, and no atom moved more than skin/2 since the build."""
        if self._reference is None:
            return False
        ref, positions, cell = self._reference
        if ref() is not batch or batch.positions.shape != positions.shape:
            return False
        key = "neighbor_matrix" if self.format == "matrix" else "neighbor_list"
        if key not in batch:
            return False
        if (cell is None) != ("cell" not in batch) or (
            cell is not None and not torch.equal(batch.cell.detach(), cell)
        ):
            return False
        moved = (batch.positions.detach() - positions).norm(dim=-1)
        if moved.numel() and bool(moved.max() > 0.5 * self.skin):
            return False
        remember_positions(batch, self.format)
        self._restamp(batch)
        return True
