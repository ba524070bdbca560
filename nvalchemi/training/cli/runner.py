"""Run or resume a job: data, strategy, hooks, validation, reporting, plots.

Order of work in :func:`run_job`:

1. optional distributed setup (``DistributedManager`` + ``DDPHook`` first in the hooks);
2. readers for the training and validation data (nothing is loaded yet);
3. the strategy: built from the job (:mod:`.build`), or restored from a checkpoint
   (``TrainingStrategy.load_checkpoint``, which rebuilds the saved strategy class);
4. datasets and loaders, with neighbour lists for the model's cutoff;
5. validation (CLI flags, else the job's ``validation`` block, else every epoch);
6. hooks added by the CLI: reporting, a time budget, and a ``PreemptionHandler``
   (``SIGTERM``/``SIGUSR1`` -> checkpoint and exit 75) when a ``CheckpointHook`` exists;
7. ``strategy.run(loader)``, then learning curves and, on rank 0 with validation data,
   parity plots of the final model (EMA weights when the run kept them) on that data.

``SIGTERM``/``SIGUSR1`` during steps 1-6 stop the command with a message (nothing was
saved, nothing needs resuming) and exit status 75 (:class:`SetupSignals`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvalchemi.training.cli._errors import CLIError
from nvalchemi.training.cli.job_spec import TrainingJobSpec, dump_job
from nvalchemi.training.cli.payload import ResolvedJob

__all__ = [
    "RunOptions",
    "RunResult",
    "SetupSignals",
    "distributed_enabled",
    "launch_env",
    "SavedProgress",
    "run_job",
    "saved_progress",
    "seed_everything",
]


@dataclass
class RunOptions:
    """Command-line overrides of a job (``None``: use the job's value)."""

    batch_size: int | None = None
    shuffle: bool | None = None
    drop_last: bool = False
    num_workers: int | None = None
    map_location: str | None = None
    distributed: bool | None = None
    ddp_backend: str | None = None
    dist_timeout_s: float | None = None  # else the job's distributed.timeout_s
    validation_paths: tuple[str, ...] = ()
    validation_every_epochs: int | None = None
    validation_every_steps: int | None = None
    minutes: float | None = None
    num_steps: int | None = None
    lr: float | None = None  # resume only: new learning rate of every optimizer
    trust: bool = False
    allow_imports: tuple[str, ...] = ()


@dataclass
class RunResult:
    strategy: Any
    run_dir: Path
    checkpoint_dir: Path | None
    plots: list[Path] = field(default_factory=list)
    final_metrics: dict[str, float] = field(default_factory=dict)
    final_weights: str | None = None
    num_train: int = 0
    num_validation: int = 0
    is_main: bool = True
    forgetting: dict[str, dict[str, float]] | None = None
    """Held-out replay errors before/after a fine-tune with replay (``ForgettingHook.result``)."""


def launch_env(environ: Any = None) -> Any:
    """The launch this process is part of (torchrun, Slurm ``srun`` or a single process)."""
    from nvalchemi.distributed.launch import METHOD_ENV, detect_launch_env

    try:
        return detect_launch_env(environ)
    except ValueError as exc:
        raise CLIError(
            f"cannot read the launch environment: {exc}",
            field="environment",
            fix=f"fix the launcher variables, or set {METHOD_ENV}=single to run one process",
        ) from None


def distributed_enabled(flag: bool | None, environ: Any = None) -> bool:
    """``--distributed/--no-distributed``, else whether the launch has more than one rank.

    torchrun (``RANK``/``WORLD_SIZE``) and Slurm ``srun`` (``SLURM_PROCID``/``SLURM_NTASKS``)
    are recognised, as by ``DistributedManager.initialize``.
    """
    if flag is not None:
        return bool(flag)
    return launch_env(environ).world_size > 1


def _distributed(options: RunOptions, job: TrainingJobSpec) -> tuple[Any, list[Any]]:
    if not distributed_enabled(options.distributed):
        return None, []
    from nvalchemi.distributed import DistributedManager
    from nvalchemi.training.hooks.ddp import DDPHook

    timeout_s = options.dist_timeout_s
    if timeout_s is None and job.distributed is not None:
        timeout_s = job.distributed.timeout_s
    DistributedManager.initialize(backend=options.ddp_backend, timeout_s=timeout_s)
    return DistributedManager(), [DDPHook(backend=options.ddp_backend)]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (model initialisation, dropout).

    With the data order seeded by the loader, two runs of the same job on the CPU give
    bitwise-identical weights. Every rank uses the same seed (DDP starts from rank 0's
    weights anyway).
    """
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _validation_config(job: TrainingJobSpec, options: RunOptions, loader: Any) -> Any:
    from nvalchemi.training.validation import ValidationConfig

    if options.validation_every_epochs and options.validation_every_steps:
        raise CLIError(
            "Use only one of --validation-every-epochs and --validation-every-steps",
            fix="drop one of them",
        )
    if options.validation_every_epochs or options.validation_every_steps:
        cadence = {
            "every_n_epochs": options.validation_every_epochs,
            "every_n_steps": options.validation_every_steps,
        }
    elif job.validation is not None:
        cadence = {
            "every_n_epochs": job.validation.every_n_epochs,
            "every_n_steps": job.validation.every_n_steps,
        }
    else:
        cadence = {"every_n_epochs": 1}
    use_ema = job.validation.use_ema if job.validation is not None else "auto"
    return ValidationConfig(validation_data=loader, use_ema=use_ema, **cadence)


def _checkpoint_dir(hooks: list[Any]) -> Path | None:
    from nvalchemi.training.hooks.checkpoint import CheckpointHook

    for hook in hooks:
        if isinstance(hook, CheckpointHook):
            return Path(hook.checkpoint_dir)
    return None


_MAP_FIX = "use --map-location cpu (or a device present on this machine)"


def check_devices(
    job: TrainingJobSpec, options: RunOptions, resume_from: Path | None, index: Any = "latest"
) -> None:
    """Refuse devices this machine lacks before anything is loaded or built on them."""
    from nvalchemi.training.cli.devices import check_device

    if options.map_location is not None:
        check_device(options.map_location, field="--map-location", fix=_MAP_FIX)
        return
    if resume_from is None:
        devices = job.strategy.get("devices") or ["cpu"]
        for device in [devices] if isinstance(devices, str) else devices:
            check_device(
                device,
                field="strategy.devices",
                fix="set strategy.devices to ['cpu'] in the job file, or pass --map-location cpu",
            )
        return
    from nvalchemi.training.checkpoint import read_strategy_metadata

    meta = read_strategy_metadata(resume_from, index) or {}
    for device in meta.get("devices") or []:
        check_device(
            device,
            field=f"CHECKPOINT_DIR (saved devices of {resume_from})",
            fix="pass --map-location cpu to resume on the CPU (or another device present here)",
        )


def _check_root(resume_from: Path) -> None:
    if not (resume_from / "manifest.json").is_file():
        raise CLIError(
            f"{resume_from} holds no checkpoints (no manifest.json)",
            field="CHECKPOINT_DIR",
            fix="give the directory the run's CheckpointHook writes to (output.checkpoint_dir)",
        )


CLI_HOOKS = frozenset({"DDPHook", "ReportingOrchestrator", "TimeBudgetHook", "PreemptionHandler"})
"""Hooks ``spec run`` adds by itself (from options and the launch), not from ``source.hooks``."""


def _warn_missing_job_hooks(resume_from: Path, index: Any, hooks: list[Any]) -> None:
    """Warn when the saved run had hooks from ``source.hooks`` that the job no longer lists.

    The CLI's own hooks (:data:`CLI_HOOKS`) come and go with the options (``--minutes``,
    the number of ranks); their absence is no reason to warn.
    """
    from nvalchemi.training.checkpoint import read_strategy_metadata

    meta = read_strategy_metadata(resume_from, index) or {}
    names = set()
    for hook in hooks:
        children = getattr(hook, "iter_hooks", None)
        names.update(type(h).__name__ for h in (children() if callable(children) else [hook]))
    missing = sorted(set(meta.get("hook_types") or []) - names - CLI_HOOKS)
    if missing:
        warnings.warn(
            f"The saved run used hooks {missing} that the job file does not list in "
            "source.hooks (hooks are not stored in checkpoints); add them back to keep e.g. "
            "checkpointing, EMA and early stopping going.",
            UserWarning,
            stacklevel=2,
        )


@dataclass
class SavedProgress:
    """How far the run of a checkpoint got, and how far it was meant to go."""

    step_count: int
    epoch_count: int
    num_steps: int | None
    num_epochs: float | None
    exact: bool
    """Whether :attr:`complete` is known before training (not for fractional epochs)."""
    optimizer_configs: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1

    @property
    def complete(self) -> bool:
        if self.num_steps is not None:
            return self.step_count >= self.num_steps
        return self.exact and self.num_epochs is not None and self.epoch_count >= self.num_epochs

    def describe(self) -> str:
        if self.num_steps is not None:
            return f"step {self.step_count:,} of num_steps = {self.num_steps:,}"
        return (
            f"epoch {self.epoch_count} of num_epochs = {self.num_epochs} (step {self.step_count:,})"
        )


def saved_progress(resume_from: str | Path, index: Any) -> SavedProgress:
    """The :class:`SavedProgress` of checkpoint ``index`` in ``resume_from`` (no tensors read)."""
    from nvalchemi.training.checkpoint import read_strategy_metadata

    _check_root(Path(resume_from))
    meta = read_strategy_metadata(resume_from, index) or {}
    state = meta.get("runtime_state") or {}
    modifier = meta.get("epoch_step_modifier", 1.0)
    return SavedProgress(
        step_count=int(state.get("step_count", 0)),
        epoch_count=int(state.get("epoch_count", 0)),
        num_steps=meta.get("num_steps"),
        num_epochs=meta.get("num_epochs"),
        exact=modifier in (None, 1, 1.0),
        optimizer_configs=meta.get("optimizer_configs") or {},
        world_size=int(meta.get("world_size") or 1),
    )


def _load(resume_from: Path, index: Any, options: RunOptions, hooks: list[Any]) -> Any:
    from nvalchemi.training.strategy import TrainingStrategy

    _warn_missing_job_hooks(resume_from, index, hooks)
    overrides: dict[str, Any] = {}
    if options.num_steps is not None:
        overrides.update(num_steps=options.num_steps, num_epochs=None)
    if options.lr is not None:
        overrides["optimizer_kwargs"] = {"lr": options.lr}
    with warnings.catch_warnings():
        # The validation config is attached right after loading (it needs the model's
        # neighbour-list cutoff for its loader); missing hooks were checked above.
        warnings.filterwarnings("ignore", message="The saved run validated")
        warnings.filterwarnings("ignore", message="The saved run used hooks")
        return TrainingStrategy.load_checkpoint(
            resume_from,
            index,
            options.map_location,
            hooks=hooks,
            trust=options.trust,
            overrides=overrides or None,
        )


class _StoppedDuringSetup(BaseException):
    """A stop signal before the first step (a ``BaseException``: no ``except Exception`` eats it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SetupSignals:
    """``SIGTERM``/``SIGUSR1`` while a run is set up: a clear message and exit status 75.

    Setting up (reading data, fitting statistics, neighbour lists) can take minutes on
    a large data set. A signal then stops the command with a message that the run was
    stopped before its first training step, that nothing was saved and nothing needs
    resuming, and exit status :data:`~nvalchemi.training.preemption.PREEMPTION_EXIT_CODE`
    (75): a job script that requeues on 75 simply runs the same command again. Once
    training started (:meth:`training_started`), the run's ``PreemptionHandler`` owns
    the signals (checkpoint, then 75); without one, a signal acts as it would without
    this guard.
    """

    def __init__(self, console: Any = None) -> None:
        self.console = console
        self.training = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SetupSignals:
        import signal
        import threading

        from nvalchemi.training.preemption import PreemptionHandler

        if threading.current_thread() is threading.main_thread():
            for signum in PreemptionHandler().signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def training_started(self) -> None:
        self.training = True

    def _handle(self, signum: int, frame: Any) -> None:
        import os

        if not self.training:
            raise _StoppedDuringSetup(signum)
        self._restore()  # as without this guard: e.g. the default action (exit 143)
        os.kill(os.getpid(), signum)

    def _restore(self) -> None:
        import signal

        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._restore()
        if not isinstance(exc, _StoppedDuringSetup):
            return
        import signal

        from nvalchemi.training.preemption import PREEMPTION_EXIT_CODE

        if self.console is not None:
            name = signal.Signals(exc.signum).name
            self.console.print(
                f"Stopped by {name} while setting up (reading data, statistics, neighbour "
                "lists), before the first training step: nothing was trained or saved, so "
                "nothing needs resuming; run the same command again to start. Exit status "
                f"{PREEMPTION_EXIT_CODE}.",
                markup=False,
                soft_wrap=True,
            )
        raise SystemExit(PREEMPTION_EXIT_CODE) from None


def run_job(
    job: TrainingJobSpec,
    resolved: ResolvedJob,
    options: RunOptions,
    *,
    resume_from: str | Path | None = None,
    checkpoint_index: Any = -1,
    console: Any = None,
) -> RunResult:
    """Train (or resume) ``job``; returns the strategy and where results are.

    A stop signal before the first step ends the command with exit status 75 and a
    message (see :class:`SetupSignals`).
    """
    from nvalchemi.distributed.launch import detect_launch_env

    main_rank = _launch_rank(detect_launch_env) == 0
    with SetupSignals(console if main_rank else None) as signals:
        return _run_job(
            job,
            resolved,
            options,
            signals,
            resume_from=resume_from,
            checkpoint_index=checkpoint_index,
            console=console,
        )


def _launch_rank(detect: Any) -> int:
    try:
        return detect().rank
    except ValueError:
        return 0


def _run_job(
    job: TrainingJobSpec,
    resolved: ResolvedJob,
    options: RunOptions,
    signals: SetupSignals,
    *,
    resume_from: str | Path | None,
    checkpoint_index: Any,
    console: Any,
) -> RunResult:
    from nvalchemi.distributed.runtime import get_rank, get_world_size
    from nvalchemi.training.cli.build import build_strategy
    from nvalchemi.training.cli.data_sources import (
        make_dataset,
        make_loader,
        neighbor_config_of,
        open_sources,
    )
    from nvalchemi.training.cli.finetune_run import forgetting_hook, prepare_finetune_run
    from nvalchemi.training.cli.run_reporting import TimeBudgetHook, reporting_hook
    from nvalchemi.training.preemption import PreemptionHandler

    run_dir = Path(job.output.run_dir)
    if resume_from is not None:
        _check_root(Path(resume_from))
    check_devices(
        job, options, None if resume_from is None else Path(resume_from), checkpoint_index
    )
    manager, hooks = _distributed(options, job)
    is_main = get_rank(manager) == 0
    if not is_main:
        console = None  # one rank reports
    title = job.name
    world_size = get_world_size(manager)
    if world_size > 1:
        title = f"{job.name} (rank 0 of {world_size}; structures/s per rank)"
        if console is not None:
            console.print(
                f"distributed: {world_size} ranks ({launch_env().source} launch); progress "
                f"is rank 0's: structures/s are per rank, about {world_size}x that in total"
            )
    hooks += [hook for hook, _ in resolved.hooks]
    forgetting = forgetting_hook(job)
    if forgetting is not None:
        hooks.append(forgetting)  # ahead of the reporters: its numbers join validation rows
    checkpoint_dir = _checkpoint_dir(hooks)
    if resume_from is None and checkpoint_dir and (checkpoint_dir / "manifest.json").is_file():
        raise CLIError(
            f"{checkpoint_dir} already holds checkpoints of an earlier run",
            field="source.hooks (CheckpointHook.checkpoint_dir)",
            fix=f"continue it with `nvalchemi-training spec resume {checkpoint_dir} --spec JOB`, "
            "or remove the directory, or point the CheckpointHook somewhere else",
        )
    hooks.append(
        reporting_hook(
            run_dir,
            log_every=job.output.log_every_n_steps,
            tensorboard=job.output.tensorboard,
            title=title,
            console=console,
        )
    )
    if options.minutes is not None:
        hooks.append(TimeBudgetHook(options.minutes * 60))
    if checkpoint_dir is not None:
        hooks.append(PreemptionHandler())
    data = job.dataset
    sources = open_sources(data, options.validation_paths)
    counts = {"num_train": sources.num_train, "num_validation": sources.num_validation}
    if console is not None:
        console.print(
            f"data: {counts['num_train']:,} training / {counts['num_validation']:,} validation "
            f"structures from {len(sources.train)} source(s)"
        )
    try:
        if resume_from is not None:
            strategy = _load(Path(resume_from), checkpoint_index, options, hooks)
        else:
            seed_everything(data.seed)  # same job, same initial weights and training
            strategy = build_strategy(
                job,
                sources=sources,
                hooks=hooks,
                trust=options.trust,
                map_location=options.map_location,
                distributed_manager=manager,
            )
        if manager is not None:
            strategy.distributed_manager = manager
        neighbors = neighbor_config_of(strategy.models)
        train = make_dataset(sources.train, neighbor_config=neighbors, in_memory=data.in_memory)
        batch_size = options.batch_size or data.batch_size
        shuffle = data.shuffle if options.shuffle is None else options.shuffle
        num_workers = data.num_workers if options.num_workers is None else options.num_workers
        finetune = prepare_finetune_run(
            job, strategy, train, run_dir=run_dir, neighbors=neighbors, batch_size=batch_size,
            shuffle=shuffle, seed=data.seed, resumed=resume_from is not None, manager=manager,
            forgetting=forgetting, console=console,
        )  # fmt: skip
        if finetune is not None and finetune.batch_sampler is not None:
            from nvalchemi.data.datapipes.dataloader import DataLoader

            loader = DataLoader(
                finetune.train, batch_sampler=finetune.batch_sampler, num_workers=num_workers
            )
        else:
            loader = make_loader(
                train if finetune is None else finetune.train,
                batch_size=batch_size,
                shuffle=shuffle,
                seed=data.seed,
                num_workers=num_workers,
                drop_last=options.drop_last,
                balance_ranks=True,
            )
        validation = None
        if sources.validation:
            validation = make_dataset(
                sources.validation, neighbor_config=neighbors, in_memory=data.in_memory
            )
            val_loader = make_loader(validation, batch_size=options.batch_size or data.batch_size)
            strategy.validation_config = _validation_config(job, options, val_loader)
        if is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            dump_job(job, run_dir / "job.json")
        signals.training_started()
        strategy.run(loader)
        result = RunResult(strategy, run_dir, checkpoint_dir, is_main=is_main, **counts)
        result.forgetting = None if forgetting is None else forgetting.result
        if job.output.plots and is_main:
            _final_plots(result, job, validation, options.batch_size or data.batch_size, console)
    finally:
        sources.close()
    return result


def _final_plots(
    result: RunResult, job: TrainingJobSpec, validation: Any, batch_size: int, console: Any
) -> None:
    """Learning curves, and parity plots of the final model on the validation data."""
    from nvalchemi.training.cli.final_eval import final_parity_plots
    from nvalchemi.training.cli.run_reporting import PLOTS_HINT, learning_curves, plots_available

    if not plots_available():
        if console is not None:
            console.print(PLOTS_HINT)
        return
    curve = learning_curves(result.run_dir)
    if curve is not None:
        result.plots.append(curve)
    if validation is None:
        return
    use_ema = job.validation.use_ema if job.validation is not None else "auto"
    paths, metrics, weights = final_parity_plots(
        result.strategy, validation, result.run_dir, batch_size=batch_size, use_ema=use_ema
    )
    result.plots += paths
    result.final_metrics, result.final_weights = metrics, weights
