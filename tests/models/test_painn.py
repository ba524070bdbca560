"""PaiNN: physics checks, data fitting, errors and reconstruction."""

from __future__ import annotations

import json

import pytest
import torch

from nvalchemi._serialization import init_kwargs_from_attrs
from nvalchemi.data import AtomicData, Batch
from nvalchemi.models import PaiNN
from nvalchemi.models.statistics import data_elements, fit_atomic_energies, fit_scale_shift
from nvalchemi.models.testing import check_model

SMALL = {"cutoff": 4.0, "hidden_channels": 16, "num_interactions": 2, "num_rbf": 8}


def _model(dtype=torch.float64, **kwargs):
    torch.manual_seed(0)
    params = {**SMALL, "elements": [29, 79], "atomic_energies": {29: -3.5, 79: -3.0}}
    params.update(kwargs)
    return PaiNN(dtype=dtype, scale=0.3, **params)


def test_bare_constructor_gives_a_usable_model(helpers):
    model = PaiNN()
    assert model.cutoff == 5.0 and model.num_interactions == 3
    assert model.model_config.neighbor_config.cutoff == 5.0
    out = model(helpers.batch_of([helpers.triclinic_cu_au()], 5.0, torch.float32))
    assert out["energy"].shape == (1, 1) and out["forces"].shape == (4, 3)
    assert out["energy"].dtype == torch.float32


@pytest.mark.parametrize("cutoff_fn", ["cosine", "polynomial"])
def test_physics_checks_in_float64(structures, cutoff_fn):
    report = check_model(_model(cutoff_fn=cutoff_fn), structures)
    assert report["forces_fd"] < 1e-5 and report["stress_fd"] < 1e-6


def test_float32_model_agrees_with_its_float64_copy(structures):
    model = _model(dtype=torch.float32)
    assert check_model(model, structures, checks=("dtype",))["dtype"] < 1e-3


def test_outputs_with_stress_on_a_mixed_batch(helpers):
    model = _model()
    model.set_config("active_outputs", {"energy", "forces", "stress"})
    batch = helpers.batch_of([helpers.triclinic_cu_au(), helpers.cu_cluster()], 4.0)
    out = model(batch)
    assert out["stress"].shape == (2, 3, 3)
    assert torch.equal(out["stress"][1], torch.zeros(3, 3, dtype=torch.float64))
    assert out["stress"][0].abs().sum() > 0
    assert out["forces"].shape == (8, 3)


@pytest.mark.parametrize("cutoff_fn", ["cosine", "polynomial"])
def test_stamped_neighbor_lists_longer_are_harmless_shorter_are_rejected(helpers, cutoff_fn):
    model = _model(cutoff_fn=cutoff_fn)  # cutoff 4 Å
    model.set_config("active_outputs", {"energy", "forces", "stress"})
    systems = [helpers.triclinic_cu_au(), helpers.au_slab(), helpers.cu_cluster()]
    exact = model(helpers.batch_of(systems, 4.0))
    longer = model(helpers.batch_of(systems, 6.0))  # the envelope zeroes the extra pairs
    for key in ("energy", "forces", "stress"):
        torch.testing.assert_close(longer[key], exact[key], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"cutoff >= 4 Å.*cutoff 3 Å"):
        model(helpers.batch_of(systems, 3.0))


def test_stress_is_none_without_any_cell(helpers):
    model = _model()
    model.set_config("active_outputs", {"energy", "forces", "stress"})
    out = model(helpers.batch_of([helpers.cu_cluster()], 4.0))
    assert out["stress"] is None and out["energy"] is not None


def test_forward_does_not_modify_the_batch(helpers):
    batch = helpers.batch_of([helpers.triclinic_cu_au()], 4.0)
    before = batch.positions.clone()
    _model().train()(batch)
    assert not batch.positions.requires_grad
    assert torch.equal(batch.positions, before)


