"""The export contract: ``Potential`` (eager), ``neighbor_inputs`` and the exported model."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from nvalchemi.data.neighbors import edge_vectors, neighbor_list_for_system
from nvalchemi.models import NvalchemiCalculator, PaiNN
from nvalchemi.models._utils import energy_and_derivatives, graph_layout
from nvalchemi.models.base import BaseModelMixin, ModelConfig, NeighborConfig
from nvalchemi.models.export import (
    SELF_CHECK_TOLERANCE,
    ExportError,
    Potential,
    export_model,
    neighbor_inputs,
    quiet_torchscript,
    read_export_metadata,
)

TIGHT = {"rtol": 1e-10, "atol": 1e-12}


def _painn(dtype=torch.float64, **kwargs):
    torch.manual_seed(0)
    params = {
        "cutoff": 4.0,
        "hidden_channels": 16,
        "num_interactions": 2,
        "num_rbf": 8,
        "elements": [29, 79],
        "atomic_energies": {29: -3.0, 79: -2.5},
        "scale": 0.3,
        "dtype": dtype,
        "active_outputs": ("energy", "forces", "stress"),
    }
    return PaiNN(**{**params, **kwargs})


def contract_inputs(atoms, cutoff, dtype=torch.float64):
    """The contract's inputs of one ``ase.Atoms``."""
    inputs = {
        "positions": torch.tensor(atoms.positions, dtype=dtype),
        "atomic_numbers": torch.tensor(atoms.numbers, dtype=torch.long),
        "cell": torch.tensor(atoms.cell.array, dtype=dtype),
        "pbc": torch.tensor(atoms.pbc, dtype=torch.bool),
    }
    inputs.update(neighbor_inputs(**inputs, cutoff=cutoff))
    return inputs


def batched_inputs(atoms_list, cutoff, dtype=torch.float64):
    """The contract's batched inputs of several ``ase.Atoms``."""
    inputs = {
        "positions": torch.tensor(np.concatenate([a.positions for a in atoms_list]), dtype=dtype),
        "atomic_numbers": torch.tensor(np.concatenate([a.numbers for a in atoms_list])),
        "cell": torch.tensor(np.stack([a.cell.array for a in atoms_list]), dtype=dtype),
        "pbc": torch.tensor(np.stack([a.pbc for a in atoms_list])),
        "batch": torch.repeat_interleave(
            torch.arange(len(atoms_list)), torch.tensor([len(a) for a in atoms_list])
        ),
    }
    inputs.update(neighbor_inputs(**inputs, cutoff=cutoff))
    return inputs


def _slab_with_volume(helpers):
    return helpers.au_slab()  # pbc T, T, F with vacuum: a cell with volume


def _cases(helpers):
    return {
        "periodic": helpers.triclinic_cu_au(),
        "primitive": helpers.small_primitive_cu(),
        "slab": _slab_with_volume(helpers),
        "molecule": helpers.cu_cluster(),
    }


# ------------------------------------------------------------------ neighbor_inputs
def test_neighbor_inputs_are_vesins_full_list_with_cartesian_shifts(helpers):
    for atoms in _cases(helpers).values():
        inputs = contract_inputs(atoms, 4.0)
        periodic = atoms.pbc.any()
        pairs, images = neighbor_list_for_system(
            atoms.positions,
            atoms.cell.array if periodic else None,
            atoms.pbc if periodic else None,
            4.0,
        )
        assert inputs["edge_index"].dtype == torch.long
        np.testing.assert_array_equal(inputs["edge_index"].numpy(), pairs.T)
        expected = images @ atoms.cell.array if periodic else np.zeros_like(images, float)
        np.testing.assert_allclose(inputs["shifts"].numpy(), expected, atol=1e-12)
        # the contract's vector of every edge is shorter than the cutoff
        i, j = inputs["edge_index"]
        vectors = inputs["positions"][j] - inputs["positions"][i] + inputs["shifts"]
        assert float(vectors.norm(dim=1).max()) < 4.0
        # both directions of every pair are present
        shifts = np.round(inputs["shifts"].numpy(), 6) + 0.0  # + 0.0: no -0.0
        forward = sorted(zip(i.tolist(), j.tolist(), map(tuple, shifts)))
        backward = sorted(zip(j.tolist(), i.tolist(), map(tuple, -shifts + 0.0)))
        assert forward == backward


