"""JSONLinesReporter and read_metrics: rows, rank 0 only, crash safety, resuming."""

from __future__ import annotations

import io
import json
from pathlib import Path

import _reporting_support as support
import pytest
import torch

from nvalchemi.hooks.context import TrainContext
from nvalchemi.hooks.reporting import (
    JSONLinesReporter,
    ReportingOrchestrator,
    ReportingState,
    read_metrics,
)
from nvalchemi.hooks.reporting import jsonl as jsonl_module
from nvalchemi.training.stages import TrainingStage

STEP = TrainingStage.AFTER_OPTIMIZER_STEP
VALIDATION = TrainingStage.AFTER_VALIDATION


def train(reporter_or_hook, ctx, steps, *, validate_every=None):
    call = (
        reporter_or_hook
        if isinstance(reporter_or_hook, ReportingOrchestrator)
        else lambda c, s: reporter_or_hook.report(c, s, ReportingState())
    )
    for _ in range(steps):
        call(ctx, STEP)
        support.advance(ctx, energy=0.5 / (ctx.step_count + 2))
        if validate_every and ctx.step_count % validate_every == 0:
            ctx.validation = support.validation_summary(loss=1.0 / ctx.step_count)
            call(ctx, VALIDATION)


def lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_rows_for_steps_and_validations(tmp_path):
    reporter = JSONLinesReporter(tmp_path)
    assert reporter.path == tmp_path / "metrics.jsonl"
    with ReportingOrchestrator(
        [reporter], stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"}
    ) as hook:
        train(hook, support.make_ctx(), 4, validate_every=2)
    rows = lines(reporter.path)
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("train", 1),
        ("train", 2),
        ("validation", 2),
        ("train", 3),
        ("train", 4),
        ("validation", 4),
    ]
    first = rows[0]
    assert list(first)[:6] == ["kind", "step", "epoch", "batch_count", "time", "elapsed_s"]
    assert first["batch_count"] == 1 and first["epoch"] == 0 and first["time"] > 1.6e9
    assert first["loss/EnergyMSELoss/unweighted"] == pytest.approx(0.5)
    assert rows[1]["loss/EnergyMSELoss/unweighted"] == pytest.approx(0.25)
    assert first["optimizer/lr"] == pytest.approx(1e-3)
    assert "memory/rss_peak_mib" in first
    assert "throughput/structures_per_s" in rows[1]  # measured from the second event on
    validation = rows[2]
    assert validation["validation/loss/total"] == pytest.approx(0.5)
    assert validation["validation/forces_mae_eV_per_A"] == pytest.approx(0.05)
    assert validation["units"]["validation/forces_mae_eV_per_A"] == "eV/Å"  # the first row with it
    assert not any(key.startswith("loss/") for key in validation)
    assert validation["epoch"] == 0 and validation["batch_count"] == 2


def test_only_global_rank_zero_writes(tmp_path):
    reporter = JSONLinesReporter(tmp_path / "m.jsonl")
    reporter.report(support.make_ctx(global_rank=1), STEP, ReportingState())
    reporter.close()
    assert not (tmp_path / "m.jsonl").exists()
    assert reporter.rank_zero_only and not reporter.requires_all_ranks


def test_validation_rows_can_be_left_out(tmp_path):
    reporter = JSONLinesReporter(tmp_path, include_validation=False)
    with reporter:
        train(reporter, support.make_ctx(), 2, validate_every=1)
    assert {row["kind"] for row in lines(reporter.path)} == {"train"}


def test_second_train_row_for_the_same_step_is_skipped(tmp_path):
    reporter = JSONLinesReporter(tmp_path)
    ctx = support.make_ctx(step=3, batches_per_epoch=4)
    reporter.report(ctx, STEP, ReportingState())  # step 4 done
    support.advance(ctx)
    reporter.report(ctx, TrainingStage.AFTER_EPOCH, ReportingState())  # still step 4
    reporter.close()
    assert [row["step"] for row in lines(reporter.path)] == [4]


