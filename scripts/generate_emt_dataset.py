#!/usr/bin/env python
"""Generate the bundled EMT data set (train/val/test extxyz files).

Deterministic: the same arguments always write the same bytes. With the
defaults it reproduces ``nvalchemi/data/bundled/``::

    python scripts/generate_emt_dataset.py
    python scripts/generate_emt_dataset.py --out /tmp/emt --num-structures 60
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    from nvalchemi.data import emt_generator
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from nvalchemi.data import emt_generator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(emt_generator.__file__).resolve().with_name("bundled"),
        help="output folder (default: the package's bundled data folder)",
    )
    parser.add_argument(
        "--num-structures",
        type=int,
        default=emt_generator.DEFAULT_NUM_STRUCTURES,
        help=f"total number of structures (default {emt_generator.DEFAULT_NUM_STRUCTURES})",
    )
    parser.add_argument(
        "--seed", type=int, default=emt_generator.DEFAULT_SEED, help="base random seed"
    )
    args = parser.parse_args(argv)
    if args.num_structures < len(emt_generator.FAMILIES):
        parser.error(
            f"--num-structures must be at least {len(emt_generator.FAMILIES)} (one per family)"
        )
    start = time.perf_counter()
    emt_generator.write_dataset(
        args.out, args.num_structures, args.seed, progress=lambda msg: print(msg, flush=True)
    )
    print(f"Done in {time.perf_counter() - start:.1f} s.", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
