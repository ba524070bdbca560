"""Rank helpers that work with any manager object, ``torch.distributed``, or neither.

Every helper takes an optional duck-typed ``manager`` (a
:class:`~nvalchemi.distributed.DistributedManager`, PhysicsNeMo's, or anything
with the probed attributes). Without one, or when the manager lacks the
attribute, the helper falls back to ``torch.distributed`` and then to the
launcher's environment variables, so the same code runs in a single process,
under ``torchrun`` and under ``srun``.

Collectives (:func:`all_reduce`, :func:`barrier`, :func:`broadcast_object`,
:func:`all_agree`) are no-ops in a single process.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from nvalchemi.distributed.launch import LaunchEnv, detect_launch_env
from nvalchemi.distributed.manager import TIMEOUT_ENV, DistributedManager, _best_effort_barrier
from nvalchemi.distributed.stalls import collective_failure_note, is_collective_failure

__all__ = [
    "all_agree",
    "all_reduce",
    "barrier",
    "broadcast_object",
    "collective_device",
    "destroy_distributed",
    "distributed_device",
    "explain_collective_failure",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed_initialized",
    "resolve_global_rank",
    "resolve_world_size",
]

T = TypeVar("T")
_MISSING = object()
_EXPLAINED = "_nvalchemi_collective_explained"


# --------------------------------------------------------------------------- queries
def is_distributed_initialized(manager: Any = None) -> bool:
    """Whether distributed communication is set up (per the manager, else ``torch.distributed``).

    Example:
        >>> is_distributed_initialized()
        False
    """
    value = _probe(manager, ("is_initialized", "initialized", "is_distributed_initialized"))
    if value is not _MISSING:
        return bool(value)
    return _process_group_ready()


def get_rank(manager: Any = None) -> int:
    """Global rank: the manager's, else ``torch.distributed``'s, else ``RANK``/``SLURM_PROCID``, else 0."""
    value = _probe(manager, ("global_rank", "rank", "get_rank"))
    if value is not _MISSING:
        return int(value)
    if _process_group_ready():
        return dist.get_rank()
    return _launch_env().rank


def get_world_size(manager: Any = None) -> int:
    """Number of processes: the manager's, else ``torch.distributed``'s, else the launcher's, else 1."""
    value = _probe(manager, ("world_size", "get_world_size"))
    if value is not _MISSING:
        return int(value)
    if _process_group_ready():
        return dist.get_world_size()
    return _launch_env().world_size


def get_local_rank(manager: Any = None) -> int:
    """Rank on this node: the manager's, else ``LOCAL_RANK``/``SLURM_LOCALID``, else 0."""
    value = _probe(manager, ("local_rank", "get_local_rank"))
    if value is not _MISSING:
        return int(value)
    local = _launch_env().local_rank
    return 0 if local is None else local


def distributed_device(
    manager: Any = None, fallback: str | torch.device = "cpu", *, prefer_cuda: bool = True
) -> torch.device:
    """Device of this rank: the manager's, else ``cuda:<local rank>``, else ``fallback``.

    Example:
        >>> distributed_device(None, "cpu", prefer_cuda=False)
        device(type='cpu')
    """
    value = _probe(manager, ("device", "get_device"))
    if value is not _MISSING and value is not None:
        return torch.device(value)
    if prefer_cuda and torch.cuda.is_available():
        return torch.device("cuda", get_local_rank(manager))
    return torch.device(fallback)


def resolve_world_size() -> int:
    """World size from the shared :class:`DistributedManager`, ``torch.distributed`` or the launcher."""
    if DistributedManager.is_initialized():
        return DistributedManager().world_size
    return get_world_size(None)


def resolve_global_rank(global_rank: int | None = None) -> int:
    """``global_rank`` if given, else the rank from the manager, ``torch.distributed`` or the launcher."""
    if global_rank is not None:
        return int(global_rank)
    if DistributedManager.is_initialized():
        return DistributedManager().rank
    return get_rank(None)


