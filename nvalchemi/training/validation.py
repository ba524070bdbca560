"""Validation: :class:`ValidationConfig` (when and how) and :class:`ValidationLoop` (one pass).

A pass evaluates the loss and error metrics over a validation loader with models in
eval mode, gradients only when the loss needs them (force/stress losses), and restores
the models' modes and gradients afterwards. Sums are kept on the device and read once
at the end; under ``torch.distributed`` every rank packs its sums and counts into one
float64 tensor that is all-reduced once, so every rank returns the same summary.

Summary keys (``strategy.last_validation`` / ``ctx.validation``):

* ``total_loss``: mean over batches of the total loss (0-d float64 CPU tensor);
  ``per_component_unweighted`` (mean over batches), ``per_component_sample`` and
  ``per_component_sample_count`` (mean and number of the per-structure weighted values of
  the structures that have the component's label; unlabelled ones are not counted),
  ``per_component_weight``
  and ``per_component_raw_weight`` (weights at the current step), ``num_batches``;
* metrics, for whichever of ``predicted_energy``/``energy``, ``predicted_forces``/``forces``
  and ``predicted_stress``/``stress`` are present (NaN labels are missing and excluded):
  ``energy_mae``, ``energy_rmse``, ``energy_per_atom_mae``, ``energy_per_atom_rmse`` (eV,
  eV/atom), ``forces_mae``, ``forces_rmse`` (eV/Å, per Cartesian component),
  ``stress_mae``, ``stress_rmse`` (eV/Å³, per tensor component), plus ``num_structures``
  (each from :func:`error_sums`, the error metric evaluation reports use too);
* ``name``, ``model_source`` (``"live"``, ``"ema"``, ``"mixed"``), ``ema_model_keys``,
  ``precision``, ``distributed_reduced``.

Example:
    >>> from nvalchemi.training import ValidationConfig
    >>> config = ValidationConfig(validation_data=[], every_n_epochs=1)
    >>> config.grad_mode, config.name
    ('auto', 'validation')
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from nvalchemi.distributed.runtime import all_reduce, get_world_size, is_distributed_initialized
from nvalchemi.training.errors import add_note
from nvalchemi.training.losses.composition import (
    as_composed_loss,
    assemble_loss_targets,
    compute_supervised_loss,
)
from nvalchemi.training.runtime import unwrap_model
from nvalchemi.training.stages import TrainingStage

__all__ = [
    "BatchValidationCallback",
    "ValidationConfig",
    "ValidationLoop",
    "error_sums",
    "mae_rmse",
]

_BEFORE_FORWARD = TrainingStage.BEFORE_FORWARD
_AFTER_FORWARD = TrainingStage.AFTER_FORWARD
# (prediction key, target key, metric prefix, per atom): one block of error_sums each
_METRICS = (
    ("predicted_energy", "energy", "energy", False),
    ("predicted_energy", "energy", "energy_per_atom", True),
    ("predicted_forces", "forces", "forces", False),
    ("predicted_stress", "stress", "stress", False),
)


@runtime_checkable
class BatchValidationCallback(Protocol):
    """Called after every validation batch with keyword-only arguments.

    ``batch`` (on the validation device), ``predictions`` (validation-function output),
    ``loss`` (the batch's ``ComposedLossOutput``), ``batch_count`` (0-based index in the
    pass), ``step_count`` and ``epoch`` of the training run.
    """

    def __call__(
        self,
        *,
        batch: Any,
        predictions: Mapping[str, torch.Tensor],
        loss: Mapping[str, Any],
        batch_count: int,
        step_count: int,
        epoch: int,
    ) -> None: ...


class ValidationConfig(BaseModel):
    """When and how a :class:`~nvalchemi.training.TrainingStrategy` validates.

    Args:
        validation_data: a re-iterable of batches (a list or a DataLoader, not a generator).
        validation_fn: ``fn(model_or_models, batch) -> predictions``; default: the
            strategy's ``training_fn``.
        loss_fn: loss to evaluate (a leaf is wrapped); default: the strategy's.
        every_n_epochs / every_n_steps: cadence (at most one; neither = only at the end).
        grad_mode: ``"auto"`` enables autograd when the loss needs it
            (``loss_fn.requires_eval_grad()``), or force ``"enabled"``/``"disabled"``.
        set_eval: put models in eval mode during the pass (restored afterwards).
        use_ema: use the strategy's ``inference_model`` slot (``"auto"``: when populated).
        use_mixed_precision: reuse the mixed-precision hook's inference autocast.
        batch_callback: a :class:`BatchValidationCallback`.
        name: label stored in the summary.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    validation_data: Any
    validation_fn: Callable[..., Mapping[str, torch.Tensor]] | None = None
    loss_fn: Any = None
    every_n_epochs: int | None = Field(default=None, ge=1)
    every_n_steps: int | None = Field(default=None, ge=1)
    grad_mode: Literal["auto", "enabled", "disabled"] = "auto"
    set_eval: bool = True
    use_ema: Literal["auto", "always", "never"] = "auto"
    use_mixed_precision: Literal["auto", "always", "never"] = "auto"
    batch_callback: Any = None
    name: str = Field(default="validation", min_length=1)

    @field_validator("validation_data")
    @classmethod
    def _re_iterable(cls, value: Any) -> Any:
        try:
            iterator = iter(value)
        except TypeError:
            raise ValueError(
                f"validation_data must be iterable (a list of batches or a DataLoader); got "
                f"{type(value).__name__}."
            ) from None
        if iterator is value:
            raise ValueError(
                "validation_data must be re-iterable (validation runs many times); got a "
                f"one-shot {type(value).__name__}. Pass a list or a DataLoader."
            )
        return value

    @field_validator("loss_fn")
    @classmethod
    def _composed(cls, value: Any) -> Any:
        return None if value is None else as_composed_loss(value)

    @field_validator("validation_fn", "batch_callback")
    @classmethod
    def _callable(cls, value: Any, info: Any) -> Any:
        if value is not None and not callable(value):
            raise ValueError(f"{info.field_name} must be callable; got {type(value).__name__}.")
        return value

    @model_validator(mode="after")
    def _one_cadence(self) -> ValidationConfig:
        if self.every_n_epochs is not None and self.every_n_steps is not None:
            raise ValueError(
                "Only one of every_n_epochs or every_n_steps may be set; got "
                f"every_n_epochs={self.every_n_epochs}, every_n_steps={self.every_n_steps}."
            )
        return self


