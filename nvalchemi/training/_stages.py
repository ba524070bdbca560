"""Documented import path for :class:`TrainingStage` (defined in ``stages.py``)."""

from nvalchemi.training.stages import TrainingStage as TrainingStage
