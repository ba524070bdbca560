"""Live progress and metrics for training (and simulation) runs.

One hook, :class:`ReportingOrchestrator`, sends selected engine events to
reporters: :class:`RichReporter` (terminal dashboard or plain log lines),
:class:`TensorBoardReporter` (extra ``tensorboard``), :class:`JSONLinesReporter`
(``metrics.jsonl``) and the experiment trackers :class:`WandbReporter` and
:class:`MLflowReporter` (extra ``trackers``). :mod:`.plots` turns the
metrics file and predictions into PNG plots (extra ``plots``).

Example:
    >>> from nvalchemi.hooks.reporting import JSONLinesReporter, ReportingOrchestrator, RichReporter
    >>> reporting = ReportingOrchestrator(  # doctest: +SKIP
    ...     [RichReporter(), JSONLinesReporter("runs/demo")],
    ...     stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"},
    ...     frequency=10,
    ... )
"""

from nvalchemi._lazy import lazy_exports

_EXPORTS = {
    "DEFAULT_REPORT_STAGES": ".orchestrator",
    "ReportingOrchestrator": ".orchestrator",
    "ReportingErrorPolicy": ".orchestrator",
    "Reporter": ".orchestrator",
    "ReportingState": ".state",
    "ReporterMessage": ".state",
    "RichReporter": ".rich_reporter",
    "RichLayout": ".rich_layouts",
    "BaseRichLayout": ".rich_layouts",
    "TrainingRichLayout": ".rich_layouts",
    "DynamicsRichLayout": ".rich_layouts",
    "TensorBoardReporter": ".tensorboard",
    "TensorBoardWriter": ".tensorboard",
    "TrackerReporter": ".tracker",
    "WandbReporter": ".wandb",
    "MLflowReporter": ".mlflow",
    "JSONLinesReporter": ".jsonl",
    "read_metrics": ".jsonl",
    "metric_units": ".jsonl",
    "ScalarSnapshot": ".scalars",
    "ScalarCallback": ".scalars",
    "collect_scalars": ".scalars",
    "extract_loss_scalars": ".scalars",
    "extract_optimizer_lr_scalars": ".scalars",
    "extract_scalars": ".scalars",
    "extract_dynamics_scalars": ".scalars",
    "extract_validation_scalars": ".scalars",
    "reduce_scalar_snapshot": ".reduce",
    "normalize_rank_reduction": ".reduce",
    "plot_learning_curves": ".plots",
    "plot_parity": ".plots",
    "parity_plots": ".plots",
    "run_reporting": ".presets",
    "learning_curves": ".presets",
    "plots_available": ".presets",
    "PLOTS_HINT": ".presets",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
