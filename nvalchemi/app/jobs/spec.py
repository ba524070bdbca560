"""The job file of ``spec run``: :class:`TrainingJobSpec` (JSON or YAML).

A job names the model's source, the data, the outputs, the validation cadence, the
length (``minutes``, a time budget, or a fixed length in ``strategy``), the ``finetune``
block, what to check at the end (``evaluation``: the MD check) and the training recipe (``strategy``: a
:class:`~nvalchemi.training.strategy_payload.StrategyPayload`). Every block forbids
unknown keys and every structural error is reported at once; dotted paths are resolved
later by :mod:`nvalchemi.app.jobs.resolve`.

Example:
    >>> job = TrainingJobSpec.model_validate({
    ...     "workflow": "train",
    ...     "source": {"model": "custom"},
    ...     "dataset": {"path": "data/train.extxyz", "val_fraction": 0.1},
    ...     "output": {"run_dir": "runs/demo"},
    ...     "strategy": {"optimizer_configs": {}, "devices": ["cpu"], "loss_fn_spec": {}},
    ...     "minutes": 10,
    ... })
    >>> job.dataset.all_paths, job.output.checkpoint_root
    (['data/train.extxyz'], 'runs/demo/checkpoints')
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nvalchemi.app.md_check import MDCheckSettings
from nvalchemi.training.strategy_payload import FINETUNE_KEYS, StrategyPayload, with_timestamps

__all__ = [
    "BalanceSpec",
    "DatasetSpec",
    "DistributedSpec",
    "EvaluationSpec",
    "FineTuneSpec",
    "MDCheckSpec",
    "MaceSourceOptions",
    "OutputSpec",
    "ReplaySpec",
    "RuntimeHookSpec",
    "SourceSpec",
    "TrainingJobSpec",
    "ValidationSpec",
    "FINETUNE_KEYS",
    "StrategyPayload",
    "dump_job",
    "read_job_file",
    "section_schemas",
    "stage_name",
]

ModelSource = Literal["native-checkpoint", "mace", "custom"]
Logger = Literal["tensorboard", "wandb", "mlflow"]
"""An experiment tracker a run can log to (``output.loggers``, ``--logger``)."""
DataFormat = Literal["auto", "extxyz", "ase-db", "alchemi-zarr", "alchemi-zarr-multidataset"]


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class RuntimeHookSpec(_Block):
    """One hook of ``source.hooks``: a spec (``cls_path`` + constructor kwargs) and stages.

    A bare spec dict (with an optional ``stages`` or ``stage`` key) is accepted too. Stages
    are ``TrainingStage`` names (``"AFTER_EPOCH"``) or ints; one hook is built per stage.
    """

    spec: dict[str, Any] = Field(
        json_schema_extra={"additionalProperties": True},
        description="cls_path, timestamp and constructor keyword arguments of the hook",
    )
    stages: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _bare_spec(cls, data: Any) -> Any:
        if isinstance(data, dict) and "cls_path" in data and "spec" not in data:
            data = dict(data)
            stages = data.pop("stages", None)
            stage = data.pop("stage", None)
            if stages is None:
                stages = [] if stage is None else [stage]
            return {"spec": data, "stages": stages}
        return data

    @field_validator("spec")
    @classmethod
    def _has_cls_path(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(value.get("cls_path"), str) or not value["cls_path"]:
            raise ValueError(
                "a hook spec needs 'cls_path' (the dotted path of the hook class, e.g. "
                "'nvalchemi.training.hooks.checkpoint.CheckpointHook')"
            )
        return with_timestamps(value)

    @field_validator("stages", mode="before")
    @classmethod
    def _stage_names(cls, value: Any) -> Any:
        if value is None:
            return []
        return [stage_name(s) for s in (value if isinstance(value, (list, tuple)) else [value])]


def stage_name(stage: Any) -> str:
    """The ``TrainingStage`` name of ``stage`` (a name, ``"TrainingStage.X"`` or an int)."""
    from nvalchemi.training.stages import TrainingStage

    if isinstance(stage, int) and not isinstance(stage, bool):
        with contextlib.suppress(ValueError):
            return TrainingStage(stage).name
    name = str(stage).removeprefix("TrainingStage.").upper()
    if name not in TrainingStage.__members__:
        raise ValueError(f"unknown stage {stage!r}; use one of {list(TrainingStage.__members__)}")
    return name


class MaceSourceOptions(_Block):
    """MACE-only source options: override the model's reference energies (at most one)."""

    atomic_energies: dict[str, float] | None = None
    atomic_energies_path: str | None = None

    @model_validator(mode="after")
    def _at_most_one(self) -> MaceSourceOptions:
        if self.atomic_energies is not None and self.atomic_energies_path is not None:
            raise ValueError("give atomic_energies or atomic_energies_path, not both")
        return self


