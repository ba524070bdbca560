"""Uncertainty that means something: does a committee's spread track its errors?

For a model that outputs spreads (a :class:`~nvalchemi.models.committee.Committee`),
:func:`uncertainty_report` measures, overall and per structure group (``config_type``):

* ``spearman``: the rank correlation between the predicted uncertainty and the error:
  per atom, the force deviation ``|forces_std_i|`` (DP-GEN's per-atom deviation) against
  the force error ``|F_pred,i - F_ref,i|``; per structure, the energy std per atom against
  the absolute energy error per atom; the stress std against the stress error (norms).
* ``within_1_sigma`` .. ``within_3_sigma``: the fraction of errors within 1, 2, 3 sigma
  (force and stress components, energies), to compare with a Gaussian's 0.683, 0.954,
  0.997 (``expected``); ``uncalibrated_within_*`` the same before calibration.

The spreads are calibrated by one factor per quantity (energy, forces, stress) that
:func:`fit_calibration` fits on validation data (the maximum-likelihood scale of Gaussian
errors: ``s^2 = mean((error / sigma_raw)^2)``); the model stores them
(``Committee.uncertainty_scale``), so the calculator, the export and ``evaluate`` apply
them. ``spec run`` fits them on its validation data and stores them in a last checkpoint
(:func:`nvalchemi.app.evaluation.store_calibration`);
:func:`nvalchemi.app.evaluation.calibrate` does it for a model in Python.

Example:
    >>> import numpy as np
    >>> from types import SimpleNamespace
    >>> rng = np.random.default_rng(0)
    >>> sigma = rng.uniform(0.05, 0.2, size=(4000, 3))
    >>> ev = SimpleNamespace(
    ...     forces_pred=rng.normal(0.0, 2.0 * sigma), forces_ref=np.zeros((4000, 3)),
    ...     forces_std=sigma, uncertainty_scale={"forces": 1.0})
    >>> round(fit_calibration(ev)["forces"], 1)
    2.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "EXPECTED_COVERAGE",
    "SIGMAS",
    "SPREAD_QUANTITIES",
    "apply_calibration",
    "calibration_plot",
    "fit_calibration",
    "has_spreads",
    "set_calibration",
    "uncertainty_metrics",
    "uncertainty_report",
]

SPREAD_QUANTITIES = ("energy", "forces", "stress")
"""The quantities with a spread, in the order of ``Committee.uncertainty_scale``."""

SIGMAS = (1, 2, 3)
EXPECTED_COVERAGE = {k: math.erf(k / math.sqrt(2.0)) for k in SIGMAS}
"""The fraction of Gaussian errors within ``k`` sigma: 0.683, 0.954, 0.997."""


# ------------------------------------------------------------------------------ the numbers
def _pairs(evaluation: Any, quantity: str, structures: np.ndarray | None = None) -> Any:
    """``(errors, sigmas, rank_uncertainty, rank_error)`` of one quantity, or ``None``.

    ``errors``/``sigmas`` are the flat signed errors and their sigmas (components);
    the rank pair is what the Spearman correlation compares (per atom or structure).
    ``structures`` (a bool mask) keeps those structures (and their atoms).
    """
    if quantity == "energy":
        std = getattr(evaluation, "energy_std", None)
        if std is None:
            return None
        atoms = np.asarray(evaluation.atoms_per_structure, dtype=float)
        error = evaluation.energy_per_atom_pred - evaluation.energy_per_atom_ref
        sigma = std / atoms
        if structures is not None:
            error, sigma = error[structures], sigma[structures]
        return error, sigma, sigma, np.abs(error)
    if quantity == "forces":
        std = getattr(evaluation, "forces_std", None)
        if std is None or evaluation.forces_ref is None:
            return None
        error = evaluation.forces_pred - evaluation.forces_ref
        if structures is not None:
            owner = np.repeat(np.arange(len(structures)), evaluation.atoms_per_structure)
            error, std = error[structures[owner]], std[structures[owner]]
        return error, std, np.linalg.norm(std, axis=1), np.linalg.norm(error, axis=1)
    std = getattr(evaluation, "stress_std", None)
    if std is None or evaluation.stress_ref is None:
        return None
    error = evaluation.stress_pred - evaluation.stress_ref
    if structures is not None:
        error, std = error[structures], std[structures]
    return error, std, np.linalg.norm(std, axis=1), np.linalg.norm(error, axis=1)


def _finite(*arrays: np.ndarray) -> list[np.ndarray]:
    keep = np.ones(np.shape(arrays[0]), dtype=bool)
    for array in arrays:
        keep &= np.isfinite(array)
    return [np.asarray(a)[keep] for a in arrays]


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    x, y = _finite(np.asarray(x, float).reshape(-1), np.asarray(y, float).reshape(-1))
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    from scipy.stats import spearmanr  # scipy comes with ase

    return float(spearmanr(x, y).statistic)


def _scale_of(evaluation: Any, quantity: str) -> float:
    scales = getattr(evaluation, "uncertainty_scale", None) or {}
    return float(scales.get(quantity, 1.0))


def uncertainty_metrics(
    evaluation: Any, quantity: str, structures: np.ndarray | None = None
) -> dict[str, float] | None:
    """Spearman correlation and sigma coverage of one quantity (``None`` without spreads).

    Keys: ``count`` (entries with an error and a positive sigma), ``spearman``,
    ``within_k_sigma`` and ``uncalibrated_within_k_sigma`` for k = 1, 2, 3,
    ``rmse`` and ``rms_sigma`` (the root mean square of errors and sigmas).
    """
    found = _pairs(evaluation, quantity, structures)
    if found is None:
        return None
    error, sigma, rank_uncertainty, rank_error = found
    error, sigma = _finite(
        np.asarray(error, float).reshape(-1), np.asarray(sigma, float).reshape(-1)
    )
    positive = sigma > 0
    error, sigma = error[positive], sigma[positive]
    if error.size == 0:
        return None
    z = np.abs(error) / sigma
    raw = z * _scale_of(evaluation, quantity)
    out: dict[str, float] = {
        "count": int(error.size),
        "spearman": _spearman(rank_uncertainty, rank_error),
        "rmse": float(np.sqrt(np.mean(error**2))),
        "rms_sigma": float(np.sqrt(np.mean(sigma**2))),
    }
    for k in SIGMAS:
        out[f"within_{k}_sigma"] = float(np.mean(z <= k))
    for k in SIGMAS:
        out[f"uncalibrated_within_{k}_sigma"] = float(np.mean(raw <= k))
    return out


def _block(evaluation: Any, structures: np.ndarray | None) -> dict[str, dict[str, float]]:
    out = {}
    for quantity in SPREAD_QUANTITIES:
        found = uncertainty_metrics(evaluation, quantity, structures)
        if found is not None:
            out[quantity] = found
    return out


def has_spreads(evaluation: Any) -> bool:
    """Whether ``evaluation`` holds a model's spreads."""
    return any(getattr(evaluation, f"{q}_std", None) is not None for q in SPREAD_QUANTITIES)


