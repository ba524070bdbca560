"""A job's ``finetune`` block at run time: statistics, the zero-step check, replay, forgetting.

:func:`prepare_finetune_run` (``spec run``, between building the strategy and training)
keeps a copy of the source model, fits the trained head's reference energies (and
scale/shift) on rank 0 (``finetune_statistics.json``), compares the fine-tune-ready model
with the source on a few structures (``finetune_parity.json``), labels the replay data
with the source once (cached in ``replay_labels.zarr``), holds part of it out for the
``ForgettingHook`` and mixes the rest into training. A resumed run only reads the cached
labels; ``finetune check`` does the first steps without training (:func:`finetune_check`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError
from nvalchemi.app.jobs.spec import FineTuneSpec, TrainingJobSpec

__all__ = [
    "PARITY_FILENAME",
    "REPLAY_LABELS",
    "FineTuneRun",
    "finetune_check",
    "forgetting_hook",
    "parity_note",
    "prepare_finetune_run",
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


def _replay_source(job: TrainingJobSpec, neighbors: Any) -> Any:
    """The replay files as one in-memory dataset (their own labels, neighbour lists)."""
    from nvalchemi.data.datapipes.dataset import InMemoryDataset
    from nvalchemi.data.neighbors import NeighborListTransform
    from nvalchemi.data.sources import open_reader

    replay = job.finetune.replay
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
            structures += [reader.read_data(i) for i in range(len(reader))]
        finally:
            reader.close()
    transforms = None if neighbors is None else [NeighborListTransform(neighbors)]
    return InMemoryDataset(data_list=structures, transforms=transforms)


def _labelled_replay(
    job: TrainingJobSpec, source: Any, run_dir: Path, neighbors: Any, resumed: bool, manager: Any
) -> Any:
    from nvalchemi.distributed.runtime import barrier, get_rank, get_world_size
    from nvalchemi.training.replay import pseudo_label, read_pseudo_labels

    replay = job.finetune.replay
    if not replay.pseudo_label:
        return _replay_source(job, neighbors)
    cache = run_dir / REPLAY_LABELS
    if source is None and not cache.exists():
        raise FieldError(
            f"the replay labels of this run ({cache}) are gone, and the resumed model is no "
            "longer the source that made them",
            field="finetune.replay.pseudo_label",
            fix="restore the file, or start a new fine-tune from the source checkpoint",
        )
    if get_rank(manager) == 0 and not cache.exists():
        pseudo_label(
            source, _replay_source(job, None), head=_source_head(job.finetune), cache=cache
        )
    if get_world_size(manager) > 1:
        barrier(manager)  # rank 0 wrote the labels; every rank reads the same store
    return read_pseudo_labels(cache, neighbors)


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
    labelled = _labelled_replay(job, source, run_dir, neighbors, resumed, manager)
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
