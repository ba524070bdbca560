"""A job's ``finetune`` block at run time: statistics, the zero-step check, replay, forgetting.

:func:`prepare_finetune_run` (``spec run``, between building the strategy and training)
keeps a copy of the source model, fits the trained head's reference energies (and
scale/shift) on rank 0 (``finetune_statistics.json``), compares the fine-tune-ready model
with the source on a few structures (``finetune_parity.json``), labels the replay data
with the source once (cached in ``replay_labels.zarr``), holds part of it out for the
``ForgettingHook`` and mixes the rest into training. A resumed run only reads the cached
labels; ``finetune check`` does the first steps without training (:func:`finetune_check`).

``finetune init`` starts from what the source was trained on: :func:`read_source_recipe`
reads a native checkpoint's loss and outputs (JSON only) and :func:`plan_finetune_loss`
keeps its terms and weights, adding or leaving out the stress term as the new data and
``--stress/--no-stress`` say.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError
from nvalchemi.app.jobs.spec import FineTuneSpec, TrainingJobSpec

__all__ = [
    "PARITY_FILENAME",
    "REPLAY_LABELS",
    "FineTuneLoss",
    "FineTuneRun",
    "SourceRecipe",
    "finetune_check",
    "finetune_loss",
    "forgetting_hook",
    "loss_terms",
    "parity_note",
    "plan_finetune_loss",
    "prepare_finetune_run",
    "read_source_recipe",
]

PARITY_FILENAME = "finetune_parity.json"
REPLAY_LABELS = "replay_labels.zarr"


@dataclass
class FineTuneRun:
    """What :func:`prepare_finetune_run` set up."""

    train: Any
    """The dataset to train on (with replay: a ``MultiDataset``)."""
    batch_sampler: Any = None
    """The replay-ratio batch sampler, or ``None`` (batch ``train`` as usual)."""
    statistics: Any = None
    parity: Any = None
    num_replay: int = 0
    num_holdout: int = 0


def forgetting_hook(job: TrainingJobSpec) -> Any:
    """A ``ForgettingHook`` for a job with replay (its data comes later), else ``None``."""
    if job.finetune is None or job.finetune.replay is None:
        return None
    from nvalchemi.training.hooks.finetune import ForgettingHook

    return ForgettingHook()


def _main_model(strategy: Any) -> Any:
    from nvalchemi.training.runtime import unwrap_model

    models = strategy.models
    if set(models) != {"main"}:
        raise FieldError(
            f"applies to one model (key 'main'); this job has models {sorted(models)}",
            field="finetune",
            fix="remove the finetune block, or fine-tune one model per job",
        )
    return unwrap_model(models["main"])


def _statistics(spec: FineTuneSpec, model: Any, train: Any, run_dir: Any, manager: Any) -> Any:
    from nvalchemi.training.finetune_statistics import prepare_finetune_model

    try:
        return prepare_finetune_model(
            model,
            train,
            e0=spec.e0,
            atomic_energies=spec.atomic_energies,
            scale_shift=spec.scale_shift,
            head=spec.head,
            run_dir=run_dir,
            distributed_manager=manager,
        )
    except (TypeError, ValueError) as exc:
        raise FieldError(
            str(exc), field="finetune.e0", fix="see docs/finetuning.md (reference energies)"
        ) from None


def _source_head(spec: FineTuneSpec) -> str | int | None:
    """The source's head: named, else the first when a new head became the default."""
    if spec.source_head is not None:
        return spec.source_head
    return 0 if spec.head is not None else None


def _parity(spec: FineTuneSpec, source: Any, model: Any, train: Any) -> Any:
    from nvalchemi.training.finetune_parity import check_zero_step_parity

    count = min(spec.parity_structures, len(train))
    if count == 0:
        return None
    return check_zero_step_parity(
        source,
        model,
        [train[i] for i in range(count)],
        head=spec.head,
        source_head=_source_head(spec),
    )


