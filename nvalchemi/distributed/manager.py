"""``DistributedManager``: one shared view of this process's rank, device and process group.

Built on plain ``torch.distributed``. All instances share one state, so any
part of the program can call ``DistributedManager()`` and see the same rank,
device and process group.

Typical use (the same script runs as one process, under ``torchrun`` or under ``srun``)::

    from nvalchemi.distributed import DistributedManager

    DistributedManager.initialize()  # reads torchrun/Slurm variables; single process otherwise
    manager = DistributedManager()
    model = model.to(manager.device)
    ...
    DistributedManager.cleanup()

A rank that dies or stalls must not make the others wait forever: collectives
fail after ``timeout_s`` seconds (argument, else the ``NVALCHEMI_DIST_TIMEOUT_S``
environment variable, else :data:`~nvalchemi.distributed.stalls.DEFAULT_TIMEOUT_S`,
10 minutes), and every rank posts a heartbeat to the rendezvous store so that the
error names the rank that went silent (see :mod:`nvalchemi.distributed.stalls`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from nvalchemi.distributed.launch import DEFAULT_ADDR, DEFAULT_PORT, detect_launch_env
from nvalchemi.distributed.stalls import DEFAULT_TIMEOUT_S, Heartbeat, heartbeat_interval

__all__ = ["DistributedManager"]

TIMEOUT_ENV = "NVALCHEMI_DIST_TIMEOUT_S"


@dataclass
class _State:
    initialized: bool = False
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device | None = None
    backend: str | None = None
    distributed: bool = False
    owns_process_group: bool = False
    source: str = "single"
    broadcast_buffers: bool = False
    find_unused_parameters: bool = False
    groups: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    heartbeat: Heartbeat | None = None


class DistributedManager:
    """Rank, world size, device and process groups of this process (shared state).

    Instantiating before :meth:`initialize` is allowed and reports a single
    process (rank 0 of 1); if ``torch.distributed`` was already initialised by
    someone else, the manager adopts that process group (and never destroys it).

    Example:
        >>> from nvalchemi.distributed import DistributedManager
        >>> DistributedManager.initialize()  # no launcher variables: one process
        >>> manager = DistributedManager()
        >>> manager.rank, manager.world_size, manager.distributed
        (0, 1, False)
        >>> DistributedManager.cleanup()
    """

    _state: ClassVar[_State] = _State()
    _atexit_registered: ClassVar[bool] = False
    _generation: ClassVar[int] = 0  # process groups this process has created so far

    def __init__(self) -> None:
        if not self._state.initialized and _process_group_ready():
            type(self)._adopt_process_group()

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def initialize(
        cls,
        backend: str | None = None,
        timeout_s: float | None = None,
        method: str | None = None,
    ) -> None:
        """Set up this process from the launcher's environment (idempotent).

        Reads torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
        ``MASTER_PORT``, else Slurm's ``SLURM_PROCID``/``SLURM_NTASKS``/
        ``SLURM_LOCALID`` (see :mod:`nvalchemi.distributed.launch`), else runs as
        a single process. A process group is created only when the world size
        is larger than one. ``method`` (or ``NVALCHEMI_DIST_METHOD``) forces
        ``"torchrun"``, ``"slurm"`` or ``"single"``.
        """
        if cls._state.initialized:
            return
        if _process_group_ready():
            cls._adopt_process_group()
            return
        launch = detect_launch_env(method=method)
        cls._configure(
            rank=launch.rank,
            world_size=launch.world_size,
            local_rank=launch.local_rank,
            addr=launch.master_addr,
            port=launch.master_port,
            backend=backend,
            timeout_s=timeout_s,
            source=launch.source,
        )

    @classmethod
    def setup(
        cls,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int | None = None,
        addr: str = DEFAULT_ADDR,
        port: str | int = DEFAULT_PORT,
        backend: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Set up this process with explicit rank and rendezvous address.

        Exports ``MASTER_ADDR``/``MASTER_PORT`` and, when ``world_size > 1``,
        creates the default process group (``nccl`` on CUDA, ``gloo`` on CPU
        unless ``backend`` says otherwise). ``local_rank`` defaults to
        ``rank % torch.cuda.device_count()`` with CUDA and to ``rank`` without.

        Example (two processes on one machine, run once in each)::

            DistributedManager.setup(rank=rank, world_size=2, port=29511, timeout_s=60)
        """
        for name, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"DistributedManager.setup: {name} must be an int; got {value!r}.")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"DistributedManager.setup: need world_size >= 1 and 0 <= rank < world_size; "
                f"got rank={rank}, world_size={world_size}."
            )
        if cls._state.initialized:
            state = cls._state
            if (state.rank, state.world_size) == (rank, world_size):
                return
            raise RuntimeError(
                f"DistributedManager is already set up as rank {state.rank} of "
                f"{state.world_size}; call DistributedManager.cleanup() before setting up "
                f"rank {rank} of {world_size}."
            )
        cls._configure(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            addr=addr,
            port=str(port),
            backend=backend,
            timeout_s=timeout_s,
            source="setup",
        )

    @classmethod
    def is_initialized(cls) -> bool:
        """Whether :meth:`initialize` or :meth:`setup` has run (also for one process)."""
        return cls._state.initialized

    @classmethod
    def cleanup(cls, barrier: bool = True) -> None:
        """Destroy the process group this manager created and reset the shared state.

        By default every rank first waits for the others (best effort: a failed
        barrier, e.g. after a peer died, does not stop the teardown). Without that
        barrier a rank that tears down while its peer is still finishing a collective
        can abort at exit ("terminate called without an active exception") under
        gloo. A process group that was adopted (created outside the manager) is left
        alone.
        """
        state = cls._state
        if state.heartbeat is not None:
            state.heartbeat.stop()
        if state.owns_process_group and _process_group_ready():
            if barrier:
                _best_effort_barrier()
            dist.destroy_process_group()
        DistributedManager._state = _State()

    @staticmethod
    def get_available_backend() -> str:
        """``"nccl"`` when CUDA and NCCL are available, else ``"gloo"``."""
        if torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available():
            return "nccl"
        return "gloo"

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self._state.rank

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return self._state.world_size

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node (selects the GPU)."""
        return self._state.local_rank

    @property
    def device(self) -> torch.device:
        """``cuda:<local_rank>`` when CUDA is available, else ``cpu``."""
        state = self._state
        if state.device is not None:
            return state.device
        return _default_device(state.local_rank)

    @property
    def cuda(self) -> bool:
        """Whether :attr:`device` is a CUDA device."""
        return self.device.type == "cuda"

    @property
    def distributed(self) -> bool:
        """Whether a process group with more than one process is in use."""
        return self._state.distributed

    @property
    def backend(self) -> str | None:
        """Backend of the process group (``None`` for a single process)."""
        return self._state.backend

    @property
    def broadcast_buffers(self) -> bool:
        """Default ``broadcast_buffers`` for ``DistributedDataParallel`` (settable)."""
        return self._state.broadcast_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self._state.broadcast_buffers = bool(value)

    @property
    def find_unused_parameters(self) -> bool:
        """Default ``find_unused_parameters`` for ``DistributedDataParallel`` (settable)."""
        return self._state.find_unused_parameters

    @find_unused_parameters.setter
    def find_unused_parameters(self, value: bool) -> None:
        self._state.find_unused_parameters = bool(value)

    @property
    def process_group(self) -> Any:
        """The default process group, or ``None`` when not distributed."""
        return self.group()

    @property
    def group_names(self) -> list[str]:
        """Names of the groups made with :meth:`create_group`."""
        return list(self._state.groups)

    def group(self, name: str | None = None) -> Any:
        """Return the process group called ``name`` (``None``: the default group).

        The default group is ``None`` when this process is not distributed.
        """
        if name is None:
            return dist.group.WORLD if self._state.distributed else None
        try:
            return self._state.groups[name]
        except KeyError:
            raise KeyError(
                f"No process group named {name!r}; known groups: {self.group_names}. "
                "Create it with DistributedManager().create_group(name, ranks)."
            ) from None

    def create_group(self, name: str, ranks: list[int] | None = None) -> Any:
        """Create a named subgroup of ``ranks`` (all ranks by default).

        Like ``torch.distributed.new_group``, every rank must call this with
        the same arguments, including ranks that are not members.
        """
        if not self._state.distributed:
            raise RuntimeError(
                "create_group needs an initialised multi-process run; call "
                "DistributedManager.initialize() under torchrun or srun first."
            )
        if name in self._state.groups:
            raise ValueError(f"A process group named {name!r} already exists.")
        group = dist.new_group(ranks=ranks)
        self._state.groups[name] = group
        return group

    def __repr__(self) -> str:
        return (
            f"DistributedManager(rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank}, device={self.device}, "
            f"distributed={self.distributed}, backend={self.backend})"
        )

    # ------------------------------------------------------------------ internals
    @classmethod
    def _configure(
        cls,
        *,
        rank: int,
        world_size: int,
        local_rank: int | None,
        addr: str,
        port: str,
        backend: str | None,
        timeout_s: float | None,
        source: str,
    ) -> None:
        if local_rank is None:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            local_rank = rank % count if count else rank
        device = _default_device(local_rank)
        if device.type == "cuda" and local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"Local rank {local_rank} has no GPU: only {torch.cuda.device_count()} are "
                "visible. Launch at most one process per GPU, or pass backend='gloo' with "
                "CUDA_VISIBLE_DEVICES='' to run on CPU."
            )
        backend = _resolve_backend(backend, device)
        timeout = _resolve_timeout(timeout_s)
        state = _State(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            device=device,
            source=source,
            timeout_s=timeout.total_seconds(),
        )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world_size > 1:
            os.environ["MASTER_ADDR"] = addr
            os.environ["MASTER_PORT"] = str(port)
            store = _rendezvous_store(rank, world_size, timeout, cls._generation)
            kwargs: dict[str, Any] = {
                "backend": backend,
                "store": store,
                "rank": rank,
                "world_size": world_size,
                "timeout": timeout,
            }
            if device.type == "cuda" and "nccl" in backend:
                # Binding the communicator to the GPU is only meaningful (and only
                # safe: torch 2.13 rejects a CPU device_id) for CUDA devices.
                kwargs["device_id"] = device
            dist.init_process_group(**kwargs)
            DistributedManager._generation += 1
            state.backend = dist.get_backend()
            state.distributed = True
            state.owns_process_group = True
            interval = heartbeat_interval(state.timeout_s)
            state.heartbeat = Heartbeat(store.clone(), rank, world_size, interval).start()
        state.initialized = True
        DistributedManager._state = state
        cls._register_atexit()

    @classmethod
    def _adopt_process_group(cls) -> None:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        try:
            local_rank = detect_launch_env().local_rank
        except ValueError:  # the group exists already; a stray variable must not break us
            local_rank = None
        if local_rank is None:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            local_rank = rank % count if count else rank
        backend = dist.get_backend()
        device = _default_device(local_rank) if "nccl" in backend else torch.device("cpu")
        DistributedManager._state = _State(
            initialized=True,
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            device=device,
            backend=backend,
            distributed=world_size > 1,
            owns_process_group=False,
            source="adopted",
        )

    @classmethod
    def _register_atexit(cls) -> None:
        if not cls._atexit_registered:
            atexit.register(_cleanup_at_exit)
            DistributedManager._atexit_registered = True


def _cleanup_at_exit() -> None:
    # The interpreter is exiting; a broken group must not mask the real error.
    with contextlib.suppress(Exception):
        DistributedManager.cleanup()


def _process_group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rendezvous_store(
    rank: int, world_size: int, timeout: datetime.timedelta, generation: int
) -> Any:
    """The ``env://`` store (torchrun's agent store, or one hosted by rank 0), keyed by generation.

    Made here rather than inside ``init_process_group`` so the manager holds it: the
    heartbeats go through a clone of it. Re-initialising after ``cleanup`` reuses the
    (multi-tenant) store of the previous group, whose keys (the peers' old addresses)
    must not be read again: every group lives under the keys of its generation, and
    every rank creates its groups in the same order, so the generations agree.
    """
    from torch.distributed import PrefixStore, rendezvous

    store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return PrefixStore(f"nvalchemi_generation_{generation}", store)


def _default_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _resolve_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"backend must be a string such as 'gloo' or 'nccl'; got {backend!r}.")
    if "nccl" in backend and device.type != "cuda" and "gloo" not in backend:
        raise ValueError(
            f"backend={backend!r} needs CUDA, but this process runs on {device}; "
            "use backend='gloo' (or None to pick automatically)."
        )
    return backend


def _resolve_timeout(timeout_s: float | None) -> datetime.timedelta:
    """``timeout_s``, else ``NVALCHEMI_DIST_TIMEOUT_S``, else ``DEFAULT_TIMEOUT_S`` (10 minutes)."""
    source = "timeout_s"
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if not raw:
            return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
        source = TIMEOUT_ENV
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(
                f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; e.g. {TIMEOUT_ENV}=600."
            ) from None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"{source} must be a positive number of seconds; got {timeout_s!r}.")
    return datetime.timedelta(seconds=float(timeout_s))


def _best_effort_barrier() -> None:
    with contextlib.suppress(RuntimeError):  # a peer already left: tear down anyway
        dist.barrier()
