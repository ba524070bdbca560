"""Turn a hook context into named float scalars (the one place reporting syncs).

Everything a reporter shows or writes goes through :func:`collect_scalars`.
Tensor values are gathered first and converted to Python floats together, one
device transfer per device, so a reporting event costs one synchronisation no
matter how many loss components there are. Nothing else in reporting reads
tensor values, and reporters only run at their reporting cadence.

Key scheme (slash-separated):

* ``loss/total``; ``loss/<Component>/unweighted|weight|raw_weight|sample_mean``
  with the composed loss's component names (``loss/EnergyMSELoss/unweighted``);
  other ``ctx.losses`` entries as ``loss/<name>``.
* ``optimizer/lr`` (one optimizer with one group), ``optimizer/group_<g>/lr``,
  ``optimizer/<i>/lr``, ``optimizer/<i>/group_<g>/lr``; the same under
  ``scheduler/`` from ``get_last_lr()``.
* ``grad_norm`` (from ``ctx.grad_norm``), ``throughput/structures_per_s``,
  ``throughput/atoms_per_s``, ``memory/cuda_max_allocated_mib``,
  ``memory/rss_peak_mib``.
* ``training/steps_per_s|batches_per_s|target_steps|remaining_steps|
  progress_fraction|eta_s|target_epochs|epoch_fraction`` (progress).
* ``validation/loss/...`` and ``validation/<metric>`` at ``AFTER_VALIDATION``; error
  metrics carry their unit (``validation/forces_mae_eV_per_A``, see
  :mod:`nvalchemi.hooks.reporting.units`); on EMA weights also ``validation/ema/updates``
  and ``validation/ema/initial_share`` (the weight the averaged copy still gives the
  weights it started from: large while the EMA warms up).
* ``budget/remaining_s|seconds|planned_steps`` with a time budget; progress then counts
  towards the planned step and the ETA is the time left.
* ``<name>`` or ``<name>/...`` for custom scalars.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from nvalchemi.hooks.reporting._events import event_position, is_validation_stage, stage_name
from nvalchemi.hooks.reporting.state import ReporterMessage, ReportingState
from nvalchemi.hooks.reporting.units import metric_key

if TYPE_CHECKING:
    from nvalchemi.hooks.context import HookContext

__all__ = [
    "ScalarCallback",
    "ScalarSnapshot",
    "TrainingPlan",
    "collect_scalars",
    "extract_dynamics_scalars",
    "extract_loss_scalars",
    "extract_optimizer_lr_scalars",
    "extract_scalars",
    "extract_scheduler_lr_scalars",
    "extract_validation_scalars",
    "training_plan",
    "validate_custom_scalars",
]

ScalarCallback = Callable[["HookContext", Enum], object]
"""``callback(ctx, stage) -> number | 1-element tensor | mapping | None``."""

_COMPONENT_FIELDS = {
    "per_component_unweighted": "unweighted",
    "per_component_weight": "weight",
    "per_component_raw_weight": "raw_weight",
    "per_component_sample": "sample_mean",
}
# Validation-summary entries that describe the pass rather than measure the model.
_VALIDATION_METADATA = frozenset(
    {
        "name",
        "model_source",
        "ema_model_keys",
        "precision",
        "distributed_reduced",
        "per_component_sample_count",
    }
)


@dataclass(frozen=True, kw_only=True)
class ScalarSnapshot:
    """The scalars of one reporting event, with the counters they belong to.

    ``step_count``/``batch_count``/``epoch_step_count``/``epoch`` are the
    context's raw counters. ``step`` is the number of optimizer steps completed
    including the reported one (``step_count + 1`` at ``AFTER_OPTIMIZER_STEP``),
    the x axis every built-in reporter uses.

    Example:
        >>> snap = ScalarSnapshot(stage="AFTER_OPTIMIZER_STEP", scalars={"loss/total": 0.5},
        ...     timestamp_s=0.0, elapsed_s=1.0, event_count=1, step_count=0, batch_count=0,
        ...     epoch_step_count=0, epoch=0, step=1)
        >>> snap.as_dict()["scalars"]
        {'loss/total': 0.5}
    """

    stage: str
    scalars: dict[str, float]
    timestamp_s: float
    elapsed_s: float
    event_count: int
    step_count: int
    batch_count: int
    epoch_step_count: int
    epoch: int
    global_rank: int = 0
    messages: tuple[ReporterMessage, ...] = ()
    step: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats become ``None``)."""
        data = asdict(self)
        data["scalars"] = {k: (v if math.isfinite(v) else None) for k, v in self.scalars.items()}
        data["messages"] = [asdict(m) for m in self.messages]
        return data

    def with_scalars(self, scalars: Mapping[str, float]) -> ScalarSnapshot:
        """A copy with ``scalars`` replaced (used after a cross-rank reduction)."""
        return replace(self, scalars=dict(scalars))


