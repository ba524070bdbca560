"""Fixtures of the distributed tests."""

from __future__ import annotations

import pytest

from nvalchemi.distributed import DistributedManager

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NVALCHEMI_DIST_METHOD",
    "NVALCHEMI_DIST_TIMEOUT_S",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID",
    "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_ID",
)


@pytest.fixture
def clean_launch_env(monkeypatch):
    """No launcher variables in this process, and no manager state before or after."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    DistributedManager.cleanup()
    yield
    DistributedManager.cleanup()
