"""Measure balanced sampling and replay fine-tuning defaults through the CLI (issue 29).

Every run is what a user runs: ``train init`` / ``finetune init``, then ``spec run
--threads 1``, then ``evaluate --json`` on a test file. One JSON line per run on stdout
with the errors overall and per ``config_type`` (meV/atom, meV/Å). Give ``--steps N``
for a fixed length (arms comparable on a busy machine), else ``--minutes M``.

Subcommands::

    # an EMT set with rare slabs: 'bulk' (bulk, alloy, rattle, strain) and 7 % 'slab'
    python scripts/measure_weights.py slabs-data OUT_DIR
    # a bulk-only set (source model, replay) and a slab set (the new type)
    python scripts/measure_weights.py newtype-data OUT_DIR
    # train from scratch, optionally with dataset.balance (alpha)
    python scripts/measure_weights.py train TRAIN VAL TEST RUN_DIR --steps 1200 [--alpha A]
    # fine-tune a checkpoint on new data, optionally with replay of old data
    python scripts/measure_weights.py finetune CKPT NEW NEW_TEST OLD_TEST RUN_DIR \
        [--replay OLD] [--steps 600] [--set PATH=JSON] [-- extra finetune init options]

The numbers quoted in ``docs/weights.md`` come from these commands (see there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BULK_FAMILIES = ("bulk", "alloy", "rattle", "strain_iso")
SLAB_FAMILIES = ("surface_111", "surface_100")


def cli(*args: object, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    result = subprocess.run(
        [sys.executable, "-m", "nvalchemi.training.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if check and result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(map(str, args))}\n{result.stderr[-3000:]}")
    return result


def _draw(families: tuple[str, ...], count: int, start: int, kind: str) -> list:
    """``count`` EMT structures cycling over ``families`` (seeds from ``start``), tagged
    ``config_type=kind``."""
    from nvalchemi.data.emt_generator import make_structure

    frames = []
    for i in range(count):
        family = families[i % len(families)]
        atoms = make_structure(family, start + i // len(families))
        atoms.info = {"config_type": kind, "family": family}
        frames.append(atoms)
    return frames


def slabs_data(out: Path, bulk: int, slabs: int, test_bulk: int, test_slabs: int) -> None:
    """Train/val/test files: ``bulk`` bulk-like structures and ``slabs`` slabs (+ tests)."""
    from ase.io import write

    out.mkdir(parents=True, exist_ok=True)
    train = _draw(BULK_FAMILIES, bulk, 0, "bulk") + _draw(SLAB_FAMILIES, slabs, 0, "slab")
    val = _draw(BULK_FAMILIES, bulk // 10, 5000, "bulk") + _draw(
        SLAB_FAMILIES, slabs // 10 + 2, 5000, "slab"
    )
    test = _draw(BULK_FAMILIES, test_bulk, 9000, "bulk") + _draw(
        SLAB_FAMILIES, test_slabs, 9000, "slab"
    )
    for name, frames in (("train", train), ("val", val), ("test", test)):
        write(out / f"{name}.extxyz", frames)
        print(json.dumps({"file": str(out / f"{name}.extxyz"), "structures": len(frames)}))


def newtype_data(out: Path, bulk: int, slabs: int, test_bulk: int, test_slabs: int) -> None:
    """Files for adding a structure type: a bulk-only set (the source model's data, also
    the replay) and a slab set (the new type), each with a test file."""
    from ase.io import write

    out.mkdir(parents=True, exist_ok=True)
    files = {
        "bulk_train": _draw(BULK_FAMILIES, bulk, 0, "bulk"),
        "bulk_val": _draw(BULK_FAMILIES, bulk // 10, 5000, "bulk"),
        "bulk_test": _draw(BULK_FAMILIES, test_bulk, 9000, "bulk"),
        "slab_train": _draw(SLAB_FAMILIES, slabs, 0, "slab"),
        "slab_val": _draw(SLAB_FAMILIES, slabs // 10, 5000, "slab"),
        "slab_test": _draw(SLAB_FAMILIES, test_slabs, 9000, "slab"),
    }
    for name, frames in files.items():
        write(out / f"{name}.extxyz", frames)
        print(json.dumps({"file": str(out / f"{name}.extxyz"), "structures": len(frames)}))


def _errors(report: dict) -> dict:
    def pick(block: dict) -> dict:
        return {
            "E_meV_atom": round(1000 * block.get("energy_per_atom_mae", float("nan")), 2),
            "F_meV_A": round(1000 * block.get("forces_mae", float("nan")), 1),
            "n": block.get("num_structures", block.get("structures")),
        }

    return {
        "overall": pick(report["metrics"]),
        "groups": {name: pick(block) for name, block in report["by_group"].items()},
    }


def evaluate(checkpoints: Path, test: Path) -> dict:
    result = cli("evaluate", checkpoints, "--dataset", test, "--json", "--no-plots")
    return _errors(json.loads(result.stdout))


def _steps(run_dir: Path) -> int | None:
    from nvalchemi.hooks.reporting import read_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("kind") == "train"]
    return rows[-1].get("step") if rows else None


def _budget(args: argparse.Namespace) -> list[object]:
    """A fixed number of optimizer steps when given (comparable arms on a noisy machine),
    else the time budget."""
    if args.steps:
        return ["--num-steps", args.steps]
    return ["--minutes", args.minutes]


def train(args: argparse.Namespace) -> None:
    run = Path(args.run_dir)
    job = run.with_suffix(".json")
    cli(
        "train",
        "init",
        "--dataset",
        args.train,
        "--validation-dataset",
        args.val,
        "--output-dir",
        run,
        "--device",
        "cpu",
        *_budget(args),
        "--out",
        job,
    )
    data = json.loads(job.read_text())
    data["dataset"]["seed"] = args.seed
    if args.alpha is not None:
        data["dataset"]["balance"] = {"alpha": args.alpha}
    if args.type_weight:
        data["dataset"]["config_type_weights"] = dict(
            (k, float(v)) for k, v in (w.split("=") for w in args.type_weight)
        )
    data["output"]["tensorboard"] = False
    data["output"]["plots"] = False
    job.write_text(json.dumps(data, indent=2))
    start = time.time()
    cli("spec", "run", job, "--threads", 1, "--no-report")
    seconds = time.time() - start
    errors = evaluate(run / "checkpoints", Path(args.test))
    print(
        json.dumps(
            {
                "run": str(run),
                "alpha": args.alpha,
                "type_weights": args.type_weight,
                "seed": args.seed,
                "budget": _budget(args),
                "wall_s": round(seconds),
                "steps": _steps(run),
                **errors,
            }
        ),
        flush=True,
    )


def _set(data: dict, item: str) -> None:
    """Edit the written job: ``a.b.0.c=JSON`` sets a field, ``a.b+=JSON`` appends to a list
    (what no ``finetune init`` option writes, e.g. a warm-up scheduler or an EMA hook)."""
    path, sep, value = item.partition("=")
    append = path.endswith("+")
    keys = path.rstrip("+").split(".")
    if not sep:
        raise SystemExit(f"--set {item!r}: write PATH=JSON or PATH+=JSON")
    node: Any = data
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    last = int(keys[-1]) if isinstance(node, list) else keys[-1]
    if append:
        node.setdefault(last, []).append(json.loads(value))
    else:
        node[last] = json.loads(value)


def finetune(args: argparse.Namespace, extra: list[str]) -> None:
    run = Path(args.run_dir)
    job = run.with_suffix(".json")
    init = [
        "finetune",
        "init",
        "checkpoint",
        args.checkpoint,
        "--dataset",
        args.new,
        "--output-dir",
        run,
        "--device",
        "cpu",
        *_budget(args),
        "--out",
        job,
    ]
    for path in args.replay or ():
        init += ["--replay", path]
    cli(*init, *extra)
    data = json.loads(job.read_text())
    for item in args.set or ():
        _set(data, item)
    data["output"]["tensorboard"] = False
    data["output"]["plots"] = False
    job.write_text(json.dumps(data, indent=2))
    start = time.time()
    cli("spec", "run", job, "--threads", 1, "--no-report")
    seconds = time.time() - start
    print(
        json.dumps(
            {
                "run": str(run),
                "replay": args.replay,
                "extra": extra,
                "set": args.set,
                "budget": _budget(args),
                "wall_s": round(seconds),
                "steps": _steps(run),
                "new": evaluate(run / "checkpoints", Path(args.new_test)),
                "old": evaluate(run / "checkpoints", Path(args.old_test)),
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("slabs-data")
    p.add_argument("out", type=Path)
    p.add_argument("--bulk", type=int, default=1000)
    p.add_argument("--slabs", type=int, default=75)
    p.add_argument("--test-bulk", type=int, default=120)
    p.add_argument("--test-slabs", type=int, default=60)
    p = sub.add_parser("newtype-data")
    p.add_argument("out", type=Path)
    p.add_argument("--bulk", type=int, default=1000)
    p.add_argument("--slabs", type=int, default=180)
    p.add_argument("--test-bulk", type=int, default=120)
    p.add_argument("--test-slabs", type=int, default=60)
    p = sub.add_parser("train")
    for name in ("train", "val", "test", "run_dir"):
        p.add_argument(name)
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--steps", type=int, help="a fixed step budget instead of --minutes")
    p.add_argument("--alpha", type=float)
    p.add_argument("--type-weight", action="append", help="config_type=weight")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("finetune")
    for name in ("checkpoint", "new", "new_test", "old_test", "run_dir"):
        p.add_argument(name)
    p.add_argument("--replay", action="append")
    p.add_argument(
        "--set", action="append", help="edit the job: PATH=JSON or PATH+=JSON (repeatable)"
    )
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--steps", type=int, help="a fixed step budget instead of --minutes")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    if args.command == "slabs-data":
        slabs_data(args.out, args.bulk, args.slabs, args.test_bulk, args.test_slabs)
    elif args.command == "newtype-data":
        newtype_data(args.out, args.bulk, args.slabs, args.test_bulk, args.test_slabs)
    elif args.command == "train":
        train(args)
    else:
        finetune(args, extra)


if __name__ == "__main__":
    main()