# --------------------------------------------------------------------------- coercion
class _ScalarBuffer:
    """Collects named values; tensors are converted together in :meth:`resolve`."""

    def __init__(self) -> None:
        self.values: dict[str, float | torch.Tensor] = {}

    def add(self, key: str, value: Any) -> None:
        self.values[key] = _coerce(key, value)

    def add_mapping(self, mapping: Mapping[Any, Any], prefix: str | None) -> None:
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"Scalar mapping keys must be strings; got {key!r} "
                    f"({type(key).__name__}) under {prefix or '<root>'!r}."
                )
            name = key if not prefix else f"{prefix}/{key}"
            if isinstance(value, Mapping):
                self.add_mapping(value, name)
            elif value is not None:
                self.add(name, value)

    def resolve(self) -> dict[str, float]:
        pending: dict[torch.device, list[str]] = {}
        for key, value in self.values.items():
            if isinstance(value, torch.Tensor):
                pending.setdefault(value.device, []).append(key)
        resolved = dict(self.values)
        for device, keys in pending.items():
            dtype = torch.float32 if device.type == "mps" else torch.float64
            stacked = torch.stack([self.values[k].to(dtype) for k in keys])  # type: ignore[union-attr]
            for key, number in zip(keys, stacked.tolist()):  # the single sync per device
                resolved[key] = float(number)
        return resolved  # type: ignore[return-value]


def _coerce(key: str, value: Any) -> float | torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"Scalar {key!r} must be a number or a 1-element tensor; got a tensor of "
                f"shape {tuple(value.shape)}. Reduce it (e.g. .mean()) in the callback."
            )
        return value.detach().reshape(())
    if isinstance(value, numbers.Real):  # includes bool and numpy scalars
        return float(value)
    size = getattr(value, "size", None)
    if hasattr(value, "dtype") and size == 1 and hasattr(value, "item"):  # numpy 0-d/1-element
        return float(value.item())
    raise TypeError(
        f"Scalar {key!r} must be a real number or a 1-element tensor; got {type(value).__name__}."
    )


def extract_scalars(mapping: Mapping[str, Any], *, prefix: str | None = None) -> dict[str, float]:
    """Flatten a (nested) mapping of numbers/1-element tensors into ``{"a/b": float}``.

    ``None`` values are skipped; non-string keys raise ``TypeError``.

    Example:
        >>> extract_scalars({"mae": 0.5, "per": {"H": 1, "O": torch.tensor(2.0)}}, prefix="val")
        {'val/mae': 0.5, 'val/per/H': 1.0, 'val/per/O': 2.0}
    """
    buffer = _ScalarBuffer()
    buffer.add_mapping(mapping, prefix)
    return buffer.resolve()


