"""``--minutes`` (``TimeBudgetHook``): a clean stop, agreed by every rank under DDP."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from _ranks import run_ranks

from nvalchemi.training.stages import TrainingStage
from nvalchemi.training.time_budget import TimeBudgetHook

RANKS = Path(__file__).with_name("_time_budget_ranks.py")


class _Strategy:
    step_count = 0
    distributed_manager = None
    stop_reason = None

    def request_stop(self, reason):
        self.stop_reason = self.stop_reason or reason


def test_a_single_process_stops_after_the_step_that_spends_the_budget():
    hook, strategy = TimeBudgetHook(1e-9, check_interval=5), _Strategy()
    hook(SimpleNamespace(workflow=strategy, step_count=0), TrainingStage.BEFORE_TRAINING)
    hook(SimpleNamespace(workflow=strategy, step_count=1), TrainingStage.AFTER_BATCH)
    assert strategy.stop_reason.startswith("time budget of")  # no interval in one process


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="positive number of seconds"):
        TimeBudgetHook(0)
    with pytest.raises(ValueError, match="check_interval"):
        TimeBudgetHook(10, check_interval=0)


@pytest.mark.distributed
def test_ranks_with_skewed_budgets_stop_at_the_same_step():
    results = run_ranks(RANKS, 2, rendezvous="tcp", timeout=180)  # both ranks must exit 0
    steps = [r["step"] for r in results]
    assert steps == [3, 3]  # the first agreement (check_interval=3), on both ranks
    assert all(r["reason"].startswith("time budget of") for r in results)
