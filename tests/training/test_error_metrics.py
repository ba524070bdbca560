"""The one error metric of validation summaries and evaluation reports: ``error_sums``."""

import math

import numpy as np
import torch

from nvalchemi.app.evaluation import Evaluation
from nvalchemi.training.validation import error_sums, mae_rmse


def test_missing_labels_are_left_out_and_a_diverged_prediction_shows():
    sums = error_sums(torch.tensor([1.0, 2.0, 5.0]), torch.tensor([0.0, float("nan"), 3.0]))
    assert sums.tolist() == [3.0, 5.0, 2.0]
    mae, rmse = mae_rmse(sums)
    assert float(mae) == 1.5 and math.isclose(float(rmse), math.sqrt(2.5))
    diverged = error_sums(torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]))
    assert math.isnan(float(mae_rmse(diverged)[0]))


def test_sums_add_up_over_batches_and_a_divisor_gives_per_atom_errors():
    pred, target = torch.tensor([2.0, 6.0, 9.0]), torch.tensor([1.0, 3.0, 3.0])
    whole = error_sums(pred, target)
    parts = error_sums(pred[:1], target[:1]) + error_sums(pred[1:], target[1:])
    assert torch.equal(whole, parts)
    per_atom = error_sums(pred, target, torch.tensor([1.0, 3.0, 2.0]))
    assert per_atom.tolist() == [1.0 + 1.0 + 3.0, 1.0 + 1.0 + 9.0, 3.0]


def test_evaluation_reports_use_the_same_metric():
    pred, ref = np.array([1.0, 2.0, 4.0]), np.array([1.5, np.nan, 2.0])
    metrics = Evaluation(energy_per_atom_pred=pred, energy_per_atom_ref=ref).metrics()
    mae, rmse = mae_rmse(error_sums(torch.from_numpy(pred), torch.from_numpy(ref)))
    assert metrics["energy_per_atom_mae"] == float(mae) == 1.25
    assert metrics["energy_per_atom_rmse"] == float(rmse)
