"""Documented import path of :mod:`nvalchemi.training.finetune.replay`."""

from nvalchemi.training.finetune.replay import (
    ReplayMix,
    mix_replay,
    pseudo_label,
    read_pseudo_labels,
    split_holdout,
)

__all__ = [
    "ReplayMix",
    "mix_replay",
    "pseudo_label",
    "read_pseudo_labels",
    "split_holdout",
]
