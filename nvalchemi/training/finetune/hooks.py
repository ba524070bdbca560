"""Fine-tuning hooks: new heads and submodules, which parameters train, and forgetting.

:class:`AddHeadHook` (readout heads copied from an existing one),
:class:`ModulePatchHook` (new or replaced submodules) and
:class:`TrainableParameterHook` (freezing by name pattern) do their work once, when
registered with a strategy (before optimizers exist), and never fire at a stage.
:class:`ForgettingHook` measures what a fine-tune forgets: the error on held-out data
of the source's domain before training and at every validation. Parameter names are
qualified by the model key and never contain wrapper prefixes
(``"main.model.projection.weight"``, also after ``DDPHook`` wraps the model), so
filters computed at registration keep matching when optimizers are built later.

Example:
    >>> import torch
    >>> from nvalchemi.training import EnergyMSELoss, OptimizerConfig, TrainingStrategy
    >>> strategy = TrainingStrategy(  # doctest: +SKIP
    ...     models=model,
    ...     optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-4}),
    ...     loss_fn=EnergyMSELoss(),
    ...     num_steps=100,
    ...     hooks=[
    ...         ModulePatchHook(patches={"main.readout": torch.nn.Linear(16, 1)}),
    ...         TrainableParameterHook(trainable_patterns=("main.readout.*",)),
    ...     ],
    ... )
"""

from __future__ import annotations

import fnmatch
import itertools
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)
from torch import nn

from nvalchemi._serialization import spec_factory
from nvalchemi.training.model_spec import model_spec_for
from nvalchemi.training.optimizers import iter_qualified_named_parameters
from nvalchemi.training.spec import BaseSpec, create_model_spec, create_model_spec_from_json
from nvalchemi.training.validation import ValidationConfig, ValidationLoop

__all__ = [
    "AddHeadHook",
    "ForgettingHook",
    "ModulePatchHook",
    "PatchedModule",
    "TrainableParameterHook",
    "apply_module_patches",
]


class _RegistrationHook(BaseModel):
    """A hook that does its work in ``on_register`` and never runs at a stage."""

    model_config = ConfigDict(extra="forbid")

    frequency: ClassVar[int] = 1
    stage: ClassVar[Any] = None

    def _runs_on_stage(self, stage: Any) -> bool:
        return False

    def __call__(self, ctx: Any, stage: Any) -> None:
        """Never called: the work is done in ``on_register``."""

    @staticmethod
    def _reapply_parameter_filters(workflow: Any) -> None:
        for hook in getattr(workflow, "hooks", None) or ():
            if isinstance(hook, TrainableParameterHook):
                hook.apply(workflow)  # its name filters predate the new parameters


