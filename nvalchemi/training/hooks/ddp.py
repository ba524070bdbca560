"""Data-parallel training on ``torch.distributed``: :class:`DDPHook`.

Drop ``DDPHook()`` into a strategy's ``hooks`` and launch the script with ``torchrun``
(or ``srun``); the same script runs unchanged as one process, where the hook does
nothing.

Example:
    >>> hook = DDPHook(model_keys=("main",), backend="gloo", broadcast_buffers=False)
    >>> hook.stage.name, hook.find_unused_parameters
    ('SETUP', None)
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr
from torch import nn
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

from nvalchemi.data.datapipes.dataloader import DataLoader
from nvalchemi.data.datapipes.multidataset import MultiDataset
from nvalchemi.data.datapipes.samplers import MultiDatasetBatchSampler
from nvalchemi.distributed.manager import TIMEOUT_ENV, DistributedManager
from nvalchemi.distributed.runtime import (
    destroy_distributed,
    distributed_device,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed_initialized,
)
from nvalchemi.training.errors import add_note
from nvalchemi.training.stages import TrainingStage

__all__ = ["DDPHook"]

# torch.utils.data.DataLoader options copied when the loader is rebuilt around a new sampler
_COPIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "generator",
    "persistent_workers",
    "in_order",
)


class DDPHook(BaseModel):
    """Wrap training models in ``DistributedDataParallel`` and shard the data, at ``SETUP``.

    Before device placement (``prepare_strategy``) the hook initialises
    ``torch.distributed`` from the launcher's variables (torchrun's ``RANK``/
    ``WORLD_SIZE``/``MASTER_*`` or Slurm's) when ``auto_init`` is set, ``WORLD_SIZE > 1``
    and nothing is initialised yet, and on CUDA pins this rank's GPU
    (``strategy.devices = [cuda:<local rank>]``). At ``SETUP`` it wraps the models
    ``model_keys`` in ``DistributedDataParallel`` (``device_ids`` only for CUDA models;
    parameters keep their identity and names, so optimizers and patterns keep working)
    and gives ``strategy.active_dataloader`` a distributed sampler
    (:meth:`prepare_dataloader`). With a world size of one it does nothing (a manager
    reporting ``world_size == 1`` is never asked to initialise). On teardown (end of
    ``run()`` or of a ``train_batch`` session) it puts the unwrapped models back and
    destroys the process group if it created it: register it first in ``hooks=[...]``,
    so hooks that still communicate at exit (``CheckpointHook``) are torn down before.
    Force and stress training needs no ``find_unused_parameters=True``: the inner
    ``autograd.grad`` only differentiates with respect to positions.

    Args:
        model_keys: models to wrap; ``None``: all models with optimizer configs.
        find_unused_parameters / broadcast_buffers: forwarded; ``None`` uses the
            distributed manager's attribute of that name when it has one, else False.
        static_graph: forwarded.
        process_group: explicit group; ``None``: the manager's ``process_group`` /
            ``group`` / ``get_process_group()``, else the default group.
        backend: backend when the hook initialises the process group (``None``: nccl on
            CUDA, gloo otherwise).
        auto_init: initialise ``torch.distributed`` from the launcher's variables.
        sampler_cls: sampler class or factory, called ``sampler_cls(dataset, **kwargs)``.
        sampler_kwargs: keywords for ``sampler_cls``; they override the inferred
            ``num_replicas``, ``rank``, ``shuffle``, ``seed`` and ``drop_last``.

    Raises (at ``SETUP``):
        RuntimeError: world size > 1 but no process group (``auto_init=False`` and no
            initialised manager).
        KeyError: ``model_keys`` names a model the strategy does not have.
        ValueError: a dataloader whose sampler cannot be replaced (see
            :meth:`prepare_dataloader`).
    """

    model_config = ConfigDict(
        extra="forbid", arbitrary_types_allowed=True, validate_assignment=False
    )

    frequency: ClassVar[int] = 1
    stage: ClassVar[TrainingStage] = TrainingStage.SETUP

    model_keys: tuple[str, ...] | None = None
    find_unused_parameters: bool | None = None
    broadcast_buffers: bool | None = None
    static_graph: bool = False
    process_group: Any | None = None
    backend: str | None = None
    auto_init: bool = True
    sampler_cls: Callable[..., Any] = DistributedSampler
    sampler_kwargs: dict[str, Any] = Field(default_factory=dict)

    _original_models: dict[str, nn.Module] = PrivateAttr(default_factory=dict)
    _initialized_process_group: bool = PrivateAttr(default=False)
    _manager: Any = PrivateAttr(default=None)
    _strategy: Any = PrivateAttr(default=None)
    _is_wrapped: bool = PrivateAttr(default=False)

    def prepare_strategy(self, strategy: Any) -> None:
        """Initialise communication if needed and pin this rank's GPU (before device placement)."""
        self._strategy = strategy
        self._manager = strategy.distributed_manager
        if self._single_process():
            return  # a manager reporting one process: no process group to create
        created = self.auto_init and init_distributed(self._manager, backend=self.backend)
        if get_world_size(self._manager) <= 1:
            return  # nothing to tear down either: one process has no group to destroy
        if created:
            self._initialized_process_group = True
            self._warn_if_torn_down_early(strategy)
        device = distributed_device(
            self._manager, strategy.devices[0], prefer_cuda=self.backend != "gloo"
        )
        if device.type == "cuda":
            torch.cuda.set_device(device)
            strategy.devices = [device]

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        if stage is not TrainingStage.SETUP:
            return
        strategy = getattr(ctx, "workflow", None)
        if strategy is None:
            raise RuntimeError(
                "DDPHook needs ctx.workflow (the TrainingStrategy) at SETUP; register it with "
                "a TrainingStrategy instead of calling it directly."
            )
        self._strategy = strategy
        if self._manager is None:
            self._manager = strategy.distributed_manager
        self.wrap_models(strategy)
        strategy.active_dataloader = self.prepare_dataloader(strategy.active_dataloader)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None and self._is_wrapped and _is_communication_error(exc):
            _explain_peer_failure(exc, self._manager)
        self.close(failed=exc_type is not None)

    def close(self, failed: bool = False) -> None:
        """Put the unwrapped models back; destroy the process group if this hook created it."""
        strategy = self._strategy
        if strategy is not None:
            for key, original in self._original_models.items():
                current = strategy.models.get(key)
                if current is not original and getattr(current, "module", None) is original:
                    strategy.models[key] = original
                    _release_reducer(current)
        self._original_models = {}
        self._is_wrapped = False
        self._strategy = None
        created, self._initialized_process_group = self._initialized_process_group, False
        manager, self._manager = self._manager, None
        if not created:
            return
        if failed:
            # Other ranks may be gone: tear down locally, never raise over the run's error.
            with contextlib.suppress(Exception):
                destroy_distributed(manager, barrier=False)
            return
        destroy_distributed(manager)  # waits for every rank: nobody leaves while others use it

    def wrap_models(self, strategy: Any) -> None:
        """Replace the selected models in ``strategy.models`` by DDP wrappers (once)."""
        if self._is_wrapped or get_world_size(self._manager) <= 1:
            return
        manager = self._manager
        if not is_distributed_initialized(manager):
            raise RuntimeError(
                "DDPHook requires initialized distributed communication when world_size > 1. "
                "Set auto_init=True (the default) so the hook initialises torch.distributed, "
                "launch under torchrun/srun, or pass an initialised distributed_manager "
                "(DistributedManager.initialize())."
            )
        keys = tuple(strategy.optimizer_configs) if self.model_keys is None else self.model_keys
        unknown = [k for k in keys if k not in strategy.models]
        if unknown:
            raise KeyError(
                f"DDPHook model_keys include unknown model(s) {unknown}; available model keys: "
                f"{sorted(strategy.models)}."
            )
        ddp_cls = torch.nn.parallel.DistributedDataParallel  # looked up now: tests patch it
        options = {
            "find_unused_parameters": self._option("find_unused_parameters"),
            "broadcast_buffers": self._option("broadcast_buffers"),
            "static_graph": self.static_graph,
        }
        group = self._process_group()
        for key in keys:
            model = strategy.models[key]
            if _is_ddp(model, ddp_cls):
                continue
            if not any(p.requires_grad for p in model.parameters()):
                continue  # nothing to synchronise (and DDP refuses such modules)
            kwargs = dict(options)
            if group is not None:
                kwargs["process_group"] = group
            first = next(model.parameters())
            if first.device.type == "cuda":
                kwargs["device_ids"] = [first.device.index]
                kwargs["output_device"] = first.device.index
            self._original_models[key] = model
            with warnings.catch_warnings():
                # torch >= 2.13 deprecates broadcast_buffers in favour of forward_sync_buffers,
                # whose False still syncs buffers at construction: we keep the documented option.
                warnings.filterwarnings(
                    "ignore", "`broadcast_buffers` is deprecated", FutureWarning
                )
                strategy.models[key] = ddp_cls(model, **kwargs)
        self._is_wrapped = True

    def _option(self, name: str) -> bool:
        value = getattr(self, name)
        return bool(getattr(self._manager, name, None) if value is None else value)

    def _process_group(self) -> Any:
        if self.process_group is not None:
            return self.process_group
        for name in ("process_group", "group", "get_process_group"):
            value = getattr(self._manager, name, None)
            if callable(value):
                try:
                    value = value()
                except TypeError:
                    continue
            if value is not None:
                return value
        return None

    def prepare_dataloader(self, loader: Any) -> Any:
        """Return ``loader`` (or a rebuilt copy) drawing a disjoint shard on this rank.

        Rules, in order:

        1. ``None``, a world size of one, an object without ``sampler`` (a list of batches)
           or a loader over an ``IterableDataset``: returned unchanged (caller-managed).
        2. A ``batch_sampler`` with ``shard(num_replicas, rank)`` (``BudgetBatchSampler``)
           is replaced by its copy for this rank (in place on nvalchemi's ``DataLoader``,
           else in a rebuilt loader): every rank packs the same epoch.
        3. A ``sampler``, ``batch_sampler`` or ``batch_sampler.sampler`` that is already
           distributed (``num_replicas``, ``rank`` and ``set_epoch``, or a ``sampler_cls``
           instance) is kept (a warning if ``num_replicas`` is not the world size).
        4. nvalchemi ``DataLoader`` and a ``DistributedSampler``-family ``sampler_cls``: a
           batch sampler is installed in place (``MultiDatasetBatchSampler`` for a
           ``MultiDataset`` with the default class, else ``BatchSampler(sampler_cls(dataset,
           **kwargs), batch_size, drop_last)``); a non-distributed ``batch_sampler`` already
           there raises ``ValueError``.
        5. Otherwise ``sampler_cls(dataset, **kwargs)`` is assigned to ``loader.sampler``; a
           torch ``DataLoader`` (which forbids that) is rebuilt with the same options
           (``ValueError`` if it was built with a ``batch_sampler``).

        ``kwargs``: ``num_replicas``, ``rank``, ``shuffle`` (the sampler's or loader's, else
        whether it samples randomly), ``seed`` (the loader's or sampler's, else 0) and
        ``drop_last`` (the batch sampler's or loader's), as far as the factory accepts them,
        then ``sampler_kwargs``.
        """
        if loader is None or get_world_size(self._manager) <= 1 or not hasattr(loader, "sampler"):
            return loader
        if not hasattr(loader, "dataset"):
            raise ValueError(
                "DDPHook cannot inject a distributed sampler into a dataloader with no dataset "
                "attribute. Give the loader a .dataset, or shard the data yourself and pass "
                "a loader without a .sampler attribute."
            )
        dataset = loader.dataset
        if isinstance(dataset, torch.utils.data.IterableDataset):
            return loader  # a stream shards itself (e.g. by get_worker_info / rank)
        sharded = self._shard_batch_sampler(loader)
        if sharded is not None:
            return sharded
        sampler = getattr(loader, "sampler", None)
        batch_sampler = getattr(loader, "batch_sampler", None)
        for candidate in (sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
            if candidate is not None and self._is_distributed(candidate):
                self._check_replicas(candidate)
                return loader
        drop_last = _infer_drop_last(loader, batch_sampler)
        ours = _is_nvalchemi_loader(loader)
        if ours and batch_sampler is not None:
            raise ValueError(
                "DDPHook cannot replace a non-distributed batch_sampler on "
                f"nvalchemi.data.datapipes.DataLoader ({type(batch_sampler).__name__}). Give "
                "it a distributed batch sampler (num_replicas/rank/set_epoch, e.g. "
                "MultiDatasetBatchSampler(..., num_replicas=world_size, rank=rank)) or drop "
                "batch_sampler and let the hook install one."
            )
        defaults = self._default_kwargs(loader, sampler, drop_last)
        if ours and _is_distributed_sampler_class(self.sampler_cls):
            return self._install_batch_sampler(loader, dataset, defaults, drop_last)
        kwargs = {**_accepted(self.sampler_cls, defaults), **self.sampler_kwargs}
        new_sampler = self.sampler_cls(dataset, **kwargs)
        with contextlib.suppress(AttributeError, ValueError):  # torch's loader refuses
            loader.sampler = new_sampler
        if loader.sampler is new_sampler:
            return loader
        if getattr(loader, "batch_size", None) is None:
            raise ValueError(
                "DDPHook cannot inject DistributedSampler into a DataLoader constructed with "
                "batch_sampler. Pass a distributed batch sampler (num_replicas/rank/set_epoch) "
                "yourself, or build the DataLoader with batch_size= so the hook can add one."
            )
        return _rebuild(
            loader,
            "DDPHook could not assign dataloader.sampler and could not rebuild the dataloader "
            "with the configured sampler ({exc}). Build the loader with a distributed sampler "
            "yourself.",
            batch_size=loader.batch_size,
            sampler=new_sampler,
            drop_last=drop_last,
        )

    def _shard_batch_sampler(self, loader: Any) -> Any:
        """Rule 2 of :meth:`prepare_dataloader`; ``None`` for a batch sampler without ``shard``."""
        batch_sampler = getattr(loader, "batch_sampler", None)
        shard = getattr(batch_sampler, "shard", None)
        if not callable(shard):
            return None
        world, rank = get_world_size(self._manager), get_rank(self._manager)
        if (batch_sampler.num_replicas, batch_sampler.rank) == (world, rank):
            return loader
        sharded = shard(num_replicas=world, rank=rank)
        if _is_nvalchemi_loader(loader):
            loader.batch_sampler = sharded
            return loader
        return _rebuild(
            loader,
            f"DDPHook could not rebuild the dataloader around the batch sampler for this rank "
            f"({{exc}}). Build it with {type(sharded).__name__}(..., num_replicas="
            "world_size, rank=rank) yourself.",
            batch_sampler=sharded,
        )

    def _install_batch_sampler(
        self, loader: Any, dataset: Any, defaults: dict[str, Any], drop_last: bool
    ) -> Any:

        kwargs = {**defaults, **self.sampler_kwargs}
        if isinstance(dataset, MultiDataset) and self.sampler_cls is DistributedSampler:
            batch_sampler = MultiDatasetBatchSampler(
                dataset, batch_size=loader.batch_size, **kwargs
            )
        else:
            try:
                len(dataset)
            except TypeError:
                raise TypeError(
                    f"DDPHook needs a sized dataset to shard; {type(dataset).__name__} has no "
                    "__len__."
                ) from None
            drop = bool(kwargs.get("drop_last", drop_last))
            batch_sampler = BatchSampler(
                self.sampler_cls(dataset, **kwargs), loader.batch_size, drop
            )
        loader.batch_sampler = batch_sampler
        loader.sampler = None
        return loader

    def _default_kwargs(self, loader: Any, sampler: Any, drop_last: bool) -> dict[str, Any]:
        shuffle = self.sampler_kwargs.get("shuffle")
        if shuffle is None:
            shuffle = _infer_shuffle(loader, sampler)
        return {
            "num_replicas": get_world_size(self._manager),
            "rank": get_rank(self._manager),
            "shuffle": bool(shuffle),
            "seed": _infer_seed(loader, sampler),
            "drop_last": drop_last,
        }

    def _is_distributed(self, sampler: Any) -> bool:
        if isinstance(self.sampler_cls, type) and isinstance(sampler, self.sampler_cls):
            return True
        return (
            hasattr(sampler, "num_replicas")
            and hasattr(sampler, "rank")
            and callable(getattr(sampler, "set_epoch", None))
        )

    def _check_replicas(self, sampler: Any) -> None:
        replicas, world = getattr(sampler, "num_replicas", None), get_world_size(self._manager)
        if isinstance(replicas, int) and replicas != world:
            warnings.warn(
                f"DDPHook keeps the dataloader's distributed sampler {type(sampler).__name__}, "
                f"but it shards over num_replicas={replicas} while the world size is {world}; "
                "ranks may see overlapping data. Build it with num_replicas=world_size (or "
                "leave the sampler to the hook).",
                UserWarning,
                stacklevel=3,
            )

    def _single_process(self) -> bool:
        # Not for our DistributedManager: it reports one process until initialised, which
        # reads the launcher's variables (init_distributed decides).
        manager = self._manager
        if manager is None or isinstance(manager, DistributedManager):
            return False
        return not is_distributed_initialized(manager) and get_world_size(manager) <= 1

    def _warn_if_torn_down_early(self, strategy: Any) -> None:
        # Hooks exit in reverse registration order: one registered before this hook that
        # still communicates at exit would find the process group already destroyed.
        for hook in strategy.hooks:
            if hook is self:
                return
            if callable(getattr(hook, "__exit__", None)):
                warnings.warn(
                    f"DDPHook created the process group and will destroy it at teardown, "
                    f"before {type(hook).__name__} (registered earlier) exits; register "
                    "DDPHook first in hooks=[...] so collectives at exit still work.",
                    UserWarning,
                    stacklevel=4,
                )
                return


# ---------------------------------------------------------------------------- module helpers
_COMMUNICATION_HINTS = ("gloo", "nccl", "connection closed", "connection reset", "timed out")


def _is_communication_error(exc: BaseException) -> bool:
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(hint in text for hint in _COMMUNICATION_HINTS)


def _explain_peer_failure(exc: BaseException, manager: Any) -> None:

    add_note(
        exc,
        f"DDPHook: rank {get_rank(manager)} of {get_world_size(manager)} lost contact with "
        "the other ranks during data-parallel training. Another rank most likely exited, "
        "crashed or stalled: check its log first. Waits are bounded by the process-group "
        f"timeout ({TIMEOUT_ENV} or DistributedManager.initialize(timeout_s=...)).",
    )


def _is_ddp(model: Any, ddp_cls: Any) -> bool:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return True
    return isinstance(ddp_cls, type) and isinstance(model, ddp_cls)


def _is_nvalchemi_loader(loader: Any) -> bool:
    return isinstance(loader, DataLoader)


def _is_distributed_sampler_class(factory: Any) -> bool:
    return isinstance(factory, type) and issubclass(factory, DistributedSampler)


def _accepted(factory: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """The inferred defaults ``factory`` takes: all for the DistributedSampler family or
    ``**kwargs``, those it names if it has both ``num_replicas`` and ``rank``, else none."""
    if _is_distributed_sampler_class(factory):
        return dict(defaults)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    if "num_replicas" in params and "rank" in params:
        return {k: v for k, v in defaults.items() if k in params}
    return {}


def _infer_drop_last(loader: Any, batch_sampler: Any) -> bool:
    value = getattr(batch_sampler, "drop_last", None)
    return bool(getattr(loader, "drop_last", None) if value is None else value)


def _infer_shuffle(loader: Any, sampler: Any) -> bool:
    # Ours: ShuffleSampler.shuffle / DataLoader.shuffle; torch's: a RandomSampler.
    for value in (getattr(sampler, "shuffle", None), getattr(loader, "shuffle", None)):
        if isinstance(value, bool):
            return value
    return isinstance(sampler, RandomSampler)


def _infer_seed(loader: Any, sampler: Any) -> int:
    for value in (getattr(loader, "seed", None), getattr(sampler, "seed", None)):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def _loader_options(loader: Any) -> dict[str, Any]:
    """The worker and memory options of a ``torch.utils.data.DataLoader``, for a rebuild."""
    kwargs = {name: getattr(loader, name) for name in _COPIED if hasattr(loader, name)}
    if getattr(loader, "multiprocessing_context", None) is not None:
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    if getattr(loader, "num_workers", 0) > 0 and getattr(loader, "prefetch_factor", None):
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if getattr(loader, "pin_memory_device", None):
        kwargs["pin_memory_device"] = loader.pin_memory_device
    return kwargs


def _rebuild(loader: Any, error: str, **sampling: Any) -> Any:
    """A new loader of ``type(loader)`` with ``sampling`` and the same options; ``error`` names ``{exc}``."""
    try:
        return type(loader)(loader.dataset, **sampling, **_loader_options(loader))
    except TypeError as exc:
        raise ValueError(error.format(exc=exc)) from exc


def _release_reducer(wrapper: Any) -> None:
    """Drop a DDP wrapper's gradient reducer now, while the process group is registered.

    The reducer holds the process group and is destroyed with the GIL held. Left to the
    garbage collector (the wrapper lives on in reference cycles of the finished run), it
    can be the group's last owner after ``destroy_process_group``; gloo's destructor then
    joins a communication thread waiting for the GIL: a deadlock (a rank hanging after
    ``run()`` returned). Released here, the group's last reference goes with
    ``destroy_process_group``, whose destructor releases the GIL.
    """
    state = getattr(wrapper, "__dict__", {})
    if state.get("reducer") is not None:
        state.pop("logger", None)  # DDP's logger holds the reducer too
        state.pop("reducer")
