"""The reference's loss messages and metadata rules, to the letter (issue 30, items 19 and 20).

Users match these messages in their own code; our extra detail may follow each one.
"""

import math

import pytest
import torch

from nvalchemi._serialization import UnsafeImportError
from nvalchemi.spec import create_model_spec_from_json
from nvalchemi.training.hooks.ema import EMAHook
from nvalchemi.training.hooks.gradients import GradientAccumulationHook, LossSpikeSkipHook
from nvalchemi.training.losses import (
    ComposedLossFunction,
    EnergyHuberLoss,
    EnergyMAELoss,
    EnergyMSELoss,
    ForceHuberLoss,
    ForceL2NormLoss,
    ForceMSELoss,
    LinearWeight,
    loss_component_to_spec,
)

E = torch.tensor([[3.0], [10.0], [4.0]])
F = torch.tensor([[1.0, 0, 0], [2.0, 0, 0], [3.0, 0, 0], [1.0, 1.0, 1.0], [0, 2.0, 0]])
BATCH_IDX = torch.tensor([0, 0, 0, 1, 1])


# ----------------------------------------------------------------------------- item 19


@pytest.mark.parametrize("loss_cls", [EnergyMSELoss, EnergyMAELoss, EnergyHuberLoss])
def test_energy_count_mismatch_says_energy_batch_size(loss_cls):
    loss = loss_cls(per_atom=True)
    with pytest.raises(ValueError, match=r"must match energy batch size \(3\)"):
        loss(E + 1, E, num_nodes_per_graph=torch.tensor([3, 5]))
    with pytest.raises(ValueError, match=r"1-D count tensor or a 2-D padded node mask"):
        loss(E + 1, E, num_nodes_per_graph=torch.ones(3, 2, 2, dtype=torch.bool))


@pytest.mark.parametrize("loss_cls", [ForceMSELoss, ForceHuberLoss, ForceL2NormLoss])
def test_padded_force_count_mismatch_says_force_batch_size(loss_cls):
    padded = torch.zeros(2, 3, 3)
    with pytest.raises(ValueError, match=r"must match force batch size \(2\)"):
        loss_cls()(padded + 1, padded, num_nodes_per_graph=torch.tensor([3, 2, 1]))
    with pytest.raises(
        ValueError, match=r"batch dimension \(3\) must match force batch size \(2\)"
    ):
        loss_cls()(padded + 1, padded, num_nodes_per_graph=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"width \(4\) must match force max nodes \(3\)"):
        loss_cls()(padded + 1, padded, num_nodes_per_graph=torch.ones(2, 4, dtype=torch.bool))


def test_flat_force_count_mismatch_says_force_batch_size():
    with pytest.raises(ValueError, match=r"must match force batch size \(2\)"):
        ForceMSELoss()(
            F + 1, F, batch_idx=BATCH_IDX, num_graphs=2, num_nodes_per_graph=torch.tensor([3, 2, 1])
        )


class _NaNAfter:
    """A schedule that returns NaN (a user's schedule with a bug)."""

    per_epoch = False

    def __call__(self, step: int, epoch: int) -> float:
        return math.nan

    def to_spec(self):  # pragma: no cover - never serialized here
        raise NotImplementedError


def test_a_non_finite_schedule_weight_names_schedule_and_loss():
    loss_fn = _NaNAfter() * EnergyMSELoss() + ForceMSELoss()
    with pytest.raises(
        ValueError,
        match=r"^_NaNAfter for EnergyMSELoss returned non-finite weight nan; schedules must "
        r"return finite floats",
    ):
        loss_fn.current_weight(step=3)


def test_loss_component_to_spec_accepts_only_leaves():
    with pytest.raises(TypeError, match=r"accepts only leaf BaseLossFunction objects; "):
        loss_component_to_spec(EnergyMSELoss() + ForceMSELoss())


def test_mismatched_normalize_weights_say_self_and_other():
    plain = ComposedLossFunction([EnergyMSELoss()], normalize_weights=True)
    raw = ComposedLossFunction([ForceMSELoss()], normalize_weights=False)
    with pytest.raises(
        ValueError, match=r"mismatched normalize_weights \(self=True, other=False\)"
    ):
        plain + raw
    with pytest.raises(ValueError, match=r"\(self=False, other=True\)"):
        raw + plain