# ---------------------------------------------------------------------------- module patches
class ModulePatchHook(_RegistrationHook):
    """Add or replace submodules of the strategy's models when registered.

    Registration resolves every target first and changes nothing if any fails
    (``KeyError`` for an unknown model key, ``AttributeError`` naming a missing parent,
    ``TypeError`` for a non-module on the path or a spec that does not build a module),
    then installs the modules in order, each on the device and floating dtype of the
    module it replaces (else of its parent). It raises ``RuntimeError`` after optimizers
    were built, warns when one module instance serves several targets (shared
    parameters), and never re-applies its patches (no fresh modules replace trained
    ones). A patched model remembers how to rebuild itself (:class:`PatchedModule`), so
    its checkpoints reload with ``load_model_from_checkpoint``.

    Args:
        patches: ``{"<model key>.<path>.<child>": module_or_spec}`` in application
            order: an ``nn.Module`` or a :class:`BaseSpec` (or its JSON dict). An existing
            ``child`` is replaced, a missing one added; every parent must exist.

    Example:
        >>> import torch
        >>> hook = ModulePatchHook(patches={"main.model.projection": torch.nn.Linear(64, 1)})
        >>> list(hook.patches)
        ['main.model.projection']
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    patches: dict[str, Any] = Field(default_factory=dict)

    @field_validator("patches", mode="before")
    @classmethod
    def _check_patches(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise TypeError(
                f"patches must map 'model_key.path.child' targets to modules or specs; got "
                f"{type(value).__name__}."
            )
        out: dict[str, Any] = {}
        for target, patch in value.items():
            if not isinstance(target, str):
                raise TypeError(f"patch targets must be strings; got {target!r}.")
            out[target] = _as_patch_value(target, patch)
        return out

    # target -> the module this hook installed there (to recognise its own work)
    _installed: dict[str, nn.Module] = PrivateAttr(default_factory=dict)

    def __init__(self, patches: Mapping[str, Any] | None = None, **data: Any) -> None:
        super().__init__(patches=patches, **data)

    def on_register(self, workflow: Any) -> None:
        """Apply the patches to ``workflow.models`` (all targets resolved first)."""
        models = getattr(workflow, "models", None)
        if not isinstance(models, Mapping):
            raise TypeError(
                "ModulePatchHook needs a workflow whose models are a mapping of names to "
                f"modules (a TrainingStrategy); got {type(models).__name__}."
            )
        installed = self._installed
        pending = {
            target: patch
            for target, patch in self.patches.items()
            if not _still_installed(models, target, installed.get(target))
        }
        if not pending:
            return  # already applied by this hook: never replace trained modules
        if getattr(workflow, "optimizers_built", False):
            raise RuntimeError(
                "ModulePatchHook must be registered before optimizers are built; the new "
                "modules would not be optimized. Pass it in hooks=[...] when constructing the "
                "strategy (or use FineTuningStrategy(module_patches=...))."
            )
        _warn_shared(pending)
        by_model: dict[str, dict[str, Any]] = {}
        for target, patch in pending.items():
            key, _, path = target.partition(".")
            _check_target(target)
            if key not in models:
                raise KeyError(
                    f"ModulePatchHook target {target!r}: unknown model key {key!r}; available "
                    f"model keys: {sorted(models)}."
                )
            by_model.setdefault(key, {})[path] = patch
        applied = {}
        for key, patches in by_model.items():
            root = _patchable_root(models[key], key)
            applied[key] = (root, _resolve_all(root, patches, prefix=f"{key}."))
        for key, (root, resolved) in applied.items():
            base, recorded = _spec_before_patching(root)
            for (parent, child, module), path in zip(resolved, by_model[key]):
                setattr(parent, child, module)
                installed[f"{key}.{path}"] = module
                patch = by_model[key][path]
                recorded[path] = patch if isinstance(patch, BaseSpec) else module
            _record_rebuild_spec(root, base, recorded)
        self._reapply_parameter_filters(workflow)


def apply_module_patches(module: nn.Module, patches: Mapping[str, Any]) -> nn.Module:
    """Install ``{"path.child": module_or_spec}`` into ``module`` (all resolved first); return it.

    Paths are relative to ``module`` (no model key); used to rebuild patched models.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> _ = apply_module_patches(net, {"1": torch.nn.Linear(4, 2)})
        >>> net[1].out_features
        2
    """
    values = {path: _as_patch_value(path, patch) for path, patch in patches.items()}
    for path in values:
        _check_target(path, relative=True)
    for parent, child, new in _resolve_all(module, values, prefix=""):
        setattr(parent, child, new)
    return module


class PatchedModule(nn.Module):
    """Rebuilds a model that :class:`ModulePatchHook` patched: :meth:`from_patches`.

    A factory namespace, never instantiated; an ``nn.Module`` because untrusted
    checkpoint specs may only name model classes and their classmethod factories.
    """

    def __init__(self) -> None:  # pragma: no cover - guard
        raise TypeError("PatchedModule is a factory namespace; call PatchedModule.from_patches.")

    @classmethod
    @spec_factory
    def from_patches(
        cls, model: BaseSpec, paths: list[str], modules: list[BaseSpec], device: Any = None
    ) -> nn.Module:
        """Build ``model`` (on ``device`` when its factory takes one), then install
        ``modules[i]`` at ``paths[i]`` in order."""
        if len(paths) != len(modules):
            raise ValueError(
                f"PatchedModule.from_patches: {len(paths)} paths for {len(modules)} modules."
            )
        if device is not None and model.accepts_kwarg("device"):
            base = model.build(device=device)
        else:
            base = model.build()
        if not isinstance(base, nn.Module):
            raise TypeError(f"PatchedModule: {model.cls_path} built {type(base).__name__}.")
        patches = dict(zip(paths, modules))
        apply_module_patches(base, patches)
        _record_rebuild_spec(base, model, patches)
        return base if device is None else base.to(device)


class _RebuildSpec:
    """A patched model's ``checkpoint_spec``: its original spec plus the patches (picklable)."""

    def __init__(self, base: BaseSpec, patches: dict[str, Any]) -> None:
        self.base = base
        self.patches = patches

    def __call__(self) -> BaseSpec:
        specs = []
        for path, patch in self.patches.items():
            spec = patch if isinstance(patch, BaseSpec) else model_spec_for(patch)
            if spec is None:
                raise ValueError(
                    f"the module patched in at {path!r} ({type(patch).__name__}) cannot be "
                    "described for a checkpoint; pass the patch as a BaseSpec "
                    "(create_model_spec(cls, **kwargs)) instead of a module instance."
                )
            specs.append(spec)
        return create_model_spec(
            PatchedModule.from_patches, model=self.base, paths=list(self.patches), modules=specs
        )


