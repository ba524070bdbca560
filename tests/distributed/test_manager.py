"""DistributedManager and launcher detection: single process in-process, 2 gloo ranks in subprocesses."""

from __future__ import annotations

import _spawn as spawn
import pytest
import torch
from _ranks import free_port

from nvalchemi.distributed import DistributedManager
from nvalchemi.distributed.launch import detect_launch_env, expand_slurm_nodelist

pytestmark = pytest.mark.usefixtures("clean_launch_env")


# ----------------------------------------------------------------------------- launch env
def test_torchrun_variables_are_read():
    env = detect_launch_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29400",
        }
    )
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert (env.master_addr, env.master_port, env.source) == ("10.0.0.1", "29400", "torchrun")


def test_torchrun_defaults_for_address_port_and_local_rank():
    env = detect_launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert (env.master_addr, env.master_port, env.local_rank) == ("localhost", "12355", None)


def test_slurm_variables_are_read_when_torchrun_variables_are_absent():
    env = detect_launch_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu[07-08],login",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.source) == (5, 8, 1, "slurm")
    assert env.master_addr == "gpu07"
    assert env.master_port == str(15000 + 123456 % 15000)


def test_slurm_address_precedence():
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[3-4]"}
    assert detect_launch_env(base).master_addr == "node3"
    with_ip = {**base, "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}
    assert detect_launch_env(with_ip).master_addr == "10.1.2.3"
    exported = {**with_ip, "MASTER_ADDR": "head", "MASTER_PORT": "2999"}
    assert (detect_launch_env(exported).master_addr, detect_launch_env(exported).master_port) == (
        "head",
        "2999",
    )


def test_slurm_step_task_count_wins_over_the_allocation():
    env = detect_launch_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2"})
    assert env.world_size == 2


def test_torchrun_wins_over_slurm_and_nothing_means_one_process():
    both = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert detect_launch_env(both).source == "torchrun"
    single = detect_launch_env({})
    assert (single.rank, single.world_size, single.local_rank, single.source) == (
        0,
        1,
        0,
        "single",
    )


def test_method_override():
    slurm = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}
    assert detect_launch_env(slurm, method="single").world_size == 1
    assert detect_launch_env({**slurm, "NVALCHEMI_DIST_METHOD": "single"}).world_size == 1
    with pytest.raises(ValueError, match="NVALCHEMI_DIST_METHOD"):
        detect_launch_env({}, method="mpi")
    with pytest.raises(ValueError, match="srun"):
        detect_launch_env({}, method="slurm")
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE"):
        detect_launch_env({}, method="torchrun")