def uncertainty_report(evaluation: Any) -> dict[str, Any]:
    """The JSON-ready ``"uncertainty"`` block: factors, overall and per-group metrics."""
    report: dict[str, Any] = {
        "calibration_factors": {q: _scale_of(evaluation, q) for q in SPREAD_QUANTITIES},
        "expected": {f"within_{k}_sigma": EXPECTED_COVERAGE[k] for k in SIGMAS},
        "overall": _block(evaluation, None),
        "by_group": {},
    }
    groups = getattr(evaluation, "groups", None)
    if groups is not None:
        for label in sorted(set(groups.tolist()), key=str):
            report["by_group"][str(label)] = _block(evaluation, groups == label)
    return report


# -------------------------------------------------------------------------- calibration
def fit_calibration(evaluation: Any) -> dict[str, float]:
    """``{quantity: factor}`` that calibrates the *uncalibrated* spreads of ``evaluation``.

    The factor is the maximum-likelihood scale of Gaussian errors with the spreads as
    relative sigmas: ``sqrt(mean((error / sigma_raw)^2))`` over entries with a positive
    sigma (``sigma_raw`` = the evaluated sigma over the factor it was evaluated with).
    Quantities without spreads or errors are left out.
    """
    factors = {}
    for quantity in SPREAD_QUANTITIES:
        found = _pairs(evaluation, quantity)
        if found is None:
            continue
        error, sigma = _finite(
            np.asarray(found[0], float).reshape(-1), np.asarray(found[1], float).reshape(-1)
        )
        keep = sigma > 0
        if not keep.any():
            continue
        raw = sigma[keep] / _scale_of(evaluation, quantity)
        factor = float(np.sqrt(np.mean((error[keep] / raw) ** 2)))
        if math.isfinite(factor) and factor > 0:
            factors[quantity] = factor
    return factors


