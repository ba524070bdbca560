"""A hook that holds others (the reporting orchestrator) is checkpointed only with state.

Every run of the CLI has a ``ReportingOrchestrator``; with no reporter that has state it
used to write ``{"ReportingOrchestrator": {}}`` into every ``hooks.pt``, and a Python user
resuming without it was warned that its state "was not restored".
"""

from __future__ import annotations

import warnings

import _checkpoint_support as C
import torch

from nvalchemi.hooks.reporting import ReportingOrchestrator
from nvalchemi.training import TrainingStrategy


class Printer:
    def report(self, ctx, stage, state):
        pass


class RunId(Printer):
    def __init__(self):
        self.run_id = "abc"

    def state_dict(self):
        return {"run_id": self.run_id}

    def load_state_dict(self, state):
        self.run_id = state["run_id"]


def _not_restored(caught) -> list[str]:
    return [str(w.message) for w in caught if "was not restored" in str(w.message)]


def test_a_reporting_orchestrator_without_stateful_reporters_is_not_checkpointed(tmp_path):
    strategy = C.strategy(num_steps=1, hooks=[ReportingOrchestrator([Printer()])])
    assert list(strategy.iter_checkpointable_hooks()) == []
    strategy.run(C.batches(1))
    strategy.save_checkpoint(tmp_path)
    assert not list(tmp_path.glob("checkpoints/*/hooks.pt"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainingStrategy.load_checkpoint(tmp_path)  # without the orchestrator
    assert _not_restored(caught) == []


def test_stateful_reporters_are_still_saved_and_restored(tmp_path):
    reporter = RunId()
    orchestrator = ReportingOrchestrator([reporter])
    strategy = C.strategy(num_steps=1, hooks=[orchestrator])
    assert [key for key, _ in strategy.iter_checkpointable_hooks()] == ["ReportingOrchestrator"]
    strategy.run(C.batches(1))
    strategy.save_checkpoint(tmp_path)
    fresh = RunId()
    fresh.run_id = "other"
    TrainingStrategy.load_checkpoint(tmp_path, hooks=[ReportingOrchestrator([fresh])])
    assert fresh.run_id == "abc"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainingStrategy.load_checkpoint(tmp_path)
    assert any("ReportingOrchestrator" in m for m in _not_restored(caught))  # state lost: say so


def test_an_empty_hook_state_of_an_older_checkpoint_is_not_reported_as_lost(tmp_path):
    strategy = C.strategy(num_steps=1)
    strategy.run(C.batches(1))
    strategy.save_checkpoint(tmp_path)
    (folder,) = tmp_path.glob("checkpoints/*")
    torch.save({"ReportingOrchestrator": {}}, folder / "hooks.pt")  # as saved before the fix
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainingStrategy.load_checkpoint(tmp_path)
    assert _not_restored(caught) == []
