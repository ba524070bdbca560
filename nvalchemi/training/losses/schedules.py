"""Loss weights: numbers and schedules, ``weight = schedule(step, epoch)``.

Multiply a leaf loss by a schedule to get a scheduled component:

>>> from nvalchemi.training.losses import ForceMSELoss
>>> loss = LinearWeight(start=0.0, end=10.0, num_steps=1000) * ForceMSELoss()
>>> LinearWeight(start=0.0, end=10.0, num_steps=1000)(500, 0)
5.0

Schedules are frozen pydantic models (hashable, unknown keywords rejected) and round-trip
through specs. Any object with ``per_epoch``, ``__call__(step, epoch) -> float`` and
``to_spec()`` satisfies :class:`LossWeightSchedule` and can be used the same way.

A composition's weights are checked, scaled (a nested composition's weights times its
weight: a schedule times a number stays a lazy product) and resolved at each call by the
functions at the end of this module.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator

from nvalchemi.training.spec import BaseSpec, create_model_spec

__all__ = [
    "ConstantWeight",
    "CosineWeight",
    "LinearWeight",
    "LossWeightSchedule",
    "PiecewiseWeight",
]


@runtime_checkable
class LossWeightSchedule(Protocol):
    """A loss weight that changes during training.

    ``per_epoch=True`` schedules are indexed by epoch, others by optimizer step.
    ``to_spec()`` is needed for restartable (checkpointed) training.
    """

    per_epoch: bool

    def __call__(self, step: int, epoch: int) -> float: ...

    def to_spec(self) -> BaseSpec: ...


class _BaseWeightSchedule(BaseModel):
    """Base for built-in schedules; subclass it and implement ``value_at(index)``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    per_epoch: bool = False

    def __call__(self, step: int, epoch: int | None = None) -> float:
        if self.per_epoch and epoch is None:
            raise ValueError(
                f"{type(self).__name__} has per_epoch=True, so epoch must be provided "
                "(call it as schedule(step, epoch))."
            )
        return float(self.value_at(epoch if self.per_epoch else step))

    def value_at(self, index: int) -> float:
        raise NotImplementedError

    def to_spec(self) -> BaseSpec:
        """Spec that rebuilds this schedule."""
        return create_model_spec(type(self), **self.model_dump())


class ConstantWeight(_BaseWeightSchedule):
    """Always ``value``."""

    value: FiniteFloat

    def value_at(self, index: int) -> float:
        return self.value


class _RampWeight(_BaseWeightSchedule):
    start: FiniteFloat
    end: FiniteFloat
    num_steps: int = Field(gt=0)

    def _fraction(self, index: int) -> float:
        return min(max(index / self.num_steps, 0.0), 1.0)


class LinearWeight(_RampWeight):
    """``start`` at index <= 0, ``end`` at index >= ``num_steps``, linear in between."""

    def value_at(self, index: int) -> float:
        return self.start + (self.end - self.start) * self._fraction(index)


class CosineWeight(_RampWeight):
    """Like :class:`LinearWeight` with a half-cosine ramp (midpoint = average of the ends)."""

    def value_at(self, index: int) -> float:
        return self.start + (self.end - self.start) * 0.5 * (
            1.0 - math.cos(math.pi * self._fraction(index))
        )


class PiecewiseWeight(_BaseWeightSchedule):
    """``values[k]`` on the k-th interval cut by ``boundaries`` (a boundary starts the next one).

    >>> PiecewiseWeight(boundaries=(10,), values=(1.0, 0.1))(10, 0)
    0.1
    """

    boundaries: tuple[int, ...]
    values: tuple[FiniteFloat, ...]

    @model_validator(mode="after")
    def _check(self) -> PiecewiseWeight:
        if len(self.values) != len(self.boundaries) + 1:
            raise ValueError(
                f"values must have len(boundaries) + 1 = {len(self.boundaries) + 1} entries, "
                f"got {len(self.values)}"
            )
        if any(b < 0 for b in self.boundaries):
            raise ValueError(f"boundaries must be non-negative, got {self.boundaries}")
        if any(b >= c for b, c in zip(self.boundaries, self.boundaries[1:])):
            raise ValueError(f"boundaries must be strictly increasing, got {self.boundaries}")
        return self

    def value_at(self, index: int) -> float:
        return self.values[bisect.bisect_right(self.boundaries, index)]


# --------------------------------------------------------------- weights of a composition
Weight = float | LossWeightSchedule


def is_weight(value: Any) -> bool:
    """A number (not a bool) or a :class:`LossWeightSchedule`."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (numbers.Real, LossWeightSchedule))


@dataclasses.dataclass(frozen=True)
class _ProductWeight:
    """Lazy product of two weights (a schedule scaled by a number or by another schedule)."""

    left: Any
    right: Any

    @property
    def per_epoch(self) -> bool:
        return any(getattr(w, "per_epoch", False) for w in (self.left, self.right))

    def __call__(self, step: int, epoch: int) -> float:
        def value(w: Any) -> float:
            return float(w) if isinstance(w, numbers.Real) else w(step, epoch)

        return value(self.left) * value(self.right)

    def to_spec(self) -> BaseSpec:
        return create_model_spec(_ProductWeight, left=self.left, right=self.right)


def scale_weight(weight: Any, factor: Any) -> Any:
    """``weight * factor``: a float for two numbers, else a lazy :class:`_ProductWeight`."""
    if isinstance(factor, numbers.Real) and factor == 1.0:
        return weight
    if isinstance(weight, numbers.Real) and weight == 1.0:
        return float(factor) if isinstance(factor, numbers.Real) else factor
    if isinstance(weight, numbers.Real) and isinstance(factor, numbers.Real):
        return float(weight) * float(factor)
    return _ProductWeight(weight, factor)


def check_weight(index: int, weight: Any) -> Any:
    """``weights[index]`` of a composition as stored: ``None`` is 1.0, numbers are floats."""
    if weight is None:
        return 1.0
    if not is_weight(weight):
        raise TypeError(
            f"weights[{index}] must be a float or LossWeightSchedule (per_epoch, "
            f"__call__(step, epoch), to_spec()), got {type(weight).__name__}."
        )
    if isinstance(weight, numbers.Real):
        if not math.isfinite(weight):
            raise ValueError(
                f"weights[{index}]: weight {weight} is not finite; use a finite number."
            )
        return float(weight)
    return weight


def resolve_weight(name: str, weight: Any, step: int, epoch: int | None) -> float:
    """The value of component ``name``'s weight at ``(step, epoch)``, checked."""
    if isinstance(weight, float):
        return weight
    if weight.per_epoch and epoch is None:
        raise ValueError(
            f"epoch must be provided when the {name} loss weight schedule has per_epoch=True. "
            "Pass epoch=... to the loss call."
        )
    try:
        value = weight(step, 0 if epoch is None else epoch)
    except TypeError as exc:
        raise TypeError(
            f"{name}: weight schedule {type(weight).__name__} does not satisfy the "
            f"LossWeightSchedule contract __call__(step, epoch) -> float: {exc}"
        ) from exc
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name}: weight schedule {type(weight).__name__} returned "
            f"{type(value).__name__}; LossWeightSchedule.__call__ must return float."
        )
    if not math.isfinite(value):
        raise ValueError(
            f"{type(weight).__name__} for {name} returned non-finite weight {float(value)!r}; "
            f"schedules must return finite floats (at step={step}, epoch={epoch})."
        )
    return float(value)
