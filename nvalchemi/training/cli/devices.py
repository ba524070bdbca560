"""Check that a device named by the user exists here, before anything is built on it.

Example:
    >>> check_device("cpu", field="--device", fix="use --device cpu")
    device(type='cpu')
"""

from __future__ import annotations

from typing import Any

from nvalchemi.training.cli._errors import CLIError

__all__ = ["check_device"]


def check_device(device: Any, *, field: str, fix: str) -> Any:
    """``torch.device(device)``, or a :class:`CLIError` naming ``field`` and ``fix``.

    Refuses names torch does not know, CUDA without a CUDA build or GPU, a CUDA index
    beyond the GPUs present, and MPS where it is not available.
    """
    import torch

    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise CLIError(f"{device!r} is not a device", field=field, fix=fix) from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise CLIError(
                f"{device!r} asks for CUDA, which is not available on this machine "
                f"({'no GPU found' if torch.backends.cuda.is_built() else 'torch is a CPU-only build'})",
                field=field,
                fix=fix,
            )
        if resolved.index is not None and resolved.index >= count:
            raise CLIError(
                f"{device!r} does not exist: this machine has {count} GPU(s) "
                f"(cuda:0 to cuda:{count - 1})",
                field=field,
                fix=fix,
            )
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise CLIError(f"{device!r}: MPS is not available here", field=field, fix=fix)
    return resolved
