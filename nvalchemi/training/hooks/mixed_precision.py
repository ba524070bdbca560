"""``MixedPrecisionHook``: bf16/fp16 autocast for training and validation, fp16 loss scaling.

Forces and stress (derivatives of the energy) and per-structure energy sums are
precision-sensitive: a 64-atom energy of -250 eV summed in bfloat16 resolves about
2 eV. Hence two scopes:

``autocast_scope="layers"`` (default)
    Only the matmuls of ``nn.Linear``, ``nn.Bilinear`` and convolution layers run in
    low precision, each layer's output cast back to float32; everything else
    (activations, sums, the autograd derivative, the loss) stays float32, so
    predictions match float32 training to a loose tolerance. Implemented with
    process-global module forward hooks that exist only between ``BEFORE_BATCH`` and
    ``DO_BACKWARD`` (and inside :meth:`~MixedPrecisionHook.inference_autocast`) and
    act only in the training thread; functional matmuls stay float32.
``autocast_scope="region"``
    The reference behaviour: one ``torch.autocast`` region over ``BEFORE_BATCH``, the
    forward and the loss. Fastest for large models, but the model must sum energies
    in float32 itself (or the loss use ``dtype_policy="prediction_to_target"``).

For ``float16`` a ``torch.amp.GradScaler`` scales the loss at ``DO_BACKWARD`` and
unscales the gradients at ``DO_OPTIMIZER_STEP`` (before clipping); the orchestrator
steps through the scaler, which skips overflowed steps. The scaler's state is
checkpointed and survives the end of a strategy context.

Example:
    >>> hook = MixedPrecisionHook(precision="bf16")
    >>> hook.precision, hook.precision_name
    (torch.bfloat16, 'bfloat16')
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, PrivateAttr, field_serializer, field_validator
from torch import nn
from torch.nn.modules import module as _module_hooks

from nvalchemi.training.hooks.update import TrainingUpdateHook
from nvalchemi.training.stages import TrainingStage

__all__ = ["MixedPrecisionHook"]

_BEFORE_BATCH = TrainingStage.BEFORE_BATCH
_DO_BACKWARD = TrainingStage.DO_BACKWARD
_DO_OPTIMIZER_STEP = TrainingStage.DO_OPTIMIZER_STEP
_AFTER_OPTIMIZER_STEP = TrainingStage.AFTER_OPTIMIZER_STEP

_PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_ALLOWED_MSG = (
    "MixedPrecisionHook.precision must be one of (float32, bfloat16, float16) "
    "(also accepted: torch dtypes, 'torch.'-prefixed names and the aliases fp32, bf16, fp16)"
)
# Layers whose forward is dominated by a matmul: the only ones autocast in "layers" scope.
_MATMUL_LAYERS = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)


def _parse_precision(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value in _PRECISIONS.values():
            return value
    elif isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        name = _ALIASES.get(name, name)
        if name in _PRECISIONS:
            return _PRECISIONS[name]
    raise ValueError(f"{_ALLOWED_MSG}; got {value!r}.")


class _LayerAutocast:
    """Autocast around each matmul layer's forward (entering thread only), output cast back."""

    __slots__ = ("_autocast", "_depth", "_handles", "_input_dtype", "_thread", "dtype")

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._autocast = torch.autocast(device_type, dtype=dtype)
        self._handles: list[Any] = []
        self._depth = 0
        self._input_dtype: torch.dtype | None = None
        self._thread = 0

    def __enter__(self) -> _LayerAutocast:
        if not self._handles:
            self._thread = threading.get_ident()
            self._depth = 0
            self._handles = [
                _module_hooks.register_module_forward_pre_hook(self._pre),
                _module_hooks.register_module_forward_hook(self._post, always_call=True),
            ]
        return self

    def __exit__(self, *exc: Any) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        if self._depth > 0:  # a layer raised before its post hook could run
            self._depth = 0
            self._autocast.__exit__(None, None, None)

    def _pre(self, module: nn.Module, args: Any) -> None:
        if not isinstance(module, _MATMUL_LAYERS) or threading.get_ident() != self._thread:
            return
        if self._depth == 0:
            self._input_dtype = _first_float_dtype(args)
            self._autocast.__enter__()
        self._depth += 1

    def _post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if (
            self._depth == 0
            or not isinstance(module, _MATMUL_LAYERS)
            or threading.get_ident() != self._thread
        ):
            return None
        self._depth -= 1
        if self._depth:
            return None
        self._autocast.__exit__(None, None, None)
        target = self._input_dtype
        if target is None or target == self.dtype:
            return None
        return _cast_floating(output, self.dtype, target)


