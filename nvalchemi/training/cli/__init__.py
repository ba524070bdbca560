"""The ``nvalchemi-training`` command line.

Commands (``nvalchemi-training --help`` lists them; each has ``--help``):

* ``quickstart``: train PaiNN on the bundled EMT data set, evaluate, plot, and show the
  checkpoint as an ASE calculator;
* ``train init`` / ``finetune init {checkpoint,mace,custom}``: scaffold a job spec;
* ``spec report`` / ``spec run`` / ``spec resume``: explain, run and resume a job;
* ``schema dump`` / ``schema template``: the job-spec JSON schema and a template;
* ``data convert`` / ``data stats``: extxyz / ASE db -> zarr store; data statistics;
* ``evaluate``: metrics, parity plots and per-element errors of a checkpoint.

Also runnable as ``python -m nvalchemi.training.cli``. Importing this package loads
click only; commands import torch and the rest when they run.
"""

from nvalchemi.training.cli import (  # noqa: F401  (registers the commands)
    data_cmds,
    evaluate_cmd,
    init_cmds,
    quickstart,
    spec_cmds,
)
from nvalchemi.training.cli._app import main

__all__ = ["main"]
