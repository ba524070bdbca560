"""Loss-weight schedules: ``weight = schedule(step, epoch)``.

Multiply a leaf loss by a schedule to get a scheduled component:

>>> from nvalchemi.training.losses import ForceMSELoss
>>> loss = LinearWeight(start=0.0, end=10.0, num_steps=1000) * ForceMSELoss()
>>> LinearWeight(start=0.0, end=10.0, num_steps=1000)(500, 0)
5.0

Schedules are frozen pydantic models (hashable, unknown keywords rejected) and round-trip
through specs. Any object with ``per_epoch``, ``__call__(step, epoch) -> float`` and
``to_spec()`` satisfies :class:`LossWeightSchedule` and can be used the same way.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator

if TYPE_CHECKING:
    from nvalchemi.training.spec import BaseSpec

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
        from nvalchemi.training.spec import create_model_spec

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
