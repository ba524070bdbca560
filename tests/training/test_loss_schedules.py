"""Loss-weight schedules: values, per-epoch indexing, validation, immutability, specs."""

import json
import math

import pytest
from pydantic import ValidationError

from nvalchemi.training import create_model_spec, create_model_spec_from_json
from nvalchemi.training.losses import (
    ConstantWeight,
    CosineWeight,
    EnergyMSELoss,
    LinearWeight,
    LossWeightSchedule,
    PiecewiseWeight,
)


@pytest.mark.parametrize(
    ("schedule", "step", "expected"),
    [
        (ConstantWeight(value=2.5), 10**6, 2.5),
        (LinearWeight(start=0.0, end=10.0, num_steps=1000), -5, 0.0),
        (LinearWeight(start=0.0, end=10.0, num_steps=1000), 0, 0.0),
        (LinearWeight(start=0.0, end=10.0, num_steps=1000), 250, 2.5),
        (LinearWeight(start=0.0, end=10.0, num_steps=1000), 1000, 10.0),
        (LinearWeight(start=0.0, end=10.0, num_steps=1000), 5000, 10.0),
        (LinearWeight(start=4.0, end=2.0, num_steps=4), 1, 3.5),
        (CosineWeight(start=0.0, end=0.1, num_steps=5000), 0, 0.0),
        (CosineWeight(start=0.0, end=0.1, num_steps=5000), 2500, 0.05),
        (
            CosineWeight(start=0.0, end=0.1, num_steps=5000),
            1250,
            0.05 * (1 - math.cos(math.pi / 4)),
        ),
        (CosineWeight(start=0.0, end=0.1, num_steps=5000), 9999, 0.1),
        (PiecewiseWeight(boundaries=(10, 20), values=(1.0, 0.5, 0.1)), 9, 1.0),
        (PiecewiseWeight(boundaries=(10, 20), values=(1.0, 0.5, 0.1)), 10, 0.5),
        (PiecewiseWeight(boundaries=(10, 20), values=(1.0, 0.5, 0.1)), 19, 0.5),
        (PiecewiseWeight(boundaries=(10, 20), values=(1.0, 0.5, 0.1)), 20, 0.1),
    ],
)
def test_values_at_chosen_steps(schedule, step, expected):
    value = schedule(step, 0)
    assert type(value) is float
    assert value == pytest.approx(expected)


def test_per_epoch_schedules_index_by_epoch():
    schedule = LinearWeight(start=0.0, end=1.0, num_steps=4, per_epoch=True)
    assert schedule(1000, 1) == 0.25
    assert LinearWeight(start=0.0, end=1.0, num_steps=4)(1, 1000) == 0.25
    with pytest.raises(ValueError, match=r"per_epoch=True, so epoch must be provided"):
        schedule(3)


def test_per_epoch_without_epoch_in_a_composition_names_the_component():
    loss_fn = LinearWeight(start=0.0, end=1.0, num_steps=4, per_epoch=True) * EnergyMSELoss()
    with pytest.raises(
        ValueError, match=r"epoch must be provided when the EnergyMSELoss loss weight"
    ):
        loss_fn.current_weight(step=3)
    assert loss_fn.current_weight(step=3, epoch=2) == [1.0]


@pytest.mark.parametrize(
    ("cls", "kwargs", "fragment"),
    [
        (LinearWeight, {"start": 0.0, "end": 1.0, "num_steps": 0}, "greater than 0"),
        (CosineWeight, {"start": 0.0, "end": 1.0}, "num_steps"),
        (ConstantWeight, {"value": float("inf")}, "finite"),
        (LinearWeight, {"start": 0.0, "end": 1.0, "num_steps": 5, "num_step": 3}, "Extra inputs"),
        (ConstantWeight, {"value": 1.0, "per_epochs": True}, "Extra inputs"),
        (PiecewiseWeight, {"boundaries": (5,), "values": (1.0,)}, "len\\(boundaries\\) \\+ 1"),
        (PiecewiseWeight, {"boundaries": (5, 5), "values": (1.0, 2.0, 3.0)}, "strictly increasing"),
        (PiecewiseWeight, {"boundaries": (-1,), "values": (1.0, 2.0)}, "non-negative"),
    ],
)
def test_invalid_arguments_are_rejected(cls, kwargs, fragment):
    with pytest.raises(ValidationError, match=fragment):
        cls(**kwargs)


def test_schedules_are_frozen_and_hashable():
    schedule = LinearWeight(start=0.0, end=1.0, num_steps=10)
    with pytest.raises(ValidationError):
        schedule.end = 2.0
    assert hash(schedule) == hash(LinearWeight(start=0.0, end=1.0, num_steps=10))
    assert len({schedule, LinearWeight(start=0.0, end=1.0, num_steps=10)}) == 1


@pytest.mark.parametrize(
    "schedule",
    [
        ConstantWeight(value=3.0),
        LinearWeight(start=0.0, end=10.0, num_steps=1000, per_epoch=True),
        CosineWeight(start=1.0, end=0.1, num_steps=5000),
        PiecewiseWeight(boundaries=(10, 20), values=(1.0, 0.5, 0.1)),
    ],
)
def test_spec_round_trip_is_exact(schedule):
    assert isinstance(schedule, LossWeightSchedule)
    data = json.loads(json.dumps(schedule.to_spec().model_dump()))
    spec = create_model_spec_from_json(data)
    assert spec.model_dump() == data
    rebuilt = spec.build()
    assert rebuilt == schedule and type(rebuilt) is type(schedule)
    assert [rebuilt(s, s) for s in (0, 7, 15, 30)] == [schedule(s, s) for s in (0, 7, 15, 30)]


class StepDecay:
    """A custom schedule satisfying the protocol without subclassing."""

    per_epoch = False

    def __init__(self, every: int = 10):
        self.every = every

    def __call__(self, step, epoch):
        return 0.5 ** (step // self.every)

    def to_spec(self):
        return create_model_spec(StepDecay, every=self.every)


def test_custom_protocol_schedule():
    assert isinstance(StepDecay(), LossWeightSchedule)
    loss_fn = StepDecay(every=2) * EnergyMSELoss()
    loss_fn.normalize_weights = False
    assert loss_fn.current_weight(step=4) == [0.25]


class NoSpec:
    per_epoch = False

    def __call__(self, step, epoch):
        return 1.0


def test_schedule_without_to_spec_is_not_a_weight():
    assert not isinstance(NoSpec(), LossWeightSchedule)
    with pytest.raises(TypeError):
        NoSpec() * EnergyMSELoss()
