"""The application on top of the engine: the ``nvalchemi-training`` commands and what they compute.

:mod:`nvalchemi.app.cli` holds the commands (options and printing only);
:mod:`nvalchemi.app.jobs` the job files (schema, scaffolding, checks, running);
:mod:`nvalchemi.app.evaluation` the evaluation reports; :mod:`nvalchemi.app.bench` the
configuration benchmark; :mod:`nvalchemi.app.devices` the choice of device. Each is a library
a Python user can call. The engine (:mod:`nvalchemi.training` and the layers below it) never
imports this package.
"""
