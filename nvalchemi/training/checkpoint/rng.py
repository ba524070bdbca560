"""Random-number-generator states in checkpoints (torch CPU/CUDA, numpy, Python ``random``).

States are stored as tensors and plain numbers so they load with
``torch.load(weights_only=True)``; each rank's state goes to its own file
(``rng/rank_<r>.pt``) and is restored on the rank that saved it.

Example:
    >>> import random
    >>> state = capture_rng()
    >>> a = random.random()
    >>> restore_rng(state)
    >>> random.random() == a
    True
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["capture_rng", "gather_rng", "preserved_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (CPU tensors and numbers)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    version, internal, gauss = random.getstate()
    state["python"] = {
        "version": int(version),
        "state": torch.tensor(internal, dtype=torch.int64),
        "gauss_next": gauss,
    }
    try:
        import numpy as np  # optional
    except ImportError:  # pragma: no cover - numpy is a torch dependency here
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore :func:`capture_rng` output (CUDA states only when the devices match)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([t.to("cpu", torch.uint8) for t in cuda])
        else:
            warnings.warn(
                f"The checkpoint holds CUDA RNG states for {len(cuda)} device(s) but "
                f"{torch.cuda.device_count()} are visible; CUDA RNG states were not restored.",
                UserWarning,
                stacklevel=3,
            )
    py = state.get("python")
    if py:
        internal = tuple(int(v) for v in py["state"].tolist())
        random.setstate((int(py["version"]), internal, py["gauss_next"]))
    np_state = state.get("numpy")
    if np_state:
        import numpy as np  # optional

        np.random.set_state(
            (
                np_state["kind"],
                np_state["keys"].numpy().astype(np.uint32),
                int(np_state["pos"]),
                int(np_state["has_gauss"]),
                float(np_state["cached_gaussian"]),
            )
        )


def gather_rng(manager: Any = None) -> list[dict[str, Any]]:
    """Every rank's :func:`capture_rng` (a collective under ``torch.distributed``)."""
    del manager  # the default group is used; rank files are indexed by global rank
    state = capture_rng()
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [state]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, state)
    return out


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Leave the RNG states as they were on entry (saving must not perturb training)."""
    state = capture_rng()
    try:
        yield
    finally:
        restore_rng(state)
