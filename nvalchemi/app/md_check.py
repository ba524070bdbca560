"""The MD check: does a potential survive molecular dynamics before you trust it?

Low test errors do not mean stable dynamics. :func:`md_check` draws a few structures of
every structure type of a data set (``config_type``, any ``group_by`` info key, else
atom-count ranges, as the evaluation tables group them), runs Langevin NVT at each
temperature and then NVE from where NVT ended, and reports per group:

* ``runs`` and ``stable``: runs that stayed physical, i.e. had no pair of atoms closer
  than ``min_distance_factor`` times the smallest distance in the data, no energy
  runaway (the potential energy per atom moving more than ``energy_window_eV_per_atom``
  from its start, the kinetic energy per atom above it, or a non-finite value), and no
  lost atom (one more atom than at the start without a neighbour within the model's
  cutoff);
* ``first_failure_ps``: when the first of them failed (``None``: none did);
* ``nve_drift_meV_per_atom_ps``: the mean absolute slope of the total energy per atom
  during NVE over the stable runs (``nve_drift_max_meV_per_atom_ps``: the largest);
* ``failures``: how many runs failed for each reason.

Runs are batched with torch-sim (:class:`~nvalchemi.models.TorchSimModel`, extra ``md``)
when it is installed, else they go one by one through ASE with
:class:`~nvalchemi.models.NvalchemiCalculator`. :meth:`MDCheckResult.plot` draws the energy
and temperature of every run against time, one row per group. :class:`MDCheckHook` runs a
short check every few validations during training, so the learning curves show when the
potential became stable (``validation/md/stable_fraction``, ...).

Defaults (:class:`MDCheckSettings`): 300 K and 900 K, one structure per group of at most
64 atoms, 0.4 ps of NVT then 0.2 ps of NVE at 2 fs, records and checks every 5 steps:
about half a minute for the bundled data (9 groups, 18 runs) with the quickstart's PaiNN
on 2 CPU cores through torch-sim.

torch, torch-sim, ASE, matplotlib and the models are imported where they are used: job files
import this module to validate ``evaluation.md``, which must stay light.

Example:
    >>> from nvalchemi.app.md_check import MDCheckSettings
    >>> settings = MDCheckSettings(temperatures_K=[300, 900], nvt_ps=1.0)
    >>> settings.nvt_steps, settings.nve_steps
    (500, 100)
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "FAILURE_KINDS",
    "MDCheckHook",
    "MDCheckResult",
    "MDCheckSettings",
    "MDRun",
    "MDStructures",
    "as_fully_periodic",
    "draw_structures",
    "iter_table_rows",
    "md_check",
    "run_md_check",
]

BOLTZMANN_EV_PER_K = 8.617333262e-5
"""k_B in eV/K (CODATA 2018)."""

FAILURE_KINDS = ("non-finite", "energy", "close pair", "lost atom", "error")
"""Why a run stopped being physical (keys of a group's ``failures``)."""

DEFAULT_LOST_DISTANCE = 6.0
"""Å: the lost-atom distance for a model without a neighbour cutoff."""


class MDCheckSettings(BaseModel):
    """What the MD check runs (times in ps and fs, temperatures in K, energies in eV).

    Example:
        >>> MDCheckSettings().model_dump()["temperatures_K"]
        [300.0, 900.0]
    """

    model_config = ConfigDict(extra="forbid")

    temperatures_K: list[float] = Field(
        default_factory=lambda: [300.0, 900.0],
        min_length=1,
        description="Langevin NVT temperatures; every structure runs at each of them",
    )
    nvt_ps: float = Field(default=0.4, ge=0, description="NVT (Langevin) time per run")
    nve_ps: float = Field(default=0.2, ge=0, description="NVE time after NVT (drift measured)")
    timestep_fs: float = Field(default=2.0, gt=0, le=20)
    structures_per_group: int = Field(default=1, ge=1)
    max_atoms: int | None = Field(
        default=64,
        ge=1,
        description="draw structures of at most this many atoms (a group with none: its "
        "smallest); keeps the check cheap",
    )
    friction_per_ps: float = Field(default=10.0, gt=0, description="Langevin friction")
    check_every: int = Field(
        default=5, ge=1, description="steps between records and geometry checks"
    )
    min_distance_factor: float = Field(
        default=0.7,
        gt=0,
        le=1,
        description="a pair closer than this times the data's smallest distance fails a run",
    )
    energy_window_eV_per_atom: float = Field(
        default=1.0,
        gt=0,
        description="potential energy per atom moving more than this from its start, or a "
        "kinetic energy per atom above it, fails a run",
    )
    lost_atom_distance: float | None = Field(
        default=None,
        gt=0,
        description="Å: an atom with no neighbour this close is lost (default: the model's "
        "cutoff, else 6 Å)",
    )
    engine: Literal["auto", "torch-sim", "ase"] = Field(
        default="auto", description="auto: torch-sim when installed, else ASE"
    )
    group_by: str | None = Field(
        default=None, description="info key that groups structures (default: config_type)"
    )
    seed: int = 0

    @field_validator("temperatures_K")
    @classmethod
    def _positive(cls, values: list[float]) -> list[float]:
        bad = [t for t in values if not t > 0]
        if bad:
            raise ValueError(f"temperatures must be > 0 K; got {bad}")
        return [float(t) for t in values]

    @property
    def nvt_steps(self) -> int:
        return round(1000 * self.nvt_ps / self.timestep_fs)

    @property
    def nve_steps(self) -> int:
        return round(1000 * self.nve_ps / self.timestep_fs)

    @property
    def timestep_ps(self) -> float:
        return self.timestep_fs / 1000

    def short(self) -> MDCheckSettings:
        """A quick version for checks during training: the highest temperature, one
        structure per group, 0.2 ps NVT and 0.1 ps NVE."""
        return self.model_copy(
            update={
                "temperatures_K": [max(self.temperatures_K)],
                "structures_per_group": 1,
                "nvt_ps": min(self.nvt_ps, 0.2),
                "nve_ps": min(self.nve_ps, 0.1),
            }
        )


# --------------------------------------------------------------------------- structures
@dataclass
class MDStructures:
    """The structures an MD check runs, their groups, and the data's smallest distance (Å)."""

    atoms: list[Any]
    groups: list[str]
    grouping: str
    data_min_distance: float


def _atoms_at(reader: Any, index: int) -> Any:
    """Structure ``index`` of ``reader`` (through subsets) as ``ase.Atoms``."""
    while hasattr(reader, "indices") and hasattr(reader, "reader"):
        index, reader = reader.indices[index], reader.reader
    get_atoms = getattr(reader, "get_atoms", None)
    return get_atoms(index) if callable(get_atoms) else reader.read_data(index).to_atoms()


def _natural(label: str) -> tuple:
    """Groups in reading order: atom-count ranges by their first number, others by name."""
    head = label.split("-")[0].split(" ")[0]
    return (0, int(head), label) if head.isdigit() else (1, 0, label)


def draw_structures(
    readers: Sequence[Any], settings: MDCheckSettings, *, distance_sample: int = 200
) -> MDStructures:
    """Draw ``structures_per_group`` structures of each group of ``readers`` (seeded).

    The smallest interatomic distance of the data is measured on the drawn structures
    and up to ``distance_sample`` others (seeded), so its bound does not depend on a
    lucky draw.

    Raises:
        ValueError: the readers hold no structure.
    """
    from nvalchemi.app.evaluation import structure_groups

    labels, grouping = structure_groups(readers, settings.group_by)
    where = [(r, i) for r in readers for i in range(len(r))]
    if not where:
        raise ValueError("the MD check needs structures, but the data set is empty")
    rng = np.random.default_rng(settings.seed)
    chosen: list[int] = []
    for group in sorted(set(labels.tolist()), key=_natural):
        members = rng.permutation(np.flatnonzero(labels == group)).tolist()
        chosen += _small_first(members, where, settings)
    atoms = [_atoms_at(*where[i]).copy() for i in chosen]
    others = rng.permutation(len(where))[:distance_sample].tolist()
    sample = atoms + [_atoms_at(*where[i]) for i in others if i not in set(chosen)]
    return MDStructures(
        atoms=atoms,
        groups=[str(labels[i]) for i in chosen],
        grouping=grouping,
        data_min_distance=min(_closest_pair(a) for a in sample),
    )


def _small_first(members: list[int], where: list[Any], settings: MDCheckSettings) -> list[int]:
    """The first ``structures_per_group`` of ``members`` with at most ``max_atoms`` atoms
    (none such: the smallest member)."""
    wanted = settings.structures_per_group
    if settings.max_atoms is None:
        return members[:wanted]
    picked, sizes = [], {}
    for i in members:
        sizes[i] = len(_atoms_at(*where[i]))
        if sizes[i] <= settings.max_atoms:
            picked.append(i)
            if len(picked) == wanted:
                break
    return picked or [min(members, key=sizes.__getitem__)]


def _pairs(
    positions: np.ndarray, cell: np.ndarray, pbc: np.ndarray, cutoff: float
) -> tuple[np.ndarray, np.ndarray]:
    """``(senders [E], distances [E])`` of every pair closer than ``cutoff`` (Å)."""
    from nvalchemi.data.neighbors import neighbor_list_for_system

    periodic = bool(np.any(pbc))
    pairs, shifts = neighbor_list_for_system(
        positions, cell if periodic else None, pbc if periodic else None, cutoff
    )
    vectors = positions[pairs[:, 1]] - positions[pairs[:, 0]]
    if periodic:
        vectors = vectors + shifts @ cell
    return pairs[:, 0], np.linalg.norm(vectors, axis=1)


def _closest_pair(atoms: Any, cutoff: float = 6.0) -> float:
    """The smallest interatomic distance of ``atoms`` (``inf`` with none within ``cutoff``)."""
    _, distances = _pairs(atoms.positions, atoms.cell.array, atoms.pbc, cutoff)
    return float(distances.min()) if distances.size else math.inf


# --------------------------------------------------------------------------- runs
@dataclass
class MDRun:
    """One structure at one temperature: its record (every ``check_every`` steps) and fate.

    Energies in eV (whole structure), times in ps from the start of NVT; NVE starts at
    record ``nve_start``.
    """

    group: str
    structure: int
    temperature_K: float
    num_atoms: int
    times_ps: list[float] = field(default_factory=list)
    potential_energy: list[float] = field(default_factory=list)
    kinetic_energy: list[float] = field(default_factory=list)
    nve_start: int | None = None
    failure: str | None = None
    failure_kind: str | None = None
    failure_ps: float | None = None
    isolated_at_start: int = 0
    closest_pair: float = math.inf
    """The shortest interatomic distance seen at a check (Å)."""

    @property
    def stable(self) -> bool:
        return self.failure is None

    @property
    def temperatures(self) -> np.ndarray:
        """Instantaneous temperature (K) of every record, ``2 E_kin / (3 N k_B)``."""
        kinetic = np.asarray(self.kinetic_energy, dtype=float)
        return 2 * kinetic / (3 * self.num_atoms * BOLTZMANN_EV_PER_K)

    def nve_drift(self) -> float | None:
        """Slope of the total energy per atom during NVE, meV/atom/ps (``None``: no NVE)."""
        if self.nve_start is None or len(self.times_ps) - self.nve_start < 2:
            return None
        times = np.asarray(self.times_ps[self.nve_start :])
        total = np.add(self.potential_energy, self.kinetic_energy)[self.nve_start :]
        slope = np.polyfit(times - times[0], total / self.num_atoms, 1)[0]
        return float(1000 * slope)

    def record(self, time_ps: float, potential: float, kinetic: float) -> None:
        self.times_ps.append(float(time_ps))
        self.potential_energy.append(float(potential))
        self.kinetic_energy.append(float(kinetic))

    def fail(self, kind: str, message: str, time_ps: float) -> None:
        if self.failure is None:
            self.failure_kind, self.failure, self.failure_ps = kind, message, float(time_ps)


@dataclass(frozen=True)
class _Limits:
    min_distance: float
    lost_distance: float
    energy_window: float


def _inspect(
    run: MDRun,
    positions: np.ndarray,
    cell: np.ndarray,
    pbc: np.ndarray,
    limits: _Limits,
    first: bool = False,
) -> None:
    """Fail ``run`` at its last record if it stopped being physical (see the module doc)."""
    time_ps, potential, kinetic = run.times_ps[-1], run.potential_energy[-1], run.kinetic_energy[-1]
    n = run.num_atoms
    if not (math.isfinite(potential) and math.isfinite(kinetic) and np.isfinite(positions).all()):
        run.fail("non-finite", "non-finite energy or positions", time_ps)
        return
    change = (potential - run.potential_energy[0]) / n
    if abs(change) > limits.energy_window:
        run.fail("energy", f"potential energy moved {change:+.2f} eV/atom", time_ps)
        return
    if kinetic / n > limits.energy_window:
        temperature = run.temperatures[-1]
        run.fail("energy", f"kinetic energy runaway ({temperature:.0f} K)", time_ps)
        return
    cutoff = max(limits.min_distance, limits.lost_distance)
    senders, distances = _pairs(positions, cell, pbc, cutoff)
    closest = float(distances.min()) if distances.size else math.inf
    run.closest_pair = min(run.closest_pair, closest)
    isolated = n - np.unique(senders[distances < limits.lost_distance]).size
    if first:
        run.isolated_at_start = isolated
    if closest < limits.min_distance:
        message = f"atoms {closest:.2f} Å apart (bound {limits.min_distance:.2f} Å)"
        run.fail("close pair", message, time_ps)
    elif isolated > run.isolated_at_start:
        lost = isolated - run.isolated_at_start
        message = f"{lost} atom(s) without a neighbour within {limits.lost_distance:.1f} Å"
        run.fail("lost atom", message, time_ps)


def _thermal_momenta(atoms: Any, temperature_K: float, rng: np.random.Generator) -> None:
    """Maxwell-Boltzmann momenta at ``temperature_K`` without centre-of-mass motion."""
    masses = atoms.get_masses()[:, None]
    momenta = rng.normal(size=(len(atoms), 3)) * np.sqrt(
        masses * BOLTZMANN_EV_PER_K * temperature_K
    )
    if len(atoms) > 1:
        momenta -= masses * (momenta.sum(0) / masses.sum())
    atoms.set_momenta(momenta)


# --------------------------------------------------------------------------- engines
def _run_ase(
    model: Any,
    runs: list[MDRun],
    structures: MDStructures,
    settings: MDCheckSettings,
    limits: _Limits,
    device: Any,
    head: str | None,
) -> None:
    """Every run on its own through ASE (Langevin, then velocity Verlet)."""
    from nvalchemi.models.calculator import NvalchemiCalculator

    if getattr(model, "model_config", None) is None:
        raise TypeError(
            f"The MD check's ASE engine runs BaseModelMixin models; {type(model).__name__} is "
            "not one (an exported potential runs with engine='torch-sim')."
        )
    calculator = NvalchemiCalculator(model, device=device, head=head)
    for number, run in enumerate(runs):
        atoms = structures.atoms[run.structure].copy()
        atoms.calc = calculator
        rng = np.random.default_rng([settings.seed, number])
        _run_one_with_ase(run, atoms, settings, limits, rng)


def _run_one_with_ase(
    run: MDRun, atoms: Any, settings: MDCheckSettings, limits: _Limits, rng: np.random.Generator
) -> None:
    from ase import units
    from ase.md.langevin import Langevin
    from ase.md.verlet import VelocityVerlet

    dt = settings.timestep_fs * units.fs
    _thermal_momenta(atoms, run.temperature_K, rng)
    step = 0

    def observe(first: bool = False) -> None:
        potential = atoms.get_potential_energy()
        run.record(step * settings.timestep_ps, potential, atoms.get_kinetic_energy())
        _inspect(run, atoms.positions, atoms.cell.array, atoms.pbc, limits, first)

    try:
        observe(first=True)
        friction = settings.friction_per_ps / (1000 * units.fs)
        nvt = Langevin(
            atoms, dt, temperature_K=run.temperature_K, friction=friction, rng=rng, fixcm=False
        )
        for phase, (dynamics, steps) in enumerate(
            ((nvt, settings.nvt_steps), (VelocityVerlet(atoms, dt), settings.nve_steps))
        ):
            if phase == 1 and steps:
                run.nve_start = len(run.times_ps) - 1
            done = 0
            while done < steps and run.stable:
                chunk = min(settings.check_every, steps - done)
                dynamics.run(chunk)
                done += chunk
                step += chunk
                observe()
    except Exception as exc:  # a model that raises on a broken structure failed the check
        run.fail("error", f"{type(exc).__name__}: {exc}", step * settings.timestep_ps)


def as_fully_periodic(atoms: Any, cutoff: float) -> Any:
    """``atoms`` periodic along all three vectors, for torch-sim's one pbc flag.

    Each open direction of a mixed structure (a slab: pbc T, T, F) gets a cell vector
    normal to the periodic ones, long enough for ``cutoff`` plus 6 Å of vacuum between
    images; the periodic vectors are kept, so results are the open-boundary ones.
    """
    if atoms.pbc.all() or not atoms.pbc.any():
        return atoms
    atoms = atoms.copy()
    cell = atoms.cell.array.copy()
    basis: list[np.ndarray] = []
    for vector in cell[atoms.pbc]:
        _add_orthonormal(basis, vector)
    normals = basis[len(basis) :]
    for axis in np.eye(3):
        _add_orthonormal(normals, axis, against=basis)
    for i, normal in zip(np.flatnonzero(~atoms.pbc), normals):
        extent = np.ptp(atoms.positions @ normal)
        cell[i] = normal * (extent + cutoff + 6.0)
    atoms.set_cell(cell, scale_atoms=False)
    atoms.pbc = True
    return atoms


def _add_orthonormal(
    vectors: list[np.ndarray], candidate: np.ndarray, against: Sequence[np.ndarray] = ()
) -> None:
    """Append ``candidate`` minus its projections on ``vectors`` and ``against``, normalised
    (nothing when it lies in their span): Gram-Schmidt."""
    rest = np.asarray(candidate, dtype=float)
    for other in (*against, *vectors):
        rest = rest - np.dot(rest, other) * other
    norm = np.linalg.norm(rest)
    if norm > 1e-6 and len(vectors) + len(against) < 3:
        vectors.append(rest / norm)


def _run_torch_sim(
    model: Any,
    runs: list[MDRun],
    structures: MDStructures,
    settings: MDCheckSettings,
    limits: _Limits,
    device: Any,
    head: str | None,
) -> None:
    """All runs batched through torch-sim: one state of the periodic runs, one of the open."""
    from nvalchemi.models.torchsim import TorchSimModel

    adapter = TorchSimModel(model, device=device, head=head, compute_stress=False)
    vacuum = adapter.cutoff or DEFAULT_LOST_DISTANCE
    periodic: list[tuple[MDRun, Any]] = []
    open_boundary: list[tuple[MDRun, Any]] = []
    for run in runs:
        atoms = as_fully_periodic(structures.atoms[run.structure], vacuum)
        (periodic if atoms.pbc.all() else open_boundary).append((run, atoms))
    for members in (periodic, open_boundary):
        if members:
            _integrate(
                adapter, [run for run, _ in members], [a for _, a in members], settings, limits
            )


def _integrate(
    adapter: Any,
    runs: list[MDRun],
    structures: list[Any],
    settings: MDCheckSettings,
    limits: _Limits,
) -> None:
    """Langevin then NVE for one torch-sim state; failed systems leave the state."""
    import torch
    import torch_sim as ts

    units = ts.units.MetalUnits
    options = {"dtype": adapter.dtype, "device": adapter.device}
    kT = torch.tensor([r.temperature_K for r in runs], **options) * units.temperature
    dt = torch.tensor(settings.timestep_fs * 1e-3 * units.time, **options)
    gamma = torch.tensor(settings.friction_per_ps / units.time, **options)
    nvt_init, nvt_step = ts.integrators.nvt_langevin(
        model=adapter, dt=dt, kT=kT, gamma=gamma, seed=settings.seed
    )
    _, nve_step = ts.integrators.nve(model=adapter, dt=dt, kT=kT)
    state = ts.io.atoms_to_state(structures, adapter.device, adapter.dtype)

    def initial(state: Any, rows: Any) -> Any:
        return nvt_init(state, kT=kT[rows])

    def nvt(state: Any, rows: Any) -> Any:
        return nvt_step(state, kT=kT[rows])

    def nve(state: Any, rows: Any) -> Any:
        return nve_step(state)

    md, alive = _isolating(initial, state, list(range(len(runs))), runs, 0.0, init=True)
    if md is not None:
        _observe(md, alive, runs, 0.0, limits, first=True)
        md, alive = _drop_failed(md, alive, runs)
    total = settings.nvt_steps + settings.nve_steps
    for step in range(1, total + 1):
        if md is None:
            return
        if step == settings.nvt_steps + 1 and settings.nve_steps:
            for index in alive:
                runs[index].nve_start = len(runs[index].times_ps) - 1
        time_ps = step * settings.timestep_ps
        stepper = nvt if step <= settings.nvt_steps else nve
        md, alive = _isolating(stepper, md, alive, runs, time_ps)
        if md is None:
            return
        if step % settings.check_every == 0 or step in (settings.nvt_steps, total):
            _observe(md, alive, runs, time_ps, limits)
        else:
            _check_finite(md, alive, runs, time_ps)
        md, alive = _drop_failed(md, alive, runs)


def _isolating(
    step: Any, md: Any, alive: list[int], runs: list[MDRun], time_ps: float, init: bool = False
) -> tuple[Any, list[int]]:
    """``step(state, rows)`` on the whole batch; if it raises, system by system, failing
    those that raise (``rows`` index the runs' temperatures).

    The integrators replace a state's tensors rather than writing into them, so the
    state handed to ``step`` is a shallow copy and ``md`` keeps the step's start.
    """
    import torch
    from torch_sim.state import concatenate_states

    def rows(indices: list[int]) -> torch.Tensor:
        return torch.tensor(indices, dtype=torch.long, device=md.device)

    def fresh(state: Any) -> Any:
        return state if init else copy.copy(state)

    try:
        return step(fresh(md), rows(alive)), alive
    except Exception as exc:
        if len(alive) == 1:
            _fail_with(runs[alive[0]], exc, time_ps)
            return None, []
    survivors, kept = [], []
    for position, index in enumerate(alive):
        try:
            survivors.append(step(fresh(md[[position]]), rows([index])))
            kept.append(index)
        except Exception as exc:
            _fail_with(runs[index], exc, time_ps)
    return (concatenate_states(survivors) if survivors else None), kept


def _fail_with(run: MDRun, exc: Exception, time_ps: float) -> None:
    run.fail("error", f"{type(exc).__name__}: {exc}", time_ps)


def _check_finite(md: Any, alive: list[int], runs: list[MDRun], time_ps: float) -> None:
    """Fail systems whose energy or forces stopped being finite (between full checks)."""
    import torch

    bad_atoms = (~torch.isfinite(md.forces)).any(dim=1).to(md.energy.dtype)
    bad = md.energy.new_zeros(len(alive)).index_add(0, md.system_idx, bad_atoms) > 0
    bad |= ~torch.isfinite(md.energy)
    if bool(bad.any()):
        for k in torch.nonzero(bad).flatten().tolist():
            runs[alive[k]].fail("non-finite", "non-finite energy or forces", time_ps)


def _observe(
    md: Any,
    alive: list[int],
    runs: list[MDRun],
    time_ps: float,
    limits: _Limits,
    first: bool = False,
) -> None:
    """Record every system's energies and inspect its geometry."""
    kinetic_atoms = 0.5 * (md.momenta**2).sum(dim=1) / md.masses
    kinetic = md.energy.new_zeros(len(alive)).index_add(0, md.system_idx, kinetic_atoms)
    potential = md.energy.detach().double().cpu().numpy()
    kinetic = kinetic.detach().double().cpu().numpy()
    positions = md.positions.detach().double().cpu().numpy()
    cells = md.cell.mT.detach().double().cpu().numpy()
    pbc = np.array([bool(md.pbc)] * 3)
    start = 0
    for k, index in enumerate(alive):
        run = runs[index]
        run.record(time_ps, potential[k], kinetic[k])
        _inspect(run, positions[start : start + run.num_atoms], cells[k], pbc, limits, first)
        start += run.num_atoms


def _drop_failed(md: Any, alive: list[int], runs: list[MDRun]) -> tuple[Any, list[int]]:
    keep = [k for k, index in enumerate(alive) if runs[index].stable]
    if len(keep) == len(alive):
        return md, alive
    if not keep:
        return None, []
    return md[keep], [alive[k] for k in keep]


# --------------------------------------------------------------------------- results
def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


@dataclass
class MDCheckResult:
    """Every run of an MD check and what they add up to per group (:meth:`by_group`)."""

    runs: list[MDRun]
    settings: MDCheckSettings
    engine: str
    grouping: str
    data_min_distance: float
    min_distance: float
    lost_distance: float
    seconds: float = 0.0

    @property
    def groups(self) -> list[str]:
        return sorted({run.group for run in self.runs}, key=_natural)

    @property
    def planned_ps(self) -> float:
        return (self.settings.nvt_steps + self.settings.nve_steps) * self.settings.timestep_ps

    def _summary(self, runs: list[MDRun]) -> dict[str, Any]:
        stable = [run for run in runs if run.stable]
        drifts = [abs(d) for d in (run.nve_drift() for run in stable) if d is not None]
        failed = [run.failure_ps for run in runs if run.failure_ps is not None]
        failures = {kind: 0 for kind in FAILURE_KINDS}
        for run in runs:
            if run.failure_kind is not None:
                failures[run.failure_kind] += 1
        return {
            "runs": len(runs),
            "stable": len(stable),
            "first_failure_ps": min(failed) if failed else None,
            "nve_drift_meV_per_atom_ps": float(np.mean(drifts)) if drifts else None,
            "nve_drift_max_meV_per_atom_ps": float(np.max(drifts)) if drifts else None,
            "failures": {kind: n for kind, n in failures.items() if n},
            "closest_pair_A": _finite_or_none(min(run.closest_pair for run in runs)),
            "atoms": sorted({run.num_atoms for run in runs}),
        }

    def by_group(self) -> dict[str, dict[str, Any]]:
        """``{group: {"runs", "stable", "first_failure_ps", "nve_drift_meV_per_atom_ps",
        "nve_drift_max_meV_per_atom_ps", "failures": {kind: count}, "closest_pair_A",
        "atoms"}}`` (``closest_pair_A``: the shortest distance any run reached, Å)."""
        return {g: self._summary([r for r in self.runs if r.group == g]) for g in self.groups}

    def report(self) -> dict[str, Any]:
        """Everything as one JSON-ready dict (the evaluation JSON's ``"md"``)."""
        overall = self._summary(self.runs)
        return {
            "engine": self.engine,
            "grouping": self.grouping,
            "seconds": round(self.seconds, 2),
            "settings": self.settings.model_dump(mode="json"),
            "data_min_distance_A": _finite_or_none(self.data_min_distance),
            "min_distance_bound_A": self.min_distance,
            "lost_atom_distance_A": self.lost_distance,
            "runs": overall["runs"],
            "stable": overall["stable"],
            "first_failure_ps": overall["first_failure_ps"],
            "nve_drift_meV_per_atom_ps": overall["nve_drift_meV_per_atom_ps"],
            "groups": self.by_group(),
            "failed_runs": [
                {
                    "group": run.group,
                    "structure": run.structure,
                    "temperature_K": run.temperature_K,
                    "time_ps": run.failure_ps,
                    "kind": run.failure_kind,
                    "reason": run.failure,
                }
                for run in self.runs
                if not run.stable
            ],
        }

    def scalars(self) -> dict[str, float]:
        """Numbers for learning curves: ``stable_fraction``, ``survival_fraction`` (mean
        share of the planned time the runs lasted), ``first_failure_ps`` and
        ``nve_drift_meV_per_atom_ps`` (when defined), ``runs``, ``stable``."""
        overall = self._summary(self.runs)
        planned = self.planned_ps or 1.0
        lasted = [planned if run.stable else run.failure_ps for run in self.runs]
        out = {
            "runs": float(overall["runs"]),
            "stable": float(overall["stable"]),
            "stable_fraction": overall["stable"] / max(overall["runs"], 1),
            "survival_fraction": float(np.mean(lasted)) / planned if lasted else 0.0,
        }
        for key in ("first_failure_ps", "nve_drift_meV_per_atom_ps"):
            if overall[key] is not None:
                out[key] = float(overall[key])
        return out

    def plot(self, path: str | Path) -> Path:
        """Energy (per atom, from its start) and temperature of every run against time,
        one row per group; an x marks a failure, a dotted line the start of NVE."""
        from nvalchemi.hooks.reporting.plots import _figure, _save

        groups = self.groups
        figure = _figure(10.0, 2.6 * len(groups) + 0.6)
        axes = figure.subplots(len(groups), 2, squeeze=False)
        for row, group in enumerate(groups):
            energy_ax, temperature_ax = axes[row]
            runs = [run for run in self.runs if run.group == group]
            for number, run in enumerate(runs):
                color = f"C{number % 10}"
                times = np.asarray(run.times_ps)
                if times.size == 0:
                    continue
                potential = np.asarray(run.potential_energy)
                total = potential + np.asarray(run.kinetic_energy)
                label = f"#{run.structure} {run.temperature_K:.0f} K"
                energy_ax.plot(
                    times, (potential - potential[0]) / run.num_atoms, color=color, label=label
                )
                energy_ax.plot(
                    times,
                    (total - total[0]) / run.num_atoms,
                    color=color,
                    linestyle="--",
                    linewidth=0.8,
                )
                temperature_ax.plot(times, run.temperatures, color=color)
                temperature_ax.axhline(run.temperature_K, color=color, linestyle=":", linewidth=0.6)
                if run.nve_start is not None:
                    for ax in (energy_ax, temperature_ax):
                        ax.axvline(times[run.nve_start], color="0.5", linestyle=":", linewidth=0.8)
                if not run.stable and run.failure_ps is not None:
                    value = (potential[-1] - potential[0]) / run.num_atoms
                    if math.isfinite(value):
                        energy_ax.plot([run.failure_ps], [value], "x", color=color, markersize=9)
            stable = sum(run.stable for run in runs)
            energy_ax.set_title(f"{group}: {stable}/{len(runs)} stable", fontsize=9, loc="left")
            energy_ax.set_ylabel("E - E(0) (eV/atom)")
            temperature_ax.set_ylabel("T (K)")
            energy_ax.legend(fontsize=7, loc="best")
        for ax in axes[-1]:
            ax.set_xlabel("time (ps)")
        figure.suptitle(
            f"MD check ({self.engine}): solid potential, dashed total energy; "
            "NVT then NVE after the dotted line",
            fontsize=10,
        )
        height = 2.6 * len(groups) + 0.6
        figure.tight_layout(rect=(0, 0, 1, 1 - 0.45 / height))
        return _save(figure, path)


# --------------------------------------------------------------------------- entry points
def _engine(choice: str) -> str:
    from nvalchemi._optional import OptionalDependency

    if choice == "auto":
        return "torch-sim" if OptionalDependency.TORCH_SIM.is_available() else "ase"
    if choice == "torch-sim":
        OptionalDependency.TORCH_SIM.require("the MD check's torch-sim engine")
    return choice


def _cutoff_of(model: Any) -> float | None:
    """The model's neighbour cutoff (Å): its ``neighbor_config``'s, or an export's ``cutoff``."""
    config = getattr(model, "model_config", None)
    if config is None:
        cutoff = getattr(model, "cutoff", None)
        return float(cutoff) if cutoff else None
    return None if config.neighbor_config is None else float(config.neighbor_config.cutoff)


def run_md_check(
    model: Any,
    structures: MDStructures,
    settings: MDCheckSettings | None = None,
    *,
    device: Any = "cpu",
    head: str | None = None,
) -> MDCheckResult:
    """Run the MD check of ``model`` on ``structures``: a ``BaseModelMixin`` model
    (``head``: the readout head of a multi-head one), or with the torch-sim engine also a
    module that follows the export contract (a loaded export, a ``Potential``).

    The model's modes and active outputs are restored afterwards, and the global random
    state is left as it was (a check during training does not change the training).
    """
    import torch

    from nvalchemi.training.runtime import evaluating

    settings = settings or MDCheckSettings()
    engine = _engine(settings.engine)
    cutoff = _cutoff_of(model)
    data_min = structures.data_min_distance
    limits = _Limits(
        # No pair within 6 Å anywhere in the data: nothing to derive a bound from.
        min_distance=settings.min_distance_factor * data_min if math.isfinite(data_min) else 0.0,
        lost_distance=settings.lost_atom_distance or cutoff or DEFAULT_LOST_DISTANCE,
        energy_window=settings.energy_window_eV_per_atom,
    )
    runs = [
        MDRun(group, index, temperature, len(atoms))
        for index, (atoms, group) in enumerate(zip(structures.atoms, structures.groups))
        for temperature in settings.temperatures_K
    ]
    device = torch.device(device)
    started = time.perf_counter()
    forked = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), evaluating(model):
        torch.manual_seed(settings.seed)
        run_engine = _run_torch_sim if engine == "torch-sim" else _run_ase
        run_engine(model, runs, structures, settings, limits, device, head)
    return MDCheckResult(
        runs=runs,
        settings=settings,
        engine=engine,
        grouping=structures.grouping,
        data_min_distance=structures.data_min_distance,
        min_distance=limits.min_distance,
        lost_distance=limits.lost_distance,
        seconds=time.perf_counter() - started,
    )


