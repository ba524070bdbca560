"""The model contract: ModelConfig, NeighborConfig and BaseModelMixin."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from nvalchemi.data import AtomicData, Batch
from nvalchemi.models.base import (
    BaseModelMixin,
    ModelConfig,
    NeighborConfig,
    NeighborListFormat,
)


class Quadratic(nn.Module, BaseModelMixin):
    """E = k * sum r^2 with optional configuration knobs for the tests."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.k = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        self.model_config = config or ModelConfig(
            outputs={"energy", "forces"}, autograd_outputs={"forces"}
        )

    embedding_shapes = {}

    def compute_embeddings(self, data, **kwargs):
        raise NotImplementedError

    def forward(self, data, **kwargs):
        inputs = self.adapt_input(data)
        energy = self.k * (inputs["positions"] ** 2).sum()
        return self.adapt_output({"energy": energy.reshape(1)}, data)


def _data(n=3):
    return AtomicData(
        atomic_numbers=torch.ones(n, dtype=torch.long),
        positions=torch.randn(n, 3, dtype=torch.float64),
    )


# ----------------------------------------------------------------- configs
def test_model_config_defaults():
    cfg = ModelConfig()
    assert cfg.outputs == frozenset({"energy"})
    assert cfg.autograd_inputs == frozenset({"positions"})
    assert cfg.autograd_outputs == frozenset()
    assert cfg.active_outputs == {"energy"}
    assert cfg.gradient_keys == set()
    assert cfg.supports_pbc is False and cfg.needs_pbc is False
    assert cfg.needs_neighborlist is False


def test_model_config_capabilities_are_frozen_and_sets_are_coerced():
    cfg = ModelConfig(outputs={"energy", "forces"}, required_inputs=["charge"])
    assert isinstance(cfg.outputs, frozenset) and isinstance(cfg.required_inputs, frozenset)
    with pytest.raises(AttributeError):
        cfg.outputs.add("stress")


def test_model_config_rejects_unknown_fields_and_inconsistent_capabilities():
    with pytest.raises(ValidationError, match="compute_forces"):
        ModelConfig(compute_forces=True)
    with pytest.raises(ValidationError, match="autograd_outputs"):
        ModelConfig(outputs={"energy"}, autograd_outputs={"forces"})
    with pytest.raises(ValidationError, match="needs_pbc"):
        ModelConfig(needs_pbc=True)


def test_active_outputs_empty_and_novel_names_are_kept():
    assert ModelConfig(active_outputs=set()).active_outputs == set()
    assert ModelConfig(active_outputs={"magic"}).active_outputs == {"magic"}


def test_model_config_json_round_trip():
    cfg = ModelConfig(
        outputs={"energy", "forces"},
        autograd_outputs={"forces"},
        neighbor_config=NeighborConfig(cutoff=4.5, format="matrix", skin=0.5),
        active_outputs={"energy"},
    )
    again = ModelConfig.model_validate(json.loads(cfg.model_dump_json()))
    assert again == cfg
    assert again.neighbor_config.format is NeighborListFormat.MATRIX
    assert again.needs_neighborlist


def test_neighbor_config_defaults_and_validation():
    nc = NeighborConfig(cutoff=5.0)
    assert nc.format == NeighborListFormat.COO == "coo"
    assert NeighborListFormat.MATRIX == "matrix"
    assert nc.half_list is False and nc.skin == 0.0
    with pytest.raises(ValidationError):
        NeighborConfig(cutoff=0.0)
    with pytest.raises(ValidationError):
        NeighborConfig(cutoff=1.0, skin=-0.1)


# ------------------------------------------------------------ subclass rules
def test_subclass_without_model_config_fails_at_construction():
    class Forgetful(nn.Module, BaseModelMixin):
        def __init__(self):
            super().__init__()

        embedding_shapes = {}

        def compute_embeddings(self, data, **kwargs):
            return data

    with pytest.raises(TypeError, match=r"Forgetful.__init__\(\) must set self.model_config"):
        Forgetful()


def test_config_may_be_set_after_a_parent_init_or_by_the_parent():
    class Child(Quadratic):
        def __init__(self):
            nn.Module.__init__(self)  # parent init skipped entirely, config set here
            self.k = nn.Parameter(torch.tensor(2.0))
            self.model_config = ModelConfig()

    class Grandchild(Quadratic):
        pass  # inherits the parent's __init__, which sets the config

    assert Child().model_config.outputs == {"energy"}
    assert "forces" in Grandchild().model_config.outputs


def test_extra_repr_describes_the_config():
    text = repr(Quadratic())
    assert "outputs=['energy', 'forces']" in text and "autograd=['forces']" in text