def apply_calibration(evaluation: Any, factors: Mapping[str, float]) -> None:
    """Rescale ``evaluation``'s spreads from the factors they were evaluated with to
    ``factors`` (in place), as if the model had had ``factors`` all along."""
    scales = dict(getattr(evaluation, "uncertainty_scale", None) or {})
    for quantity, factor in factors.items():
        name = f"{quantity}_std"
        value = getattr(evaluation, name, None)
        if value is not None:
            setattr(evaluation, name, value * (factor / scales.get(quantity, 1.0)))
        scales[quantity] = float(factor)
    evaluation.uncertainty_scale = scales


def set_calibration(model: Any, factors: Mapping[str, float]) -> bool:
    """Give ``model`` (a committee) the calibration ``factors``; ``False`` if it takes none."""
    setter = getattr(model, "set_uncertainty_scale", None)
    if not callable(setter) or not factors:
        return False
    setter(**dict(factors))
    return True


# --------------------------------------------------------------------------------- plot
def calibration_plot(evaluation: Any, out_dir: str | Path) -> Path | None:
    """``calibration.png``: observed against expected coverage of Gaussian intervals,
    and the RMS error against the RMS sigma in bins of sigma, per quantity."""
    from statistics import NormalDist

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = {q: _pairs(evaluation, q) for q in SPREAD_QUANTITIES}
    found = {q: v for q, v in found.items() if v is not None}
    if not found:
        return None
    levels = np.linspace(0.01, 0.99, 50)
    widths = np.array([NormalDist().inv_cdf(0.5 + p / 2) for p in levels])
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    left.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="ideal")
    right_lo, right_hi = math.inf, 0.0
    for quantity, (error, sigma, _, _) in found.items():
        error, sigma = _finite(
            np.asarray(error, float).reshape(-1), np.asarray(sigma, float).reshape(-1)
        )
        keep = sigma > 0
        error, sigma = error[keep], sigma[keep]
        if error.size == 0:
            continue
        z = np.abs(error) / sigma
        left.plot(levels, [(z <= w).mean() for w in widths], label=quantity)
        order = np.argsort(sigma)
        bins = [b for b in np.array_split(order, min(20, max(1, order.size // 20))) if b.size]
        rms_sigma = [np.sqrt(np.mean(sigma[b] ** 2)) for b in bins]
        rmse = [np.sqrt(np.mean(error[b] ** 2)) for b in bins]
        right.loglog(rms_sigma, rmse, "o-", ms=3, label=quantity)
        right_lo = min(right_lo, *rms_sigma, *(e for e in rmse if e > 0))
        right_hi = max(right_hi, *rms_sigma, *rmse)
    left.set(
        xlabel="expected fraction within the interval",
        ylabel="observed fraction",
        title="calibration (Gaussian intervals)",
    )
    left.legend()
    if math.isfinite(right_lo) and right_hi > 0:
        right.plot([right_lo, right_hi], [right_lo, right_hi], color="0.6", lw=1, ls="--")
    right.set(xlabel="RMS predicted sigma (bin)", ylabel="RMS error (bin)", title="error vs sigma")
    right.legend()
    figure.tight_layout()
    path = Path(out_dir) / "calibration.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
