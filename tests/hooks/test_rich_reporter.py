"""RichReporter: plain log lines off a terminal, the live dashboard on one, validation table."""

from __future__ import annotations

import io
from types import SimpleNamespace

import _reporting_support as support
import pytest
import torch
from rich.console import Console

from nvalchemi.hooks.context import DynamicsContext, TrainContext
from nvalchemi.hooks.reporting import (
    DynamicsRichLayout,
    ReportingOrchestrator,
    ReportingState,
    RichReporter,
    TrainingRichLayout,
)
from nvalchemi.hooks.reporting.rich_layouts import choose_plot_keys, format_duration
from nvalchemi.training.stages import TrainingStage

STEP = TrainingStage.AFTER_OPTIMIZER_STEP
VALIDATION = TrainingStage.AFTER_VALIDATION


def plain_console() -> Console:
    return Console(file=io.StringIO(), width=160)


def terminal_console() -> Console:
    return Console(file=io.StringIO(), width=140, force_terminal=True, color_system="truecolor")


def run_epochs(hook, *, epochs=2, batches_per_epoch=4, validate=True):
    """Drive ``hook`` like the strategy: steps, then a validation after each epoch."""
    ctx = support.make_ctx(batches_per_epoch=batches_per_epoch, num_epochs=epochs)
    for _ in range(epochs * batches_per_epoch):
        hook(ctx, STEP)
        support.advance(
            ctx, batches_per_epoch=batches_per_epoch, energy=0.5 / (ctx.step_count + 2), forces=0.1
        )
        if validate and ctx.epoch_step_count == 0:
            ctx.validation = support.validation_summary(
                loss=0.4 / ctx.epoch, forces_mae=0.05 / ctx.epoch
            )
            hook(ctx, VALIDATION)
    return ctx


def render_text(reporter: RichReporter, width: int = 140) -> str:
    console = Console(file=io.StringIO(), width=width, record=True)
    console.print(reporter.renderable())
    return console.export_text()


