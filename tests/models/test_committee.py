"""Committees: members by seed, mean and spread (known answers), the committee loss, the
online bootstrap, checkpoints and exact resume, a real 2-rank DDP run, the calculator."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from nvalchemi.models import PaiNN
from nvalchemi.models._utils import energy_and_derivatives, graph_layout
from nvalchemi.models.base import BaseModelMixin, ModelConfig
from nvalchemi.models.committee import Committee, bootstrap_counts, member_key
from nvalchemi.spec import create_model_spec

ELEMENTS = [29, 79]
TINY = {"cutoff": 4.0, "hidden_channels": 8, "num_interactions": 1, "num_rbf": 4}


class Quadratic(nn.Module, BaseModelMixin):
    """``E = a * sum |r|^2``, so ``F = -2 a r``: members with known outputs."""

    def __init__(self, a: float = 1.0) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a), dtype=torch.float64))
        self.model_config = ModelConfig(
            outputs={"energy", "forces"}, autograd_outputs={"forces"}, supports_pbc=True
        )

    embedding_shapes: dict = {}

    def compute_embeddings(self, data, **kwargs):
        raise NotImplementedError

    def forward(self, data, **kwargs):
        inputs = self.adapt_input(data)
        batch_idx, num_graphs = graph_layout(data)

        def energy(positions, cell):
            per_atom = self.a * (positions**2).sum(-1)
            return per_atom.new_zeros(num_graphs).index_add(0, batch_idx, per_atom)

        out = energy_and_derivatives(
            energy,
            inputs["positions"],
            batch_idx=batch_idx,
            num_graphs=num_graphs,
            compute_forces="forces" in self.output_data(),
            training=self.training,
        )
        return self.adapt_output(out, data)


def _member_spec(**extra):
    kwargs = {**TINY, "elements": ELEMENTS, "dtype": torch.float64, **extra}
    return create_model_spec(PaiNN, **kwargs)


def _cells(helpers, count=4):
    from ase.build import bulk

    out = []
    for i in range(count):
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True)
        atoms.numbers[i % 4] = 79
        atoms.rattle(0.08, seed=i)
        out.append(atoms)
    return helpers.emt_labelled(out)


def _batch(helpers, atoms_list, cutoff=TINY["cutoff"]):
    return helpers.batch_of(atoms_list, cutoff)


# ----------------------------------------------------------------------- members and spread
def test_member_i_is_the_member_spec_built_under_seed_plus_i():
    spec = _member_spec()
    committee = Committee([spec], size=3, seed=7)
    for index, member in enumerate(committee.members):
        torch.manual_seed(7 + index)
        alone = spec.build()
        theirs = dict(alone.named_parameters())
        for name, ours in member.named_parameters():
            assert torch.equal(ours, theirs[name]), name
    first = committee.members[0].embedding.weight
    assert not torch.equal(first, committee.members[1].embedding.weight)


def test_building_a_committee_leaves_the_callers_random_stream_alone():
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    Committee([_member_spec()], size=2)
    assert torch.equal(torch.rand(3), expected)


def test_mean_spread_and_dpgen_deviation_match_the_known_answer(helpers):
    committee = Committee([Quadratic(1.0), Quadratic(2.0), Quadratic(3.0)])
    atoms = _cells(helpers, 2)
    batch = _batch(helpers, atoms)
    out = committee(batch)
    positions = batch.positions.double()
    sq = (positions**2).sum(-1)
    per_structure = torch.zeros(2, dtype=torch.float64).index_add(0, batch.batch_idx, sq)
    spread = math.sqrt(2.0 / 3.0)  # population std of (1, 2, 3)
    assert torch.allclose(out["energy"].reshape(-1), 2.0 * per_structure)
    assert torch.allclose(out["energy_std"].reshape(-1), spread * per_structure)
    assert torch.allclose(out["forces"], -4.0 * positions)
    assert torch.allclose(out["forces_std"], 2.0 * spread * positions.abs())
    # DP-GEN: max over atoms of sqrt(mean_m |F_m - mean F|^2)
    forces = np.stack([-2.0 * a * positions.numpy() for a in (1.0, 2.0, 3.0)])
    per_atom = np.sqrt(((forces - forces.mean(0)) ** 2).sum(-1).mean(0))
    owner = batch.batch_idx.numpy()
    expected = [per_atom[owner == b].max() for b in range(2)]
    assert np.allclose(out["max_force_deviation"].reshape(-1).numpy(), expected)
    for index, a in enumerate((1.0, 2.0, 3.0)):
        assert torch.allclose(out[member_key("forces", index)], -2.0 * a * positions)
    assert "stress" not in out


def test_calibration_factors_scale_the_spreads_of_their_quantity_only(helpers):
    committee = Committee([Quadratic(1.0), Quadratic(2.0)])
    batch = _batch(helpers, _cells(helpers, 2))
    before = committee(batch)
    committee.set_uncertainty_scale(forces=2.5)
    after = committee(batch)
    assert torch.allclose(after["forces_std"], 2.5 * before["forces_std"])
    assert torch.allclose(after["max_force_deviation"], 2.5 * before["max_force_deviation"])
    assert torch.equal(after["energy_std"], before["energy_std"])
    assert torch.equal(after["forces"], before["forces"])
    with pytest.raises(ValueError, match="must be > 0"):
        committee.set_uncertainty_scale(energy=0.0)
    with pytest.raises(ValueError, match="unknown quantities"):
        committee.set_uncertainty_scale(charges=1.0)


def test_painn_committee_outputs_are_the_members_mean_and_spread(helpers):
    spec = _member_spec(active_outputs=["energy", "forces", "stress"])
    committee = Committee([spec], size=3).eval()
    batch = _batch(helpers, _cells(helpers, 3))
    out = committee(batch)
    alone = [member(batch) for member in committee.members]
    for key in ("energy", "forces", "stress"):
        stacked = torch.stack([o[key].reshape(out[key].shape) for o in alone])
        assert torch.allclose(out[key], stacked.mean(0))
        std_key = "energy_std" if key == "energy" else f"{key}_std"
        assert torch.allclose(out[std_key], stacked.std(0, unbiased=False))
        assert not out[std_key].requires_grad


def test_active_outputs_reach_the_members_and_spreads_follow_their_quantity(helpers):
    committee = Committee([_member_spec()], size=2).eval()
    batch = _batch(helpers, _cells(helpers, 1))
    committee.set_config("active_outputs", {"energy"})
    out = committee(batch)
    assert set(out) == {"energy", "energy_std", "energy_m0", "energy_m1"}
    committee.set_config("active_outputs", {"max_force_deviation"})
    assert "forces" in committee(batch) and "max_force_deviation" in committee(batch)


def test_members_must_agree_on_their_neighbour_lists_and_be_models():
    with pytest.raises(ValueError, match="at least 2 members"):
        Committee([_member_spec()])
    with pytest.raises(ValueError, match="size=3"):
        Committee([_member_spec(), _member_spec()], size=3)
    with pytest.raises(TypeError, match=r"nn\.Module \+ BaseModelMixin"):
        Committee([nn.Linear(2, 2), nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="neighbour-list format"):
        Committee([Quadratic(), PaiNN(**TINY, elements=ELEMENTS)])


def test_from_data_fits_once_and_draws_every_member_from_its_own_seed(helpers):
    from nvalchemi.data import AtomicData

    data = [AtomicData.from_atoms(a, dtype=torch.float64) for a in _cells(helpers, 4)]
    committee = Committee.from_data(data, members=[_member_spec()], size=2, seed=4)
    reference = PaiNN.from_data(data, **_member_spec().kwargs)
    for index, member in enumerate(committee.members):
        assert member.atomic_energies == reference.atomic_energies
        assert (member.scale, member.shift) == (reference.scale, reference.shift)
        torch.manual_seed(4 + index)
        alone = PaiNN(**member.init_kwargs())
        assert torch.equal(member.embedding.weight, alone.embedding.weight)


def test_checkpoint_spec_rebuilds_the_committee_with_its_calibration(helpers):
    from nvalchemi.training.model_spec import model_spec_for

    committee = Committee([_member_spec()], size=2, seed=1, bootstrap=True)
    committee.set_uncertainty_scale(forces=1.7)
    spec = model_spec_for(committee, strict=True)
    rebuilt = spec.build()
    rebuilt.load_state_dict(committee.state_dict())
    assert rebuilt.bootstrap and rebuilt.size == 2
    batch = _batch(helpers, _cells(helpers, 1))
    assert torch.equal(rebuilt.eval()(batch)["forces_std"], committee.eval()(batch)["forces_std"])


# ------------------------------------------------------------------------------ training
def _loss():
    from nvalchemi.training import EnergyMSELoss, ForceMSELoss

    return EnergyMSELoss(per_atom=True) + 10.0 * ForceMSELoss()


def _member_grads(model, loss, batch, **extra):
    from nvalchemi.training.strategy import default_training_fn

    model.zero_grad()
    predictions = default_training_fn(model, batch)
    targets = {"energy": batch.energy, "forces": batch.forces}
    total = loss(
        predictions,
        targets,
        batch_idx=batch.batch_idx,
        num_graphs=batch.num_graphs,
        num_nodes_per_graph=batch.num_nodes_per_graph,
        **extra,
    )["total_loss"]
    total.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_committee_loss_trains_every_member_as_if_alone(helpers):
    from nvalchemi.app.committee import committee_loss

    committee = Committee([_member_spec()], size=2).train()
    batch = _batch(helpers, _cells(helpers, 3))
    ours = _member_grads(committee, committee_loss(_loss(), 2), batch)
    offset = 0
    for member in committee.members:
        alone = _member_grads(copy.deepcopy(member), _loss(), batch)
        for got, expected in zip(ours[offset : offset + len(alone)], alone):
            assert torch.allclose(got, expected / 2, atol=1e-12)
        offset += len(alone)


def test_bootstrap_counts_are_poisson_deterministic_and_order_free(helpers):
    from ase.build import bulk

    from nvalchemi.data import AtomicData, Batch

    cells = []
    for i in range(600):
        atoms = bulk("Cu", "fcc", a=3.6) * (2, 1, 1)
        atoms.rattle(0.1, seed=i)
        cells.append(AtomicData.from_atoms(atoms, dtype=torch.float32))
    batch = Batch.from_data_list(cells)
    counts = bootstrap_counts(batch, 4, seed=0)
    assert counts.shape == (4, 600)
    assert abs(counts.mean().item() - 1.0) < 0.08 and abs(counts.var().item() - 1.0) < 0.15
    assert abs((counts == 0).float().mean().item() - math.exp(-1)) < 0.04
    assert not torch.equal(counts[0], counts[1])
    assert not torch.equal(counts, bootstrap_counts(batch, 4, seed=1))
    # the same structure, alone, in another batch, with its atoms reversed: the same counts
    reversed_atoms = AtomicData(
        atomic_numbers=cells[5].atomic_numbers.flip(0), positions=cells[5].positions.flip(0)
    )
    assert torch.equal(bootstrap_counts(reversed_atoms, 4)[:, 0], counts[:, 5])


def test_bootstrap_scales_each_members_gradient_by_its_counts(helpers):
    from nvalchemi.app.committee import committee_loss

    committee = Committee([_member_spec()], size=2, bootstrap=True).train()
    batch = _batch(helpers, _cells(helpers, 4))
    counts = bootstrap_counts(batch, 2)
    assert len({tuple(c.tolist()) for c in counts}) == 2  # the members draw differently
    ours = _member_grads(committee, committee_loss(_loss(), 2), batch)
    offset = 0
    for index, member in enumerate(committee.members):
        weight = counts[index].to(torch.float64)
        alone = _member_grads(copy.deepcopy(member), _loss(), batch, loss_weight=weight)
        # loss_weight gives a weighted mean (divided by the sum of the weights); the bootstrap
        # scales each structure's gradient by its count alone: on cells of one size the two
        # differ by sum(counts) / structures
        scale = float(weight.sum()) / len(weight)
        for got, expected in zip(ours[offset : offset + len(alone)], alone):
            assert torch.allclose(got, expected * scale / 2, atol=1e-12)
        offset += len(alone)


def _hooks(root: Path) -> list:
    from nvalchemi.training.hooks import CheckpointHook, EMAHook

    return [CheckpointHook(root, step_interval=3), EMAHook(decay=0.9)]


def _loader(train):
    from nvalchemi.data.datapipes import DataLoader, InMemoryDataset

    return DataLoader(InMemoryDataset(data_list=train), batch_size=2, shuffle=True, seed=3)


def _strategy(root: Path, num_steps: int):
    from nvalchemi.app.committee import committee_loss
    from nvalchemi.training import OptimizerConfig, TrainingStrategy

    torch.manual_seed(0)
    return TrainingStrategy(
        models=Committee([_member_spec()], size=2, bootstrap=True),
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
        loss_fn=committee_loss(_loss(), 2),
        num_steps=num_steps,
        hooks=_hooks(root),
    )


def test_exact_resume_of_a_committee_run(helpers, tmp_path):
    from nvalchemi.app.evaluation import final_model
    from nvalchemi.data import AtomicData
    from nvalchemi.data.neighbors import NeighborListTransform
    from nvalchemi.training import TrainingStrategy

    transform = NeighborListTransform(TINY["cutoff"])
    cells = _cells(helpers, 4)
    train = [transform(AtomicData.from_atoms(a, dtype=torch.float64), {})[0] for a in cells]
    reference = _strategy(tmp_path / "ref", 6)
    reference.run(_loader(train))

    _strategy(tmp_path / "run", 3).run(_loader(train))
    resumed = TrainingStrategy.load_checkpoint(
        tmp_path / "run", hooks=_hooks(tmp_path / "run"), overrides={"num_steps": 6}
    )
    assert resumed.step_count == 3
    resumed.run(_loader(train))
    for weights in ("never", "always"):  # the live and the EMA weights
        (ours, kind), (theirs, _) = final_model(resumed, weights), final_model(reference, weights)
        assert kind == ("live" if weights == "never" else "ema")
        torch.testing.assert_close(
            ours.state_dict(), theirs.state_dict(), rtol=0, atol=0, equal_nan=True, msg=kind
        )


def test_two_gloo_ranks_train_a_committee_like_one_process_on_the_union(tmp_path):
    from _ranks import run_ranks

    script = Path(__file__).with_name("_committee_ranks.py")
    results = run_ranks(script, args=[str(tmp_path)], timeout=180)
    assert results[0]["wrapped"] == "DistributedDataParallel"
    single = torch.load(tmp_path / "single.pt", weights_only=True)
    for rank in (0, 1):
        ours = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(ours, single, rtol=1e-5, atol=1e-6, equal_nan=True)


# ---------------------------------------------------------------------------- calculator
def test_calculator_reports_the_spread_and_uses_the_calibration(helpers, tmp_path):
    from nvalchemi.models import CommitteeCalculator, NvalchemiCalculator

    committee = Committee([_member_spec(active_outputs=["energy", "forces", "stress"])], size=3)
    atoms = _cells(helpers, 1)[0]
    batch = _batch(helpers, [atoms])
    expected = committee.eval()(batch)
    atoms.calc = CommitteeCalculator(committee)
    assert np.allclose(atoms.get_forces(), expected["forces"].numpy())
    assert np.allclose(atoms.calc.get_property("forces_std", atoms), expected["forces_std"])
    deviation = atoms.calc.get_property("max_force_deviation", atoms)
    assert deviation == pytest.approx(float(expected["max_force_deviation"]))
    assert atoms.calc.get_property("stress_std", atoms).shape == (6,)
    committee.set_uncertainty_scale(forces=3.0)
    atoms.calc = CommitteeCalculator(committee)
    assert atoms.calc.get_property("max_force_deviation", atoms) == pytest.approx(3 * deviation)
    with pytest.raises(TypeError, match="outputs no spread"):
        CommitteeCalculator(PaiNN(**TINY, elements=ELEMENTS))
    # the plain calculator passes the spread of a committee through too
    plain = atoms.copy()
    plain.calc = NvalchemiCalculator(committee)
    assert plain.calc.get_property("max_force_deviation", plain) == pytest.approx(3 * deviation)


def test_set_config_active_outputs_reaches_the_members_and_their_specs(helpers):
    from nvalchemi.training.model_spec import model_spec_for

    committee = Committee([_member_spec()], size=2)
    committee.set_config("active_outputs", {"energy", "forces", "stress"})
    assert all(m.active_outputs == ("energy", "forces", "stress") for m in committee.members)
    rebuilt = model_spec_for(committee, strict=True).build()
    assert set(rebuilt.model_config.active_outputs) == {"energy", "forces", "stress"}
    # a temporary choice (as evaluation makes) leaves the members' own setting alone
    committee.model_config.active_outputs = {"energy"}
    committee.eval()(_batch(helpers, _cells(helpers, 1)))
    assert all(m.active_outputs == ("energy", "forces", "stress") for m in committee.members)