def test_bad_launcher_values_name_the_variable():
    with pytest.raises(ValueError, match="RANK='one'"):
        detect_launch_env({"RANK": "one", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="outside"):
        detect_launch_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=">= 1"):
        detect_launch_env({"RANK": "0", "WORLD_SIZE": "0"})


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04],other", ["node01", "node02", "node03", "node04", "other"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("gpu[001,005-006]-ib", ["gpu001-ib", "gpu005-ib", "gpu006-ib"]),
        ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
        ("x,y[1,3]", ["x", "y1", "y3"]),
    ],
)
def test_slurm_nodelist_expansion(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[01-04", "node]1[", "node[a-b]", "n[1-]"])
def test_malformed_nodelist_raises(nodelist):
    with pytest.raises(ValueError, match="Slurm node list"):
        expand_slurm_nodelist(nodelist)


# ----------------------------------------------------------------------------- single process
def test_instantiating_before_initialize_reports_one_process():
    manager = DistributedManager()
    assert not DistributedManager.is_initialized()
    assert (manager.rank, manager.world_size, manager.local_rank) == (0, 1, 0)
    assert manager.distributed is False
    assert manager.process_group is None and manager.group() is None
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert manager.device.type == expected and manager.cuda == (expected == "cuda")


def test_initialize_without_launcher_is_one_process_without_a_process_group():
    DistributedManager.initialize()
    DistributedManager.initialize()  # idempotent
    manager = DistributedManager()
    assert DistributedManager.is_initialized()
    assert (manager.rank, manager.world_size, manager.distributed) == (0, 1, False)
    assert manager.backend is None
    assert not torch.distributed.is_initialized()
    DistributedManager.cleanup(barrier=True)  # nothing to wait for or destroy
    assert not DistributedManager.is_initialized()


def test_instances_share_state_and_cleanup_resets_it():
    DistributedManager.setup(rank=0, world_size=1, local_rank=0)
    first, second = DistributedManager(), DistributedManager()
    first.find_unused_parameters = True
    first.broadcast_buffers = True
    assert second.find_unused_parameters is True and second.broadcast_buffers is True
    DistributedManager.cleanup()
    assert first.find_unused_parameters is False and second.broadcast_buffers is False


def test_setup_validates_its_arguments():
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        DistributedManager.setup(rank=2, world_size=2)
    with pytest.raises(TypeError, match="rank must be an int"):
        DistributedManager.setup(rank=True, world_size=2)
    with pytest.raises(ValueError, match="positive number of seconds"):
        DistributedManager.setup(timeout_s=0)
    assert not DistributedManager.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_nccl_on_a_cpu_machine_is_a_clear_error():
    with pytest.raises(ValueError, match="backend='gloo'"):
        DistributedManager.setup(rank=0, world_size=1, backend="nccl")
    assert DistributedManager.get_available_backend() == "gloo"


def test_timeout_from_environment_must_be_a_number(monkeypatch):
    monkeypatch.setenv("NVALCHEMI_DIST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="NVALCHEMI_DIST_TIMEOUT_S='soon'"):
        DistributedManager.initialize()


def test_setup_again_with_another_rank_needs_cleanup():
    DistributedManager.setup(rank=0, world_size=1)
    DistributedManager.setup(rank=0, world_size=1)  # same: no-op
    with pytest.raises(RuntimeError, match="cleanup"):
        DistributedManager.setup(rank=0, world_size=2)


def test_named_groups_need_a_distributed_run():
    manager = DistributedManager()
    with pytest.raises(KeyError, match="create_group"):
        manager.group("tensor-parallel")
    with pytest.raises(RuntimeError, match="initialize"):
        manager.create_group("tensor-parallel")
    assert manager.group_names == []


def test_existing_process_group_is_adopted_and_never_destroyed_by_cleanup(tmp_path):
    from nvalchemi.distributed import runtime as rt

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        manager = DistributedManager()  # adopts the user's group
        assert DistributedManager.is_initialized()
        assert (manager.rank, manager.world_size, manager.backend) == (0, 1, "gloo")
        assert manager.device == torch.device("cpu")
        DistributedManager.initialize()  # no-op: already set up
        DistributedManager.cleanup()
        assert torch.distributed.is_initialized()  # not ours to destroy
        assert rt.destroy_distributed() is True
        assert not torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_repr_shows_rank_and_device():
    text = repr(DistributedManager())
    assert "rank=0" in text and "world_size=1" in text


# ----------------------------------------------------------------------------- two processes
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_setup_with_explicit_address_creates_and_destroys_the_group():
    port = str(free_port())
    results = spawn.run(
        "setup_explicit",
        rendezvous="none",
        env=lambda rank: {"TEST_RANK": str(rank), "TEST_PORT": port},
    )
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["pair_sum"] == 3.0  # all-reduce over the named group
        assert result["same_object"] is True
        assert result["initialized_after"] is False
        assert result["dist_after"] is False  # cleanup destroyed the group it created
        assert result["world_after"] == 1


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("peer_mode", ["exit", "stall"])
def test_collective_fails_instead_of_hanging_when_a_rank_leaves(peer_mode):
    """Rank 1 exits (or stops participating) after init; rank 0's all_reduce must raise.

    The 3 s process-group timeout comes from NVALCHEMI_DIST_TIMEOUT_S; the
    subprocess deadline (240 s: generous on a loaded machine, still far below
    PyTorch's default of 10-30 min) turns a hang into a test failure.
    """
    (rank0,) = spawn.run(
        "peer_failure",
        rendezvous="tcp",
        env={"NVALCHEMI_DIST_TIMEOUT_S": "3", "TEST_PEER_MODE": peer_mode},
        timeout=240,
        wait_for=(0,),
    )
    assert rank0["outcome"] == "raised", rank0
    assert rank0["message"].startswith("RuntimeError")
