"""``MACEWrapper.from_checkpoint`` with the reference's arguments: device, cuEquivariance,
dtype, ``torch.compile`` (and its keywords), reference energies from a mapping or a file."""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import warnings

import pytest
import torch

from nvalchemi._optional import OptionalDependencyError
from nvalchemi.models import MACEWrapper

pytest.importorskip(
    "mace", reason="mace-torch is not installed (pip install 'nvalchemi-training[mace]')"
)

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning",
    "ignore:.*cuequivariance.*:UserWarning",
    "ignore:Loading .* with pickle:UserWarning",
)

SMALL = {
    "atomic_numbers": [29, 79],
    "atomic_energies": {29: -3.0, 79: -2.5},
    "r_max": 4.0,
    "num_bessel": 4,
    "max_ell": 1,
    "num_interactions": 2,  # two: dynamo then guards on e3nn Irreps (see MACEWrapper)
    "hidden_irreps": "4x0e + 4x1o",
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


@pytest.fixture
def batch(helpers):
    return helpers.batch_of([helpers.triclinic_cu_au()], 4.0)


def _energy(wrapper, batch):
    wrapper.model_config.active_outputs = {"energy"}
    with torch.no_grad():
        return wrapper(copy.copy(batch))["energy"]


def test_the_pickle_warning_says_trusted(model_file):
    with pytest.warns(UserWarning, match="trusted"):
        MACEWrapper.from_checkpoint(model_file)


def test_the_mace_checkpoint_adapter_warns_trusted(model_file):
    from nvalchemi.training.checkpoint import load_checkpoint

    with pytest.warns(UserWarning, match="trusted"):
        loaded = load_checkpoint(model_file, adapter="mace")
    assert isinstance(loaded["models"]["main"]["model"], MACEWrapper)


def test_the_arguments_are_the_references_in_its_order():
    names = list(inspect.signature(MACEWrapper.from_checkpoint).parameters)
    assert names[:7] == [
        "checkpoint_path",
        "device",
        "enable_cueq",
        "dtype",
        "compile_model",
        "atomic_energies",
        "atomic_energies_path",
    ]
    assert names[-1] == "compile_kwargs"


def test_device_dtype_and_energies_by_position_and_keyword(model_file, batch):
    plain = MACEWrapper.from_checkpoint(model_file)
    by_position = MACEWrapper.from_checkpoint(
        model_file, torch.device("cpu"), False, torch.float32, False, {"Cu": -1.0}
    )
    assert by_position.dtype == torch.float32
    assert next(by_position.model.parameters()).device == torch.device("cpu")
    shift = _energy(by_position, batch).double() - _energy(plain, batch)
    # triclinic_cu_au: three Cu atoms, whose E0 moves from -3 to -1 eV
    torch.testing.assert_close(shift, torch.tensor([[6.0]], dtype=torch.float64), atol=1e-4, rtol=0)
    by_keyword = MACEWrapper.from_checkpoint(model_file, device="cpu", dtype="float32")
    assert by_keyword.dtype == torch.float32
    # the older name of the device argument still works; a contradiction is refused
    assert MACEWrapper.from_checkpoint(model_file, map_location="cpu").dtype == torch.float64
    with pytest.raises(ValueError, match="disagree"):
        MACEWrapper.from_checkpoint(model_file, device="cpu", map_location="meta")


def test_reference_energies_from_a_json_file(model_file, batch, tmp_path):
    energies = tmp_path / "e0.json"
    energies.write_text(json.dumps({"Au": 0.5, "29": -1.0}))
    plain = MACEWrapper.from_checkpoint(model_file)
    loaded = MACEWrapper.from_checkpoint(model_file, atomic_energies_path=energies)
    assert loaded.get_reference_energies() == {29: -1.0, 79: 0.5}
    assert loaded.checkpoint_spec().kwargs["atomic_energies_path"] == str(energies.resolve())
    shift = _energy(loaded, batch) - _energy(plain, batch)  # 3 Cu: -3 -> -1, 1 Au: -2.5 -> 0.5
    torch.testing.assert_close(shift, torch.tensor([[9.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="not both"):
        MACEWrapper.from_checkpoint(
            model_file, atomic_energies={"Cu": 1.0}, atomic_energies_path=energies
        )
    energies.write_text("[1.0, 2.0]")
    with pytest.raises(TypeError, match="must map"):
        MACEWrapper.from_checkpoint(model_file, atomic_energies_path=energies)
    energies.write_text(json.dumps({"Fe": 1.0}))
    with pytest.raises(ValueError, match="not in the model"):
        MACEWrapper.from_checkpoint(model_file, atomic_energies_path=energies)
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        MACEWrapper.from_checkpoint(model_file, atomic_energies_path=tmp_path / "missing.json")


def test_enable_cueq_off_cuda_is_refused_by_name(model_file):
    with pytest.raises(ValueError, match="CUDA"):
        MACEWrapper.from_checkpoint(model_file, device="cpu", enable_cueq=True)


@pytest.mark.skipif(
    importlib.util.find_spec("cuequivariance_torch") is not None,
    reason="cuEquivariance is installed here",
)
def test_enable_cueq_without_cuequivariance_names_the_package(model_file):
    with pytest.raises(OptionalDependencyError, match="cuequivariance"):
        MACEWrapper.from_checkpoint(model_file, device="cuda", enable_cueq=True)


def test_compile_model_runs_torch_compile_with_its_keywords(model_file, batch):
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward  # run the captured graph as it is

    eager = MACEWrapper.from_checkpoint(model_file)
    compiled = MACEWrapper.from_checkpoint(
        model_file, compile_model=True, backend=recording_backend, dynamic=False
    )
    assert not compiled.training
    assert not any(p.requires_grad for p in compiled.parameters())  # inference-only
    torch.testing.assert_close(_energy(compiled, batch), _energy(eager, batch))
    assert graphs, "the backend passed as a compile keyword never ran"
    record = compiled.checkpoint_spec().kwargs
    assert record["compile_model"] is True and record["dynamic"] is False
    assert record["backend"] is recording_backend


def test_compile_keywords_without_compile_model_are_refused(model_file):
    with pytest.raises(ValueError, match="compile_model=True"):
        MACEWrapper.from_checkpoint(model_file, mode="max-autotune")


def test_the_spec_rebuilds_with_the_same_options(model_file, batch):
    from nvalchemi.spec import create_model_spec_from_json

    loaded = MACEWrapper.from_checkpoint(model_file, dtype="float32", atomic_energies={"Au": 1})
    record = loaded.checkpoint_spec()
    assert record.kwargs["enable_cueq"] is False and record.kwargs["compile_model"] is False
    assert "device" not in record.kwargs and "map_location" not in record.kwargs
    rebuilt = create_model_spec_from_json(json.loads(record.model_dump_json()), trust=True).build()
    assert rebuilt.dtype == torch.float32
    torch.testing.assert_close(_energy(rebuilt, batch), _energy(loaded, batch))
