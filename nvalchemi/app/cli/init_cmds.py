"""``train init``, ``finetune init [--from SOURCE | checkpoint|mace|custom]``,
``finetune check`` and ``schema dump|template``.

Each init command writes a complete job spec (JSON, or YAML for a ``.yaml`` path; stdout
without ``--out``) that ``spec report`` explains and ``spec run`` trains.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from nvalchemi.app.cli._app import debug_option, main
from nvalchemi.app.cli._errors import CLIError
from nvalchemi.app.cli._options import (
    MINUTES,
    batch_size_value,
    option_group,
    parse_checkpoint_index,
)
from nvalchemi.app.jobs.finetune import finetune_loss, loss_terms
from nvalchemi.app.jobs.recipe import QUICKSTART
from nvalchemi.app.jobs.spec import TrainingJobSpec, dump_job

__all__ = ["finetune", "schema", "train"]

DTYPE_POLICIES = ("strict", "prediction_to_target", "target_to_prediction")


def _common_options(default_lr: float, *, required: bool = True):
    """Options shared by every init command (``required=False``: checked by the command)."""
    return option_group(
        click.option(
            "--dataset",
            "datasets",
            multiple=True,
            required=required,
            help="Training data: extxyz / ASE db file or zarr store (repeat for "
            "several; they become one MultiDataset).",
        ),
        click.option("--output-dir", required=required, help="Run directory of the job."),
        click.option(
            "--out",
            "out",
            type=click.Path(dir_okay=False),
            help="Write the spec here (.json or .yaml); default: stdout.",
        ),
        click.option(
            "--lr",
            type=float,
            default=default_lr,
            show_default=True,
            help="Peak learning rate (AdamW).",
        ),
        click.option(
            "--minutes",
            type=MINUTES,
            help="Time budget: the run's length and learning-rate schedule are "
            "fitted to it at run time (train init default: 10).",
        ),
        click.option(
            "--num-steps",
            type=click.IntRange(min=1),
            help="A fixed length in optimizer steps (fine-tunes: default 1000, 2000 with "
            "--replay).",
        ),
        click.option("--num-epochs", type=click.IntRange(min=1), help="A fixed length in epochs."),
        click.option(
            "--device",
            default="auto",
            show_default=True,
            help="cpu, cuda, cuda:N, or auto (cuda when available).",
        ),
        click.option(
            "--trainable-pattern",
            "trainable_patterns",
            multiple=True,
            help="Train only parameters matching this fnmatch pattern over "
            "qualified names like 'main.readout.*' (repeatable).",
        ),
        click.option(
            "--freeze-pattern",
            "freeze_patterns",
            multiple=True,
            help="Freeze parameters matching this pattern (repeatable).",
        ),
        click.option(
            "--loss-dtype-policy",
            "dtype_policy",
            type=click.Choice(DTYPE_POLICIES),
            default="strict",
            show_default=True,
            help="What the loss does when prediction and label dtypes differ: "
            "raise (strict) or cast one to the other.",
        ),
        click.option(
            "--validation-dataset",
            "validation_datasets",
            multiple=True,
            help="Validation data file(s).",
        ),
        click.option(
            "--val-fraction",
            type=click.FloatRange(0, 1, min_open=True, max_open=True),
            help="Hold out this fraction of the training data for validation (seeded).",
        ),
        click.option("--validation-every-epochs", type=click.IntRange(min=1)),
        click.option("--validation-every-steps", type=click.IntRange(min=1)),
        click.option(
            "--batch-size",
            default=str(QUICKSTART.batch_size),
            show_default=True,
            callback=batch_size_value,
            help="Structures per batch, or auto (an atom budget found by "
            "probing the model's memory at run time).",
        ),
        click.option(
            "--max-atoms",
            type=click.IntRange(min=1),
            help="Batches of at most this many atoms instead of a fixed count.",
        ),
        click.option(
            "--max-edges",
            type=click.IntRange(min=1),
            help="Batches of at most this many neighbour pairs.",
        ),
        click.option(
            "--in-memory/--no-in-memory",
            default=None,
            help="Load the data into memory once (default: when the files are under 1 GB).",
        ),
        click.option("--name", help="Job name (shown in reports)."),
        debug_option,
    )


def _scaffold(workflow: str, model: str, options: dict[str, Any], **extra: Any) -> TrainingJobSpec:
    from nvalchemi.app.devices import resolve_device
    from nvalchemi.app.jobs.scaffold import scaffold_job

    lengths = [k for k in ("minutes", "num_steps", "num_epochs") if options[k] is not None]
    if len(lengths) > 1:
        raise CLIError(
            f"give one length: {' and '.join('--' + k.replace('_', '-') for k in lengths)} "
            "contradict each other",
            fix="a budget (--minutes) or a fixed length (--num-steps / --num-epochs)",
        )
    if options["batch_size"] == "auto" and (options["max_atoms"] or options["max_edges"]):
        raise CLIError(
            "--batch-size auto finds --max-atoms / --max-edges itself", fix="give one or the other"
        )

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
    # The click names of the common options are scaffold_job's parameters.
    kwargs = {k: v for k, v in options.items() if k != "out"}
    kwargs["device"] = resolve_device(options["device"])
    kwargs.update(extra)
    return TrainingJobSpec.model_validate(scaffold_job(workflow, model, **kwargs))


def _describe(job: TrainingJobSpec) -> str:
    """``"trains PaiNN (built-in, nvalchemi.models.painn) on ..."`` for the init messages."""
    spec = job.strategy.model_specs.get("main") or {}
    path = spec.get("cls_path")
    members = spec.get("members") or []
    if members and isinstance(members[0], dict):  # a committee: describe its members
        committee = f"a committee of {spec.get('size') or len(members)} "
        spec, path = members[0], members[0].get("cls_path")
    else:
        committee = ""
    if job.workflow == "finetune":
        what = f"fine-tunes a {job.source.model} model ({job.source.checkpoint_path or job.source.model_id})"
    elif path:
        module, name = str(path).rsplit(".", 1)
        where = "built-in, " if module.startswith("nvalchemi.") else ""
        what = f"trains {committee}{name} ({where}{module}) from scratch"
    else:
        what = "trains your model (fill strategy.model_specs.main)"
    length = (
        f"fitted to {job.minutes:g} min"
        if job.minutes is not None
        and job.strategy.num_steps is None
        and job.strategy.num_epochs is None
        else _fixed_length(job)
    )
    stress = " with stress" if "stress" in loss_terms(job.strategy.loss_fn_spec) else ""
    return f"{what}{stress}, {length}"


def _fixed_length(job: TrainingJobSpec) -> str:
    if job.strategy.num_epochs is not None:
        return f"{job.strategy.num_epochs} epochs"
    return f"{job.strategy.num_steps:,} steps"


def _emit(job: TrainingJobSpec, out: str | None) -> None:
    if out is None:
        click.echo(dump_job(job, only_set=True), nl=False)
        click.echo(f"A job that {_describe(job)}", err=True)
        return
    from nvalchemi.app.jobs.paths import rebase_job_paths

    # Paths typed here are relative to the current directory; in the file they are
    # relative to the file's directory (as spec run reads them).
    data = job.model_dump(mode="json", exclude_none=True, exclude_unset=True)
    dump_job(rebase_job_paths(data, Path(out).parent), out)
    click.echo(f"Wrote {out}", err=True)
    click.echo(f"Created {out}: a job that {_describe(job)}", err=True)


# ---------------------------------------------------------------------------- train
@main.group()
def train() -> None:
    """Scaffold a training-from-scratch job."""


@train.command(
    "init",
    epilog="""\b
