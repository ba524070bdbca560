"""Rank helpers for training code (documented import path; defined in ``nvalchemi.distributed``)."""

from nvalchemi.distributed.runtime import (
    all_reduce,
    barrier,
    destroy_distributed,
    distributed_device,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed_initialized,
)

__all__ = [
    "all_reduce",
    "barrier",
    "destroy_distributed",
    "distributed_device",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed_initialized",
]
