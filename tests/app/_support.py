"""Helpers for the CLI tests: run commands in-process or in a subprocess, scaffold tiny jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from nvalchemi.data.bundled import BUNDLED_DIR
from nvalchemi.training.cli import main

TRAIN = BUNDLED_DIR / "train.extxyz"
VAL = BUNDLED_DIR / "val.extxyz"
TEST = BUNDLED_DIR / "test.extxyz"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY_PAINN = {"cutoff": 4.0, "hidden_channels": 8, "num_interactions": 1, "num_rbf": 4}


def invoke(*args: Any) -> Any:
    """Run ``nvalchemi-training ARGS`` in this process (stdout and stderr kept apart)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def run_cli(
    *args: Any, cwd: Path | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """Run ``python -m nvalchemi.training.cli ARGS`` in a subprocess (one thread)."""
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    env.pop("NVALCHEMI_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "nvalchemi.training.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
        check=False,
    )


def assert_user_error(result: Any, *fragments: str, fix: str = "") -> None:
    """Exit status 1, a one-paragraph message containing ``fragments``, no traceback.

    The message must also give a fix (``Fix: ...``) containing ``fix``.
    """
    subprocess_result = hasattr(result, "returncode")
    code = result.returncode if subprocess_result else result.exit_code
    text = result.stderr
    assert code == 1, text
    assert "Traceback" not in text, text
    start = 0 if text.startswith("Error: ") else text.find("\nError: ") + 1
    assert start > 0 or text.startswith("Error: "), text
    message = text[start:].strip()
    assert "\n" not in message, text  # one paragraph, and it comes last
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    assert "Fix: " in message, f"no fix given: {message}"
    assert fix in message.split("Fix: ", 1)[1], (fix, message)
    assert "errors.pydantic.dev" not in message and "[type=" not in message, message
    if not subprocess_result:
        assert result.exception is None or isinstance(result.exception, SystemExit), text


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_SIGNATURE


def write_job(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data, indent=2))
    return path


def tiny_job(
    tmp_path: Path,
    *init_args: Any,
    name: str = "job.json",
    num_steps: int = 3,
    structures: int = 16,
    checkpoint_every: int | None = None,
) -> dict[str, Any]:
    """A ``train init`` job shrunk to seconds: tiny PaiNN, a few structures and steps."""
    out = tmp_path / name
    args = [
        "train",
        "init",
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path / "run",
        "--num-steps",
        num_steps,
        "--batch-size",
        4,
        "--device",
        "cpu",
        "--out",
        out,
    ]
    if not any(str(a).startswith("--val") for a in init_args):
        args += ["--val-fraction", 0.25]
    if not any(str(a) in ("--stress", "--no-stress") for a in init_args):
        args.append("--no-stress")  # the bundled data has stress: keep the tiny runs small
    result = invoke(*args, *init_args)
    assert result.exit_code == 0, result.output
    job = json.loads(out.read_text())
    if job["strategy"]["model_specs"]:
        job["strategy"]["model_specs"]["main"].update(TINY_PAINN)
    job["dataset"].update({"max_structures": structures, "in_memory": True})
    job["output"].update({"tensorboard": False, "log_every_n_steps": 1})
    if checkpoint_every is not None:
        hook = job["source"]["hooks"][0]["spec"]
        hook.pop("epoch_interval", None)
        hook.update({"step_interval": checkpoint_every, "keep_last": None})
    return job