def _spec_before_patching(root: nn.Module) -> tuple[BaseSpec | None, dict[str, Any]]:
    """The unpatched model's spec and the patches recorded so far (none for a plain model)."""
    current = root.__dict__.get("checkpoint_spec")
    if isinstance(current, _RebuildSpec):
        return current.base, dict(current.patches)
    try:
        return model_spec_for(root), {}
    except (TypeError, ValueError):
        return None, {}


def _record_rebuild_spec(root: nn.Module, base: BaseSpec | None, patches: dict[str, Any]) -> None:
    """Give ``root`` a ``checkpoint_spec`` for its patched form (none without a base spec)."""
    if base is not None:
        # An instance attribute shadows any checkpoint_spec() of the model class.
        object.__setattr__(root, "checkpoint_spec", _RebuildSpec(base, patches))


def _as_patch_value(target: str, patch: Any) -> Any:
    if isinstance(patch, (nn.Module, BaseSpec)):
        return patch
    if isinstance(patch, Mapping) and "cls_path" in patch:
        return create_model_spec_from_json(patch)
    raise TypeError(
        f"patch {target!r} must be an nn.Module, a BaseSpec or a spec JSON dict; got "
        f"{type(patch).__name__}."
    )


def _check_target(target: str, relative: bool = False) -> None:
    parts = target.split(".")
    if len(parts) < (1 if relative else 2) or not all(parts):
        what = "'path.child'" if relative else "'<model_key>.<path>.<child>'"
        raise ValueError(
            f"ModulePatchHook target {target!r} must have the form {what} with non-empty "
            "dot-separated parts, e.g. 'main.model.readout'."
        )


def _patchable_root(model: nn.Module, key: str) -> nn.Module:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise RuntimeError(
            f"ModulePatchHook: model {key!r} is already wrapped in DistributedDataParallel, "
            "which has registered its parameters; register the hook before DDPHook wraps it "
            "(patches address the unwrapped names, e.g. 'main.model.readout')."
        )
    while True:
        if isinstance(model, nn.DataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


def _resolve_all(
    root: nn.Module, patches: Mapping[str, Any], prefix: str
) -> list[tuple[nn.Module, str, nn.Module]]:
    resolved = []
    for path, patch in patches.items():
        *parents, child = path.split(".")
        parent = root
        walked = prefix.rstrip(".") or type(root).__name__
        for part in parents:
            if not hasattr(parent, part):
                raise AttributeError(
                    f"ModulePatchHook target {prefix}{path!r}: {walked!r} has missing parent "
                    f"component {part!r}."
                )
            parent = getattr(parent, part)
            walked = f"{walked}.{part}"
            if not isinstance(parent, nn.Module):
                raise TypeError(
                    f"ModulePatchHook target {prefix}{path!r}: {walked!r} is a "
                    f"{type(parent).__name__}, not an nn.Module."
                )
        existing = getattr(parent, child, None)
        if existing is not None and not isinstance(existing, nn.Module):
            raise TypeError(
                f"ModulePatchHook target {prefix}{path!r}: existing attribute {child!r} is a "
                f"{type(existing).__name__}, not an nn.Module; only modules can be replaced."
            )
        module = patch.build() if isinstance(patch, BaseSpec) else patch
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"ModulePatchHook target {prefix}{path!r}: the spec built "
                f"{type(module).__name__}, not an nn.Module."
            )
        _match_placement(module, existing if existing is not None else parent)
        resolved.append((parent, child, module))
    return resolved


