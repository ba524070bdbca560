"""``finetune init --from`` with reference energies, a new head and replay; ``finetune check``."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from nvalchemi.app.jobs.finetune import read_source_recipe
from nvalchemi.data import AtomicData
from nvalchemi.data.datapipes import InMemoryDataset
from nvalchemi.data.io.zarr import AtomicDataZarrReader
from nvalchemi.hooks.reporting import read_metrics
from nvalchemi.training.checkpoint import load_model_from_checkpoint, read_strategy_metadata
from nvalchemi.training.replay import mix_replay

from ._finetune_sources import relabelled
from ._support import TRAIN, assert_user_error, invoke, write_job


def _job(tmp_path, trained_run, *args):
    out = tmp_path / "ft.json"
    result = invoke(
        "finetune",
        "init",
        "--from",
        trained_run["checkpoints"],
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path / "ft",
        "--num-steps",
        3,
        "--batch-size",
        4,
        "--val-fraction",
        0.25,
        "--validation-every-steps",
        1,
        "--device",
        "cpu",
        "--no-stress",  # the bundled data has stress: keep the tiny runs small
        "--out",
        out,
        *args,
    )
    assert result.exit_code == 0, result.output
    job = json.loads(out.read_text())
    job["dataset"].update({"max_structures": 12, "in_memory": True})
    if "replay" in job.get("finetune", {}):
        job["finetune"]["replay"]["max_structures"] = 10
    job["output"].update({"tensorboard": False, "plots": False})
    return write_job(out, job), job


def test_init_from_a_checkpoint_writes_the_finetune_block(tmp_path, trained_run):
    _, job = _job(
        tmp_path,
        trained_run,
        "--e0",
        "estimated",
        "--replay",
        TRAIN,
        "--replay-ratio",
        0.25,
        "--head",
        "ft",
        "--trunk-lr-scale",
        0,
    )
    assert job["source"]["model"] == "native-checkpoint"
    assert job["finetune"]["e0"] == "estimated" and job["finetune"]["head"] == "ft"
    # one replay structure on top of the 4 new ones (a quarter of 4 + 1, rounded)
    assert job["finetune"]["replay"]["ratio"] == 0.2 and job["dataset"]["batch_size"] == 5
    assert job["strategy"]["trainable_patterns"] == ["main.head_readouts.ft.*"]


def test_replay_run_records_statistics_parity_labels_and_forgetting(tmp_path, trained_run):
    path, _ = _job(
        tmp_path,
        trained_run,
        "--e0",
        "estimated",
        "--replay",
        TRAIN,
        "--replay-ratio",
        0.25,
        "--head",
        "ft",
        "--trunk-lr-scale",
        0.5,
        "--pseudo-label",
    )
    report = invoke("spec", "report", path)
    assert "Fine-tuning" in report.stderr and "estimated" in report.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = invoke("spec", "run", path, "--no-report")
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "ft"
    stats = json.loads((run_dir / "finetune_statistics.json").read_text())
    assert stats["e0_mode"] == "estimated" and stats["head"] == "ft"
    parity = json.loads((run_dir / "finetune_parity.json").read_text())
    assert parity["max_abs"]["forces"] == 0.0  # only the reference energies moved
    assert "energy differences are expected" in result.stderr
    assert (run_dir / "replay_labels.zarr").is_dir()
    assert "forgetting: held-out replay energy MAE" in result.stderr
    rows = [r for r in read_metrics(run_dir) if r["kind"] == "validation"]
    assert "validation/forgetting/energy_per_atom_mae_increase" in rows[-1]
    model = load_model_from_checkpoint(run_dir / "checkpoints", use_ema=False)
    assert model.head_names == ("default", "ft")
    assert model.get_reference_energies("ft") != model.get_reference_energies("default")
    meta = read_strategy_metadata(run_dir / "checkpoints")
    assert meta["new_heads"] == {"ft": None}
    # A resumed run reuses the cached labels (the fine-tuned model must not relabel).
    labels = run_dir / "replay_labels.zarr" / "zarr.json"
    stamp = labels.stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = invoke(
            "spec", "resume", run_dir / "checkpoints", "--spec", path, "--num-steps", 4
        )
    assert resumed.exit_code == 0, resumed.output
    assert labels.stat().st_mtime_ns == stamp
    assert read_strategy_metadata(run_dir / "checkpoints")["runtime_state"]["step_count"] == 4

    # Another run in a folder holding labels of other replay structures labels them again.
    (tmp_path / "other").mkdir()
    other_path, other = _job(tmp_path / "other", trained_run, "--replay", TRAIN, "--pseudo-label")
    other["finetune"]["replay"]["max_structures"] = 6
    write_job(other_path, other)
    other_dir = tmp_path / "other" / "ft"
    other_dir.mkdir(parents=True)
    shutil.copytree(run_dir / "replay_labels.zarr", other_dir / "replay_labels.zarr")
    fresh = invoke("spec", "run", other_path, "--no-report")
    assert fresh.exit_code == 0, fresh.output
    assert "labelling the structures again" in fresh.stderr, fresh.stderr
    assert len(AtomicDataZarrReader(str(other_dir / "replay_labels.zarr"))) == 6


def test_finetune_check_prints_the_zero_step_differences(tmp_path, trained_run):
    path, _ = _job(tmp_path, trained_run)
    result = invoke("finetune", "check", path)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["num_structures"] == 4
    assert max(report["max_abs"].values()) <= 1e-5  # float32 model, keep: no change


def test_bad_finetune_options_are_explained(tmp_path, trained_run):
    base = [
        "finetune",
        "init",
        "--from",
        trained_run["checkpoints"],
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path / "x",
        "--device",
        "cpu",
    ]
    assert_user_error(invoke(*base, "--e0", "fixed"), "needs the values", fix="--e0-value")
    assert_user_error(invoke(*base, "--replay-ratio", 0.2), "need replay data", fix="--replay")
    assert_user_error(
        invoke(
            "finetune", "init", "--from", tmp_path, "--dataset", TRAIN, "--output-dir", tmp_path
        ),
        "not an nvalchemi checkpoint",
        fix="checkpoint directory",
    )


def test_evaluate_picks_a_head_of_the_fine_tuned_model(tmp_path, trained_run):
    path, _ = _job(tmp_path, trained_run, "--head", "ft", "--e0", "estimated")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert invoke("spec", "run", path, "--no-report").exit_code == 0
    root = tmp_path / "ft" / "checkpoints"
    common = [
        "evaluate",
        root,
        "--dataset",
        TRAIN,
        "--max-structures",
        6,
        "--no-plots",
        "--no-ema",
        "--json",
    ]
    by_head = {}
    for head in ("default", "ft"):
        result = invoke(*common, "--head", head)
        assert result.exit_code == 0, result.output
        by_head[head] = json.loads(result.stdout)["metrics"]["energy_per_atom_mae"]
    assert by_head["default"] != by_head["ft"]  # the heads hold different E0
    assert_user_error(invoke(*common, "--head", "nope"), "not a head", fix="--head")


def test_replay_mixed_by_size_is_trained_on(tmp_path, trained_run):
    """With --replay-ratio size the replay joins the new data by size: an epoch holds both."""
    path, job = _job(tmp_path, trained_run, "--replay", TRAIN, "--replay-ratio", "size")
    assert "ratio" not in job["finetune"]["replay"]
    job["strategy"]["num_steps"] = 4
    write_job(path, job)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = invoke("spec", "run", path, "--no-report")
    assert result.exit_code == 0, result.output
    assert "replay: 9 structures (mixed by size" in result.stderr
    # 9 new + 9 replay structures in batches of 4: 5 batches an epoch (the new data
    # alone would fill 3), so the 4th step is still in the first epoch
    rows = [r for r in read_metrics(tmp_path / "ft") if r["kind"] == "validation"]
    assert [r["epoch"] for r in rows if r["step"] == 4] == [0]


def test_replay_defaults_are_the_source_lr_and_half_of_every_batch(tmp_path, trained_run):
    """The measured default (docs/finetuning.md, "Adding a structure type"): with --replay
    and neither --lr nor --replay-ratio, a checkpoint fine-tune trains at the source's peak
    lr with half of every batch from replay (weight 1), the replay on top of the
    --batch-size new structures; given values win, 'size' mixes by size in the batch
    given, as do atom budgets."""
    source_lr = read_source_recipe(trained_run["checkpoints"]).lr
    assert source_lr is not None and source_lr not in (1e-5, 2e-5)
    for args, lr, ratio, weight, batch in (
        (("--replay", TRAIN), source_lr, 0.5, None, 8),
        (("--replay", TRAIN, "--lr", 2e-5), 2e-5, 0.5, None, 8),
        (("--replay", TRAIN, "--replay-ratio", 0.125), source_lr, 0.2, None, 5),
        (("--replay", TRAIN, "--replay-ratio", 0.6), source_lr, 6 / 10, None, 10),
        (("--replay", TRAIN, "--replay-ratio", "size"), source_lr, None, None, 4),
        (("--replay", TRAIN, "--replay-weight", 0.5), source_lr, 0.5, 0.5, 8),
        (("--replay", TRAIN, "--max-atoms", 200), source_lr, 0.5, None, 4),
        ((), 1e-5, None, None, 4),
    ):
        _, job = _job(tmp_path, trained_run, *args)
        optimizer = job["strategy"]["optimizer_configs"]["main"][0]["optimizer_kwargs"]
        assert optimizer["lr"] == pytest.approx(lr)
        assert job["source"]["optimizer_lr"] == pytest.approx(lr)
        replay = job.get("finetune", {}).get("replay", {})
        assert (replay.get("ratio"), replay.get("weight")) == (ratio, weight), args
        assert job["dataset"]["batch_size"] == batch, args
        if ratio is not None and "--max-atoms" not in args:  # the run draws 4 new ones
            mix = mix_replay(_tiny(8), _tiny(8), batch_size=batch, ratio=ratio)
            assert mix.batch_sampler.samples_per_dataset[0] == 4, args


def _tiny(count: int) -> InMemoryDataset:
    atom = AtomicData(atomic_numbers=torch.tensor([29]), positions=torch.zeros(1, 3))
    return InMemoryDataset(data_list=[atom] * count)


def test_replay_trains_on_the_files_labels_when_every_structure_has_them(tmp_path, trained_run):
    """The measured default (docs/finetuning.md): labelled replay files keep their labels;
    a file lacking energies or forces on a structure is labelled by the source; a choice
    given wins."""
    partly = tmp_path / "partly.extxyz"
    labelled = relabelled(tmp_path / "labelled.extxyz", 3)
    bare = relabelled(tmp_path / "bare.extxyz", 1, forces=False)
    partly.write_text(labelled.read_text() + bare.read_text())
    for args, pseudo_label, said in (
        (("--replay", TRAIN), False, "trained on the files' own labels"),
        (("--replay", partly), True, "labelled by the source model"),
        (("--replay", TRAIN, "--pseudo-label"), True, None),
        (("--replay", partly, "--pseudo-label"), True, None),
        (("--replay", labelled, "--replay-labels"), False, None),
    ):
        out = ("--output-dir", tmp_path / "ft", "--out", tmp_path / "ft.json")
        result = invoke(*_init(trained_run), *out, *args)
        assert result.exit_code == 0, result.output
        replay = json.loads((tmp_path / "ft.json").read_text())["finetune"]["replay"]
        assert replay.get("pseudo_label", True) is pseudo_label, args
        if said is None:
            assert "--replay: trained on" not in result.stderr
            assert "--replay: labelled by" not in result.stderr
        else:
            assert f"--replay: {said}" in result.stderr, result.stderr


def _init(trained_run) -> tuple:
    """``finetune init`` of the trained run on the bundled training file, nothing else set."""
    return ("finetune", "init", "--from", trained_run["checkpoints"], "--dataset", TRAIN)


def test_replay_without_a_length_runs_2000_steps(tmp_path, trained_run):
    """The measured default length with --replay (1,000 steps missed the target); a length
    or a budget given wins, and a fine-tune without replay keeps 1,000 steps."""
    base = _init(trained_run)
    for args, steps in (
        (("--replay", TRAIN), 2000),
        (("--replay", TRAIN, "--num-steps", 7), 7),
        (("--replay", TRAIN, "--num-epochs", 2), None),
        (("--replay", TRAIN, "--minutes", 3), None),
        ((), 1000),
    ):
        out = tmp_path / "ft.json"
        result = invoke(*base, "--output-dir", tmp_path / "ft", "--out", out, *args)
        assert result.exit_code == 0, result.output
        assert json.loads(out.read_text())["strategy"].get("num_steps") == steps, args


def test_replay_ratio_that_is_no_share_is_refused(tmp_path, trained_run):
    for bad in ("0", "1", "half"):
        result = invoke(
            *_init(trained_run), "--output-dir", tmp_path / "ft", "--replay", TRAIN,
            "--replay-ratio", bad,
        )  # fmt: skip
        assert result.exit_code != 0
        assert "--replay-ratio" in result.output and "'size'" in result.output, result.output
