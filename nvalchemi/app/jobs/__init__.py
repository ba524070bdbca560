"""Job files: a whole training or fine-tuning run described in one JSON/YAML file.

What ``nvalchemi-training`` does with a job is a function here, usable from Python:
:class:`TrainingJobSpec` (the schema), :func:`load_job` (read, validate, resolve),
:func:`scaffold_job` (``train init`` / ``finetune init``), :func:`job_warnings`
(``spec report``), :func:`lr_preview`, :func:`run_job` (``spec run`` / ``spec resume``),
and the quickstart pipeline (:mod:`.quickstart`, :mod:`.recipe`).

Example:
    >>> from nvalchemi.app.jobs import TrainingJobSpec, check_job
    >>> job = TrainingJobSpec.model_validate(TrainingJobSpec.template())
    >>> job.name, job.minutes
    ('train-painn', 10.0)
"""

from nvalchemi._lazy import lazy_exports

_EXPORTS = {
    "TrainingJobSpec": ".spec",
    "dump_job": ".spec",
    "read_job_file": ".spec",
    "section_schemas": ".spec",
    "ResolvedJob": ".resolve",
    "check_job": ".resolve",
    "load_job": ".resolve",
    "JobWarning": ".checks",
    "job_warnings": ".checks",
    "check_horizons": ".checks",
    "lr_preview": ".lr_preview",
    "scaffold_job": ".scaffold",
    "RunOptions": ".run",
    "RunResult": ".run",
    "run_job": ".run",
    "PaiNNRecipe": ".recipe",
    "QUICKSTART": ".recipe",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
