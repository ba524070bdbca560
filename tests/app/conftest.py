"""Fixtures of the CLI tests: one torch thread, and a tiny trained run shared by several tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ._support import invoke, tiny_job, write_job


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> dict[str, Any]:
    """A tiny training run (4 steps, a checkpoint every 2) shared by several tests."""
    tmp = tmp_path_factory.mktemp("trained")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job = tiny_job(tmp, num_steps=4, checkpoint_every=2)
        path = write_job(tmp / "job.json", job)
        result = invoke("spec", "run", path, "--no-report")
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    return {
        "job": job,
        "job_path": path,
        "run_dir": tmp / "run",
        "checkpoints": tmp / "run" / "checkpoints",
        "output": result.output,
    }