def md_check(
    model: Any,
    readers: Sequence[Any],
    settings: MDCheckSettings | None = None,
    *,
    device: Any = "cpu",
    head: str | None = None,
) -> MDCheckResult:
    """Draw structures from ``readers`` (:func:`draw_structures`) and run the MD check.

    Example:
        >>> from nvalchemi.data.sources import open_reader
        >>> reader = open_reader("data/test.extxyz")  # doctest: +SKIP
        >>> result = md_check(model, [reader], MDCheckSettings(temperatures_K=[600]))  # doctest: +SKIP
        >>> result.by_group()["bulk"]["stable"]  # doctest: +SKIP
    """
    settings = settings or MDCheckSettings()
    structures = draw_structures(readers, settings)
    return run_md_check(model, structures, settings, device=device, head=head)


# --------------------------------------------------------------------------- training hook
class MDCheckHook:
    """A short MD check every ``every_n_validations`` validations (the 1st, K+1-th, ...).

    At ``AFTER_VALIDATION`` it checks the model that was validated (its EMA weights
    when the run keeps them, else the live ones) and adds ``summary[name] =``
    :meth:`MDCheckResult.scalars` to the validation summary, so the reporters write
    ``validation/md/stable_fraction``, ``validation/md/survival_fraction``,
    ``validation/md/first_failure_ps``, ``validation/md/nve_drift_meV_per_atom_ps``,
    ... next to the validation errors (register it before the reporting hook). The
    structures are drawn once, at the first check. Under DDP every rank runs it (the
    same seeded check), so every rank reports the same keys. The count of validations
    is checkpointed.

    Args:
        dataset: data file(s) to draw structures from (extxyz / ASE db / zarr), or
        readers: open readers (the hook does not close them).
        every_n_validations: check at every K-th validation.
        settings: an :class:`MDCheckSettings` or its dict (default:
            ``MDCheckSettings().short()``).
        name: the key in the validation summary.

    Example:
        >>> hook = MDCheckHook("data/val.extxyz", every_n_validations=5)  # doctest: +SKIP
        >>> strategy.register_hook(hook)  # before the ReportingOrchestrator  # doctest: +SKIP
    """

    frequency = 1
    stage = None

    def __init__(
        self,
        dataset: str | Sequence[str] | None = None,
        *,
        readers: Sequence[Any] | None = None,
        every_n_validations: int = 5,
        settings: MDCheckSettings | dict[str, Any] | None = None,
        name: str = "md",
    ) -> None:
        if (dataset is None) == (readers is None):
            raise ValueError("MDCheckHook needs one of dataset= (file paths) or readers=.")
        if isinstance(every_n_validations, bool) or not (
            isinstance(every_n_validations, int) and every_n_validations >= 1
        ):
            raise ValueError(
                f"every_n_validations must be an int >= 1; got {every_n_validations!r}."
            )
        self.paths = [dataset] if isinstance(dataset, str) else list(dataset or [])
        self.readers = None if readers is None else list(readers)
        self.every_n_validations = every_n_validations
        if settings is None:
            settings = MDCheckSettings().short()
        self.settings = MDCheckSettings.model_validate(settings)
        self.name = str(name)
        self.validations = 0
        self.last: MDCheckResult | None = None
        self._structures: MDStructures | None = None
        self._workflow: Any = None

    def _runs_on_stage(self, stage: Any) -> bool:
        return getattr(stage, "name", None) == "AFTER_VALIDATION"

    def on_register(self, workflow: Any) -> None:
        self._workflow = workflow

    def state_dict(self) -> dict[str, Any]:
        return {"validations": self.validations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.validations = int(state.get("validations", 0))

    def structures(self) -> MDStructures:
        """The structures every check runs (drawn at the first call)."""
        if self._structures is None:
            if self.readers is not None:
                self._structures = draw_structures(self.readers, self.settings)
            else:
                from nvalchemi.data.sources import open_reader

                readers = [open_reader(p, field="MDCheckHook.dataset") for p in self.paths]
                try:
                    self._structures = draw_structures(readers, self.settings)
                finally:
                    for reader in readers:
                        reader.close()
        return self._structures

    def __call__(self, ctx: Any, stage: Any) -> None:
        self.validations += 1
        if (self.validations - 1) % self.every_n_validations:
            return
        from nvalchemi.app.evaluation import final_model

        workflow = getattr(ctx, "workflow", None) or self._workflow
        summary = getattr(ctx, "validation", None)
        use_ema = (
            "never"
            if isinstance(summary, dict) and summary.get("model_source") == "live"
            else "auto"
        )
        model, _ = final_model(workflow, use_ema)
        if model is None:
            return
        devices = getattr(workflow, "devices", None) or ["cpu"]
        self.last = run_md_check(model, self.structures(), self.settings, device=devices[0])
        if isinstance(summary, dict):
            summary[self.name] = self.last.scalars()


def iter_table_rows(report: dict[str, Any]) -> Iterable[tuple[str, ...]]:
    """Rows ``(group, runs, stable, first failure ps, NVE drift, closest pair, failures)``
    of a :meth:`MDCheckResult.report`, as text for tables."""
    for group, entry in report["groups"].items():
        first = entry["first_failure_ps"]
        drift = entry["nve_drift_meV_per_atom_ps"]
        closest = entry["closest_pair_A"]
        failures = ", ".join(f"{kind} {n}" for kind, n in entry["failures"].items())
        yield (
            group,
            str(entry["runs"]),
            str(entry["stable"]),
            "-" if first is None else f"{first:.2f}",
            "-" if drift is None else f"{drift:.2g}",
            "-" if closest is None else f"{closest:.2f}",
            failures or "-",
        )
