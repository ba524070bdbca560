"""Read rank, world size and rendezvous address from the launcher's environment.

Supported launchers, tried in this order when ``method`` is ``"auto"``:

``torchrun`` (or any ``env://`` launcher)
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
``slurm`` (``srun``)
    ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``/``SLURM_NPROCS``),
    ``SLURM_LOCALID``. The rendezvous host is ``MASTER_ADDR`` if exported, else
    ``SLURM_LAUNCH_NODE_IPADDR``, else the first host of ``SLURM_STEP_NODELIST``/
    ``SLURM_JOB_NODELIST``. The port is ``MASTER_PORT`` if exported, else derived
    from ``SLURM_JOB_ID`` so that two jobs sharing a node do not collide. If
    ``srun`` is started from outside the allocation (a login node), export
    ``MASTER_ADDR`` to the first compute node yourself.
``single``
    One process (rank 0 of 1).

Set ``NVALCHEMI_DIST_METHOD`` to ``torchrun``, ``slurm`` or ``single`` to force a
launcher, e.g. ``single`` to run one process inside a multi-task Slurm
allocation without ``srun``.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["LaunchEnv", "detect_launch_env", "expand_slurm_nodelist"]

METHOD_ENV = "NVALCHEMI_DIST_METHOD"
DEFAULT_ADDR = "localhost"
DEFAULT_PORT = "12355"
_SLURM_PORT_BASE = 15000  # below Linux's ephemeral range (32768+)
_SLURM_PORT_SPAN = 15000
_METHODS = ("auto", "torchrun", "env", "slurm", "single")

LaunchSource = Literal["torchrun", "slurm", "single"]


@dataclass(frozen=True, slots=True)
class LaunchEnv:
    """Where this process sits in a launch, as read from the environment.

    ``local_rank`` is ``None`` when the launcher did not say (the caller picks
    a default from the devices it has).
    """

    rank: int
    world_size: int
    local_rank: int | None
    master_addr: str
    master_port: str
    source: LaunchSource


def detect_launch_env(
    environ: Mapping[str, str] | None = None, method: str | None = None
) -> LaunchEnv:
    """Return the launch described by ``environ`` (default ``os.environ``).

    Example:
        >>> env = detect_launch_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "2950"})
        >>> env.rank, env.world_size, env.master_addr, env.master_port, env.source
        (1, 2, 'localhost', '2950', 'torchrun')
    """
    env = os.environ if environ is None else environ
    method = (method or env.get(METHOD_ENV) or "auto").strip().lower()
    if method not in _METHODS:
        raise ValueError(
            f"Unknown distributed launch method {method!r} (from the argument or "
            f"{METHOD_ENV}); use one of {', '.join(_METHODS)}."
        )
    has_torchrun = "RANK" in env and "WORLD_SIZE" in env
    has_slurm = "SLURM_PROCID" in env and _slurm_tasks_var(env) is not None
    if method in ("torchrun", "env") or (method == "auto" and has_torchrun):
        if not has_torchrun:
            raise ValueError(
                f"{METHOD_ENV}={method!r} needs RANK and WORLD_SIZE in the environment; "
                "launch with torchrun or set them."
            )
        return _validated(_from_torchrun(env))
    if method == "slurm" or (method == "auto" and has_slurm):
        if not has_slurm:
            raise ValueError(
                f"{METHOD_ENV}='slurm' needs SLURM_PROCID and SLURM_NTASKS in the "
                "environment; launch the script with srun."
            )
        return _validated(_from_slurm(env, _slurm_tasks_var(env) or "SLURM_NTASKS"))
    return LaunchEnv(0, 1, 0, DEFAULT_ADDR, DEFAULT_PORT, "single")


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a compressed Slurm host list into host names, in order.

    Handles comma-separated items, bracketed ranges with zero padding and
    several bracket groups per item.

    Example:
        >>> expand_slurm_nodelist("node[01-03,07],login")
        ['node01', 'node02', 'node03', 'node07', 'login']
        >>> expand_slurm_nodelist("r[1-2]n[3-4]")
        ['r1n3', 'r1n4', 'r2n3', 'r2n4']
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        pieces = re.split(r"(\[[^\[\]]*\])", item)
        choices: list[list[str]] = []
        for piece in pieces:
            if piece.startswith("["):
                choices.append(_expand_ranges(piece[1:-1], nodelist))
            elif "[" in piece or "]" in piece:
                raise ValueError(f"Unbalanced brackets in Slurm node list {nodelist!r}.")
            elif piece:
                choices.append([piece])
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    local = env.get("LOCAL_RANK")
    return LaunchEnv(
        rank=_int_var(env, "RANK"),
        world_size=_int_var(env, "WORLD_SIZE"),
        local_rank=None if local is None else _int_var(env, "LOCAL_RANK"),
        master_addr=env.get("MASTER_ADDR") or DEFAULT_ADDR,
        master_port=env.get("MASTER_PORT") or DEFAULT_PORT,
        source="torchrun",
    )


def _from_slurm(env: Mapping[str, str], tasks_var: str) -> LaunchEnv:
    local = env.get("SLURM_LOCALID")
    return LaunchEnv(
        rank=_int_var(env, "SLURM_PROCID"),
        world_size=_int_var(env, tasks_var),
        local_rank=None if local is None else _int_var(env, "SLURM_LOCALID"),
        master_addr=_slurm_master_addr(env),
        master_port=_slurm_master_port(env),
        source="slurm",
    )


def _slurm_tasks_var(env: Mapping[str, str]) -> str | None:
    # The step's task count is what srun launched; SLURM_NTASKS is the allocation's.
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
        if env.get(name):
            return name
    return None


def _slurm_master_addr(env: Mapping[str, str]) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if env.get("SLURM_LAUNCH_NODE_IPADDR"):
        return env["SLURM_LAUNCH_NODE_IPADDR"]
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            hosts = expand_slurm_nodelist(env[name])
            if hosts:
                return hosts[0]
    return DEFAULT_ADDR


def _slurm_master_port(env: Mapping[str, str]) -> str:
    if env.get("MASTER_PORT"):
        return env["MASTER_PORT"]
    job_id = env.get("SLURM_JOB_ID", "")
    if job_id.isdigit():
        return str(_SLURM_PORT_BASE + int(job_id) % _SLURM_PORT_SPAN)
    return DEFAULT_PORT


def _validated(launch: LaunchEnv) -> LaunchEnv:
    if launch.world_size < 1:
        raise ValueError(
            f"World size from the {launch.source} environment must be >= 1; "
            f"got {launch.world_size}."
        )
    if not 0 <= launch.rank < launch.world_size:
        raise ValueError(
            f"Rank {launch.rank} from the {launch.source} environment is outside "
            f"[0, {launch.world_size}); check the launcher's variables."
        )
    if launch.local_rank is not None and launch.local_rank < 0:
        raise ValueError(f"Local rank must be >= 0; got {launch.local_rank}.")
    return launch


def _int_var(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"Environment variable {name}={raw!r} is not an integer.") from None


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise ValueError(f"Unbalanced brackets in Slurm node list {nodelist!r}.")
    if depth:
        raise ValueError(f"Unbalanced brackets in Slurm node list {nodelist!r}.")
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_ranges(spec: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        low, sep, high = part.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"Cannot parse range {part!r} in Slurm node list {nodelist!r}.")
        if not sep:
            out.append(low)
            continue
        width = len(low)
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out
