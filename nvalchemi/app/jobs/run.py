"""Run or resume a job (``spec run`` / ``spec resume``): :func:`run_job`.

It sets up distributed training when launched on several ranks, opens the data, builds
the strategy from the job (or restores it from a checkpoint), makes the loaders (fixed
batches, an atom/edge budget, or ``batch_size: auto`` probed on the model), adds
validation, reporting, a time budget and a ``PreemptionHandler``, trains, and on rank 0
evaluates the final model on the validation data (``final_evaluation.json``, parity
plots) and, with ``evaluation: {md: ...}``, runs the MD check on it (``"md"`` in
``final_evaluation.json``, ``md_check.png``; :mod:`nvalchemi.app.md_check`). A stop
signal before the first step exits with status 75 (:mod:`.signals`).

Example:
    >>> from nvalchemi.app.jobs import load_job, run_job, RunOptions
    >>> job, resolved = load_job("job.yaml")  # doctest: +SKIP
    >>> result = run_job(job, resolved, RunOptions(minutes=5))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError
from nvalchemi._fileio import write_atomic
from nvalchemi.app.jobs.resolve import ResolvedJob
from nvalchemi.app.jobs.signals import SetupSignals
from nvalchemi.app.jobs.spec import TrainingJobSpec, dump_job

__all__ = [
    "RUN_HOOKS",
    "RunOptions",
    "RunResult",
    "SavedProgress",
    "distributed_enabled",
    "launch_env",
    "run_job",
    "saved_progress",
    "seed_everything",
]

FINAL_EVALUATION = "final_evaluation.json"


@dataclass
class RunOptions:
    """Overrides of a job (``None``: use the job's value), e.g. from the command line."""

    batch_size: int | str | None = None
    max_atoms: int | None = None
    max_edges: int | None = None
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
    threads: int | None = None
    """Neighbour-list builder threads (the caller sets torch's own)."""
    group_by: str | None = None
    loggers: tuple[str, ...] = ()
    """Experiment trackers (``--logger``); empty: the job's ``output.loggers``."""
    lr: float | None = None  # resume only: new learning rate of every optimizer
    trust: bool = False
    allow_imports: tuple[str, ...] = ()


@dataclass
class RunResult:
    """What a run left: the strategy, where its files are, the final evaluation."""

    strategy: Any
    run_dir: Path
    checkpoint_dir: Path | None
    plots: list[Path] = field(default_factory=list)
    final_metrics: dict[str, float] = field(default_factory=dict)
    final_weights: str | None = None
    evaluation: Any = None
    """The final model's :class:`~nvalchemi.app.evaluation.Evaluation` on the validation data."""
    grouping: str = ""
    num_train: int = 0
    num_validation: int = 0
    is_main: bool = True
    budget: Any = None
    """The :class:`~nvalchemi.training.time_budget.BudgetPlan` when the run had a budget."""
    batch_budget: Any = None
    """The :class:`~nvalchemi.training.memory_probe.BatchBudget` of ``batch_size: auto``."""
    forgetting: dict[str, dict[str, float]] | None = None
    """Held-out replay errors before/after a fine-tune with replay (``ForgettingHook.result``)."""
    md_check: Any = None
    """The final model's :class:`~nvalchemi.app.md_check.MDCheckResult` (``evaluation.md``)."""
    trackers: list[Any] = field(default_factory=list)
    """The experiment-tracker reporters (``output.loggers``); their ``run_id`` names the run."""
    calibration: dict[str, float] | None = None
    """A committee's calibration factors fitted on the validation data (stored in a last
    checkpoint by single-process runs; see :mod:`nvalchemi.app.uncertainty`)."""


def launch_env(environ: Any = None) -> Any:
    """The launch this process is part of (torchrun, Slurm ``srun`` or a single process)."""
    from nvalchemi.distributed.launch import METHOD_ENV, detect_launch_env

    try:
        return detect_launch_env(environ)
    except ValueError as exc:
        raise FieldError(
            f"cannot read the launch environment: {exc}",
            field="environment",
            fix=f"fix the launcher variables, or set {METHOD_ENV}=single to run one process",
        ) from None


def distributed_enabled(flag: bool | None, environ: Any = None) -> bool:
    """``--distributed/--no-distributed``, else whether the launch (torchrun, srun) has ranks."""
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
    """Seed Python's, NumPy's and torch's generators: the same job gives the same weights."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _validation_config(job: TrainingJobSpec, options: RunOptions, loader: Any) -> Any:
    from nvalchemi.training.validation import ValidationConfig

    if options.validation_every_epochs and options.validation_every_steps:
        raise FieldError(
            "Use only one of --validation-every-epochs and --validation-every-steps",
            fix="drop one of them",
        )
    epochs, steps = options.validation_every_epochs, options.validation_every_steps
    if not (epochs or steps) and job.validation is not None:
        epochs, steps = job.validation.every_n_epochs, job.validation.every_n_steps
    elif not (epochs or steps):
        epochs = 1
    use_ema = job.validation.use_ema if job.validation is not None else "auto"
    return ValidationConfig(
        validation_data=loader, use_ema=use_ema, every_n_epochs=epochs, every_n_steps=steps
    )


def _checkpoint_dir(hooks: list[Any]) -> Path | None:
    from nvalchemi.training.hooks.checkpoint import CheckpointHook

    for hook in hooks:
        if isinstance(hook, CheckpointHook):
            return Path(hook.checkpoint_dir)
    return None


def _check_writable(path: Path, field: str) -> None:
    """Refuse, before anything runs, a directory the run could not write (read-only, no
    permission): a :class:`FieldError` naming it and the cause. Leaves nothing behind."""
    import tempfile

    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise FieldError(
            f"{path} cannot be created: {existing} is not a directory",
            field=field,
            fix="choose a writable directory",
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".nvalchemi-write-test-", dir=existing))
    except OSError as exc:
        cause = exc.strerror or type(exc).__name__
        whose = "" if existing == path.absolute() else f" (the nearest existing folder of {path})"
        raise FieldError(
            f"cannot write in {existing}{whose}: {cause}",
            field=field,
            fix=f"choose a writable directory for {path}, or make {existing} writable",
        ) from None


def check_devices(
    job: TrainingJobSpec, options: RunOptions, resume_from: Path | None, index: Any = "latest"
) -> None:
    """Refuse devices this machine lacks before anything is loaded or built on them."""
    from nvalchemi.app.devices import check_device

    if options.map_location is not None:
        check_device(
            options.map_location,
            field="--map-location",
            fix="use --map-location cpu (or a device present on this machine)",
        )
        return
    if resume_from is None:
        for device in job.strategy.devices:
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
        raise FieldError(
            f"{resume_from} holds no checkpoints (no manifest.json)",
            field="CHECKPOINT_DIR",
            fix="give the directory the run's CheckpointHook writes to (output.checkpoint_dir)",
        )


RUN_HOOKS = frozenset(
    {"DDPHook", "ReportingOrchestrator", "TimeBudgetHook", "PreemptionHandler", "MDCheckHook"}
)
"""Hooks :func:`run_job` adds by itself (from options and the launch), not from ``source.hooks``."""


def _warn_missing_job_hooks(resume_from: Path, index: Any, hooks: list[Any]) -> None:
    """Warn when the saved run had hooks of ``source.hooks`` (not :data:`RUN_HOOKS`) gone now."""
    from nvalchemi.training.checkpoint import read_strategy_metadata

    meta = read_strategy_metadata(resume_from, index) or {}
    names = set()
    for hook in hooks:
        children = getattr(hook, "iter_hooks", None)
        names.update(type(h).__name__ for h in (children() if callable(children) else [hook]))
    missing = sorted(set(meta.get("hook_types") or []) - names - RUN_HOOKS)
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
        # A budget comes and goes with --minutes: its plan is not needed without one.
        warnings.filterwarnings("ignore", message=r".*hooks \['TimeBudgetHook'\] that are not")
        return TrainingStrategy.load_checkpoint(
            resume_from,
            index,
            options.map_location,
            hooks=hooks,
            trust=options.trust,
            overrides=overrides or None,
        )


def run_job(
    job: TrainingJobSpec,
    resolved: ResolvedJob,
    options: RunOptions | None = None,
    *,
    resume_from: str | Path | None = None,
    checkpoint_index: Any = -1,
    console: Any = None,
    signals: SetupSignals | None = None,
) -> RunResult:
    """Train (or resume) ``job``; returns the strategy and where results are.

    ``console`` (anything with ``print(text)``, e.g. a rich console) gets a few lines
    about the data, the model and the plan; the reporters show progress. ``signals``: the
    caller's :class:`SetupSignals` when it installed them earlier (the command line does,
    before it reads the job); else this call installs its own.
    """
    options = options or RunOptions()
    if signals is not None:
        return _run(job, resolved, options, signals, resume_from, checkpoint_index, console)
    with SetupSignals.on_main_rank(console) as own:
        return _run(job, resolved, options, own, resume_from, checkpoint_index, console)


def _budget_hook(job: TrainingJobSpec, options: RunOptions) -> Any:
    """A ``TimeBudgetHook`` for ``--minutes`` / ``minutes:`` (fitted unless the length is fixed)."""
    from nvalchemi.training.time_budget import TimeBudgetHook

    minutes = options.minutes if options.minutes is not None else job.minutes
    if minutes is None:
        return None
    fixed = job.strategy.num_steps is not None or job.strategy.num_epochs is not None
    return TimeBudgetHook(minutes * 60, fit=not (fixed or options.num_steps is not None))


def _batch_options(job: TrainingJobSpec, options: RunOptions) -> tuple[Any, Any, Any]:
    """``(batch_size, max_atoms, max_edges)`` after the options' overrides."""
    data = job.dataset
    if options.max_atoms is not None or options.max_edges is not None:
        return (
            data.batch_size if options.batch_size is None else options.batch_size,
            options.max_atoms,
            options.max_edges,
        )
    if options.batch_size is not None:
        return options.batch_size, None, None
    return data.batch_size, data.max_atoms, data.max_edges


