"""Evaluate the final model of a ``spec run`` on its validation data and draw parity plots.

:func:`final_model` picks the model validation would use (the EMA weights in the
strategy's ``inference_model`` slot when ``use_ema`` allows, else the live weights,
DDP wrappers stripped); :func:`final_parity_plots` runs it over the validation data with
:func:`~nvalchemi.training.cli.evaluation.predict` (the code ``evaluate`` and
``quickstart`` use) and writes ``parity_energy_per_atom.png`` / ``parity_forces.png``
(MAE/RMSE in the legend) into the run directory.

Runs on one process (rank 0) over an unsharded loader, so it issues no collectives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["final_model", "final_parity_plots"]


def final_model(strategy: Any, use_ema: str = "auto") -> tuple[Any, str]:
    """``(model, "ema" | "live")`` of the strategy's ``main`` model (``None`` if it has none).

    ``use_ema`` follows ``ValidationConfig.use_ema``: ``"auto"`` and ``"always"`` take the
    EMA weights when an ``EMAHook`` filled the ``inference_model`` slot, ``"never"`` the
    live weights.
    """
    from torch import nn

    models = strategy.unwrapped_models()
    if "main" not in models:
        return None, "live"
    slot = None if use_ema == "never" else strategy.inference_model
    if isinstance(slot, nn.ModuleDict):
        slot = dict(slot.items()).get("main")
    if isinstance(slot, nn.Module):
        return slot, "ema"
    return models["main"], "live"


def final_parity_plots(
    strategy: Any, dataset: Any, run_dir: str | Path, *, batch_size: int, use_ema: str = "auto"
) -> tuple[list[Path], dict[str, float], str]:
    """Parity PNGs of the final model on ``dataset``; returns ``(paths, metrics, weights)``.

    ``weights`` says which weights were evaluated (``"ema"`` or ``"live"``); no paths
    when the strategy has no ``main`` model.
    """
    from nvalchemi.training.cli.data_sources import make_loader
    from nvalchemi.training.cli.evaluation import predict

    model, weights = final_model(strategy, use_ema)
    if model is None:
        return [], {}, weights
    loader = make_loader(dataset, batch_size=batch_size)  # unsharded: every structure
    evaluation = predict(model, loader, device=strategy.devices[0])
    return evaluation.parity_plots(run_dir), evaluation.metrics(), weights
