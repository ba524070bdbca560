"""Consistency checks that every model in nvalchemi (and yours) should pass.

Each check evaluates the model on transformed copies of a few structures and raises
``AssertionError`` with the largest deviation when the model misbehaves:

* :func:`check_permutation_invariance`: renumbering atoms permutes forces only;
* :func:`check_translation_invariance`, :func:`check_rotation_equivariance`:
  energy invariant, forces rotate as vectors, stress as a rank-2 tensor;
* :func:`check_forces_finite_difference`: ``F = -dE/dr``;
* :func:`check_stress_finite_difference`: ``sigma = (1/V) dE/d(epsilon)``;
* :func:`check_batch_consistency`: a batch gives what each structure gives alone;
* :func:`check_dtype_agreement`: the model in its dtype agrees with a float64 copy.

:func:`check_model` runs them all. Neighbour lists are recomputed for every
transformed structure from ``model.model_config.neighbor_config``.

Example:
    >>> from ase.build import bulk
    >>> from nvalchemi.models import PaiNN
    >>> from nvalchemi.models.testing import check_model
    >>> atoms = bulk("Cu", "fcc", a=3.6) * (2, 1, 1)
    >>> atoms.rattle(0.05, seed=0)
    >>> report = check_model(PaiNN(cutoff=4.0, hidden_channels=8, elements=[29]), [atoms])
    >>> sorted(report)[:3]
    ['batch', 'dtype', 'forces_fd']
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from nvalchemi.data.atomic_data import AtomicData
from nvalchemi.data.batch import Batch

__all__ = [
    "ALL_CHECKS",
    "check_batch_consistency",
    "check_dtype_agreement",
    "check_forces_finite_difference",
    "check_model",
    "check_permutation_invariance",
    "check_rotation_equivariance",
    "check_stress_finite_difference",
    "check_translation_invariance",
    "evaluate",
    "random_rotation",
]

ALL_CHECKS = (
    "permutation",
    "translation",
    "rotation",
    "forces_fd",
    "stress_fd",
    "batch",
    "dtype",
)

Outputs = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- helpers
def _as_data(structure: Any) -> AtomicData:
    """A float64 ``AtomicData`` with only species, positions, cell and pbc."""
    if not isinstance(structure, AtomicData):
        structure = AtomicData.from_atoms(structure, dtype=torch.float64)
    fields = {
        "atomic_numbers": structure["atomic_numbers"],
        "positions": structure["positions"].detach().double(),
    }
    if "cell" in structure and "pbc" in structure and bool(structure["pbc"].any()):
        fields["cell"] = structure["cell"].detach().double()
        fields["pbc"] = structure["pbc"]
    return AtomicData(**fields)


def _with(data: AtomicData, **changes: torch.Tensor) -> AtomicData:
    fields = {k: data[k] for k in ("atomic_numbers", "positions", "cell", "pbc") if k in data}
    fields.update(changes)
    return AtomicData(**fields)


def _is_periodic(data: AtomicData) -> bool:
    return "cell" in data and bool(data["pbc"].any())


def _supported(model: Any, wanted: Iterable[str]) -> set[str]:
    return set(wanted) & set(model.model_config.outputs)


def evaluate(
    model: Any, structures: Sequence[AtomicData], outputs: Iterable[str] = ("energy", "forces")
) -> Outputs:
    """Run ``model`` (eval mode) on a batch of ``structures`` with neighbour lists
    computed for it; returns detached outputs. The model's mode and active outputs
    are restored afterwards."""
    batch = Batch.from_data_list(list(structures))
    config = model.model_config.neighbor_config
    if config is not None:
        from nvalchemi.data.neighbors import compute_neighbors

        compute_neighbors(batch, config=config)
    previous_active = model.model_config.active_outputs
    was_training = model.training
    wanted = _supported(model, outputs)
    if "stress" in wanted and "cell" not in batch:
        wanted.discard("stress")
    try:
        model.model_config.active_outputs = wanted
        model.eval()
        result = model(batch)
    finally:
        model.model_config.active_outputs = previous_active
        model.train(was_training)
    return {k: v.detach() for k, v in result.items() if v is not None}


def _tolerance(model: Any) -> tuple[float, float]:
    dtype = _model_dtype(model)
    return (1e-7, 1e-6) if dtype == torch.float64 else (2e-4, 2e-3)


def _model_dtype(model: Any) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.get_default_dtype()


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> float:
    got, want = got.double(), want.double()
    error = float((got - want).abs().max()) if got.numel() else 0.0
    if not torch.allclose(got, want, atol=atol, rtol=rtol):
        raise AssertionError(
            f"{name}: max deviation {error:.3e} exceeds atol={atol:g}, rtol={rtol:g}.\n"
            f"got  {got.flatten()[:6].tolist()}\nwant {want.flatten()[:6].tolist()}"
        )
    return error


def random_rotation(generator: torch.Generator | None = None) -> torch.Tensor:
    """A random proper rotation matrix ``[3, 3]`` (float64)."""
    q, r = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64, generator=generator))
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def _tol(model: Any, atol: float | None, rtol: float | None) -> tuple[float, float]:
    default_atol, default_rtol = _tolerance(model)
    return (default_atol if atol is None else atol), (default_rtol if rtol is None else rtol)


# ---------------------------------------------------------------------------- checks
def check_permutation_invariance(
    model: Any, structures: Sequence[Any], *, seed: int = 0, atol=None, rtol=None
) -> float:
    """Renumbering the atoms leaves energy and stress unchanged and permutes forces."""
    atol, rtol = _tol(model, atol, rtol)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for i, structure in enumerate(structures):
        data = _as_data(structure)
        perm = torch.randperm(data.num_nodes, generator=gen)
        moved = _with(
            data, atomic_numbers=data["atomic_numbers"][perm], positions=data["positions"][perm]
        )
        outputs = ("energy", "forces", "stress")
        ref, new = evaluate(model, [data], outputs), evaluate(model, [moved], outputs)
        for key in ref:
            want = ref[key][perm] if key == "forces" else ref[key]
            worst = max(worst, _compare(f"permutation[{i}] {key}", new[key], want, atol, rtol))
    return worst


def check_translation_invariance(
    model: Any, structures: Sequence[Any], *, seed: int = 0, atol=None, rtol=None
) -> float:
    """A rigid translation leaves energy, forces and stress unchanged."""
    atol, rtol = _tol(model, atol, rtol)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for i, structure in enumerate(structures):
        data = _as_data(structure)
        shift = torch.randn(3, dtype=torch.float64, generator=gen) * 3.0
        moved = _with(data, positions=data["positions"] + shift)
        outputs = ("energy", "forces", "stress")
        ref, new = evaluate(model, [data], outputs), evaluate(model, [moved], outputs)
        for key in ref:
            worst = max(worst, _compare(f"translation[{i}] {key}", new[key], ref[key], atol, rtol))
    return worst


def check_rotation_equivariance(
    model: Any, structures: Sequence[Any], *, seed: int = 0, atol=None, rtol=None
) -> float:
    """Rotating positions and cell: energy invariant, ``F -> F R^T``, ``sigma -> R sigma R^T``."""
    atol, rtol = _tol(model, atol, rtol)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for i, structure in enumerate(structures):
        data = _as_data(structure)
        rot = random_rotation(gen)
        changes = {"positions": data["positions"] @ rot.T}
        if "cell" in data:
            changes["cell"] = data["cell"] @ rot.T
        moved = _with(data, **changes)
        outputs = ("energy", "forces", "stress")
        ref, new = evaluate(model, [data], outputs), evaluate(model, [moved], outputs)
        for key in ref:
            want = ref[key]
            if key == "forces":
                want = want.double() @ rot.T
            elif key == "stress":
                want = rot @ want.double() @ rot.T
            worst = max(worst, _compare(f"rotation[{i}] {key}", new[key], want, atol, rtol))
    return worst


def check_forces_finite_difference(
    model: Any,
    structures: Sequence[Any],
    *,
    step: float = 1e-4,
    num_components: int = 6,
    seed: int = 0,
    atol: float | None = None,
    rtol: float | None = None,
) -> float:
    """Forces equal ``-(E(r + h) - E(r - h)) / 2h`` for random atom components."""
    if atol is None:
        atol = 1e-5 if _model_dtype(model) == torch.float64 else 2e-2
    rtol = 1e-4 if rtol is None else rtol
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for i, structure in enumerate(structures):
        data = _as_data(structure)
        forces = evaluate(model, [data], ("energy", "forces"))["forces"].double()
        picks = torch.randint(0, data.num_nodes * 3, (num_components,), generator=gen).tolist()
        got, want = [], []
        for flat in picks:
            atom, axis = divmod(flat, 3)
            energies = []
            for sign in (1.0, -1.0):
                pos = data["positions"].clone()
                pos[atom, axis] += sign * step
                energies.append(
                    evaluate(model, [_with(data, positions=pos)], ("energy",))["energy"]
                )
            want.append(-(energies[0] - energies[1]).double().sum() / (2 * step))
            got.append(forces[atom, axis])
        worst = max(
            worst,
            _compare(
                f"finite-difference forces[{i}]", torch.stack(got), torch.stack(want), atol, rtol
            ),
        )
    return worst


def check_stress_finite_difference(
    model: Any,
    structures: Sequence[Any],
    *,
    step: float = 1e-5,
    atol: float | None = None,
    rtol: float | None = None,
) -> float:
    """Stress equals ``(1/V) dE/d(epsilon)`` by central differences of a symmetric strain
    (periodic structures only; others are skipped)."""
    if "stress" not in model.model_config.outputs:
        return 0.0
    if atol is None:
        atol = 1e-6 if _model_dtype(model) == torch.float64 else 1e-3
    rtol = 1e-4 if rtol is None else rtol
    worst = 0.0
    for i, structure in enumerate(structures):
        data = _as_data(structure)
        if not _is_periodic(data):
            continue
        stress = evaluate(model, [data], ("energy", "stress"))["stress"][0].double()
        cell = data["cell"][0]
        volume = float(torch.det(cell).abs())
        fd = torch.zeros(3, 3, dtype=torch.float64)
        for a in range(3):
            for b in range(a, 3):
                energies = []
                for sign in (1.0, -1.0):
                    eps = torch.zeros(3, 3, dtype=torch.float64)
                    eps[a, b] += sign * step / (1 if a == b else 2)
                    eps[b, a] = eps[a, b]
                    deform = torch.eye(3, dtype=torch.float64) + eps
                    strained = _with(
                        data,
                        positions=data["positions"] @ deform,
                        cell=(cell @ deform).unsqueeze(0),
                    )
                    energies.append(
                        evaluate(model, [strained], ("energy",))["energy"].double().sum()
                    )
                derivative = (energies[0] - energies[1]) / (2 * step)
                fd[a, b] = fd[b, a] = derivative / volume
        worst = max(worst, _compare(f"finite-difference stress[{i}]", stress, fd, atol, rtol))
    return worst


def check_batch_consistency(
    model: Any, structures: Sequence[Any], *, atol=None, rtol=None
) -> float:
    """A batch of structures gives the outputs of each structure evaluated alone."""
    atol, rtol = _tol(model, atol, rtol)
    datas = [_as_data(s) for s in structures]
    outputs = ("energy", "forces", "stress")
    all_periodic = all(_is_periodic(d) for d in datas)
    batched = evaluate(model, datas, outputs if all_periodic else ("energy", "forces"))
    worst, start = 0.0, 0
    for i, data in enumerate(datas):
        alone = evaluate(model, [data], outputs if all_periodic else ("energy", "forces"))
        stop = start + data.num_nodes
        for key, value in alone.items():
            got = batched[key][start:stop] if key == "forces" else batched[key][i : i + 1]
            worst = max(worst, _compare(f"batch[{i}] {key}", got, value, atol, rtol))
        start = stop
    return worst


def check_dtype_agreement(
    model: Any, structures: Sequence[Any], *, atol: float = 1e-3, rtol: float = 1e-3
) -> float:
    """The model in its own dtype agrees with a float64 copy of itself (same weights)."""
    reference = copy.deepcopy(model).to(torch.float64)
    datas = [_as_data(s) for s in structures]
    worst = 0.0
    for i, data in enumerate(datas):
        outputs = ("energy", "forces", "stress") if _is_periodic(data) else ("energy", "forces")
        got, want = evaluate(model, [data], outputs), evaluate(reference, [data], outputs)
        for key in got:
            if got[key].dtype != _model_dtype(model):
                raise AssertionError(
                    f"dtype[{i}] {key} has dtype {got[key].dtype}; expected the model dtype "
                    f"{_model_dtype(model)}."
                )
            worst = max(worst, _compare(f"dtype[{i}] {key}", got[key], want[key], atol, rtol))
    return worst


_CHECKS: dict[str, Callable[..., float]] = {
    "permutation": check_permutation_invariance,
    "translation": check_translation_invariance,
    "rotation": check_rotation_equivariance,
    "forces_fd": check_forces_finite_difference,
    "stress_fd": check_stress_finite_difference,
    "batch": check_batch_consistency,
}


def check_model(
    model: Any,
    structures: Sequence[Any],
    *,
    checks: Iterable[str] = ALL_CHECKS,
    dtype: torch.dtype | None = torch.float64,
) -> dict[str, float]:
    """Run the consistency checks on ``model`` and return the worst deviation of each.

    Args:
        model: an ``nn.Module`` + ``BaseModelMixin`` model (not modified).
        structures: ``AtomicData`` or ``ase.Atoms``; include periodic ones to check
            stress.
        checks: names from :data:`ALL_CHECKS` (e.g. drop ``"rotation"`` for a
            model that is not rotation invariant by design).
        dtype: run the checks on a copy of the model in this dtype (float64 makes
            the finite differences sharp); ``None`` uses the model as is. The
            ``"dtype"`` check always compares the model as given with float64.

    Raises:
        AssertionError: naming the failing check, structure, output and deviation.
        ValueError: an unknown check name.
    """
    checks = list(checks)
    unknown = sorted(set(checks) - set(ALL_CHECKS))
    if unknown:
        raise ValueError(f"Unknown checks {unknown}; choose from {list(ALL_CHECKS)}.")
    subject = model if dtype is None else copy.deepcopy(model).to(dtype)
    report = {}
    for name in checks:
        if name == "dtype":
            report[name] = check_dtype_agreement(model, structures)
        else:
            report[name] = _CHECKS[name](subject, structures)
    return report