def _replay_source(job: TrainingJobSpec, neighbors: Any, model: Any) -> Any:
    """The replay files as one in-memory dataset (their own labels, neighbour lists); every
    file's elements must be the model's, and its own labels present when they are used."""
    from nvalchemi.data.datapipes.dataset import InMemoryDataset
    from nvalchemi.data.neighbors import NeighborListTransform
    from nvalchemi.data.sources import open_reader

    replay = job.finetune.replay
    supported = _supported_elements(model)
    structures = []
    for path in replay.all_paths:
        reader = open_reader(
            path,
            dtype=job.dataset.dtype,
            label_keys=job.dataset.label_keys,
            max_structures=replay.max_structures,
            field="finetune.replay.path",
        )
        try:
            read = [reader.read_data(i) for i in range(len(reader))]
        finally:
            reader.close()
        _check_replay_file(path, read, supported, None if replay.pseudo_label else job)
        structures += read
    transforms = None if neighbors is None else [NeighborListTransform(neighbors)]
    return InMemoryDataset(data_list=structures, transforms=transforms)


def _supported_elements(model: Any) -> set[int] | None:
    """The atomic numbers ``model`` handles (``None``: it does not say)."""
    energies = getattr(model, "get_reference_energies", None)
    if not callable(energies):
        return None
    try:
        return {int(z) for z in energies()}
    except (TypeError, ValueError):
        return None


def _symbols(zs: Any) -> str:
    from ase.data import chemical_symbols

    return ", ".join(chemical_symbols[z] if 0 < z < len(chemical_symbols) else f"Z={z}" for z in zs)


def _labelled(data: Any, label: str) -> bool:
    if label not in data:  # AtomicData has no .get
        return False
    value = data[label]
    return value is not None and bool(value.isfinite().all())


def _check_replay_file(
    path: str, structures: list[Any], supported: set[int] | None, labelled_job: Any
) -> None:
    """Elements the model lacks, and (``labelled_job``: its own labels are trained on)
    labels the loss needs that no structure of the file has, are named with the file."""
    if supported is not None:
        present = {int(z) for data in structures for z in data["atomic_numbers"].tolist()}
        unknown = sorted(present - supported)
        if unknown:
            raise FieldError(
                f"{path} has structures with {_symbols(unknown)}, elements the model does not "
                f"have (it has {_symbols(sorted(supported))})",
                field="finetune.replay.path",
                fix="replay data of the model's elements only (remove those structures)",
            )
    if labelled_job is None:
        return
    needed = [o for o in loss_terms(labelled_job.strategy.loss_fn_spec) if o != "stress"]
    for label in needed or ["energy", "forces"]:
        if not any(_labelled(data, label) for data in structures):
            what = "an energy label" if label == "energy" else "force labels"
            raise FieldError(
                f"none of the {len(structures)} structures of {path} has {what}, "
                "and the replay is trained on its own labels (pseudo_label: false, "
                "--replay-labels)",
                field="finetune.replay.pseudo_label",
                fix="label the replay with the source model (pseudo_label: true, the "
                "default), or give replay files with energy and force labels",
            )


def _labelled_replay(
    job: TrainingJobSpec,
    source: Any,
    model: Any,
    run_dir: Path,
    neighbors: Any,
    resumed: bool,
    manager: Any,
) -> Any:
    from nvalchemi.distributed.runtime import barrier, get_rank, get_world_size
    from nvalchemi.training.replay import pseudo_label, read_pseudo_labels

    replay = job.finetune.replay
    if not replay.pseudo_label:
        return _replay_source(job, neighbors, model)
    cache = run_dir / REPLAY_LABELS
    if source is None and not cache.exists():
        raise FieldError(
            f"the replay labels of this run ({cache}) are gone, and the resumed model is no "
            "longer the source that made them",
            field="finetune.replay.pseudo_label",
            fix="restore the file, or start a new fine-tune from the source checkpoint",
        )
    if get_rank(manager) == 0 and source is not None:
        # reuses the store when it was made from these structures and this model, else
        # labels them again (a changed replay file or source checkpoint)
        pseudo_label(
            source, _replay_source(job, None, source), head=_source_head(job.finetune), cache=cache
        )
    if get_world_size(manager) > 1:
        barrier(manager)  # rank 0 wrote the labels; every rank reads the same store
    # without the source (a resume) the labels must be of the replay files as they are now
    structures = None if source is not None else _replay_source(job, None, None)
    return read_pseudo_labels(cache, neighbors, structures=structures)