def test_neighbor_inputs_of_a_batch_are_each_systems_list_offset(helpers):
    atoms_list = list(_cases(helpers).values())
    inputs = batched_inputs(atoms_list, 4.0)
    start, edges = 0, 0
    for atoms in atoms_list:
        alone = contract_inputs(atoms, 4.0)
        count = alone["edge_index"].shape[1]
        np.testing.assert_array_equal(
            inputs["edge_index"][:, edges : edges + count].numpy(),
            alone["edge_index"].numpy() + start,
        )
        np.testing.assert_allclose(inputs["shifts"][edges : edges + count], alone["shifts"])
        start, edges = start + len(atoms), edges + count
    assert edges == inputs["edge_index"].shape[1]


def test_neighbor_inputs_keep_the_dtype_and_reject_bad_batches():
    pos = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float32)
    out = neighbor_inputs(pos, torch.tensor([1, 1]), None, None, 2.0)
    assert out["shifts"].dtype == torch.float32
    with pytest.raises(ValueError, match="contiguous"):
        neighbor_inputs(pos, torch.tensor([1, 1]), None, None, 2.0, batch=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="2 atomic numbers for 3 positions"):
        neighbor_inputs(torch.zeros(3, 3), torch.tensor([1, 1]), None, None, 2.0)


# ------------------------------------------------------------------ Potential
@pytest.mark.parametrize("case", ["periodic", "primitive", "slab", "molecule"])
def test_potential_equals_the_model_on_a_batch(helpers, case):
    atoms = _cases(helpers)[case]
    model = _painn()
    potential = Potential(model)
    out = potential(contract_inputs(atoms, potential.cutoff))
    with torch.no_grad():
        direct = model(helpers.batch_of([atoms], model.cutoff))
    assert out["energy"].shape == ()
    np.testing.assert_allclose(float(out["energy"]), float(direct["energy"]), **TIGHT)
    np.testing.assert_allclose(out["forces"].numpy(), direct["forces"].numpy(), **TIGHT)
    np.testing.assert_allclose(float(out["atomic_energies"].sum()), float(out["energy"]), **TIGHT)
    if atoms.pbc.any():
        stress = direct["stress"][0].numpy()
        np.testing.assert_allclose(out["stress"].numpy(), stress, **TIGHT)
        np.testing.assert_allclose(out["virial"].numpy(), -stress * atoms.cell.volume, **TIGHT)
    else:
        assert "stress" not in out and "virial" not in out


def test_potential_atomic_energies_are_the_models_per_atom_energies(helpers):
    atoms = helpers.triclinic_cu_au()
    model = _painn()
    out = Potential(model)(contract_inputs(atoms, model.cutoff))
    data = helpers.batch_of([atoms], model.cutoff)
    species = model.species_index(data.atomic_numbers)
    with torch.no_grad():
        features = model.node_features(
            species,
            data.positions,
            data.neighbor_list,
            data.neighbor_list_shifts,
            data.cell,
            data.batch_idx,
        )
        expected = model.atomic_energy(species, features)
    np.testing.assert_allclose(out["atomic_energies"].numpy(), expected.numpy(), **TIGHT)


def test_potential_batched_equals_each_system_alone(helpers):
    cases = _cases(helpers)
    atoms_list = [cases["periodic"], cases["molecule"], cases["slab"], cases["primitive"]]
    potential = Potential(_painn())
    out = potential(batched_inputs(atoms_list, potential.cutoff))
    assert out["energy"].shape == (4,) and out["stress"].shape == (4, 3, 3)
    start = 0
    for s, atoms in enumerate(atoms_list):
        alone = potential(contract_inputs(atoms, potential.cutoff))
        atoms_slice = slice(start, start + len(atoms))
        np.testing.assert_allclose(out["energy"][s], alone["energy"], **TIGHT)
        np.testing.assert_allclose(out["forces"][atoms_slice], alone["forces"], **TIGHT)
        np.testing.assert_allclose(
            out["atomic_energies"][atoms_slice], alone["atomic_energies"], **TIGHT
        )
        if atoms.pbc.any():
            np.testing.assert_allclose(out["stress"][s], alone["stress"], **TIGHT)
            np.testing.assert_allclose(out["virial"][s], alone["virial"], **TIGHT)
        else:  # a molecule's rows are zero
            assert not out["stress"][s].any() and not out["virial"][s].any()
        start += len(atoms)