def _match_placement(module: nn.Module, reference: nn.Module) -> None:
    tensors = itertools.chain(reference.parameters(), reference.buffers())
    like = next((t for t in tensors if t.is_floating_point()), None)
    if like is not None and any(
        t.is_floating_point() and (t.dtype, t.device) != (like.dtype, like.device)
        for t in module.parameters()
    ):
        module.to(device=like.device, dtype=like.dtype)


def _still_installed(models: Mapping[str, Any], target: str, module: Any) -> bool:
    """Whether ``module`` (installed by this hook earlier) still sits at ``target``."""
    if module is None:
        return False
    key, _, path = target.partition(".")
    current = models.get(key)
    if current is None:
        return False
    try:
        current = _patchable_root(current, key)
    except RuntimeError:
        current = current.module
    for part in path.split("."):
        current = getattr(current, part, None)
        if current is None:
            return False
    return current is module


def _warn_shared(patches: Mapping[str, Any]) -> None:
    owners: dict[int, list[str]] = {}
    for target, patch in patches.items():
        if isinstance(patch, nn.Module):
            owners.setdefault(id(patch), []).append(target)
    for targets in owners.values():
        if len(targets) > 1:
            warnings.warn(
                f"ModulePatchHook uses the same module instance for targets {targets}; their "
                "parameters will be shared. Pass separate instances (or specs) to train them "
                "independently.",
                UserWarning,
                stacklevel=4,
            )


# ---------------------------------------------------------------------------- parameter filters
class TrainableParameterHook(_RegistrationHook):
    """Choose the trained parameters by qualified-name patterns, when registered.

    Patterns match ``"<model key>.<parameter name>"`` without wrapper prefixes
    (``"main.model.joint_mlp.*"``), so they keep matching after DDP wraps the model.
    Every pattern must match a parameter (``ValueError`` naming it, with example names).
    Registering after optimizers were built warns: they are rebuilt, losing their state.

    Args:
        freeze_patterns: ``fnmatch`` patterns of parameters to freeze.
        trainable_patterns: patterns to train: alone an allow-list, with
            ``freeze_patterns`` exceptions to them; matches train even if the model had
            them frozen (``requires_grad=False``).
        freeze_mode: ``"requires_grad"`` (frozen parameters get ``requires_grad=False``
            during ``run``/``train_batch``, restored afterwards) or ``"optimizer_only"``
            (they still get gradients, visible at ``AFTER_BACKWARD`` and cleared at every
            zeroing point, but no optimizer updates them).

    Example:
        >>> hook = TrainableParameterHook(trainable_patterns=("main.model.projection.*",))
        >>> hook.freeze_mode
        'requires_grad'
    """

    freeze_patterns: tuple[str, ...] = ()
    trainable_patterns: tuple[str, ...] = ()
    freeze_mode: Literal["requires_grad", "optimizer_only"] = "requires_grad"

    @field_validator("freeze_patterns", "trainable_patterns", mode="before")
    @classmethod
    def _one_pattern(cls, value: Any) -> Any:
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _some_pattern(self) -> TrainableParameterHook:
        if not self.freeze_patterns and not self.trainable_patterns:
            raise ValueError(
                "TrainableParameterHook requires freeze_patterns, trainable_patterns, or both."
            )
        return self

    def on_register(self, workflow: Any) -> None:
        """Resolve the patterns against the workflow's parameters and set its filters."""
        if getattr(workflow, "optimizers_built", False):
            warnings.warn(
                "TrainableParameterHook registered after optimizers were built; they will be "
                "rebuilt with the new parameter filter (their state, e.g. Adam moments, is "
                "lost). Register it before the first run.",
                UserWarning,
                stacklevel=3,
            )
        self.apply(workflow)

    def apply(self, workflow: Any) -> frozenset[str]:
        """Set the workflow's parameter filters from the patterns; return the trained names."""
        models = getattr(workflow, "models", None)
        if models is None:
            raise TypeError("TrainableParameterHook needs a workflow with models.")
        names = [name for name, _ in iter_qualified_named_parameters(models)]
        frozen = self._matches(names, self.freeze_patterns, "freeze_patterns")
        forced = self._matches(names, self.trainable_patterns, "trainable_patterns")
        if self.freeze_patterns:
            allowed = frozenset((set(names) - frozen) | forced)
        else:
            allowed = frozenset(forced)
        by_grad = self.freeze_mode == "requires_grad"
        filters = {
            "set_optimizer_parameter_filter": allowed,
            "set_trainable_parameter_filter": allowed if by_grad else None,
            "set_force_trainable_parameter_filter": frozenset(forced) if forced else None,
        }
        for name in filters:
            if not callable(getattr(workflow, name, None)):
                raise TypeError(
                    f"TrainableParameterHook needs a workflow with {name}(names); "
                    f"{type(workflow).__name__} has none (use a TrainingStrategy)."
                )
        for name, names in filters.items():
            getattr(workflow, name)(names)
        return allowed

    @staticmethod
    def _matches(names: list[str], patterns: tuple[str, ...], field: str) -> set[str]:
        matched: set[str] = set()
        for pattern in patterns:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                hint = ""
                if any(fnmatch.fnmatchcase(n, f"{pattern}.*") for n in names):
                    hint = f" To match every parameter of that module use '{pattern}.*'."
                raise ValueError(
                    f"{field} pattern {pattern!r} did not match any parameter. Patterns are "
                    "matched against fully qualified names like 'main.model.projection.weight' "
                    f"(no DDP 'module.' prefix); this strategy has e.g. {_examples(names)}.{hint}"
                )
            matched.update(hits)
        return matched