def prepare_finetune_run(
    job: TrainingJobSpec,
    strategy: Any,
    train: Any,
    *,
    run_dir: Path,
    neighbors: Any,
    batch_size: int,
    shuffle: bool,
    seed: int,
    resumed: bool,
    manager: Any = None,
    forgetting: Any = None,
    console: Any = None,
) -> FineTuneRun | None:
    """Apply ``job.finetune`` to ``strategy`` and the training data (``None`` without it)."""
    from nvalchemi.distributed.runtime import get_rank

    spec = job.finetune
    if spec is None:
        return None
    model = _main_model(strategy)
    run = FineTuneRun(train=train)
    source = None
    if not resumed:
        source = copy.deepcopy(model).eval()
        run.statistics = _statistics(spec, model, train, run_dir, manager)
        run.parity = _parity(spec, source, model, train)
        if run.parity is not None and get_rank(manager) == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / PARITY_FILENAME).write_text(json.dumps(run.parity.to_dict(), indent=2))
        if console is not None:
            _print_preparation(console, run)
    if spec.replay is None:
        return run
    from nvalchemi.data.datapipes import MultiDataset
    from nvalchemi.training.replay import mix_replay, split_holdout

    replay = spec.replay
    labelled = _labelled_replay(job, source, model, run_dir, neighbors, resumed, manager)
    kept, held = split_holdout(labelled, replay.holdout_fraction, seed=seed)
    heads = None
    if spec.head is not None:
        heads = [model.head_index(spec.head), model.head_index(_source_head(spec))]
    try:
        mix = mix_replay(
            train,
            kept,
            batch_size=batch_size,
            ratio=replay.ratio,
            weight=replay.weight,
            heads=heads,
            shuffle=shuffle,
            seed=seed,
            distributed_manager=manager,
        )
    except ValueError as exc:
        raise FieldError(str(exc), field="finetune.replay") from None
    run.train, run.batch_sampler = mix.dataset, mix.batch_sampler
    run.num_replay, run.num_holdout = len(kept), len(held)
    if forgetting is not None:
        from nvalchemi.data.sources import make_loader

        if heads is not None:
            held = MultiDataset(held, head_indices=[heads[1]])
        forgetting.holdout = make_loader(held, batch_size=batch_size)
    if console is not None:
        share = f"{replay.ratio:.0%} of every batch" if replay.ratio else "mixed by size"
        console.print(
            f"replay: {run.num_replay} structures ({share}, weight {replay.weight:g}), "
            f"{run.num_holdout} held out to measure forgetting"
        )
    return run


def _print_preparation(console: Any, run: FineTuneRun) -> None:
    stats = run.statistics
    shifted = {
        element: value - stats.source_atomic_energies[element]
        for element, value in stats.atomic_energies.items()
        if element in stats.source_atomic_energies
    }
    moved = ", ".join(f"{k} {v:+.4f}" for k, v in shifted.items() if v != 0.0) or "none"
    console.print(
        f"fine-tune E0 ({stats.e0_mode}): changes from the source in eV: {moved}"
        + (f"; new elements {stats.new_elements}" if stats.new_elements else "")
    )
    if run.parity is not None:
        console.print(run.parity.format())
        note = parity_note(stats)
        if note:
            console.print(note)


def parity_note(stats: Any) -> str | None:
    """Why the zero-step energies differ from the source on purpose (``None``: they should not)."""
    reasons = []
    if any(
        stats.atomic_energies[e] != stats.source_atomic_energies.get(e)
        for e in stats.atomic_energies
    ):
        reasons.append(f"e0 '{stats.e0_mode}' changed reference energies")
    if stats.scale_shift_mode != "keep":
        reasons.append("scale and shift were re-estimated")
    if not reasons:
        return None
    return f"energy differences are expected: {' and '.join(reasons)}; forces stay the same."


