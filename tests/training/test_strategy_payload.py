"""``StrategyPayload``: one validator for a strategy's JSON form, every error at once with its path."""

from __future__ import annotations

import copy

import pytest

from nvalchemi._errors import FieldError
from nvalchemi.app.jobs.resolve import validate_job_data
from nvalchemi.app.jobs.spec import TrainingJobSpec
from nvalchemi.training.strategy_payload import StrategyPayload


def _template() -> dict:
    return copy.deepcopy(TrainingJobSpec.template())


def test_a_template_payload_resolves_to_real_objects():
    payload = StrategyPayload.model_validate(_template()["strategy"])
    resolved = payload.resolve()
    config = resolved.optimizer_configs["main"][0]
    assert config.optimizer_cls.__name__ == "AdamW"
    assert config.scheduler_cls.__name__ == "WarmupCosineLR"
    assert [type(c).__name__ for c in resolved.loss_fn.components] == [
        "EnergyMSELoss",
        "ForceMSELoss",
    ]
    assert resolved.model_classes["main"].__name__ == "PaiNN"
    assert (
        payload.as_spec_dict(finetuning=False).keys().isdisjoint({"freeze_patterns", "new_heads"})
    )


def test_every_resolution_problem_is_reported_at_once_with_its_field():
    data = _template()["strategy"]
    data["optimizer_configs"]["main"][0]["optimizer_cls"] = "torch.optim.AdamWW"
    data["loss_fn_spec"]["components"][0]["cls_path"] += "x"
    data["model_specs"]["main"]["cls_path"] = "nvalchemi.models.painn.PaiNNX"
    with pytest.raises(FieldError) as caught:
        StrategyPayload.model_validate(data).resolve()
    text = str(caught.value)
    assert text.startswith("3 problems: (1) strategy.optimizer_configs.main[0].optimizer_cls")
    order = [
        text.index(f)
        for f in ("optimizer_configs.main[0]", "strategy.loss_fn_spec", "strategy.model_specs.main")
    ]
    assert order == sorted(order)  # the payload's order
    assert "did you mean 'torch.optim.AdamW'?" in text
    assert [p.field for p in caught.value.parts][:2] == [
        "strategy.optimizer_configs.main[0].optimizer_cls",
        "strategy.loss_fn_spec",
    ]


def test_a_job_with_several_errors_lists_them_all_in_file_order():
    data = _template()
    data["dataset"]["batch_size"] = 0
    data["output"]["log_every_n_steps"] = -1
    data["strategy"]["num_steps"] = "many"
    data["source"]["fit_to_data"] = "yes please"
    with pytest.raises(FieldError) as caught:
        validate_job_data(data, "job.yaml")
    text = str(caught.value)
    assert "job.yaml is not a valid job: 4 errors:" in text
    fields = [
        "source.fit_to_data",
        "dataset.batch_size",
        "output.log_every_n_steps",
        "strategy.num_steps",
    ]
    positions = [text.index(f + ":") for f in fields]
    assert positions == sorted(positions)  # as they come in the file
    # The same payload reordered in the file is reported in that order.
    reordered = {
        k: data[k]
        for k in (
            "strategy",
            "output",
            "dataset",
            "source",
            "workflow",
            "name",
            "minutes",
            "validation",
        )
    }
    with pytest.raises(FieldError) as caught:
        validate_job_data(reordered, "job.yaml")
    text = str(caught.value)
    positions = [text.index(f + ":") for f in reversed(fields)]
    assert positions == sorted(positions)


def test_structure_errors_name_the_key():
    with pytest.raises(ValueError, match="exactly one of num_epochs and num_steps"):
        StrategyPayload.model_validate({"num_steps": 1, "num_epochs": 1})
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        StrategyPayload.model_validate({"nmu_steps": 1})
    assert StrategyPayload.model_validate({"devices": "cpu"}).devices == ["cpu"]
