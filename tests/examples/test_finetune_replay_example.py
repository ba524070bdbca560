"""examples/finetune_with_replay.py runs end to end with small settings."""

from __future__ import annotations

import json
from pathlib import Path

from _ranks import run_python

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_with_replay.py"


def test_replay_example_reports_forgetting_of_both_fine_tunes(tmp_path):
    args = {
        "--pretrain-steps": 8,
        "--finetune-steps": 6,
        "--pretrain-size": 24,
        "--finetune-size": 16,
        "--replay-size": 8,
        "--holdout-size": 8,
        "--batch-size": 4,
        "--hidden": 8,
        "--interactions": 1,
        "--out": tmp_path,
    }
    result = run_python([EXAMPLE, *(x for kv in args.items() for x in kv)])  # must exit 0
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    plain, replay = summary["no_replay"], summary["replay"]
    assert plain["steps"] == replay["steps"] == 6
    # Both start from the same source, measured on the same held-out structures.
    assert plain["forgetting_before"] == replay["forgetting_before"]
    assert plain["forgetting_after"] != replay["forgetting_after"]
    # The new elements had no reference energies: e0="estimated" fitted them first, and
    # that changes energies only, never forces (zero-step parity of the forces).
    assert plain["new_elements"] == ["Al", "Ag", "Au"]
    assert plain["zero_step_force_difference"] == 0.0
    assert (tmp_path / "pretrain_checkpoints" / "manifest.json").is_file()
