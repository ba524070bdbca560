"""``load_checkpoint(file, adapter="mace", adapter_kwargs=...)`` forwards every option to
``MACEWrapper.from_checkpoint``: dtype, cuEquivariance, ``torch.compile`` and its keywords."""

from __future__ import annotations

import warnings

import pytest
import torch

from nvalchemi.models import MACEWrapper
from nvalchemi.training.checkpoint import load_checkpoint

pytest.importorskip("mace", reason="mace-torch is not installed")

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning",
    "ignore:.*pickle.*:UserWarning",
    "ignore:.*cuequivariance.*:UserWarning",
)

SMALL = {
    "atomic_numbers": [29, 79],
    "atomic_energies": {29: -3.0, 79: -2.5},
    "r_max": 4.0,
    "num_bessel": 4,
    "max_ell": 1,
    "num_interactions": 1,
    "hidden_irreps": "4x0e",
    "MLP_irreps": "4x0e",
    "correlation": 1,
    "radial_MLP": [8],
    "avg_num_neighbors": 10.0,
    "seed": 0,
}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapper = MACEWrapper.from_mace_kwargs(**SMALL)
    path = tmp_path_factory.mktemp("mace") / "small.model"
    wrapper.export_model(path)
    return path


def _load(path, **options):
    return load_checkpoint(path, adapter="mace", adapter_kwargs=options)["models"]["main"]["model"]


def test_the_adapter_forwards_dtype_compile_and_its_keywords(model_file):
    assert _load(model_file, dtype="float32").dtype == torch.float32
    compiled = _load(model_file, compile_model=True, compile_kwargs={"dynamic": False})
    assert not any(p.requires_grad for p in compiled.parameters())  # compiled: inference-only
    kwargs = compiled.checkpoint_spec().kwargs
    assert kwargs["compile_model"] is True and kwargs["dynamic"] is False


def test_the_adapter_forwards_cueq_and_compile_keywords_to_their_checks(model_file):
    with pytest.raises(ValueError, match="enable_cueq=True converts the model"):
        _load(model_file, enable_cueq=True)  # on the CPU
    with pytest.raises(ValueError, match=r"\['mode'\] are torch.compile keywords"):
        _load(model_file, compile_kwargs={"mode": "max-autotune"})  # without compile_model
