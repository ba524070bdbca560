"""The job file of ``learn``: :class:`LearnJob` (YAML or JSON).

A learn job names where its state lives (``work_dir``), how many iterations to run, the
starting model and data (a ``train`` job, run first when its checkpoint is not there yet,
or a committee checkpoint plus data files), and the four parts of an iteration:
``explore`` (MD with the committee), ``select`` (trust levels on its max force deviation),
``label`` (an ASE calculator named by import path, in worker processes) and ``train``
(a fine-tune of the committee with replay of earlier data). Relative paths are relative
to the job file. Every block forbids unknown keys.

The labeller is code the job names: like every path a file names, it must pass the trust
rule, so list its package under ``imports`` (``imports: [ase.calculators.emt]``): your
job file is where you say you trust it.

Example:
    >>> job = LearnJob.model_validate({
    ...     "work_dir": "runs/learn",
    ...     "start": {"checkpoint": "runs/c/checkpoints", "train": ["data/train.extxyz"]},
    ...     "explore": {"structures": ["data/start.extxyz"], "temperatures": [600]},
    ...     "select": {"trust_lo": 0.05, "trust_hi": 0.3},
    ...     "label": {"calculator": "ase.calculators.emt.EMT"},
    ...     "imports": ["ase.calculators.emt"],
    ... })
    >>> job.iterations, job.select.max_structures, job.explore.stop_above(job.select)
    (3, 20, 0.6)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nvalchemi.app.md_check import MDCheckSettings

__all__ = [
    "ExploreSpec",
    "LabelSpec",
    "LearnJob",
    "LearnTrainSpec",
    "SelectSpec",
    "StartSpec",
    "read_learn_job",
]


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _as_list(value: Any) -> Any:
    """One path where a list of paths is expected."""
    return [value] if isinstance(value, str) else value


class StartSpec(_Block):
    """The committee and the labelled data the loop starts from.

    ``job``: a ``train`` job (``train init --committee N``); the loop runs it first when
    its checkpoint root holds no finished run, and takes its training data (``train``)
    and validation data unless given here. ``checkpoint``: a committee's checkpoint root
    instead; then ``train`` is required.
    """

    job: str | None = None
    checkpoint: str | None = None
    train: list[str] = Field(default_factory=list, description="labelled data files so far")
    validation: list[str] = Field(
        default_factory=list,
        description="validation files: calibration of the spread after every iteration",
    )
    test: list[str] = Field(
        default_factory=list, description="held-out files: test errors after every iteration"
    )

    @field_validator("train", "validation", "test", mode="before")
    @classmethod
    def _one_path(cls, value: Any) -> Any:
        return _as_list(value)

    @model_validator(mode="after")
    def _one_source(self) -> StartSpec:
        if (self.job is None) == (self.checkpoint is None):
            raise ValueError("give start.job (a train job) or start.checkpoint, not both")
        if self.checkpoint is not None and not self.train:
            raise ValueError("start.checkpoint needs start.train (the data it was trained on)")
        return self


class ExploreSpec(_Block):
    """Molecular dynamics with the committee from every start structure, temperature and
    isotropic strain: Langevin NVT, a frame kept every ``every`` steps."""

    structures: list[str] = Field(description="files of start structures (extxyz, ASE db)")
    max_structures: int | None = Field(
        default=None,
        ge=1,
        description="start structures per file and iteration, taken in turn (iteration i: "
        "structures i*n to i*n+n-1, wrapping around); null: all of them every iteration",
    )
    temperatures: list[float] = Field(default_factory=lambda: [300.0])
    strains: list[float] = Field(
        default_factory=lambda: [0.0], description="isotropic strains of the cell, e.g. 0.02"
    )
    steps: int = Field(default=200, ge=1)
    every: int = Field(default=10, ge=1, description="steps between kept frames")
    timestep_fs: float = Field(default=2.0, gt=0)
    friction_per_fs: float = Field(default=0.02, gt=0)
    stop_deviation: float | None = Field(
        default=None,
        gt=0,
        description="end a trajectory at a frame whose max force deviation exceeds this "
        "(eV/Å; default: twice select.trust_hi): it has left what the model knows",
    )
    engine: Literal["auto", "torch-sim", "ase"] = Field(
        default="auto",
        description="auto: torch-sim (every trajectory in one batch) when installed, else "
        "ASE (one trajectory at a time)",
    )

    @field_validator("structures", mode="before")
    @classmethod
    def _one_path(cls, value: Any) -> Any:
        return _as_list(value)

    @field_validator("temperatures", "strains", mode="before")
    @classmethod
    def _one_value(cls, value: Any) -> Any:
        return [value] if isinstance(value, (int, float)) else value

    def stop_above(self, select: SelectSpec) -> float:
        """The deviation that ends a trajectory."""
        return self.stop_deviation if self.stop_deviation is not None else 2.0 * select.trust_hi


class SelectSpec(_Block):
    """Which frames are labelled: max force deviation (calibrated, eV/Å) in
    ``[trust_lo, trust_hi)``, at most ``max_structures`` per iteration, none closer than
    ``min_distance`` to another selected frame (a radial-distribution fingerprint)."""

    trust_lo: float = Field(gt=0)
    trust_hi: float = Field(gt=0)
    max_structures: int = Field(default=20, ge=1)
    min_distance: float = Field(
        default=0.05,
        ge=0,
        description="relative fingerprint difference below which a frame is a near-duplicate "
        "of one already selected (frames of one equilibrated MD run differ by 0.02-0.07)",
    )
    method: Literal["diverse", "deviation", "random"] = Field(
        default="diverse",
        description="diverse: farthest-point sampling of the candidates in fingerprint "
        "space, weighted by their uncertainty; deviation: the most uncertain candidates "
        "first; random: a random draw from every frame (the baseline of "
        "benchmarks/active_learning.py)",
    )
    score: Literal["forces", "forces+energy"] = Field(
        default="forces",
        description="a candidate's uncertainty: its max force deviation, or that plus its "
        "energy spread per atom (each over its median among the candidates)",
    )

    @model_validator(mode="after")
    def _ordered(self) -> SelectSpec:
        if self.trust_hi <= self.trust_lo:
            raise ValueError(
                f"select.trust_hi ({self.trust_hi}) must exceed select.trust_lo ({self.trust_lo})"
            )
        return self


class LabelSpec(_Block):
    """The reference method: an ASE calculator class (or factory) and its keyword arguments."""

    calculator: str = Field(description="import path, e.g. ase.calculators.emt.EMT")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    workers: int = Field(default=1, ge=1, description="labelling processes")
    stress: bool = Field(default=True, description="label the stress of periodic cells")


class LearnTrainSpec(_Block):
    """The fine-tune of every iteration: from the last committee, on the new labels with
    replay of every earlier label, for a fixed budget of ``steps``."""

    steps: int = Field(default=200, ge=1)
    lr: float = Field(default=1e-3, gt=0)
    warmup: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="share of the steps over which the learning rate rises to lr (then a "
        "cosine decay): a fresh optimizer's first steps are its largest",
    )
    batch_size: int = Field(default=8, ge=2)
    replay_ratio: float | None = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="share of every batch drawn from earlier labels (null: all labels "
        "shuffled together)",
    )
    checkpoint_every: int = Field(default=50, ge=1, description="steps between checkpoints")
    device: str = "cpu"


class LearnJob(_Block):
    """A complete active-learning job for ``nvalchemi-training learn``."""

    name: str = "learn"
    work_dir: str = Field(description="where the loop keeps its state, data and models")
    iterations: int = Field(default=3, ge=1)
    seed: int = 0
    imports: list[str] = Field(
        default_factory=list,
        description="modules whose code the job names (the labeller's package, your own "
        "code): they pass the import trust rule",
    )
    start: StartSpec
    explore: ExploreSpec
    select: SelectSpec
    label: LabelSpec
    train: LearnTrainSpec = Field(default_factory=LearnTrainSpec)
    md_check: MDCheckSettings | None = Field(
        default_factory=lambda: MDCheckSettings().short(),
        description="a short MD check of every iteration's committee (nvalchemi.app.md_check) "
        "on the test data (else the validation, else the training data), in the report; "
        "default: 0.2 ps NVT at 900 K then 0.1 ps NVE, one structure per group; null: none",
    )

    def resolve_paths(self, base: str | Path) -> LearnJob:
        """A copy whose relative paths are relative to ``base`` (the job file's folder)."""

        def fix(path: str) -> str:
            expanded = Path(path).expanduser()
            return os.path.normpath(expanded if expanded.is_absolute() else Path(base) / expanded)

        data = self.model_dump()
        data["work_dir"] = fix(data["work_dir"])
        start = data["start"]
        for key in ("job", "checkpoint"):
            if start[key] is not None:
                start[key] = fix(start[key])
        for key in ("train", "validation", "test"):
            start[key] = [fix(p) for p in start[key]]
        data["explore"]["structures"] = [fix(p) for p in data["explore"]["structures"]]
        return LearnJob.model_validate(data)


def read_learn_job(path: str | Path) -> LearnJob:
    """The :class:`LearnJob` in ``path`` with its paths made absolute; errors name the field.

    Raises:
        FieldError: the file is missing or unparsable, or a field is wrong.
    """
    from pydantic import ValidationError

    from nvalchemi._errors import FieldError, validation_lines
    from nvalchemi.app.jobs.spec import read_job_file

    try:
        data = read_job_file(path)
    except FileNotFoundError:
        raise FieldError(
            f"learn job file {path} does not exist",
            fix="write one (docs/active-learning.md, examples/learn/learn.yaml)",
        ) from None
    except ValueError as exc:
        raise FieldError(str(exc), fix="correct the file's syntax") from None
    try:
        job = LearnJob.model_validate(data)
    except ValidationError as exc:
        lines = validation_lines(exc, data)
        raise FieldError(
            f"{path}: " + "; ".join(lines),
            fix="correct those fields (docs/active-learning.md lists every field)",
        ) from None
    return job.resolve_paths(Path(path).resolve().parent)
