"""Explore: molecular dynamics with the committee, keeping frames and their deviation.

For every start structure, temperature and isotropic strain (a trajectory), Langevin NVT
with the committee as the potential: velocities drawn at the temperature, a frame kept
every ``every`` steps with its committee max force deviation
(``info["max_force_deviation"]``, eV/Å, calibrated) and energy spread
(``info["energy_std"]``, eV). A trajectory ends early at a frame above ``stop_deviation``
(or a non-finite one) or when the model fails on it (atoms collapsed): its frames so far
are kept.

Two engines (``explore.engine``; ``auto``: torch-sim when installed):

* **torch-sim**: every trajectory in one batch (a torch-sim ``SimState``), the committee
  as one model through :class:`~nvalchemi.models.TorchSimModel` (the deviation of every
  system comes with the forces of each step); a trajectory that ends leaves the batch.
  torch-sim has one periodicity flag per batch, so periodic structures (slabs get a cell
  with vacuum along their open direction, :func:`~nvalchemi.app.md_check.as_fully_periodic`)
  and open ones run as two batches; frames keep the start structure's own cell and pbc.
* **ase**: one trajectory at a time with ASE's Langevin and
  :class:`~nvalchemi.models.CommitteeCalculator`.

Random numbers come from ``(seed, iteration)`` (and the trajectory, for ASE), so
exploring again gives the same frames with the same engine.

Example:
    >>> frames, runs = explore(committee, starts, job.explore, job.select,  # doctest: +SKIP
    ...                        seed=0, iteration=0)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["engine_of", "explore", "trajectories"]

_VACUUM = 6.0
"""Å: the vacuum of a slab's boxed cell beyond its extent, for a model without a cutoff."""


def trajectories(starts: Sequence[Any], settings: Any) -> list[tuple[int, float, float]]:
    """``(start index, temperature K, strain)`` of every trajectory, in order."""
    return [
        (index, float(t), float(strain))
        for index in range(len(starts))
        for t in settings.temperatures
        for strain in settings.strains
    ]


def engine_of(settings: Any) -> str:
    """The engine ``settings.engine`` means here: ``"torch-sim"`` or ``"ase"``."""
    from nvalchemi._optional import OptionalDependency

    if settings.engine == "auto":
        return "torch-sim" if OptionalDependency.TORCH_SIM.is_available() else "ase"
    if settings.engine == "torch-sim":
        OptionalDependency.TORCH_SIM.require("explore.engine: torch-sim")
    return settings.engine


def _strained(atoms: Any, strain: float) -> Any:
    atoms = atoms.copy()
    atoms.calc = None
    if strain and atoms.pbc.any():
        atoms.set_cell(atoms.cell[:] * (1.0 + strain), scale_atoms=True)
    return atoms