# --------------------------------------------------------------------------- losses
def _sample_mean(value: Any) -> Any:
    """Mean over the structures that have the label (losses mark the others NaN)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return None
        dtype = torch.float32 if value.device.type == "mps" else torch.float64
        return value.detach().to(dtype).nanmean()
    if isinstance(value, numbers.Real):
        return value
    if isinstance(value, Iterable):
        items = [float(v) for v in value]
        items = [v for v in items if v == v]
        return sum(items) / len(items) if items else None
    return value


def _add_losses(buffer: _ScalarBuffer, loss: Any, losses: Any, prefix: str = "loss") -> None:
    if loss is not None:
        buffer.add(f"{prefix}/total", loss)
    if losses is None:
        return
    if not isinstance(losses, Mapping):
        raise TypeError(
            f"ctx.losses must be a mapping (a ComposedLossOutput); got {type(losses).__name__}."
        )
    for name, value in losses.items():
        if value is None:
            continue
        if name == "total_loss":
            buffer.add(f"{prefix}/total", value)
        elif name in _COMPONENT_FIELDS:
            suffix = _COMPONENT_FIELDS[name]
            if not isinstance(value, Mapping):
                raise TypeError(
                    f"losses[{name!r}] must map component names to values; got "
                    f"{type(value).__name__}."
                )
            for component, part in value.items():
                part = _sample_mean(part) if suffix == "sample_mean" else part
                if part is not None:
                    buffer.add(f"{prefix}/{component}/{suffix}", part)
        elif isinstance(value, Mapping):
            buffer.add_mapping(value, f"{prefix}/{name}")
        else:
            buffer.add(f"{prefix}/{name}", value)


def extract_loss_scalars(ctx: Any) -> dict[str, float]:
    """Loss scalars of ``ctx`` (``ctx.loss`` and the composed ``ctx.losses``).

    Example:
        >>> from types import SimpleNamespace
        >>> losses = {"total_loss": torch.tensor(0.3),
        ...           "per_component_unweighted": {"EnergyMSELoss": torch.tensor(0.2)},
        ...           "per_component_weight": {"EnergyMSELoss": 1.0}}
        >>> extract_loss_scalars(SimpleNamespace(loss=None, losses=losses))
        {'loss/total': 0.30000001192092896, 'loss/EnergyMSELoss/unweighted': 0.20000000298023224, 'loss/EnergyMSELoss/weight': 1.0}
    """
    buffer = _ScalarBuffer()
    _add_losses(buffer, getattr(ctx, "loss", None), getattr(ctx, "losses", None))
    return buffer.resolve()


def _add_validation(
    buffer: _ScalarBuffer, summary: Any, prefix: str = "validation", workflow: Any = None
) -> None:
    if not isinstance(summary, Mapping):
        return
    loss_entries = {k: v for k, v in summary.items() if k == "total_loss" or k in _COMPONENT_FIELDS}
    _add_losses(buffer, None, loss_entries, prefix=f"{prefix}/loss")
    for key, value in summary.items():
        if key in loss_entries or key in _VALIDATION_METADATA or not isinstance(key, str):
            continue
        _add_if_scalar(buffer, f"{prefix}/{metric_key(key)}", value)
    if summary.get("model_source") in ("ema", "mixed"):
        ema = _ema_hook(workflow)
        if ema is not None:
            updates = int(ema.num_updates)
            buffer.add(f"{prefix}/ema/updates", updates)
            buffer.add(f"{prefix}/ema/initial_share", float(ema.decay) ** max(updates - 1, 0))


def _ema_hook(workflow: Any) -> Any:
    """The EMA hook of ``workflow`` (one with ``decay`` and ``num_updates``), if any."""
    for hook in list(getattr(workflow, "hooks", None) or ()):
        children = getattr(hook, "iter_hooks", None)
        for candidate in (hook, *(children() if callable(children) else ())):
            if isinstance(getattr(candidate, "num_updates", None), int) and isinstance(
                getattr(candidate, "decay", None), float
            ):
                return candidate
    return None


def _add_if_scalar(buffer: _ScalarBuffer, key: str, value: Any) -> None:
    """Add numbers and 1-element tensors; flatten mappings; skip everything else."""
    if isinstance(value, Mapping):
        for sub, item in value.items():
            if isinstance(sub, str):
                _add_if_scalar(buffer, f"{key}/{sub}", item)
    elif isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.is_complex():
            buffer.add(key, value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        buffer.add(key, value)


def extract_validation_scalars(
    summary: Mapping[str, Any] | None, *, prefix: str = "validation"
) -> dict[str, float]:
    """Scalars of a validation summary: ``validation/loss/...`` and ``validation/<metric>``.

    Entries that are not numbers (names, flags, lists, per-sample tensors) are
    skipped, so any summary can be passed.

    Example:
        >>> extract_validation_scalars({"name": "val", "total_loss": 0.5, "forces_mae": 0.1})
        {'validation/loss/total': 0.5, 'validation/forces_mae': 0.1}
    """
    buffer = _ScalarBuffer()
    _add_validation(buffer, summary, prefix)
    return buffer.resolve()


# --------------------------------------------------------------------------- learning rates
def _lr_key(prefix: str, index: int | None, group: int | None) -> str:
    parts = [prefix]
    if index is not None:
        parts.append(str(index))
    if group is not None:
        parts.append(f"group_{group}")
    parts.append("lr")
    return "/".join(parts)


def _add_optimizer_lrs(buffer: _ScalarBuffer, optimizers: Any) -> None:
    optimizers = list(optimizers or ())
    many = len(optimizers) > 1
    for index, optimizer in enumerate(optimizers):
        groups = list(getattr(optimizer, "param_groups", None) or ())
        for g, group in enumerate(groups):
            lr = group.get("lr") if isinstance(group, Mapping) else None
            if lr is not None:
                key = _lr_key("optimizer", index if many else None, g if len(groups) > 1 else None)
                buffer.add(key, lr)


def _add_scheduler_lrs(buffer: _ScalarBuffer, schedulers: Any, optimizers: Any) -> None:
    schedulers = list(schedulers or ())
    many = max(len(schedulers), len(list(optimizers or ()))) > 1
    for index, scheduler in enumerate(schedulers):
        get_last_lr = getattr(scheduler, "get_last_lr", None)
        if scheduler is None or not callable(get_last_lr):
            continue
        try:
            lrs = list(get_last_lr())
        except (AttributeError, RuntimeError):  # not stepped yet on some schedulers
            continue
        for g, lr in enumerate(lrs):
            key = _lr_key("scheduler", index if many else None, g if len(lrs) > 1 else None)
            buffer.add(key, lr)


def extract_optimizer_lr_scalars(ctx: Any) -> dict[str, float]:
    """Learning rates from ``ctx.optimizers`` (``param_groups``) and ``ctx.lr_schedulers``.

    Example:
        >>> from types import SimpleNamespace
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> extract_optimizer_lr_scalars(SimpleNamespace(optimizers=[opt], lr_schedulers=[None]))
        {'optimizer/lr': 0.1}
    """
    buffer = _ScalarBuffer()
    optimizers = getattr(ctx, "optimizers", None)
    _add_optimizer_lrs(buffer, optimizers)
    _add_scheduler_lrs(buffer, getattr(ctx, "lr_schedulers", None), optimizers)
    return buffer.resolve()


def extract_scheduler_lr_scalars(ctx: Any) -> dict[str, float]:
    """Only the ``scheduler/...`` learning rates of ``ctx``."""
    buffer = _ScalarBuffer()
    _add_scheduler_lrs(
        buffer, getattr(ctx, "lr_schedulers", None), getattr(ctx, "optimizers", None)
    )
    return buffer.resolve()


# --------------------------------------------------------------------------- dynamics
def _add_dynamics(buffer: _ScalarBuffer, ctx: Any) -> None:
    batch = getattr(ctx, "batch", None)
    energy = getattr(batch, "energy", None) if batch is not None else None
    if isinstance(energy, torch.Tensor) and energy.numel() > 0:
        buffer.add("energy", energy.detach().to(torch.float64).mean())
    forces = getattr(batch, "forces", None) if batch is not None else None
    if isinstance(forces, torch.Tensor) and forces.ndim == 2 and forces.shape[0] > 0:
        buffer.add("fmax", torch.linalg.vector_norm(forces.detach(), dim=-1).max())
    num_graphs = getattr(batch, "num_graphs", None) if batch is not None else None
    if isinstance(num_graphs, int):
        buffer.add("dynamics/num_graphs", num_graphs)
    mask = getattr(ctx, "converged_mask", None)
    if isinstance(mask, torch.Tensor) and mask.numel() > 0:
        converged = mask.detach().reshape(-1).to(torch.float64)
        buffer.add("dynamics/converged_count", converged.sum())
        buffer.add("converged_fraction", converged.mean())


def extract_dynamics_scalars(ctx: Any) -> dict[str, float]:
    """``energy`` (mean), ``fmax``, ``dynamics/num_graphs``, convergence counts of a dynamics ctx."""
    buffer = _ScalarBuffer()
    _add_dynamics(buffer, ctx)
    return buffer.resolve()


# --------------------------------------------------------------------------- progress
@dataclass(frozen=True)
class TrainingPlan:
    """What the engine says about the run's length (each ``None`` when unknown)."""

    target_steps: int | None = None
    target_epochs: int | None = None
    batches_per_epoch: int | None = None


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def training_plan(workflow: Any) -> TrainingPlan:
    """Target steps/epochs and batches per epoch of a training engine, when it knows them.

    Batches per epoch come from ``len(workflow.active_dataloader)`` (unsized
    loaders give ``None``); target steps from ``num_steps``, else
    ``ceil(num_epochs * batches_per_epoch * epoch_step_modifier)``.
    """
    if workflow is None:
        return TrainingPlan()
    loader = getattr(workflow, "active_dataloader", None)
    batches_per_epoch = None
    if loader is not None:
        try:
            batches_per_epoch = _positive_int(len(loader))
        except (TypeError, ValueError, NotImplementedError):
            batches_per_epoch = None
    target_steps = _positive_int(getattr(workflow, "num_steps", None))
    target_epochs = _positive_int(getattr(workflow, "num_epochs", None))
    if target_steps is None and target_epochs is not None and batches_per_epoch is not None:
        modifier = getattr(workflow, "epoch_step_modifier", 1.0)
        if not isinstance(modifier, numbers.Real) or isinstance(modifier, bool) or modifier <= 0:
            modifier = 1.0
        target_steps = math.ceil(target_epochs * batches_per_epoch * float(modifier))
    return TrainingPlan(target_steps, target_epochs, batches_per_epoch)