class SourceSpec(_Block):
    """Where the model comes from and which runtime hooks the run gets."""

    model: ModelSource = Field(
        default="custom",
        description="custom: model_specs in strategy (train, or finetune with a weights file); "
        "native-checkpoint: an nvalchemi checkpoint directory; mace: a mace-torch model file",
    )
    checkpoint_path: str | None = None
    model_id: str | None = None
    checkpoint_index: int | Literal["latest", "best"] = -1
    compile_model: bool | None = None
    use_original_loss: bool = False
    use_original_opt_class: bool = False
    optimizer_lr: float | None = Field(default=1e-5, gt=0)
    fit_to_data: bool = Field(
        default=False,
        description="train jobs: build models whose class has from_data(train_data, **kwargs) "
        "(e.g. PaiNN) by fitting elements, reference energies and scale/shift on the "
        "training set; values given in the model spec are kept",
    )
    hooks: list[RuntimeHookSpec] = Field(default_factory=list)
    mace: MaceSourceOptions | None = None
    active_outputs: list[Literal["energy", "forces", "stress"]] | None = Field(
        default=None,
        description="fine-tunes: outputs the model computes while training (e.g. add "
        "'stress' for a stress loss; default: the model's own setting); train jobs set "
        "strategy.model_specs.main.active_outputs instead",
    )

    @model_validator(mode="before")
    @classmethod
    def _endpoint_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "endpoint" in data:
            data = dict(data)
            endpoint = data.pop("endpoint")
            if "model" in data and data["model"] != endpoint:
                raise ValueError(
                    f"'endpoint' ({endpoint!r}) and 'model' ({data['model']!r}) disagree; "
                    "keep only 'model'"
                )
            data["model"] = endpoint
        return data

    @model_validator(mode="after")
    def _mace_options(self) -> SourceSpec:
        if self.mace is not None and self.model != "mace":
            raise ValueError("'mace' options are only valid when model is 'mace'")
        return self


class _Files(_Block):
    path: str | None = None
    paths: list[str] = Field(default_factory=list)

    @property
    def all_paths(self) -> list[str]:
        """``paths``, else ``[path]``."""
        return list(self.paths) if self.paths else [str(self.path)]


def _block_or_flag(value: Any) -> Any:
    """An optional block written as a flag: ``true`` is the block's defaults, ``false`` none."""
    if value is True:
        return {}
    if value is False:
        return None
    return value


class BalanceSpec(_Block):
    """``dataset.balance``: draw the groups of the training data (``group_by``, an extxyz/db
    info key) in proportion to ``count ** alpha`` (:class:`GroupBalancedSampler`): rare groups
    are seen more often, epochs keep their length."""

    group_by: str = Field(
        default="config_type", min_length=1, description="info key whose values are the groups"
    )
    alpha: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="1: in proportion to size (as without balancing); 0: every group equally often",
    )


