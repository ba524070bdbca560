"""Energy -> forces and stress by automatic differentiation: the one shared implementation.

Conventions: forces ``F = -dE/dr``; stress ``sigma = (1/V) dE/d(epsilon)`` for a symmetric
strain ``epsilon`` applied as ``r -> r (I + epsilon)`` and ``cell -> cell (I + epsilon)``
(cell rows are lattice vectors). This is ASE's sign: positive = tensile, pressure
``p = -tr(sigma) / 3``. With ``training=True`` derivatives are taken with
``create_graph=True`` so force and stress losses train the weights.

Most models only need :func:`energy_and_derivatives`:

    >>> import torch
    >>> pos = torch.randn(4, 3, dtype=torch.float64)
    >>> out = energy_and_derivatives(
    ...     lambda p, c: (p**2).sum().reshape(1), pos, batch_idx=torch.zeros(4, dtype=torch.long),
    ...     num_graphs=1, compute_forces=True)
    >>> torch.allclose(out["forces"], -2 * pos)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

__all__ = [
    "autograd_forces",
    "autograd_forces_and_stresses",
    "autograd_stresses",
    "cell_cache_needs_update",
    "cell_volume",
    "energy_and_derivatives",
    "graph_layout",
    "prepare_strain",
    "sum_outputs",
]

EnergyFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def prepare_strain(
    positions: torch.Tensor, cell: torch.Tensor, batch_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply a zero symmetric strain with a gradient, for stress by autograd.

    Args:
        positions: ``[V, 3]``.
        cell: ``[B, 3, 3]`` (rows are lattice vectors).
        batch_idx: ``[V]`` system index of every atom.

    Returns:
        ``(strained_positions, strained_cell, displacement)``; ``displacement`` is a
        zero ``[B, 3, 3]`` leaf with ``requires_grad=True``. The strain is
        ``(D + D^T) / 2``, so ``dE/dD`` is the symmetric strain derivative.
    """
    displacement = torch.zeros(
        cell.shape[0], 3, 3, dtype=positions.dtype, device=positions.device, requires_grad=True
    )
    symmetric = 0.5 * (displacement + displacement.transpose(-1, -2))
    strained_positions = positions + torch.einsum(
        "vi,vij->vj", positions, symmetric.index_select(0, batch_idx)
    )
    strained_cell = cell.to(positions.dtype) + torch.bmm(cell.to(positions.dtype), symmetric)
    return strained_positions, strained_cell, displacement


def cell_volume(cell: torch.Tensor) -> torch.Tensor:
    """``|det(cell)|`` per system, ``[B]``."""
    return torch.linalg.det(cell).abs()