def _add_progress(
    buffer: _ScalarBuffer, ctx: Any, stage: Any, state: ReportingState | None
) -> None:
    rates = state.rates if state is not None else None
    dynamics = not hasattr(ctx, "batch_count")
    prefix = "dynamics" if dynamics else "training"
    steps_per_s = rates.steps_per_s if rates is not None else None
    if steps_per_s is not None:
        buffer.add(f"{prefix}/steps_per_s", steps_per_s)
    if not dynamics and rates is not None and rates.batches_per_s is not None:
        buffer.add("training/batches_per_s", rates.batches_per_s)
    workflow = getattr(ctx, "workflow", None)
    position = event_position(ctx, stage)
    if dynamics:
        plan = TrainingPlan(target_steps=_positive_int(getattr(workflow, "n_steps", None)))
    else:
        plan = training_plan(workflow)
    if plan.target_steps is not None:
        remaining = max(plan.target_steps - position.step, 0)
        buffer.add(f"{prefix}/target_steps", plan.target_steps)
        buffer.add(f"{prefix}/remaining_steps", remaining)
        buffer.add(f"{prefix}/progress_fraction", min(position.step / plan.target_steps, 1.0))
        if steps_per_s:
            buffer.add(f"{prefix}/eta_s", remaining / steps_per_s)
    if plan.target_epochs is not None:
        buffer.add("training/target_epochs", plan.target_epochs)
    if plan.batches_per_epoch is not None:
        fraction = min(position.epoch_step / plan.batches_per_epoch, 1.0)
        buffer.add("training/epoch_fraction", fraction)


