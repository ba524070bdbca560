"""model_spec_for: checkpoint_spec first, constructor introspection, one verification per class."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nvalchemi.models.demo import DemoModel, DemoModelWrapper
from nvalchemi.training import create_model_spec
from nvalchemi.training.model_spec import model_spec_for


class Counted(nn.Module):
    constructed = 0

    def __init__(self, width: int = 4, inner: nn.Module | None = None) -> None:
        super().__init__()
        type(self).constructed += 1
        self.width = width
        self.inner = inner
        self.layer = nn.Linear(width, width)


class WithSpec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def checkpoint_spec(self):
        return create_model_spec(nn.Linear, in_features=2, out_features=2)


class Unrecoverable(nn.Module):
    def __init__(self, size: int) -> None:  # not stored as self.size
        super().__init__()
        self.layer = nn.Linear(size, 1)


def test_demo_model_spec_rebuilds_the_same_architecture():
    model = DemoModelWrapper(DemoModel(num_atom_types=10, hidden_dim=8))
    rebuilt = model_spec_for(model, strict=True).build()
    assert type(rebuilt) is DemoModelWrapper
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {
        k: v.shape for k, v in model.state_dict().items()
    }


def test_checkpoint_spec_wins_and_wrappers_are_looked_through():
    spec = model_spec_for(nn.DataParallel(WithSpec()))
    assert spec.cls_path == "torch.nn.modules.linear.Linear"


def test_nested_modules_are_described_recursively():
    spec = model_spec_for(Counted(3, inner=nn.Linear(1, 2)), strict=True)
    assert spec.kwargs["width"] == 3
    assert spec.kwargs["inner"].cls_path == "torch.nn.modules.linear.Linear"


def test_undescribable_models_give_none_or_a_reason():
    assert model_spec_for(Unrecoverable(3)) is None
    with pytest.raises(ValueError, match=r"'size' .* not stored as attribute self.size"):
        model_spec_for(Unrecoverable(3), strict=True)
    with pytest.raises(ValueError, match=r"\*args"):
        model_spec_for(nn.Sequential(nn.Linear(1, 1)), strict=True)


def test_verification_builds_once_per_class_and_arguments():
    model = Counted(5)
    before = Counted.constructed
    for _ in range(20):
        assert model_spec_for(model) is not None
    assert Counted.constructed - before == 1  # one (meta-device) verification, then cached
    model_spec_for(Counted(6))
    assert Counted.constructed - before == 3  # the new instance + its verification


def test_verification_rejects_a_spec_that_rebuilds_other_weights():
    model = Counted(4)
    model.layer = nn.Linear(4, 7)  # patched after construction: the constructor cannot rebuild it
    with pytest.raises(ValueError, match="different weights"):
        model_spec_for(model, strict=True)
    assert torch.is_tensor(model.layer.weight)


@pytest.mark.parametrize(
    "module",
    [
        "nvalchemi.training.strategy",
        "nvalchemi.training.validation",
        "nvalchemi.training.runtime",
        "nvalchemi.training.model_spec",
        "nvalchemi.training.errors",
        "nvalchemi.training.hooks.update",
        "nvalchemi.training.hooks.early_stopping",
    ],
)
def test_docstring_examples_run(module):
    import doctest
    import importlib

    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(importlib.import_module(module), optionflags=flags, verbose=False)
    assert result.failed == 0 and result.attempted > 0