# ---------------------------------------------------------------- inputs
@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (ModelConfig(), {"positions", "atomic_numbers"}),
        (
            ModelConfig(neighbor_config=NeighborConfig(cutoff=3.0)),
            {"positions", "atomic_numbers", "neighbor_list"},
        ),
        (
            ModelConfig(neighbor_config=NeighborConfig(cutoff=3.0, format="matrix")),
            {"positions", "atomic_numbers", "neighbor_matrix", "num_neighbors"},
        ),
        (
            ModelConfig(supports_pbc=True, needs_pbc=True, required_inputs={"charge"}),
            {"positions", "atomic_numbers", "pbc", "cell", "charge"},
        ),
    ],
)
def test_input_data(config, expected):
    assert Quadratic(config).input_data() == expected


def test_output_data_intersects_and_warns_about_unsupported_requests():
    model = Quadratic()
    model.model_config.active_outputs = {"energy", "dipole"}
    with pytest.warns(UserWarning, match="dipole"):
        assert model.output_data() == {"energy"}
    model.model_config.active_outputs = set()
    assert model.output_data() == set()


def test_adapt_input_enables_grad_without_touching_the_callers_tensors():
    model = Quadratic()
    data = _data()
    inputs = model.adapt_input(data)
    assert inputs["positions"].requires_grad
    assert not data.positions.requires_grad  # the batch tensor is not modified
    assert inputs["positions"].data_ptr() == data.positions.data_ptr()  # no copy
    model.model_config.active_outputs = {"energy"}
    assert not model.adapt_input(data)["positions"].requires_grad


def test_adapt_input_keeps_an_upstream_graph():
    model = Quadratic()
    data = _data()
    source = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    data.positions = source * 2.0
    inputs = model.adapt_input(data)
    assert inputs["positions"] is data.positions


def test_adapt_input_gradient_keys_and_errors():
    config = ModelConfig(required_inputs={"charges"}, gradient_keys={"charges"})
    model = Quadratic(config)
    data = _data()
    with pytest.raises(KeyError, match="charges"):
        model.adapt_input(data)
    data.charges = torch.zeros(3, dtype=torch.float64)
    assert model.adapt_input(data)["charges"].requires_grad
    model.model_config.gradient_keys = {"info_flag"}
    with pytest.raises(TypeError, match="not a tensor"):
        model.adapt_input(
            {
                "positions": data.positions,
                "atomic_numbers": data.atomic_numbers,
                "charges": data.charges,
                "info_flag": 3,
            }
        )


def test_a_model_that_needs_pbc_rejects_a_structure_without_a_cell():
    model = Quadratic(ModelConfig(supports_pbc=True, needs_pbc=True))
    with pytest.raises(KeyError, match=r"\['cell', 'pbc'\]"):
        model.adapt_input(_data())


def _crystal(n=2):
    return AtomicData(
        atomic_numbers=torch.ones(n, dtype=torch.long),
        positions=torch.randn(n, 3, dtype=torch.float64),
        cell=torch.eye(3, dtype=torch.float64) * 3.0,
        pbc=[True, True, True],
    )


def test_a_model_that_needs_pbc_rejects_open_systems_in_a_mixed_batch():
    model = Quadratic(ModelConfig(supports_pbc=True, needs_pbc=True))
    # collation gives the molecules a zero cell and pbc False instead of a missing field
    batch = Batch.from_data_list([_crystal(), _data(2), _crystal(), _data(1)])
    with pytest.raises(ValueError, match=r"needs_pbc=True.*system\(s\) \[1, 3\]"):
        model(batch)
    slab = _crystal()
    slab.pbc = torch.tensor([[True, True, False]])  # periodic in some direction: accepted
    assert model(Batch.from_data_list([_crystal(), slab]))["energy"] is not None


def _stamped(cutoff, half_list=False, format="coo"):
    from nvalchemi.data.neighbors import compute_neighbors

    batch = Batch.from_data_list([_crystal(2), _crystal(3)])
    compute_neighbors(batch, cutoff, half_list=half_list, format=format)
    return batch


@pytest.mark.parametrize("half_list", [False, True])
def test_a_list_stamped_with_a_smaller_cutoff_or_the_other_half_full_choice_is_rejected(
    half_list,
):
    config = NeighborConfig(cutoff=3.0, half_list=half_list)
    model = Quadratic(ModelConfig(neighbor_config=config))
    with pytest.raises(ValueError, match=r"cutoff >= 3 Å.*cutoff 2 Å.*compute_neighbors") as err:
        model(_stamped(2.0, half_list))
    assert "NeighborListHook" in str(err.value)
    wanted, built = ("half", "full") if half_list else ("full", "half")
    with pytest.raises(ValueError, match=rf"needs a {wanted} neighbour list.*as a {built} list"):
        model(_stamped(3.0, not half_list))
    model(_stamped(3.0, half_list))  # built for the model
    model(_stamped(4.5, half_list))  # reaches further: pairs beyond the cutoff are ignored