def _apply_budget(buffer: _ScalarBuffer, position: Any) -> None:
    """With a time budget, progress counts towards its planned step; the ETA is the time left."""
    values = buffer.values
    planned = values.get("budget/planned_steps")
    if isinstance(planned, float) and planned > 0:
        values["training/target_steps"] = planned
        values["training/remaining_steps"] = max(planned - position.step, 0.0)
        values["training/progress_fraction"] = min(position.step / planned, 1.0)
    remaining = values.get("budget/remaining_s")
    if isinstance(remaining, float):
        values["training/eta_s"] = remaining


def _add_throughput(buffer: _ScalarBuffer, state: ReportingState | None) -> None:
    if state is None:
        return
    if state.rates.structures_per_s is not None:
        buffer.add("throughput/structures_per_s", state.rates.structures_per_s)
    if state.rates.atoms_per_s is not None:
        buffer.add("throughput/atoms_per_s", state.rates.atoms_per_s)


def _cuda_device(ctx: Any) -> torch.device | None:
    for source in (getattr(ctx, "batch", None), getattr(ctx, "model", None)):
        device = getattr(source, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            return device
    return None


def _add_memory(buffer: _ScalarBuffer, ctx: Any) -> None:
    # Allocator statistics are host-side counters: reading them does not sync.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = _cuda_device(ctx) or torch.device("cuda", torch.cuda.current_device())
        buffer.add("memory/cuda_max_allocated_mib", torch.cuda.max_memory_allocated(device) / 2**20)
    try:
        import resource  # posix
    except ImportError:  # Windows
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1.0 if sys.platform == "darwin" else 1024.0  # bytes on macOS, KiB elsewhere
    buffer.add("memory/rss_peak_mib", peak * scale / 2**20)


# --------------------------------------------------------------------------- custom
def validate_custom_scalars(custom_scalars: Any) -> dict[str, ScalarCallback]:
    """Check ``{name: callable(ctx, stage)}`` and return it as a dict (``None`` -> ``{}``)."""
    if custom_scalars is None:
        return {}
    if not isinstance(custom_scalars, Mapping):
        raise TypeError(
            "custom_scalars must be a mapping {name: callable(ctx, stage)}; got "
            f"{type(custom_scalars).__name__}."
        )
    for name, callback in custom_scalars.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"custom_scalars keys must be non-empty strings; got {name!r}.")
        if not callable(callback):
            raise TypeError(
                f"custom_scalars[{name!r}] must be callable as callback(ctx, stage); got "
                f"{type(callback).__name__}."
            )
    return dict(custom_scalars)


