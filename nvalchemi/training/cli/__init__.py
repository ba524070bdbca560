"""The documented import path of the ``nvalchemi-training`` command (``nvalchemi.training.cli:main``).

The command line is the application, :mod:`nvalchemi.app.cli`; this package only re-exports
its entry point and the job schema so that the console script, ``python -m
nvalchemi.training.cli`` and scripts written for the reference API keep working. It is the
one place in ``nvalchemi.training`` that names the application.
"""

from nvalchemi.app.cli import TrainingJobSpec, main

__all__ = ["TrainingJobSpec", "main"]
