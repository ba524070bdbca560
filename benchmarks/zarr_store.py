"""Size and read speed of the zarr store (``AtomicDataZarrWriter`` / ``AtomicDataZarrReader``).

Prints JSON lines:

* ``store_size``: bytes on disk of stores written by ``data convert``'s library function
  (:func:`~nvalchemi.data.convert.convert_to_zarr`) from the bundled EMT data
  (train + validation + test, 3,000 structures) and from a ~6 KB extxyz (the first two
  structures), and of the same data written in one ``write`` call;
* ``store_read``: structures/s reading those stores (median and best of ``--repeats``):

  - ``read_many_sequential``: ``reader.read_many`` over consecutive batches of 16,
  - ``read_random``: ``reader.read(i)`` in a shuffled order,
  - ``loader_shuffled``: ``DataLoader(Dataset(reader), batch_size=16, shuffle=True)``
    (what training does, without neighbour lists: the reading and collation cost),

  for the bundled store and for a larger synthetic one (``--large`` structures of 64 atoms),
  also with ``cache_bytes=0`` (no decoded chunk kept: the worst case of random reads
  from a store far larger than the reader's cache).

Scale mode (``--scale 10000 100000 1000000``) writes, for each size, a store of synthetic
periodic 32-atom structures (energy, forces, stress, float32 positions) with
``AtomicDataZarrWriter`` in appends of 10,000 (one process, one thread) and prints a
``store_scale`` line: write time, bytes and files on disk, and, measured in a fresh
process (so the memory is the reader's alone): the time and resident memory of opening
it, random single-structure reads per second (``reader.read(i)``, random order), and
structures per second through a shuffled ``DataLoader`` (batch 8) with 0 and 2 workers
(``--workers``, default 0 1 2), with the CPU microseconds per structure of the main
process (``*_main_cpu_us``) and of the workers (``*_workers_cpu_us``, their start
included); on a shared machine, the rates per CPU second of the reading process
(``*_per_cpu_s``) say more than the wall-clock ones. Stores go to ``--workdir`` (default:
a temporary folder, removed).

Compare runs of this script on two commits (interleaved, on a quiet machine) for
before/after numbers; nothing here asserts a speed.

Usage: ``python benchmarks/zarr_store.py [--repeats 5] [--large 20000] [--quick]``,
``python benchmarks/zarr_store.py --scale 10000 100000 [--reads 20000] [--workdir DIR]``
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.bundled import BUNDLED_DIR

BATCH = 16


def store_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def convert(inputs: list[Path], output: Path) -> None:
    from nvalchemi.data.convert import convert_to_zarr, open_inputs

    convert_to_zarr(open_inputs([str(p) for p in inputs]), output)


def tiny_extxyz(workdir: Path, structures: int = 2) -> Path:
    """The first ``structures`` structures of the bundled training file (about 6 KB)."""
    lines = (BUNDLED_DIR / "train.extxyz").read_text().splitlines(keepends=True)
    out, i = [], 0
    for _ in range(structures):
        n = int(lines[i])
        out += lines[i : i + n + 2]
        i += n + 2
    path = workdir / "tiny.extxyz"
    path.write_text("".join(out))
    return path


def synthetic(count: int, atoms: int, seed: int = 0) -> list[AtomicData]:
    """Random periodic structures with float32 positions and labels (no physics needed)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        out.append(
            AtomicData(
                atomic_numbers=torch.randint(1, 90, (atoms,), generator=g),
                positions=10 * torch.rand(atoms, 3, generator=g),
                cell=10 * torch.eye(3).unsqueeze(0),
                pbc=torch.ones(1, 3, dtype=torch.bool),
                energy=torch.randn(1, 1, generator=g),
                forces=torch.randn(atoms, 3, generator=g),
                stress=torch.randn(1, 3, 3, generator=g),
            )
        )
    return out


def rates(fn, repeats: int) -> dict:
    values = [fn() for _ in range(repeats)]
    return {"median": round(statistics.median(values)), "best": round(max(values))}


