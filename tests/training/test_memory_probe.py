"""probe_batch_budget on the CPU: a budget whose batches fit the memory it was given."""

from __future__ import annotations

import json

import pytest
import torch

from nvalchemi.data import Batch
from nvalchemi.data.bundled import bundled_split_path
from nvalchemi.data.io.ase import ASEReader
from nvalchemi.data.neighbors import compute_neighbors
from nvalchemi.models.painn import PaiNN
from nvalchemi.training import memory_probe
from nvalchemi.training.memory_probe import BUDGET_FILE, probe_batch_budget

CUTOFF = 4.0


@pytest.fixture(scope="module")
def samples():
    reader = ASEReader(bundled_split_path("val"))
    return [reader.read_data(i) for i in range(0, 120, 4)]


def small_painn() -> PaiNN:
    torch.manual_seed(0)
    return PaiNN(cutoff=CUTOFF, hidden_channels=16, num_interactions=2, num_rbf=8)


def measured_peak(model, batch) -> int:
    meter = memory_probe._Meter(torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    meter.start()
    memory_probe._training_step(model, batch)
    peak = meter.peak()
    model.zero_grad(set_to_none=True)
    return peak


def test_the_chosen_budget_fits_the_memory_it_was_given(samples, tmp_path):
    model = small_painn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    available = memory_probe._cpu_peak_bytes() + 768 * 2**20
    budget = probe_batch_budget(
        model, samples, "cpu", tmp_path, fraction=0.8, available_bytes=available
    )
    # the weights are untouched and no gradient is left behind
    after = model.state_dict()
    assert all(torch.equal(before[k].nan_to_num(), after[k].nan_to_num()) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert budget.available_bytes == available and budget.fraction == 0.8
    assert budget.bytes_per_atom + budget.bytes_per_edge > 0
    assert budget.predicted_peak_bytes <= 0.8 * available + 1
    assert budget.max_atoms >= max(s.num_nodes for s in samples)
    assert budget.max_edges is not None and budget.max_edges > budget.max_atoms
    assert len(budget.measurements) >= 6  # three sizes, dense and sparse first
    assert budget.measurements[-1]["atoms"] > budget.measurements[0]["atoms"]
    # a batch at the budget stays under the memory the probe was given
    batch, atoms, edges = [], 0, 0
    for item in samples * 200:
        single = Batch.from_data_list([item])
        compute_neighbors(single, CUTOFF)
        if atoms + item.num_nodes > budget.max_atoms or edges + single.num_edges > budget.max_edges:
            break
        batch.append(item)
        atoms += item.num_nodes
        edges += single.num_edges
    full = Batch.from_data_list(batch)
    compute_neighbors(full, CUTOFF)
    assert full.num_nodes > 0.8 * budget.max_atoms or full.num_edges > 0.8 * budget.max_edges
    assert measured_peak(model, full) < available
    written = json.loads((tmp_path / BUDGET_FILE).read_text())
    assert written["max_atoms"] == budget.max_atoms and written["measurements"]


def test_too_little_memory_is_a_clear_error(samples):
    with pytest.raises(ValueError, match="fewer than the largest sample structure"):
        probe_batch_budget(small_painn(), samples, "cpu", available_bytes=64 * 2**20)
    with pytest.raises(ValueError, match="fraction must be in"):
        probe_batch_budget(small_painn(), samples, "cpu", fraction=1.5)
