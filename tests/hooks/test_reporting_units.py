"""Units everywhere a number is shown: keys, loss labels, meV displays, the EMA warm-up, a budget."""

from __future__ import annotations

import io
import json

import _reporting_support as support
from rich.console import Console

from nvalchemi.hooks.reporting import JSONLinesReporter, ReportingOrchestrator, RichReporter
from nvalchemi.hooks.reporting.units import display, key_unit, loss_units, metric_key
from nvalchemi.training.losses import (
    ComposedLossFunction,
    EnergyMAELoss,
    EnergyMSELoss,
    ForceMSELoss,
    StressMSELoss,
)
from nvalchemi.training.stages import TrainingStage

STEP, VALIDATION = TrainingStage.AFTER_OPTIMIZER_STEP, TrainingStage.AFTER_VALIDATION


def test_metric_keys_carry_units_and_display_in_mev():
    assert [
        metric_key(m)
        for m in (
            "energy_mae",
            "energy_per_atom_rmse",
            "forces_mae",
            "stress_rmse",
            "num_structures",
        )
    ] == [
        "energy_mae_eV",
        "energy_per_atom_rmse_eV_per_atom",
        "forces_mae_eV_per_A",
        "stress_rmse_eV_per_A3",
        "num_structures",
    ]
    assert key_unit("validation/stress_mae_eV_per_A3") == "eV/Å³"
    assert display("validation/energy_mae_eV", 1.2345) == ("energy (total) MAE", "1234 meV")
    assert display("validation/forces_rmse_eV_per_A", 0.0171) == ("forces RMSE", "17.1 meV/Å")
    assert display("loss/total", 1.0) is None


def test_loss_terms_are_labelled_with_the_unit_of_their_value():
    loss = ComposedLossFunction(
        [
            EnergyMSELoss(per_atom=True),
            EnergyMAELoss(per_atom=False),
            ForceMSELoss(),
            StressMSELoss(),
        ]
    )
    assert loss_units(loss) == {
        "EnergyMSELoss": "(eV/atom)²",
        "EnergyMAELoss": "eV",
        "ForceMSELoss": "(eV/Å)²",
        "StressMSELoss": "(eV/Å³)²",
    }


class _EMA:
    decay, num_updates = 0.995, 40


def _lines(ctx, summary_source="ema", budget=None):
    console = Console(file=io.StringIO(), width=400)
    custom = None if budget is None else {"budget": lambda c, s: budget}
    reporter = RichReporter(console=console, custom_scalars=custom)
    with ReportingOrchestrator(
        [reporter], stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"}
    ) as hook:
        hook(ctx, STEP)
        ctx.validation = {**support.validation_summary(), "model_source": summary_source}
        hook(ctx, VALIDATION)
    return console.file.getvalue().splitlines()


def _ctx():
    ctx = support.make_ctx()
    ctx.workflow.loss_fn = ComposedLossFunction([EnergyMSELoss(per_atom=True), ForceMSELoss()])
    ctx.workflow.hooks = [_EMA()]
    return ctx


def test_progress_and_validation_lines_carry_units_and_the_ema_warm_up():
    train, validation = _lines(_ctx())
    assert "loss 1.50e+00 (weighted sum) [EnergyMSELoss 5.00e-01 (eV/atom)², " in train
    assert "ForceMSELoss 1.00e-01 (eV/Å)²]" in train
    assert validation.startswith(
        "validation epoch 1 step 0 (EMA weights, warming up: 40 updates, "
        "82% of the average is still the initial weights)"
    )
    assert "forces MAE 50 meV/Å forces RMSE 65 meV/Å" in validation
    _, live = _lines(_ctx(), summary_source="live")
    assert "EMA" not in live


def test_a_time_budget_shows_the_time_left_and_the_planned_end():
    (train, _) = _lines(
        _ctx(), budget={"seconds": 300.0, "remaining_s": 200.0, "planned_steps": 600.0}
    )
    assert "step 1/600" in train and "03:20 left of 05:00" in train


def test_metrics_jsonl_says_the_unit_of_every_key_once(tmp_path):
    ctx = _ctx()
    reporter = JSONLinesReporter(tmp_path)
    with ReportingOrchestrator(
        [reporter], stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"}
    ) as hook:
        for _ in range(2):
            hook(ctx, STEP)
            support.advance(ctx, energy=0.2)
        ctx.validation = support.validation_summary()
        hook(ctx, VALIDATION)
    rows = [json.loads(line) for line in reporter.path.read_text().splitlines()]
    assert rows[0]["units"]["loss/ForceMSELoss/unweighted"] == "(eV/Å)²"
    assert "units" not in rows[1]  # said once
    assert rows[2]["units"]["validation/forces_mae_eV_per_A"] == "eV/Å"
