"""Fine-tuning mistakes named where they are made: replay elements the model lacks, an
unlabelled replay trained on its own labels, a non-finite E0, a head name with a dot, and
the ``nan`` of an fp16 benchmark."""

from __future__ import annotations

import json

import pytest

from ._finetune_sources import painn_source, relabelled
from ._support import TRAIN, assert_user_error, invoke, write_job


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return painn_source(tmp_path_factory.mktemp("source") / "checkpoints", stress=False)


@pytest.fixture(scope="module")
def iron(tmp_path_factory):
    """Four labelled bcc Fe cells: an element the source model does not have."""
    import ase.io
    import numpy as np
    from ase.build import bulk
    from ase.calculators.singlepoint import SinglePointCalculator

    frames = []
    for seed in range(4):
        atoms = bulk("Fe", cubic=True)
        atoms.rattle(0.05, seed=seed)
        atoms.calc = SinglePointCalculator(atoms, energy=-8.0, forces=np.zeros((len(atoms), 3)))
        frames.append(atoms)
    path = tmp_path_factory.mktemp("replay") / "iron.extxyz"
    ase.io.write(path, frames)
    return path


def _init(tmp_path, source, *args):
    return invoke(
        "finetune", "init", "checkpoint", source, "--dataset", TRAIN,
        "--output-dir", tmp_path / "ft", "--num-steps", 1, "--batch-size", 4,
        "--device", "cpu", "--no-stress", "--out", tmp_path / "ft.json", *args,
    )  # fmt: skip


def _run(tmp_path, edit=None):
    path = tmp_path / "ft.json"
    job = json.loads(path.read_text())
    job["dataset"].update({"max_structures": 8, "in_memory": True})
    job["output"].update({"tensorboard": False, "plots": False})
    if edit is not None:
        edit(job)
    return invoke("spec", "run", write_job(path, job), "--no-report")


@pytest.mark.parametrize("labels", ["--pseudo-label", "--replay-labels"])
def test_a_replay_file_with_an_element_the_model_lacks_is_named(tmp_path, source, iron, labels):
    result = _init(tmp_path, source, "--replay", iron, labels)
    assert result.exit_code == 0, result.output
    result = _run(tmp_path)
    assert_user_error(result, str(iron), "Fe", "finetune.replay.path", fix="model's elements")


def test_an_unlabelled_replay_with_replay_labels_is_refused_at_init(tmp_path, source):
    bare = relabelled(tmp_path / "bare.extxyz", 4, energy=False, forces=False, stress=False)
    result = _init(tmp_path, source, "--replay", bare, "--replay-labels")
    assert_user_error(result, str(bare), "energy or forces labels", "--replay-labels")
    # the source labels it by default
    assert _init(tmp_path, source, "--replay", bare).exit_code == 0


def test_an_unlabelled_replay_with_replay_labels_is_refused_at_run(tmp_path, source):
    labelled = relabelled(tmp_path / "labelled.extxyz", 4)
    bare = relabelled(tmp_path / "bare.extxyz", 4, energy=False, forces=False, stress=False)
    result = _init(tmp_path, source, "--replay", labelled, "--replay-labels")
    assert result.exit_code == 0, result.output

    def swap(job):  # the file changed after init, or the job was edited by hand
        job["finetune"]["replay"]["paths"] = [str(bare)]

    result = _run(tmp_path, swap)
    assert_user_error(
        result, str(bare), "has an energy label", "finetune.replay.pseudo_label",
        fix="pseudo_label: true",
    )  # fmt: skip


@pytest.mark.parametrize("value", ["Cu=nan", "Cu=inf", "Cu=-inf"])
def test_a_non_finite_e0_value_is_refused_at_init(tmp_path, source, value):
    result = _init(tmp_path, source, "--e0", "fixed", "--e0-value", value)
    assert_user_error(result, value, "finite", fix="--e0-value Cu=-3.71")
    assert not (tmp_path / "ft.json").exists()


def test_an_e0_value_of_an_unknown_element_is_refused_at_init(tmp_path, source):
    result = _init(tmp_path, source, "--e0", "fixed", "--e0-value", "Xx=-1")
    assert_user_error(result, "'Xx' is not a chemical symbol")


def test_a_head_name_with_a_dot_is_refused_at_init(tmp_path, source):
    result = _init(tmp_path, source, "--head", "a.b")
    assert_user_error(result, "--head 'a.b'", "no dots", fix="--head ft")
    assert _init(tmp_path, source, "--head", "ft").exit_code == 0


def test_an_fp16_benchmark_on_the_cpu_explains_its_nan():
    from nvalchemi.app.bench import CandidateResult, candidate_note

    result = invoke(
        "bench", "--model", "demo", "--device", "cpu", "--steps", 2, "--warmup", 0,
        "--max-structures", 24, "--precision", "fp16", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    [fp16] = json.loads(result.stdout)["candidates"]
    # the demo model's gradients overflow float16 at the scaler's first scale (65536)
    assert fp16["nonfinite_grad_steps"] == 2
    text = " ".join(result.stderr.split())
    assert "fp16: 2 of 2 timed steps had inf/NaN gradients" in text
    assert "the gradient-norm error is nan" in text and "on a CPU" in text
    fine = CandidateResult("bf16", 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0)
    assert candidate_note(fine, 2, "cpu") is None
