"""Train: fine-tune the committee on the new labels, replaying every earlier label.

Each iteration starts a :class:`~nvalchemi.training.FineTuningStrategy` from the last
committee's checkpoint (its EMA weights when it has them) with the committee's own loss,
AdamW at ``train.lr`` decaying over ``train.steps`` steps (the budget; after a warm-up
over ``train.warmup`` of them when set), and batches that
mix the new labels with earlier ones (:func:`~nvalchemi.training.replay.mix_replay`,
``train.replay_ratio`` of every batch). Checkpoints go to the iteration's folder every
``train.checkpoint_every`` steps; a killed run resumes from the last one exactly (the
engine's resume: weights, optimizer, loader position, RNG). At the end the spread is
calibrated on the validation data and stored with the model
(:func:`~nvalchemi.app.evaluation.store_calibration`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["finetune_committee"]

MANIFEST = "manifest.json"


class _Progress:
    """A hook that reports ``(step, steps)`` after every optimizer step."""

    frequency = 1
    stage = None

    def __init__(self, report: Callable[[int, int], None], steps: int) -> None:
        self.report, self.steps = report, steps

    def _runs_on_stage(self, stage: Any) -> bool:
        from nvalchemi.training.stages import TrainingStage

        return stage is TrainingStage.AFTER_BATCH

    def __call__(self, ctx: Any, stage: Any) -> None:
        self.report(int(ctx.workflow.step_count), self.steps)


def _dataset(readers: Sequence[Any], neighbors: Any) -> Any:
    from nvalchemi.data.sources import make_dataset

    return make_dataset(list(readers), neighbor_config=neighbors, in_memory=True)


def _optimizer(settings: Any) -> Any:
    """AdamW at ``settings.lr``, cosine decay to 5 % of it over ``settings.steps``; with
    ``settings.warmup``, a rise from 5 % over that share of the steps first."""
    import torch

    from nvalchemi.training.optimizers import OptimizerConfig
    from nvalchemi.training.time_budget import WarmupCosineLR

    adamw = (torch.optim.AdamW, {"lr": settings.lr, "weight_decay": 0.0})
    if not settings.warmup:
        return OptimizerConfig(
            *adamw,
            torch.optim.lr_scheduler.CosineAnnealingLR,
            {"T_max": settings.steps, "eta_min": settings.lr * 0.05},
        )
    schedule = {"total_steps": settings.steps, "warmup_fraction": settings.warmup}
    schedule.update(initial_fraction=0.05, final_fraction=0.05)
    return OptimizerConfig(*adamw, WarmupCosineLR, schedule)


def finetune_committee(
    previous: Path,
    root: Path,
    new: Sequence[Any],
    replay: Sequence[Any],
    validation: Sequence[Any],
    settings: Any,
    *,
    seed: int,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Fine-tune the committee in checkpoint root ``previous`` into ``root``.

    ``new``, ``replay`` and ``validation`` are data readers (the new labels, every
    earlier label, the calibration data); ``settings`` is the job's ``train`` block.
    Returns the calibration factors stored with the model (``{}`` without validation).
    """
    import torch

    from nvalchemi.app.evaluation import calibrate, final_model, store_calibration
    from nvalchemi.app.jobs.run import seed_everything
    from nvalchemi.data.sources import neighbor_config_of
    from nvalchemi.training.finetune import FineTuningStrategy
    from nvalchemi.training.hooks import CheckpointHook
    from nvalchemi.training.replay import mix_replay

    hooks: list[Any] = [CheckpointHook(root, step_interval=settings.checkpoint_every)]
    if progress is not None:
        hooks.append(_Progress(progress, settings.steps))
    device = torch.device(settings.device)
    if (root / MANIFEST).is_file():
        strategy = FineTuningStrategy.load_checkpoint(root, hooks=hooks, map_location=device)
    else:
        seed_everything(seed)
        optimizer = _optimizer(settings)
        strategy = FineTuningStrategy.from_pretrained_checkpoint(
            previous,
            use_original_loss=True,
            use_ema_weights=True,
            optimizer_configs=optimizer,
            num_steps=settings.steps,
            hooks=hooks,
            map_location=device,
            devices=[device],
        )
    neighbors = neighbor_config_of(strategy.models)
    mix = mix_replay(
        _dataset(new, neighbors),
        _dataset(replay, neighbors),
        batch_size=settings.batch_size,
        ratio=settings.replay_ratio,
        seed=seed,
    )
    strategy.run(mix.loader())
    from nvalchemi.training.checkpoint import CheckpointManifest

    if CheckpointManifest.read(root).entry("latest").step_count != strategy.step_count:
        strategy.save_checkpoint(root)
    if not validation:
        return {}
    model, _ = final_model(strategy, "auto")
    factors, _ = calibrate(model, list(validation), device=device)
    store_calibration(strategy, factors, root)
    return factors