def _budget_sampler(dataset: Any, max_atoms: Any, max_edges: Any, **kwargs: Any) -> Any:
    from nvalchemi.data.datapipes import BudgetBatchSampler

    try:
        return BudgetBatchSampler(dataset, max_atoms=max_atoms, max_edges=max_edges, **kwargs)
    except ValueError as exc:
        raise FieldError(
            str(exc),
            field="dataset.max_edges" if max_edges else "dataset.max_atoms",
            fix="give positive budgets (or batch_size: auto)",
        ) from None


def _probe(strategy: Any, train: Any, run_dir: Path, is_main: bool, console: Any) -> Any:
    """``batch_size: auto``: the atom/edge budget of the model on the training device."""
    from nvalchemi.training.memory_probe import probe_batch_budget

    model = strategy.unwrapped_models().get("main")
    if model is None:
        raise FieldError(
            "needs a model 'main' to probe",
            field="dataset.batch_size",
            fix="give batch_size as a number",
        )
    budget = probe_batch_budget(
        model, train, strategy.devices[0], out_dir=run_dir if is_main else None
    )
    if console is not None:
        edges = "" if budget.max_edges is None else f", {budget.max_edges:,} neighbour pairs"
        console.print(
            f"batch budget (batch_size: auto): {budget.max_atoms:,} atoms{edges} per batch, "
            f"probed on {budget.device} in {budget.seconds:.1f} s "
            f"({run_dir / 'batch_budget.json'})"
        )
    return budget


