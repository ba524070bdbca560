"""``bench``: training speed of a job or a built-in model on this machine, and precision candidates."""

from __future__ import annotations

import json
from typing import Any

import click

from nvalchemi.app.cli._app import debug_option, main
from nvalchemi.app.cli._console import err_console, print_table
from nvalchemi.app.cli._options import (
    json_option,
    max_structures_option,
    threads_option,
    trust_options,
)

__all__ = ["bench"]


def _named_model(
    model: str, datasets: tuple[str, ...], batch_size: int, device: str, structures: int
) -> tuple[Any, Any]:
    """``(make_strategy, loader)`` for a built-in model on ``datasets`` (default: bundled)."""
    import copy

    import torch

    from nvalchemi.app.jobs.recipe import QUICKSTART
    from nvalchemi.data.bundled import bundled_split_path
    from nvalchemi.data.datapipes.dataloader import DataLoader
    from nvalchemi.data.sources import make_dataset, open_reader
    from nvalchemi.models import DemoModel, DemoModelWrapper, PaiNN
    from nvalchemi.training.strategy import TrainingStrategy

    paths = datasets or (str(bundled_split_path("train")),)
    readers = [open_reader(p, field="--dataset", max_structures=structures) for p in paths]
    torch.manual_seed(0)
    if model == "painn":
        config = PaiNN(**QUICKSTART.model_kwargs()).model_config.neighbor_config
        data = make_dataset(readers, neighbor_config=config, in_memory=True)
        template = PaiNN.from_data(DataLoader(data, batch_size=64), **QUICKSTART.model_kwargs())
    else:
        data = make_dataset(readers, in_memory=True)
        template = DemoModelWrapper(DemoModel())
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, seed=0)

    def make(hooks: list[Any]) -> Any:
        return TrainingStrategy(
            models=copy.deepcopy(template),
            devices=[device],
            num_steps=10**9,
            hooks=hooks,
            optimizer_configs=QUICKSTART.optimizer_config(None),
            loss_fn=QUICKSTART.loss_fn(),
        )

    return make, loader


def _job(
    path: str, device: str | None, trust: bool, allow_imports: tuple[str, ...]
) -> tuple[Any, Any]:
    """``(make_strategy, loader)`` for a job file (its checkpoint hooks left out)."""
    from nvalchemi.app.jobs.build import build_strategy
    from nvalchemi.app.jobs.resolve import build_hooks, load_job
    from nvalchemi.app.jobs.run import seed_everything
    from nvalchemi.data.sources import make_dataset, make_loader, neighbor_config_of
    from nvalchemi.training.hooks.checkpoint import CheckpointHook

    job, _ = load_job(path, trust=trust, allow_imports=allow_imports)
    sources = job.dataset.open_sources()

    def make(hooks: list[Any]) -> Any:
        seed_everything(job.dataset.seed)  # the same initial weights every time
        own = [
            h for h, _ in build_hooks(job.source.hooks, trust) if not isinstance(h, CheckpointHook)
        ]
        return build_strategy(
            job, sources=sources, hooks=[*own, *hooks], trust=trust, map_location=device
        )

    strategy = make([])
    data = make_dataset(
        sources.train,
        neighbor_config=neighbor_config_of(strategy.models),
        in_memory=job.dataset.in_memory,
    )
    batch_size = job.dataset.batch_size if isinstance(job.dataset.batch_size, int) else 8
    return make, make_loader(data, batch_size=batch_size, shuffle=True, seed=job.dataset.seed)