def test_potential_leaves_the_model_as_it_was(helpers):
    model = _painn().train()
    before = set(model.model_config.active_outputs)
    Potential(model)(contract_inputs(helpers.triclinic_cu_au(), model.cutoff))
    assert model.training and set(model.model_config.active_outputs) == before


def test_potential_rejects_shifts_that_are_not_lattice_translations(helpers):
    atoms = helpers.triclinic_cu_au()
    inputs = contract_inputs(atoms, 4.0)
    inputs["shifts"] = inputs["shifts"] + 0.3
    with pytest.raises(ValueError, match="not lattice translations"):
        Potential(_painn())(inputs)


def test_potential_checks_the_head():
    with pytest.raises(ValueError, match="not a head of this model"):
        Potential(_painn(heads=["pbe", "r2scan"]), head="ccsd")


# ------------------------------------------------------------------ export_model
def _check_set(helpers):
    cases = _cases(helpers)
    return [cases["periodic"], cases["slab"], cases["molecule"], cases["primitive"]]


@pytest.fixture(scope="module")
def painn_export(tmp_path_factory):
    """A float64 PaiNN (with stress) and its export, shared by the tests that only read."""
    model = _painn()
    path = tmp_path_factory.mktemp("export") / "painn.pt"
    info = export_model(model, path)  # checked on the default sample structures
    return model, path, info


def _load(path):
    with quiet_torchscript():
        return torch.jit.load(str(path))


@pytest.mark.parametrize("case", ["periodic", "primitive", "slab", "molecule"])
def test_export_equals_the_calculator_and_the_eager_potential(helpers, painn_export, case):
    model, path, _ = painn_export
    exported = _load(path)
    atoms = _cases(helpers)[case]
    inputs = contract_inputs(atoms, exported.cutoff)
    out, eager = exported(inputs), Potential(model)(inputs)
    assert set(out) == set(eager)
    for key in eager:
        np.testing.assert_allclose(out[key].numpy(), eager[key].numpy(), **TIGHT)
    atoms.calc = NvalchemiCalculator(model)
    np.testing.assert_allclose(float(out["energy"]), atoms.get_potential_energy(), **TIGHT)
    np.testing.assert_allclose(out["forces"].numpy(), atoms.get_forces(), **TIGHT)
    if atoms.pbc.any():
        from ase.stress import full_3x3_to_voigt_6_stress

        voigt = full_3x3_to_voigt_6_stress(out["stress"].numpy())
        np.testing.assert_allclose(voigt, atoms.get_stress(), **TIGHT)


def test_export_batched_equals_the_eager_potential(helpers, painn_export):
    model, path, _ = painn_export
    exported = _load(path)
    inputs = batched_inputs(_check_set(helpers), exported.cutoff)
    out, eager = exported(inputs), Potential(model)(inputs)
    assert out["energy"].shape == (4,) and out["stress"].shape == (4, 3, 3)
    for key in eager:
        np.testing.assert_allclose(out[key].numpy(), eager[key].numpy(), **TIGHT)


def test_export_attributes_metadata_and_self_check(painn_export):
    _, path, info = painn_export
    exported = _load(path)
    assert exported.cutoff == 4.0 and isinstance(exported.cutoff, float)
    assert exported.atomic_numbers == [29, 79]
    assert read_export_metadata(path) == info
    assert info["dtype"] == "float64" and info["cutoff"] == 4.0
    assert info["model"]["class"] == "nvalchemi.models.painn.PaiNN"
    assert info["units"]["stress"].startswith("eV/Å³")
    assert info["versions"]["torch"] == torch.__version__
    check = info["self_check"]
    assert check["tolerance"] == 1e-10 and len(check["structures"]) == 3
    assert set(check["max_relative_error"]) == {
        "energy",
        "atomic_energies",
        "forces",
        "stress",
        "virial",
    }
    assert max(check["max_relative_error"].values()) <= 1e-10


