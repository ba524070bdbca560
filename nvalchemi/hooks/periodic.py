"""Atoms back inside their periodic cell: :class:`WrapPeriodicHook`, :func:`wrap_positions_into_cell`.

Frames from molecular dynamics (and hand-made structures) often hold atoms outside the
cell: an atom that left through a periodic face is the same atom one lattice vector
away. Nothing physical changes when it is moved back, but features built from absolute
positions, and anything that assumes atoms inside the cell, behave better. Only
periodic axes are wrapped (fractional coordinates mod 1); a slab keeps its vacuum axis
and a molecule is left alone.

A neighbour list the batch already carries stays valid: each edge's integer image
shift is corrected by the lattice images its two atoms moved by, so every edge vector
``positions[j] - positions[i] + shift @ cell`` is the same before and after (COO and
matrix formats), and the list's stamp follows the new positions.

Example:
    >>> import torch
    >>> cell = torch.eye(3).mul(2.0).unsqueeze(0)
    >>> wrap_positions_into_cell(torch.tensor([[2.5, -0.5, 1.0]]), cell,
    ...                          torch.tensor([[True, True, False]])).tolist()
    [[0.5, 1.5, 1.0]]
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from nvalchemi.data._neighbor_stamps import remember_positions, stamp_of
from nvalchemi.hooks.protocol import runs_at

__all__ = ["WrapPeriodicHook", "wrap_positions_into_cell"]

DEFAULT_STAGE_NAMES = frozenset({"BEFORE_FORWARD", "BEFORE_COMPUTE"})
"""Stages the hook runs at when no stage is given: before the model (training, dynamics)."""


def lattice_images(
    positions: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    batch_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[V, 3]`` integer lattice images (as floats) each atom lies in; 0 on open axes.

    ``positions - images @ cell`` is inside the cell. The fractional coordinates are
    computed in float64 with the pseudo-inverse of the cell, so a zero lattice vector on
    an open axis (molecules, slabs written without a vacuum vector) is harmless.
    """
    cell = cell.reshape(-1, 3, 3)
    pbc = pbc.reshape(-1, 3).to(device=positions.device, dtype=torch.bool)
    if batch_idx is None:
        if cell.shape[0] != 1:
            raise ValueError(
                f"wrap_positions_into_cell: {cell.shape[0]} cells need batch_idx (the structure "
                "of every atom)"
            )
        batch_idx = torch.zeros(positions.shape[0], dtype=torch.long, device=positions.device)
    inverse = torch.linalg.pinv(cell.detach().to(torch.float64))
    fractional = torch.einsum(
        "vi,vij->vj", positions.detach().to(torch.float64), inverse.index_select(0, batch_idx)
    )
    images = torch.floor(fractional)
    return torch.where(pbc.index_select(0, batch_idx), images, torch.zeros_like(images))


def wrap_positions_into_cell(
    positions: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    batch_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """``positions`` moved into their cell along periodic axes (a new tensor).

    Args:
        positions: ``[V, 3]`` Cartesian positions (Å).
        cell: ``[B, 3, 3]`` (or ``[3, 3]``) lattice vectors as rows.
        pbc: ``[B, 3]`` (or ``[3]``) periodic axes.
        batch_idx: ``[V]`` structure of every atom (needed when ``B > 1``).

    The move is a whole number of lattice vectors: differentiable with respect to
    ``positions`` (gradient 1) and ``cell``.
    """
    images = lattice_images(positions, cell, pbc, batch_idx)
    cells = cell.reshape(-1, 3, 3)
    if batch_idx is None:
        batch_idx = torch.zeros(positions.shape[0], dtype=torch.long, device=positions.device)
    move = torch.einsum("vi,vij->vj", images.to(cells.dtype), cells.index_select(0, batch_idx))
    return positions - move.to(positions.dtype)


class WrapPeriodicHook:
    """Wrap ``ctx.batch.positions`` in place into the cell along periodic axes.

    Runs before the model: at ``TrainingStage.BEFORE_FORWARD`` (or a dynamics engine's
    ``BEFORE_COMPUTE``) unless ``stage`` says otherwise. A batch without ``cell`` and
    ``pbc`` is left alone. Register it before a ``NeighborListHook`` or let it keep the
    batch's own lists valid (see the module docstring). Moving atoms changes neither
    energies nor forces of a periodic model; it changes what position-dependent inputs
    (and a model that is not translation invariant) see.

    Args:
        frequency: run every ``frequency`` steps.
        stage: the stage to run at (``None``: before the model, see above).
    """

    def __init__(self, frequency: int = 1, stage: Enum | None = None) -> None:
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(f"WrapPeriodicHook: frequency must be an int >= 1; got {frequency!r}")
        self.frequency = frequency
        self.stage = stage

    def __repr__(self) -> str:
        return f"WrapPeriodicHook(frequency={self.frequency}, stage={self.stage})"

    def _runs_on_stage(self, stage: Enum) -> bool:
        return runs_at(self.stage, stage, DEFAULT_STAGE_NAMES)

    def __call__(self, ctx: Any, stage: Enum | None = None) -> None:
        batch = getattr(ctx, "batch", None)
        if batch is None or "cell" not in batch or "pbc" not in batch:
            return
        positions, cell = batch.positions, batch.cell.reshape(-1, 3, 3)
        batch_idx = batch.batch_idx
        valid = {fmt: stamp_of(batch, fmt) is not None for fmt in ("coo", "matrix")}
        images = lattice_images(positions, cell, batch.pbc, batch_idx)
        move = torch.einsum("vi,vij->vj", images.to(cell.dtype), cell.index_select(0, batch_idx))
        with torch.no_grad():  # a constant move of the input, never part of a graph
            positions.sub_(move.to(positions.dtype))
        _shift_edges(batch, images.to(torch.long), cell, batch_idx)
        for fmt, was_valid in valid.items():
            if was_valid:
                remember_positions(batch, fmt)


def _shift_edges(
    batch: Any, images: torch.Tensor, cell: torch.Tensor, batch_idx: torch.Tensor
) -> None:
    """Correct stored image shifts so every edge vector is what it was before the move.

    An edge ``(i, j)`` with shift ``S``: after ``r_k -> r_k - n_k @ cell`` its vector is
    ``r_j - r_i + (S + n_j - n_i) @ cell``.
    """
    if "neighbor_list" in batch and "neighbor_list_shifts" in batch:
        pairs = batch.neighbor_list
        change = images.index_select(0, pairs[:, 1]) - images.index_select(0, pairs[:, 0])
        shifts = batch.neighbor_list_shifts
        shifts.add_(change.to(shifts.dtype))
        if "shifts" in batch:  # the same shifts in Cartesian form
            edge_cell = cell.index_select(0, batch_idx.index_select(0, pairs[:, 0]))
            cartesian = batch.shifts
            cartesian.add_(torch.einsum("ei,eij->ej", change.to(edge_cell.dtype), edge_cell))
    if "neighbor_matrix" in batch and "neighbor_matrix_shifts" in batch:
        matrix = batch.neighbor_matrix
        count = images.shape[0]
        real = matrix < count  # padding holds the atom count
        receivers = images.index_select(0, matrix.clamp(max=count - 1).reshape(-1))
        change = receivers.reshape(*matrix.shape, 3) - images.unsqueeze(1)
        change = torch.where(real.unsqueeze(-1), change, torch.zeros_like(change))
        shifts = batch.neighbor_matrix_shifts
        shifts.add_(change.to(shifts.dtype))