class ValidationLoop:
    """One validation pass; use it as a context manager and call :meth:`execute`.

    Build it from a strategy with :meth:`from_training_strategy` (what
    ``strategy.validate()`` does), or standalone:

    Example:
        >>> import torch
        >>> from nvalchemi.training import EnergyMSELoss, ValidationConfig, default_training_fn
        >>> loop = ValidationLoop(  # doctest: +SKIP
        ...     validation_data=val_batches, config=ValidationConfig(validation_data=val_batches),
        ...     device=torch.device("cpu"), model=model, loss_fn=EnergyMSELoss(),
        ...     validation_fn=default_training_fn)
        >>> with loop:  # doctest: +SKIP
        ...     summary = loop.execute()

    Standalone rules: exactly one of ``model``/``models``; the loss comes from
    ``loss_fn`` or ``config.loss_fn``; ``validation_fn`` (or ``config.validation_fn``) is
    required; an ``inference_model`` (bare module, or ``ModuleDict`` by model key)
    replaces the live model(s); ``autocast`` is a context-manager factory (label
    ``"mixed"``); ``grad_enabled=None`` follows ``config.grad_mode``.
    """

    def __init__(
        self,
        *,
        validation_data: Iterable[Any],
        config: ValidationConfig,
        device: torch.device | str,
        model: nn.Module | None = None,
        models: Mapping[str, nn.Module] | None = None,
        loss_fn: Any = None,
        loss_target_assembler: Callable[..., Mapping[str, torch.Tensor]] = assemble_loss_targets,
        validation_fn: Callable[..., Mapping[str, torch.Tensor]] | None = None,
        inference_model: nn.Module | None = None,
        autocast: Callable[[], Any] | None = None,
        grad_enabled: bool | None = None,
        distributed_manager: Any = None,
        step_count: int = 0,
        epoch: int = 0,
    ) -> None:
        if (model is None) == (models is None):
            raise ValueError("Exactly one of 'model' or 'models' must be provided.")
        loss_fn = loss_fn if loss_fn is not None else config.loss_fn
        if loss_fn is None:
            raise ValueError(
                "ValidationLoop: loss_fn must be provided in standalone mode; pass loss_fn=... "
                "or set ValidationConfig(loss_fn=...)."
            )
        validation_fn = validation_fn or config.validation_fn
        if validation_fn is None:
            raise ValueError("validation_fn is required in standalone mode.")
        if model is not None:
            model_arg: Any = unwrap_model(model)
            ema_keys: list[str] = []
            if isinstance(inference_model, nn.Module) and not isinstance(
                inference_model, nn.ModuleDict
            ):
                model_arg, ema_keys = inference_model, ["main"]
        else:
            model_arg = {k: unwrap_model(m) for k, m in models.items()}
            ema_keys = _apply_slot(model_arg, inference_model)
        self.config = config
        self.device = torch.device(device)
        self.loss_fn = as_composed_loss(loss_fn)
        self.validation_data = validation_data
        self._model_arg = model_arg
        self._assembler = loss_target_assembler
        self._fn = validation_fn
        self._autocast = autocast or contextlib.nullcontext
        self._precision = "mixed" if autocast is not None else "float32"
        self._manager = distributed_manager
        self._ema_keys = sorted(ema_keys)
        self._total_models = len(model_arg) if model is None else 1
        self._strategy: Any = None
        self._counters = (step_count, epoch)
        self._entered = False
        self._saved_modes: list[tuple[nn.Module, bool]] = []
        self._saved_grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        if grad_enabled is None:
            mode = config.grad_mode
            grad_enabled = (
                self.loss_fn.requires_eval_grad() if mode == "auto" else mode == "enabled"
            )
        self.grad_enabled = bool(grad_enabled)

    @classmethod
    def from_training_strategy(
        cls, strategy: Any, config: ValidationConfig | None = None
    ) -> ValidationLoop:
        """A loop over ``config`` (default ``strategy.validation_config``) for ``strategy``.

        Models come from the strategy (DDP wrappers stripped) or, per ``config.use_ema``,
        from its ``inference_model`` slot; counters are read when :meth:`execute` runs.
        """
        config = config if config is not None else strategy.validation_config
        if config is None:
            raise RuntimeError("TrainingStrategy.validate() requires a validation_config.")
        models = strategy.unwrapped_models()
        slot = None if config.use_ema == "never" else strategy.inference_model
        if config.use_ema == "always" and slot is None:
            raise RuntimeError(
                "ValidationConfig(use_ema='always') requires a populated inference_model slot "
                "(e.g. via EMAHook)."
            )
        device = strategy.devices[0]
        autocast, precision = strategy.validation_autocast(device, config.use_mixed_precision)
        single = strategy.single_model_input
        loop = cls(
            validation_data=config.validation_data,
            config=config,
            device=device,
            model=models["main"] if single else None,
            models=None if single else dict(models),
            loss_fn=config.loss_fn if config.loss_fn is not None else strategy.loss_fn,
            loss_target_assembler=strategy.loss_target_assembler,
            validation_fn=config.validation_fn or strategy.training_fn,
            inference_model=slot,
            autocast=autocast,
            distributed_manager=strategy.distributed_manager,
        )
        if config.use_ema == "always" and len(loop._ema_keys) < loop._total_models:
            missing = sorted(set(models) - set(loop._ema_keys))
            raise RuntimeError(
                "ValidationConfig(use_ema='always') requires an inference model for every model "
                f"key; missing: {missing}."
            )
        loop._precision = precision
        loop._strategy = strategy
        return loop

    # ----------------------------------------------------------------- context
    def __enter__(self) -> ValidationLoop:
        arg = self._model_arg
        values = arg.values() if isinstance(arg, dict) else [arg]
        modules = list({id(m): m for m in values if isinstance(m, nn.Module)}.values())
        self._saved_modes = [(m, m.training) for top in modules for m in top.modules()]
        if self.config.set_eval:
            for module in modules:
                module.eval()
        self._saved_grads = []
        if self.grad_enabled:
            params = {id(p): p for module in modules for p in module.parameters()}
            self._saved_grads = [(p, p.grad) for p in params.values()]
            for param in params.values():
                param.grad = None
        self._entered = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._entered = False
        for param, grad in self._saved_grads:
            param.grad = grad
        self._saved_grads = []
        for module, training in self._saved_modes:
            module.training = training
        self._saved_modes = []

    # ----------------------------------------------------------------- the pass
    def execute(self) -> dict[str, Any]:
        """Run the pass and return the summary (see the module docstring)."""
        if not self._entered:
            raise RuntimeError("ValidationLoop.execute() must be called inside a 'with' block.")
        strategy = self._strategy
        step, epoch = (
            (strategy.step_count, strategy.epoch_count) if strategy is not None else self._counters
        )
        before: tuple[Any, ...] = ()
        after: tuple[Any, ...] = ()
        if strategy is not None:  # neighbour lists for batches that come without them
            before = (*strategy.neighbor_list_builders(), *strategy.hooks_for(_BEFORE_FORWARD))
            after = strategy.hooks_for(_AFTER_FORWARD)
        ctx = strategy.new_context() if (before or after) else None
        totals = _Totals(self.loss_fn.component_names, self.device, self.loss_fn.components)
        workflow = strategy if strategy is not None else self
        callback = self.config.batch_callback
        grad_context = torch.enable_grad if self.grad_enabled else torch.no_grad
        index, where = 0, "loading the batch"
        try:
            for index, batch in enumerate(self.validation_data):
                where = "moving the batch to the device"
                batch = _to_device(batch, self.device)
                if self.grad_enabled:
                    for param, _ in self._saved_grads:
                        param.grad = None
                with grad_context(), self._autocast():
                    if ctx is not None:
                        ctx.batch, ctx.predictions = batch, None
                    where = "BEFORE_FORWARD hooks"
                    for hook in before:
                        hook(ctx, _BEFORE_FORWARD)
                    where = "the forward pass (validation_fn)"
                    predictions = self._fn(self._model_arg, batch)
                    if ctx is not None:
                        ctx.predictions = predictions
                    where = "AFTER_FORWARD hooks"
                    for hook in after:
                        hook(ctx, _AFTER_FORWARD)
                    where = "the loss"
                    loss = compute_supervised_loss(
                        self.loss_fn,
                        predictions,
                        batch,
                        step=step,
                        epoch=epoch,
                        workflow=workflow,
                        target_assembler=self._assembler,
                        batch_label="Validation batch",
                    )
                where = "accumulating metrics"
                totals.add(loss, predictions, batch)
                if callback is not None:
                    where = "batch_callback"
                    callback(
                        batch=batch,
                        predictions=predictions,
                        loss=loss,
                        batch_count=index,
                        step_count=step,
                        epoch=epoch,
                    )
                where = "loading the batch"
        except Exception as exc:
            add_note(
                exc,
                f"raised in validation {self.config.name!r} while {where} at validation "
                f"batch {index} (training step {step}, epoch {epoch})",
            )
            raise
        finally:
            if ctx is not None:
                ctx.batch, ctx.predictions = None, None
        summary = totals.summary(self.loss_fn, step, epoch, self._manager)
        summary.update(
            name=self.config.name,
            model_source=_source(len(self._ema_keys), self._total_models),
            ema_model_keys=list(self._ema_keys),
            precision=self._precision,
        )
        return summary


