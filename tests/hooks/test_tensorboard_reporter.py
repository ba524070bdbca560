"""TensorBoardReporter: tags and steps, rank rules, writer lifecycle, missing extra."""

from __future__ import annotations

import sys

import _reporting_support as support
import pytest

from nvalchemi._optional import OptionalDependency, OptionalDependencyError
from nvalchemi.hooks.reporting import (
    ReportingOrchestrator,
    ReportingState,
    TensorBoardReporter,
    TensorBoardWriter,
)
from nvalchemi.training.stages import TrainingStage

# Tests with an injected writer run without the extra; the others need it.
requires_tensorboard = pytest.mark.skipif(
    not OptionalDependency.TENSORBOARD.is_available(), reason="tensorboard extra not installed"
)

STEP = TrainingStage.AFTER_OPTIMIZER_STEP


class FakeWriter:
    def __init__(self):
        self.scalars, self.flushes, self.closed = [], 0, 0

    def add_scalar(self, tag, scalar_value, global_step=None):
        self.scalars.append((tag, scalar_value, global_step))

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed += 1


def test_writes_sorted_tags_at_the_completed_step():
    writer = FakeWriter()
    assert isinstance(writer, TensorBoardWriter)
    reporter = TensorBoardReporter("unused", writer=writer, include_memory=False)
    reporter.report(support.make_ctx(step=9), STEP, ReportingState())
    tags = [tag for tag, _, _ in writer.scalars]
    assert tags == sorted(tags)
    assert {step for _, _, step in writer.scalars} == {10}
    values = {tag: value for tag, value, _ in writer.scalars}
    assert values["loss/EnergyMSELoss/unweighted"] == pytest.approx(0.5)
    assert values["optimizer/lr"] == pytest.approx(1e-3)
    assert writer.flushes == 1


def test_tag_prefix_flush_option_and_validation_tags():
    writer = FakeWriter()
    reporter = TensorBoardReporter("unused", writer=writer, tag_prefix="run1/", flush=False)
    ctx = support.make_ctx(step=3)
    ctx.validation = support.validation_summary()
    reporter.report(ctx, TrainingStage.AFTER_VALIDATION, ReportingState())
    tags = {tag for tag, _, _ in writer.scalars}
    assert "run1/validation/forces_mae_eV_per_A" in tags and "run1/validation/loss/total" in tags
    assert not any(tag.startswith("run1/loss/") for tag in tags)
    assert writer.flushes == 0


@requires_tensorboard
def test_rank_zero_only_by_default_and_rank_token_rules(tmp_path):
    writer = FakeWriter()
    reporter = TensorBoardReporter("unused", writer=writer)
    reporter.report(support.make_ctx(global_rank=1), STEP, ReportingState())
    assert writer.scalars == []
    with pytest.raises(ValueError, match=r"\{rank\}"):
        TensorBoardReporter(tmp_path / "tb", rank_zero_only=False)
    per_rank = TensorBoardReporter(str(tmp_path / "tb" / "rank{rank}"), rank_zero_only=False)
    assert per_rank.resolved_log_dir(3).endswith("rank3")
    assert not per_rank.requires_all_ranks
    reduced = TensorBoardReporter(tmp_path / "tb", rank_zero_only=False, rank_reduction="mean")
    assert reduced.requires_all_ranks


def test_close_closes_the_writer_and_orchestrator_closes_the_reporter():
    writer = FakeWriter()
    reporter = TensorBoardReporter("unused", writer=writer)
    with ReportingOrchestrator([reporter]) as hook:
        hook(support.make_ctx(), STEP)
    assert writer.closed == 1


@requires_tensorboard
def test_real_summary_writer_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reporter = TensorBoardReporter(tmp_path / "tb")
    ctx = support.make_ctx()
    with reporter:
        for _ in range(3):
            reporter.report(ctx, STEP, ReportingState())
            support.advance(ctx, energy=0.25)
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    events = accumulator.Scalars("loss/EnergyMSELoss/unweighted")
    assert [e.step for e in events] == [1, 2, 3]
    assert [round(e.value, 4) for e in events] == [0.5, 0.25, 0.25]


def test_missing_tensorboard_raises_optional_dependency_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(OptionalDependencyError, match=r"nvalchemi-training\[tensorboard\]"):
        TensorBoardReporter("runs/x")
    TensorBoardReporter("runs/x", writer=FakeWriter())  # an injected writer needs nothing


def test_bad_writer_is_rejected():
    with pytest.raises(TypeError, match="add_scalar"):
        TensorBoardReporter("x", writer=object())
    with pytest.raises(TypeError, match="custom_scalars"):
        TensorBoardReporter("x", writer=FakeWriter(), custom_scalars=[1])