def _add_custom(
    buffer: _ScalarBuffer, ctx: Any, stage: Any, custom: Mapping[str, ScalarCallback]
) -> None:
    for name, callback in custom.items():
        value = callback(ctx, stage)
        if value is None:
            continue
        if isinstance(value, Mapping):
            buffer.add_mapping(value, name)
        else:
            buffer.add(name, value)


# --------------------------------------------------------------------------- snapshot
def collect_scalars(
    ctx: Any,
    stage: Any,
    state: ReportingState | None = None,
    *,
    custom_scalars: Mapping[str, ScalarCallback] | None = None,
    include_losses: bool = True,
    include_optimizer_lrs: bool = True,
    include_dynamics: bool = False,
    include_progress: bool = False,
    include_grad_norm: bool = True,
    include_throughput: bool = False,
    include_memory: bool = False,
    include_validation: bool | None = None,
) -> ScalarSnapshot:
    """Read the scalars of one event into a :class:`ScalarSnapshot`.

    ``include_validation=None`` (default) adds the validation summary only at
    ``AFTER_VALIDATION``; at that stage the per-batch training entries (losses,
    gradient norm, throughput) are left out because they belong to the last
    training batch, not to the validation pass.

    Example:
        >>> from nvalchemi.hooks.context import TrainContext
        >>> ctx = TrainContext(batch=None, step_count=4, loss=torch.tensor(0.25))
        >>> snap = collect_scalars(ctx, "AFTER_OPTIMIZER_STEP")
        >>> snap.scalars, snap.step_count, snap.step
        ({'loss/total': 0.25}, 4, 5)
    """
    custom = validate_custom_scalars(custom_scalars)
    validating = is_validation_stage(stage)
    if include_validation is None:
        include_validation = validating
    buffer = _ScalarBuffer()
    if include_losses and not validating:
        _add_losses(buffer, getattr(ctx, "loss", None), getattr(ctx, "losses", None))
    if include_validation:
        _add_validation(
            buffer, getattr(ctx, "validation", None), workflow=getattr(ctx, "workflow", None)
        )
    if include_optimizer_lrs:
        optimizers = getattr(ctx, "optimizers", None)
        _add_optimizer_lrs(buffer, optimizers)
        _add_scheduler_lrs(buffer, getattr(ctx, "lr_schedulers", None), optimizers)
    grad_norm = getattr(ctx, "grad_norm", None)
    if include_grad_norm and grad_norm is not None and not validating:
        buffer.add("grad_norm", grad_norm)
    if include_dynamics:
        _add_dynamics(buffer, ctx)
    if include_progress:
        _add_progress(buffer, ctx, stage, state)
    if include_throughput and not validating:
        _add_throughput(buffer, state)
    if include_memory:
        _add_memory(buffer, ctx)
    _add_custom(buffer, ctx, stage, custom)
    position = event_position(ctx, stage)
    if include_progress:
        _apply_budget(buffer, position)
    rank = getattr(ctx, "global_rank", 0)
    return ScalarSnapshot(
        stage=stage_name(stage),
        scalars=buffer.resolve(),
        timestamp_s=time.time(),
        elapsed_s=state.elapsed_s if state is not None else 0.0,
        event_count=state.event_count if state is not None else 0,
        step_count=_counter(ctx, "step_count"),
        batch_count=_counter(ctx, "batch_count"),
        epoch_step_count=_counter(ctx, "epoch_step_count"),
        epoch=_counter(ctx, "epoch"),
        global_rank=rank if isinstance(rank, int) else 0,
        messages=tuple(state.messages) if state is not None else (),
        step=position.step,
    )


def _counter(ctx: Any, name: str) -> int:
    value = getattr(ctx, name, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