# --------------------------------------------------------------------------- accumulation
class _Totals:
    """Device-side sums and counts of one pass, read (and all-reduced) once at the end."""

    def __init__(
        self, component_names: list[str], device: torch.device, leaves: Iterable[Any] = ()
    ) -> None:
        self.names = list(component_names)
        self.leaves = list(leaves)
        self.device = device
        # total, then per component (unweighted, labelled-sample sum, labelled-sample count),
        # then one error_sums block (abs, sq, n) per metric of _METRICS. Counts live on the
        # device too, so nothing syncs per batch.
        size = 1 + 3 * len(self.names) + 3 * len(_METRICS)
        self.sums = torch.zeros(size, dtype=torch.float64, device=device)
        self.num_batches = 0
        self.num_structures = 0
        self.last_weights: tuple[dict[str, float], dict[str, float]] | None = None

    def add(self, loss: Mapping[str, Any], predictions: Mapping[str, Any], batch: Any) -> None:
        parts = [loss["total_loss"].detach().reshape(())]
        unweighted = loss["per_component_unweighted"]
        samples = loss.get("per_component_sample", {})
        zero = self.sums.new_zeros(())
        for i, name in enumerate(self.names):
            parts.append(unweighted[name].detach().reshape(()) if name in unweighted else zero)
            sample = samples.get(name)
            if sample is None:
                parts += [zero, zero]
                continue
            sample = sample.detach()
            labelled = self._labelled(i, sample)
            # Unlabelled structures (NaN) are left out; a NaN where a label exists stays.
            parts.append(torch.where(labelled, sample, 0.0).sum())
            parts.append(labelled.sum())
        parts = [p.to(torch.float64).reshape(1) for p in parts]
        zeros = self.sums.new_zeros(3)
        for pred_key, target_key, _, per_atom in _METRICS:
            parts.append(_errors(predictions, batch, pred_key, target_key, per_atom, zeros))
        self.sums += torch.cat(parts)
        self.num_batches += 1
        self.num_structures += _num_graphs(batch)
        self.last_weights = (
            dict(loss.get("per_component_weight", {})),
            dict(loss.get("per_component_raw_weight", {})),
        )

    def _labelled(self, index: int, sample: torch.Tensor) -> torch.Tensor:
        """The leaf's mask of labelled structures, else the non-NaN entries of ``sample``."""
        leaf = self.leaves[index] if index < len(self.leaves) else None
        valid = getattr(leaf, "per_sample_valid", None)
        if isinstance(valid, torch.Tensor) and valid.shape == sample.shape:
            return valid.to(device=sample.device, dtype=torch.bool)
        return ~torch.isnan(sample)

    def summary(self, loss_fn: Any, step: int, epoch: int, manager: Any) -> dict[str, Any]:
        counts = torch.tensor(
            [self.num_batches, self.num_structures], dtype=torch.float64, device=self.device
        )
        packed = torch.cat([self.sums, counts])
        reduced = _all_reduce(packed, manager)
        values = packed.cpu() if reduced is None else reduced
        n = len(self.names)
        sums, tail = values[: self.sums.numel()], values[self.sums.numel() :]
        num_batches, num_structures = int(tail[0]), int(tail[1])
        if num_batches == 0:
            raise ValueError("validation_data produced no batches.")
        sample_counts = [int(sums[3 + 3 * i]) for i in range(n)]
        out: dict[str, Any] = {"total_loss": sums[0] / num_batches}
        out["per_component_unweighted"] = {
            name: sums[1 + 3 * i] / num_batches for i, name in enumerate(self.names)
        }
        out["per_component_sample"] = {
            name: sums[2 + 3 * i] / sample_counts[i]
            for i, name in enumerate(self.names)
            if sample_counts[i] > 0
        }
        out["per_component_sample_count"] = dict(zip(self.names, sample_counts))
        effective, raw = self.last_weights or _weights(loss_fn, step, epoch)
        out["per_component_weight"] = effective
        out["per_component_raw_weight"] = raw
        out["num_batches"] = num_batches
        out["num_structures"] = num_structures
        out.update(_metrics(sums[1 + 3 * n :]))
        out["distributed_reduced"] = reduced is not None
        return out


