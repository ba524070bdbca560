"""EMAHook before its first update: the shadow tracks the live weights.

Validation, checkpoints and ``load_model_from_checkpoint(use_ema=True)`` must never see
the untrained initial weights while the average has not started (``start_step`` not
reached); old checkpoints holding such a stale shadow load the trained weights.
"""

from __future__ import annotations

import copy

import _update_support as S
import torch
from _checkpoint_support import batches, demo_model, strategy

from nvalchemi.checkpoint_files import averaged_weights as ema_weights
from nvalchemi.training import TrainingStage, ValidationConfig
from nvalchemi.training.checkpoint import load_model_from_checkpoint
from nvalchemi.training.hooks.ema import EMAHook

_NUMERIC = ("total_loss", "energy_mae", "energy_rmse", "forces_mae", "forces_rmse")


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _shadow(hook: EMAHook) -> list[torch.Tensor]:
    return S.params_of(hook.get_averaged_model().module)


def test_start_step_beyond_the_run_validates_and_publishes_the_live_model(tmp_path):
    model = demo_model()
    initial = copy.deepcopy(model.state_dict())
    hook = EMAHook(decay=0.99, start_step=100)
    val = ValidationConfig(validation_data=batches(2, seed=5), every_n_steps=1)
    run = strategy(model, hooks=[hook], num_steps=5, validation_config=val, lr=0.05)
    run.run(batches(4))
    assert hook.num_updates == 0
    trained = model.state_dict()
    assert not _equal_states(trained, initial)  # training moved the weights

    ema_summary = run.last_validation
    live_summary = run.validate(val.model_copy(update={"use_ema": "never"}))
    assert live_summary["model_source"] == "live"
    for key in _NUMERIC:
        assert torch.equal(ema_summary[key], live_summary[key]), key
    assert all(torch.equal(a, b) for a, b in zip(_shadow(hook), S.params_of(model)))

    run.save_checkpoint(tmp_path)
    loaded = load_model_from_checkpoint(tmp_path)  # use_ema=True by default
    assert _equal_states(loaded.state_dict(), trained)


def test_shadow_tracks_until_the_first_update_then_averages():
    model = S.ForceMLP()
    hook = EMAHook(decay=0.5, start_step=3)
    run = S.make_strategy(model, hooks=[hook], num_steps=4)
    live, shadow = [], []
    run.register_hook(
        S.StageHook(
            TrainingStage.AFTER_BATCH,
            lambda ctx: (live.append(S.params_of(model)), shadow.append(_shadow(hook))),
        )
    )
    run.run(S.make_batches(4))
    assert hook.num_updates == 2
    for step in (0, 1, 2):  # steps 1, 2 track; step 3 is the first update (a copy)
        assert all(torch.equal(a, b) for a, b in zip(shadow[step], live[step])), step
    expected = [0.5 * a + 0.5 * b for a, b in zip(live[2], live[3])]
    for got, want in zip(shadow[3], expected):
        torch.testing.assert_close(got, want)


def test_update_every_gap_after_start_step_still_tracks():
    model = S.ForceMLP()
    hook = EMAHook(decay=0.9, start_step=1, update_every=10)  # first update at step 10
    S.make_strategy(model, hooks=[hook], num_steps=3).run(S.make_batches(3))
    assert hook.num_updates == 0
    assert all(torch.equal(a, b) for a, b in zip(_shadow(hook), S.params_of(model)))


def test_setup_copies_weights_changed_outside_the_optimizer():
    model = S.ForceMLP()
    hook = EMAHook(start_step=100)
    run = S.make_strategy(model, hooks=[hook], num_steps=1)
    run.run(S.make_batches(1))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # e.g. weights loaded from elsewhere between runs
    S.make_strategy(model, hooks=[hook], num_steps=1, step_count=1).run(S.make_batches(1))
    assert all(torch.equal(a, b) for a, b in zip(_shadow(hook), S.params_of(model)))


def test_resume_before_and_across_start_step_is_bitwise():
    data = S.make_batches(4)
    torch.manual_seed(0)
    model = S.ForceMLP()
    start = copy.deepcopy(model.state_dict())
    full = EMAHook(decay=0.7, start_step=3)
    S.make_strategy(model, hooks=[full], num_steps=4).run(data)

    first_model = S.ForceMLP()
    first_model.load_state_dict(start)
    first = EMAHook(decay=0.7, start_step=3)
    S.make_strategy(first_model, hooks=[first], num_steps=2).run(data)
    assert first.num_updates == 0
    saved_model, saved_hook = copy.deepcopy(first_model.state_dict()), first.state_dict()

    second_model = S.ForceMLP()
    second_model.load_state_dict(saved_model)
    second = EMAHook(decay=0.7, start_step=3)
    second.load_state_dict(saved_hook)
    S.make_strategy(second_model, hooks=[second], num_steps=4, step_count=2).run(data)
    assert second.num_updates == full.num_updates == 2
    for a, b in zip(_shadow(second), _shadow(full)):
        assert torch.equal(a, b)


def test_ema_weights_fall_back_to_live_weights_without_updates():
    stale = {"module.w": torch.zeros(2), "n_averaged": torch.tensor(0)}
    averaged = {"module.w": torch.ones(2), "n_averaged": torch.tensor(4)}
    assert (
        ema_weights(
            {"EMAHook": {"model_key": "main", "num_updates": 0, "averaged_model_state": stale}},
            "main",
        )
        is None
    )
    found = ema_weights(
        {"EMAHook": {"model_key": "main", "num_updates": 4, "averaged_model_state": averaged}},
        "main",
    )
    assert set(found) == {"w"} and torch.equal(found["w"], torch.ones(2))
    # without num_updates (older format) the AveragedModel's own counter decides
    assert ema_weights({"model_key": "main", "averaged_model_state": stale}, "main") is None
    assert ema_weights({"model_key": "main", "averaged_model_state": averaged}, "main") is not None
