"""MACEWrapper: a mace-torch model behind the nvalchemi contract."""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest
import torch

from nvalchemi.models import MACEWrapper, NvalchemiCalculator
from nvalchemi.models.testing import check_model

pytest.importorskip(
    "mace", reason="mace-torch is not installed (pip install 'nvalchemi-training[mace]')"
)

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning:torch.jit._serialization",
    "ignore:.*cuequivariance.*:UserWarning",
)

TINY = {
    "atomic_numbers": [29, 79],
    "atomic_energies": {29: -3.0, 79: -2.5},
    "r_max": 4.0,
    "num_bessel": 6,
    "max_ell": 2,
    "num_interactions": 2,
    "hidden_irreps": "8x0e + 8x1o",
    "MLP_irreps": "8x0e",
    "correlation": 2,
    "radial_MLP": [16, 16],
    "avg_num_neighbors": 20.0,
    "atomic_inter_scale": 0.5,
    "seed": 0,
}


@pytest.fixture(scope="module")
def tiny_mace():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MACEWrapper.from_mace_kwargs(**TINY)


@pytest.fixture
def wrapper(tiny_mace):
    return copy.deepcopy(tiny_mace)


def test_config(wrapper):
    cfg = wrapper.model_config
    assert {"energy", "forces", "stress"} <= cfg.outputs
    assert cfg.active_outputs == {"energy", "forces"}
    assert cfg.supports_pbc and not cfg.needs_pbc
    assert cfg.neighbor_config.cutoff == pytest.approx(4.0)
    assert wrapper.dtype == torch.float64


def test_physics_checks(wrapper, helpers):
    report = check_model(wrapper, [helpers.triclinic_cu_au(), helpers.cu_cluster()])
    assert report["stress_fd"] < 1e-6