def test_stamp_check_covers_the_matrix_format_and_leaves_unstamped_lists_alone():
    matrix = NeighborConfig(cutoff=3.0, format=NeighborListFormat.MATRIX)
    with pytest.raises(ValueError, match="cutoff 2 Å"):
        Quadratic(ModelConfig(neighbor_config=matrix))(_stamped(2.0, format="matrix"))
    model = Quadratic(ModelConfig(neighbor_config=NeighborConfig(cutoff=3.0)))
    unstamped = _data(2)
    unstamped.neighbor_list = torch.tensor([[0, 1], [1, 0]])
    model(unstamped)
    moved = _stamped(2.0)
    moved.positions = moved.positions + 0.1  # the stamp no longer applies: not checked
    model(moved)


def test_missing_neighbor_list_error_says_how_to_compute_it():
    model = Quadratic(ModelConfig(neighbor_config=NeighborConfig(cutoff=3.0)))
    with pytest.raises(KeyError, match=r"neighbor_list.*compute_neighbors"):
        model.adapt_input(_data())


def test_adapt_input_collects_optional_inputs_and_batch_fields():
    model = Quadratic(ModelConfig(optional_inputs={"cell", "charges"}))
    batch = Batch.from_data_list([_data(2), _data(3)])
    inputs = model.adapt_input(batch)
    assert set(inputs) == {"positions", "atomic_numbers"}
    batch.charges = torch.zeros(5, dtype=torch.float64)
    assert "charges" in model.adapt_input(batch)


# ---------------------------------------------------------------- outputs
def test_adapt_output_shapes_and_missing_values():
    model = Quadratic()
    out = model.adapt_output({"energy": torch.tensor([1.0, 2.0])}, None)
    assert list(out) == ["energy", "forces"]
    assert out["energy"].shape == (2, 1) and out["forces"] is None
    assert all(v is None for v in model.adapt_output(torch.zeros(2), None).values())


def test_forward_through_the_contract_gives_energy_and_forces():
    model = Quadratic()
    data = _data()
    out = model(data)
    assert out["energy"].shape == (1, 1)
    assert out["forces"] is None  # this toy does not compute forces; the key is still there


def test_set_config():
    model = Quadratic()
    model.set_config("active_outputs", ["energy"])
    assert model.model_config.active_outputs == {"energy"}
    with pytest.raises(AttributeError, match="no field 'activ'"):
        model.set_config("activ", {"energy"})


# -------------------------------------------------------------- neighbours
def test_make_neighbor_hooks():
    from nvalchemi.hooks.neighbor_list import NeighborListHook
    from nvalchemi.training import TrainingStage

    assert Quadratic().make_neighbor_hooks() == []
    config = ModelConfig(neighbor_config=NeighborConfig(cutoff=3.5, skin=0.25))
    hooks = Quadratic(config).make_neighbor_hooks(
        neighbor_list_method="cell_list", stage=TrainingStage.BEFORE_FORWARD
    )
    assert len(hooks) == 1 and isinstance(hooks[0], NeighborListHook)
    assert hooks[0].stage is TrainingStage.BEFORE_FORWARD
    assert hooks[0].method == "cell_list" and hooks[0].skin == 0.25
    assert Quadratic(config).make_neighbor_hooks()[0].stage is None


def test_make_neighbor_hooks_builds_the_hook_without_importing_the_hooks_package():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from nvalchemi.models.base import ModelConfig, NeighborConfig\n"
        "from nvalchemi.models.demo import DemoModel, DemoModelWrapper\n"
        "model = DemoModelWrapper(DemoModel(hidden_dim=4))\n"
        "model.model_config = ModelConfig(neighbor_config=NeighborConfig(cutoff=3.0))\n"
        "(hook,) = model.make_neighbor_hooks()\n"
        "assert hook.cutoff == 3.0\n"
        "assert not [m for m in sys.modules if m.startswith(('nvalchemi.hooks', "
        "'nvalchemi.training'))], sorted(m for m in sys.modules if m.startswith('nvalchemi'))\n"
        "from nvalchemi.hooks.neighbor_list import NeighborListHook\n"
        "assert type(hook) is NeighborListHook  # the documented path names the same class\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --------------------------------------------------------------- exporting
def test_add_output_head_is_not_supported_by_default():
    with pytest.raises(NotImplementedError):
        Quadratic().add_output_head("dipole")


def test_export_model_honours_as_state_dict(tmp_path):
    model = Quadratic()
    model.export_model(tmp_path / "sd.pt", as_state_dict=True)
    state = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert set(state) == {"k"}
    model.export_model(tmp_path / "full.pt")
    assert isinstance(torch.load(tmp_path / "full.pt", weights_only=False), Quadratic)