def error_sums(
    pred: torch.Tensor, target: torch.Tensor, per: torch.Tensor | None = None
) -> torch.Tensor:
    """``[sum |e|, sum e^2, n]`` of ``e = (pred - target) / per`` over the labelled entries.

    In float64, on ``pred``'s device (no host sync). A NaN target is a missing label and is
    left out; a NaN prediction stays, so a diverged model shows in the metrics. ``per``
    (e.g. atoms per structure) divides each error. Sums of several batches or ranks add
    up; read them with :func:`mae_rmse`.

    >>> sums = error_sums(torch.tensor([1.0, 2.0, 5.0]), torch.tensor([0.0, float("nan"), 3.0]))
    >>> sums.tolist(), [float(v) for v in mae_rmse(sums)]
    ([3.0, 5.0, 2.0], [1.5, 1.5811388300841898])
    """
    pred = pred.detach().to(torch.float64)
    target = target.detach().to(device=pred.device, dtype=torch.float64).reshape(pred.shape)
    valid = ~torch.isnan(target)
    err = torch.where(valid, pred - target, 0.0)
    if per is not None:
        err = err / per.to(device=err.device, dtype=torch.float64).reshape(err.shape)
    return torch.stack([err.abs().sum(), (err * err).sum(), valid.sum().to(torch.float64)])


