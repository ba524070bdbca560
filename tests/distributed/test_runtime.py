"""Rank helpers: duck-typed managers, environment fallbacks, and real 2-rank gloo collectives."""

from __future__ import annotations

import _spawn as spawn
import pytest
import torch
from _ranks import free_port

import nvalchemi.distributed as nd
from nvalchemi.distributed import DistributedManager
from nvalchemi.distributed import runtime as rt

pytestmark = pytest.mark.usefixtures("clean_launch_env")

NINE = (
    "all_reduce",
    "barrier",
    "destroy_distributed",
    "distributed_device",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed_initialized",
)


class AttrManager:
    """A manager exposing plain attributes (like PhysicsNeMo's)."""

    rank = 3
    world_size = 4
    local_rank = 1
    device = "cpu"
    initialized = True


class MethodManager:
    """A manager exposing zero-argument methods, and one method that needs arguments."""

    def global_rank(self, group):  # needs an argument: skipped, next name tried
        raise AssertionError("must not be called with arguments")

    def get_rank(self):
        return 2

    def get_world_size(self):
        return 8

    def get_local_rank(self):
        return 0

    def get_device(self):
        return torch.device("meta")

    def is_distributed_initialized(self):
        return False


# ----------------------------------------------------------------------------- queries
def test_documented_helpers_are_reexported():
    import nvalchemi.training.distributed as td

    assert sorted(td.__all__) == sorted(NINE)
    for name in NINE:
        assert getattr(td, name) is getattr(rt, name)
        assert getattr(nd, name) is getattr(rt, name)
    assert nd.resolve_world_size is rt.resolve_world_size


def test_helpers_read_manager_attributes():
    manager = AttrManager()
    assert rt.get_rank(manager) == 3
    assert rt.get_world_size(manager) == 4
    assert rt.get_local_rank(manager) == 1
    assert rt.distributed_device(manager) == torch.device("cpu")
    assert rt.is_distributed_initialized(manager) is True


def test_helpers_call_zero_argument_methods_and_skip_others():
    manager = MethodManager()
    assert rt.get_rank(manager) == 2
    assert rt.get_world_size(manager) == 8
    assert rt.get_local_rank(manager) == 0
    assert rt.distributed_device(manager) == torch.device("meta")
    assert rt.is_distributed_initialized(manager) is False


def test_without_manager_helpers_fall_back_to_torchrun_variables(monkeypatch):
    assert (rt.get_rank(), rt.get_world_size(), rt.get_local_rank()) == (0, 1, 0)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (rt.get_rank(), rt.get_world_size(), rt.get_local_rank()) == (5, 6, 1)
    assert rt.get_rank(object()) == 5  # a manager without the attribute


