"""Replay against forgetting: mix data of the source model's domain into a fine-tune.

Two kinds of replay data:

* real data the source was trained on (any dataset with labels);
* structures you give, labelled by the source model itself: :func:`pseudo_label`
  runs the source once and keeps the labels (optionally cached in a zarr store, so a
  resumed run reuses them instead of asking the fine-tuned model).

:func:`mix_replay` puts the fine-tuning data and the replay data behind one
:class:`~nvalchemi.data.datapipes.MultiDataset`: every structure carries the
``loss_weight`` of its dataset (the losses' weighted means divide by the sum of the
weights, so ``weight`` sets a replay structure's share against a fine-tuning one's, whose
weight is 1) and, for multi-head models, the
``head`` that predicts it. ``ratio`` fixes the replay share of every batch (a
:class:`~nvalchemi.data.datapipes.MultiDatasetBatchSampler`); without it batches mix
the two in proportion to their sizes.

How much was forgotten is measured by
:class:`~nvalchemi.training.hooks.ForgettingHook` on a held-out part of the replay data.

Example:
    >>> replay = pseudo_label(source_model, my_structures, cache="runs/ft/replay.zarr")
    >>> mixed = mix_replay(finetune_dataset, replay, ratio=0.2, batch_size=8)  # doctest: +SKIP
    >>> strategy.run(mixed.loader())  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nvalchemi._fileio import replace_dir
from nvalchemi.checkpoint_files import read_json

__all__ = ["ReplayMix", "mix_replay", "pseudo_label", "read_pseudo_labels", "split_holdout"]

import copy

from nvalchemi.data.batch import iter_batches
from nvalchemi.data.datapipes import MultiDataset
from nvalchemi.data.datapipes.dataloader import DataLoader
from nvalchemi.data.datapipes.dataset import InMemoryDataset
from nvalchemi.data.datapipes.samplers import MultiDatasetBatchSampler
from nvalchemi.data.io.zarr import AtomicDataZarrReader, AtomicDataZarrWriter
from nvalchemi.data.neighbors import NeighborListTransform, compute_neighbors
from nvalchemi.training.runtime import evaluating

_LABELS = ("energy", "forces", "stress")
_INPUTS_FILE = "nvalchemi_replay_inputs.json"  # what the labels of a cache were made from


def pseudo_label(
    model: torch.nn.Module,
    structures: Iterable[Any],
    *,
    head: str | None = None,
    batch_size: int = 16,
    cache: str | Path | None = None,
) -> Any:
    """The structures labelled by ``model``: an ``InMemoryDataset`` with energy, forces, stress.

    Args:
        model: the source model (run in eval mode; its mode is restored).
        structures: ``AtomicData``, ``ase.Atoms`` or ``Batch`` items; their own
            labels are replaced. Stress is labelled for periodic structures with a
            volume when the model can compute it.
        head: the source head that labels (multi-head models; default: the first).
        batch_size: structures per forward pass.
        cache: a zarr store path. The store records what it was made from (a digest of
            the structures, of the model's class, settings and weights, and the head):
            when those match, its labels are returned and the model is not run; when
            they do not, the structures are labelled again (with a warning) and the
            store replaced. A store there without that record is refused.

    Labels take each structure's float dtype; the structures carry neighbour lists
    for the model's cutoff.
    """
    items = _atomic_data_list(structures)
    if not items:
        raise ValueError("pseudo_label got no structures to label.")
    inputs = None
    if cache is not None:
        inputs = {
            "structures": _structures_digest(items),
            "model": _model_digest(model),
            "head": head,
        }
        changed = _cache_changes(Path(cache), inputs)
        if changed == []:
            return read_pseudo_labels(cache, model.model_config.neighbor_config)
        if changed:
            warnings.warn(
                f"The replay labels cached at {cache} were made from other inputs "
                f"({', '.join(changed)} changed); labelling the structures again.",
                UserWarning,
                stacklevel=2,
            )
    labelled = []
    for batch in iter_batches(items, batch_size):
        labelled.extend(_label_batch(model, batch, head))
    if cache is not None:
        _write_store(labelled, Path(cache), inputs)
    return InMemoryDataset(data_list=labelled)


def read_pseudo_labels(
    cache: str | Path, neighbor_config: Any = None, *, structures: Iterable[Any] | None = None
) -> Any:
    """The labelled structures :func:`pseudo_label` cached at ``cache`` (an ``InMemoryDataset``).

    ``neighbor_config`` (a model's ``NeighborConfig``): neighbour lists to build.
    ``structures``: the structures the labels should be of (e.g. the replay files read
    again on resume); ``ValueError`` if the store was made from others.
    """
    if structures is not None:
        recorded = _recorded_inputs(Path(cache)) or {}
        if recorded.get("structures") != _structures_digest(_atomic_data_list(structures)):
            raise ValueError(
                f"The replay labels at {cache} were made from other structures than the "
                "replay files hold now (they changed since the labels were made). Restore the "
                f"files, or delete {cache} and label them again with the source model."
            )
    transforms = None if neighbor_config is None else [NeighborListTransform(neighbor_config)]
    return InMemoryDataset(reader=AtomicDataZarrReader(str(cache)), transforms=transforms)


def _structures_digest(structures: Iterable[Any]) -> str:
    """A SHA-256 of the structures' inputs in order (every field but labels and edges)."""
    digest = hashlib.sha256()
    for data in structures:
        for name in sorted(data.keys()):
            if name not in _LABELS and data.level_of(name) != "edge":
                _hash_tensor(digest, name, data[name])
        digest.update(b"|")
    return digest.hexdigest()


def _model_digest(model: Any) -> str:
    """A SHA-256 of the model's class, settings (``model_config``) and every weight."""
    digest = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    config = getattr(model, "model_config", None)
    dump = config.model_dump(exclude={"active_outputs", "gradient_keys"}) if config else {}
    digest.update(json.dumps(_sorted_sets(dump), sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        _hash_tensor(digest, name, tensor)
    return digest.hexdigest()


def _hash_tensor(digest: Any, name: str, tensor: torch.Tensor) -> None:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    digest.update(f"{name}:{flat.dtype}:{tuple(tensor.shape)}:".encode())
    digest.update(flat.view(torch.uint8).numpy().tobytes())


def _sorted_sets(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(map(str, value))
    if isinstance(value, dict):
        return {k: _sorted_sets(v) for k, v in value.items()}
    return value


def _atomic_data_list(structures: Iterable[Any]) -> list[Any]:
    """``structures`` as a list of ``AtomicData`` (``Batch`` items split, ASE converted)."""
    items: list[Any] = []
    for batch in iter_batches(structures, batch_size=64):
        items.extend(batch.to_data_list())
    return items


def _recorded_inputs(cache: Path) -> dict[str, Any] | None:
    """The inputs recorded in the store at ``cache`` (``None``: no record)."""
    try:
        recorded = read_json(cache / _INPUTS_FILE, "replay label record")
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


def _cache_changes(cache: Path, inputs: dict[str, Any]) -> list[str] | None:
    """``None``: no store; else the names of the inputs that differ from its record."""
    if not cache.exists():
        return None
    recorded = _recorded_inputs(cache)
    if recorded is None:
        raise ValueError(
            f"{cache} exists but does not record what its labels were made from (made by an "
            "older nvalchemi, or not a replay label store), so it can be neither trusted nor "
            "replaced. Delete it to label the structures again, or choose another cache path."
        )
    names = {"structures": "the structures", "model": "the model's weights or settings"}
    return [names.get(k, f"the {k}") for k in inputs if recorded.get(k) != inputs[k]]


def split_holdout(dataset: Any, fraction: float, seed: int = 0) -> tuple[Any, Any]:
    """``(kept, held_out)`` in-memory datasets; ``held_out`` is a seeded ``fraction`` (>= 1).

    The held-out part measures forgetting; it is never trained on.
    """
    n = len(dataset)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"holdout fraction must be between 0 and 1; got {fraction}.")
    if n < 2:
        raise ValueError(f"cannot hold out part of {n} replay structure(s); give more.")
    count = max(1, min(n - 1, round(n * fraction)))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held, kept = sorted(order[:count]), sorted(order[count:])
    return (
        InMemoryDataset(data_list=[dataset[i] for i in kept]),
        InMemoryDataset(data_list=[dataset[i] for i in held]),
    )


@dataclass
class ReplayMix:
    """The mixed dataset of :func:`mix_replay` and how to batch it."""

    dataset: Any
    """``MultiDataset(finetune, replay)`` with ``loss_weight`` (and ``head``) fields."""
    batch_size: int
    batch_sampler: Any
    """A ``MultiDatasetBatchSampler`` with the replay ``ratio``, or ``None`` (plain shuffle)."""
    seed: int = 0
    shuffle: bool = True

    def loader(self, **kwargs: Any) -> Any:
        """An nvalchemi ``DataLoader`` over the mix (``kwargs``: ``num_workers``, ...)."""
        if self.batch_sampler is not None:
            return DataLoader(self.dataset, batch_sampler=self.batch_sampler, **kwargs)
        return DataLoader(
            self.dataset, batch_size=self.batch_size, shuffle=self.shuffle, seed=self.seed, **kwargs
        )


def mix_replay(
    finetune: Any,
    replay: Any,
    *,
    batch_size: int,
    ratio: float | None = None,
    weight: float = 1.0,
    heads: Sequence[int] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    distributed_manager: Any = None,
) -> ReplayMix:
    """Fine-tuning data plus replay data, weighted and (optionally) at a fixed batch share.

    Args:
        finetune: the new data (a dataset of ``AtomicData``).
        replay: the replay data (e.g. from :func:`pseudo_label`).
        batch_size: structures per batch.
        ratio: the replay share of every batch (``0 < ratio < 1``); an epoch then
            holds as many batches as it takes to show every fine-tuning structure
            once on average. ``None``: batches of the shuffled concatenation.
        weight: replay's ``loss_weight`` (fine-tuning structures have 1.0).
        heads: ``(finetune_head, replay_head)`` indices for multi-head models (e.g.
            the new head and the source's); ``None``: no ``head`` field.
        shuffle / seed: sampling order (identical on every rank).
        distributed_manager: shard the batches across ranks (the sampler then
            counts as distributed, so ``DDPHook`` keeps it).
    """

    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"replay weight must be finite and non-negative; got {weight}.")
    if heads is not None and len(heads) != 2:
        raise ValueError(f"heads must be (finetune_head, replay_head); got {heads!r}.")
    dataset = MultiDataset(
        finetune,
        replay,
        output_strict=False,
        loss_weights=[1.0, float(weight)],
        head_indices=None if heads is None else [int(h) for h in heads],
    )
    sampler = None
    if ratio is not None:
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"replay ratio must be between 0 and 1 (exclusive); got {ratio}.")
        if batch_size < 2:
            raise ValueError(
                "a replay ratio needs batches of at least 2 structures; got "
                f"batch_size={batch_size}."
            )
        replayed = min(batch_size - 1, max(1, round(batch_size * ratio)))
        counts = [batch_size - replayed, replayed]
        sampler = MultiDatasetBatchSampler(
            dataset,
            batch_size=batch_size,
            samples_per_dataset=counts,
            num_batches=math.ceil(len(finetune) / counts[0]),
            shuffle=shuffle,
            seed=seed,
            distributed_manager=distributed_manager,
        )
    return ReplayMix(dataset, batch_size, sampler, seed, shuffle)


# ---------------------------------------------------------------------------- labelling
def _label_batch(model: Any, batch: Any, head: str | None) -> list[Any]:
    """The structures of ``batch`` with the model's energy/forces/stress as labels."""
    config = model.model_config
    work = batch.clone()
    if config.neighbor_config is not None:
        compute_neighbors(work, config=config.neighbor_config)
    cell = work.get("cell")
    volumes = (
        torch.linalg.det(cell.double()).abs().cpu()
        if cell is not None
        else torch.zeros(work.num_graphs, dtype=torch.float64)
    )
    pbc = work.get("pbc")
    periodic = (
        pbc.reshape(work.num_graphs, 3).any(-1).cpu()
        if pbc is not None
        else torch.zeros(work.num_graphs, dtype=torch.bool)
    )
    wants_stress = bool(((volumes > 1e-12) & periodic).any()) and "stress" in config.outputs
    active = {"energy", "forces"} | ({"stress"} if wants_stress else set())
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    with evaluating(model, active & set(config.outputs)), torch.enable_grad():
        out = model(work.to(device)) if head is None else model(work.to(device), head=head)
    counts = batch.num_nodes_per_graph.cpu().tolist()
    forces = out.get("forces")
    forces = None if forces is None else forces.detach().cpu().split(counts)
    labelled = []
    for i in range(batch.num_graphs):
        data = work.get_data(i)  # with the labelling model's neighbour lists
        for label in _LABELS:
            if label in data:
                data[label] = None
        dtype = data["positions"].dtype
        data["energy"] = out["energy"][i].detach().cpu().reshape(1).to(dtype)
        if forces is not None:
            data["forces"] = forces[i].to(dtype)
        stress = out.get("stress")
        if stress is not None and bool(periodic[i]) and float(volumes[i]) > 1e-12:
            data["stress"] = stress[i].detach().cpu().reshape(1, 3, 3).to(dtype)
        labelled.append(data)
    return labelled


def _write_store(structures: list[Any], path: Path, inputs: dict[str, Any]) -> None:
    """Write the labelled structures and their ``inputs`` record to ``path`` (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    if tmp.exists():  # our own half-written store of an interrupted run
        shutil.rmtree(tmp)
    AtomicDataZarrWriter(str(tmp)).write([_without_edges(d) for d in structures])
    (tmp / _INPUTS_FILE).write_text(json.dumps(inputs))
    replace_dir(tmp, path)


def _without_edges(data: Any) -> Any:
    """Neighbour lists are rebuilt for the consuming model; store the structure only."""
    data = copy.copy(data)
    for key in ("neighbor_list", "neighbor_list_shifts", "shifts"):
        if key in data:
            data[key] = None
    return data