def _loaders(
    job: TrainingJobSpec,
    options: RunOptions,
    strategy: Any,
    train: Any,
    validation: Any,
    finetune: Any,
    run_dir: Path,
    is_main: bool,
    console: Any,
    balance: Any = None,
) -> tuple[Any, Any, Any]:
    """``(train loader, validation loader, batch budget of 'auto' or None)``.

    ``balance``: the group-balanced sampler of ``dataset.balance`` (an order of one
    replica), or ``None``."""
    from nvalchemi.data.datapipes.dataloader import DataLoader
    from nvalchemi.data.sources import make_loader

    data = job.dataset
    shuffle = data.shuffle if options.shuffle is None else options.shuffle
    workers = data.num_workers if options.num_workers is None else options.num_workers
    batch_size, max_atoms, max_edges = _batch_options(job, options)
    probed = None
    if finetune is not None:
        train = finetune.train  # with replay: the new data and the replay, one dataset
    if finetune is not None and finetune.batch_sampler is not None:
        loader = DataLoader(
            finetune.train, batch_sampler=finetune.batch_sampler, num_workers=workers
        )
    elif batch_size == "auto" or max_atoms is not None or max_edges is not None:
        if batch_size == "auto":
            probed = _probe(strategy, train, run_dir, is_main, console)
            max_atoms, max_edges = probed.max_atoms, probed.max_edges
        sampler = _budget_sampler(
            train,
            max_atoms,
            max_edges,
            shuffle=shuffle,
            seed=data.seed,
            drop_last=options.drop_last,
            sampler=balance,
        )
        loader = DataLoader(train, batch_sampler=sampler, num_workers=workers)
    elif balance is not None:  # sharded over the ranks like DistributedSampler
        from nvalchemi.data.datapipes import GroupBalancedSampler

        sampler = GroupBalancedSampler(
            balance.groups,
            alpha=balance.alpha,
            shuffle=shuffle,
            seed=data.seed,
            drop_last=options.drop_last,
        )
        loader = DataLoader(
            train,
            sampler=sampler,
            batch_size=batch_size,
            drop_last=options.drop_last,
            num_workers=workers,
        )
    else:
        loader = make_loader(
            train,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=data.seed,
            num_workers=workers,
            drop_last=options.drop_last,
            balance_ranks=True,
        )
    val_loader = None
    if validation is not None:
        if isinstance(batch_size, int):
            val_loader = make_loader(validation, batch_size=batch_size)
        else:
            val_loader = DataLoader(
                validation,
                batch_sampler=_budget_sampler(validation, max_atoms, max_edges, shuffle=False),
            )
    return loader, val_loader, probed