def _examples(names: list[str], limit: int = 6) -> list[str]:
    if len(names) <= limit:
        return names
    step = len(names) / limit
    return [names[int(i * step)] for i in range(limit)]


# ---------------------------------------------------------------------------- new heads
class AddHeadHook(_RegistrationHook):
    """Add readout heads to the strategy's multi-head models when registered.

    The models need ``add_head(name, copy_from)`` and ``head_names``
    (:class:`~nvalchemi.models.PaiNN`). Registering after optimizers were built raises
    ``RuntimeError``; a :class:`TrainableParameterHook` registered before is re-applied.

    Args:
        heads: ``{"<head>": copy_from}`` for model ``"main"`` or
            ``{"<model key>.<head>": copy_from}``; the new head starts as a copy of
            ``copy_from`` (``None``: the default head). Existing heads are left alone (a
            resumed run rebuilds its models with them). The last head added becomes the
            default: structures without a ``head`` field (the fine-tuning data) use it,
            replay structures name the source head.

    Example:
        >>> hook = AddHeadHook(heads={"dft": None})
        >>> hook.heads
        {'dft': None}
    """

    heads: dict[str, str | None] = Field(default_factory=dict)

    def on_register(self, workflow: Any) -> None:
        """Add the heads the models lack (all targets checked first)."""
        models = getattr(workflow, "models", None)
        if not isinstance(models, Mapping):
            raise TypeError("AddHeadHook needs a workflow whose models are a mapping (a strategy).")
        pending = []
        for target, copy_from in self.heads.items():
            key, head = target.rsplit(".", 1) if "." in target else ("main", target)
            if key not in models:
                raise KeyError(
                    f"AddHeadHook target {target!r}: unknown model key {key!r}; models: "
                    f"{sorted(models)}."
                )
            model = _patchable_root(models[key], key)
            names = getattr(model, "head_names", None)
            if names is None or not callable(getattr(model, "add_head", None)):
                raise TypeError(
                    f"AddHeadHook target {target!r}: {type(model).__name__} has no readout "
                    "heads (needs head_names and add_head, e.g. nvalchemi.models.PaiNN)."
                )
            if head in names:
                continue
            if copy_from is not None and copy_from not in names:
                raise ValueError(
                    f"AddHeadHook target {target!r}: copy_from={copy_from!r} is not a head of "
                    f"model {key!r} (heads: {list(names)})."
                )
            pending.append((model, head, copy_from))
        if not pending:
            return
        if getattr(workflow, "optimizers_built", False):
            raise RuntimeError(
                "AddHeadHook must be registered before optimizers are built; the new heads "
                "would not be optimized. Use FineTuningStrategy(new_heads=...)."
            )
        for model, head, copy_from in pending:
            model.add_head(head, copy_from=copy_from, make_default=True)
        self._reapply_parameter_filters(workflow)