def test_training_reduces_an_energy_and_force_loss(helpers):
    structures = helpers.emt_labelled([helpers.triclinic_cu_au(), helpers.au_slab()])
    batch = helpers.batch_of(structures, 4.0, torch.float32)
    model = PaiNN.from_data(batch, dtype=torch.float32, **SMALL).train()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)

    def loss_fn():
        out = model(batch)
        e = ((out["energy"] - batch.energy) / batch.num_nodes_per_graph[:, None]).pow(2).mean()
        return e + (out["forces"] - batch.forces).pow(2).mean()

    first = float(loss_fn().detach())
    for _ in range(30):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    assert float(loss_fn().detach()) < 0.5 * first


# ------------------------------------------------------------------ errors
def test_unsupported_element_names_it(helpers):
    model = _model(elements=[29], atomic_energies=None)
    with pytest.raises(ValueError, match=r"Au \(Z=79\).*elements=\["):
        model(helpers.batch_of([helpers.triclinic_cu_au()], 4.0))


def test_missing_neighbor_list_says_how_to_compute_it(helpers):
    data = AtomicData.from_atoms(helpers.triclinic_cu_au(), dtype=torch.float64)
    with pytest.raises(KeyError, match=r"neighbor_list.*compute_neighbors"):
        _model()(Batch.from_data_list([data]))


def test_periodic_input_without_shifts_is_rejected(helpers):
    data = AtomicData.from_atoms(helpers.triclinic_cu_au(), dtype=torch.float64)
    data.neighbor_list = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(ValueError, match=r"neighbor_list_shifts.*compute_neighbors"):
        _model()(data)


