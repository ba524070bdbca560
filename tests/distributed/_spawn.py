"""Child side of the multi-process tests of ``nvalchemi.distributed``.

Each scenario below runs in every rank (``python _spawn.py <scenario>``) and prints
one ``RESULT {json}`` line; :func:`run` starts them through :func:`_ranks.run_ranks`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from _ranks import report as _report
from _ranks import run_ranks


def run(scenario: str, **kwargs: object) -> list[dict]:
    """``run_ranks`` on this file's ``scenario`` (keyword arguments as for ``run_ranks``)."""
    return run_ranks(Path(__file__), args=[scenario], **kwargs)


# --------------------------------------------------------------------------- child side
def scenario_collectives() -> None:
    """initialize() from the environment, then every collective helper."""
    import torch

    from nvalchemi.distributed import DistributedManager
    from nvalchemi.distributed import runtime as rt

    DistributedManager.initialize()
    manager = DistributedManager()
    rank = manager.rank
    summed = rt.all_reduce(torch.tensor([float(rank + 1), 10.0]), manager)
    maxed = rt.all_reduce(torch.tensor([rank]), op=torch.distributed.ReduceOp.MAX)
    rt.barrier(manager)
    obj = rt.broadcast_object({"from": rank, "items": [1, 2]} if rank == 0 else None)
    from_one = rt.broadcast_object(f"rank{rank}", src=1, manager=manager)
    values = dict(
        rank=rank,
        world_size=manager.world_size,
        local_rank=manager.local_rank,
        distributed=manager.distributed,
        backend=manager.backend,
        device=str(manager.device),
        has_group=manager.process_group is not None,
        helper_rank=rt.get_rank(),
        helper_world=rt.get_world_size(),
        resolved_rank=rt.resolve_global_rank(),
        resolved_world=rt.resolve_world_size(),
        collective_device=str(rt.collective_device("cuda")),
        summed=summed.tolist(),
        maxed=maxed.tolist(),
        broadcast=obj,
        broadcast_from_one=from_one,
        any_one=rt.all_agree(rank == 1),
        all_one=rt.all_agree(rank == 1, require="all"),
        all_true=rt.all_agree(True, manager, require="all"),
        none_true=rt.all_agree(False),
        tensor_any=rt.all_agree(torch.tensor([False, rank == 0])),
        tensor_all=rt.all_agree(torch.tensor(rank == 0), require="all"),
        initialized_before_cleanup=rt.is_distributed_initialized(manager),
    )
    DistributedManager.cleanup(barrier=True)
    _report(**values, dist_after_cleanup=torch.distributed.is_initialized())


def scenario_setup_explicit() -> None:
    """DistributedManager.setup() with explicit arguments, a named group, cleanup."""
    import torch

    from nvalchemi.distributed import DistributedManager

    rank = int(os.environ["TEST_RANK"])
    DistributedManager.setup(
        rank=rank, world_size=2, addr="127.0.0.1", port=os.environ["TEST_PORT"], timeout_s=30
    )
    manager = DistributedManager()
    pair = manager.create_group("pair", ranks=[0, 1])
    value = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(value, group=pair)
    same_object = manager.group("pair") is pair
    DistributedManager.setup(rank=rank, world_size=2)  # same rank/world: no-op
    DistributedManager.cleanup(barrier=True)
    _report(
        rank=rank,
        pair_sum=value.item(),
        same_object=same_object,
        initialized_after=DistributedManager.is_initialized(),
        dist_after=torch.distributed.is_initialized(),
        world_after=DistributedManager().world_size,
    )


def scenario_slurm_auto_init() -> None:
    """Slurm variables only: init_distributed() without a manager, then destroy_distributed()."""
    import torch

    from nvalchemi.distributed import DistributedManager
    from nvalchemi.training import distributed as td

    created = td.init_distributed(backend="gloo", timeout_s=30)
    created_again = td.init_distributed()
    manager = DistributedManager()
    value = td.all_reduce(torch.tensor([manager.rank + 1.0]))
    values = dict(
        rank=manager.rank,
        world_size=manager.world_size,
        local_rank=manager.local_rank,
        helper_rank=td.get_rank(),
        helper_local_rank=td.get_local_rank(manager),
        master_addr=os.environ["MASTER_ADDR"],
        created=created,
        created_again=created_again,
        value=value.item(),
    )
    td.barrier()
    destroyed = td.destroy_distributed()
    _report(
        **values,
        destroyed=destroyed,
        manager_initialized=DistributedManager.is_initialized(),
        dist_after=torch.distributed.is_initialized(),
    )


def scenario_peer_failure() -> None:
    """Rank 1 leaves (exits or stalls); rank 0's collective must raise, not hang."""
    import torch

    from nvalchemi.distributed import DistributedManager
    from nvalchemi.distributed import runtime as rt

    DistributedManager.initialize()
    rank = DistributedManager().rank
    rt.barrier()
    if rank == 1:
        if os.environ["TEST_PEER_MODE"] == "exit":
            _report(rank=1, left=True)
            os._exit(0)  # die without saying goodbye
        time.sleep(600)  # alive but silent; the parent kills it once rank 0 is done
    start = time.monotonic()
    try:
        rt.all_reduce(torch.ones(1))
        outcome, message = "returned", ""
    except Exception as exc:
        outcome, message = "raised", f"{type(exc).__name__}: {exc}"[:300]
    _report(rank=0, outcome=outcome, message=message, waited_s=time.monotonic() - start)
    os._exit(0)  # skip atexit teardown of the broken group


SCENARIOS = {
    "collectives": scenario_collectives,
    "setup_explicit": scenario_setup_explicit,
    "slurm_auto_init": scenario_slurm_auto_init,
    "peer_failure": scenario_peer_failure,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
