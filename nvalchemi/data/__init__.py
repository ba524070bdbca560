"""Atomic structures, batches, neighbour lists, readers and data pipelines."""

from nvalchemi._lazy import lazy_exports

_EXPORTS = {
    "AtomicData": ".atomic_data",
    "AtomicNumberTable": ".atomic_data",
    "Batch": ".batch",
    "iter_batches": ".batch",
    "FieldSpec": ".fields",
    "FIELDS": ".fields",
    "Reader": ".datapipes.reader",
    "AtomicDataZarrReader": ".io.zarr",
    "AtomicDataZarrWriter": ".io.zarr",
    "ASEReader": ".io.ase",
    "BatchDatasetProtocol": ".datapipes.dataset",
    "Dataset": ".datapipes.dataset",
    "InMemoryDataset": ".datapipes.dataset",
    "MultiDataset": ".datapipes.multidataset",
    "DataLoader": ".datapipes.dataloader",
    "Compose": ".transforms",
    "compute_neighbors": ".neighbors",
    "edge_vectors": ".neighbors",
    "neighbor_list_for_system": ".neighbors",
    "NeighborListTransform": ".neighbors",
    "write_extxyz": ".io.ase",
    "BUNDLED_DIR": ".bundled",
    "bundled_split_path": ".bundled",
    "load_bundled_atoms": ".bundled",
    "bundled_summary": ".bundled",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
