"""examples/finetune_from_checkpoint.py runs end to end with small settings."""

from __future__ import annotations

import json
from pathlib import Path

from _ranks import run_python

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_from_checkpoint.py"


def test_finetune_example_trains_only_the_readout(tmp_path):
    args = {
        "--pretrain-steps": 6,
        "--finetune-steps": 4,
        "--pretrain-size": 24,
        "--finetune-size": 12,
        "--val-size": 6,
        "--batch-size": 4,
        "--hidden": 8,
        "--interactions": 1,
        "--out": tmp_path,
    }
    result = run_python([EXAMPLE, *(x for kv in args.items() for x in kv)])  # must exit 0
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["pretrain_steps"] == 6 and summary["finetune_steps"] == 4
    assert summary["readout_changed"] and summary["body_unchanged"]
    assert (tmp_path / "pretrain_checkpoints" / "manifest.json").is_file()
