"""The shared energy -> forces / stress autograd utilities."""

from __future__ import annotations

import pytest
import torch

import nvalchemi.models._utils as utils
from nvalchemi.models._utils import (
    autograd_forces,
    autograd_forces_and_stresses,
    autograd_stresses,
    cell_cache_needs_update,
    energy_and_derivatives,
    prepare_strain,
    sum_outputs,
)


def _positions(n=5):
    return torch.randn(n, 3, dtype=torch.float64, requires_grad=True)


def test_public_names_are_importable_from_the_spec_path():
    for name in utils.__all__:
        assert callable(getattr(utils, name))


def test_forces_of_a_harmonic_energy():
    pos = _positions()
    energy = (pos**2).sum().reshape(1)
    torch.testing.assert_close(autograd_forces(energy, pos), -2 * pos.detach())


def test_training_forces_allow_double_backward_into_parameters():
    k = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    pos = _positions()
    forces = autograd_forces((k * (pos**2).sum()).reshape(1), pos, training=True)
    assert forces.requires_grad
    forces.pow(2).sum().backward()  # d/dk sum (2 k r)^2 = 8 k sum r^2
    torch.testing.assert_close(k.grad, 8 * k.detach() * (pos.detach() ** 2).sum())


def test_retain_graph_allows_a_second_derivative_call():
    pos = _positions()
    energy = (pos**3).sum().reshape(1)
    first = autograd_forces(energy, pos, retain_graph=True)
    torch.testing.assert_close(autograd_forces(energy, pos), first)
    with pytest.raises(RuntimeError):
        autograd_forces(energy, pos)  # the graph is freed now


def test_prepare_strain_is_the_identity_at_zero_displacement():
    pos = torch.randn(4, 3, dtype=torch.float64)
    cell = torch.randn(2, 3, 3, dtype=torch.float64)
    batch_idx = torch.tensor([0, 0, 1, 1])
    p, c, d = prepare_strain(pos, cell, batch_idx)
    assert d.shape == (2, 3, 3) and d.requires_grad and d.is_leaf
    torch.testing.assert_close(p, pos)
    torch.testing.assert_close(c, cell)


def test_stress_of_a_linear_strain_energy_is_tensile_positive():
    pos = torch.zeros(1, 3, dtype=torch.float64)
    cell = torch.eye(3, dtype=torch.float64).unsqueeze(0)
    _, _, disp = prepare_strain(pos, cell, torch.zeros(1, dtype=torch.long))
    stress = autograd_stresses((2 * disp[0, 0, 0]).reshape(1), disp, cell, 1)
    assert stress.shape == (1, 3, 3)
    assert stress[0, 0, 0] == pytest.approx(2.0)
    assert stress.abs().sum() == pytest.approx(2.0)


def test_compressed_cell_has_negative_stress_and_volume_scaling():
    # E = (V - V0)^2 / (2 V0) per system; compressed (V < V0) -> sigma < 0 (pressure > 0).
    cell = torch.stack([torch.eye(3) * 0.9, torch.eye(3) * 2.0]).double()
    pos = torch.zeros(2, 3, dtype=torch.float64)
    batch_idx = torch.tensor([0, 1])
    _, strained, disp = prepare_strain(pos, cell, batch_idx)
    v0 = torch.tensor([1.0, 8.0], dtype=torch.float64)
    volume = torch.linalg.det(strained)
    energy = (volume - v0) ** 2 / (2 * v0)
    stress = autograd_stresses(energy, disp, cell, 2)
    v = torch.linalg.det(cell)
    expected = (v - v0) / v0  # dE/d(eps_aa) / V = (V - V0) / V0
    torch.testing.assert_close(
        torch.diagonal(stress, dim1=1, dim2=2), expected[:, None].expand(2, 3)
    )
    assert stress[0, 0, 0] < 0
    torch.testing.assert_close(stress[1], torch.zeros(3, 3, dtype=torch.float64))


