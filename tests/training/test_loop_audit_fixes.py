"""Training-loop fixes from the audit: loss visibility, the non-finite policy, error context,
metric schedulers without validation, gradient-accumulation epochs, and exact resume with a
plain ``torch.utils.data.DataLoader(shuffle=True)``."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import _checkpoint_support as C
import _update_support as S
import pytest
import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader

from nvalchemi.data import Batch
from nvalchemi.training import OptimizerConfig, TrainingStage, TrainingStrategy, ValidationConfig
from nvalchemi.training.errors import NonFiniteLossError, TrainingStalledError
from nvalchemi.training.hooks import CheckpointHook, GradientAccumulationHook, GradientClipHook
from nvalchemi.training.hooks.update import TrainingUpdateHook

St = TrainingStage


def _text(exc: BaseException) -> str:
    return "\n".join([str(exc), *getattr(exc, "__notes__", [])])


def _finite(strategy: TrainingStrategy) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in strategy.models["main"].parameters())


def _same_weights(a: TrainingStrategy, b: TrainingStrategy) -> bool:
    sa, sb = a.unwrapped_models()["main"].state_dict(), b.unwrapped_models()["main"].state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class _Kill(Exception):
    pass


class _KillAt:
    """Raise at ``stage`` once ``attribute`` of the context reaches ``value`` (a crash)."""

    frequency = 1

    def __init__(self, stage: TrainingStage, attribute: str, value: int) -> None:
        self.stage, self.attribute, self.value = stage, attribute, value

    def __call__(self, ctx, stage) -> None:
        if getattr(ctx, self.attribute) == self.value:
            raise _Kill()


class _LossLog:
    """Per-step training losses (as ``float.hex``) at ``AFTER_BATCH``."""

    frequency = 1
    stage = St.AFTER_BATCH

    def __init__(self) -> None:
        self.losses: list[tuple[int, str]] = []

    def __call__(self, ctx, stage) -> None:
        self.losses.append((ctx.step_count, float(ctx.loss).hex()))


# ----------------------------------------------------------------------------- 1. visibility
def test_before_epoch_sees_no_stale_loss_or_predictions_of_the_last_epoch():
    seen = []
    hook = S.StageHook(St.BEFORE_EPOCH, lambda ctx: seen.append((ctx.loss, ctx.predictions)))
    S.make_strategy(hooks=[hook], num_epochs=2).run(S.make_batches(1))
    assert len(seen) == 2
    assert all(loss is None and predictions is None for loss, predictions in seen)


def test_before_training_sees_no_loss_left_by_an_earlier_train_batch():
    seen = []
    hook = S.StageHook(St.BEFORE_TRAINING, lambda ctx: seen.append((ctx.loss, ctx.losses)))
    strategy = S.make_strategy(hooks=[hook], num_steps=2)
    strategy.train_batch(S.make_batches(1)[0])
    strategy.close()
    strategy.run(S.make_batches(1))
    assert seen == [(None, None)]


def test_after_validation_sees_the_last_training_loss_detached():
    seen = []

    def look(ctx):
        seen.append((ctx.loss.requires_grad, ctx.losses["total_loss"].requires_grad))

    val = ValidationConfig(validation_data=S.make_batches(1, seed=9), every_n_steps=1)
    strategy = S.make_strategy(
        hooks=[S.StageHook(St.AFTER_VALIDATION, look)], validation_config=val, num_steps=2
    )
    strategy.run(S.make_batches(2))
    assert seen and all(flags == (False, False) for flags in seen)


# ----------------------------------------------------------------------------- 2. non-finite
def _nan_at(index: int, n: int = 4) -> list[Batch]:
    data = C.batches(n)
    data[index] = C.batches(1, seed=5, nan=True)[0]
    return data


@pytest.mark.parametrize("hooks", ["none", "plain", "orchestrator"])
def test_a_due_check_raises_before_the_poisoned_step_lands(hooks):
    extra = {
        "none": [],
        "plain": [S.StageHook(St.AFTER_BATCH, lambda ctx: None)],
        "orchestrator": [GradientClipHook(max_norm=10.0)],
    }[hooks]
    strategy = C.strategy(num_steps=4, hooks=extra, nonfinite_check_interval=1)
    with pytest.raises(NonFiniteLossError) as info:
        strategy.run(_nan_at(1))
    assert info.value.step == 1 and strategy.step_count == 1
    assert _finite(strategy)
    assert "no optimizer step used it" in str(info.value)


def test_batched_checks_say_how_many_steps_may_be_affected_and_how_to_be_strict():
    strategy = C.strategy(num_steps=4)  # default interval: found at the end of the run
    with pytest.raises(NonFiniteLossError) as info:
        strategy.run(_nan_at(1))
    message = str(info.value)
    assert info.value.step == 1 and strategy.step_count == 4
    assert "last 3 step(s)" in message
    assert "TrainingStrategy(nonfinite_check_interval=1)" in message


def test_train_batch_raises_on_a_nonfinite_loss_before_stepping():
    strategy = C.strategy(num_steps=5)
    strategy.train_batch(C.batches(1)[0])
    before = [p.detach().clone() for p in strategy.models["main"].parameters()]
    with pytest.raises(NonFiniteLossError):
        strategy.train_batch(C.batches(1, nan=True)[0])
    strategy.close()
    assert strategy.step_count == 1
    after = list(strategy.models["main"].parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_closing_a_session_runs_the_pending_check_and_still_exits_hooks():
    exits = []

    class Exits:
        frequency, stage = 1, St.AFTER_BATCH

        def __call__(self, ctx, stage):
            pass

        def __exit__(self, exc_type, exc, tb):
            exits.append(exc_type)

    strategy = C.strategy(hooks=[Exits()])
    strategy.train_batch(C.batches(1)[0])
    # A loss recorded but not yet checked, as the batched periodic check leaves them.
    record = strategy.__dict__["_run"].record
    record.losses.append(torch.tensor(float("nan")))
    record.meta.append((1, 0, 1, 1, []))
    with pytest.raises(NonFiniteLossError):
        strategy.close()
    assert exits == [NonFiniteLossError]


# ----------------------------------------------------------------------------- 3./4. errors
def test_optimizer_build_errors_name_the_config_the_class_and_the_stage():
    config = OptimizerConfig(torch.optim.Adam, {"lr": "fast"})
    strategy = S.make_strategy(optimizer_configs=config)
    with pytest.raises(TypeError) as info:
        strategy.run(S.make_batches(1))
    text = _text(info.value)
    assert "optimizer_configs['main'][0]" in text
    assert "torch.optim.adam.Adam" in text
    assert "stage building optimizers" in text


def test_a_bad_metric_adapter_key_names_the_validation_stage_and_the_config():
    config = OptimizerConfig(
        torch.optim.SGD,
        {"lr": 0.1},
        ReduceLROnPlateau,
        {"patience": 0},
        scheduler_metric_adapter="no_such_metric",
    )
    val = ValidationConfig(validation_data=S.make_batches(1, seed=9), every_n_steps=1)
    strategy = S.make_strategy(optimizer_configs=config, validation_config=val, num_steps=2)
    with pytest.raises(KeyError) as info:
        strategy.run(S.make_batches(2))
    text = _text(info.value)
    assert "stage validation / metric schedulers" in text
    assert "the training loop" not in text
    assert "optimizer_configs['main'][0]" in text


def test_a_metric_scheduler_without_validation_is_rejected_at_run_start():
    config = OptimizerConfig(torch.optim.SGD, {"lr": 0.1}, ReduceLROnPlateau)
    strategy = S.make_strategy(optimizer_configs=config)
    with pytest.raises(
        ValueError, match=r"optimizer_configs\['main'\]\[0\].*ReduceLROnPlateau"
    ) as e:
        strategy.run(S.make_batches(2))
    assert "ValidationConfig" in str(e.value) and "time-based scheduler" in str(e.value)
    assert strategy.step_count == 0


# ----------------------------------------------------------------------------- 5. accumulation
def test_num_epochs_with_accumulation_counts_passes_over_the_data():
    strategy = S.make_strategy(hooks=[GradientAccumulationHook(3)], num_epochs=3)
    strategy.run(S.make_batches(4))
    # 4 batches per epoch = windows of 3 and 1: two optimizer steps per epoch
    assert (strategy.epoch_count, strategy.batch_count, strategy.step_count) == (3, 12, 6)
    assert not strategy.accumulation_window_open


def test_the_last_batch_of_an_epoch_closes_a_short_window_averaged_over_its_batches():
    batches = S.make_batches(4)
    torch.manual_seed(0)
    model = S.ForceMLP()
    probe, plain = S.GradProbe(priority=35), S.GradProbe(priority=35)
    frozen = S.sgd(0.0)  # gradients only: the weights never move
    S.make_strategy(
        copy.deepcopy(model),
        optimizer_configs=frozen,
        hooks=[GradientAccumulationHook(3), probe],
        num_epochs=1,
    ).run(batches)
    S.make_strategy(model, optimizer_configs=frozen, hooks=[plain], num_epochs=1).run(batches)
    assert len(probe.grads) == 2 and len(plain.grads) == 4
    for i, grad in enumerate(probe.grads[0]):
        mean = sum(g[i] for g in plain.grads[:3]) / 3
        torch.testing.assert_close(grad, mean, rtol=1e-5, atol=1e-6)
    for grad, single in zip(probe.grads[1], plain.grads[3]):
        torch.testing.assert_close(grad, single, rtol=1e-5, atol=1e-6)


def test_accumulating_batches_do_not_count_as_skips_but_skipped_windows_do():
    strategy = S.make_strategy(
        hooks=[GradientAccumulationHook(5)], num_steps=2, max_consecutive_skips=2
    )
    strategy.run(S.make_batches(10))
    assert (strategy.step_count, strategy.batch_count) == (2, 10)

    class VetoEveryWindow(TrainingUpdateHook):
        priority = 45

        def __call__(self, ctx, stage, will_skip):
            return not (stage is St.DO_OPTIMIZER_STEP and not will_skip), ctx.loss

    strategy = S.make_strategy(
        hooks=[GradientAccumulationHook(3), VetoEveryWindow()],
        num_steps=1,
        max_consecutive_skips=2,
    )
    with pytest.raises(TrainingStalledError):
        strategy.run(S.make_batches(12))
    assert strategy.batch_count == 6  # two skipped windows of three batches


def test_a_requested_stop_waits_for_the_accumulation_window_to_close():
    def stop(ctx):
        if ctx.batch_count == 1:
            ctx.workflow.request_stop("test")

    strategy = S.make_strategy(
        hooks=[GradientAccumulationHook(3), S.StageHook(St.AFTER_BATCH, stop)], num_steps=5
    )
    strategy.run(S.make_batches(6))
    assert (strategy.step_count, strategy.batch_count) == (1, 3)
    assert not strategy.accumulation_window_open


class _Unsized:
    """A re-iterable loader without ``__len__`` (epochs end when it is exhausted)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def _manifest(root: Path) -> list[tuple[int, int]]:
    entries = json.loads((root / "manifest.json").read_text())["checkpoints"]
    return [(e["step_count"], e["batch_count"]) for e in entries]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_checkpoint_hook_defers_a_save_due_inside_a_window_to_the_window_end(tmp_path):
    hook = CheckpointHook(tmp_path, epoch_interval=1, async_save=False, save_on_train_end=False)
    strategy = C.strategy(hooks=[GradientAccumulationHook(3), hook], num_steps=3)
    strategy.run(_Unsized(C.batches(4)))  # epochs of 4 batches end inside windows of 3
    assert _manifest(tmp_path) == [(2, 6), (3, 9)]
    for index in (0, 1):
        loaded = TrainingStrategy.load_checkpoint(
            tmp_path, checkpoint_index=index, hooks=[GradientAccumulationHook(3)]
        )
        assert loaded.orchestrator().state_dict()["GradientAccumulationHook"]["micro_step"] == 0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_epoch_checkpoint_with_accumulation_resumes_bitwise(tmp_path):
    data = C.batches(4)
    reference = C.strategy(hooks=[GradientAccumulationHook(3)], num_steps=None, num_epochs=3)
    reference.run(data)
    assert (reference.step_count, reference.batch_count, reference.epoch_count) == (6, 12, 3)

    first = C.strategy(
        hooks=[
            GradientAccumulationHook(3),
            CheckpointHook(tmp_path, epoch_interval=1, async_save=False, save_on_train_end=False),
            _KillAt(St.BEFORE_EPOCH, "epoch", 2),
        ],
        num_steps=None,
        num_epochs=3,
    )
    with pytest.raises(_Kill):
        first.run(data)
    assert _manifest(tmp_path) == [(2, 4), (4, 8)]
    resumed = TrainingStrategy.load_checkpoint(
        tmp_path, checkpoint_index=0, hooks=[GradientAccumulationHook(3)]
    )
    resumed.run(data)
    assert (resumed.step_count, resumed.batch_count, resumed.epoch_count) == (6, 12, 3)
    assert _same_weights(reference, resumed)