def _set_outputs(job: TrainingJobSpec, strategy: Any) -> None:
    """``source.active_outputs``: what the fine-tuned model computes while training."""
    if job.source.active_outputs is None:
        return
    for key, model in strategy.unwrapped_models().items():
        config = getattr(model, "model_config", None)
        if config is None:
            continue
        unknown = set(job.source.active_outputs) - set(config.outputs)
        if unknown:
            raise FieldError(
                f"model {key!r} ({type(model).__name__}) cannot produce {sorted(unknown)}; it "
                f"produces {sorted(config.outputs)}",
                field="source.active_outputs",
                fix="remove them (and the loss terms that need them)",
            )
        config.active_outputs = set(job.source.active_outputs)


def _run(
    job: TrainingJobSpec,
    resolved: ResolvedJob,
    options: RunOptions,
    signals: SetupSignals,
    resume_from: str | Path | None,
    checkpoint_index: Any,
    console: Any,
) -> RunResult:
    from nvalchemi.app.jobs.build import build_strategy
    from nvalchemi.app.jobs.finetune import forgetting_hook, prepare_finetune_run
    from nvalchemi.app.jobs.sampling import balance_line, balanced_sampler
    from nvalchemi.app.jobs.trackers import (
        chosen_loggers,
        log_evaluation,
        open_trackers,
        tensorboard_switch,
        tracker_reporters,
    )
    from nvalchemi.data.sources import make_dataset, neighbor_config_of
    from nvalchemi.distributed.runtime import get_rank, get_world_size
    from nvalchemi.hooks.reporting.presets import run_reporting
    from nvalchemi.training.preemption import PreemptionHandler

    run_dir = Path(job.output.run_dir)
    resume = None if resume_from is None else Path(resume_from)
    if resume is not None:
        _check_root(resume)
    check_devices(job, options, resume, checkpoint_index)
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
    _check_writable(run_dir, "output.run_dir")
    if checkpoint_dir is not None:
        _check_writable(checkpoint_dir, "source.hooks (CheckpointHook.checkpoint_dir)")
    if resume is None and checkpoint_dir and (checkpoint_dir / "manifest.json").is_file():
        raise FieldError(
            f"{checkpoint_dir} already holds checkpoints of an earlier run",
            field="source.hooks (CheckpointHook.checkpoint_dir)",
            fix=f"continue it with `nvalchemi-training spec resume {checkpoint_dir} --spec JOB`, "
            "or remove the directory, or point the CheckpointHook somewhere else",
        )
    budget = _budget_hook(job, options)
    if budget is not None:
        hooks.append(budget)
    loggers = chosen_loggers(job, options.loggers)
    config = {"job": job.model_dump(mode="json", exclude_none=True)}
    trackers = tracker_reporters(loggers, run_dir, name=job.name, config=config)
    reporting = run_reporting(
        run_dir,
        log_every=job.output.log_every_n_steps,
        tensorboard=tensorboard_switch(job, loggers),
        title=title,
        console=console,
        budget=budget,
        trackers=trackers,
    )
    hooks.append(reporting)
    if checkpoint_dir is not None:
        hooks.append(PreemptionHandler())
    data = job.dataset
    sources = data.open_sources(options.validation_paths)
    md_hook = _md_check_hook(job, sources)
    if md_hook is not None:
        hooks.insert(hooks.index(reporting), md_hook)  # its numbers join the validation rows
    counts = {"num_train": sources.num_train, "num_validation": sources.num_validation}
    if console is not None:
        console.print(
            f"data: {counts['num_train']:,} training / {counts['num_validation']:,} validation "
            f"structures from {len(sources.train)} source(s)"
            + (" (in memory)" if data.in_memory else "")
        )
    try:
        if resume is not None:
            strategy = _load(resume, checkpoint_index, options, hooks)
        else:
            seed_everything(data.seed)  # same job, same initial weights and training
            strategy = build_strategy(
                job,
                sources=sources,
                hooks=hooks,
                trust=options.trust,
                map_location=options.map_location,
                distributed_manager=manager,
                num_steps=options.num_steps,
            )
            _set_outputs(job, strategy)
        if manager is not None:
            strategy.distributed_manager = manager
        neighbors = neighbor_config_of(strategy.models)
        threads = {"n_threads": options.threads}
        train = make_dataset(
            sources.train, neighbor_config=neighbors, in_memory=data.in_memory, **threads
        )
        batch_size, _, _ = _batch_options(job, options)
        finetune = prepare_finetune_run(
            job,
            strategy,
            train,
            run_dir=run_dir,
            neighbors=neighbors,
            batch_size=batch_size if isinstance(batch_size, int) else 8,
            shuffle=data.shuffle if options.shuffle is None else options.shuffle,
            seed=data.seed,
            resumed=resume is not None,
            manager=manager,
            forgetting=forgetting,
            console=console,
        )
        validation = None
        if sources.validation:
            validation = make_dataset(
                sources.validation, neighbor_config=neighbors, in_memory=data.in_memory, **threads
            )
        balance = balanced_sampler(
            job,
            sources.train,
            shuffle=data.shuffle if options.shuffle is None else options.shuffle,
            seed=data.seed,
            whole_epoch=True,
            replay=job.finetune is not None and job.finetune.replay is not None,
        )
        if balance is not None and console is not None:
            console.print(balance_line(balance, data.balance.group_by))
        loader, val_loader, probed = _loaders(
            job, options, strategy, train, validation, finetune, run_dir, is_main, console, balance
        )
        if val_loader is not None:
            strategy.validation_config = _validation_config(job, options, val_loader)
        restore_job_copy = record_job(run_dir, job_as_run(job, options)) if is_main else None
        if console is not None and budget is not None:
            console.print(_budget_line(budget))
        signals.training_started()
        first_step = strategy.step_count
        with open_trackers(trackers):  # one tracked run for training and the final evaluation
            try:
                strategy.run(loader)
            except BaseException:
                if restore_job_copy is not None and strategy.step_count == first_step:
                    restore_job_copy()  # refused before its first step: the earlier copy stands
                raise
            result = RunResult(strategy, run_dir, checkpoint_dir, is_main=is_main, **counts)
            result.forgetting = None if forgetting is None else forgetting.result
            result.budget = None if budget is None else budget.plan
            result.batch_budget = probed
            result.trackers = trackers
            if is_main and sources.validation:
                _final_evaluation(result, job, sources.validation, val_loader, options)
            if result.calibration and checkpoint_dir is not None:
                if world_size == 1:
                    from nvalchemi.app.evaluation import store_calibration

                    store_calibration(strategy, result.calibration, checkpoint_dir)
                elif console is not None:
                    console.print(
                        "the calibration factors of the committee's spreads are in "
                        "final_evaluation.json; multi-rank runs do not store them in the checkpoint"
                    )
            if is_main and job.evaluation is not None and job.evaluation.md is not None:
                _final_md_check(result, job, sources.validation or sources.train, options, console)
            if is_main:
                log_evaluation(
                    trackers, result.evaluation, plots=result.plots, md_check=result.md_check
                )
    finally:
        sources.close()
    return result