def test_forces_and_stresses_in_one_call_match_separate_calls():
    torch.manual_seed(0)
    pos = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    cell = (torch.eye(3) * 4 + 0.1 * torch.randn(3, 3)).double().expand(2, 3, 3).clone()
    batch_idx = torch.tensor([0, 0, 0, 1, 1, 1])
    p, _, disp = prepare_strain(pos, cell, batch_idx)
    energy = torch.zeros(2, dtype=torch.float64).index_add(0, batch_idx, (p**4).sum(-1))
    forces, stress = autograd_forces_and_stresses(energy, pos, disp, cell, 2, retain_graph=True)
    torch.testing.assert_close(forces, autograd_forces(energy, pos, retain_graph=True))
    torch.testing.assert_close(stress, autograd_stresses(energy, disp, cell, 2))


def test_zero_volume_systems_get_zero_stress_and_finite_gradients():
    pos = torch.randn(2, 3, dtype=torch.float64)
    cell = torch.zeros(1, 3, 3, dtype=torch.float64)
    k = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    out = energy_and_derivatives(
        lambda p, c: k * (p**2).sum().reshape(1),
        pos,
        cell,
        batch_idx=torch.zeros(2, dtype=torch.long),
        num_graphs=1,
        compute_stress=True,
        training=True,
    )
    assert torch.equal(out["stress"], torch.zeros(1, 3, 3, dtype=torch.float64))
    (out["stress"].sum() + out["forces"].sum()).backward()
    assert torch.isfinite(k.grad)


def test_energy_and_derivatives_under_no_grad_still_computes_and_detaches():
    k = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    pos = torch.randn(3, 3, dtype=torch.float64)
    with torch.no_grad():
        out = energy_and_derivatives(
            lambda p, c: k * (p**2).sum().reshape(1),
            pos,
            batch_idx=torch.zeros(3, dtype=torch.long),
            num_graphs=1,
        )
    torch.testing.assert_close(out["forces"], -4 * pos)
    assert not out["energy"].requires_grad and not out["forces"].requires_grad
    assert out["energy"].shape == (1, 1) and "stress" not in out
    assert not pos.requires_grad


def test_energy_and_derivatives_training_graph_reaches_parameters():
    k = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    pos = torch.randn(3, 3, dtype=torch.float64)
    cell = torch.eye(3, dtype=torch.float64).unsqueeze(0) * 3
    out = energy_and_derivatives(
        lambda p, c: k * (p**2).sum().reshape(1) + k * torch.linalg.det(c),
        pos,
        cell,
        batch_idx=torch.zeros(3, dtype=torch.long),
        num_graphs=1,
        compute_stress=True,
        training=True,
    )
    assert out["forces"].requires_grad and out["stress"].requires_grad
    out["forces"].pow(2).sum().backward()
    assert k.grad is not None and k.grad != 0


def test_sum_outputs():
    a = {"energy": torch.ones(2, 1), "forces": torch.ones(3, 3), "charges": torch.zeros(3)}
    b = {"energy": torch.ones(2, 1), "forces": None, "charges": torch.ones(3), "stress": None}
    out = sum_outputs(a, b)
    torch.testing.assert_close(out["energy"], 2 * torch.ones(2, 1))
    torch.testing.assert_close(out["forces"], torch.ones(3, 3))
    torch.testing.assert_close(out["charges"], torch.ones(3))  # last write wins
    assert out["stress"] is None
    custom = sum_outputs(a, b, additive_keys={"charges"})
    torch.testing.assert_close(custom["charges"], torch.ones(3))
    torch.testing.assert_close(custom["energy"], torch.ones(2, 1))
    assert sum_outputs() == {}
    assert sum_outputs(a) == a


def test_cell_cache_needs_update():
    cell = torch.eye(3).unsqueeze(0)
    assert cell_cache_needs_update(cell, None)
    assert not cell_cache_needs_update(cell, cell.clone())
    assert cell_cache_needs_update(cell, cell * 1.01)
    assert cell_cache_needs_update(cell, cell.double())
    assert cell_cache_needs_update(cell, torch.eye(3))
    assert not cell_cache_needs_update(cell, cell + 1e-9)
