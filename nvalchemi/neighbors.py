"""One-shot neighbour lists for a batch (documented import path ``nvalchemi.neighbors``)."""

from nvalchemi.data.neighbors import compute_neighbors

__all__ = ["compute_neighbors"]