def _first_float_dtype(args: Any) -> torch.dtype | None:
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            return arg.dtype
    return None


def _cast_floating(output: Any, low: torch.dtype, target: torch.dtype) -> Any:
    if isinstance(output, torch.Tensor):
        return output.to(target) if output.dtype == low else output
    if isinstance(output, tuple):
        return tuple(_cast_floating(o, low, target) for o in output)
    return output


@dataclass(slots=True)
class _Runtime:
    region: Any = None
    scaler: torch.amp.GradScaler | None = None
    pending_scaler_state: dict[str, Any] | None = None
    unscaled: bool = False


class MixedPrecisionHook(BaseModel, TrainingUpdateHook):
    """Train (and optionally validate) under bf16/fp16 autocast; fp16 adds loss scaling.

    Args:
        precision: ``torch.float32`` (no-op), ``torch.bfloat16`` or ``torch.float16``;
            also the names ``"float32"``/``"bfloat16"``/``"float16"`` (optionally
            ``"torch."``-prefixed, any case) and the aliases ``"fp32"``/``"bf16"``/``"fp16"``.
        autocast_scope: ``"layers"`` (default; only matmul layers in low precision, see
            the module docstring) or ``"region"`` (one autocast region over forward+loss).

    Priority 20 (after gradient accumulation, before clipping); at most one per strategy.
    Validation reuses it through :meth:`inference_autocast`
    (``ValidationConfig(use_mixed_precision="auto"|"always")``).

    Example:
        >>> from nvalchemi.training.hooks import EMAHook
        >>> hooks = [MixedPrecisionHook("bf16"), EMAHook(decay=0.999)]  # doctest: +SKIP
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")
    priority: ClassVar[int] = 20
    _exclusive_update_key: ClassVar[str | None] = "MixedPrecisionHook"

    precision: torch.dtype
    autocast_scope: Literal["layers", "region"] = "layers"

    _rt: _Runtime = PrivateAttr(default_factory=_Runtime)

    @property
    def _runtime(self) -> _Runtime:
        # Direct slot access: pydantic's __getattr__ for private attributes costs ~3 us.
        return self.__pydantic_private__["_rt"]

    def __init__(self, precision: Any = None, **data: Any) -> None:
        if precision is not None:
            data["precision"] = precision
        super().__init__(**data)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision(cls, value: Any) -> torch.dtype:
        return _parse_precision(value)

    @field_serializer("precision")
    def _dump_precision(self, value: torch.dtype) -> str:
        return str(value).removeprefix("torch.")  # JSON-ready; parsed back by the validator

    @property
    def precision_name(self) -> str:
        """``"float32"``, ``"bfloat16"`` or ``"float16"`` (the validation summary's label)."""
        return str(self.precision).removeprefix("torch.")

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 ``GradScaler`` (``None`` before the first fp16 batch or for bf16/fp32)."""
        return self._runtime.scaler

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool = False) -> tuple[bool, Any]:
        precision = self.precision
        if precision is torch.float32:
            return True, ctx.loss
        rt = self._runtime
        if stage is _BEFORE_BATCH:
            device_type = _device_type(ctx)
            if precision is torch.float16:
                ctx.grad_scaler = self._ensure_scaler(device_type)
            self._close_region()  # left open by a batch that raised mid-forward
            region = self.inference_autocast(device_type)
            region.__enter__()
            rt.region = region
        elif stage is _DO_BACKWARD:
            self._close_region()
            if precision is torch.float16:
                scaler = ctx.grad_scaler = self._ensure_scaler(_device_type(ctx))
                return True, scaler.scale(ctx.loss)
        elif stage is _DO_OPTIMIZER_STEP:
            if precision is torch.float16:
                scaler = ctx.grad_scaler = self._ensure_scaler(_device_type(ctx))
                if not will_skip:
                    # All unscales before any step, so clipping (priority 30) sees true grads.
                    for optimizer in ctx.optimizers:
                        scaler.unscale_(optimizer)
                    rt.unscaled = True
        elif stage is _AFTER_OPTIMIZER_STEP:
            self._close_region()
            if rt.unscaled:
                rt.unscaled = False
                scaler = rt.scaler
                # A later hook vetoed the step after we unscaled: update() clears the
                # scaler's per-optimizer record (else the next unscale_ raises) and
                # applies the usual backoff/growth bookkeeping.
                if scaler is not None and getattr(scaler, "_per_optimizer_states", None):
                    scaler.update()
        return True, ctx.loss

    def inference_autocast(self, device: torch.device | str) -> Any:
        """A fresh context manager with the training precision on ``device`` (never the scaler)."""
        device_type = torch.device(device).type
        if self.precision is torch.float32:
            return contextlib.nullcontext()
        if self.autocast_scope == "region":
            return torch.amp.autocast(device_type, dtype=self.precision, enabled=True)
        return _LayerAutocast(device_type, self.precision)

    def _close_region(self) -> None:
        rt = self._runtime
        region, rt.region = rt.region, None
        if region is not None:
            region.__exit__(None, None, None)

    def _ensure_scaler(self, device_type: str) -> torch.amp.GradScaler:
        rt = self._runtime
        scaler = rt.scaler
        if scaler is not None and getattr(scaler, "_device", device_type) == device_type:
            return scaler
        state = rt.pending_scaler_state
        if scaler is not None:  # the run moved to another device type: carry the scale over
            state = scaler.state_dict()
        scaler = torch.amp.GradScaler(device=device_type, enabled=True)
        if state:
            scaler.load_state_dict(state)
        rt.scaler, rt.pending_scaler_state = scaler, None
        return scaler

    def __enter__(self) -> MixedPrecisionHook:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Leave any open autocast region; the ``GradScaler`` (and its scale) is kept."""
        self._close_region()
        self._runtime.unscaled = False

    def close(self) -> None:
        """Same as ``__exit__``."""
        self.__exit__(None, None, None)

    def state_dict(self) -> dict[str, Any]:
        """``{"precision", "autocast_scope", "grad_scaler"}`` (``None`` until fp16 scaling ran)."""
        rt = self._runtime
        scaler_state = rt.scaler.state_dict() if rt.scaler is not None else rt.pending_scaler_state
        return {
            "precision": self.precision_name,
            "autocast_scope": self.autocast_scope,
            "grad_scaler": dict(scaler_state) if scaler_state else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the ``GradScaler`` state (now, or when the scaler is created); a checkpoint of
        another precision is accepted, its scaler state dropped with a ``UserWarning``.
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"MixedPrecisionHook.load_state_dict expects a mapping; got {type(state).__name__}."
            )
        saved = state.get("grad_scaler")
        saved_precision = state.get("precision")
        if saved_precision is not None and _parse_precision(saved_precision) != self.precision:
            if saved:
                warnings.warn(
                    f"MixedPrecisionHook: checkpoint precision {saved_precision!r} differs from "
                    f"{self.precision_name!r}; its GradScaler state is not restored.",
                    UserWarning,
                    stacklevel=2,
                )
            return
        if not saved:
            return
        if not isinstance(saved, Mapping):
            raise ValueError(
                "MixedPrecisionHook state 'grad_scaler' must be a GradScaler.state_dict() "
                f"mapping; got {type(saved).__name__}."
            )
        rt = self._runtime
        if rt.scaler is not None:
            rt.scaler.load_state_dict(dict(saved))
        else:
            rt.pending_scaler_state = dict(saved)

    def __repr_args__(self) -> Iterator[tuple[str, Any]]:
        yield "precision", self.precision_name
        yield "autocast_scope", self.autocast_scope


def _device_type(ctx: Any) -> str:
    devices = getattr(ctx.workflow, "devices", None)
    if devices:
        return torch.device(devices[0]).type
    model = ctx.model
    if isinstance(model, nn.Module):
        for param in model.parameters():
            return param.device.type
    return "cpu"