def test_missing_positions_is_a_key_error():
    with pytest.raises(KeyError, match="positions"):
        _model()({"atomic_numbers": torch.tensor([29]), "neighbor_list": torch.zeros(0, 2)})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cutoff": 0.0}, "cutoff"),
        ({"cutoff_fn": "gaussian"}, "cutoff_fn"),
        ({"elements": [0, 29]}, "elements"),
        ({"elements": [29], "atomic_energies": {79: 1.0}}, "atomic_energies"),
        ({"elements": [29, 79], "atomic_energies": [1.0]}, "atomic_energies"),
        ({"dtype": "int32"}, "dtype"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PaiNN(**kwargs)


# ------------------------------------------------------ fitting from data
def test_fit_atomic_energies_recovers_exact_references():
    e0 = {29: -3.25, 79: -2.5}
    structures = []
    for n_cu, n_au in [(3, 1), (1, 2), (4, 0), (2, 2)]:
        z = torch.tensor([29] * n_cu + [79] * n_au)
        energy = sum(e0[int(v)] for v in z)
        structures.append(
            AtomicData(atomic_numbers=z, positions=torch.randn(len(z), 3), energy=energy)
        )
    fitted = fit_atomic_energies(structures)
    assert fitted == pytest.approx(e0)
    assert fit_atomic_energies(Batch.from_data_list(structures)) == pytest.approx(e0)
    assert data_elements(structures) == [29, 79]
    scale, shift = fit_scale_shift(structures, fitted)
    assert shift == pytest.approx(0.0, abs=1e-9) and scale == 1.0


def test_fitting_accepts_map_style_datasets_and_loaders_of_batches():
    structures = [
        AtomicData(
            atomic_numbers=torch.tensor([29] * n), positions=torch.randn(n, 3), energy=-2.0 * n
        )
        for n in (1, 2, 3)
    ]

    class MapStyle:  # __len__ + __getitem__ only, like a plain torch Dataset
        def __len__(self):
            return len(structures)

        def __getitem__(self, i):
            return structures[i]

    assert fit_atomic_energies(MapStyle()) == pytest.approx({29: -2.0})
    loader = [Batch.from_data_list(structures[:2]), Batch.from_data_list(structures[2:])]
    assert fit_atomic_energies(loader) == pytest.approx({29: -2.0})


def test_fit_scale_shift_uses_force_rms():
    data = AtomicData(
        atomic_numbers=torch.tensor([29, 29]),
        positions=torch.zeros(2, 3),
        energy=torch.tensor(1.0),
        forces=torch.tensor([[3.0, 0.0, 0.0], [0.0, -3.0, 0.0]]),
    )
    scale, shift = fit_scale_shift([data], {29: 0.0})
    assert scale == pytest.approx(3.0 / 3**0.5)
    assert shift == pytest.approx(0.5)


def test_fit_without_energies_is_an_error():
    data = AtomicData(atomic_numbers=torch.tensor([29]), positions=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="energy"):
        fit_atomic_energies([data])


def test_from_data_fits_every_data_dependent_argument(helpers):
    structures = helpers.emt_labelled([helpers.triclinic_cu_au(), helpers.au_slab()])
    batch = helpers.batch_of(structures, 4.0)
    model = PaiNN.from_data(structures, cutoff=4.0, hidden_channels=8)
    assert model.elements == [29, 79]
    assert set(model.atomic_energies) == {"Cu", "Au"}
    e0 = fit_atomic_energies(structures)
    assert model.atomic_energies == pytest.approx({"Cu": e0[29], "Au": e0[79]}, abs=1e-6)
    assert model.scale == pytest.approx(fit_scale_shift(structures, e0)[0])
    assert fit_scale_shift(structures, model.atomic_energies) == pytest.approx(
        fit_scale_shift(structures, e0), abs=1e-6
    )
    assert model.avg_num_neighbors is None
    with_lists = PaiNN.from_data(batch, cutoff=4.0, hidden_channels=8, avg_num_neighbors="auto")
    expected = batch.num_edges / batch.num_nodes
    assert with_lists.avg_num_neighbors == pytest.approx(expected)
    with pytest.raises(ValueError, match="neighbour lists"):
        PaiNN.from_data(structures, cutoff=4.0, avg_num_neighbors="auto")


# --------------------------------------------------------- reconstruction
def test_rebuild_from_attributes_and_json(helpers):
    model = _model(elements=[29, 79], avg_num_neighbors=12.0)
    kwargs = init_kwargs_from_attrs(model)
    assert kwargs["atomic_energies"] == {"Cu": -3.5, "Au": -3.0}
    assert kwargs["dtype"] == torch.float64
    as_json = json.loads(json.dumps({**kwargs, "dtype": "float64"}))
    rebuilt = PaiNN(**as_json)
    rebuilt.load_state_dict(model.state_dict())
    batch = helpers.batch_of([helpers.triclinic_cu_au()], 4.0)
    torch.testing.assert_close(rebuilt(batch)["forces"], model(batch)["forces"])


def test_create_model_spec_rebuilds_the_model(helpers):
    from nvalchemi.training.spec import create_model_spec, create_model_spec_from_json

    model = _model()
    spec = create_model_spec(PaiNN, **init_kwargs_from_attrs(model))
    again = create_model_spec_from_json(json.loads(spec.model_dump_json())).build()
    again.load_state_dict(model.state_dict())
    assert again.dtype == torch.float64
    batch = helpers.batch_of([helpers.au_slab()], 4.0)
    torch.testing.assert_close(again(batch)["energy"], model(batch)["energy"])


def test_model_follows_to_dtype():
    model = _model(dtype=torch.float32).to(torch.float64)
    assert model.dtype == torch.float64
    assert init_kwargs_from_attrs(model)["dtype"] == torch.float64


def test_export_and_load(tmp_path, helpers):
    model = _model()
    model.export_model(tmp_path / "painn.pt")
    again = PaiNN.load(tmp_path / "painn.pt")
    batch = helpers.batch_of([helpers.triclinic_cu_au()], 4.0)
    torch.testing.assert_close(again(batch)["energy"], model(batch)["energy"])


def test_embeddings(helpers):
    model = _model()
    batch = model.compute_embeddings(helpers.batch_of([helpers.triclinic_cu_au()] * 2, 4.0))
    assert batch.node_embeddings.shape == (8, 16)
    assert batch.graph_embeddings.shape == (2, 16)
    assert model.embedding_shapes["node_embeddings"] == (16,)


def test_active_outputs_survive_a_rebuild_from_the_model_spec():
    from nvalchemi.training.model_spec import model_spec_for

    model = PaiNN(hidden_channels=8, num_interactions=1, num_rbf=4)
    model.set_config("active_outputs", {"energy", "forces", "stress"})
    rebuilt = model_spec_for(model).build()
    assert set(rebuilt.model_config.active_outputs) == {"energy", "forces", "stress"}
    with pytest.raises(ValueError, match="cannot produce"):
        PaiNN(active_outputs=("energy", "dipole"))