def _frame(
    atoms: Any,
    positions: Any,
    spread: tuple[float, float],
    number: int,
    step: int,
    plan: tuple,
) -> Any:
    """A copy of ``atoms`` at ``positions``; its spread ``(max force deviation, energy
    std)`` and origin in ``info``."""
    frame = atoms.copy()
    frame.calc = None
    frame.set_constraint()
    frame.positions = np.asarray(positions, dtype=float)
    _, temperature, strain = plan
    frame.info.update(
        max_force_deviation=spread[0],
        energy_std=spread[1],
        learn_run=number,
        learn_step=step,
        temperature_K=temperature,
        strain=strain,
    )
    return frame


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def explore(
    model: Any,
    starts: Sequence[Any],
    settings: Any,
    select: Any,
    *,
    seed: int,
    iteration: int,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Run every trajectory; returns ``(frames, runs)``.

    ``frames``: ``Atoms`` without labels, trajectory by trajectory, ``info`` holding
    ``max_force_deviation``, ``energy_std``, ``learn_run``, ``learn_step``,
    ``temperature_K``, ``strain`` (and the start structure's own info, e.g.
    ``config_type``). ``runs``: per trajectory its settings, frames kept and how it
    ended (``"steps"``, ``"deviation"`` or the model's error). ``progress(done, total)`` is called as the trajectories advance.
    """
    plan = trajectories(starts, settings)
    systems = [_strained(starts[index], strain) for index, _, strain in plan]
    runs = [
        {"start": index, "temperature_K": t, "strain": strain, "frames": 0}
        for index, t, strain in plan
    ]
    frames: list[list[Any]] = [[] for _ in plan]
    engine = _explore_torch_sim if engine_of(settings) == "torch-sim" else _explore_ase
    engine(model, systems, plan, runs, frames, settings, select, seed, iteration, progress)
    return [frame for found in frames for frame in found], runs


# --------------------------------------------------------------------------------- ASE
def _explore_ase(
    model: Any,
    systems: list[Any],
    plan: list[tuple],
    runs: list[dict[str, Any]],
    frames: list[list[Any]],
    settings: Any,
    select: Any,
    seed: int,
    iteration: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """One trajectory at a time: ASE's Langevin with the committee as calculator."""
    from ase import units
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary

    from nvalchemi.models.committee_calculator import CommitteeCalculator

    stop = settings.stop_above(select)
    for number, atoms in enumerate(systems):
        temperature = plan[number][1]
        rng = np.random.default_rng([int(seed), int(iteration), number])
        atoms = atoms.copy()
        atoms.calc = CommitteeCalculator(model)
        MaxwellBoltzmannDistribution(atoms, temperature_K=temperature, rng=rng)
        Stationary(atoms)
        atoms.set_constraint(FixCom())  # no drift of the whole cell (ASE's advice)
        dynamics = Langevin(
            atoms,
            timestep=settings.timestep_fs * units.fs,
            temperature_K=temperature,
            friction=settings.friction_per_fs / units.fs,
            fixcm=False,
            rng=rng,
        )
        run, ended, step = runs[number], "steps", 0
        try:
            while step < settings.steps:
                chunk = min(settings.every, settings.steps - step)
                dynamics.run(chunk)
                step += chunk
                deviation = float(atoms.calc.get_property("max_force_deviation", atoms))
                spread = (deviation, float(atoms.calc.get_property("energy_std", atoms)))
                frames[number].append(
                    _frame(atoms, atoms.positions, spread, number, step, plan[number])
                )
                run["frames"] += 1
                if not np.isfinite(deviation) or deviation > stop:
                    ended = "deviation"
                    break
        except Exception as exc:  # the model failed on what MD made of the structure
            ended = _error(exc)
        run["ended"], run["steps"] = ended, step
        if progress is not None:
            progress(number + 1, len(systems))


# --------------------------------------------------------------------------- torch-sim
def _explore_torch_sim(
    model: Any,
    systems: list[Any],
    plan: list[tuple],
    runs: list[dict[str, Any]],
    frames: list[list[Any]],
    settings: Any,
    select: Any,
    seed: int,
    iteration: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Every trajectory at once: one torch-sim batch of the periodic systems, one of the
    open ones; the deviation of each step comes from the model's own output."""
    import torch

    from nvalchemi.app.md_check import as_fully_periodic
    from nvalchemi.models.torchsim import TorchSimModel

    adapter = TorchSimModel(model, compute_stress=False)
    boxed = [as_fully_periodic(atoms, adapter.cutoff or _VACUUM) for atoms in systems]
    groups = [
        [k for k, atoms in enumerate(boxed) if atoms.pbc.all()],
        [k for k, atoms in enumerate(boxed) if not atoms.pbc.all()],
    ]
    groups = [members for members in groups if members]
    chunks = -(-settings.steps // settings.every)
    done = [0]

    def advanced() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], chunks * len(groups))

    last: dict[str, Any] = {}
    handle = adapter.register_forward_hook(lambda module, args, out: last.update(out=out))
    # One seed for the whole exploration: the initial momenta and every Langevin kick.
    entropy = int(np.random.SeedSequence([int(seed), int(iteration)]).generate_state(1)[0])
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(entropy)
            for members in groups:
                walk = _Walk(adapter, last, members, boxed, systems, plan, runs, frames)
                walk.run(settings, settings.stop_above(select), entropy, advanced)
    finally:
        handle.remove()


class _Walk:
    """Langevin NVT of one torch-sim batch; systems leave it when their trajectory ends."""

    def __init__(
        self,
        adapter: Any,
        last: dict[str, Any],
        members: list[int],
        boxed: list[Any],
        systems: list[Any],
        plan: list[tuple],
        runs: list[dict[str, Any]],
        frames: list[list[Any]],
    ) -> None:
        self.adapter, self.last, self.members = adapter, last, members
        self.boxed, self.systems, self.plan = boxed, systems, plan
        self.runs, self.frames = runs, frames

    def run(self, settings: Any, stop: float, seed: int, advanced: Callable[[], None]) -> None:
        import torch
        import torch_sim as ts

        units = ts.units.MetalUnits
        options = {"dtype": self.adapter.dtype, "device": self.adapter.device}
        temperatures = [self.plan[k][1] for k in self.members]
        kT = torch.tensor(temperatures, **options) * units.temperature
        dt = torch.tensor(settings.timestep_fs * 1e-3 * units.time, **options)
        gamma = torch.tensor(settings.friction_per_fs * 1e3 / units.time, **options)
        init, update = ts.integrators.nvt_langevin(
            model=self.adapter, dt=dt, kT=kT, gamma=gamma, seed=seed
        )
        state = ts.io.atoms_to_state(
            [self.boxed[k] for k in self.members], self.adapter.device, self.adapter.dtype
        )
        # alive: positions in self.members of the systems still in the batch
        md, alive = self._step(lambda s, rows: init(s, kT=kT[rows]), state, [*range(len(kT))])
        step = 0
        while md is not None and step < settings.steps:
            chunk = min(settings.every, settings.steps - step)
            for _ in range(chunk):
                md, alive = self._step(lambda s, rows: update(s, kT=kT[rows]), md, alive, step)
                step += 1
                if md is None:
                    break
            if md is not None:
                md, alive = self._record(md, alive, step, stop)
            advanced()
        for k in alive:
            self._end(k, "steps", step)

    def _step(
        self, step: Callable[[Any, Any], Any], md: Any, alive: list[int], steps: int = 0
    ) -> tuple[Any, list[int]]:
        """``step(state, rows)`` on the batch; if it raises, system by system, ending the
        trajectories of those that raise. Returns ``(state, alive)``.

        The integrators replace a state's tensors rather than writing into them, so a
        shallow copy keeps the step's start for the retry.
        """
        import torch
        from torch_sim.state import concatenate_states

        def rows(positions: list[int]) -> Any:
            return torch.tensor(positions, dtype=torch.long, device=md.device)

        try:
            return step(copy.copy(md), rows(alive)), alive
        except Exception as exc:
            if len(alive) == 1:
                self._end(alive[0], _error(exc), steps)
                return None, []
        survivors, kept = [], []
        for position, k in enumerate(alive):
            try:
                survivors.append(step(copy.copy(md[[position]]), rows([k])))
                kept.append(k)
            except Exception as exc:
                self._end(k, _error(exc), steps)
        return (concatenate_states(survivors) if survivors else None), kept

    def _record(self, md: Any, alive: list[int], step: int, stop: float) -> tuple[Any, list[int]]:
        """Keep a frame of every system in the batch; drop those whose deviation ends them.

        The model's last call was on the batch at its current positions (the integrator's
        last force call), unless a failure made the last step go system by system: then
        the last output is one system's, and the batch is evaluated again."""
        out = self.last.get("out")
        if out is None or out["max_force_deviation"].shape[0] != len(alive):
            out = self.adapter(md)
        deviations = out["max_force_deviation"].detach().double().cpu().numpy().reshape(-1)
        energy_stds = out["energy_std"].detach().double().cpu().numpy().reshape(-1)
        positions = md.positions.detach().double().cpu().numpy()
        counts = [len(self.boxed[self.members[k]]) for k in alive]
        starts = np.concatenate([[0], np.cumsum(counts)])
        keep = []
        for position, k in enumerate(alive):
            number = self.members[k]
            deviation = float(deviations[position])
            here = positions[starts[position] : starts[position + 1]]
            spread = (deviation, float(energy_stds[position]))
            self.frames[number].append(
                _frame(self.systems[number], here, spread, number, step, self.plan[number])
            )
            self.runs[number]["frames"] += 1
            if not np.isfinite(deviation) or deviation > stop:
                self._end(k, "deviation", step)
            else:
                keep.append(position)
        if len(keep) == len(alive):
            return md, alive
        if not keep:
            return None, []
        return md[keep], [alive[p] for p in keep]

    def _end(self, k: int, ended: str, steps: int) -> None:
        run = self.runs[self.members[k]]
        run["ended"], run["steps"] = ended, steps