def collective_device(fallback: str | torch.device = "cpu") -> torch.device:
    """Device that collective tensors must live on for the active backend.

    CPU for gloo (or any non-NCCL backend); the manager's device or
    ``cuda:<local rank>`` for NCCL; ``fallback`` when nothing is set up
    (CPU if ``fallback`` asks for CUDA and none is available).
    """
    if _process_group_ready() and "nccl" not in str(dist.get_backend()):
        return torch.device("cpu")
    if DistributedManager.is_initialized():
        return DistributedManager().device
    if _process_group_ready() and torch.cuda.is_available():
        return torch.device("cuda", get_local_rank(None))
    device = torch.device(fallback)
    if device.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return device


# --------------------------------------------------------------------------- lifecycle
def init_distributed(manager: Any = None, *, backend: str | None = None, **kwargs: Any) -> bool:
    """Initialise distributed communication if needed; return whether this call did it.

    With a manager, calls the first of its ``init_process_group``,
    ``initialize``, ``init`` or ``setup`` (passing ``backend`` and ``kwargs``
    when its signature accepts them). Without one, initialises the shared
    :class:`DistributedManager` from torchrun or Slurm variables when they
    describe more than one process (``timeout_s=`` is forwarded).

    Example:
        >>> init_distributed()  # one process: nothing to do
        False
    """
    if is_distributed_initialized(manager):
        return False
    if manager is not None:
        for name in ("init_process_group", "initialize", "init", "setup"):
            method = getattr(manager, name, None)
            if callable(method):
                call_kwargs = dict(kwargs)
                if backend is not None:
                    call_kwargs["backend"] = backend
                method(**_accepted_kwargs(method, call_kwargs))
                return is_distributed_initialized(manager)
        raise TypeError(
            f"{type(manager).__name__} has none of init_process_group/initialize/init/setup; "
            "pass a DistributedManager or initialise torch.distributed yourself."
        )
    if _process_group_ready() or _launch_env().world_size <= 1:
        return False
    DistributedManager.initialize(backend=backend, **kwargs)
    return _process_group_ready()


def destroy_distributed(manager: Any = None, *, barrier: bool = True) -> bool:
    """Tear down distributed communication; return whether something was torn down.

    ``barrier=True`` first waits for every rank (see :meth:`DistributedManager.cleanup`);
    pass ``False`` on an error path, where peers may already be gone.
    """
    if manager is not None and not isinstance(manager, DistributedManager):
        for name in ("destroy_process_group", "destroy", "cleanup", "teardown"):
            method = getattr(manager, name, None)
            if callable(method):
                was_initialized = is_distributed_initialized(manager)
                method()
                return was_initialized
    was_ready = _process_group_ready() or (
        manager is not None and is_distributed_initialized(manager)
    )
    if DistributedManager.is_initialized():
        # destroys the group only if the manager created it
        DistributedManager.cleanup(barrier=barrier)
    if _process_group_ready():
        if barrier:
            _best_effort_barrier()
        dist.destroy_process_group()
    return was_ready


# --------------------------------------------------------------------------- collectives
def barrier(manager: Any = None) -> None:
    """Wait until every rank reaches this point (no-op in a single process)."""
    method = getattr(manager, "barrier", None) if manager is not None else None
    if callable(method):
        method()
    elif _process_group_ready():
        try:
            dist.barrier(group=_manager_group(manager))
        except RuntimeError as exc:
            _explain_collective_failure(exc, "barrier")
            raise