# ----------------------------------------------------------------------------- 6. torch loaders
def _collate(structures) -> Batch:
    return Batch.from_data_list(list(structures))


@pytest.mark.parametrize("duration", ["num_steps", "num_epochs"])
def test_plain_shuffling_dataloader_resumes_mid_epoch_exactly(tmp_path, duration):
    structures = [s for b in C.batches(5, seed=3) for s in b.to_data_list()]

    def loader() -> DataLoader:  # shuffles with the global torch RNG (no generator)
        return DataLoader(structures, batch_size=2, shuffle=True, collate_fn=_collate)

    kwargs = {"num_steps": None, "num_epochs": 3} if duration == "num_epochs" else {}
    kwargs.setdefault("num_steps", 13)
    reference_log = _LossLog()
    reference = C.strategy(hooks=[reference_log], **kwargs)
    torch.manual_seed(7)
    reference.run(loader())

    save = CheckpointHook(tmp_path, step_interval=7, async_save=False, save_on_train_end=False)
    first = C.strategy(hooks=[_LossLog(), save, _KillAt(St.AFTER_BATCH, "step_count", 8)], **kwargs)
    torch.manual_seed(7)
    with pytest.raises(_Kill):
        first.run(loader())

    torch.manual_seed(999)  # a fresh process: the checkpoint restores the RNG
    log = _LossLog()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the resume lacks the crash and checkpoint hooks
        resumed = TrainingStrategy.load_checkpoint(tmp_path, hooks=[log])
    # step 7 of 5-batch epochs: the resume starts mid-epoch (epoch 1, batch 2)
    assert (resumed.step_count, resumed.epoch_count, resumed.epoch_step_count) == (7, 1, 2)
    resumed.run(loader())
    assert log.losses == reference_log.losses[7:]
    assert resumed.step_count == reference.step_count
    assert _same_weights(reference, resumed)


def test_runtime_state_carries_the_loader_position_as_json():
    strategy = S.make_strategy(num_steps=1)
    strategy.run(S.make_batches(2))
    state = strategy.runtime_state()
    position = state["loader_position"]
    assert position["epoch"] == 0 and isinstance(position["torch"], str)
    json.dumps(state)
    other = S.make_strategy()
    other.load_runtime_state(state)
    assert other.runtime_state() == state
    with pytest.raises(ValueError, match="loader_position"):
        other.load_runtime_state({**state, "loader_position": {**position, "torch": "not base64!"}})
    legacy = {k: v for k, v in state.items() if k != "loader_position"}
    other.load_runtime_state({**legacy, "epoch_rng_state": position["torch"]})  # before 0.2
    assert other.runtime_state()["loader_position"]["torch"] == position["torch"]