def mae_rmse(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean absolute error and root-mean-square error from :func:`error_sums` (NaN if empty)."""
    return sums[0] / sums[2], torch.sqrt(sums[1] / sums[2])


def _errors(
    predictions: Mapping[str, Any],
    batch: Any,
    pred_key: str,
    target_key: str,
    per_atom: bool,
    zeros: torch.Tensor,
) -> torch.Tensor:
    """:func:`error_sums` of one metric of a batch; ``zeros`` without the prediction or the
    label (or, per atom, the atom counts)."""
    pred = predictions.get(pred_key) if isinstance(predictions, Mapping) else None
    target = _field(batch, target_key)
    if not isinstance(pred, torch.Tensor) or target is None:
        return zeros
    if not per_atom:
        return error_sums(pred.reshape(target.shape), target).to(zeros.device)
    atoms = _field(batch, "num_nodes_per_graph")
    if atoms is None or atoms.numel() != target.numel():
        return zeros
    return error_sums(pred.reshape(-1), target.reshape(-1), atoms.clamp_min(1)).to(zeros.device)


def _metrics(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for i, (_, _, prefix, _) in enumerate(_METRICS):
        sums = blocks[3 * i : 3 * i + 3]
        if float(sums[2]) > 0:
            out[f"{prefix}_mae"], out[f"{prefix}_rmse"] = mae_rmse(sums)
    return out


def _weights(loss_fn: Any, step: int, epoch: int) -> tuple[dict[str, float], dict[str, float]]:
    # A rank without validation batches still reports the weights of the current step.
    resolve = getattr(loss_fn, "_resolved_weights", None)
    names = loss_fn.component_names
    if callable(resolve):
        raw, effective = resolve(step, epoch)
        return dict(zip(names, effective)), dict(zip(names, raw))
    effective = loss_fn.weight_factors(step, epoch)
    return effective, dict(effective)


def _all_reduce(packed: torch.Tensor, manager: Any) -> torch.Tensor | None:
    """The SUM over ranks of ``packed`` on the CPU, or ``None`` in a single process."""
    if not is_distributed_initialized(manager) or get_world_size(manager) <= 1:
        return None

    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    device = packed.device if "nccl" in backend else torch.device("cpu")
    tensor = packed.to(device)
    return all_reduce(tensor, manager).cpu()


def _apply_slot(models: dict[str, nn.Module], slot: Any) -> list[str]:
    """Replace named models by inference models from ``slot``; return the replaced keys."""
    if isinstance(slot, nn.ModuleDict):
        keys = [k for k in slot if k in models]
        for key in keys:
            models[key] = slot[key]
        return keys
    if isinstance(slot, nn.Module) and "main" in models:
        models["main"] = slot
        return ["main"]
    return []


def _source(ema: int, total: int) -> str:
    if ema == 0:
        return "live"
    return "ema" if ema >= total else "mixed"


def _field(batch: Any, key: str) -> torch.Tensor | None:
    try:
        value = batch.get(key) if isinstance(batch, Mapping) else getattr(batch, key, None)
    except (KeyError, ValueError):
        return None
    return value if isinstance(value, torch.Tensor) else None


def _num_graphs(batch: Any) -> int:
    value = getattr(batch, "num_graphs", None)
    return int(value) if isinstance(value, int) else 0


def _to_device(batch: Any, device: torch.device) -> Any:
    if getattr(batch, "device", device) != device and callable(getattr(batch, "to", None)):
        return batch.to(device, non_blocking=True)
    return batch