def job_as_run(job: TrainingJobSpec, options: RunOptions) -> dict[str, Any]:
    """``job`` with every override of ``options`` that is a job setting applied: what
    ``<run_dir>/job.json`` records, and a job ``spec run`` takes to train the same way.

    Execution options that are no job setting (``--threads``, ``--distributed``,
    ``--ddp-backend``, ``--drop-last``, ``--trust``, ``--allow-import``) are not in it.
    """
    data = job.model_dump(mode="json", exclude_none=True)
    dataset, strategy = data["dataset"], data["strategy"]
    batch_size, max_atoms, max_edges = _batch_options(job, options)
    dataset.update(batch_size=batch_size, max_atoms=max_atoms, max_edges=max_edges)
    if options.shuffle is not None:
        dataset["shuffle"] = options.shuffle
    if options.num_workers is not None:
        dataset["num_workers"] = options.num_workers
    if options.validation_paths:
        dataset["validation_path"] = [str(Path(p).resolve()) for p in options.validation_paths]
        dataset["val_fraction"] = None
    if options.validation_every_epochs or options.validation_every_steps:
        data["validation"] = {
            **data.get("validation", {}),
            "every_n_epochs": options.validation_every_epochs,
            "every_n_steps": options.validation_every_steps,
        }
    if options.minutes is not None:
        data["minutes"] = options.minutes
    if options.num_steps is not None:
        strategy.update(num_steps=options.num_steps, num_epochs=None)
    if options.map_location is not None:
        strategy["devices"] = [options.map_location]
    if options.lr is not None:
        for configs in (strategy.get("optimizer_configs") or {}).values():
            for config in configs:
                config.setdefault("optimizer_kwargs", {})["lr"] = options.lr
    if options.dist_timeout_s is not None:
        data["distributed"] = {**data.get("distributed", {}), "timeout_s": options.dist_timeout_s}
    if options.group_by is not None:
        data["output"]["group_by"] = options.group_by
    return _without_none(data)


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def record_job(run_dir: Path, job: dict[str, Any]) -> Any:
    """Write ``job`` to ``<run_dir>/job.json`` (atomically); returns a function that puts
    back what was there before (the previous run's copy, or nothing)."""
    path = run_dir / "job.json"
    previous = path.read_bytes() if path.is_file() else None
    write_atomic(path, dump_job(job).encode())

    def restore() -> None:
        if previous is None:
            path.unlink(missing_ok=True)
        else:
            write_atomic(path, previous)

    return restore