class DatasetSpec(_Files):
    """Training data (several paths: one ``MultiDataset``), and validation data from
    ``validation_path`` (files of their own) or ``val_fraction`` (a seeded split), not both."""

    format: DataFormat = "auto"
    validation_path: str | list[str] | None = None
    val_fraction: float | None = Field(default=None, gt=0, lt=1)
    seed: int = Field(
        default=0,
        description="seed of the run: the validation split, shuffling and (spec run) model "
        "initialisation, so the same job gives the same model",
    )
    batch_size: int | Literal["auto"] = Field(
        default=8,
        description="structures per batch; 'auto': batches by an atom/edge budget that "
        "spec run finds by probing the model's peak memory on the training device "
        "(written to <run_dir>/batch_budget.json)",
    )
    max_atoms: int | None = Field(
        default=None, ge=1, description="batches of at most this many atoms (BudgetBatchSampler)"
    )
    max_edges: int | None = Field(
        default=None, ge=1, description="batches of at most this many neighbour pairs"
    )
    shuffle: bool = True
    num_workers: int = Field(default=0, ge=0)
    in_memory: bool = Field(
        default=False, description="load every structure once into memory (small data sets)"
    )
    max_structures: int | None = Field(
        default=None, ge=1, description="use only the first N structures of each file"
    )
    dtype: Literal["float32", "float64"] = Field(
        default="float32", description="dtype of positions and labels read from ASE formats"
    )
    label_keys: dict[str, str] = Field(
        default_factory=dict,
        description="ASE formats: where labels live, e.g. {'energy': 'REF_energy'}",
    )
    config_type_weights: dict[str, float] | None = Field(
        default=None,
        description="loss weight of the structures of each config_type (extxyz/db info), "
        "e.g. {'slab111': 3.0}; multiplies their config_weight; unlisted types: 1",
    )
    balance: BalanceSpec | None = Field(
        default=None,
        description="draw rare structure groups more often (see docs/weights.md); "
        "true for the defaults",
    )

    @field_validator("config_type_weights")
    @classmethod
    def _weights(cls, value: Any) -> Any:
        from nvalchemi.data.weights import check_config_type_weights

        return check_config_type_weights(value)

    @field_validator("balance", mode="before")
    @classmethod
    def _balance_flag(cls, value: Any) -> Any:
        return _block_or_flag(value)

    @field_validator("batch_size")
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be >= 1, or 'auto'")
        return value

    @property
    def budget(self) -> bool:
        """Whether batches are formed by an atom/edge budget instead of a structure count."""
        return self.batch_size == "auto" or self.max_atoms is not None or self.max_edges is not None

    @model_validator(mode="after")
    def _paths(self) -> DatasetSpec:
        if self.batch_size == "auto" and (self.max_atoms or self.max_edges):
            raise ValueError("batch_size 'auto' finds max_atoms / max_edges; give one or the other")
        if self.path is None and not self.paths:
            raise ValueError("give 'path' (one file or store) or 'paths' (several)")
        if self.path is not None and self.paths and self.path not in self.paths:
            raise ValueError(f"'path' ({self.path!r}) must be one of 'paths' when both are given")
        if self.path is None and len(self.paths) == 1:
            self.path = self.paths[0]
        if self.validation_path is not None and self.val_fraction is not None:
            raise ValueError("use only one of 'validation_path' and 'val_fraction'")
        unknown = sorted(set(self.label_keys) - {"energy", "forces", "stress", "virials"})
        if unknown:
            raise ValueError(
                f"label_keys has unknown labels {unknown}; use energy, forces, stress, virials"
            )
        return self

    @property
    def validation_paths(self) -> list[str]:
        """The validation paths (empty when there are none or a fraction is used)."""
        if self.validation_path is None:
            return []
        if isinstance(self.validation_path, str):
            return [self.validation_path]
        return list(self.validation_path)

    @property
    def has_validation(self) -> bool:
        return bool(self.validation_paths) or self.val_fraction is not None

    def open_sources(self, validation_paths: list[str] | tuple[str, ...] = ()) -> Any:
        """Readers of this data (close them); ``validation_paths`` replace the block's own."""
        from nvalchemi.data.sources import open_sources

        return open_sources(
            self.all_paths,
            validation_paths=list(validation_paths or self.validation_paths),
            val_fraction=None if validation_paths else self.val_fraction,
            seed=self.seed,
            format=self.format,
            dtype=self.dtype,
            label_keys=self.label_keys,
            max_structures=self.max_structures,
            config_type_weights=self.config_type_weights,
        )