def read_cases(path: Path, repeats: int, limit: int | None, cache_bytes: int | None) -> dict:
    from nvalchemi.data.datapipes.dataloader import DataLoader
    from nvalchemi.data.datapipes.dataset import Dataset
    from nvalchemi.data.io.zarr import AtomicDataZarrReader

    options = {} if cache_bytes is None else {"cache_bytes": cache_bytes}
    reader = AtomicDataZarrReader(str(path), **options)
    n = len(reader) if limit is None else min(limit, len(reader))
    rng = np.random.default_rng(0)

    def sequential() -> float:
        start = time.perf_counter()
        for a in range(0, n, BATCH):
            reader.read_many(range(a, min(a + BATCH, n)))
        return n / (time.perf_counter() - start)

    def random() -> float:
        order = rng.permutation(len(reader))[:n].tolist()
        start = time.perf_counter()
        for i in order:
            reader.read(i)
        return n / (time.perf_counter() - start)

    dataset = Dataset(reader, skip_validation=True)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)

    def shuffled() -> float:
        start, count = time.perf_counter(), 0
        for batch in loader:
            count += batch.num_graphs
            if count >= n:
                break
        return count / (time.perf_counter() - start)

    random()  # warm the page cache and open files
    out = {
        "read_many_sequential": rates(sequential, repeats),
        "read_random": rates(random, repeats),
        "loader_shuffled": rates(shuffled, repeats),
        "structures": n,
    }
    reader.close()
    return out


# ------------------------------------------------------------------------ scale mode
APPEND = 10_000
SCALE_ATOMS = 32


def _template(count: int) -> Batch:
    """``count`` periodic 32-atom structures in one ``Batch`` (values refilled per append)."""
    from nvalchemi.data import Batch

    return Batch.from_data_list(synthetic(count, SCALE_ATOMS, seed=1), device="cpu")


def _refill(batch: Batch, generator: torch.Generator) -> Batch:
    """New random values (noisy floats, like real positions and forces) in ``batch``."""
    atoms, structures = batch.num_nodes, batch.num_graphs
    batch["positions"] = 10 * torch.rand(atoms, 3, generator=generator)
    batch["forces"] = torch.randn(atoms, 3, generator=generator)
    batch["energy"] = -200 + torch.randn(structures, 1, generator=generator, dtype=torch.float64)
    batch["stress"] = 0.01 * torch.randn(structures, 3, 3, generator=generator)
    batch["atomic_numbers"] = torch.randint(1, 90, (atoms,), generator=generator)
    return batch


def write_scale_store(path: Path, structures: int) -> float:
    """Write the synthetic store; return the seconds spent in the writer."""
    from nvalchemi.data.io.zarr import AtomicDataZarrWriter

    writer = AtomicDataZarrWriter(str(path))
    generator = torch.Generator().manual_seed(structures)
    template = _template(min(APPEND, structures))
    spent, done = 0.0, 0
    while done < structures:
        count = min(APPEND, structures - done)
        batch = _refill(template if count == template.num_graphs else _template(count), generator)
        start = time.perf_counter()
        if done == 0:
            writer.write(batch)
        else:
            writer.append(batch)
        spent += time.perf_counter() - start
        done += count
    return spent


def _rss_mb() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (loader workers)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def probe(path: str, reads: int, workers: list[int]) -> dict:
    """Open ``path`` in this (fresh) process; time reads; report rates and memory."""
    from nvalchemi.data.datapipes.dataloader import DataLoader
    from nvalchemi.data.datapipes.dataset import Dataset
    from nvalchemi.data.io.zarr import AtomicDataZarrReader

    torch.set_num_threads(1)
    before = _rss_mb()
    start = time.perf_counter()
    reader = AtomicDataZarrReader(path)
    out = {
        "open_s": round(time.perf_counter() - start, 3),
        "open_rss_mb": round(_rss_mb() - before),
    }
    order = np.random.default_rng(0).permutation(len(reader))
    count = min(reads, len(reader))
    for i in order[-1000:].tolist():  # warm the page cache and open files
        reader.read(i)
    start, cpu = time.perf_counter(), time.process_time()
    for i in order[:count].tolist():
        reader.read(i)
    out["random_reads_per_s"] = round(count / (time.perf_counter() - start))
    out["random_reads_per_cpu_s"] = round(count / (time.process_time() - cpu))
    out["rss_after_reads_mb"] = round(_rss_mb() - before)
    dataset = Dataset(reader, skip_validation=True)
    for num_workers in workers:
        loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=num_workers)
        children = _children_cpu_s()
        seen, start, cpu = 0, None, 0.0
        for batch in loader:
            if start is None:  # after the first batch: workers started
                start, cpu = time.perf_counter(), time.process_time()
                continue
            seen += batch.num_graphs
            if seen >= count:
                break
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        del loader, batch  # its workers exit, so their CPU time is counted below
        name = f"loader_{num_workers}_workers"
        out[f"{name}_per_s"] = round(seen / wall)
        if num_workers == 0:
            out[f"{name}_per_cpu_s"] = round(seen / cpu)
        else:  # CPU microseconds per structure; the workers' start included
            out[f"{name}_main_cpu_us"] = round(cpu / seen * 1e6, 1)
            out[f"{name}_workers_cpu_us"] = round((_children_cpu_s() - children) / seen * 1e6, 1)
    reader.close()
    return out


