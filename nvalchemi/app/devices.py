"""Choose the training device and check that a device named by the user exists here.

:func:`resolve_device` turns ``"auto"`` into ``"cuda"`` when a GPU is present, else
``"cpu"``; :func:`check_device` refuses a device this machine lacks before anything is
built on it (a :class:`~nvalchemi._errors.FieldError` naming the field and the fix).

Example:
    >>> check_device("cpu", field="--device", fix="use --device cpu")
    device(type='cpu')
    >>> resolve_device("cpu")
    'cpu'
"""

from __future__ import annotations

from typing import Any

from nvalchemi._errors import FieldError

__all__ = ["check_device", "resolve_device"]


def resolve_device(device: str = "auto") -> str:
    """``device``, with ``"auto"`` resolved to ``"cuda"`` when CUDA is available, else ``"cpu"``."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: Any, *, field: str, fix: str) -> Any:
    """``torch.device(device)``, or a :class:`FieldError` naming ``field`` and ``fix``.

    Refuses names torch does not know, CUDA without a CUDA build or GPU, a CUDA index
    beyond the GPUs present, and MPS where it is not available.
    """
    import torch

    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise FieldError(f"{device!r} is not a device", field=field, fix=fix) from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise FieldError(
                f"{device!r} asks for CUDA, which is not available on this machine "
                f"({'no GPU found' if torch.backends.cuda.is_built() else 'torch is a CPU-only build'})",
                field=field,
                fix=fix,
            )
        if resolved.index is not None and resolved.index >= count:
            raise FieldError(
                f"{device!r} does not exist: this machine has {count} GPU(s) "
                f"(cuda:0 to cuda:{count - 1})",
                field=field,
                fix=fix,
            )
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise FieldError(f"{device!r}: MPS is not available here", field=field, fix=fix)
    return resolved