def _stress_from_grad(grad: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
    # Systems without a cell (zero volume, e.g. a molecule in a mixed batch) get zero
    # stress: a NaN here would poison gradients even where the loss masks the label.
    # A periodic cell of zero volume has no stress either; from_atoms rejects such
    # cells and NvalchemiCalculator refuses their stress, but an AtomicData built by
    # hand with one still gets zeros here.
    volume = cell_volume(cell.to(grad.dtype))
    has_volume = volume > 0
    safe = torch.where(has_volume, volume, torch.ones_like(volume))
    return grad / safe.view(-1, 1, 1) * has_volume.view(-1, 1, 1)


def _grad(
    energy: torch.Tensor,
    inputs: list[torch.Tensor],
    training: bool,
    retain_graph: bool,
) -> tuple[torch.Tensor | None, ...]:
    return torch.autograd.grad(
        energy,
        inputs,
        grad_outputs=torch.ones_like(energy),
        create_graph=training,
        retain_graph=retain_graph or training,
        allow_unused=True,
    )


def _zeros_if_none(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


def autograd_forces(
    energy: torch.Tensor,
    positions: torch.Tensor,
    training: bool = False,
    retain_graph: bool = False,
) -> torch.Tensor:
    """``-dE/dr`` summed over systems, ``[V, 3]``.

    ``training=True`` builds a differentiable graph (``create_graph``) and retains it.
    """
    (grad,) = _grad(energy, [positions], training, retain_graph)
    return -_zeros_if_none(grad, positions)


def autograd_stresses(
    energy: torch.Tensor,
    displacement: torch.Tensor,
    cell: torch.Tensor,
    num_graphs: int | None = None,
    training: bool = False,
    retain_graph: bool = False,
) -> torch.Tensor:
    """``(1/V) dE/d(epsilon)`` per system, ``[B, 3, 3]`` (positive = tensile).

    ``displacement`` comes from :func:`prepare_strain`; ``num_graphs`` is accepted
    for API compatibility (it is ``cell.shape[0]``).
    """
    (grad,) = _grad(energy, [displacement], training, retain_graph)
    return _stress_from_grad(_zeros_if_none(grad, displacement), cell)


def autograd_forces_and_stresses(
    energy: torch.Tensor,
    positions: torch.Tensor,
    displacement: torch.Tensor,
    cell: torch.Tensor,
    num_graphs: int | None = None,
    training: bool = False,
    retain_graph: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forces ``[V, 3]`` and stress ``[B, 3, 3]`` from one ``autograd.grad`` call."""
    grad_pos, grad_disp = _grad(energy, [positions, displacement], training, retain_graph)
    forces = -_zeros_if_none(grad_pos, positions)
    return forces, _stress_from_grad(_zeros_if_none(grad_disp, displacement), cell)


def graph_layout(data: object) -> tuple[torch.Tensor, int]:
    """``(batch_idx [V], num_graphs)`` of a ``Batch``, or of an ``AtomicData`` (one system)."""
    num_graphs = getattr(data, "num_graphs", None)
    if num_graphs is not None:
        return data.batch_idx, int(num_graphs)
    positions = data["positions"]
    return torch.zeros(positions.shape[0], dtype=torch.long, device=positions.device), 1


def energy_and_derivatives(
    energy_fn: EnergyFn,
    positions: torch.Tensor,
    cell: torch.Tensor | None = None,
    *,
    batch_idx: torch.Tensor,
    num_graphs: int,
    compute_forces: bool = True,
    compute_stress: bool = False,
    training: bool = False,
) -> dict[str, torch.Tensor]:
    """Run an energy model and differentiate it: the body of most models' ``forward``.

    Args:
        energy_fn: ``energy_fn(positions, cell) -> energy [B]`` or ``[B, 1]``; it must
            use the positions and cell it is given (they carry the strain).
        positions: ``[V, 3]``; a tensor that already requires grad is used as is.
        cell: ``[B, 3, 3]`` or ``None`` (no stress then).
        batch_idx: ``[V]`` system of every atom.
        num_graphs: ``B``.
        compute_forces: return ``forces [V, 3] = -dE/dr``.
        compute_stress: return ``stress [B, 3, 3]`` (needs ``cell``); systems with a
            zero cell get zeros.
        training: differentiable derivatives (``create_graph=True``) so force and
            stress losses reach the weights. Ignored when grad mode is off.

    Returns:
        ``{"energy": [B, 1], "forces": ..., "stress": ...}`` (only what was asked).
        Under ``torch.no_grad()`` derivatives are still computed and every output
        is detached. While ``torch.compile`` traces it, the derivatives come from
        ``torch.func.grad`` instead of ``torch.autograd.grad`` (same values), so the
        energy, its derivatives and their backward compile into one graph.
    """
    grad_enabled = torch.is_grad_enabled()
    training = training and grad_enabled
    compute_stress = compute_stress and cell is not None
    need_grad = compute_forces or compute_stress
    if need_grad and torch.compiler.is_compiling():
        # torch.compile cannot differentiate a compiled backward again (forces trained by
        # autograd.grad(create_graph=True)); torch.func.grad traces into the same graph.
        out = _functional_derivatives(
            energy_fn, positions, cell, batch_idx, num_graphs, compute_forces, compute_stress
        )
        return out if grad_enabled else {k: v.detach() for k, v in out.items()}
    with torch.set_grad_enabled(grad_enabled or need_grad):
        if compute_forces and not positions.requires_grad:
            positions = positions.detach().requires_grad_(True)
        strained_pos, strained_cell, displacement = positions, cell, None
        if compute_stress:
            strained_pos, strained_cell, displacement = prepare_strain(positions, cell, batch_idx)
        energy = energy_fn(strained_pos, strained_cell).reshape(num_graphs, 1)
        out = {"energy": energy}
        if compute_forces and compute_stress:
            out["forces"], out["stress"] = autograd_forces_and_stresses(
                energy, positions, displacement, cell, num_graphs, training=training
            )
        elif compute_forces:
            out["forces"] = autograd_forces(energy, positions, training=training)
        elif compute_stress:
            out["stress"] = autograd_stresses(
                energy, displacement, cell, num_graphs, training=training
            )
    if not grad_enabled:
        out = {k: v.detach() for k, v in out.items()}
    return out


def _functional_derivatives(
    energy_fn: EnergyFn,
    positions: torch.Tensor,
    cell: torch.Tensor | None,
    batch_idx: torch.Tensor,
    num_graphs: int,
    compute_forces: bool,
    compute_stress: bool,
) -> dict[str, torch.Tensor]:
    """:func:`energy_and_derivatives` with ``torch.func.grad`` (the path under ``torch.compile``).

    The same strain and sign conventions; the derivatives stay differentiable with
    respect to the model's parameters (what ``create_graph=True`` gives in eager mode).
    """
    positions = positions.detach()
    displacement = positions.new_zeros(num_graphs, 3, 3)

    def total(pos: torch.Tensor, disp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        strained_pos, strained_cell = pos, cell
        if compute_stress:
            symmetric = 0.5 * (disp + disp.transpose(-1, -2))
            strained_pos = pos + torch.einsum(
                "vi,vij->vj", pos, symmetric.index_select(0, batch_idx)
            )
            strained_cell = cell.to(pos.dtype) + torch.bmm(cell.to(pos.dtype), symmetric)
        energy = energy_fn(strained_pos, strained_cell).reshape(num_graphs, 1)
        return energy.sum(), energy

    (grad_pos, grad_disp), energy = torch.func.grad(total, argnums=(0, 1), has_aux=True)(
        positions, displacement
    )
    out = {"energy": energy}
    if compute_forces:
        out["forces"] = -grad_pos
    if compute_stress:
        out["stress"] = _stress_from_grad(grad_disp, cell)
    return out


def sum_outputs(
    *outputs: Mapping[str, torch.Tensor | None],
    additive_keys: Iterable[str] | None = None,
) -> dict[str, torch.Tensor | None]:
    """Combine model outputs: ``additive_keys`` (default energy, forces, stress) are
    summed, ``None`` values are skipped, any other key takes the last value given."""
    additive = {"energy", "forces", "stress"} if additive_keys is None else set(additive_keys)
    out: dict[str, torch.Tensor | None] = {}
    for output in outputs:
        for key, value in output.items():
            if value is None:
                out.setdefault(key, None)
            elif key in additive and out.get(key) is not None:
                out[key] = out[key] + value
            else:
                out[key] = value
    return out


def cell_cache_needs_update(
    cell: torch.Tensor | None,
    cached_cell: torch.Tensor | None,
    rtol: float = 1e-5,
    atol: float | None = None,
) -> bool:
    """Whether a cache keyed on ``cached_cell`` is stale for ``cell`` (syncs; not for hot loops)."""
    if cell is None or cached_cell is None:
        return True
    if (
        cell.shape != cached_cell.shape
        or cell.device != cached_cell.device
        or cell.dtype != cached_cell.dtype
    ):
        return True
    if atol is None:
        eps = torch.finfo(cell.dtype).eps if cell.dtype.is_floating_point else 0.0
        atol = max(1e-6, eps)
    return not torch.allclose(cell, cached_cell, rtol=rtol, atol=atol)
