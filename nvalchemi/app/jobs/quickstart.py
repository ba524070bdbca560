"""The quickstart pipeline: bundled EMT data -> PaiNN -> checkpoints -> test metrics.

:func:`prepare_run` checks the run directory (fresh, ``--resume`` or ``--overwrite``) and
settles the recipe; :func:`load_splits` reads the bundled splits into memory with
neighbour lists; :func:`build_strategy` (or :func:`resume_strategy`) sets up the
``TrainingStrategy`` with validation, EMA, clipping, checkpoints, live reporting, Ctrl-C as
a clean stop and a ``TimeBudgetHook`` that fits the run to the budget without ``--epochs``.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError
from nvalchemi.app.jobs.recipe import QUICK, QUICKSTART, PaiNNRecipe
from nvalchemi.app.jobs.trackers import tracker_reporters

__all__ = ["QuickstartPlan", "Splits", "build_strategy", "load_splits", "prepare_run"]

CONFIG_FILE = "quickstart.json"
_OWNED = (
    "checkpoints",
    "tensorboard",
    "metrics.jsonl",
    CONFIG_FILE,
    "test_metrics.json",
    "learning_curves.png",
    "parity_energy_per_atom.png",
    "parity_forces.png",
    "parity_stress.png",
)
_WRITTEN_BY = "nvalchemi-training quickstart"  # marks the record, and so the run, as ours


@dataclass
class QuickstartPlan:
    """What the quickstart will do: the recipe, where, and whether it resumes."""

    recipe: PaiNNRecipe
    run_dir: Path
    resume: bool
    budget_s: float | None
    device: str
    created: list[str] = field(default_factory=list)
    """What of :data:`_OWNED` this run creates (recorded, so ``--overwrite`` deletes only that)."""
    trackers: list[Any] = field(default_factory=list)
    """``WandbReporter``/``MLflowReporter`` of ``--logger`` (the run's id is checkpointed)."""
    tensorboard: bool | None = None
    """``--logger`` given: whether it names TensorBoard (``None``: when installed)."""

    @property
    def fitted(self) -> bool:
        """Whether the run's length is fitted to the budget (no fixed number of epochs)."""
        return self.recipe.epochs is None and self.budget_s is not None

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
        raise FieldError(
            f"{path} is not a quickstart run record ({exc})",
            fix="use another --run-dir, or --overwrite to start over",
        ) from None


def _found(run_dir: Path) -> list[str]:
    """The names quickstart writes that already lie in ``run_dir``."""
    return [n for n in _OWNED if (run_dir / n).exists() or (run_dir / n).is_symlink()]


def _created_by_quickstart(run_dir: Path) -> list[str] | None:
    """What the quickstart record of ``run_dir`` says quickstart created there, or ``None``
    when no record written by quickstart marks the folder."""
    try:
        record = json.loads((run_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("written_by") != _WRITTEN_BY:
        return None
    created = record.get("created")
    if not isinstance(created, list):
        return None
    return [name for name in created if name in _OWNED]


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)  # a link goes, never what it points at
    else:
        shutil.rmtree(path)


def _clear_earlier_run(run_dir: Path, found: list[str], overwrite: bool) -> None:
    """Delete the earlier quickstart run in ``run_dir`` (``--overwrite``): only what its
    record says it created; refuse anything quickstart did not create."""
    created = _created_by_quickstart(run_dir)
    listing = ", ".join(found)
    if created is None:
        raise FieldError(
            f"{run_dir} holds {listing}, which quickstart did not create (no quickstart.json "
            "written by quickstart marks them); nothing was deleted",
            field="--run-dir",
            fix="choose another --run-dir (quickstart deletes only runs it created itself)",
        )
    if not overwrite:
        raise FieldError(
            f"{run_dir} already holds a quickstart run",
            fix="pass --resume to continue it, --overwrite to start over, or choose "
            "another --run-dir",
        )
    foreign = [name for name in found if name not in created]
    if foreign:
        raise FieldError(
            f"{run_dir} holds {', '.join(foreign)}, which the quickstart run there did not "
            "create; nothing was deleted",
            field="--run-dir",
            fix="move them away yourself, or choose another --run-dir",
        )
    for name in created:
        _remove(run_dir / name)


def prepare_run(
    run_dir: str | Path,
    *,
    resume: bool,
    overwrite: bool,
    quick: bool,
    epochs: int | None,
    minutes: float | None,
    device: str,
    loggers: Sequence[str] = (),
) -> QuickstartPlan:
    """Check the run directory against the flags and settle the recipe; ``loggers``: the
    experiment trackers (``--logger``; none: TensorBoard when installed).

    ``--overwrite`` deletes only what an earlier quickstart run recorded as created in
    ``quickstart.json``; a folder holding anything else quickstart would write (another
    run's checkpoints, ...) is refused with what was found, and nothing is deleted.
    """
    plan = _plan(run_dir, resume, overwrite, quick, epochs, minutes, device)
    if loggers:
        config = {"quickstart": plan.recipe.to_dict(), "device": device}
        plan.trackers = tracker_reporters(loggers, plan.run_dir, name="quickstart", config=config)
        plan.tensorboard = "tensorboard" in loggers
    return plan


def _plan(
    run_dir: str | Path,
    resume: bool,
    overwrite: bool,
    quick: bool,
    epochs: int | None,
    minutes: float | None,
    device: str,
) -> QuickstartPlan:
    from nvalchemi.app.devices import check_device

    check_device(device, field="--device", fix="use --device cpu (or cuda where a GPU is present)")
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise FieldError("--resume and --overwrite contradict each other", fix="pick one")
    if resume:
        saved = _saved_recipe(run_dir)
        if saved is None or not (run_dir / "checkpoints" / "manifest.json").is_file():
            found = ", ".join(_found(run_dir)) or "nothing of a quickstart run"
            raise FieldError(
                f"there is no quickstart run to resume in {run_dir} (found: {found})",
                field="--resume",
                fix="run `nvalchemi-training quickstart` without --resume first (or point "
                "--run-dir at an earlier run)",
            )
        if epochs is not None and epochs != saved.epochs:
            raise FieldError(
                f"--epochs {epochs} differs from the run being resumed ({saved.epochs} epochs)",
                field="--epochs",
                fix="drop --epochs to continue the run exactly, or start a new run with --run-dir",
            )
        if quick and saved.hidden_channels != QUICK.hidden_channels:
            raise FieldError(
                f"--quick differs from the run in {run_dir} (a full quickstart)",
                field="--quick",
                fix="drop --quick to resume it",
            )
        if minutes is None and saved.epochs is None:
            minutes = saved.minutes  # the same budget: the saved plan continues
        budget = None if minutes is None else minutes * 60
        return QuickstartPlan(saved, run_dir, True, budget, device)
    found = _found(run_dir)
    if found:
        _clear_earlier_run(run_dir, found, overwrite)
    recipe = (QUICK if quick else QUICKSTART).replace(epochs=epochs, minutes=minutes)
    if recipe.epochs is None:
        minutes = recipe.minutes
    budget = None if minutes is None else minutes * 60
    created = [name for name in _OWNED if name not in _found(run_dir)]
    return QuickstartPlan(recipe, run_dir, False, budget, device, created)


def save_plan(plan: QuickstartPlan) -> None:
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "written_by": _WRITTEN_BY,
        "created": plan.created,
        "recipe": plan.recipe.to_dict(),
        "device": plan.device,
    }
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


def loaders(splits: Splits, recipe: PaiNNRecipe) -> tuple[Any, ...]:
    """``(train, validation, test)`` loaders; only the training data is shuffled."""
    from nvalchemi.data.datapipes.dataloader import DataLoader

    return tuple(
        DataLoader(
            data, batch_size=recipe.batch_size, shuffle=data is splits.train, seed=recipe.seed
        )
        for data in (splits.train, splits.val, splits.test)
    )


def build_model(splits: Splits, recipe: PaiNNRecipe, device: str) -> Any:
    """PaiNN with elements, reference energies and scale/shift fitted on the training split."""
    import torch

    from nvalchemi.data.datapipes.dataloader import DataLoader
    from nvalchemi.models.painn import PaiNN

    torch.manual_seed(recipe.seed)
    fit_data = DataLoader(splits.train, batch_size=256)
    return PaiNN.from_data(fit_data, **recipe.model_kwargs()).to(device)


def _hooks(plan: QuickstartPlan, console: Any) -> list[Any]:
    from nvalchemi.hooks.reporting.presets import run_reporting
    from nvalchemi.training.hooks.checkpoint import CheckpointHook
    from nvalchemi.training.hooks.ema import EMAHook
    from nvalchemi.training.hooks.gradients import GradientClipHook
    from nvalchemi.training.preemption import PreemptionHandler
    from nvalchemi.training.time_budget import TimeBudgetHook

    recipe = plan.recipe
    budget = None
    if plan.budget_s is not None:
        budget = TimeBudgetHook(plan.budget_s, fit=plan.fitted)
    hooks: list[Any] = [EMAHook(decay=recipe.ema_decay)]
    if recipe.grad_clip_norm:
        hooks.append(GradientClipHook(recipe.grad_clip_norm))
    hooks += [
        CheckpointHook(
            plan.checkpoint_dir, epoch_interval=1, keep_last=recipe.keep_last, keep_best=1
        ),
        run_reporting(
            plan.run_dir,
            log_every=recipe.log_every_n_steps,
            tensorboard=plan.tensorboard,
            title="nvalchemi quickstart: PaiNN on bundled EMT",
            console=console,
            budget=budget,
            trackers=plan.trackers,
        ),
        # Ctrl-C: finish the step, checkpoint, evaluate (a second Ctrl-C is ignored).
        PreemptionHandler(signals=(signal.SIGINT,), exit=False),
    ]
    if budget is not None:
        hooks.append(budget)
    return hooks


def _validation(val_loader: Any) -> Any:
    from nvalchemi.training.validation import ValidationConfig

    return ValidationConfig(validation_data=val_loader, every_n_epochs=1)


def build_strategy(
    plan: QuickstartPlan, model: Any, train: Any, val: Any, console: Any = None
) -> Any:
    """A fresh ``TrainingStrategy`` for the plan's recipe."""
    from nvalchemi.app.jobs.build import BUDGET_STEPS
    from nvalchemi.training.strategy import TrainingStrategy

    recipe = plan.recipe
    fixed = {"num_epochs": recipe.epochs} if recipe.epochs else {"num_steps": BUDGET_STEPS}
    total_steps = recipe.epochs * len(train) if recipe.epochs else None  # else fitted
    return TrainingStrategy(
        models=model,
        optimizer_configs=recipe.optimizer_config(total_steps),
        loss_fn=recipe.loss_fn(),
        validation_config=_validation(val),
        hooks=_hooks(plan, console),
        devices=[plan.device],
        **fixed,
    )


def resume_strategy(plan: QuickstartPlan, val: Any, console: Any = None) -> Any:
    """The strategy of the latest checkpoint, with the same hooks and validation."""
    import warnings

    from nvalchemi.training.strategy import TrainingStrategy

    with warnings.catch_warnings():
        # A cap (--minutes with --epochs) comes and goes: its plan is not needed without one.
        warnings.filterwarnings("ignore", message=r".*hooks \['TimeBudgetHook'\] that are not")
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