class OutputSpec(_Block):
    """Where the run writes (``run_dir``); ``checkpoint_dir`` records where the job's
    ``CheckpointHook`` writes (``spec report`` checks they agree)."""

    run_dir: str
    checkpoint_dir: str | None = None
    report_path: str | None = None
    log_every_n_steps: int = Field(default=10, ge=1)
    tensorboard: bool | None = Field(
        default=None, description="write TensorBoard events (default: when installed)"
    )
    loggers: list[Logger] | None = Field(
        default=None,
        description="experiment trackers the run logs to: tensorboard, wandb, mlflow "
        "(default: tensorboard when installed; [] for none; --logger replaces the list)",
    )
    group_by: str | None = Field(
        default=None,
        description="info key of the structures (extxyz/db) that the final evaluation breaks "
        "errors down by (default: config_type when the data has it, else atom-count ranges)",
    )
    plots: bool = Field(
        default=True,
        description="write learning curves and, with validation data, parity plots of the "
        "final model (PNGs in run_dir) at the end",
    )

    @model_validator(mode="after")
    def _tensorboard_agrees(self) -> OutputSpec:
        if self.loggers is not None:
            self.loggers = list(dict.fromkeys(self.loggers))
            if self.tensorboard is not None and self.tensorboard != ("tensorboard" in self.loggers):
                raise ValueError(
                    f"tensorboard: {str(self.tensorboard).lower()} disagrees with loggers: "
                    f"{self.loggers}; list the trackers in loggers only"
                )
        return self

    @property
    def checkpoint_root(self) -> str:
        """``checkpoint_dir``, else ``<run_dir>/checkpoints``."""
        return self.checkpoint_dir or str(Path(self.run_dir) / "checkpoints")


class ValidationSpec(_Block):
    """Validation cadence (neither field: validate only at the end)."""

    every_n_epochs: int | None = Field(default=None, ge=1)
    every_n_steps: int | None = Field(default=None, ge=1)
    use_ema: Literal["auto", "always", "never"] = "auto"

    @model_validator(mode="after")
    def _one_cadence(self) -> ValidationSpec:
        if self.every_n_epochs is not None and self.every_n_steps is not None:
            raise ValueError("use only one of every_n_epochs and every_n_steps")
        return self


class DistributedSpec(_Block):
    """Multi-rank runs: how long a collective may wait for a rank before the run fails."""

    timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="seconds every collective waits for the other ranks before the run fails "
        "naming the silent rank (default: NVALCHEMI_DIST_TIMEOUT_S, else 600); --dist-timeout "
        "overrides it",
    )


class ReplaySpec(_Files):
    """Replay data mixed into a fine-tune against forgetting (``finetune.replay``)."""

    pseudo_label: bool = Field(
        default=True,
        description="label the replay structures with the source model (once, cached in "
        "<run_dir>/replay_labels.zarr); false: use the labels in the files",
    )
    ratio: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="share of every batch drawn from replay (default: in proportion to size)",
    )
    weight: float = Field(default=1.0, ge=0, description="loss weight of replay structures")
    holdout_fraction: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        description="held out of replay (never trained on) to measure forgetting",
    )
    max_structures: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _some_path(self) -> ReplaySpec:
        if self.path is None and not self.paths:
            raise ValueError("finetune.replay needs 'path' (a file) or 'paths' (several)")
        return self