# ---------------------------------------------------------------------------- forgetting
class ForgettingHook:
    """Error on held-out data of the source's domain: before the fine-tune, and as it goes.

    At ``BEFORE_TRAINING`` (once: the value is checkpointed, a resumed run keeps it) it
    evaluates the models on ``holdout`` with the strategy's loss and validation metrics;
    at every ``AFTER_VALIDATION`` again, adding ``summary[name] = {"<metric>": now,
    "<metric>_before": ..., "<metric>_increase": ...}`` for the MAE/RMSE metrics, which
    the reporters write (``FineTuningStrategy`` puts this hook before them); at
    ``AFTER_TRAINING`` it fills :attr:`result`. Under DDP every rank evaluates.

    Args:
        holdout: re-iterable batches the fine-tune never trains on (e.g. held-out
            replay data); may be set later (``hook.holdout = loader``), before the run.
        name: the key under which the numbers appear.

    Example:
        >>> hook = ForgettingHook()
        >>> hook.result is None
        True
    """

    frequency = 1
    stage = None
    _STAGES = ("BEFORE_TRAINING", "AFTER_VALIDATION", "AFTER_TRAINING")

    def __init__(self, holdout: Any = None, *, name: str = "forgetting") -> None:
        self.holdout = holdout
        self.name = str(name)
        self.before: dict[str, float] | None = None
        self.after: dict[str, float] | None = None
        self._latest: tuple[int, dict[str, float]] | None = None
        self._workflow: Any = None

    def _runs_on_stage(self, stage: Any) -> bool:
        return getattr(stage, "name", None) in self._STAGES

    def on_register(self, workflow: Any) -> None:
        self._workflow = workflow

    def state_dict(self) -> dict[str, Any]:
        return {"before": self.before}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        before = state.get("before")
        self.before = None if before is None else {k: float(v) for k, v in before.items()}

    @property
    def result(self) -> dict[str, dict[str, float]] | None:
        """``{"before": ..., "after": ..., "increase": ...}`` once the run ended, else ``None``."""
        if self.before is None or self.after is None:
            return None
        return {
            "before": dict(self.before),
            "after": dict(self.after),
            "increase": {k: self.after[k] - v for k, v in self.before.items() if k in self.after},
        }

    def __call__(self, ctx: Any, stage: Any) -> None:
        name = getattr(stage, "name", "")
        workflow = getattr(ctx, "workflow", None) or self._workflow
        if name == "BEFORE_TRAINING":
            if self.before is None:
                self.before = self.evaluate(workflow)
            return
        now = self.evaluate(workflow)
        if name == "AFTER_TRAINING":
            self.after = now
            return
        summary = getattr(ctx, "validation", None)
        if isinstance(summary, dict) and self.before is not None:
            entry = {}
            for key, value in now.items():
                entry[key] = value
                if key in self.before:
                    entry[f"{key}_before"] = self.before[key]
                    entry[f"{key}_increase"] = value - self.before[key]
            summary[self.name] = entry

    def evaluate(self, workflow: Any) -> dict[str, float]:
        """The MAE/RMSE metrics of ``workflow``'s models on ``holdout`` now (cached per step)."""
        if self.holdout is None:
            raise RuntimeError(
                "ForgettingHook has no holdout data; pass ForgettingHook(holdout=loader) or set "
                "hook.holdout before the run."
            )
        step = int(getattr(workflow, "step_count", 0))
        if self._latest is not None and self._latest[0] == step:
            return dict(self._latest[1])
        config = ValidationConfig(validation_data=self.holdout, name=self.name)
        loop = ValidationLoop.from_training_strategy(workflow, config)
        with loop:
            summary = loop.execute()
        metrics = {
            key: float(value)
            for key, value in summary.items()
            if isinstance(key, str) and key.endswith(("_mae", "_rmse"))
        }
        metrics["loss"] = float(summary["total_loss"])
        self._latest = (step, metrics)
        return dict(metrics)