def test_without_manager_helpers_fall_back_to_slurm_variables(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert (rt.get_rank(), rt.get_world_size(), rt.get_local_rank()) == (3, 4, 1)


def test_malformed_environment_reads_as_one_process(monkeypatch):
    monkeypatch.setenv("RANK", "not-a-number")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (rt.get_rank(), rt.get_world_size()) == (0, 1)


def test_distributed_device_fallbacks():
    assert rt.distributed_device(None, "cpu", prefer_cuda=False) == torch.device("cpu")
    assert rt.distributed_device(None, "meta", prefer_cuda=False) == torch.device("meta")
    if not torch.cuda.is_available():
        assert rt.distributed_device() == torch.device("cpu")


def test_resolvers_and_collective_device_in_one_process():
    assert rt.resolve_global_rank(7) == 7
    assert rt.resolve_global_rank() == 0
    assert rt.resolve_world_size() == 1
    DistributedManager.setup(rank=0, world_size=1)
    assert rt.resolve_world_size() == 1
    DistributedManager.cleanup()
    assert rt.collective_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert rt.collective_device("cuda") == torch.device("cpu")


def test_is_distributed_initialized_uses_the_real_manager():
    manager = DistributedManager()
    assert rt.is_distributed_initialized(manager) is False
    DistributedManager.initialize()
    assert rt.is_distributed_initialized(manager) is True
    assert rt.is_distributed_initialized() is False  # no process group in one process


# ----------------------------------------------------------------------------- lifecycle
def test_init_distributed_is_a_no_op_for_one_process():
    assert rt.init_distributed() is False
    assert not torch.distributed.is_initialized()
    assert rt.destroy_distributed() is False


def test_init_distributed_calls_the_manager_with_accepted_arguments():
    calls = []

    class Initializable:
        initialized = False

        def initialize(self, backend=None):
            calls.append(backend)
            self.initialized = True

    class SetupOnly:
        initialized = False

        def setup(self):
            calls.append("setup")
            self.initialized = True

    assert rt.init_distributed(Initializable(), backend="gloo", timeout_s=5) is True
    assert rt.init_distributed(SetupOnly(), backend="gloo") is True
    assert calls == ["gloo", "setup"]
    already = Initializable()
    already.initialized = True
    assert rt.init_distributed(already) is False
    assert calls == ["gloo", "setup"]


def test_init_distributed_with_a_manager_lacking_init_methods_raises():
    class Empty:
        initialized = False

    with pytest.raises(TypeError, match="initialize"):
        rt.init_distributed(Empty())


def test_init_distributed_with_the_real_manager_in_one_process():
    manager = DistributedManager()
    assert rt.init_distributed(manager, backend="gloo") is True  # the manager is now set up
    assert DistributedManager.is_initialized()
    assert rt.destroy_distributed(manager) is True
    assert not DistributedManager.is_initialized()


def test_destroy_distributed_calls_the_manager():
    class Destroyable:
        initialized = True

        def cleanup(self):
            self.initialized = False

    manager = Destroyable()
    assert rt.destroy_distributed(manager) is True
    assert manager.initialized is False


# ----------------------------------------------------------------------------- collectives
def test_collectives_are_no_ops_in_one_process():
    tensor = torch.tensor([1.0, 2.0])
    assert rt.all_reduce(tensor) is tensor
    assert tensor.tolist() == [1.0, 2.0]
    rt.barrier()
    payload = {"a": [1]}
    assert rt.broadcast_object(payload) is payload
    assert rt.all_agree(True) is True and rt.all_agree(False) is False
    assert rt.all_agree(torch.tensor([False, True])) is True
    assert rt.all_agree(torch.tensor(False), require="all") is False


def test_all_agree_rejects_unknown_requirement():
    with pytest.raises(ValueError, match="'any' or 'all'"):
        rt.all_agree(True, require="most")


def test_collectives_delegate_to_manager_methods():
    seen = []

    class Communicating:
        def barrier(self):
            seen.append("barrier")

        def all_reduce(self, tensor, op):
            seen.append(op)
            return tensor * 2

    manager = Communicating()
    rt.barrier(manager)
    result = rt.all_reduce(torch.ones(2), manager)
    assert result.tolist() == [2.0, 2.0]
    assert seen == ["barrier", torch.distributed.ReduceOp.SUM]


# ----------------------------------------------------------------------------- two processes
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_from_torchrun_variables():
    results = spawn.run("collectives", rendezvous="tcp")  # RANK, WORLD_SIZE, MASTER_* ...
    for rank, r in enumerate(results):
        assert (r["rank"], r["world_size"], r["local_rank"]) == (rank, 2, rank)
        assert r["distributed"] is True and r["backend"] == "gloo" and r["has_group"] is True
        assert r["device"] == "cpu" and r["collective_device"] == "cpu"
        assert (r["helper_rank"], r["helper_world"]) == (rank, 2)
        assert (r["resolved_rank"], r["resolved_world"]) == (rank, 2)
        assert r["summed"] == [3.0, 20.0]  # (0 + 1) + (1 + 1), 10 + 10
        assert r["maxed"] == [1]
        assert r["broadcast"] == {"from": 0, "items": [1, 2]}
        assert r["broadcast_from_one"] == "rank1"
        # rank 1 votes True, rank 0 False: "any" agrees on True, "all" on False
        assert (r["any_one"], r["all_one"]) == (True, False)
        assert (r["all_true"], r["none_true"]) == (True, False)
        assert (r["tensor_any"], r["tensor_all"]) == (True, False)
        assert r["initialized_before_cleanup"] is True
        assert r["dist_after_cleanup"] is False


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_from_slurm_variables_with_auto_init():
    port = str(free_port())
    results = spawn.run(
        "slurm_auto_init",
        rendezvous="none",
        env=lambda rank: {
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank),
            "SLURM_JOB_NODELIST": "localhost,node[02-03]",
            "SLURM_JOB_ID": "4242",
            "MASTER_PORT": port,
        },
    )
    for rank, r in enumerate(results):
        assert (r["rank"], r["world_size"], r["local_rank"]) == (rank, 2, rank)
        assert (r["helper_rank"], r["helper_local_rank"]) == (rank, rank)
        assert r["master_addr"] == "localhost"  # first host of the node list
        assert r["created"] is True and r["created_again"] is False
        assert r["value"] == 3.0
        assert r["destroyed"] is True
        assert r["manager_initialized"] is False and r["dist_after"] is False