def _budget_line(budget: Any) -> str:
    minutes = f"{budget.seconds / 60:.3g} min"
    if budget.fit:
        return (
            f"time budget: {minutes}; the run's length and learning-rate schedule are fitted "
            "to it after timing the first steps"
        )
    return f"time budget: {minutes}, a cap on the job's fixed length"


def _final_evaluation(
    result: RunResult,
    job: TrainingJobSpec,
    readers: list[Any],
    val_loader: Any,
    options: RunOptions,
) -> None:
    """Learning curves; the final model on the validation data: errors, tables, parity plots."""
    from nvalchemi.app.evaluation import evaluate_final_model
    from nvalchemi.hooks.reporting.presets import learning_curves, plots_available

    if job.output.plots and plots_available():
        curve = learning_curves(result.run_dir)
        if curve is not None:
            result.plots.append(curve)
    use_ema = job.validation.use_ema if job.validation is not None else "auto"
    batch_size = getattr(val_loader, "batch_size", None) or 16
    evaluation, weights, grouping = evaluate_final_model(
        result.strategy,
        readers,
        batch_size=batch_size,
        use_ema=use_ema,
        group_by=options.group_by or job.output.group_by,
        n_threads=options.threads,
    )
    if evaluation is None:
        return
    from nvalchemi.app.uncertainty import apply_calibration, calibration_plot, fit_calibration

    # A committee's spreads: calibrated on this validation data (stored by the caller).
    result.calibration = fit_calibration(evaluation)
    apply_calibration(evaluation, result.calibration)
    result.evaluation, result.final_weights, result.grouping = evaluation, weights, grouping
    result.final_metrics = evaluation.metrics()
    report = {"weights": weights, "grouping": grouping, **evaluation.report()}
    (result.run_dir / FINAL_EVALUATION).write_text(json.dumps(report, indent=2) + "\n")
    if job.output.plots and plots_available():
        result.plots += evaluation.parity_plots(result.run_dir)
        if result.calibration:
            result.plots.append(calibration_plot(evaluation, result.run_dir))