@main.command(
    "bench",
    epilog="""\b
Examples:
  nvalchemi-training bench --model painn --steps 50 --json
  nvalchemi-training bench job.yaml --device cuda --precision bf16 --precision fp16
""",
)
@click.argument("job", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--model",
    type=click.Choice(["painn", "demo"]),
    default="painn",
    show_default=True,
    help="A built-in model to measure (when no JOB is given).",
)
@click.option(
    "--dataset",
    "datasets",
    multiple=True,
    help="Data for --model (default: the bundled EMT training split).",
)
@max_structures_option("Structures read for --model [512].")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Structures per batch for --model (a JOB uses its own).",
)
@click.option("--steps", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True)
@click.option("--device", help="cpu, cuda, cuda:N (default: a JOB's device, else auto).")
@click.option(
    "--precision",
    "precisions",
    multiple=True,
    type=click.Choice(["bf16", "fp16"]),
    help="A mixed-precision candidate, compared with float32 eager (repeatable).",
)
@click.option(
    "--compile",
    "compile_",
    is_flag=True,
    help="A compiled candidate: TrainingStrategy(compile=True); its warm-up compiles.",
)
@threads_option()
@json_option()
@trust_options
@debug_option
def bench(
    job: str | None,
    model: str,
    datasets: tuple[str, ...],
    max_structures: int | None,
    batch_size: int,
    steps: int,
    warmup: int,
    device: str | None,
    precisions: tuple[str, ...],
    compile_: bool,
    threads: int,
    as_json: bool,
    trust: bool,
    allow_imports: tuple[str, ...],
) -> None:
    """Measure training on this machine: structures/s, steps/s, peak memory, the loader's
    share of the step, and the loss / gradient-norm error of precision and compile candidates."""
    import torch

    from nvalchemi.app.bench import STARVED_SHARE, benchmark, candidate_note
    from nvalchemi.app.devices import check_device, resolve_device

    torch.set_num_threads(threads)
    if device is not None:
        check_device(device, field="--device", fix="use --device cpu (or a GPU present here)")
    if job is not None:
        make, loader = _job(job, device, trust, allow_imports)
        name = job
    else:
        make, loader = _named_model(
            model, datasets, batch_size, resolve_device(device or "auto"), max_structures or 512
        )
        name = f"{model} (batch {batch_size})"
    candidates = [*precisions, *(["compile"] if compile_ else [])]
    result = benchmark(make, loader, steps=steps, warmup=warmup, candidates=candidates, name=name)
    console = err_console()
    rows = [
        ("device", result.device),
        ("timed steps", f"{result.steps} (after {result.warmup_steps})"),
        ("structures/s", f"{result.structures_per_s:,.1f}"),
        ("steps/s", f"{result.steps_per_s:,.2f}"),
        ("atoms/s", f"{result.atoms_per_s:,.0f}"),
        ("median step (ms)", f"{result.step_ms_median:.1f}"),
        ("loader share of the step", f"{100 * result.loader_share:.1f}%"),
        (f"peak memory (MiB, {result.memory_kind})", f"{result.peak_memory_mib:,.0f}"),
    ]
    print_table(console, f"Benchmark: {name}", ["", "value"], rows)
    if result.starved:
        console.print(
            f"warning: the data loader takes {100 * result.loader_share:.0f}% of each step "
            f"(> {100 * STARVED_SHARE:.0f}%): the model waits for data; use loader workers, "
            "in_memory data or neighbour lists stored with `data convert --cutoff`"
        )
    if result.candidates:
        print_table(
            console,
            "Candidates against float32 eager (same batches, same start)",
            [
                "candidate",
                "steps/s",
                "speedup",
                "loss rel. err. max",
                "mean",
                "grad-norm rel. err. max",
                "mean",
            ],
            [
                (
                    c.name,
                    f"{c.steps_per_s:.2f}",
                    f"{c.speedup:.2f}x",
                    f"{c.loss_rel_error_max:.2e}",
                    f"{c.loss_rel_error_mean:.2e}",
                    f"{c.grad_norm_rel_error_max:.2e}",
                    f"{c.grad_norm_rel_error_mean:.2e}",
                )
                for c in result.candidates
            ],
        )
    for candidate in result.candidates:
        note = candidate_note(candidate, result.steps, result.device)
        if note:
            console.print(f"note: {note}")
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
