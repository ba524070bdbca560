"""``train init``, ``finetune init {checkpoint,mace,custom}`` and ``schema dump|template``.

Each init command writes a complete job spec (JSON, or YAML for a ``.yaml`` path) that
``spec report`` explains and ``spec run`` trains. Without ``--out`` the spec is printed
to stdout.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import click

from nvalchemi.training.cli._app import debug_option, main, parse_checkpoint_index
from nvalchemi.training.cli._errors import CLIError
from nvalchemi.training.cli.job_spec import TrainingJobSpec, dump_job
from nvalchemi.training.cli.recipe import QUICKSTART

__all__ = ["finetune", "schema", "train"]

DTYPE_POLICIES = ("strict", "prediction_to_target", "target_to_prediction")


def _common_options(default_lr: float):
    """Options shared by every init command."""

    def decorate(fn):
        options = [
            click.option("--dataset", "datasets", multiple=True, required=True,
                         help="Training data: extxyz / ASE db file or zarr store (repeat for "
                              "several; they become one MultiDataset)."),
            click.option("--output-dir", required=True, help="Run directory of the job."),
            click.option("--out", "out", type=click.Path(dir_okay=False),
                         help="Write the spec here (.json or .yaml); default: stdout."),
            click.option("--lr", type=float, default=default_lr, show_default=True,
                         help="Peak learning rate (AdamW)."),
            click.option("--num-steps", type=click.IntRange(min=1), default=1000,
                         show_default=True, help="Training length in optimizer steps."),
            click.option("--num-epochs", type=click.IntRange(min=1),
                         help="Training length in epochs (replaces --num-steps)."),
            click.option("--device", default="auto", show_default=True,
                         help="cpu, cuda, cuda:N, or auto (cuda when available)."),
            click.option("--trainable-pattern", "trainable_patterns", multiple=True,
                         help="Train only parameters matching this fnmatch pattern over "
                              "qualified names like 'main.readout.*' (repeatable)."),
            click.option("--freeze-pattern", "freeze_patterns", multiple=True,
                         help="Freeze parameters matching this pattern (repeatable)."),
            click.option("--loss-dtype-policy", type=click.Choice(DTYPE_POLICIES),
                         default="strict", show_default=True,
                         help="What the loss does when prediction and label dtypes differ: "
                              "raise (strict) or cast one to the other."),
            click.option("--validation-dataset", "validation_datasets", multiple=True,
                         help="Validation data file(s)."),
            click.option("--val-fraction", type=click.FloatRange(0, 1, min_open=True,
                                                                 max_open=True),
                         help="Hold out this fraction of the training data for validation "
                              "(seeded)."),
            click.option("--validation-every-epochs", type=click.IntRange(min=1)),
            click.option("--validation-every-steps", type=click.IntRange(min=1)),
            click.option("--batch-size", type=click.IntRange(min=1),
                         default=QUICKSTART.batch_size, show_default=True),
            click.option("--name", help="Job name (shown in reports)."),
            debug_option,
        ]  # fmt: skip
        for option in reversed(options):
            fn = option(fn)
        return functools.wraps(fn)(fn)

    return decorate


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _scaffold(workflow: str, model: str, options: dict[str, Any], **extra: Any) -> TrainingJobSpec:
    from nvalchemi.training.cli.scaffold import scaffold_job

    if options["validation_every_epochs"] and options["validation_every_steps"]:
        raise CLIError(
            "Use only one of --validation-every-epochs and --validation-every-steps",
            fix="drop one of the two options",
        )
    if options["validation_datasets"] and options["val_fraction"] is not None:
        raise CLIError(
            "Use only one of --validation-dataset and --val-fraction",
            fix="validate on separate files or on a held-out fraction, not both",
        )
    has_validation = bool(options["validation_datasets"]) or options["val_fraction"] is not None
    if not has_validation and (
        options["validation_every_epochs"] or options["validation_every_steps"]
    ):
        raise CLIError(
            "--validation-every-* needs validation data",
            fix="add --validation-dataset PATH or --val-fraction 0.1",
        )
    trainable = tuple(extra.pop("trainable_patterns", options["trainable_patterns"]))
    return scaffold_job(
        workflow,
        model,
        datasets=list(options["datasets"]),
        output_dir=options["output_dir"],
        lr=options["lr"],
        num_steps=options["num_steps"],
        num_epochs=options["num_epochs"],
        device=_resolve_device(options["device"]),
        dtype_policy=options["loss_dtype_policy"],
        trainable_patterns=trainable,
        freeze_patterns=tuple(options["freeze_patterns"]),
        validation_datasets=tuple(options["validation_datasets"]),
        val_fraction=options["val_fraction"],
        validation_every_epochs=options["validation_every_epochs"],
        validation_every_steps=options["validation_every_steps"],
        batch_size=options["batch_size"],
        name=options["name"],
        **extra,
    )


def _emit(job: TrainingJobSpec, out: str | None) -> None:
    if out is None:
        click.echo(dump_job(job, only_set=True), nl=False)
        return
    from nvalchemi.training.cli.job_paths import rebase_job_paths

    # Paths typed here are relative to the current directory; in the file they are
    # relative to the file's directory (as spec run reads them).
    data = job.model_dump(mode="json", exclude_none=True, exclude_unset=True)
    dump_job(rebase_job_paths(data, Path(out).parent), out)
    click.echo(f"Wrote {out}", err=True)
    click.echo(f"Created {job.workflow} {job.source.model} training spec {out}", err=True)


# ---------------------------------------------------------------------------- train
@main.group()
def train() -> None:
    """Scaffold a training-from-scratch job."""


@train.command("init")
@_common_options(default_lr=QUICKSTART.lr)
@click.option("--model", "model_kind", type=click.Choice(["painn", "custom"]), default="painn",
              show_default=True,
              help="painn: the built-in PaiNN, fitted to the data at run time; custom: fill "
                   "strategy.model_specs yourself.")  # fmt: skip
@click.option("--cutoff", type=click.FloatRange(min=0, min_open=True),
              help=f"PaiNN cutoff in Å (default {QUICKSTART.cutoff}).")  # fmt: skip
def train_init(model_kind: str, cutoff: float | None, **options: Any) -> None:
    """Scaffold a job that trains a model from scratch."""
    extra: dict[str, Any] = {}
    if model_kind == "painn":
        from nvalchemi.training.cli.scaffold import painn_model_spec

        extra["model_specs"] = {"main": painn_model_spec(cutoff)}
        extra["source"] = {"fit_to_data": True}
    elif cutoff is not None:
        raise CLIError("--cutoff applies to --model painn only", fix="drop --cutoff")
    _emit(_scaffold("train", "custom", options, **extra), options["out"])


# ---------------------------------------------------------------------------- finetune
@main.group()
def finetune() -> None:
    """Scaffold fine-tuning jobs."""


@finetune.group("init")
def finetune_init() -> None:
    """Scaffold a fine-tuning job from a checkpoint or a model file."""


@finetune_init.command("checkpoint")
@click.argument("checkpoint_dir")
@_common_options(default_lr=1e-5)
@click.option("--checkpoint-index", default="-1", show_default=True,
              help="Which checkpoint: an index, 'latest' or 'best'.")  # fmt: skip
@click.option("--use-original-loss", is_flag=True,
              help="Reuse the loss saved in the checkpoint.")  # fmt: skip
@click.option("--use-original-opt-class", is_flag=True,
              help="Reuse the saved optimizer/scheduler classes and kwargs (lr set by --lr).")  # fmt: skip
def finetune_checkpoint(
    checkpoint_dir: str,
    checkpoint_index: str,
    use_original_loss: bool,
    use_original_opt_class: bool,
    **options: Any,
) -> None:
    """Fine-tune the model(s) of an nvalchemi training checkpoint."""
    index = parse_checkpoint_index(checkpoint_index)
    job = _scaffold(
        "finetune",
        "native-checkpoint",
        options,
        source={
            "checkpoint_path": checkpoint_dir,
            "checkpoint_index": index,
            "use_original_loss": use_original_loss,
            "use_original_opt_class": use_original_opt_class,
            "optimizer_lr": options["lr"],
        },
    )
    if use_original_loss or use_original_opt_class:
        data = job.model_dump(mode="json", exclude_none=True)
        if use_original_loss:
            data["strategy"].pop("loss_fn_spec")
        if use_original_opt_class:
            data["strategy"].pop("optimizer_configs")
        job = TrainingJobSpec.model_validate(data)
    _emit(job, options["out"])


@finetune_init.command("mace")
@click.argument("model_or_checkpoint")
@_common_options(default_lr=1e-5)
def finetune_mace(model_or_checkpoint: str, **options: Any) -> None:
    """Fine-tune a mace-torch model file (default: only the readouts train)."""
    key = "checkpoint_path" if Path(model_or_checkpoint).suffix else "model_id"
    patterns = options["trainable_patterns"] or ("main.model.readouts.*",)
    job = _scaffold(
        "finetune",
        "mace",
        options,
        trainable_patterns=patterns,
        source={key: model_or_checkpoint, "compile_model": False},
    )
    _emit(job, options["out"])


@finetune_init.command("custom")
@click.argument("checkpoint_path")
@_common_options(default_lr=1e-5)
def finetune_custom(checkpoint_path: str, **options: Any) -> None:
    """Fine-tune your own model class from a weights file (fill strategy.model_specs)."""
    job = _scaffold("finetune", "custom", options, source={"checkpoint_path": checkpoint_path})
    _emit(job, options["out"])


# ---------------------------------------------------------------------------- schema
@main.group()
def schema() -> None:
    """Print the job-spec JSON schema or a template job."""


def _write_text(text: str, out: str | None) -> None:
    if out is None:
        click.echo(text, nl=False)
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    click.echo(f"Wrote {out}", err=True)


@schema.command("dump")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the schema to this file.")
@debug_option
def schema_dump(out: str | None) -> None:
    """Print the JSON schema of TrainingJobSpec."""
    _write_text(json.dumps(TrainingJobSpec.model_json_schema(), indent=2) + "\n", out)


@schema.command("template")
@click.option("--workflow", type=click.Choice(["train", "finetune"]), default="finetune",
              show_default=True)  # fmt: skip
@click.option("--model", "model", type=click.Choice(["native-checkpoint", "mace", "custom"]),
              default="native-checkpoint", show_default=True)  # fmt: skip
@click.option("--out", type=click.Path(dir_okay=False), help="Write the template to this file.")
@debug_option
def schema_template(workflow: str, model: str, out: str | None) -> None:
    """Print a complete template job to edit."""
    from nvalchemi.training.cli.scaffold import painn_model_spec, scaffold_job

    common = {"datasets": ["data/train.zarr"], "num_steps": 1000, "device": "cpu",
              "validation_datasets": ("data/valid.zarr",)}  # fmt: skip
    if workflow == "train":
        job = scaffold_job(
            "train", "custom", output_dir="runs/train", lr=1e-4,
            model_specs={"main": painn_model_spec()}, source={"fit_to_data": True}, **common,
        )  # fmt: skip
    else:
        source = {
            "native-checkpoint": {"checkpoint_path": "runs/pretrain/checkpoints"},
            "custom": {"checkpoint_path": "runs/pretrain/model.pt"},
            "mace": {"checkpoint_path": "models/mace.model", "compile_model": False},
        }[model]
        patterns = {
            "native-checkpoint": ("main.readout.*",),
            "mace": ("main.model.readouts.*",),
            "custom": (),
        }[model]
        job = scaffold_job(
            "finetune", model, output_dir="runs/finetune", lr=1e-5, source=source,
            trainable_patterns=patterns, **common,
        )  # fmt: skip
    text = dump_job(job, out, only_set=True) if out else dump_job(job, only_set=True)
    if out:
        click.echo(f"Wrote {out}", err=True)
    else:
        click.echo(text, nl=False)
