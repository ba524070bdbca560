"""``spec run`` under launchers: DDP is on by default for torchrun and Slurm ``srun``."""

from __future__ import annotations

from pathlib import Path

import pytest
from _ranks import free_port, run_ranks

from nvalchemi._errors import FieldError
from nvalchemi.app.jobs.run import distributed_enabled
from nvalchemi.training.checkpoint import read_strategy_metadata

from ._support import tiny_job, write_job

RANK_SCRIPT = Path(__file__).with_name("_cli_rank.py")


def test_distributed_defaults_to_the_launchers_world_size():
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}
    assert distributed_enabled(None, slurm)
    assert distributed_enabled(None, {"RANK": "0", "WORLD_SIZE": "4"})
    assert not distributed_enabled(None, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert not distributed_enabled(None, {})
    assert not distributed_enabled(False, slurm)  # --no-distributed wins
    assert distributed_enabled(True, {})  # --distributed forces it
    with pytest.raises(FieldError, match="NVALCHEMI_DIST_METHOD=single"):
        distributed_enabled(None, {"RANK": "3", "WORLD_SIZE": "2"})


@pytest.mark.distributed
def test_spec_run_under_srun_trains_with_ddp(tmp_path):
    job = tiny_job(tmp_path, num_steps=2, structures=16)
    path = write_job(tmp_path / "job.json", job)
    port = str(free_port())

    def slurm(rank: int) -> dict[str, str]:  # what srun --ntasks 2 exports (no WORLD_SIZE)
        return {
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }

    args = ["spec", "run", path, "--no-report", "--ddp-backend", "gloo"]
    results = run_ranks(RANK_SCRIPT, 2, args=args, env=slurm, rendezvous="none", timeout=240)
    assert [r["code"] for r in results] == [0, 0]
    assert [r["group"] for r in results] == [2, 2]  # one DDP group, not two lone runs
    meta = read_strategy_metadata(tmp_path / "run" / "checkpoints")
    assert meta["world_size"] == 2
    state = meta["runtime_state"]
    assert state["step_count"] == 2
    assert state["global_step_count"] == 4  # two ranks shared each step
