"""One-shot neighbour lists for a batch (documented import path ``nvalchemi.neighbors``)."""

from nvalchemi.data.neighbors import (
    NeighborListTransform,
    compute_neighbors,
    edge_vectors,
    neighbor_list_for_system,
)

__all__ = ["NeighborListTransform", "compute_neighbors", "edge_vectors", "neighbor_list_for_system"]
