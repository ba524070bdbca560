"""The ``nvalchemi-training`` command line.

Commands (``nvalchemi-training --help`` lists them; each has ``--help``):

* ``quickstart``: train PaiNN on the bundled EMT data set, evaluate, plot, and show the
  checkpoint as an ASE calculator;
* ``train init`` / ``finetune init {checkpoint,mace,custom}``: scaffold a job spec;
* ``spec report`` / ``spec run`` / ``spec resume``: explain, run and resume a job;
* ``schema dump`` / ``schema template``: the job-spec JSON schema and a template;
* ``data convert`` / ``data stats``: extxyz / ASE db -> zarr store; data statistics;
* ``evaluate``: errors overall, per structure type, element, file and force magnitude,
  and parity plots of a checkpoint;
* ``bench``: throughput, memory, loader share and precision candidates of a job or model.

Also runnable as ``python -m nvalchemi.training.cli``. Importing this package loads
click and pydantic only; commands import torch and the rest when they run. What a
command computes is a library function: :mod:`nvalchemi.training.jobs` (job files, runs,
the quickstart), :mod:`nvalchemi.training.evaluation`, :mod:`nvalchemi.training.time_budget`,
:mod:`nvalchemi.data.sources`, :mod:`nvalchemi.data.convert`, :mod:`nvalchemi.data.inspect`.
"""

from nvalchemi.training.cli import (  # noqa: F401  (registers the commands)
    bench_cmd,
    data_cmds,
    evaluate_cmd,
    init_cmds,
    quickstart,
    spec_cmds,
)
from nvalchemi.training.cli._app import main
from nvalchemi.training.jobs.spec import TrainingJobSpec

__all__ = ["TrainingJobSpec", "main"]