def test_flush_every_and_fsync_on_close(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(jsonl_module.os, "fsync", lambda fd: synced.append(fd))
    reporter = JSONLinesReporter(tmp_path, flush_every=3)
    ctx = support.make_ctx()
    train(reporter, ctx, 2)
    assert reporter.path.read_text() == ""  # still buffered
    train(reporter, ctx, 1)
    assert len(reporter.path.read_text().splitlines()) == 3
    reporter.close()
    assert len(synced) == 1
    eager = JSONLinesReporter(tmp_path / "eager.jsonl")  # default: every row reaches the OS
    train(eager, support.make_ctx(), 1)
    assert len(eager.path.read_text().splitlines()) == 1
    eager.close()


def test_resumed_run_continues_the_file_after_a_crash(tmp_path):
    first = JSONLinesReporter(tmp_path)
    ctx = support.make_ctx()
    train(first, ctx, 5)
    first.close()
    with first.path.open("a") as handle:
        handle.write('{"kind":"train","step":6,"loss/to')  # a row cut by a crash
    resumed = JSONLinesReporter(tmp_path)  # restarted from a checkpoint at step 3
    ctx = support.make_ctx(step=3)
    train(resumed, ctx, 4)
    resumed.close()
    raw = first.path.read_text().splitlines()
    assert raw[5] == '{"kind":"train","step":6,"loss/to'  # kept, but on its own line
    assert json.loads(raw[6])["step"] == 4
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert [row["step"] for row in read_metrics(tmp_path, latest_only=False)] == [
        1,
        2,
        3,
        4,
        5,
        4,
        5,
        6,
        7,
    ]


def test_non_finite_values_are_null_and_field_names_are_reserved(tmp_path):
    reporter = JSONLinesReporter(tmp_path)
    reporter.report(
        TrainContext(batch=None, loss=torch.tensor(float("inf"))), STEP, ReportingState()
    )
    reporter.close()
    assert lines(reporter.path)[0]["loss/total"] is None
    clash = JSONLinesReporter(tmp_path / "x.jsonl", custom_scalars={"step": lambda c, s: 1})
    with pytest.raises(ValueError, match="'step'"):
        clash.report(support.make_ctx(), STEP, ReportingState())


def test_argument_and_file_errors(tmp_path):
    with pytest.raises(ValueError, match="flush_every"):
        JSONLinesReporter(tmp_path, flush_every=0)
    with pytest.raises(FileNotFoundError, match="metrics"):
        read_metrics(tmp_path / "missing")


class _EnergyModel(torch.nn.Module):
    """Energy = a learned per-element constant summed per structure (just enough to train)."""

    def __init__(self) -> None:
        super().__init__()
        self.per_element = torch.nn.Embedding(10, 1)

    def forward(self, batch):
        atom_energy = self.per_element(batch.atomic_numbers).squeeze(-1)
        energy = atom_energy.new_zeros(batch.num_graphs).index_add(0, batch.batch_idx, atom_energy)
        return {"energy": energy.unsqueeze(-1)}


def _batches(count: int, seed: int) -> list:
    from nvalchemi.data import AtomicData, Batch

    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        structures = [
            AtomicData(
                atomic_numbers=torch.randint(1, 5, (3,), generator=generator),
                positions=torch.randn(3, 3, generator=generator),
                energy=torch.randn(1, 1, generator=generator),
            )
            for _ in range(2)
        ]
        batches.append(Batch.from_data_list(structures))
    return batches


def test_real_training_run_writes_every_step_and_validation(tmp_path):
    from rich.console import Console

    from nvalchemi.hooks.reporting import RichReporter
    from nvalchemi.training import (
        EnergyMSELoss,
        OptimizerConfig,
        TrainingStrategy,
        ValidationConfig,
    )

    console = Console(file=io.StringIO(), width=200)
    reporting = ReportingOrchestrator(
        [RichReporter(console=console), JSONLinesReporter(tmp_path)],
        stages={"AFTER_OPTIMIZER_STEP", "AFTER_VALIDATION"},
    )
    strategy = TrainingStrategy(
        models=_EnergyModel(),
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 1e-2}),
        loss_fn=EnergyMSELoss(),
        validation_config=ValidationConfig(validation_data=_batches(1, seed=9), every_n_epochs=1),
        num_epochs=2,
        hooks=[reporting],
    )
    strategy.run(_batches(3, seed=0))
    rows = read_metrics(tmp_path)
    train = [(r["step"], r["epoch"]) for r in rows if r["kind"] == "train"]
    assert train == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 1)]
    validation = [r for r in rows if r["kind"] == "validation"]
    assert [r["step"] for r in validation][:2] == [3, 6]
    assert all("validation/loss/total" in r for r in validation)
    assert "loss/EnergyMSELoss/unweighted" in rows[0]
    lines = console.file.getvalue().splitlines()
    assert lines[0].startswith("epoch 1/2 batch 1/3 step 1/6 loss ")
    assert any(line.startswith("validation epoch 2 step 6 loss ") for line in lines)
