"""TrainingStage: the 18 lifecycle stages, their order and import paths."""

from __future__ import annotations

from enum import Enum

from nvalchemi.training.stages import TrainingStage

EXPECTED = [
    "SETUP",
    "BEFORE_TRAINING",
    "BEFORE_EPOCH",
    "BEFORE_BATCH",
    "BEFORE_FORWARD",
    "AFTER_FORWARD",
    "BEFORE_LOSS",
    "AFTER_LOSS",
    "BEFORE_BACKWARD",
    "DO_BACKWARD",
    "AFTER_BACKWARD",
    "BEFORE_OPTIMIZER_STEP",
    "DO_OPTIMIZER_STEP",
    "AFTER_OPTIMIZER_STEP",
    "AFTER_BATCH",
    "AFTER_EPOCH",
    "AFTER_TRAINING",
    "AFTER_VALIDATION",
]


def test_exactly_eighteen_members_in_lifecycle_order():
    assert [stage.name for stage in TrainingStage] == EXPECTED


def test_values_are_one_to_eighteen_in_order():
    assert [stage.value for stage in TrainingStage] == list(range(1, 19))


def test_every_stage_but_setup_is_before_after_or_do():
    for stage in TrainingStage:
        if stage is TrainingStage.SETUP:
            continue
        assert stage.name.startswith(("BEFORE_", "AFTER_", "DO_")), stage


def test_is_a_plain_enum_usable_as_dict_key():
    assert issubclass(TrainingStage, Enum)
    table = {stage: stage.value for stage in TrainingStage}
    assert table[TrainingStage.DO_BACKWARD] == 10


def test_documented_import_paths_give_the_same_class():
    import nvalchemi.training
    from nvalchemi.training._stages import TrainingStage as from_private_path

    assert from_private_path is TrainingStage
    assert nvalchemi.training.TrainingStage is TrainingStage
