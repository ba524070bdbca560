"""Options, rank semantics and the ``with`` protocol shared by the built-in reporters."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any, TypeVar

from nvalchemi.hooks.reporting.reduce import normalize_rank_reduction, reduce_scalar_snapshot
from nvalchemi.hooks.reporting.scalars import (
    ScalarCallback,
    ScalarSnapshot,
    collect_scalars,
    validate_custom_scalars,
)
from nvalchemi.hooks.reporting.state import ReportingState

__all__ = ["ClosesOnExit", "ScalarReporterBase"]

_R = TypeVar("_R", bound="ClosesOnExit")


class ClosesOnExit:
    """``with reporter:`` gives the reporter back and calls its ``close()`` on the way out."""

    def close(self) -> None:
        """Release what the reporter holds (nothing here; reporters override it)."""

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ScalarReporterBase(ClosesOnExit):
    """Collect (and optionally reduce across ranks) the scalars of an event.

    Rank semantics: with ``rank_reduction`` set, ``requires_all_ranks`` is True,
    every rank collects and takes part in the reduction and only
    ``ctx.global_rank == 0`` writes; otherwise ``rank_zero_only`` decides.
    """

    rank_zero_only: bool
    requires_all_ranks: bool

    def _init_scalar_options(
        self,
        *,
        custom_scalars: Mapping[str, ScalarCallback] | None,
        include_losses: bool,
        include_optimizer_lrs: bool,
        rank_reduction: Any,
        rank_zero_only: bool,
        include_throughput: bool = True,
        include_memory: bool = True,
    ) -> None:
        self.custom_scalars = validate_custom_scalars(custom_scalars)
        self.include_losses = bool(include_losses)
        self.include_optimizer_lrs = bool(include_optimizer_lrs)
        self.include_throughput = bool(include_throughput)
        self.include_memory = bool(include_memory)
        op, _ = normalize_rank_reduction(rank_reduction)
        self.rank_reduction = None if op is None else rank_reduction
        self.requires_all_ranks = op is not None
        self.rank_zero_only = bool(rank_zero_only)

    def _collect(
        self, ctx: Any, stage: Any, state: ReportingState | None, **options: Any
    ) -> ScalarSnapshot:
        snapshot = collect_scalars(
            ctx,
            stage,
            state,
            custom_scalars=self.custom_scalars,
            include_losses=self.include_losses,
            include_optimizer_lrs=self.include_optimizer_lrs,
            include_throughput=self.include_throughput,
            include_memory=self.include_memory,
            **options,
        )
        return reduce_scalar_snapshot(
            snapshot, self.rank_reduction, reporter_name=type(self).__name__
        )

    def _writes_for(self, ctx: Any) -> bool:
        """Whether this process writes for ``ctx`` (its ``global_rank``)."""
        if self.requires_all_ranks or self.rank_zero_only:
            return getattr(ctx, "global_rank", 0) == 0
        return True
