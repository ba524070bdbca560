"""EarlyStoppingHook: patience, min_delta, mode, state round trip, and stopping a real run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _training_support import Recorder, make_batches, strategy

from nvalchemi.training import EarlyStoppingHook, OptimizerConfig, TrainingStage, ValidationConfig


class FakeWorkflow:
    def __init__(self):
        self.reasons = []

    def request_stop(self, reason):
        self.reasons.append(reason)


def feed(hook, values, key="total_loss"):
    workflow = FakeWorkflow()
    stopped_at = None
    for i, value in enumerate(values):
        hook(
            SimpleNamespace(validation={key: value}, workflow=workflow),
            TrainingStage.AFTER_VALIDATION,
        )
        if workflow.reasons and stopped_at is None:
            stopped_at = i
    return stopped_at, workflow.reasons


def test_defaults_and_stage():
    hook = EarlyStoppingHook()
    assert (hook.metric, hook.patience, hook.min_delta, hook.mode) == ("total_loss", 10, 0.0, "min")
    assert hook.stage is TrainingStage.AFTER_VALIDATION and hook.frequency == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"patience": 0}, "patience must be an int >= 1"),
        ({"min_delta": -1.0}, "min_delta must be a finite number >= 0"),
        ({"mode": "up"}, "mode must be 'min' or 'max'"),
        ({"metric": ""}, "metric must be a summary key"),
    ],
)
def test_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EarlyStoppingHook(**kwargs)


def test_stops_after_patience_validations_without_improvement():
    stopped_at, reasons = feed(EarlyStoppingHook(patience=2), [1.0, 0.9, 0.95, 0.91, 0.5])
    assert stopped_at == 3
    assert "did not improve" in reasons[0] and "'total_loss'" in reasons[0]


def test_min_delta_and_max_mode():
    stopped_at, _ = feed(EarlyStoppingHook(patience=2, min_delta=0.1), [1.0, 0.95, 0.92])
    assert stopped_at == 2  # improvements smaller than min_delta do not count
    stopped_at, _ = feed(EarlyStoppingHook(patience=1, mode="max"), [0.1, 0.2, 0.2])
    assert stopped_at == 2


def test_non_finite_metrics_never_improve():
    hook = EarlyStoppingHook(patience=3)
    feed(hook, [float("nan"), torch.tensor(2.0)])
    assert hook.best == 2.0 and hook.bad_epochs == 0


def test_missing_metric_lists_the_available_ones():
    with pytest.raises(
        KeyError, match=r"'energy_mae' is not in the validation summary.*total_loss"
    ):
        feed(EarlyStoppingHook(metric="energy_mae"), [1.0])


def test_state_round_trip_and_mismatch():
    hook = EarlyStoppingHook(patience=5)
    feed(hook, [1.0, 2.0, 3.0])
    state = hook.state_dict()
    restored = EarlyStoppingHook(patience=5)
    restored.load_state_dict(state)
    assert (restored.best, restored.bad_epochs) == (1.0, 2)
    with pytest.raises(ValueError, match="metric="):
        EarlyStoppingHook(metric="energy_mae").load_state_dict(state)


def test_stops_a_run_with_consistent_counters():
    recorder = Recorder(stages=(TrainingStage.AFTER_EPOCH, TrainingStage.AFTER_TRAINING))
    hook = EarlyStoppingHook(patience=2)
    frozen = OptimizerConfig(torch.optim.SGD, {"lr": 0.0})  # the metric never improves
    config = ValidationConfig(validation_data=make_batches(1), every_n_epochs=1)
    s = strategy(
        optimizer_configs=frozen, num_epochs=20, validation_config=config, hooks=[hook, recorder]
    )
    s.run(make_batches(2))
    assert s.stop_reason is not None and "early stopping" in s.stop_reason
    assert (s.epoch_count, s.step_count, s.batch_count, s.epoch_step_count) == (3, 6, 6, 0)
    assert recorder.names() == ["AFTER_EPOCH"] * 3 + ["AFTER_TRAINING"]
    assert hook.bad_epochs == 2
