"""Process-group management on ``torch.distributed`` and rank helpers."""

from nvalchemi._lazy import lazy_exports

_EXPORTS = {
    "DistributedManager": ".manager",
    "resolve_world_size": ".runtime",
    "resolve_global_rank": ".runtime",
    "collective_device": ".runtime",
    "is_distributed_initialized": ".runtime",
    "get_rank": ".runtime",
    "get_world_size": ".runtime",
    "get_local_rank": ".runtime",
    "distributed_device": ".runtime",
    "init_distributed": ".runtime",
    "destroy_distributed": ".runtime",
    "barrier": ".runtime",
    "all_reduce": ".runtime",
    "all_agree": ".runtime",
    "broadcast_object": ".runtime",
    "explain_collective_failure": ".runtime",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