class FineTuneSpec(_Block):
    """What a fine-tune keeps of its source: reference energies, heads, replay.

    ``e0``: ``keep`` (the source's; new elements fitted), ``refit`` (on the new data),
    ``estimated`` (the source's plus the fitted offset of the new labels), ``fixed``.
    """

    e0: Literal["keep", "refit", "estimated", "fixed"] = "keep"
    atomic_energies: dict[str, float] | None = Field(
        default=None, description="e0 'fixed': {element: E0 in eV}"
    )
    scale_shift: Literal["keep", "refit"] = "keep"
    head: str | None = Field(
        default=None,
        description="add a readout head of this name (a copy of source_head) and train it on "
        "the new data; the source head keeps predicting the source's level of theory",
    )
    source_head: str | None = Field(
        default=None, description="the source's head to copy and to pseudo-label with"
    )
    trunk_lr_scale: float | None = Field(
        default=None,
        ge=0,
        description="learning rate of everything but the trained head, relative to lr "
        "(0 freezes it)",
    )
    replay: ReplaySpec | None = None
    parity_structures: int = Field(
        default=4,
        ge=0,
        description="structures of the new data for the zero-step parity check before "
        "training (0: skip)",
    )

    @model_validator(mode="after")
    def _fixed_values(self) -> FineTuneSpec:
        if (self.e0 == "fixed") != (self.atomic_energies is not None):
            raise ValueError(
                "finetune.atomic_energies gives the values of e0 'fixed' (and only of it)"
            )
        return self


class MDCheckSpec(MDCheckSettings):
    """``evaluation.md``: the MD check of the final model at the end of ``spec run`` (on the
    validation data, else the training data), and with ``every_n_validations`` a short one
    during training (:class:`~nvalchemi.app.md_check.MDCheckHook`). Every other key is an
    :class:`~nvalchemi.app.md_check.MDCheckSettings` field."""

    every_n_validations: int | None = Field(
        default=None,
        ge=1,
        description="also run a short check (the highest temperature, one structure per "
        "group, 0.2 ps NVT + 0.1 ps NVE) at every K-th validation: validation/md/* curves",
    )

    def settings(self) -> MDCheckSettings:
        """The check's settings (without the training cadence)."""
        return MDCheckSettings.model_validate(self.model_dump(exclude={"every_n_validations"}))


class EvaluationSpec(_Block):
    """What ``spec run`` checks at the end besides the errors on the validation data."""

    md: MDCheckSpec | None = Field(
        default=None,
        description="the MD check (true or {} for the defaults: 300 and 900 K, one structure "
        "per group, 0.4 ps NVT then 0.2 ps NVE)",
    )

    @field_validator("md", mode="before")
    @classmethod
    def _flag(cls, value: Any) -> Any:
        return _block_or_flag(value)


