"""Training a committee: its loss and its model spec in a job.

A :class:`~nvalchemi.models.committee.Committee` is trained by any strategy like one
model; only the loss must know it: :func:`committee_loss` applies a loss to every
member's own predictions (``predicted_energy_m0``, ...) and averages over the members,
so each member learns as if trained alone and the committee's spread stays honest.
:func:`committee_model_spec` wraps a member's model spec for ``strategy.model_specs``
(``train init --committee N`` writes both).

Example:
    >>> from nvalchemi.training.losses import EnergyMSELoss, ForceMSELoss
    >>> loss = committee_loss(EnergyMSELoss() + 10.0 * ForceMSELoss(), size=2)
    >>> [leaf.prediction_key for leaf in loss.components]
    ['predicted_energy_m0', 'predicted_forces_m0', 'predicted_energy_m1', 'predicted_forces_m1']
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from nvalchemi.models.committee import Committee, member_key
from nvalchemi.spec import BaseSpec, create_model_spec, create_model_spec_from_json

__all__ = ["committee_loss", "committee_model_spec"]


def committee_loss(loss: Any, size: int) -> Any:
    """``loss`` on each of ``size`` members' predictions, averaged over the members.

    ``loss`` is a leaf loss or a ``ComposedLossFunction`` whose leaves read the usual
    prediction keys (``predicted_energy``, ...); member ``i``'s copy reads
    ``predicted_energy_m{i}``. Weights, schedules, ``normalize_weights`` and the dtype
    policy are kept: the committee's total is the mean of the members' totals.
    """
    from nvalchemi.training.losses import ComposedLossFunction

    size = int(size)
    if size < 2:
        raise ValueError(f"a committee has at least 2 members; got size={size}.")
    if not isinstance(loss, ComposedLossFunction):
        loss = ComposedLossFunction([loss], normalize_weights=False)
    if any(leaf.prediction_key.rsplit("_m", 1)[-1].isdigit() for leaf in loss.components):
        raise ValueError(
            "the loss already reads member predictions (a key ending in _m<i>); pass the "
            "loss of one model."
        )
    members = []
    for index in range(size):
        leaves = []
        for leaf in loss.components:
            leaf = copy.deepcopy(leaf)
            leaf.prediction_key = member_key(leaf.prediction_key, index)
            leaves.append(leaf)
        members.append(
            ComposedLossFunction(
                leaves, weights=loss.weights, normalize_weights=loss.normalize_weights
            )
        )
    return ComposedLossFunction(
        members,
        weights=[1.0 / size] * size,
        normalize_weights=loss.normalize_weights,
        dtype_policy=loss.dtype_policy,
    )


def committee_model_spec(
    member: Mapping[str, Any] | BaseSpec, size: int, *, seed: int = 0, bootstrap: bool = False
) -> dict[str, Any]:
    """A ``strategy.model_specs`` entry: a committee of ``size`` members built from ``member``
    (a model spec or its JSON) under seeds ``seed``, ``seed + 1``, ...

    Example:
        >>> from nvalchemi.app.jobs.scaffold import painn_model_spec
        >>> spec = committee_model_spec(painn_model_spec(), 4)
        >>> spec["cls_path"], spec["size"], spec["members"][0]["cls_path"]
        ('nvalchemi.models.committee.Committee', 4, 'nvalchemi.models.painn.PaiNN')
    """
    if not isinstance(member, BaseSpec):
        member = create_model_spec_from_json(member, where="committee member")
    spec = create_model_spec(
        Committee, members=[member], size=int(size), seed=int(seed), bootstrap=bool(bootstrap)
    )
    return spec.model_dump()
