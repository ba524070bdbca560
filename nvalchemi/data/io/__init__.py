"""File formats: ASE-readable files (extxyz, ASE databases) and the chunked zarr store."""