class TrainingJobSpec(_Block):
    """A complete training or fine-tuning job for ``nvalchemi-training spec run``."""

    model_config = ConfigDict(extra="forbid", title="TrainingJobSpec")

    name: str = "training-job"
    workflow: Literal["train", "finetune"]
    minutes: float | None = Field(
        default=None,
        gt=0,
        description="time budget: the run's length and learning-rate schedule are fitted to "
        "it after timing the first steps (validation included); with strategy.num_steps / "
        "num_epochs set, those win and the budget is only a cap (--minutes overrides it)",
    )
    imports: list[str] = Field(
        default_factory=list,
        description="modules of your own code (next to the job file or in the working "
        "directory; never the standard library or installed packages unless --trust) whose "
        "classes and functions this job names, e.g. [common]: they pass the import trust rule",
    )
    source: SourceSpec
    dataset: DatasetSpec
    output: OutputSpec
    validation: ValidationSpec | None = None
    distributed: DistributedSpec | None = None
    finetune: FineTuneSpec | None = None
    evaluation: EvaluationSpec | None = None
    strategy: StrategyPayload = Field(
        description="the training recipe: a TrainingStrategy.to_spec_dict()-shaped payload "
        "plus fine-tuning keys (see nvalchemi.training.strategy_payload)",
    )
    notes: str | None = None

    @model_validator(mode="after")
    def _combinations(self) -> TrainingJobSpec:
        source = self.source
        if self.workflow == "train":
            if source.model != "custom":
                raise ValueError(
                    f"source.model must be 'custom' for workflow 'train' (got {source.model!r}); "
                    "to start from trained weights use workflow 'finetune'"
                )
            if source.checkpoint_path or source.model_id:
                raise ValueError(
                    "workflow 'train' starts from scratch: remove source.checkpoint_path / "
                    "source.model_id, or use workflow 'finetune'"
                )
        else:
            if source.model in ("native-checkpoint", "custom") and not source.checkpoint_path:
                raise ValueError(
                    f"source.checkpoint_path is required for a {source.model!r} fine-tune"
                )
            if source.model == "mace" and not (source.model_id or source.checkpoint_path):
                raise ValueError("a 'mace' fine-tune needs source.checkpoint_path (a model file)")
        if source.model != "native-checkpoint":
            for flag in ("use_original_loss", "use_original_opt_class"):
                if getattr(source, flag):
                    raise ValueError(
                        f"source.{flag} only applies to 'native-checkpoint' fine-tunes "
                        f"(source.model is {source.model!r}); remove it"
                    )
        if self.finetune is not None and self.workflow != "finetune":
            raise ValueError("the 'finetune' block only applies to workflow 'finetune'; remove it")
        if source.fit_to_data and self.workflow != "train":
            raise ValueError("source.fit_to_data only applies to workflow 'train'; remove it")
        if self.validation is not None and not self.dataset.has_validation:
            raise ValueError(
                "a validation block needs validation data: set dataset.validation_path or "
                "dataset.val_fraction"
            )
        payload = self.strategy
        reuse = {
            "optimizer_configs": self.source.use_original_opt_class,
            "loss_fn_spec": self.source.use_original_loss,
        }
        missing = [k for k, reused in reuse.items() if not reused and getattr(payload, k) is None]
        if missing:
            raise ValueError(
                f"strategy is missing {missing}; scaffold a job with `nvalchemi-training train "
                "init` or `finetune init` to see a complete payload"
            )
        if payload.num_epochs is None and payload.num_steps is None and self.minutes is None:
            raise ValueError(
                "the job has no length: set minutes (a time budget the run is fitted to), or "
                "strategy.num_steps / strategy.num_epochs"
            )
        return self

    @classmethod
    def template(
        cls,
        workflow: str = "train",
        model: str = "custom",
        *,
        dataset: str | Sequence[str] | None = None,
        output_dir: str | None = None,
        source_path: str | None = None,
        model_id: str | None = None,
        lr: float = 1e-5,
        num_steps: int | None = 1000,
        num_epochs: int | None = None,
        device: str = "auto",
        trainable_patterns: Sequence[str] = (),
        compile_model: bool | None = None,
        hooks: Sequence[Mapping[str, Any]] = (),
    ) -> Any:
        """A complete, valid job.

        Called bare (no ``dataset``/``output_dir``): a dict with placeholder paths, what
        ``train init`` writes, or for ``workflow="finetune"`` what ``finetune init`` writes
        for that source ``model`` (``schema template`` prints it).

        With ``dataset`` and ``output_dir`` (the reference's keywords): a
        :class:`TrainingJobSpec` for that data, from ``source_path`` (a checkpoint
        directory or model file) or ``model_id``, with AdamW at ``lr``, ``num_steps``
        (or ``num_epochs``), ``trainable_patterns``, ``source.compile_model`` and extra
        ``source.hooks`` (spec dicts) besides the checkpoint hook; a ``train`` job
        leaves ``strategy.model_specs`` for you to fill. ``device`` ``"auto"``: cuda when
        available.

        Example:
            >>> job = TrainingJobSpec.template()
            >>> job["workflow"], job["minutes"], sorted(job["strategy"]["model_specs"])
            ('train', 10.0, ['main'])
            >>> spec = TrainingJobSpec.template(workflow="finetune", model="native-checkpoint",
            ...     dataset="data/new.extxyz", output_dir="runs/ft", source_path="runs/pre/ckpt")
            >>> spec.name, spec.source.checkpoint_path, spec.strategy.num_steps
            ('native-checkpoint-fine-tune', 'runs/pre/ckpt', 1000)
        """
        if dataset is None and output_dir is None:
            given = {
                "source_path": source_path,
                "model_id": model_id,
                "num_epochs": num_epochs,
                "compile_model": compile_model,
                "trainable_patterns": tuple(trainable_patterns) or None,
                "hooks": tuple(hooks) or None,
            }
            extra = sorted(k for k, v in given.items() if v is not None)
            if extra:
                raise TypeError(
                    f"TrainingJobSpec.template() got {extra} without dataset= and output_dir=; "
                    "give both for a job of your data, or call it bare for the placeholder job."
                )
            from nvalchemi.app.jobs.scaffold import template_job

            return cls.model_validate(template_job(workflow, model)).model_dump(
                mode="json", exclude_none=True
            )
        if dataset is None or output_dir is None:
            raise TypeError("TrainingJobSpec.template() needs both dataset= and output_dir=.")
        from nvalchemi.app.devices import resolve_device
        from nvalchemi.app.jobs.scaffold import scaffold_job

        source = {
            key: value
            for key, value in (
                ("checkpoint_path", source_path),
                ("model_id", model_id),
                ("compile_model", compile_model),
            )
            if value is not None
        }
        data = scaffold_job(
            workflow,
            model,
            datasets=[dataset] if isinstance(dataset, str) else list(dataset),
            output_dir=str(output_dir),
            source=source,
            name=f"{model}-fine-tune" if workflow == "finetune" else "train-from-scratch",
            lr=lr,
            num_steps=None if num_epochs is not None else num_steps,
            num_epochs=num_epochs,
            device=resolve_device(device),
            trainable_patterns=tuple(trainable_patterns),
        )
        data["source"]["hooks"] += [dict(hook) for hook in hooks]
        return cls.model_validate(data)

    @property
    def patterns(self) -> tuple[list[str], list[str]]:
        """``(freeze_patterns, trainable_patterns)`` of the payload."""
        return list(self.strategy.freeze_patterns), list(self.strategy.trainable_patterns)

    @property
    def uses_finetuning_features(self) -> bool:
        """Whether the payload asks for patterns or module patches."""
        freeze, trainable = self.patterns
        return bool(freeze or trainable or self.strategy.module_patches)


