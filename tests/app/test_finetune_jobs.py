"""``finetune init custom|mace`` jobs run with ``spec run``."""

from __future__ import annotations

import json

import pytest
import torch

from nvalchemi.models.painn import PaiNN
from nvalchemi.training.checkpoint import load_models_from_checkpoint, read_strategy_metadata
from nvalchemi.training.spec import create_model_spec

from ._support import TINY_PAINN, TRAIN, invoke, write_job

ELEMENTS = [13, 28, 29, 46, 47, 78, 79]  # the bundled data set


def _finetune(tmp_path, kind, source, *args):
    result = invoke(
        "finetune",
        "init",
        kind,
        source,
        "--dataset",
        TRAIN,
        "--output-dir",
        tmp_path / "ft",
        "--num-steps",
        2,
        "--batch-size",
        4,
        "--val-fraction",
        0.25,
        "--device",
        "cpu",
        "--no-stress",  # the bundled data has stress: keep the tiny runs small
        *args,
    )
    assert result.exit_code == 0, result.output
    job = json.loads(result.stdout)
    job["dataset"].update({"max_structures": 8, "in_memory": True})
    job["output"]["tensorboard"] = False
    return job


def test_custom_finetune_loads_a_state_dict_and_trains_the_readout(tmp_path):
    torch.manual_seed(0)
    model = PaiNN(elements=ELEMENTS, **TINY_PAINN)
    weights = tmp_path / "weights.pt"
    torch.save(model.state_dict(), weights)
    job = _finetune(tmp_path, "custom", weights, "--trainable-pattern", "main.readout.*")
    spec = create_model_spec(PaiNN, elements=ELEMENTS, **TINY_PAINN).model_dump()
    job["strategy"]["model_specs"] = {"main": spec}
    result = invoke("spec", "run", write_job(tmp_path / "ft.json", job))
    assert result.exit_code == 0, result.output
    assert "Custom model reload" in result.stderr
    tuned = load_models_from_checkpoint(tmp_path / "ft" / "checkpoints", use_ema=False)["main"]
    original = model.state_dict()
    for name, value in tuned.state_dict().items():
        if name == "e0":
            continue
        same = torch.equal(value, original[name])
        assert same != name.startswith("readout."), name  # only the readout moved


@pytest.mark.slow
def test_mace_finetune_needs_trust_and_trains_the_readouts(tmp_path):
    pytest.importorskip("mace")
    from nvalchemi.models.mace import MACEWrapper

    wrapper = MACEWrapper.from_mace_kwargs(
        atomic_numbers=ELEMENTS, r_max=4.0, hidden_irreps="8x0e", num_interactions=1
    )
    path = tmp_path / "tiny.model"
    torch.save(wrapper.model, path)
    job = _finetune(tmp_path, "mace", path)
    assert job["strategy"]["trainable_patterns"] == ["main.model.readouts.*"]
    report = invoke("spec", "report", write_job(tmp_path / "strict.json", job))
    assert "Loss dtype" in report.stderr  # float64 MACE vs float32 labels, strict loss
    # The fix the report suggests: cast the labels to the model's dtype.
    job = _finetune(tmp_path, "mace", path, "--loss-dtype-policy", "target_to_prediction")
    job_path = write_job(tmp_path / "ft.json", job)
    assert "Loss dtype" not in invoke("spec", "report", job_path).stderr
    result = invoke("spec", "run", job_path, "--no-report", "--trust")
    assert result.exit_code == 0, result.output
    meta = read_strategy_metadata(tmp_path / "ft" / "checkpoints", "latest")
    assert meta["trainable_patterns"] == ["main.model.readouts.*"]
    assert meta["runtime_state"]["step_count"] == 2
