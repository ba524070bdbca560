"""The quickstart pipeline: bundled EMT data -> PaiNN -> checkpoints -> test metrics.

:func:`prepare_run` checks the run directory (fresh, ``--resume`` or ``--overwrite``)
and settles the recipe; :func:`load_splits` reads the bundled train/val/test splits
into memory with neighbour lists; :func:`build_strategy` (fresh) or
:func:`resume_strategy` set up a ``TrainingStrategy`` with validation every epoch,
EMA, gradient clipping, a ``CheckpointHook`` every epoch (last 3 + best kept), live
reporting, a time budget and Ctrl-C as a clean stop; :func:`calibrate_epochs` picks
how many epochs fit a time budget.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvalchemi.training.cli._errors import CLIError
from nvalchemi.training.cli.recipe import QUICK, QUICKSTART, PaiNNRecipe

__all__ = ["QuickstartPlan", "Splits", "build_strategy", "load_splits", "prepare_run"]

CONFIG_FILE = "quickstart.json"
_OWNED = ("checkpoints", "tensorboard", "metrics.jsonl", CONFIG_FILE, "test_metrics.json",
          "learning_curves.png", "parity_energy_per_atom.png", "parity_forces.png")  # fmt: skip


@dataclass
class QuickstartPlan:
    """What the quickstart will do: the recipe, where, and whether it resumes."""

    recipe: PaiNNRecipe
    run_dir: Path
    resume: bool
    calibrate: bool
    budget_s: float | None
    device: str

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"


@dataclass
class Splits:
    train: Any
    val: Any
    test: Any
    seconds: float = 0.0
    sizes: dict[str, int] = field(default_factory=dict)


def _saved_recipe(run_dir: Path) -> PaiNNRecipe | None:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return PaiNNRecipe(**json.loads(path.read_text())["recipe"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CLIError(
            f"{path} is not a quickstart run record ({exc})",
            fix="use another --run-dir, or --overwrite to start over",
        ) from None


def prepare_run(
    run_dir: str | Path,
    *,
    resume: bool,
    overwrite: bool,
    quick: bool,
    epochs: int | None,
    minutes: float | None,
    device: str,
) -> QuickstartPlan:
    """Check the run directory against the flags and settle the recipe."""
    _check_device(device)
    run_dir = Path(run_dir)
    has_run = (run_dir / "checkpoints" / "manifest.json").is_file() or (
        run_dir / CONFIG_FILE
    ).is_file()
    if resume and overwrite:
        raise CLIError("--resume and --overwrite contradict each other", fix="pick one")
    if resume:
        saved = _saved_recipe(run_dir)
        if saved is None or not (run_dir / "checkpoints" / "manifest.json").is_file():
            raise CLIError(
                f"there is no quickstart run to resume in {run_dir}",
                field="--resume",
                fix="run `nvalchemi-training quickstart` without --resume first (or point "
                "--run-dir at an earlier run)",
            )
        if epochs is not None and epochs != saved.epochs:
            raise CLIError(
                f"--epochs {epochs} differs from the run being resumed ({saved.epochs} epochs)",
                field="--epochs",
                fix="drop --epochs to continue the run exactly, or start a new run with --run-dir",
            )
        if quick and saved.hidden_channels != QUICK.hidden_channels:
            raise CLIError(
                f"--quick differs from the run in {run_dir} (a full quickstart)",
                field="--quick",
                fix="drop --quick to resume it",
            )
        budget = None if minutes is None else minutes * 60
        return QuickstartPlan(saved, run_dir, True, False, budget, device)
    if has_run:
        if not overwrite:
            raise CLIError(
                f"{run_dir} already holds a quickstart run",
                fix="pass --resume to continue it, --overwrite to start over, or choose "
                "another --run-dir",
            )
        for name in _OWNED:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    recipe = (QUICK if quick else QUICKSTART).replace(epochs=epochs)
    calibrate = epochs is None and not quick
    if calibrate and minutes is None:
        minutes = DEFAULT_MINUTES
    budget = None if minutes is None else minutes * 60
    return QuickstartPlan(recipe, run_dir, False, calibrate, budget, device)


_PROBE_STEPS, _WARMUP_STEPS = 12, 4

DEFAULT_MINUTES = 5.0
"""Training time the quickstart plans for when neither --epochs nor --minutes is given."""


def _check_device(device: str) -> None:
    from nvalchemi.training.cli.devices import check_device

    check_device(device, field="--device", fix="use --device cpu (or cuda where a GPU is present)")


def save_plan(plan: QuickstartPlan) -> None:
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    record = {"recipe": plan.recipe.to_dict(), "device": plan.device}
    (plan.run_dir / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")


def load_splits(recipe: PaiNNRecipe) -> Splits:
    """The bundled train/val/test splits in memory, neighbour lists built once."""
    from nvalchemi.data.bundled import bundled_split_path
    from nvalchemi.data.datapipes.dataset import InMemoryDataset
    from nvalchemi.data.io.ase import ASEReader
    from nvalchemi.data.neighbors import NeighborListTransform

    start = time.perf_counter()
    limits = {"train": recipe.max_train, "val": recipe.max_val, "test": recipe.max_test}
    datasets = {}
    for split, limit in limits.items():
        index = ":" if limit is None else slice(0, limit)
        reader = ASEReader(bundled_split_path(split), index=index)
        datasets[split] = InMemoryDataset(
            reader=reader, transforms=[NeighborListTransform(recipe.cutoff)]
        )
    return Splits(
        **datasets,
        seconds=time.perf_counter() - start,
        sizes={k: len(v) for k, v in datasets.items()},
    )


def _loader(dataset: Any, recipe: PaiNNRecipe, shuffle: bool) -> Any:
    from nvalchemi.data.datapipes.dataloader import DataLoader

    return DataLoader(dataset, batch_size=recipe.batch_size, shuffle=shuffle, seed=recipe.seed)


def loaders(splits: Splits, recipe: PaiNNRecipe) -> tuple[Any, Any, Any]:
    return (
        _loader(splits.train, recipe, True),
        _loader(splits.val, recipe, False),
        _loader(splits.test, recipe, False),
    )


def build_model(splits: Splits, recipe: PaiNNRecipe, device: str) -> Any:
    """PaiNN with elements, reference energies and scale/shift fitted on the training split."""
    import torch

    from nvalchemi.data.datapipes.dataloader import DataLoader
    from nvalchemi.models.painn import PaiNN

    torch.manual_seed(recipe.seed)
    fit_data = DataLoader(splits.train, batch_size=256)
    return PaiNN.from_data(fit_data, **recipe.model_kwargs()).to(device)


def calibrate_epochs(
    model: Any, train: Any, val: Any, recipe: PaiNNRecipe, budget_s: float, device: str
) -> tuple[int, float]:
    """Epochs that fit ``budget_s``, from timing a few steps of a throwaway copy.

    Returns ``(epochs, seconds per training step)``. Validation (every epoch, with
    forces) is counted at about 60 % of a training step per batch.
    """
    import torch

    from nvalchemi.training.losses.composition import compute_supervised_loss
    from nvalchemi.training.strategy import default_training_fn

    probe = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(probe.parameters(), lr=recipe.lr)
    loss_fn = recipe.loss_fn()
    timings = []
    for i, batch in enumerate(train):
        if i >= _PROBE_STEPS:
            break
        batch = batch.to(device)
        start = time.perf_counter()
        predictions = default_training_fn(probe, batch)
        loss = compute_supervised_loss(loss_fn, predictions, batch)["total_loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        timings.append(time.perf_counter() - start)
    # The first steps pay for allocator and autograd warm-up; the median ignores outliers.
    steady = sorted(timings[_WARMUP_STEPS:] or timings)
    step_s = steady[len(steady) // 2]
    epoch_s = step_s * (len(train) + 0.6 * len(val)) * 1.05
    epochs = int(max(1, min(200, math.floor(budget_s / epoch_s))))
    return epochs, step_s


def _hooks(plan: QuickstartPlan, console: Any) -> list[Any]:
    from nvalchemi.training.cli.run_reporting import TimeBudgetHook, reporting_hook
    from nvalchemi.training.hooks.checkpoint import CheckpointHook
    from nvalchemi.training.hooks.ema import EMAHook
    from nvalchemi.training.hooks.gradients import GradientClipHook
    from nvalchemi.training.preemption import PreemptionHandler

    recipe = plan.recipe
    hooks: list[Any] = [EMAHook(decay=recipe.ema_decay)]
    if recipe.grad_clip_norm:
        hooks.append(GradientClipHook(recipe.grad_clip_norm))
    hooks += [
        CheckpointHook(plan.checkpoint_dir, epoch_interval=1, keep_last=recipe.keep_last,
                       keep_best=1),
        reporting_hook(plan.run_dir, log_every=recipe.log_every_n_steps,
                       title="nvalchemi quickstart: PaiNN on bundled EMT", console=console),
        # Ctrl-C: finish the step, checkpoint, evaluate (a second Ctrl-C is ignored).
        PreemptionHandler(signals=(signal.SIGINT,), exit=False),
    ]  # fmt: skip
    if plan.budget_s is not None:
        hooks.append(TimeBudgetHook(plan.budget_s))
    return hooks


def _validation(val_loader: Any) -> Any:
    from nvalchemi.training.validation import ValidationConfig

    return ValidationConfig(validation_data=val_loader, every_n_epochs=1)


def build_strategy(
    plan: QuickstartPlan, model: Any, train: Any, val: Any, console: Any = None
) -> Any:
    """A fresh ``TrainingStrategy`` for the plan's recipe."""
    from nvalchemi.training.strategy import TrainingStrategy

    recipe = plan.recipe
    total_steps = recipe.epochs * len(train)
    return TrainingStrategy(
        models=model,
        optimizer_configs=recipe.optimizer_config(total_steps),
        loss_fn=recipe.loss_fn(),
        validation_config=_validation(val),
        hooks=_hooks(plan, console),
        num_epochs=recipe.epochs,
        devices=[plan.device],
    )


def resume_strategy(plan: QuickstartPlan, val: Any, console: Any = None) -> Any:
    """The strategy of the latest checkpoint, with the same hooks and validation."""
    from nvalchemi.training.strategy import TrainingStrategy

    return TrainingStrategy.load_checkpoint(
        plan.checkpoint_dir,
        "latest",
        map_location=plan.device,
        hooks=_hooks(plan, console),
        overrides={"validation_config": _validation(val)},
    )


def final_checkpoint(plan: QuickstartPlan) -> tuple[Path, int, int | None]:
    """``(path of the latest checkpoint, its index, its step)``."""
    from nvalchemi.training.checkpoint import CheckpointManifest

    entry = CheckpointManifest.read(plan.checkpoint_dir).entry("latest")
    path = plan.checkpoint_dir / entry.path if entry.path else plan.checkpoint_dir
    return path, entry.index, entry.step_count