def finetune_check(
    job: TrainingJobSpec, *, trust: bool = False, map_location: str | None = None
) -> FineTuneRun:
    """Build the job's fine-tune-ready model and compare it with its source (no training).

    The statistics are computed and applied as ``spec run`` would, but nothing is
    written; the report compares the first ``finetune.parity_structures`` (at least 1)
    training structures.
    """
    from nvalchemi.app.jobs.build import build_strategy
    from nvalchemi.data.sources import make_dataset, neighbor_config_of

    if job.workflow != "finetune":
        raise FieldError("is a training job", field="workflow", fix="check a fine-tuning job")
    spec = job.finetune or FineTuneSpec()
    sources = job.dataset.open_sources()
    try:
        strategy = build_strategy(
            job, sources=sources, hooks=[], trust=trust, map_location=map_location
        )
        model = _main_model(strategy)
        train = make_dataset(
            sources.train, neighbor_config=neighbor_config_of(strategy.models), in_memory=False
        )
        source = copy.deepcopy(model).eval()
        run = FineTuneRun(train=train)
        run.statistics = _statistics(spec, model, train, None, None)
        wanted = spec.model_copy(update={"parity_structures": max(1, spec.parity_structures)})
        run.parity = _parity(wanted, source, model, train)
    finally:
        sources.close()
    return run


# ---------------------------------------------------------------------- the source's recipe
_OUTPUTS = ("energy", "forces", "stress")
_COMPOSED = "ComposedLossFunction"


@dataclass(frozen=True)
class SourceRecipe:
    """What a native checkpoint's model was trained on (read from its JSON, no tensors)."""

    loss_fn_spec: dict[str, Any] | None
    """The run's loss (spec JSON), ``None`` when the checkpoint has no strategy metadata."""
    active_outputs: list[str] | None
    """The model's saved ``active_outputs``, ``None`` when its spec has none."""
    lr: float | None = None
    """The peak learning rate of the source's (first) optimizer, ``None`` when unknown."""


def read_source_recipe(checkpoint_dir: str | Path, checkpoint_index: Any = -1) -> SourceRecipe:
    """The loss and model outputs of checkpoint ``checkpoint_index`` in ``checkpoint_dir``.

    Raises:
        OSError, ValueError: the checkpoint cannot be read.
    """
    from nvalchemi.training.checkpoint.store import CheckpointStore, read_json

    files = CheckpointStore(checkpoint_dir).open(checkpoint_index)
    meta_path = files.strategy()
    meta = read_json(meta_path, "strategy metadata") if meta_path is not None else None
    loss = meta.get("loss_fn_spec") if isinstance(meta, dict) else None
    outputs = None
    spec_path = files.spec("models", "main")
    if spec_path.is_file():
        spec = read_json(spec_path, "model spec")
        saved = spec.get("active_outputs") if isinstance(spec, dict) else None
        if isinstance(saved, list):
            outputs = [str(o) for o in saved]
    return SourceRecipe(loss if isinstance(loss, dict) else None, outputs, _source_lr(meta))


def _source_lr(meta: Any) -> float | None:
    """The lr of the first optimizer config in strategy metadata (``None`` when absent)."""
    configs = meta.get("optimizer_configs") if isinstance(meta, dict) else None
    first = next(iter(configs.values()), None) if isinstance(configs, dict) and configs else None
    config = first[0] if isinstance(first, list) and first else first
    kwargs = config.get("optimizer_kwargs") if isinstance(config, dict) else None
    lr = kwargs.get("lr") if isinstance(kwargs, dict) else None
    return (
        float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0 else None
    )