def scale(sizes: list[int], reads: int, workers: list[int], workdir: Path | None) -> None:
    import shutil
    import subprocess
    import sys

    folder = Path(workdir or tempfile.mkdtemp(prefix="zarr-scale-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        for size in sizes:
            path = folder / f"scale-{size}.zarr"
            shutil.rmtree(path, ignore_errors=True)
            write_s = write_scale_store(path, size)
            files = [f for f in path.rglob("*") if f.is_file()]
            command = [sys.executable, __file__, "--probe", str(path), "--reads", str(reads)]
            command += ["--workers", *map(str, workers)]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            record = {
                "bench": "store_scale",
                "structures": size,
                "atoms_per_structure": SCALE_ATOMS,
                "write_s": round(write_s, 1),
                "write_structures_per_s": round(size / write_s),
                "store_bytes": sum(f.stat().st_size for f in files),
                "store_files": len(files),
                **json.loads(result.stdout.strip().splitlines()[-1]),
                "load_average": [round(x, 2) for x in os.getloadavg()],
            }
            print(json.dumps(record), flush=True)
            if workdir is None:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        if workdir is None:
            shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--large", type=int, default=20000, help="structures of the large store")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--scale", type=int, nargs="+", help="scale mode: store sizes")
    parser.add_argument("--reads", type=int, default=20000, help="scale mode: reads per case")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workdir", type=Path, help="scale mode: keep the stores here")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, args.reads, args.workers)), flush=True)
        return
    if args.scale:
        torch.set_num_threads(1)
        scale(args.scale, args.reads, args.workers, args.workdir)
        return
    if args.quick:
        args.repeats, args.large = 1, 500
    torch.set_num_threads(1)
    print(
        json.dumps(
            {
                "bench": "zarr_store",
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "load_average": [round(x, 2) for x in os.getloadavg()],
            }
        ),
        flush=True,
    )
    bundled = [BUNDLED_DIR / f"{name}.extxyz" for name in ("train", "val", "test")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tiny = tiny_extxyz(work)
        convert(bundled, work / "bundled.zarr")
        convert([tiny], work / "tiny.zarr")
        from nvalchemi.data.io.zarr import AtomicDataZarrReader, AtomicDataZarrWriter

        large = synthetic(args.large, 64)
        AtomicDataZarrWriter(str(work / "large.zarr")).write(large)
        del large
        print(
            json.dumps(
                {
                    "bench": "store_size",
                    "bundled_structures": len(AtomicDataZarrReader(str(work / "bundled.zarr"))),
                    "bundled_extxyz_bytes": sum(p.stat().st_size for p in bundled),
                    "bundled_store_bytes": store_bytes(work / "bundled.zarr"),
                    "tiny_extxyz_bytes": tiny.stat().st_size,
                    "tiny_store_bytes": store_bytes(work / "tiny.zarr"),
                    "large_structures": args.large,
                    "large_store_bytes": store_bytes(work / "large.zarr"),
                }
            ),
            flush=True,
        )
        cases = [("bundled", None, None), ("large", 5000, None)]
        if "cache_bytes" in inspect.signature(AtomicDataZarrReader).parameters:
            # nothing kept decoded: every read of a compressed array decodes its chunk
            cases.append(("large", 5000, 0))
        for name, limit, cache_bytes in cases:
            record = read_cases(work / f"{name}.zarr", args.repeats, limit, cache_bytes)
            print(
                json.dumps(
                    {"bench": "store_read", "store": name, "cache_bytes": cache_bytes, **record}
                ),
                flush=True,
            )
    print(
        json.dumps(
            {"bench": "zarr_store_end", "load_average": [round(x, 2) for x in os.getloadavg()]}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
