"""Learning-curve and parity PNGs (matplotlib on the Agg canvas, no pyplot)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import _reporting_support as support
import pytest
import torch

from nvalchemi.hooks.reporting import (
    JSONLinesReporter,
    ReportingOrchestrator,
    parity_plots,
    plot_learning_curves,
    plot_parity,
)
from nvalchemi.hooks.reporting import plots as plots_module
from nvalchemi.training.stages import TrainingStage

pytest.importorskip("matplotlib")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 2000
    assert not list(Path(path).parent.glob(".tmp-*"))  # no temporary file left behind


def write_metrics(run: Path, steps: int = 30) -> Path:
    reporter = JSONLinesReporter(run)
    ctx = support.make_ctx(batches_per_epoch=10, num_epochs=3)
    with ReportingOrchestrator(
        [reporter], stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"}
    ) as hook:
        for _ in range(steps):
            hook(ctx, TrainingStage.AFTER_OPTIMIZER_STEP)
            support.advance(ctx, batches_per_epoch=10, energy=math.exp(-ctx.step_count / 10))
            if ctx.epoch_step_count == 0:
                ctx.validation = support.validation_summary(loss=1.0 / ctx.epoch)
                hook(ctx, TrainingStage.AFTER_VALIDATION)
    return reporter.path


def test_learning_curves_png_from_metrics_jsonl(tmp_path):
    metrics = write_metrics(tmp_path)
    out = plot_learning_curves(metrics, tmp_path / "plots" / "learning_curves.png")
    assert out == tmp_path / "plots" / "learning_curves.png"
    assert_png(out)


def test_learning_curves_panels_cover_components_metrics_and_lr(tmp_path, monkeypatch):
    metrics = write_metrics(tmp_path)
    figures = []
    original = plots_module._save
    monkeypatch.setattr(
        plots_module, "_save", lambda fig, out: figures.append(fig) or original(fig, out)
    )
    plot_learning_curves(metrics, tmp_path / "curves.png")
    visible = [axes for axes in figures[0].axes if axes.get_visible()]
    titles = [axes.get_title() for axes in visible]
    assert titles == [
        "total loss [weighted sum]",
        "EnergyMSELoss (unweighted)",  # the test context's loss has no unit to tell
        "ForceMSELoss (unweighted)",
        "validation errors [meV/Å]",  # one axis per unit, in meV
        "validation metrics",  # metrics without a unit on their own axis
        "learning rate",
    ]
    assert all(axes.get_yscale() == "log" for axes in visible[:5])
    force_labels = [t.get_text() for t in visible[3].get_legend().get_texts()]
    assert force_labels == ["forces MAE", "forces RMSE"]
    assert visible[3].get_ylabel() == "meV/Å"
    labels = [text.get_text() for text in visible[0].get_legend().get_texts()]
    assert labels == ["train (smoothed)", "validation"]


def test_learning_curves_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        plot_learning_curves(tmp_path / "nope.jsonl", tmp_path / "x.png")
    empty = tmp_path / "metrics.jsonl"
    empty.write_text(json.dumps({"kind": "train", "step": 1, "optimizer/lr": 0.1}) + "\n")
    with pytest.raises(ValueError, match="no loss values"):
        plot_learning_curves(empty, tmp_path / "x.png")


def test_parity_legend_has_mae_and_rmse(tmp_path, monkeypatch):
    figures = []
    original = plots_module._save
    monkeypatch.setattr(
        plots_module, "_save", lambda fig, out: figures.append(fig) or original(fig, out)
    )
    ref = torch.tensor([0.0, 1.0, 2.0, 3.0, float("nan")])
    pred = torch.tensor([0.5, 1.0, 2.0, 2.5, 1.0])
    out = plot_parity(pred, ref, tmp_path / "parity.png", title="Energy", unit="eV/atom")
    assert_png(out)
    (label,) = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert "MAE 0.25 eV/atom" in label
    assert f"RMSE {math.sqrt(0.125):.3g} eV/atom" in label
    assert "n = 4" in label and "1 non-finite left out" in label
    assert figures[0].axes[0].get_xlabel() == "reference [eV/atom]"


def test_parity_plots_writes_energy_and_force_pngs(tmp_path):
    generator = torch.Generator().manual_seed(0)
    energy_ref = torch.randn(20, generator=generator)
    forces_ref = torch.randn(30, 3, generator=generator)
    paths = parity_plots(
        energy_ref + 0.01, energy_ref, forces_ref * 1.1, forces_ref, tmp_path / "parity"
    )
    assert [p.name for p in paths] == ["parity_energy_per_atom.png", "parity_forces.png"]
    for path in paths:
        assert_png(path)
    only_energy = parity_plots([1.0, 2.0], [1.0, 2.1], None, None, tmp_path / "e")
    assert [p.name for p in only_energy] == ["parity_energy_per_atom.png"]


def test_parity_input_errors(tmp_path):
    with pytest.raises(ValueError, match="pred has 3 values but ref has 2"):
        plot_parity([1.0, 2.0, 3.0], [1.0, 2.0], tmp_path / "p.png")
    with pytest.raises(ValueError, match="no finite"):
        plot_parity([float("nan")], [1.0], tmp_path / "p.png")
    with pytest.raises(ValueError, match="forces has predictions but not"):
        parity_plots(None, None, [1.0], None, tmp_path)
