"""Errors raised by the training loop, and how the loop annotates foreign errors.

Example:
    >>> err = NonFiniteLossError(step=12, epoch=1, epoch_step=4, batch_count=12,
    ...                          components=["ForceMSELoss"])
    >>> isinstance(err, ValueError), err.step
    (True, 12)
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NonFiniteLossError", "TrainingStalledError", "add_note"]


class NonFiniteLossError(ValueError):
    """The training loss became NaN or infinite.

    Attributes:
        step: optimizer step (``step_count``) being computed when it happened.
        epoch: epoch (``epoch_count``) of that batch.
        epoch_step: 0-based position of the batch within its epoch.
        batch_count: 0-based index of the batch since the start of training.
        components: names of the loss components that were non-finite (all of them
            when only the total is known).
        detail: extra text appended to the message.
    """

    def __init__(
        self,
        *,
        step: int,
        epoch: int,
        epoch_step: int,
        batch_count: int,
        components: Sequence[str] = (),
        detail: str = "",
    ) -> None:
        self.step = step
        self.epoch = epoch
        self.epoch_step = epoch_step
        self.batch_count = batch_count
        self.components = list(components)
        parts = ", ".join(self.components) if self.components else "unknown"
        message = (
            f"Non-finite training loss at step {step} (epoch {epoch}, batch {epoch_step} of the "
            f"epoch, batch {batch_count} overall); non-finite loss components: {parts}. "
            "Check the data of that batch (NaN/inf labels or positions), lower the learning "
            "rate, or set TrainingStrategy(nonfinite_loss='skip') to skip such batches."
        )
        super().__init__(f"{message} {detail}".rstrip())


class TrainingStalledError(RuntimeError):
    """Many consecutive batches made no optimizer step (skipped or vetoed)."""


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (shown after its message in tracebacks)."""
    exc.add_note(note)