def all_reduce(tensor: torch.Tensor, manager: Any = None, *, op: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place and return it (unchanged in a single process).

    ``op`` is a ``torch.distributed.ReduceOp`` (default ``SUM``).

    Example:
        >>> t = torch.tensor([1.0, 2.0])
        >>> all_reduce(t).tolist()
        [1.0, 2.0]
    """
    if op is None:
        op = dist.ReduceOp.SUM
    method = getattr(manager, "all_reduce", None) if manager is not None else None
    if callable(method):
        result = method(tensor, op=op)
        return tensor if result is None or not isinstance(result, torch.Tensor) else result
    if _process_group_ready():
        try:
            dist.all_reduce(tensor, op=op, group=_manager_group(manager))
        except RuntimeError as exc:
            _explain_collective_failure(exc, "all_reduce")
            raise
    return tensor


def broadcast_object(obj: T, src: int = 0, manager: Any = None) -> T:
    """Return rank ``src``'s ``obj`` on every rank (any picklable object).

    Example:
        >>> broadcast_object({"seed": 7})
        {'seed': 7}
    """
    if not _collectives_active():
        return obj
    payload = [obj if dist.get_rank() == src else None]
    try:
        dist.broadcast_object_list(
            payload, src=src, group=_manager_group(manager), device=_object_device()
        )
    except RuntimeError as exc:
        _explain_collective_failure(exc, "broadcast_object")
        raise
    return payload[0]  # type: ignore[return-value]


def all_agree(
    flag: bool | torch.Tensor, manager: Any = None, *, require: Literal["any", "all"] = "any"
) -> bool:
    """Combine a per-rank decision so that every rank takes the same one.

    With ``require="any"`` (default) the result is True when ``flag`` is true on
    at least one rank (stop early, skip a NaN batch, stop for preemption);
    with ``"all"`` only when it is true on every rank. ``flag`` may be a
    tensor (reduced with ``any()``). This is a synchronising collective:
    call it on every rank, at the same point.

    Example:
        >>> all_agree(True), all_agree(False, require="all")
        (True, False)
    """
    if require not in ("any", "all"):
        raise ValueError(f"all_agree: require must be 'any' or 'all'; got {require!r}.")
    if not _collectives_active():
        return bool(flag.any()) if isinstance(flag, torch.Tensor) else bool(flag)
    device = _reduce_device(manager)
    if isinstance(flag, torch.Tensor):
        vote = flag.detach().reshape(-1).any().reshape(1).to(device=device, dtype=torch.int32)
    else:
        vote = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    op = dist.ReduceOp.MAX if require == "any" else dist.ReduceOp.MIN
    try:
        dist.all_reduce(vote, op=op, group=_manager_group(manager))
    except RuntimeError as exc:
        _explain_collective_failure(exc, "all_agree")
        raise
    return bool(vote.item())


# --------------------------------------------------------------------------- internals
def _probe(manager: Any, names: Sequence[str]) -> Any:
    """First existing attribute among ``names``; zero-argument callables are called."""
    if manager is None:
        return _MISSING
    for name in names:
        try:
            value = getattr(manager, name)
        except AttributeError:
            continue
        if callable(value):
            try:
                value = value()
            except TypeError:
                continue
        return value
    return _MISSING


def _accepted_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {key: value for key, value in kwargs.items() if key in names}


def _manager_group(manager: Any) -> Any:
    group = getattr(manager, "process_group", None) if manager is not None else None
    return None if callable(group) else group


def _process_group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _collectives_active() -> bool:
    return _process_group_ready() and dist.get_world_size() > 1


def _reduce_device(manager: Any) -> torch.device:
    if "nccl" in str(dist.get_backend()):
        return distributed_device(manager, "cpu")
    return torch.device("cpu")


def _object_device() -> torch.device | None:
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return None


def explain_collective_failure(exc: BaseException, operation: str | None = None) -> bool:
    """Add a note naming the failed collective, the silent rank(s) and the timeout.

    Once per exception; returns whether ``exc`` is a failed collective (a timeout or a
    lost peer). The type is kept (callers may catch ``RuntimeError``). The silent ranks
    come from the heartbeats of the shared :class:`DistributedManager` (see
    :mod:`nvalchemi.distributed.stalls`); ``operation`` names the collective, else the
    training loop's note on the exception says where it was.
    """
    if getattr(exc, _EXPLAINED, False):
        return True
    if not is_collective_failure(exc):
        return False
    state = DistributedManager._state
    rank, world_size = state.rank, state.world_size
    if _process_group_ready():
        with contextlib.suppress(Exception):
            rank, world_size = dist.get_rank(), dist.get_world_size()
    note = collective_failure_note(
        exc,
        operation=operation,
        rank=rank,
        world_size=world_size,
        timeout_s=state.timeout_s,
        heartbeat=state.heartbeat,
        timeout_env=TIMEOUT_ENV,
    )
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, _EXPLAINED, True)
    return True


def _explain_collective_failure(exc: BaseException, operation: str) -> None:
    explain_collective_failure(exc, f"nvalchemi.distributed.{operation}()")


def _launch_env() -> LaunchEnv:
    # Rank helpers must never crash on a malformed launcher environment: they
    # report a single process, and DistributedManager.initialize() raises instead.
    try:
        return detect_launch_env()
    except ValueError:
        return LaunchEnv(0, 1, 0, "localhost", "12355", "single")