def read_job_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a ``.json``/``.yaml``/``.yml`` job file (``ValueError`` if unparsable)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"job file {path} does not exist; create one with `nvalchemi-training train init "
            "... --out job.yaml`"
        )
    text = path.read_text()
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:
        message = " ".join(str(exc).split())
        raise ValueError(f"Could not parse {path}: {message}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} must hold a mapping (a JSON object / YAML mapping) at the top level; got "
            f"{type(data).__name__}"
        )
    return data


def dump_job(
    job: TrainingJobSpec | dict[str, Any],
    path: str | Path | None = None,
    *,
    only_set: bool = False,
) -> str:
    """The job as JSON or, for a ``.yaml``/``.yml`` path, YAML; written if ``path``.
    ``only_set=True`` leaves out fields that were never set (for files people edit)."""
    if isinstance(job, BaseModel):
        data = job.model_dump(mode="json", exclude_none=True, exclude_unset=only_set)
    else:
        data = job
    if path is not None and Path(path).suffix.lower() in (".yaml", ".yml"):
        import yaml

        text = yaml.safe_dump(data, sort_keys=False)
    else:
        text = json.dumps(data, indent=2) + "\n"
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    return text


def section_schemas() -> dict[str, Any]:
    """``{section: JSON schema}`` for every top-level key of a job file, in file order.

    Example:
        >>> schemas = section_schemas()
        >>> list(schemas)[:3], schemas["dataset"]["title"]
        (['name', 'workflow', 'minutes'], 'DatasetSpec')
    """
    from pydantic import TypeAdapter

    out = {}
    for name, info in TrainingJobSpec.model_fields.items():
        schema = TypeAdapter(info.annotation).json_schema()
        if info.description and "description" not in schema:
            schema["description"] = info.description
        out[name] = schema
    return out