def test_agrees_with_mace_calculator_on_the_same_weights(wrapper, helpers, tmp_path):
    from mace.calculators import MACECalculator

    path = tmp_path / "tiny.model"
    torch.save(wrapper.model, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = MACECalculator(model_paths=str(path), device="cpu", default_dtype="float64")
    ours = NvalchemiCalculator(wrapper)
    for atoms in (helpers.triclinic_cu_au(), helpers.au_slab()):
        a, b = atoms.copy(), atoms.copy()
        a.calc, b.calc = reference, ours
        assert b.get_potential_energy() == pytest.approx(a.get_potential_energy(), abs=1e-9)
        np.testing.assert_allclose(b.get_forces(), a.get_forces(), atol=1e-9)
        if atoms.pbc.all():
            # For slabs MACE replaces the non-periodic cell vectors (other volume);
            # we keep ASE's convention (the volume of the given cell).
            np.testing.assert_allclose(b.get_stress(), a.get_stress(), atol=1e-9)


def test_train_mode_builds_a_differentiable_force_graph(wrapper, helpers):
    batch = helpers.batch_of([helpers.triclinic_cu_au()], 4.0)
    wrapper.train()
    wrapper.set_config("active_outputs", {"energy", "forces", "stress"})
    out = wrapper(batch)
    assert out["forces"].requires_grad and out["stress"].requires_grad
    (out["forces"].pow(2).sum() + out["stress"].pow(2).sum()).backward()
    grads = [p.grad for p in wrapper.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    assert not batch.positions.requires_grad  # the batch is not modified


def test_stamped_neighbor_lists_longer_are_harmless_shorter_are_rejected(wrapper, helpers):
    from nvalchemi.data.neighbors import compute_neighbors

    systems = [helpers.triclinic_cu_au(), helpers.au_slab(), helpers.cu_cluster()]
    exact = wrapper(helpers.batch_of(systems, 4.0))
    longer = wrapper(helpers.batch_of(systems, 6.0))  # MACE's envelope zeroes the extra pairs
    torch.testing.assert_close(longer["energy"], exact["energy"], rtol=0, atol=1e-12)
    torch.testing.assert_close(longer["forces"], exact["forces"], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"cutoff >= 4 Å.*cutoff 3 Å"):
        wrapper(helpers.batch_of(systems, 3.0))
    half = helpers.batch_of(systems, 4.0)
    compute_neighbors(half, 4.0, half_list=True)
    with pytest.raises(ValueError, match=r"needs a full neighbour list.*as a half list"):
        wrapper(half)


def test_eval_under_no_grad_still_gives_forces(wrapper, helpers):
    batch = helpers.batch_of([helpers.triclinic_cu_au()], 4.0)
    wrapper.eval()
    with torch.no_grad():
        out = wrapper(batch)
    assert out["forces"].shape == (4, 3) and not out["forces"].requires_grad


def test_unknown_element_is_named(wrapper, helpers):
    atoms = helpers.triclinic_cu_au()
    atoms.numbers[0] = 28
    wrapper.eval()
    with pytest.raises(ValueError, match=r"Ni \(Z=28\)"):
        wrapper(helpers.batch_of([atoms], 4.0))


def test_embeddings(wrapper, helpers):
    batch = wrapper.compute_embeddings(helpers.batch_of([helpers.triclinic_cu_au()] * 2, 4.0))
    (h,) = wrapper.embedding_shapes["node_embeddings"]
    assert batch.node_embeddings.shape == (8, h)
    assert batch.graph_embeddings.shape == (2, h)


def test_from_mace_kwargs_spec_rebuilds_the_architecture(wrapper, helpers):
    from nvalchemi.training.spec import create_model_spec_from_json

    spec = wrapper.checkpoint_spec()
    assert spec.cls_path.endswith("MACEWrapper.from_mace_kwargs")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rebuilt = create_model_spec_from_json(json.loads(spec.model_dump_json())).build()
    rebuilt.load_state_dict(wrapper.state_dict())
    batch = helpers.batch_of([helpers.au_slab()], 4.0)
    torch.testing.assert_close(rebuilt(batch)["forces"], wrapper(batch)["forces"])


def test_from_checkpoint_warns_and_records_its_path(wrapper, helpers, tmp_path):
    path = tmp_path / "tiny.model"
    wrapper.export_model(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # e3nn's torch.jit use
        with pytest.warns(UserWarning, match="pickle"):
            loaded = MACEWrapper.from_checkpoint(path, atomic_energies={29: -1.0})
    assert not loaded.training
    spec = loaded.checkpoint_spec()
    assert spec.kwargs["checkpoint_path"] == str(path.resolve())
    batch = helpers.batch_of([helpers.triclinic_cu_au()], 4.0)
    shift = loaded(batch)["energy"] - wrapper.eval()(batch)["energy"]
    torch.testing.assert_close(shift, torch.tensor([[3 * 2.0]], dtype=torch.float64))
    with pytest.raises(FileNotFoundError):
        MACEWrapper.from_checkpoint(tmp_path / "missing.model")
    torch.save(wrapper.model.state_dict(), tmp_path / "sd.pt")
    with (
        warnings.catch_warnings(),
        pytest.warns(UserWarning),
        pytest.raises(TypeError, match="not a mace-torch model"),
    ):
        warnings.simplefilter("ignore", DeprecationWarning)
        MACEWrapper.from_checkpoint(tmp_path / "sd.pt")


def test_wrapper_around_a_live_module_has_no_spec(wrapper):
    assert MACEWrapper(wrapper.model).checkpoint_spec() is None


def test_importing_mace_through_the_wrapper_keeps_torch_load_safe():
    # A fresh process: mace sets the variable only on its first import.
    import os
    import subprocess
    import sys

    code = (
        "import os\n"
        "from nvalchemi.models.mace import _require_mace\n"
        "_require_mace()\n"
        "from mace import modules  # what MACEWrapper.from_mace_kwargs imports\n"
        "print(os.environ.get('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "None"
