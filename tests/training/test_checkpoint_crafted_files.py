"""A checkpoint whose files are FIFOs, devices or huge is refused at once, never read.

A FIFO named ``spec.json`` blocked every loader forever and ``/dev/zero`` (through a
link) was read until memory ran out. The loads run in a subprocess with a memory cap and
a timeout, so a regression fails the test instead of the machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import _checkpoint_support as C

from nvalchemi.training.checkpoint import save_checkpoint

LOADS = """
import json, resource, sys
from nvalchemi.checkpoint_files import load_model_from_checkpoint
from nvalchemi.training.checkpoint import load_checkpoint

with open("/proc/self/status") as status:  # cap the address space a little above today's
    size = next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
for root in sys.argv[1:]:
    for load in (load_model_from_checkpoint, load_checkpoint):
        try:
            load(root, map_location="cpu")
            outcome = "loaded"
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        print(json.dumps([root, load.__name__, outcome]), flush=True)
"""

CASES = {
    "spec-fifo": ("models/main/spec.json", "fifo", "it is a FIFO"),
    "spec-dev-zero": ("models/main/spec.json", "/dev/zero", "it is a character device"),
    "spec-huge": ("models/main/spec.json", "huge", r"holds 67108865 bytes, more than"),
    "weights-fifo": ("models/main/weights.pt", "fifo", "it is a FIFO"),
    "weights-dev-zero": ("models/main/weights.pt", "/dev/zero", "it is a character device"),
    "strategy-fifo": ("strategy.json", "fifo", "it is a FIFO"),
}


def _craft(root: Path, relative: str, kind: str) -> None:
    target = root / "checkpoints" / "0" / relative
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "huge":
        with open(target, "wb") as handle:
            handle.truncate((64 << 20) + 1)  # sparse: no disk used
    else:
        target.symlink_to(kind)


def test_fifos_devices_and_huge_files_in_a_checkpoint_are_refused_naming_the_file(tmp_path):
    saved = tmp_path / "saved"
    C.strategy(num_steps=1).save_checkpoint(saved)
    roots = {}
    for name, (relative, kind, _) in CASES.items():
        roots[name] = tmp_path / name
        shutil.copytree(saved, roots[name])
        _craft(roots[name], relative, kind)
    result = subprocess.run(
        [sys.executable, "-c", LOADS, *map(str, roots.values())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    outcomes = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(outcomes) == 2 * len(CASES), result.stderr[-2000:]
    by_root = {str(path): name for name, path in roots.items()}
    for root, load, outcome in outcomes:
        relative, _, why = CASES[by_root[root]]
        if relative == "strategy.json" and load == "load_model_from_checkpoint":
            assert outcome == "loaded"  # models need no strategy recipe
            continue
        assert outcome.startswith("ValueError: Refusing to read"), (root, load, outcome)
        assert relative in outcome and re.search(why, outcome), (root, load, outcome)


def test_a_regular_checkpoint_still_loads_through_the_safe_reads(tmp_path):
    root = tmp_path / "ckpt"
    models, _, _ = C.linear_components()
    save_checkpoint(root, models)
    from nvalchemi.checkpoint_files import load_model_from_checkpoint

    model = load_model_from_checkpoint(root, map_location="cpu")
    assert model.weight.shape == (2, 3)