def loss_terms(spec: Any) -> dict[str, tuple[str, Any]]:
    """``{output: (loss term, weight)}`` of a loss spec (JSON), for the outputs it trains.

    Example:
        >>> from nvalchemi.app.jobs.recipe import QUICKSTART
        >>> loss_terms(QUICKSTART.loss_fn().to_spec().model_dump())
        {'energy': ('EnergyMSELoss', 10.0), 'forces': ('ForceMSELoss', 1.0)}
    """
    if not isinstance(spec, dict):
        return {}
    if str(spec.get("cls_path", "")).endswith(_COMPOSED):
        components = spec.get("components") or []
        weights = spec.get("weights") or [1.0] * len(components)
        out: dict[str, tuple[str, Any]] = {}
        for component, weight in zip(components, weights):
            for output, (name, inner) in loss_terms(component).items():
                both = isinstance(weight, (int, float)) and isinstance(inner, (int, float))
                out.setdefault(output, (name, weight * inner if both else "scheduled"))
        return out
    key = str(spec.get("prediction_key", ""))
    output = key.removeprefix("predicted_")
    if not key.startswith("predicted_") or output not in _OUTPUTS:
        return {}
    return {output: (str(spec.get("cls_path", "?")).rsplit(".", 1)[-1], 1.0)}


def _describe_terms(spec: Any) -> str:
    return ", ".join(
        f"{output} {weight:g}" if isinstance(weight, (int, float)) else f"{output} ({weight})"
        for output, (_, weight) in loss_terms(spec).items()
    )


@dataclass
class FineTuneLoss:
    """What ``finetune init`` writes for the loss, and what it tells the user."""

    loss_fn_spec: dict[str, Any] | None
    """The job's loss; ``None``: the scaffold's energy + forces (+ ``stress``) loss."""
    stress: bool
    active_outputs: list[str] | None = None
    """``source.active_outputs`` to write (``None``: the model's own)."""
    notes: list[str] = field(default_factory=list)


def _stress_term(dtype_policy: Any) -> tuple[dict[str, Any], float]:
    from nvalchemi.app.jobs.recipe import QUICKSTART

    recipe = QUICKSTART.loss_fn(dtype_policy=dtype_policy, stress=True).to_spec().model_dump()
    return recipe["components"][-1], float(recipe["weights"][-1])


def _with_stress(spec: dict[str, Any]) -> dict[str, Any]:
    term, weight = _stress_term(spec.get("dtype_policy"))
    if str(spec.get("cls_path", "")).endswith(_COMPOSED):
        components = list(spec.get("components") or [])
        weights = list(spec.get("weights") or [1.0] * len(components))
        return {**spec, "components": [*components, term], "weights": [*weights, weight]}
    from nvalchemi.app.jobs.recipe import QUICKSTART

    composed = QUICKSTART.loss_fn().to_spec().model_dump()
    return {**composed, "components": [spec, term], "weights": [1.0, weight]}


def _without(spec: dict[str, Any], output: str) -> dict[str, Any]:
    components = list(spec.get("components") or [])
    weights = list(spec.get("weights") or [1.0] * len(components))
    kept = [(c, w) for c, w in zip(components, weights) if output not in loss_terms(c)]
    return {**spec, "components": [c for c, _ in kept], "weights": [w for _, w in kept]}


