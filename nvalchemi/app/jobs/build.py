"""Build the strategy of a job (``spec run``), by workflow and model source.

``train`` builds the models from ``strategy.model_specs`` (fitted to the data with
``source.fit_to_data``), as a ``FineTuningStrategy`` when the job has freeze/trainable
patterns or module patches; ``finetune`` starts from a native checkpoint, a MACE model
file (a pickle: ``--trust``) or a custom model's state dict. ``finetune.head`` adds that
head as a copy of ``finetune.source_head``; the rest of the block is
:mod:`nvalchemi.app.jobs.finetune`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nvalchemi._errors import FieldError
from nvalchemi.app.jobs.spec import TrainingJobSpec
from nvalchemi.training.strategy_payload import parse_spec

__all__ = ["build_models", "build_strategy"]

_FIT_BATCH = 64
BUDGET_STEPS = 10**9
"""``num_steps`` of a strategy whose length a time budget decides (never reached)."""


def _fit_data(readers: list[Any]) -> Any:
    from nvalchemi.data.sources import ChainedBatches

    return ChainedBatches(readers, batch_size=_FIT_BATCH)


def build_models(
    model_specs: Mapping[str, Any],
    *,
    trust: bool,
    fit_readers: list[Any] | None = None,
    element_readers: list[Any] | None = None,
) -> dict[str, Any]:
    """``{key: model}`` from serialized specs.

    With ``fit_readers``, classes with ``from_data`` are built as
    ``cls.from_data(training data, **kwargs)``; their ``elements`` default to every element
    in ``fit_readers`` and ``element_readers`` (e.g. the validation data), so validation
    structures with an element the training split lacks still run.
    """
    from nvalchemi.models.statistics import data_elements

    models = {}
    for key, data in model_specs.items():
        where = f"strategy.model_specs.{key}"
        spec = parse_spec(data, where, trust)
        target = spec.target()
        try:
            if fit_readers is not None and callable(getattr(target, "from_data", None)):
                kwargs = spec.built_kwargs(target.from_data)
                if kwargs.get("elements") is None and element_readers:
                    zs = set(data_elements(_fit_data(fit_readers)))
                    zs |= set(data_elements(_fit_data(element_readers)))
                    kwargs["elements"] = sorted(zs)
                models[key] = target.from_data(_fit_data(fit_readers), **kwargs)
            else:
                models[key] = spec.build()
        except FieldError:
            raise
        except Exception as exc:
            message = " ".join(str(exc).split())
            fix = f"correct the keyword arguments under {where} (types and ranges)"
            raise FieldError(
                f"building {spec.cls_path} failed: {message}", field=where, fix=fix
            ) from None
    return models


def _single_or_mapping(models: dict[str, Any], job: TrainingJobSpec) -> Any:
    if set(models) == {"main"} and job.strategy.single_model_input:
        return models["main"]
    return models


def _payload(job: TrainingJobSpec, num_steps: int | None, *, finetuning: bool) -> dict[str, Any]:
    """The strategy payload with the run's length: ``num_steps`` wins, then the job's own
    length, else :data:`BUDGET_STEPS` (a time budget ends the run)."""
    spec = job.strategy.as_spec_dict(finetuning=finetuning)
    spec["model_specs"] = {}
    if num_steps is not None:
        spec.update(num_steps=num_steps, num_epochs=None)
    elif spec["num_steps"] is None and spec["num_epochs"] is None:
        spec["num_steps"] = BUDGET_STEPS
    return spec


def _train(
    job: TrainingJobSpec,
    sources: Any,
    hooks: list[Any],
    trust: bool,
    extra: dict,
    num_steps: int | None,
) -> Any:
    payload = job.strategy
    if not payload.model_specs:
        raise FieldError(
            "is empty, so there is no model to train (training-from-scratch jobs must name "
            "their model)",
            field="strategy.model_specs",
            fix="scaffold with `nvalchemi-training train init --model painn`, or add "
            "create_model_spec(MyModel, ...).model_dump() under strategy.model_specs.main",
        )
    fit = sources.train if job.source.fit_to_data else None
    models = build_models(
        payload.model_specs, trust=trust, fit_readers=fit, element_readers=sources.validation
    )
    finetuning = job.uses_finetuning_features
    if finetuning:
        from nvalchemi.training.finetune import FineTuningStrategy as cls
    else:
        from nvalchemi.training.strategy import TrainingStrategy as cls
    spec = _payload(job, num_steps, finetuning=finetuning)
    return cls.from_spec_dict(
        spec, models=_single_or_mapping(models, job), hooks=hooks, trust=trust, **extra
    )


def _mace_energies(job: TrainingJobSpec) -> dict[str, float] | None:
    options = job.source.mace
    if options is None:
        return None
    if options.atomic_energies is not None:
        return dict(options.atomic_energies)
    if options.atomic_energies_path:
        path = Path(options.atomic_energies_path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise FieldError(
                f"cannot read {path}: {exc}",
                field="source.mace.atomic_energies_path",
                fix='give a JSON file mapping elements to energies, e.g. {"Cu": -3.7}',
            ) from None
        if not isinstance(data, dict):
            raise FieldError(
                "must hold a JSON object {element: energy}",
                field="source.mace.atomic_energies_path",
            )
        return {str(k): float(v) for k, v in data.items()}
    return None


def _finetune(
    job: TrainingJobSpec,
    hooks: list[Any],
    trust: bool,
    map_location: str | None,
    extra: dict,
    num_steps: int | None,
) -> Any:
    from nvalchemi.training.finetune import FineTuningStrategy

    source, payload = job.source, job.strategy
    spec = _payload(job, num_steps, finetuning=True)
    spec.pop("model_specs")
    spec.pop("single_model_input")
    kwargs = {**spec, "hooks": hooks, **extra}
    if job.finetune is not None and job.finetune.head is not None:
        # The new head starts as a copy of the source head (zero-step parity).
        heads = dict(kwargs.get("new_heads") or {})
        heads.setdefault(job.finetune.head, job.finetune.source_head)
        kwargs["new_heads"] = heads
    if map_location is not None:
        kwargs["devices"] = [map_location]  # --map-location wins over strategy.devices
    device = map_location or str(payload.devices[0])
    if source.model == "native-checkpoint":
        root = Path(str(source.checkpoint_path))
        if not (root / "manifest.json").is_file():
            raise FieldError(
                f"{root} is not an nvalchemi checkpoint directory (no manifest.json)",
                field="source.checkpoint_path",
                fix="point it at the checkpoint root a CheckpointHook wrote (e.g. "
                "runs/pretrain/checkpoints)",
            )
        return FineTuningStrategy.from_pretrained_checkpoint(
            root,
            checkpoint_index=source.checkpoint_index,
            map_location=device,
            use_original_loss=source.use_original_loss,
            use_original_opt_class=source.use_original_opt_class,
            optimizer_lr=source.optimizer_lr,
            trust=trust,
            **kwargs,
        )
    if source.model == "mace":
        if not source.checkpoint_path:
            raise FieldError(
                f"named MACE models ({source.model_id!r}) are not downloaded by this build",
                field="source.model_id",
                fix="download the model file and set source.checkpoint_path to it",
            )
        if not trust:
            raise FieldError(
                f"MACE model files are Python pickles: loading {source.checkpoint_path} runs "
                "code from it",
                field="source.checkpoint_path",
                fix="pass --trust if you trust this file",
            )
        return FineTuningStrategy.from_mace(
            source.checkpoint_path,
            map_location=device,
            atomic_energies=_mace_energies(job),
            trust=trust,
            **kwargs,
        )
    if not payload.model_specs:
        raise FieldError(
            "is empty: a custom fine-tune rebuilds your model from its spec before loading "
            f"the weights in {source.checkpoint_path}",
            field="strategy.model_specs",
            fix="add create_model_spec(MyModel, ...).model_dump() under strategy.model_specs.main",
        )
    models = build_models(payload.model_specs, trust=trust)
    weights = Path(str(source.checkpoint_path))
    if not weights.is_file():
        raise FieldError(
            f"{weights} does not exist",
            field="source.checkpoint_path",
            fix="give a state-dict file written with torch.save(model.state_dict(), path)",
        )
    return FineTuningStrategy.from_pretrained_weights(
        _single_or_mapping(models, job), weights, trust=trust, **kwargs
    )


def build_strategy(
    job: TrainingJobSpec,
    *,
    sources: Any,
    hooks: list[Any],
    trust: bool = False,
    map_location: str | None = None,
    distributed_manager: Any = None,
    num_steps: int | None = None,
) -> Any:
    """The strategy ``spec run`` trains (validation and loaders are attached by the caller).

    ``num_steps`` replaces the job's length; a job without one (a time budget decides)
    gets :data:`BUDGET_STEPS`.
    """
    extra = {} if distributed_manager is None else {"distributed_manager": distributed_manager}
    if job.workflow == "train":
        if map_location is not None:
            extra["devices"] = [map_location]
        return _train(job, sources, hooks, trust, extra, num_steps)
    return _finetune(job, hooks, trust, map_location, extra, num_steps)
