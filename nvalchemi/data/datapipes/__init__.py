"""Readers, datasets, samplers and the batch DataLoader."""

from nvalchemi._lazy import lazy_exports

_EXPORTS = {
    "Reader": ".reader",
    "ReaderProtocol": ".reader",
    "AtomicDataZarrReader": "nvalchemi.data.io.zarr",
    "AtomicDataZarrWriter": "nvalchemi.data.io.zarr",
    "ZarrArrayConfig": "nvalchemi.data.io.zarr",
    "ZarrWriteConfig": "nvalchemi.data.io.zarr",
    "ASEReader": "nvalchemi.data.io.ase",
    "BatchDatasetProtocol": ".dataset",
    "Dataset": ".dataset",
    "InMemoryDataset": ".dataset",
    "MultiDataset": ".multidataset",
    "DistributedSamplerProtocol": ".samplers",
    "MultiDatasetSampler": ".samplers",
    "MultiDatasetBatchSampler": ".samplers",
    "DataLoader": ".dataloader",
    "ShuffleSampler": ".samplers",
    "GroupBalancedSampler": ".samplers",
    "SizeBalancedBatchSampler": ".balanced",
    "BudgetBatchSampler": ".budget",
    "count_atoms": ".budget",
    "count_edges": ".budget",
    "EpochPolicy": ".samplers",
    "epoch_generator": ".samplers",
    "DATASET_INDEX_METADATA_KEY": ".multidataset",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
