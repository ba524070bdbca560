"""The examples run end to end with tiny settings (each in a subprocess).

``examples/finetune_from_checkpoint.py`` has its own test (``test_finetune_example.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from _ranks import run_python

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_train_painn_bundled_example(tmp_path):
    out = tmp_path / "run"
    result = run_python(
        [
            str(EXAMPLES / "train_painn_bundled.py"),
            "--epochs",
            "2",
            "--max-train",
            "24",
            "--max-eval",
            "8",
            "--hidden",
            "8",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["epochs"] == 2 and summary["steps"] == 6
    assert summary["test_forces_mae_meV_per_A"] > 0
    assert (out / "checkpoints" / "manifest.json").is_file()
    assert (out / "learning_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "rattled Cu supercell" in result.stdout


def test_train_painn_job_file_runs_with_spec_run(tmp_path):
    job = yaml.safe_load((EXAMPLES / "jobs" / "train_painn.yaml").read_text())
    # its paths are relative to examples/jobs/; this copy lives elsewhere
    text = json.dumps(job).replace("../../nvalchemi", str(ROOT / "nvalchemi"))
    job = json.loads(text.replace("../../runs/train_painn", str(tmp_path / "run")))
    job["strategy"]["model_specs"]["main"].update({"hidden_channels": 8, "num_rbf": 4})
    job["output"]["tensorboard"] = False
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = run_python(
        [
            "-m",
            "nvalchemi.training.cli",
            "spec",
            "run",
            str(path),
            "--num-steps",
            "3",
            "--max-structures",
            "12",
        ],
        cwd=tmp_path,
    )
    assert "Training report: train-painn-bundled-emt" in result.stderr
    assert "Run summary" in result.stderr
    assert (tmp_path / "run" / "checkpoints" / "manifest.json").is_file()
    assert (tmp_path / "run" / "metrics.jsonl").stat().st_size > 0