def test_export_runs_under_no_grad_and_leaves_grad_mode_alone(helpers, painn_export):
    _, path, _ = painn_export
    exported = _load(path)
    inputs = contract_inputs(helpers.triclinic_cu_au(), exported.cutoff)
    expected = exported(inputs)
    with torch.no_grad():
        out = exported(inputs)
        assert not torch.is_grad_enabled()
    np.testing.assert_allclose(out["forces"].numpy(), expected["forces"].numpy(), **TIGHT)
    assert torch.is_grad_enabled()
    assert not out["forces"].requires_grad and not out["energy"].requires_grad


def test_export_raises_naming_an_unknown_element(helpers, painn_export):
    _, path, _ = painn_export
    exported = _load(path)
    inputs = contract_inputs(helpers.triclinic_cu_au(), exported.cutoff)
    inputs["atomic_numbers"] = inputs["atomic_numbers"].clone()
    inputs["atomic_numbers"][0] = 8
    with pytest.raises(Exception, match=r"cannot handle O \(Z=8\)"):
        exported(inputs)


def test_float32_export_passes_its_documented_tolerance(helpers, tmp_path):
    model = _painn()
    info = export_model(model, tmp_path / "f32.pt", dtype="float32")
    assert info["dtype"] == "float32"
    check = info["self_check"]
    assert check["tolerance"] == SELF_CHECK_TOLERANCE[torch.float32]
    assert 0 < max(check["max_relative_error"].values()) <= check["tolerance"]
    exported = _load(tmp_path / "f32.pt")
    out = exported(contract_inputs(helpers.triclinic_cu_au(), 4.0))  # float64 inputs are cast
    assert out["forces"].dtype == torch.float32
    assert next(model.parameters()).dtype == torch.float64  # the model was not converted


class _OffByAMicroElectronvolt(PaiNN):
    """A PaiNN whose export adds 1e-6 eV to every atom: what the self-check must catch."""

    def atomic_energy_module(self, head=None):
        module = super().atomic_energy_module(head)
        module.shift += 1e-6
        return module


def test_a_failing_self_check_writes_nothing_and_says_by_how_much(tmp_path):
    torch.manual_seed(0)
    model = _OffByAMicroElectronvolt(
        cutoff=4.0, hidden_channels=8, elements=[29], dtype=torch.float64
    )
    with pytest.raises(
        ExportError, match=r"energy off by [0-9.e-]+ \(relative\).*nothing was written"
    ):
        export_model(model, tmp_path / "bad.pt")
    assert list(tmp_path.iterdir()) == []
    good = export_model(_painn(elements=[29], atomic_energies=None), tmp_path / "kept.pt")
    with pytest.raises(ExportError):
        export_model(model, tmp_path / "kept.pt")
    assert read_export_metadata(tmp_path / "kept.pt") == good  # the earlier export is kept


def test_a_model_without_an_energy_module_is_refused_by_name(tmp_path):
    from nvalchemi.models import DemoModel, DemoModelWrapper

    with pytest.raises(ExportError, match=r"DemoModelWrapper.*atomic_energy_module"):
        export_model(DemoModelWrapper(DemoModel(hidden_dim=4)), tmp_path / "demo.pt")
    assert not (tmp_path / "demo.pt").exists()


