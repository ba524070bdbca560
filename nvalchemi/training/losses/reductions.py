"""Per-graph reductions over concatenated (dense) batches, without Python loops."""

from __future__ import annotations

import torch

__all__ = ["frobenius_mse", "per_graph_mean", "per_graph_sum"]


def _index(values: torch.Tensor, batch_idx: torch.Tensor, num_graphs: int | None) -> tuple:
    if batch_idx.ndim != 1:
        raise ValueError(f"batch_idx must be 1-D, got shape {tuple(batch_idx.shape)}")
    if values.shape[0] != batch_idx.shape[0]:
        raise ValueError(
            f"values leading dim ({values.shape[0]}) must match batch_idx length "
            f"({batch_idx.shape[0]})"
        )
    batch_idx = batch_idx.to(device=values.device, dtype=torch.long)
    if num_graphs is None:
        if batch_idx.numel() == 0:
            raise ValueError("num_graphs must be given when batch_idx is empty")
        num_graphs = int(batch_idx.max()) + 1  # host sync: pass num_graphs on hot paths
    elif num_graphs <= 0:
        raise ValueError(f"num_graphs must be positive, got {num_graphs}")
    return batch_idx, num_graphs


def per_graph_sum(
    values: torch.Tensor, batch_idx: torch.Tensor, num_graphs: int | None = None
) -> torch.Tensor:
    """Sum node values per graph: ``(V, *rest) -> (num_graphs, *rest)``.

    >>> per_graph_sum(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]), 2)
    tensor([3., 3.])
    """
    batch_idx, num_graphs = _index(values, batch_idx, num_graphs)
    out = values.new_zeros((num_graphs, *values.shape[1:]))
    return out.index_add_(0, batch_idx, values)


def per_graph_mean(
    values: torch.Tensor, batch_idx: torch.Tensor, num_graphs: int | None = None
) -> torch.Tensor:
    """Mean of node values per graph (empty graphs give 0)."""
    batch_idx, num_graphs = _index(values, batch_idx, num_graphs)
    sums = values.new_zeros((num_graphs, *values.shape[1:])).index_add_(0, batch_idx, values)
    counts = torch.bincount(batch_idx, minlength=num_graphs).clamp_min(1).to(values.dtype)
    return sums / counts.reshape(-1, *([1] * (values.ndim - 1)))


def frobenius_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared difference over the last two dims: ``(..., n, m) -> (...)``."""
    if pred.shape != target.shape:
        raise ValueError(
            f"frobenius_mse: shapes must match, got {tuple(pred.shape)} and {tuple(target.shape)}"
        )
    if pred.ndim < 3:
        raise ValueError(f"frobenius_mse expects (B, n, m) tensors, got ndim={pred.ndim}")
    return ((pred - target) ** 2).mean(dim=(-2, -1))
