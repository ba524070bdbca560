"""``spec report``: a job as tables and warnings, without loading models or data.

Sections: Training Intent, Hook Firing Order, Warnings, Strategy, Fine-tuning, Optimizers,
Batches, Notes and a Learning-rate preview computed with the real scheduler.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from nvalchemi.app.cli._console import format_number
from nvalchemi.app.jobs.checks import job_warnings
from nvalchemi.app.jobs.lr_preview import lr_preview, preview_steps
from nvalchemi.app.jobs.resolve import ResolvedJob
from nvalchemi.app.jobs.spec import TrainingJobSpec

__all__ = ["model_name", "render_report", "strategy_class_name"]

_LEVEL_STYLE = {"danger": "bold red", "warning": "yellow", "info": "cyan", "ok": "green"}


def strategy_class_name(job: TrainingJobSpec) -> str:
    """Which strategy ``spec run`` builds for ``job``."""
    if job.workflow == "finetune" or job.uses_finetuning_features:
        return "FineTuningStrategy"
    return "TrainingStrategy"


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", show_lines=False, expand=False)
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


def _kwargs(value: Any) -> str:
    if not value:
        return "-"
    return ", ".join(
        f"{k}={format_number(v) if isinstance(v, float) else v}" for k, v in value.items()
    )


def _loss_rows(resolved: ResolvedJob) -> list[tuple[str, str]]:
    loss = resolved.loss_fn
    if loss is None:
        return [("loss", "from the source checkpoint (use_original_loss)")]
    rows = []
    for name, component, weight in zip(loss.component_names, loss.components, loss.weights):
        weight_text = format_number(weight) if isinstance(weight, float) else type(weight).__name__
        extra = " (per atom)" if getattr(component, "per_atom", False) else ""
        rows.append(("loss term", f"{weight_text} x {name}{extra}"))
    rows.append(("loss dtype policy", loss.dtype_policy or "strict"))
    rows.append(("normalize weights", str(loss.normalize_weights)))
    return rows


def _intent(job: TrainingJobSpec, resolved: ResolvedJob) -> Table:
    table = _table("Training Intent", "setting", "value")
    source, data, payload = job.source, job.dataset, job.strategy
    model = "trained from scratch" if job.workflow == "train" else source.model
    if source.checkpoint_path:
        model += f" from {source.checkpoint_path}"
        if source.model == "native-checkpoint":
            model += f" (checkpoint {source.checkpoint_index})"
    elif source.model_id:
        model += f" {source.model_id}"
    rows = [
        ("workflow", job.workflow),
        ("model source", model),
        (
            "model",
            ", ".join(f"{k}: {model_name(c)}" for k, c in resolved.model_classes.items()) or "-",
        ),
    ]
    outputs = _outputs(job)
    if outputs:
        rows.append(("model outputs", outputs))
    if source.fit_to_data:
        rows.append(
            ("fit to data", "elements, reference energies and scale/shift from the training set")
        )
    rows.append(("training data", ", ".join(data.all_paths) + f" [{data.format}]"))
    if data.validation_paths:
        rows.append(("validation data", ", ".join(data.validation_paths)))
    elif data.val_fraction is not None:
        rows.append(
            ("validation data", f"{data.val_fraction:.0%} of the training data (seed {data.seed})")
        )
    else:
        rows.append(("validation data", "none"))
    if job.validation is not None:
        cadence = (
            f"every {job.validation.every_n_steps} steps"
            if job.validation.every_n_steps
            else f"every {job.validation.every_n_epochs or 'end of'} epoch(s)"
        )
        rows.append(("validation cadence", cadence))
    rows.append(("batches", _batches(data)))
    if data.in_memory:
        rows.append(("in memory", "every structure loaded once, neighbour lists built once"))
    rows.append(("duration", _duration(job)))
    rows.append(("devices", ", ".join(str(d) for d in resolved.devices)))
    rows.extend(_loss_rows(resolved))
    rows.append(("training_fn", payload.training_fn))
    rows.append(("run directory", job.output.run_dir))
    rows.append(("checkpoints", job.output.checkpoint_root))
    for row in rows:
        table.add_row(*row)
    return table


def model_name(cls: type) -> str:
    """``"PaiNN (built-in, nvalchemi.models.painn)"`` or ``"MyModel (mypkg.models)"``."""
    where = "built-in, " if cls.__module__.startswith("nvalchemi.") else ""
    return f"{cls.__name__} ({where}{cls.__module__})"


def _outputs(job: TrainingJobSpec) -> str:
    spec = job.strategy.model_specs.get("main") or {}
    outputs = spec.get("active_outputs") or job.source.active_outputs
    return ", ".join(outputs) if outputs else ""


def _batches(data: Any) -> str:
    if data.batch_size == "auto":
        return (
            "auto: an atom/edge budget found by probing the model's peak memory on the "
            "training device at run time"
        )
    budgets = [
        f"{v:,} {what}"
        for v, what in ((data.max_atoms, "atoms"), (data.max_edges, "neighbour pairs"))
        if v
    ]
    if budgets:
        return "at most " + " and ".join(budgets) + " per batch (BudgetBatchSampler)"
    return f"{data.batch_size} structures"


def _duration(job: TrainingJobSpec) -> str:
    payload = job.strategy
    if payload.num_epochs is not None:
        fixed = f"{payload.num_epochs} epochs"
    elif payload.num_steps is not None:
        fixed = f"{payload.num_steps:,} steps"
    else:
        return (
            f"fitted to {job.minutes:g} min: length and learning-rate schedule set after "
            "timing the first steps (validation included)"
        )
    return fixed if job.minutes is None else f"{fixed} (capped at {job.minutes:g} min)"


def _stages_of(hook: Any, stage: str | None) -> list[Any]:
    from nvalchemi.training.stages import TrainingStage

    if stage is not None:
        return [TrainingStage[stage]]
    runs_on = getattr(hook, "_runs_on_stage", None)
    if callable(runs_on):
        return [s for s in TrainingStage if runs_on(s)]
    value = getattr(hook, "stage", None)
    return [value] if isinstance(value, TrainingStage) else []


def _hook_table(resolved: ResolvedJob) -> Table:
    table = _table("Hook Firing Order", "#", "hook", "stages", "settings")
    entries = []
    for hook, stage in resolved.hooks:
        stages = _stages_of(hook, stage)
        order = min((s.value for s in stages), default=99)
        entries.append((order, hook, stages))
    entries.sort(key=lambda e: e[0])
    for i, (_, hook, stages) in enumerate(entries, 1):
        if not stages:
            names = "constructor default"
        elif len(stages) > 3:
            names = ", ".join(s.name for s in stages[:3]) + f" (+{len(stages) - 3})"
        else:
            names = ", ".join(s.name for s in stages)
        settings = "-"
        dump = getattr(hook, "model_dump", None)
        if callable(dump):
            with contextlib.suppress(Exception):
                settings = _kwargs(dump(exclude_defaults=True, exclude_none=True))
        table.add_row(str(i), type(hook).__name__, names, settings)
    if not entries:
        table.add_row("-", "none", "-", "spec run adds reporting (progress, metrics.jsonl)")
    return table


def _print_warnings(console: Console, job: TrainingJobSpec) -> list[Any]:
    """One line per warning: level, check, the field it is about, what, and the fix."""
    found = job_warnings(job)
    console.print("Warnings", style="italic")
    for w in found:
        line = Text(f"  {w.level:<7} ", style=_LEVEL_STYLE.get(w.level, ""))
        where = f"{w.field}: " if w.field else ""
        fix = f" Fix: {w.fix.rstrip('.')}." if w.fix else ""
        line.append(f"{w.check}: {where}{w.message}.{fix}")
        console.print(line, soft_wrap=True)
    if not found:
        console.print(Text("  ok      all checks: no warnings", style=_LEVEL_STYLE["ok"]))
    return found


def _strategy_table(job: TrainingJobSpec) -> Table:
    table = _table(strategy_class_name(job), "setting", "value")
    freeze, trainable = job.patterns
    patches = job.strategy.module_patches
    table.add_row("freeze_patterns", ", ".join(freeze) or "-")
    table.add_row("trainable_patterns", ", ".join(trainable) or "-")
    table.add_row("freeze_mode", job.strategy.freeze_mode)
    table.add_row("module_patches", ", ".join(patches) or "-")
    if job.source.model == "native-checkpoint":
        table.add_row("use_original_loss", str(job.source.use_original_loss))
        table.add_row("use_original_opt_class", str(job.source.use_original_opt_class))
        table.add_row("optimizer_lr", format_number(job.source.optimizer_lr))
    return table


def _finetune_table(job: TrainingJobSpec) -> Table | None:
    spec = job.finetune
    if spec is None:
        return None
    from nvalchemi.training.finetune_statistics import read_finetune_statistics

    table = _table("Fine-tuning", "setting", "value")
    table.add_row("reference energies (e0)", spec.e0)
    if spec.atomic_energies:
        table.add_row("fixed E0 (eV)", _kwargs(spec.atomic_energies))
    table.add_row("scale and shift", spec.scale_shift)
    if spec.head is not None:
        source = spec.source_head or "the first"
        table.add_row("new head", f"{spec.head} (a copy of {source} source head)")
    if spec.replay is not None:
        replay = spec.replay
        labels = "pseudo-labels of the source (cached)" if replay.pseudo_label else "file labels"
        share = f"{replay.ratio:.0%} of every batch" if replay.ratio else "by size"
        table.add_row("replay", f"{', '.join(replay.all_paths)}: {labels}")
        table.add_row(
            "replay share, weight", f"{share}, loss weight {format_number(replay.weight)}"
        )
        table.add_row("forgetting held out", f"{replay.holdout_fraction:.0%} of replay")
    table.add_row("zero-step check", f"{spec.parity_structures} structures before training")
    written = read_finetune_statistics(Path(job.output.run_dir))
    if written is not None:
        for element, value in written.atomic_energies.items():
            before = written.source_atomic_energies.get(element, 0.0)
            table.add_row(f"E0 {element} (written by the run)", f"{before:+.6f} -> {value:+.6f} eV")
        if written.scale_shift_mode != "keep":
            table.add_row("scale, shift (written)", f"{written.scale:.6g}, {written.shift:.6g}")
    return table


def _optimizer_table(resolved: ResolvedJob) -> Table:
    table = _table("Optimizers", "model", "optimizer", "kwargs", "scheduler", "scheduler kwargs")
    for key, configs in resolved.optimizer_configs.items():
        for config in configs:
            scheduler = config.scheduler_cls.__name__ if config.scheduler_cls else "-"
            table.add_row(
                key,
                config.optimizer_cls.__name__,
                _kwargs(config.optimizer_kwargs),
                scheduler,
                _kwargs(config.scheduler_kwargs),
            )
    if not resolved.optimizer_configs:
        table.add_row("all", "from the source checkpoint (use_original_opt_class)", "-", "-", "-")
    return table


def _batch_table(job: TrainingJobSpec) -> Table | None:
    """The chosen atom budget and the batch-size distribution it gives (reads atom counts)."""
    data = job.dataset
    probe = Path(job.output.run_dir) / "batch_budget.json"
    max_atoms = data.max_atoms
    table = _table("Batches", "setting", "value")
    if data.batch_size == "auto" and probe.is_file():
        chosen = json.loads(probe.read_text())
        max_atoms = chosen.get("max_atoms")
        table.add_row(
            "budget found by the last run",
            f"{max_atoms:,} atoms, {chosen.get('max_edges') or '-'} pairs ({probe})",
        )
    elif data.batch_size == "auto":
        table.add_row("budget", "probed at run time (written to <run_dir>/batch_budget.json)")
    if max_atoms is None:
        return table if data.batch_size == "auto" else None
    from nvalchemi.data.datapipes import BudgetBatchSampler, count_atoms
    from nvalchemi.data.sources import make_dataset

    sources = data.open_sources()
    try:
        atoms = count_atoms(make_dataset(sources.train))
    finally:
        sources.close()
    sampler = BudgetBatchSampler(atoms, max_atoms=max_atoms, seed=data.seed)
    sizes = sorted(len(b) for b in sampler.plan(0))
    loads = sorted(sum(atoms[i] for i in b) for b in sampler.plan(0))
    table.add_row(
        "atom budget",
        f"{max_atoms:,} atoms per batch"
        + (f" and {data.max_edges:,} neighbour pairs" if data.max_edges else ""),
    )
    table.add_row("batches per epoch", f"{len(sizes):,} (of {len(atoms):,} structures)")
    table.add_row("structures per batch", _spread(sizes))
    table.add_row("atoms per batch", _spread(loads) + f" (budget {max_atoms:,})")
    return table


def _spread(values: list[int]) -> str:
    n = len(values)
    return (
        f"min {values[0]:,}, median {values[n // 2]:,}, max {values[-1]:,}, "
        f"mean {sum(values) / n:.1f}"
    )


def _lr_section(console: Console, job: TrainingJobSpec, resolved: ResolvedJob) -> None:
    from nvalchemi.hooks.reporting._charts import braille_chart

    for key, configs in resolved.optimizer_configs.items():
        for i, config in enumerate(configs):
            steps, note = preview_steps(
                job.strategy.num_steps, config, budget=job.minutes is not None
            )
            preview = lr_preview(config, steps)
            preview.note = preview.note or note
            title = f"Learning-rate preview: {key}[{i}] {preview.optimizer}"
            if preview.scheduler:
                title += f" + {preview.scheduler}"
            console.print(title, style="italic")
            table = _table("", "step", "lr")
            for step, lr in preview.samples():
                table.add_row(f"{step:,}", f"{lr:.3e}")
            console.print(table)
            lrs = preview.lrs
            if lrs and max(lrs) > min(lrs):
                lines = braille_chart(lrs, width=60, height=6)
                console.print(f"  {max(lrs):.2e} ┤" + lines[0])
                for line in lines[1:-1]:
                    console.print("           │" + line)
                console.print(f"  {min(lrs):.2e} ┤" + lines[-1])
                console.print(f"           0{'step'.center(58)}{preview.num_steps:,}")
            if preview.note:
                console.print(f"  note: {preview.note}")


def render_report(job: TrainingJobSpec, resolved: ResolvedJob, console: Console) -> list[Any]:
    """Print every section to ``console``; return the warnings found."""
    console.print(Rule(f"Training report: {job.name}"))
    console.print(_intent(job, resolved))
    console.print(_hook_table(resolved))
    found = _print_warnings(console, job)
    console.print(_strategy_table(job))
    finetune = _finetune_table(job)
    if finetune is not None:
        console.print(finetune)
    console.print(_optimizer_table(resolved))
    batches = _batch_table(job)
    if batches is not None:
        console.print(batches)
    if job.notes:
        console.print(Panel(job.notes.strip(), title="Notes", title_align="left"))
    _lr_section(console, job, resolved)
    return found
