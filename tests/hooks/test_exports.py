"""Every hook name the public API documents for ``nvalchemi.hooks`` imports from it."""

from __future__ import annotations

import importlib

import pytest

DOCUMENTED = (
    "Hook",
    "CheckpointableHook",
    "HookContext",
    "DynamicsContext",
    "TrainContext",
    "HookRegistryMixin",
    "NeighborListHook",
    "WrapPeriodicHook",
    "BiasedPotentialHook",
    "TorchProfilerHook",
    "StageTimingHook",
)


@pytest.mark.parametrize("name", DOCUMENTED)
def test_documented_hook_names_import(name):
    hooks = importlib.import_module("nvalchemi.hooks")
    assert name in hooks.__all__
    value = getattr(hooks, name)
    assert getattr(value, "__name__", name) == name