def _md_check_hook(job: TrainingJobSpec, sources: Any) -> Any:
    """The short MD check every K validations of ``evaluation.md.every_n_validations``."""
    md = job.evaluation.md if job.evaluation is not None else None
    if md is None or md.every_n_validations is None or not sources.validation:
        return None
    from nvalchemi.app.md_check import MDCheckHook

    return MDCheckHook(
        readers=sources.validation,
        every_n_validations=md.every_n_validations,
        settings=md.settings().short(),
    )


def _final_md_check(
    result: RunResult, job: TrainingJobSpec, readers: list[Any], options: RunOptions, console: Any
) -> None:
    """``evaluation.md``: the MD check of the final model; ``"md"`` in final_evaluation.json."""
    from nvalchemi.app.evaluation import final_model
    from nvalchemi.app.md_check import md_check
    from nvalchemi.hooks.reporting.presets import plots_available

    use_ema = job.validation.use_ema if job.validation is not None else "auto"
    model, _ = final_model(result.strategy, use_ema)
    if model is None:
        return
    settings = job.evaluation.md.settings()
    if settings.group_by is None and (options.group_by or job.output.group_by):
        settings = settings.model_copy(update={"group_by": options.group_by or job.output.group_by})
    if console is not None:
        console.print(
            f"MD check of the final model: {', '.join(f'{t:g}' for t in settings.temperatures_K)}"
            f" K, {settings.nvt_ps:g} ps NVT then {settings.nve_ps:g} ps NVE per structure"
        )
    result.md_check = md_check(model, readers, settings, device=result.strategy.devices[0])
    path = result.run_dir / FINAL_EVALUATION
    report = json.loads(path.read_text()) if path.is_file() else {}
    report["md"] = result.md_check.report()
    path.write_text(json.dumps(report, indent=2) + "\n")
    if job.output.plots and plots_available():
        result.plots.append(result.md_check.plot(result.run_dir / "md_check.png"))