Examples:
  nvalchemi-training train init --dataset a.extxyz --validation-dataset b.extxyz \\
      --minutes 30 --stress --output-dir runs/my --out job.yaml
  nvalchemi-training train init --dataset data/train.extxyz --val-fraction 0.1 --output-dir runs/my
""",
)
@_common_options(default_lr=QUICKSTART.lr)
@click.option(
    "--model",
    "model_kind",
    type=click.Choice(["painn", "custom"]),
    default="painn",
    show_default=True,
    help="painn: the built-in PaiNN, fitted to the data at run time; custom: fill "
    "strategy.model_specs yourself.",
)
@click.option(
    "--cutoff",
    type=click.FloatRange(min=0, min_open=True),
    help=f"PaiNN cutoff in Å (default {QUICKSTART.cutoff}).",
)
@click.option(
    "--stress/--no-stress",
    default=None,
    help="Train on stress too: the stress loss (weight "
    f"{QUICKSTART.stress_weight:g}) and the model's stress output. Default: "
    "when the training data has stress labels.",
)
@click.option(
    "--committee",
    type=click.IntRange(min=2),
    help="Train a committee of N models (differing by seed) in one run: the prediction "
    "is their mean, their spread the uncertainty (energy_std, forces_std, "
    "max_force_deviation, stress_std).",
)
@click.option(
    "--bootstrap/--no-bootstrap",
    default=False,
    show_default=True,
    help="With --committee: each member also weights the training structures by its own "
    "bootstrap (Poisson) counts.",
)
def train_init(
    model_kind: str,
    cutoff: float | None,
    stress: bool | None,
    committee: int | None,
    bootstrap: bool,
    **options: Any,
) -> None:
    """Scaffold a job that trains a model from scratch: the quickstart recipe on your data."""
    if model_kind == "custom" and cutoff is not None:
        raise CLIError("--cutoff applies to --model painn only", fix="drop --cutoff")
    if model_kind == "custom" and committee:
        raise CLIError(
            "--committee builds a committee of the built-in PaiNN",
            fix="use --model painn, or put nvalchemi.app.committee.committee_model_spec(<your "
            "model spec>, N) under strategy.model_specs.main and committee_loss(...) as the loss",
        )
    if bootstrap and not committee:
        raise CLIError("--bootstrap needs --committee N", fix="add --committee 4")
    counts = _data_labels(options["datasets"])
    if stress is None:
        stress = bool(counts and counts["stress"])
        if stress:
            click.echo(
                f"stress labels found in {counts['stress']:,} of the first {counts['scanned']:,} "
                f"training structures: adding the stress loss (weight {QUICKSTART.stress_weight:g})"
                " and the model's stress output (--no-stress to leave them out)",
                err=True,
            )
    extra: dict[str, Any] = {"stress": stress, "structures": counts and counts["structures"]}
    if model_kind == "painn":
        from nvalchemi.app.jobs.scaffold import painn_model_spec

        member = painn_model_spec(cutoff, stress=stress)
        if committee:
            from nvalchemi.app.committee import committee_model_spec

            member = committee_model_spec(member, committee, bootstrap=bootstrap)
            extra["committee"] = committee
        extra["model_specs"] = {"main": member}
        extra["source"] = {"fit_to_data": True}
        if not any(options[k] for k in ("minutes", "num_steps", "num_epochs")):
            options["minutes"] = DEFAULT_MINUTES
    _emit(_scaffold("train", "custom", options, **extra), options["out"])


DEFAULT_MINUTES = 10.0
"""The time budget ``train init`` writes when no length is given."""


def _data_labels(paths: tuple[str, ...]) -> dict[str, int] | None:
    """Label counts of the training files (``None`` when they cannot be read now)."""
    from nvalchemi.data.inspect import label_counts
    from nvalchemi.data.sources import open_reader

    try:
        readers = [open_reader(p, field="--dataset") for p in paths]
    except ValueError:
        return None  # spec report names a missing file; the job can be written first
    try:
        return label_counts(readers)
    finally:
        for reader in readers:
            reader.close()


# ---------------------------------------------------------------------------- finetune
E0_MODES = ("keep", "refit", "estimated", "fixed")

REPLAY_RATIO = 0.5
"""``--replay`` without ``--replay-ratio``: half of every batch is replay, as many replay
structures as the ``--batch-size`` new ones (docs/finetuning.md: of the shares measured it
kept a converged source's old type best; smaller shares lost a third to twice the old
type's accuracy there, and taking the replay out of the new data's batch cost the new
type)."""

REPLAY_NUM_STEPS = 2000
"""``--replay`` without a length (``--num-steps``/``--num-epochs``/``--minutes``): this many
steps (docs/finetuning.md: at 1,000 every replay share lost more of the old type or of
the new one than at 2,000)."""

BY_SIZE = "size"
"""``--replay-ratio size``: no fixed share (the job's ``replay.ratio`` stays unset)."""


def _replay_ratio(ctx: Any, param: Any, value: str | None) -> float | str | None:
    """``--replay-ratio``: a share in (0, 1), or ``size``."""
    if value is None or value == BY_SIZE:
        return value
    try:
        ratio = float(value)
    except ValueError:
        ratio = math.nan
    if not 0 < ratio < 1:
        raise click.BadParameter(
            f"{value!r} is neither a share between 0 and 1 (exclusive) nor 'size'",
            param_hint="--replay-ratio",
        )
    return ratio


_finetune_options = option_group(
    click.option(
        "--e0",
        "e0",
        type=click.Choice(E0_MODES),
        default="keep",
        show_default=True,
        help="Reference energies of the trained head: keep the source's (new "
        "elements fitted), refit on the new data, estimated (source + "
        "fitted offset of the new labels), fixed (--e0-value).",
    ),
    click.option(
        "--e0-value",
        "e0_values",
        multiple=True,
        metavar="EL=EV",
        help="E0 of one element for --e0 fixed, e.g. Cu=-3.71 (repeatable).",
    ),
    click.option(
        "--scale-shift",
        type=click.Choice(["keep", "refit"]),
        default="keep",
        show_default=True,
        help="Keep or re-estimate scale and shift.",
    ),
    click.option(
        "--head",
        help="Add a readout head of this name (a copy of the source "
        "head) and train it on the new data.",
    ),
    click.option("--source-head", help="The source head to copy and to label replay with."),
    click.option(
        "--trunk-lr-scale",
        type=click.FloatRange(min=0),
        help="Learning rate of everything but the trained head, relative to "
        "--lr (0 freezes it; for MACE the head is every readout).",
    ),
    click.option(
        "--replay",
        "replay",
        multiple=True,
        help="Replay structures mixed in against forgetting (repeatable); a checkpoint "
        "fine-tune then defaults to the source's peak lr.",
    ),
    click.option(
        "--replay-ratio",
        metavar="RATIO|size",
        callback=_replay_ratio,
        help=f"Share of every batch drawn from replay (default {REPLAY_RATIO}), on top of "
        "the --batch-size new structures; or 'size' (batches of the shuffled new and replay "
        "data together).",
    ),
    click.option(
        "--replay-weight",
        type=click.FloatRange(min=0),
        default=1.0,
        show_default=True,
        help="Loss weight of replay structures.",
    ),
    click.option(
        "--pseudo-label/--replay-labels",
        default=None,
        help="Label replay with the source model (cached once), or train on the labels "
        "in the replay files. Default: the files' labels when every structure has "
        "energy and forces, else the source's.",
    ),
    click.option(
        "--holdout-fraction",
        type=click.FloatRange(0, 1, min_open=True, max_open=True),
        default=0.1,
        show_default=True,
        help="Replay held out to measure forgetting.",
    ),
    click.option(
        "--stress/--no-stress",
        default=None,
        help="Train on stress: the stress loss and the model's stress output. Default: "
        "when the training data has stress labels (a checkpoint's own loss terms and "
        "weights are kept otherwise).",
    ),
)
"""What a fine-tune keeps of its source: the job's ``finetune`` block, and its loss."""


_FINETUNE_OPTIONS = (
    "e0",
    "e0_values",
    "scale_shift",
    "head",
    "source_head",
    "trunk_lr_scale",
    "replay",
    "replay_ratio",
    "replay_weight",
    "pseudo_label",
    "holdout_fraction",
)


def _finetune_block(options: dict[str, Any]) -> dict[str, Any] | None:
    """The job's ``finetune`` block from the options (``None`` when all are defaults)."""
    values = {k: options.pop(k) for k in _FINETUNE_OPTIONS}
    block: dict[str, Any] = {}
    if values["e0"] != "keep":
        block["e0"] = values["e0"]
    if values["e0_values"]:
        if values["e0"] != "fixed":
            raise CLIError("--e0-value needs --e0 fixed", fix="add --e0 fixed")
        block["atomic_energies"] = _e0_values(values["e0_values"])
    elif values["e0"] == "fixed":
        raise CLIError("--e0 fixed needs the values", fix="add --e0-value Cu=-3.71 per element")
    if values["scale_shift"] != "keep":
        block["scale_shift"] = values["scale_shift"]
    if values["head"] and "." in values["head"]:
        raise CLIError(
            f"--head {values['head']!r}: head names have no dots (a dot separates a model key "
            "from its head, as in 'main.ft')",
            fix="name the new head without dots, e.g. --head ft",
        )
    for key in ("head", "source_head"):
        if values[key]:
            block[key] = values[key]
    if values["replay"]:
        block["replay"] = _replay_block(values, options)
    elif values["replay_ratio"] is not None or values["replay_weight"] != 1.0:
        raise CLIError("--replay-ratio/--replay-weight need replay data", fix="add --replay PATH")
    options["_trunk_lr_scale"] = values["trunk_lr_scale"]
    return block or None


def _replay_block(values: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The ``finetune.replay`` block; with a share and a fixed ``--batch-size``, the
    replay comes on top of the new data's batch (``options["batch_size"]`` grows, see
    :func:`_batch_with_replay`)."""
    if values["pseudo_label"] is False:
        _check_replay_labels(values["replay"])
    replay: dict[str, Any] = {"paths": list(values["replay"])}
    ratio = REPLAY_RATIO if values["replay_ratio"] is None else values["replay_ratio"]
    if values["replay_ratio"] is None:
        click.echo(
            f"--replay: {ratio:.0%} of every batch is replay (measured in "
            "docs/finetuning.md; --replay-ratio to choose, 'size' to mix by size)",
            err=True,
        )
    if ratio != BY_SIZE:
        new = options["batch_size"]
        if isinstance(new, int) and not (options["max_atoms"] or options["max_edges"]):
            options["batch_size"], ratio = _batch_with_replay(new, ratio)
        replay["ratio"] = ratio
    if values["replay_weight"] != 1.0:
        replay["weight"] = values["replay_weight"]
    if not _pseudo_label(values["replay"], values["pseudo_label"]):
        replay["pseudo_label"] = False
    if values["holdout_fraction"] != 0.1:
        replay["holdout_fraction"] = values["holdout_fraction"]
    return replay


def _batch_with_replay(new: int, ratio: float) -> tuple[int, float]:
    """``(batch size, exact replay share)`` of ``new`` structures plus the replay at ``ratio``.

    The new data keeps its batch, as without replay (docs/finetuning.md: replay taking
    part of the batch instead cost the new type); the share is exact, so the run draws
    the counts printed here. Atom or edge budgets and ``auto`` are not grown: their
    batches give the replay its share.
    """
    replayed = max(1, round(new * ratio / (1.0 - ratio)))
    click.echo(
        f"--replay: batches of {new + replayed} structures, {new} new (--batch-size) and "
        f"{replayed} replay",
        err=True,
    )
    return new + replayed, replayed / (new + replayed)


def _pseudo_label(paths: tuple[str, ...], chosen: bool | None) -> bool:
    """Whether the source labels the replay: as chosen, else unless the files are labelled.

    The files' own labels kept the old type better than the source's predictions of them
    on both sources measured (docs/finetuning.md). The files count as labelled when every
    structure read (the first 500 of each) has energy and forces; unreadable files (checked
    at run time) are labelled by the source.
    """
    if chosen is not None:
        return chosen
    counts = _data_labels(paths)
    labelled = bool(
        counts and counts["scanned"] and counts["energy"] == counts["forces"] == counts["scanned"]
    )
    if labelled:
        why = "--pseudo-label to label it with the source model instead"
    elif counts is None:
        why = "the files cannot be read now; --replay-labels to train on their labels"
    else:
        why = "the files lack energy or force labels on some structures"
    what = "trained on the files' own labels" if labelled else "labelled by the source model"
    click.echo(f"--replay: {what} ({why})", err=True)
    return not labelled


def _check_replay_labels(paths: tuple[str, ...]) -> None:
    """``--replay-labels`` trains on the replay's own labels: a file without any is refused."""
    for path in paths:
        counts = _data_labels((path,))
        if counts is None:
            continue  # not readable yet: spec run checks it
        missing = [
            label for label in ("energy", "forces") if counts["scanned"] and not counts[label]
        ]
        if missing:
            raise CLIError(
                f"--replay {path}: none of its first {counts['scanned']:,} structures has "
                f"{' or '.join(missing)} labels, and --replay-labels trains on the replay's "
                "own labels",
                fix="drop --replay-labels (the source model labels the replay), or give "
                "labelled replay files",
            )


def _e0_values(items: tuple[str, ...]) -> dict[str, float]:
    from nvalchemi.models.statistics import atomic_number

    out = {}
    for item in items:
        element, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            energy = float(value)
        except ValueError:
            raise CLIError(
                f"--e0-value {item!r} is not ELEMENT=EV", fix="write e.g. --e0-value Cu=-3.71"
            ) from None
        if not math.isfinite(energy):
            raise CLIError(
                f"--e0-value {item!r}: a reference energy must be a finite number of eV",
                fix="write e.g. --e0-value Cu=-3.71",
            )
        try:
            atomic_number(element.strip())
        except ValueError:
            raise CLIError(
                f"--e0-value {item!r}: {element.strip()!r} is not a chemical symbol",
                fix="write e.g. --e0-value Cu=-3.71",
            ) from None
        out[element.strip()] = energy
    return out


def _finetune_loss(
    model: str, source: dict[str, Any], stress: bool | None, options: dict[str, Any]
) -> Any:
    """The fine-tune's loss (the source's terms, stress as the data says); printed."""
    given = click.get_current_context().get_parameter_source("dtype_policy")
    policy = None if given in (None, ParameterSource.DEFAULT) else options["dtype_policy"]
    counts = _data_labels(options["datasets"])
    plan = finetune_loss(model, source, stress=stress, counts=counts, dtype_policy=policy)
    for note in plan.notes:
        click.echo(note, err=True)
    return plan


def _default(name: str) -> bool:
    """Whether option ``name`` of the current command was left at its default."""
    given = click.get_current_context().get_parameter_source(name)
    return given in (None, ParameterSource.DEFAULT)


def _replay_lr(source: dict[str, Any], lr: float) -> float:
    """The source checkpoint's peak lr (printed), else ``lr``.

    docs/finetuning.md: with replay the source's own peak lr kept the old type and learnt
    the new one; a tenth of it lost a third of the old type's force accuracy, 1e-5 learnt
    nothing.
    """
    from nvalchemi.app.jobs.finetune import read_source_recipe

    try:
        recipe = read_source_recipe(source["checkpoint_path"], source.get("checkpoint_index", -1))
    except (OSError, ValueError):
        return lr  # spec report names an unreadable checkpoint
    if recipe.lr is None:
        return lr
    chosen = float(f"{recipe.lr:.6g}")
    click.echo(
        f"--replay: lr {chosen:.3g}, the source's peak lr (measured in docs/finetuning.md; "
        "--lr to choose)",
        err=True,
    )
    return chosen


def _finetune_job(model: str, options: dict[str, Any], source: dict[str, Any]) -> TrainingJobSpec:
    """A fine-tuning job: the common scaffold plus the ``finetune`` block, head lr and loss."""
    stress = options.pop("stress")
    if model == "mace" and not options["trainable_patterns"]:
        options["trainable_patterns"] = ("main.model.readouts.*",)  # the readouts train
    if options["replay"] and not any(
        options[k] is not None for k in ("minutes", "num_steps", "num_epochs")
    ):
        options["num_steps"] = REPLAY_NUM_STEPS
        click.echo(
            f"--replay: {REPLAY_NUM_STEPS:,} steps (measured in docs/finetuning.md; "
            "--num-steps to choose)",
            err=True,
        )
    if model == "native-checkpoint":
        if options["replay"] and _default("lr"):
            options["lr"] = _replay_lr(source, options["lr"])
        source["optimizer_lr"] = options["lr"]
    block = _finetune_block(options)
    loss = _finetune_loss(model, source, stress, options)
    if loss.active_outputs is not None:
        source["active_outputs"] = loss.active_outputs
    extra: dict[str, Any] = {"source": source, "stress": loss.stress}
    trunk = options.pop("_trunk_lr_scale")
    head = (block or {}).get("head")
    if trunk is not None:
        extra["trunk_lr"] = (trunk, head)
    if block is not None:
        extra["finetune"] = block
    job = _scaffold("finetune", model, options, **extra)
    if loss.loss_fn_spec is None:
        return job
    data = job.model_dump(mode="json", exclude_none=True, exclude_unset=True)
    data["strategy"]["loss_fn_spec"] = loss.loss_fn_spec
    return TrainingJobSpec.model_validate(data)


def _source_kind(source: str) -> tuple[str, dict[str, Any]]:
    """``(source.model, source keys)`` told from the path given to ``--from``."""
    path = Path(source)
    if path.is_dir():
        if not (path / "manifest.json").is_file():
            raise CLIError(
                f"{path} is a directory but not an nvalchemi checkpoint (no manifest.json)",
                field="--from",
                fix="give a checkpoint directory, a MACE .model file or a weights file",
            )
        return "native-checkpoint", {"checkpoint_path": source}
    if path.suffix == ".model":
        return "mace", {"checkpoint_path": source, "compile_model": False}
    if not path.is_file():
        raise CLIError(f"{path} does not exist", field="--from")
    return "custom", {"checkpoint_path": source}


@main.group()
def finetune() -> None:
    """Scaffold and check fine-tuning jobs."""


@finetune.group(
    "init",
    invoke_without_command=True,
    epilog="""\b
Examples:
  nvalchemi-training finetune init --from runs/pre/checkpoints --dataset new.extxyz \\
      --val-fraction 0.1 --trainable-pattern 'main.readout.*' --output-dir runs/ft --out ft.yaml
  nvalchemi-training finetune init mace small.model --dataset new.extxyz --output-dir runs/ft
""",
)
@click.option(
    "--from",
    "source",
    metavar="SOURCE",
    help="Checkpoint directory, MACE .model file or weights file to fine-tune.",
)
@_common_options(default_lr=1e-5, required=False)
@_finetune_options
@click.pass_context
def finetune_init(ctx: click.Context, source: str | None, **options: Any) -> None:
    """Scaffold a fine-tuning job (--from SOURCE, or a subcommand naming the source kind)."""
    if ctx.invoked_subcommand is not None:
        return
    if source is None:
        click.echo(ctx.get_help())
        return
    missing = [f"--{k.replace('_', '-')}" for k in ("datasets", "output_dir") if not options[k]]
    if missing:
        raise CLIError(f"missing {' and '.join(missing)}", fix="give the new data and a run dir")
    model, keys = _source_kind(source)
    _emit(_finetune_job(model, options, keys), options["out"])


@finetune.command(
    "check",
    epilog="""\b
Examples:
  nvalchemi-training finetune check ft.yaml
  nvalchemi-training finetune check ft.yaml --map-location cuda --trust
""",
)
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--map-location", help="Device to build and run the models on (default: cpu).")
@click.option("--trust", is_flag=True, help="Trust the job file (pickled MACE models).")
@debug_option
def finetune_check_cmd(path: str, map_location: str | None, trust: bool) -> None:
    """Compare the job's fine-tune-ready model with its source (zero-step parity)."""
    from nvalchemi.app.cli._console import err_console
    from nvalchemi.app.jobs.finetune import finetune_check, parity_note
    from nvalchemi.app.jobs.resolve import load_job

    job, _ = load_job(path, trust=trust)
    run = finetune_check(job, trust=trust, map_location=map_location or "cpu")
    console = err_console()
    stats = run.statistics
    console.print(f"reference energies ({stats.e0_mode}), eV:")
    for element, value in stats.atomic_energies.items():
        before = stats.source_atomic_energies.get(element, 0.0)
        console.print(f"  {element:<3} {before:+.6f} -> {value:+.6f}")
    if stats.residual_rmse_per_atom is not None:
        console.print(
            f"source model on the new data: {1000 * stats.residual_rmse_per_atom:.2f} meV/atom "
            "energy RMSE (before the new E0)"
        )
    click.echo(run.parity.format())
    note = parity_note(stats)
    if note:
        console.print(note)
    click.echo(json.dumps(run.parity.to_dict()))


@finetune_init.command(
    "checkpoint",
    epilog="""\b
Examples:
  nvalchemi-training finetune init checkpoint runs/pre/checkpoints --dataset new.extxyz \\
      --use-original-loss --lr 1e-4 --num-steps 500 --output-dir runs/ft --out ft.yaml
""",
)
@click.argument("checkpoint_dir")
@_common_options(default_lr=1e-5)
@_finetune_options
@click.option(
    "--checkpoint-index",
    default="-1",
    show_default=True,
    help="Which checkpoint: an index, 'latest' or 'best'.",
)
@click.option("--use-original-loss", is_flag=True, help="Reuse the loss saved in the checkpoint.")
@click.option(
    "--use-original-opt-class",
    is_flag=True,
    help="Reuse the saved optimizer/scheduler classes and kwargs (lr set by --lr).",
)
def finetune_checkpoint(
    checkpoint_dir: str,
    checkpoint_index: str,
    use_original_loss: bool,
    use_original_opt_class: bool,
    **options: Any,
) -> None:
    """Fine-tune the model(s) of an nvalchemi training checkpoint."""
    index = parse_checkpoint_index(checkpoint_index)
    job = _finetune_job(
        "native-checkpoint",
        options,
        {
            "checkpoint_path": checkpoint_dir,
            "checkpoint_index": index,
            "use_original_loss": use_original_loss,
            "use_original_opt_class": use_original_opt_class,
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


@finetune_init.command(
    "mace",
    epilog="""\b
Examples:
  nvalchemi-training finetune init mace models/small.model --dataset new.extxyz \\
      --output-dir runs/ft --out ft.yaml
""",
)
@click.argument("model_or_checkpoint")
@_common_options(default_lr=1e-5)
@_finetune_options
def finetune_mace(model_or_checkpoint: str, **options: Any) -> None:
    """Fine-tune a mace-torch model file (default: only the readouts train)."""
    key = "checkpoint_path" if Path(model_or_checkpoint).suffix else "model_id"
    job = _finetune_job("mace", options, {key: model_or_checkpoint, "compile_model": False})
    _emit(job, options["out"])


@finetune_init.command(
    "custom",
    epilog="""\b
Examples:
  nvalchemi-training finetune init custom weights.pt --dataset new.extxyz \\
      --output-dir runs/ft --out ft.yaml     # then fill strategy.model_specs.main
""",
)
@click.argument("checkpoint_path")
@_common_options(default_lr=1e-5)
@_finetune_options
def finetune_custom(checkpoint_path: str, **options: Any) -> None:
    """Fine-tune your own model class from a weights file (fill strategy.model_specs)."""
    job = _finetune_job("custom", options, {"checkpoint_path": checkpoint_path})
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


@schema.command(
    "dump",
    epilog="""\b
Examples:
  nvalchemi-training schema dump --out job.schema.json
  nvalchemi-training schema dump | jq '.dataset.properties | keys'
""",
)
@click.option("--out", type=click.Path(dir_okay=False), help="Write the schema to this file.")
@debug_option
def schema_dump(out: str | None) -> None:
    """Print the JSON schema of every section of a job file (one top-level entry each)."""
    from nvalchemi.app.jobs.spec import section_schemas

    _write_text(json.dumps(section_schemas(), indent=2) + "\n", out)


@schema.command(
    "template",
    epilog="""\b
Examples:
  nvalchemi-training schema template --out job.yaml
  nvalchemi-training schema template --workflow finetune --model mace --out ft.yaml
""",
)
@click.option(
    "--workflow", type=click.Choice(["train", "finetune"]), default="train", show_default=True
)
@click.option(
    "--model",
    "model",
    type=click.Choice(["native-checkpoint", "mace", "custom"]),
    default="native-checkpoint",
    show_default=True,
    help="The source of a fine-tune (--workflow finetune).",
)
@click.option("--out", type=click.Path(dir_okay=False), help="Write the template to this file.")
@debug_option
def schema_template(workflow: str, model: str, out: str | None) -> None:
    """Print a complete template job to edit (TrainingJobSpec.template())."""
    text = dump_job(TrainingJobSpec.template(workflow, model), out)
    if out:
        click.echo(f"Wrote {out}", err=True)
    else:
        click.echo(text, nl=False)
