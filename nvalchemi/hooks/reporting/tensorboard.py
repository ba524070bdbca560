"""``TensorBoardReporter``: every reported scalar as a TensorBoard scalar (extra ``tensorboard``).

Tags are the scalar keys (``loss/total``, ``loss/EnergyMSELoss/unweighted``,
``optimizer/lr``, ``validation/forces_mae``, ...), optionally under a prefix;
the x axis is the number of completed optimizer steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from nvalchemi._optional import OptionalDependency
from nvalchemi.hooks.reporting._base import ScalarReporterBase
from nvalchemi.hooks.reporting.scalars import ScalarCallback
from nvalchemi.hooks.reporting.state import ReportingState

__all__ = ["TensorBoardReporter", "TensorBoardWriter"]

_RANK_TOKENS = ("{rank}", "{global_rank}")


@runtime_checkable
class TensorBoardWriter(Protocol):
    """What the reporter needs from a writer (``torch.utils.tensorboard.SummaryWriter`` fits)."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> None:
        """Record one scalar."""
        ...

    def flush(self) -> None:
        """Write pending events to disk."""
        ...

    def close(self) -> None:
        """Flush and release the files."""
        ...


class TensorBoardReporter(ScalarReporterBase):
    """Write the scalars of each reporting event to TensorBoard.

    Args:
        log_dir: event-file directory; ``{rank}``/``{global_rank}`` are replaced by
            the writing rank (required when every rank writes: ``rank_zero_only=False``
            without ``rank_reduction``).
        custom_scalars / include_losses / include_optimizer_lrs: what to collect.
        rank_reduction: reduce scalars over ranks before rank 0 writes.
        tag_prefix: prepended to every tag (``"<prefix>/<key>"``).
        flush: flush after every event (crash-safe, slightly slower).
        rank_zero_only: write only on global rank 0.
        writer: an existing writer (any :class:`TensorBoardWriter`); closed with the
            reporter and reused if reporting continues.
        include_throughput / include_memory: also write throughput and peak memory.

    Raises ``OptionalDependencyError`` at construction when ``tensorboard`` is missing.

    Example:
        >>> reporter = TensorBoardReporter("runs/demo/tb")  # doctest: +SKIP
    """

    def __init__(
        self,
        log_dir: str | Path,
        *,
        custom_scalars: Mapping[str, ScalarCallback] | None = None,
        include_losses: bool = True,
        include_optimizer_lrs: bool = True,
        rank_reduction: Any = None,
        tag_prefix: str | None = None,
        flush: bool = True,
        rank_zero_only: bool = True,
        writer: TensorBoardWriter | None = None,
        include_throughput: bool = True,
        include_memory: bool = True,
    ) -> None:
        if writer is None:
            OptionalDependency.TENSORBOARD.require("TensorBoardReporter")
        elif not all(callable(getattr(writer, m, None)) for m in ("add_scalar", "flush", "close")):
            raise TypeError(
                f"writer must have add_scalar, flush and close (a SummaryWriter); got "
                f"{type(writer).__name__}."
            )
        self._init_scalar_options(
            custom_scalars=custom_scalars,
            include_losses=include_losses,
            include_optimizer_lrs=include_optimizer_lrs,
            rank_reduction=rank_reduction,
            rank_zero_only=rank_zero_only,
            include_throughput=include_throughput,
            include_memory=include_memory,
        )
        self.log_dir = str(log_dir)
        has_token = any(token in self.log_dir for token in _RANK_TOKENS)
        if not self.rank_zero_only and not self.requires_all_ranks and not has_token:
            raise ValueError(
                f"TensorBoardReporter(log_dir={self.log_dir!r}, rank_zero_only=False) would make "
                "every rank write into the same directory; put '{rank}' in log_dir "
                "(e.g. 'runs/x/tb/rank{rank}'), or set rank_reduction='mean'."
            )
        self.tag_prefix = tag_prefix.strip("/") if tag_prefix else None
        self.flush = bool(flush)
        self.writer: TensorBoardWriter | None = writer
        self._owns_writer = writer is None

    def resolved_log_dir(self, rank: int) -> str:
        """``log_dir`` with the rank tokens replaced."""
        path = self.log_dir
        for token in _RANK_TOKENS:
            path = path.replace(token, str(rank))
        return path

    def _ensure_writer(self, rank: int) -> TensorBoardWriter:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # heavy: import on first write

            self.writer = SummaryWriter(self.resolved_log_dir(rank))
        return self.writer

    def report(self, ctx: Any, stage: Any, state: ReportingState) -> None:
        """Write every scalar of this event (sorted by key) at the completed-step count."""
        snapshot = self._collect(ctx, stage, state)
        if not self._writes_for(ctx) or not snapshot.scalars:
            return
        writer = self._ensure_writer(getattr(ctx, "global_rank", 0))
        step = snapshot.step if snapshot.step > 0 else snapshot.event_count
        for key in sorted(snapshot.scalars):
            tag = f"{self.tag_prefix}/{key}" if self.tag_prefix else key
            writer.add_scalar(tag, snapshot.scalars[key], global_step=step)
        if self.flush:
            writer.flush()

    def close(self) -> None:
        """Flush and close the writer (a new one is opened if reporting continues)."""
        writer = self.writer
        if writer is None:
            return
        writer.flush()
        writer.close()
        if self._owns_writer:
            self.writer = None
