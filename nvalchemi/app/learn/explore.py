"""Explore: molecular dynamics with the committee, keeping frames and their deviation.

For every start structure, temperature and isotropic strain, Langevin NVT (ASE) with the
committee as calculator (:class:`~nvalchemi.models.CommitteeCalculator`): velocities
drawn at the temperature, a frame kept every ``every`` steps with its committee max force
deviation (``info["max_force_deviation"]``, eV/Å, calibrated). A trajectory ends early at
a frame above ``stop_deviation`` or when the calculator fails (atoms collapsed): its
frames so far are kept. Random numbers come from ``(seed, iteration, trajectory)``, so
exploring again gives the same frames.

Example:
    >>> frames, runs = explore(committee, starts, job.explore, job.select,  # doctest: +SKIP
    ...                        seed=0, iteration=0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["explore", "trajectories"]


def trajectories(starts: Sequence[Any], settings: Any) -> list[tuple[int, float, float]]:
    """``(start index, temperature K, strain)`` of every trajectory, in order."""
    return [
        (index, float(t), float(strain))
        for index in range(len(starts))
        for t in settings.temperatures
        for strain in settings.strains
    ]


def _strained(atoms: Any, strain: float) -> Any:
    atoms = atoms.copy()
    atoms.calc = None
    if strain and atoms.pbc.any():
        atoms.set_cell(atoms.cell[:] * (1.0 + strain), scale_atoms=True)
    return atoms


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

    ``frames``: ``Atoms`` without labels, ``info`` holding ``max_force_deviation``,
    ``learn_run``, ``learn_step``, ``temperature_K``, ``strain`` (and the start structure's
    own info, e.g. ``config_type``). ``runs``: per trajectory its settings, frames kept and
    how it ended (``"steps"``, ``"deviation"`` or the calculator's error).
    ``progress(done, total)`` is called after each trajectory.
    """
    from ase import units
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary

    from nvalchemi.models.committee_calculator import CommitteeCalculator

    plan = trajectories(starts, settings)
    stop = settings.stop_above(select)
    frames: list[Any] = []
    runs: list[dict[str, Any]] = []
    for number, (index, temperature, strain) in enumerate(plan):
        rng = np.random.default_rng([int(seed), int(iteration), number])
        atoms = _strained(starts[index], strain)
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
        run = {"start": index, "temperature_K": temperature, "strain": strain, "frames": 0}
        ended = "steps"
        step = 0
        try:
            while step < settings.steps:
                chunk = min(settings.every, settings.steps - step)
                dynamics.run(chunk)
                step += chunk
                deviation = float(atoms.calc.get_property("max_force_deviation", atoms))
                frame = atoms.copy()
                frame.calc = None
                frame.set_constraint()
                frame.info.update(
                    max_force_deviation=deviation,
                    learn_run=number,
                    learn_step=step,
                    temperature_K=temperature,
                    strain=strain,
                )
                frames.append(frame)
                run["frames"] += 1
                if not np.isfinite(deviation) or deviation > stop:
                    ended = "deviation"
                    break
        except Exception as exc:  # the model failed on what MD made of the structure
            ended = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        run["ended"], run["steps"] = ended, step
        runs.append(run)
        if progress is not None:
            progress(number + 1, len(plan))
    return frames, runs
