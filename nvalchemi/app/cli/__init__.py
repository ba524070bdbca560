"""The ``nvalchemi-training`` command line (``nvalchemi-training --help`` lists the commands).

``quickstart``; ``train init`` / ``finetune init``, ``finetune check``; ``spec report|run|
resume``; ``schema dump|template``; ``data convert|check|stats``; ``evaluate``; ``export``;
``learn``; ``bench``.
Also runnable as ``python -m nvalchemi.training.cli``. Importing it loads click and
pydantic only. What a command computes is a library function
(:mod:`nvalchemi.app.jobs`, :mod:`nvalchemi.app.evaluation`,
:mod:`nvalchemi.data.sources`, ...); this package holds commands, options and printing.
"""

from nvalchemi.app.cli import (  # noqa: F401  (registers the commands)
    bench_cmd,
    data_cmds,
    evaluate_cmd,
    export_cmd,
    init_cmds,
    learn_cmd,
    quickstart,
    spec_cmds,
)
from nvalchemi.app.cli._app import main
from nvalchemi.app.jobs.spec import TrainingJobSpec

__all__ = ["TrainingJobSpec", "main"]