def plan_finetune_loss(
    recipe: SourceRecipe | None,
    *,
    stress: bool | None,
    counts: dict[str, int] | None,
    dtype_policy: str | None = None,
) -> FineTuneLoss:
    """The loss of a fine-tune: the source's terms and weights (``recipe``; ``None``: the
    scaffold's energy + forces), with stress added when the new data has stress labels
    and removed when it has none (``counts`` from ``label_counts``; ``None``: unknown), or
    as ``stress`` says. ``dtype_policy`` (given: it replaces the source's)."""
    labels = None if counts is None else counts["stress"]
    found = (
        ""
        if counts is None
        else f"{counts['stress']:,} of the first {counts['scanned']:,} training structures"
    )
    source_loss = None if recipe is None else recipe.loss_fn_spec
    if source_loss is None:
        wanted = bool(labels) if stress is None else stress
        plan = FineTuneLoss(None, wanted)
        if wanted:
            plan.active_outputs = ["energy", "forces", "stress"]
        if wanted and stress is None:
            _, weight = _stress_term(dtype_policy)
            plan.notes.append(
                f"stress labels found in {found}: adding the stress loss (weight {weight:g}) "
                "and the model's stress output (--no-stress to leave them out)"
            )
        return plan
    loss = dict(source_loss)
    if dtype_policy is not None and str(loss.get("cls_path", "")).endswith(_COMPOSED):
        loss["dtype_policy"] = dtype_policy
    had = "stress" in loss_terms(loss)
    wanted = stress if stress is not None else (had if labels is None else bool(labels))
    plan = FineTuneLoss(loss, wanted)
    if wanted and not had:
        plan.loss_fn_spec = _with_stress(loss)
        _, weight = _stress_term(loss.get("dtype_policy"))
        why = "--stress" if stress else f"stress labels found in {found}"
        plan.notes.append(
            f"{why}: adding the stress loss (weight {weight:g}) to the source's and the "
            "model's stress output" + ("" if stress else " (--no-stress to leave them out)")
        )
    elif had and not wanted:
        plan.loss_fn_spec = _without(loss, "stress")
        if stress is False:
            why = "--no-stress: leaving out the source's stress loss"
        else:
            why = (
                f"the source was trained on stress, but none of the first {counts['scanned']:,} "
                "training structures has a stress label: leaving the stress loss out "
                "(--stress keeps it)"
            )
        plan.notes.append(f"{why}; spec report warns that the fine-tune no longer trains stress")
    outputs = recipe.active_outputs
    if wanted and (outputs is None or "stress" not in outputs):
        plan.active_outputs = [o for o in _OUTPUTS if o in (outputs or _OUTPUTS) or o == "stress"]
    elif not wanted and outputs is not None and "stress" in outputs:
        plan.active_outputs = [o for o in outputs if o != "stress"]  # no stress to compute
    plan.notes.insert(
        0,
        f"loss: the source's terms and weights ({_describe_terms(source_loss)})"
        + (f", dtype policy {dtype_policy}" if dtype_policy is not None else ""),
    )
    return plan


def finetune_loss(
    model: str,
    source: dict[str, Any],
    *,
    stress: bool | None,
    counts: dict[str, int] | None,
    dtype_policy: str | None = None,
) -> FineTuneLoss:
    """:func:`plan_finetune_loss` for a ``finetune init`` source (``source.model`` kind
    ``model``, the ``source`` block): a native checkpoint's recipe is read from its files.

    Raises:
        FieldError: ``stress`` given with ``use_original_loss`` (which keeps the loss).
    """
    recipe, notes = None, []
    if model == "native-checkpoint":
        try:
            recipe = read_source_recipe(
                source["checkpoint_path"], source.get("checkpoint_index", -1)
            )
        except (OSError, ValueError) as exc:
            notes.append(
                f"cannot read the source's loss now ({exc}); writing the energy + forces "
                "loss instead (spec report compares them once the checkpoint exists)"
            )
    if not source.get("use_original_loss"):
        plan = plan_finetune_loss(recipe, stress=stress, counts=counts, dtype_policy=dtype_policy)
        plan.notes[:0] = notes
        return plan
    if stress is not None:
        raise FieldError(
            "--stress/--no-stress change the loss, --use-original-loss keeps the checkpoint's "
            "as it is",
            field="source.use_original_loss",
            fix="give one of the two",
        )
    trained = loss_terms(recipe.loss_fn_spec) if recipe is not None else {}
    if "stress" in trained and counts is not None and not counts["stress"]:
        notes.append(
            "the source's loss has a stress term, but none of the first "
            f"{counts['scanned']:,} training structures has a stress label: spec run stops at "
            "the first batch (drop --use-original-loss to leave stress out)"
        )
    return FineTuneLoss(None, stress=False, notes=notes)