# --------------------------------------------------------------------------- plain mode
def test_non_terminal_output_is_plain_lines_without_escape_codes():
    reporter = RichReporter(console=plain_console())
    assert reporter.plain
    hook = ReportingOrchestrator([reporter], stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"})
    with hook:
        run_epochs(hook)
    lines = reporter.console.file.getvalue().splitlines()
    assert "\x1b" not in reporter.console.file.getvalue()
    train = [line for line in lines if line.startswith("epoch")]
    assert len(train) == 8
    assert train[0].startswith("epoch 1/2 batch 1/4 step 1/8 loss ")
    assert "[EnergyMSELoss " in train[0] and "ForceMSELoss" in train[0]
    assert " lr 1.0e-03" in train[0]
    assert train[4].startswith("epoch 2/2 batch 1/4 step 5/8")
    assert "structures/s" in train[1] and "atoms/s" in train[1] and " eta " in train[1]
    validation = [line for line in lines if line.startswith("validation")]
    assert len(validation) == 2
    assert validation[0].startswith("validation epoch 1 step 4 loss 4.00e-01")
    assert "EnergyMSELoss 2.00e-01" in validation[0] and "forces MAE 50 meV/Å" in validation[0]
    assert "energy_mae_per_atom 2.00e-03" in validation[0] and "model_source" not in validation[0]


def test_plain_mode_prints_new_messages_once():
    reporter = RichReporter(console=plain_console())
    state = ReportingState()
    state.add_message("warning", "learning rate looks large")
    ctx = support.make_ctx()
    reporter.report(ctx, STEP, state)
    reporter.report(ctx, STEP, state)
    text = reporter.console.file.getvalue()
    assert text.count("[warning] message: learning rate looks large") == 1


def test_rank_zero_only_by_default():
    reporter = RichReporter(console=plain_console())
    reporter.report(support.make_ctx(global_rank=1), STEP, ReportingState())
    assert reporter.console.file.getvalue() == "" and reporter.history == {}
    everywhere = RichReporter(console=plain_console(), rank_zero_only=False)
    everywhere.report(support.make_ctx(global_rank=1), STEP, ReportingState())
    assert everywhere.console.file.getvalue().startswith("epoch 1/2")


def test_rank_reduction_requires_all_ranks():
    assert RichReporter(console=plain_console(), rank_reduction="mean").requires_all_ranks
    assert not RichReporter(console=plain_console(), rank_reduction="none").requires_all_ranks


# --------------------------------------------------------------------------- terminal mode
def test_live_dashboard_in_a_terminal_draws_progress_and_validation():
    reporter = RichReporter(console=terminal_console(), refresh_per_second=20)
    assert not reporter.plain
    hook = ReportingOrchestrator([reporter], stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"})
    with hook:
        assert reporter._live is not None  # the live display runs while reporting
        run_epochs(hook)
    assert reporter._live is None
    output = reporter.console.file.getvalue()
    assert "\x1b[" in output  # a real terminal rendering
    assert "Epoch 2/2" in output and "Validation" in output and "forces MAE" in output
    assert not any(line.startswith("epoch ") for line in output.splitlines())


def test_validation_table_renders_every_scalar_metric():
    reporter = RichReporter(console=terminal_console())
    state = ReportingState()
    run_epochs(lambda ctx, stage: reporter.report(ctx, stage, state))
    text = render_text(reporter)
    assert "Validation · epoch 2 · step 8" in text
    for row in (
        "loss/EnergyMSELoss",
        "energy_mae_per_atom",
        "forces MAE",
        "forces RMSE",
        "25 meV/Å",
    ):  # metrics with a unit are shown in meV, labelled
        assert row in text
    assert "▼ 50.0%" in text  # loss halved between the two validations
    assert "★ now" in text
    assert "model_source" not in text and "num_batches" not in text


def test_dashboard_shows_progress_rates_and_component_charts():
    reporter = RichReporter(console=terminal_console(), max_plots=3)
    state = ReportingState()
    state.rates.steps_per_s = state.rates.batches_per_s = 1.0
    state.rates.structures_per_s, state.rates.atoms_per_s = 16.0, 128.0
    ctx = support.make_ctx(step=5, epoch=1, batches_per_epoch=4, num_epochs=3)
    reporter.report(ctx, STEP, state)
    reporter.report(ctx, STEP, state)
    text = render_text(reporter)
    assert "Epoch 2/3" in text and "2/4" in text and "6/12" in text
    assert "eta 00:02" in text and "eta 00:06" in text  # 2 batches / 6 steps left at 1 per second
    assert "16 structures/s" in text and "128 atoms/s" in text and "lr 1.00e-03" in text
    # The component charts are drawn (the reference's preferred keys never matched them).
    assert "loss/EnergyMSELoss (log)" in text and "loss/ForceMSELoss (log)" in text


def test_default_plot_keys_prefer_total_then_components_then_one_lr():
    keys = [
        "grad_norm",
        "loss/total",
        "optimizer/lr",
        "scheduler/lr",
        "loss/ForceMSELoss/unweighted",
        "loss/EnergyMSELoss/unweighted",
        "loss/EnergyMSELoss/weight",
        "throughput/atoms_per_s",
    ]
    assert choose_plot_keys(keys, None, TrainingRichLayout.preferred_keys, 4) == [
        "loss/total",
        "loss/EnergyMSELoss/unweighted",
        "loss/ForceMSELoss/unweighted",
        "scheduler/lr",
    ]
    assert choose_plot_keys(keys, ("grad_*",), (), 3) == ["grad_norm"]
    assert choose_plot_keys(keys, None, TrainingRichLayout.preferred_keys, 0) == []


def test_max_scalars_truncates_the_latest_table():
    reporter = RichReporter(console=terminal_console(), max_scalars=2, max_plots=0)
    reporter.report(support.make_ctx(), STEP, ReportingState())
    text = render_text(reporter)
    assert "... " in text and " omitted" in text


def test_not_entered_terminal_reporter_prints_the_dashboard_per_report():
    reporter = RichReporter(console=terminal_console())
    reporter.report(support.make_ctx(), STEP, ReportingState())
    assert "Latest" in reporter.console.file.getvalue()


# --------------------------------------------------------------------------- history, layouts, options
def test_history_records_completed_steps_and_is_bounded():
    reporter = RichReporter(console=plain_console(), history_size=3)
    ctx = support.make_ctx()
    for _ in range(5):
        reporter.report(ctx, STEP, ReportingState())
        support.advance(ctx)
    points = reporter.history["loss/total"]
    assert [step for step, _ in points] == [3, 4, 5]


def test_layout_auto_selection():
    training = RichReporter(console=plain_console())
    training.report(TrainContext(batch=None, loss=torch.tensor(1.0)), STEP, ReportingState())
    assert isinstance(training.layout, TrainingRichLayout)

    dynamics = RichReporter(console=plain_console())
    batch = SimpleNamespace(
        energy=torch.tensor([[-1.0], [-3.0]]),
        forces=torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 1.0]]),
        num_graphs=2,
    )
    ctx = DynamicsContext(batch=batch, step_count=7, converged_mask=torch.tensor([True, False]))
    dynamics.report(ctx, "AFTER_STEP", ReportingState())
    assert isinstance(dynamics.layout, DynamicsRichLayout)
    line = dynamics.console.file.getvalue()
    assert line.startswith("step 7 energy -2.00e+00 fmax 5.00e+00 converged_fraction 5.00e-01")

    unknown = RichReporter(console=plain_console())
    unknown.report(SimpleNamespace(global_rank=0), "CUSTOM", ReportingState())
    assert unknown.layout is None and unknown.console.file.getvalue() == ""
    strict = RichReporter(console=plain_console(), strict_layout=True)
    with pytest.raises(ValueError, match="layout='training'"):
        strict.report(SimpleNamespace(global_rank=0), "CUSTOM", ReportingState())


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("precision", -1),
        ("max_scalars", 0),
        ("history_size", 0),
        ("max_plots", -1),
        ("plot_height", 3),
        ("refresh_per_second", 0),
    ],
)
def test_invalid_options_raise_value_error(option, value):
    with pytest.raises(ValueError, match=option):
        RichReporter(**{option: value})


def test_layout_argument_validation():
    with pytest.raises(ValueError, match="Unknown RichReporter layout"):
        RichReporter(layout="fancy")
    with pytest.raises(TypeError, match="plain_line"):
        RichReporter(layout=SimpleNamespace(render=lambda view: None))
    assert isinstance(RichReporter(layout="dynamics").layout, DynamicsRichLayout)


def test_preview_and_seed_history():
    console = Console(file=io.StringIO(), width=120, record=True, force_terminal=True)
    reporter = RichReporter.preview(console=console)
    text = reporter.console.export_text()
    assert "Epoch 3/10" in text and "energy_mae_per_atom" in text and "scheduler/lr" in text
    seeded = RichReporter(console=plain_console())
    seeded.seed_history({"loss/total": [3.0, 2.0, 1.0]}, steps=[10, 20, 30])
    assert seeded.history["loss/total"] == [(10, 3.0), (20, 2.0), (30, 1.0)]
    assert "loss/total" in render_text(seeded)


def test_format_duration():
    assert format_duration(0) == "00:00"
    assert format_duration(59.6) == "01:00"
    assert format_duration(3600 * 5 + 61) == "5:01:01"
    assert format_duration(None) == "--:--"