class _NumpyEnergies(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cutoff = 3.0
        self.atomic_numbers = [1]

    def forward(self, positions, atomic_numbers, edge_index, shifts, batch, num_systems: int):
        return torch.from_numpy(np.ones(positions.shape[0]))


class _Unscriptable(PaiNN):
    def atomic_energy_module(self, head=None):
        return _NumpyEnergies()


def test_a_construct_torchscript_cannot_compile_is_named(tmp_path):
    model = _Unscriptable(cutoff=3.0, hidden_channels=8, elements=[1])
    with pytest.raises(
        ExportError,
        match=r"(?s)_Unscriptable cannot be exported.*compile _NumpyEnergies: .*def ones",
    ):
        export_model(model, tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


def test_formats_and_targets_are_checked(tmp_path):
    with pytest.raises(
        ExportError, match=r"format: 'aoti'.*not provided yet.*Fix: use 'torchscript'"
    ):
        export_model(_painn(), tmp_path / "m.pt2", format="aoti")
    with pytest.raises(ExportError, match="unknown export format 'onnx'"):
        export_model(_painn(), tmp_path / "m.onnx", format="onnx")
    foreign = tmp_path / "notes.pt"
    foreign.write_text("my notes")
    with pytest.raises(ExportError, match="not an nvalchemi export; it is left alone"):
        export_model(_painn(), foreign)
    assert foreign.read_text() == "my notes"
    with pytest.raises(ExportError, match="is a directory"):
        export_model(_painn(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.pt"]


def _pair_energies(vectors, centers, num_atoms: int, strength, cutoff: float):
    """Half of a smooth pair energy ``strength * (1 - r/rc)^3`` per edge, on its centre."""
    r = torch.sqrt((vectors * vectors).sum(-1))
    pair = strength * torch.clamp(1.0 - r / cutoff, min=0.0) ** 3
    return torch.zeros(num_atoms, dtype=vectors.dtype).index_add(0, centers, 0.5 * pair)


class _PairEnergies(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.strength = model.strength
        self.cutoff = model.cutoff
        self.atomic_numbers = model.elements

    def forward(self, positions, atomic_numbers, edge_index, shifts, batch, num_systems: int):
        i, j = edge_index[0], edge_index[1]
        vectors = positions[j] - positions[i] + shifts
        return _pair_energies(vectors, i, positions.shape[0], self.strength, self.cutoff)


class _PairModel(torch.nn.Module, BaseModelMixin):
    """A model of someone else's: a pair potential that gives an export module."""

    def __init__(self):
        super().__init__()
        self.cutoff, self.elements = 3.5, [29, 79]
        self.strength = torch.nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
        self.model_config = ModelConfig(
            outputs={"energy", "forces", "stress"},
            autograd_outputs={"forces", "stress"},
            optional_inputs={"cell", "pbc", "neighbor_list_shifts"},
            supports_pbc=True,
            neighbor_config=NeighborConfig(cutoff=self.cutoff),
        )

    embedding_shapes = {}

    def compute_embeddings(self, data, **kwargs):
        raise NotImplementedError

    def forward(self, data, **kwargs):
        inputs = self.adapt_input(data)
        batch_idx, num_graphs = graph_layout(data)
        pairs, images = inputs["neighbor_list"], inputs.get("neighbor_list_shifts")

        def energy_fn(positions, cell):
            vectors = edge_vectors(positions, cell, pairs, images, batch_idx)
            atoms = _pair_energies(vectors, pairs[:, 0], len(positions), self.strength, 3.5)
            return atoms.new_zeros(num_graphs).index_add(0, batch_idx, atoms)

        active = self.output_data()
        cell = inputs.get("cell")
        out = energy_and_derivatives(
            energy_fn,
            inputs["positions"],
            None if cell is None else cell.reshape(-1, 3, 3),
            batch_idx=batch_idx,
            num_graphs=num_graphs,
            compute_forces="forces" in active,
            compute_stress="stress" in active,
        )
        return self.adapt_output(out, data)

    def atomic_energy_module(self, head=None):
        return _PairEnergies(self)


def test_any_model_with_a_scriptable_energy_module_exports(helpers, tmp_path):
    model = _PairModel()
    info = export_model(model, tmp_path / "pair.pt", structures=_check_set(helpers))
    assert max(info["self_check"]["max_relative_error"].values()) <= 1e-10
    exported = _load(tmp_path / "pair.pt")
    assert exported.cutoff == 3.5 and exported.atomic_numbers == [29, 79]
    for atoms in _check_set(helpers):
        atoms.calc = NvalchemiCalculator(model)
        out = exported(contract_inputs(atoms, 3.5))
        np.testing.assert_allclose(float(out["energy"]), atoms.get_potential_energy(), **TIGHT)
        np.testing.assert_allclose(out["forces"].numpy(), atoms.get_forces(), **TIGHT)


# ------------------------------------------------------------------ MACE
@pytest.fixture(scope="module")
def mace_export(tmp_path_factory):
    """A tiny float64 MACEWrapper and its export."""
    pytest.importorskip("mace", reason="mace-torch is not installed")
    import warnings

    from nvalchemi.models import MACEWrapper

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MACEWrapper.from_mace_kwargs(
            atomic_numbers=[29, 79],
            atomic_energies={29: -3.0, 79: -2.5},
            r_max=4.0,
            num_bessel=6,
            max_ell=2,
            num_interactions=2,
            hidden_irreps="8x0e + 8x1o",
            MLP_irreps="8x0e",
            correlation=2,
            radial_MLP=[16, 16],
            avg_num_neighbors=20.0,
            atomic_inter_scale=0.5,
            seed=0,
        )
        path = tmp_path_factory.mktemp("mace") / "mace.pt"
        info = export_model(model, path)
    return model, path, info


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_mace_exports_and_equals_its_calculator(helpers, mace_export):
    model, path, info = mace_export
    assert info["model"]["class"] == "nvalchemi.models.mace.MACEWrapper"
    assert max(info["self_check"]["max_relative_error"].values()) <= 1e-10
    assert "mace" in info["versions"] and "e3nn" in info["versions"]
    exported = _load(path)
    assert exported.cutoff == 4.0 and exported.atomic_numbers == [29, 79]
    for atoms in _check_set(helpers):
        atoms.calc = NvalchemiCalculator(model)
        out = exported(contract_inputs(atoms, 4.0))
        np.testing.assert_allclose(float(out["energy"]), atoms.get_potential_energy(), **TIGHT)
        np.testing.assert_allclose(out["forces"].numpy(), atoms.get_forces(), **TIGHT)
        if atoms.pbc.any():
            from ase.stress import full_3x3_to_voigt_6_stress

            voigt = full_3x3_to_voigt_6_stress(out["stress"].numpy())
            np.testing.assert_allclose(voigt, atoms.get_stress(), **TIGHT)


# ------------------------------------------------------------------ torch only
_TORCH_ONLY = r"""
import sys

for name in ("nvalchemi", "mace", "e3nn", "ase", "vesin"):
    sys.modules[name] = None  # any import of them fails from here on
try:
    import nvalchemi  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("nvalchemi was importable")
import torch

model = torch.jit.load(sys.argv[1])
inputs = torch.load(sys.argv[2], weights_only=True)
torch.save(model(inputs), sys.argv[3])
print(model.cutoff, model.atomic_numbers)
"""


@pytest.mark.parametrize("which", ["painn", "mace"])
def test_an_export_runs_where_nvalchemi_cannot_be_imported(helpers, tmp_path, which, request):
    model, path, _ = request.getfixturevalue(f"{which}_export")
    atoms_list = _check_set(helpers)
    inputs = batched_inputs(atoms_list, 4.0)
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", _TORCH_ONLY, str(path), "inputs.pt", "out.pt"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "4.0"
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    eager = Potential(model)(inputs)
    assert set(out) == set(eager)
    for key in eager:
        np.testing.assert_allclose(out[key].numpy(), eager[key].numpy(), **TIGHT)


# ------------------------------------------------------------------ ASE from an export
def test_calculator_from_export_equals_the_calculator_on_the_model(helpers, painn_export):
    model, path, _ = painn_export
    for atoms in _check_set(helpers):
        exported, eager = atoms.copy(), atoms.copy()
        exported.calc = NvalchemiCalculator.from_export(path)
        eager.calc = NvalchemiCalculator(model)
        assert exported.calc.model is None
        np.testing.assert_allclose(
            exported.get_potential_energy(), eager.get_potential_energy(), **TIGHT
        )
        np.testing.assert_allclose(exported.get_forces(), eager.get_forces(), **TIGHT)
        if atoms.pbc.any():
            np.testing.assert_allclose(exported.get_stress(), eager.get_stress(), **TIGHT)
        else:
            from ase.calculators.calculator import PropertyNotImplementedError

            with pytest.raises(PropertyNotImplementedError):
                exported.get_stress()


def test_calculator_from_export_caches_and_refuses_what_an_export_cannot_do(helpers, painn_export):
    _, path, _ = painn_export
    calc = NvalchemiCalculator.from_export(path, label="x")
    assert calc.label == "x" and calc.implemented_properties == [
        "energy",
        "free_energy",
        "forces",
        "stress",
    ]
    atoms = helpers.triclinic_cu_au()
    atoms.calc = calc
    first = atoms.get_forces()
    results = calc.results
    atoms.get_potential_energy(), atoms.get_stress()
    assert calc.results is results  # one call for everything, cached until the atoms change
    atoms.positions[0, 0] += 0.01
    assert not np.array_equal(atoms.get_forces(), first) and calc.results is not results
    atoms.numbers[0] = 8
    with pytest.raises(ValueError, match=r"cannot handle O \(Z=8\)"):
        atoms.get_potential_energy()
    with pytest.raises(TypeError, match="exported with"):
        NvalchemiCalculator(calc.potential, head="pbe")
    with pytest.raises(TypeError, match=r"\['dtype'\]"):
        NvalchemiCalculator.from_export(path, dtype=torch.float32)


def test_the_docs_torch_and_ase_recipe_gives_the_exports_results(helpers, painn_export):
    """docs/deploy.md: inputs from ASE's own neighbour list, no nvalchemi involved."""
    from ase.neighborlist import primitive_neighbor_list

    _, path, _ = painn_export
    m = _load(path)
    for atoms in _check_set(helpers):
        i, j, images = primitive_neighbor_list(
            "ijS", atoms.pbc, atoms.cell, atoms.positions, m.cutoff, self_interaction=False
        )
        inputs = {
            "positions": torch.tensor(atoms.positions),
            "atomic_numbers": torch.tensor(atoms.numbers),
            "cell": torch.tensor(atoms.cell.array),
            "pbc": torch.tensor(atoms.pbc),
            "edge_index": torch.tensor(np.stack([i, j])),
            "shifts": torch.tensor(images @ atoms.cell.array),
        }
        ours = m(contract_inputs(atoms, m.cutoff))
        theirs = m(inputs)
        for key in ours:
            np.testing.assert_allclose(theirs[key].numpy(), ours[key].numpy(), **TIGHT)


def test_a_multi_head_model_exports_the_head_asked_for(helpers, tmp_path):
    model = _painn(heads=["pbe", "r2scan"])
    model.add_head("scan", copy_from="r2scan")
    with torch.no_grad():
        model.head_readouts["scan"].readout[-1].bias.add_(0.5)  # another head, other energies
    info = export_model(model, tmp_path / "scan.pt", head="scan")
    assert info["model"]["head"] == "scan"
    exported = _load(tmp_path / "scan.pt")
    inputs = contract_inputs(helpers.triclinic_cu_au(), exported.cutoff)
    out = exported(inputs)
    for key, value in Potential(model, head="scan")(inputs).items():
        np.testing.assert_allclose(out[key].numpy(), value.numpy(), **TIGHT)
    assert abs(float(out["energy"] - Potential(model)(inputs)["energy"])) > 1.0


def test_the_export_refuses_inputs_that_do_not_follow_the_contract(helpers, painn_export):
    _, path, _ = painn_export
    exported = _load(path)
    atoms_list = _check_set(helpers)
    inputs = batched_inputs(atoms_list, exported.cutoff)
    del inputs["batch"]  # several cells but no batch
    with pytest.raises(Exception, match=r"\(B, 3, 3\) and \(B, 3\) with a batch input"):
        exported(inputs)
    inputs = contract_inputs(atoms_list[0], exported.cutoff)
    del inputs["shifts"]
    with pytest.raises(Exception, match="the inputs have no shifts"):
        exported(inputs)


def test_the_examples_in_the_docstrings_run():
    import doctest

    from nvalchemi.models import calculator, export

    for module in (export, calculator):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__