def test_hook_config_conflicts_say_construct_or_load_fresh():
    fix = "; construct the hook with matching config or load into a fresh instance"
    with pytest.raises(ValueError, match=r"EMAHook checkpoint conflict: decay=0\.5") as info:
        EMAHook(decay=0.9).load_state_dict({"decay": 0.5})
    assert fix in str(info.value)
    with pytest.raises(ValueError, match="GradientAccumulationHook checkpoint conflict") as info:
        GradientAccumulationHook(steps=2).load_state_dict({"steps": 4, "micro_step": 0})
    assert fix in str(info.value)
    with pytest.raises(ValueError, match="LossSpikeSkipHook checkpoint conflict") as info:
        LossSpikeSkipHook(window=10).load_state_dict({"window": 20})
    assert fix in str(info.value)


def test_a_refused_cls_path_begins_could_not_resolve():
    for path in ("os.system", "subprocess.Popen"):
        with pytest.raises(UnsafeImportError, match=rf"^Could not resolve cls_path='{path}'"):
            create_model_spec_from_json({"cls_path": path, "timestamp": ""})
    nested = {
        "cls_path": "torch.nn.Sequential",
        "timestamp": "",
        "args": [{"cls_path": "os.system", "timestamp": ""}],
    }
    with pytest.raises(UnsafeImportError, match=r"^Could not resolve cls_path='os.system'"):
        create_model_spec_from_json(nested)


# ----------------------------------------------------------------------------- item 20


def test_a_schedule_times_a_composition_is_a_type_error_either_way():
    composed = EnergyMSELoss() + ForceMSELoss()
    ramp = LinearWeight(start=0.0, end=1.0, num_steps=10)
    with pytest.raises(
        TypeError, match="Multiplying a ComposedLossFunction by a LossWeightSchedule"
    ):
        composed * ramp
    with pytest.raises(
        TypeError, match="Multiplying a ComposedLossFunction by a LossWeightSchedule"
    ):
        ramp * composed
    # a leaf still takes a schedule, and a composition a number
    assert (ramp * EnergyMSELoss()).weights == [ramp]
    assert (2.0 * composed).weights == [2.0, 2.0]


@pytest.mark.parametrize(
    "loss",
    [ForceMSELoss(), ForceHuberLoss(normalize_by_atom_count=True), ForceL2NormLoss()],
    ids=lambda loss: type(loss).__name__,
)
def test_a_force_loss_with_batch_idx_but_no_num_graphs_asks_for_it(loss):
    name = type(loss).__name__
    with pytest.raises(ValueError, match=rf"^{name} requires num_graphs=\.\.\. metadata"):
        loss(F + 1, F, batch_idx=BATCH_IDX)
    labels = F.clone()
    labels[0, 0] = math.nan  # the masked path asks too
    with pytest.raises(ValueError, match=rf"^{name} requires num_graphs=\.\.\. metadata"):
        loss(F + 1, labels, batch_idx=BATCH_IDX, missing_labels=torch.tensor([False, False]))


class _Batch:
    """A batch whose ``num_nodes_per_graph`` must never be read for flat forces."""

    def __init__(self, batch_idx, num_graphs):
        self.batch_idx, self.num_graphs = batch_idx, num_graphs

    @property
    def num_nodes_per_graph(self):
        raise AssertionError("flat forces read batch.num_nodes_per_graph")


def test_explicit_metadata_wins_over_batch_and_flat_forces_never_read_its_atom_counts():
    expected = ForceMSELoss()(torch.zeros_like(F), F, batch_idx=BATCH_IDX, num_graphs=2)
    assert expected.item() == pytest.approx(49 / 36)
    wrong = _Batch(torch.zeros(5, dtype=torch.long), 1)
    for loss in (ForceMSELoss(), ForceL2NormLoss(), ForceHuberLoss(normalize_by_atom_count=True)):
        explicit = loss(torch.zeros_like(F), F, batch=wrong, batch_idx=BATCH_IDX, num_graphs=2)
        reference = loss(torch.zeros_like(F), F, batch_idx=BATCH_IDX, num_graphs=2)
        assert explicit.item() == pytest.approx(reference.item())
        from_batch = loss(torch.zeros_like(F), F, batch=_Batch(BATCH_IDX, 2))
        assert from_batch.item() == pytest.approx(reference.item())
