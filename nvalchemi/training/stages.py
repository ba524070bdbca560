"""The named points of the training loop at which hooks run.

The order of the members is the order in which a training step reaches them;
``TrainingStage.SETUP.value == 1`` and ``TrainingStage.AFTER_VALIDATION.value == 18``.
"""

from __future__ import annotations

from enum import Enum, auto

__all__ = ["TrainingStage"]


class TrainingStage(Enum):
    """Lifecycle stages of a :class:`~nvalchemi.training.TrainingStrategy` run.

    ``DO_BACKWARD`` and ``DO_OPTIMIZER_STEP`` are replacement slots: a hook
    registered there takes over the backward pass or the optimizer step. Every
    other stage is an observation point. Hooks subscribe with ``stage=`` or by
    implementing ``_runs_on_stage(stage)``.

    Example:
        >>> from nvalchemi.training import TrainingStage
        >>> TrainingStage.AFTER_FORWARD.value
        6
        >>> [s.name for s in TrainingStage][:3]
        ['SETUP', 'BEFORE_TRAINING', 'BEFORE_EPOCH']
    """

    SETUP = auto()
    """Once per ``run()``/``train_batch()``, after device placement, before optimizers."""
    BEFORE_TRAINING = auto()
    """Once per ``run()``, just before the first trained batch."""
    BEFORE_EPOCH = auto()
    """Before the first batch of each epoch."""
    BEFORE_BATCH = auto()
    """Start of each batch, before gradients are zeroed."""
    BEFORE_FORWARD = auto()
    """Before ``training_fn`` (also around validation forwards)."""
    AFTER_FORWARD = auto()
    """After ``training_fn``; ``ctx.predictions`` holds the model outputs."""
    BEFORE_LOSS = auto()
    """Before the loss is computed (``ctx.loss`` is ``None``)."""
    AFTER_LOSS = auto()
    """Loss computed; ``ctx.loss`` is live (still requires grad)."""
    BEFORE_BACKWARD = auto()
    """Last point at which ``ctx.loss`` is live."""
    DO_BACKWARD = auto()
    """Replacement slot for ``loss.backward()``."""
    AFTER_BACKWARD = auto()
    """Gradients exist; ``ctx.loss``/``ctx.losses`` are detached."""
    BEFORE_OPTIMIZER_STEP = auto()
    """Last point before the optimizer step (gradient clipping goes here)."""
    DO_OPTIMIZER_STEP = auto()
    """Replacement slot for the optimizer/scheduler step."""
    AFTER_OPTIMIZER_STEP = auto()
    """After the step; ``ctx.step_count`` is not yet incremented."""
    AFTER_BATCH = auto()
    """After the counters advanced."""
    AFTER_EPOCH = auto()
    """After the loader is exhausted for an epoch."""
    AFTER_TRAINING = auto()
    """Once at the end of ``run()`` if any batch was trained."""
    AFTER_VALIDATION = auto()
    """Inside ``validate()``, after the summary is produced."""
