"""Job files: a whole training or fine-tuning run described in one JSON/YAML file.

What ``nvalchemi-training`` does with a job is a function here, usable from Python:

* :class:`TrainingJobSpec` (the file's schema; :meth:`TrainingJobSpec.template` is a
  complete job), :func:`load_job` (read, validate and resolve a file),
  :func:`scaffold_job` (what ``train init`` / ``finetune init`` write);
* :func:`job_warnings` (what ``spec report`` warns about), :func:`lr_preview`;
* :func:`run_job` (``spec run`` / ``spec resume``: data, strategy, hooks, validation, a
  time budget, reporting, the final evaluation);
* the quickstart pipeline (:mod:`nvalchemi.training.jobs.quickstart`) and its recipe
  (:mod:`nvalchemi.training.jobs.recipe`).

Example:
    >>> from nvalchemi.training.jobs import TrainingJobSpec, check_job
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
