"""``TrainingStrategy(compile=True)``: compiled forward+backward, parity with eager.

PaiNN's forces and stress come from ``energy_and_derivatives``, which ``torch.compile``
traces with ``torch.func.grad``: the compiled steps must give eager's energies, forces
and stress (5e-5 in float32, 1e-12 in float64) and its weights, without a recompile
for every batch size. The parity tests use the default backend (inductor: a C++
compile, about a minute on a loaded 2-core machine); the others ``aot_eager``.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from _training_support import TinyModel, make_batches

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.neighbors import compute_neighbors
from nvalchemi.models.painn import PaiNN
from nvalchemi.training import (
    EnergyMSELoss,
    ForceMSELoss,
    OptimizerConfig,
    StressMSELoss,
    TrainingStage,
    TrainingStrategy,
)

CUTOFF = 4.0


def cells(counts, dtype, seed=0) -> Batch:
    """A batch of rattled Cu cells of 1, 2 or 4 atoms with EMT labels and lists."""
    from ase.build import bulk
    from ase.calculators.emt import EMT

    structures = []
    for i, n in enumerate(counts):
        atoms = bulk("Cu", "fcc", a=3.6) * (1, 1, n)
        atoms.rattle(0.05, seed=seed + i)
        atoms.calc = EMT()
        atoms.get_stress()
        structures.append(AtomicData.from_atoms(atoms, dtype=dtype))
    batch = Batch.from_data_list(structures)
    compute_neighbors(batch, cutoff=CUTOFF)
    return batch


# structure, atom and edge counts that never equal 3 (a size equal to the xyz axis is
# specialised by torch's duck sizing: one extra compile, see the module docstring)
SIZES = [(1, 2, 2, 4), (2, 4), (4, 1, 2, 1), (2, 2), (1, 1, 4, 4), (4, 4)]


class Predictions:
    frequency = 1
    stage = TrainingStage.AFTER_FORWARD

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def __call__(self, ctx, stage) -> None:
        self.seen.append({k: v.detach().clone() for k, v in ctx.predictions.items()})


def painn(dtype) -> PaiNN:
    torch.manual_seed(0)
    model = PaiNN(cutoff=CUTOFF, hidden_channels=8, num_interactions=1, elements=[29], dtype=dtype)
    model.model_config.active_outputs = {"energy", "forces", "stress"}
    return model


def train(model, batches, *, epochs=1, **compile_options):
    hook = Predictions()
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 1e-3}),
        loss_fn=EnergyMSELoss() + ForceMSELoss() + StressMSELoss(),
        num_epochs=epochs,
        hooks=[hook],
        **compile_options,
    )
    strategy.run(batches)
    return strategy, hook.seen


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 5e-5), (torch.float64, 1e-12)])
def test_compiled_painn_matches_eager(dtype, tolerance):
    batches = [cells(sizes, dtype, seed=10 * i) for i, sizes in enumerate(SIZES[:3])]
    eager_model = painn(dtype)
    compiled_model = copy.deepcopy(eager_model)
    _, eager = train(eager_model, batches)
    strategy, compiled = train(compiled_model, batches, compile=True)

    assert len(eager) == len(compiled) == 3
    for ours, theirs in zip(compiled, eager):
        for key in ("predicted_energy", "predicted_forces", "predicted_stress"):
            scale = max(1.0, float(theirs[key].abs().max()))
            assert float((ours[key] - theirs[key]).abs().max()) <= tolerance * scale, key
    for ours, theirs in zip(compiled_model.parameters(), eager_model.parameters()):
        assert torch.allclose(ours, theirs, rtol=tolerance, atol=tolerance)
    assert strategy.compiled_graphs and strategy.compiled_graphs[0] > 0
    # the strategy's model stays eager (names, checkpoints, validation)
    assert type(strategy.models["main"]) is PaiNN
    assert not any(k.startswith("_orig_mod") for k in strategy.models["main"].state_dict())


def test_recompiles_stay_bounded_over_epochs_of_varying_batches():
    batches = [cells(sizes, torch.float32, seed=10 * i) for i, sizes in enumerate(SIZES)]
    assert len({(b.num_graphs, b.num_nodes, b.num_edges) for b in batches}) == len(batches)
    strategy, seen = train(
        painn(torch.float32),
        batches,
        epochs=3,
        compile=True,
        compile_kwargs={"backend": "aot_eager"},
    )
    graphs = strategy.compiled_graphs
    assert len(graphs) == 3 and len(seen) == 18
    # the first epoch compiles the graphs of the forward (and the pieces between its
    # graph breaks) once for symbolic sizes; six batch sizes later, nothing new
    assert 0 < graphs[0] <= 16
    assert graphs[1:] == [0, 0]


def test_a_model_with_its_own_autograd_forces_says_compile_is_not_supported():
    strategy = TrainingStrategy(
        models=TinyModel(),
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 1e-3}),
        loss_fn=EnergyMSELoss() + ForceMSELoss(),
        num_steps=1,
        compile=True,
        compile_kwargs={"backend": "aot_eager"},
    )
    with pytest.raises(
        RuntimeError, match=re.escape("compile=True) cannot train model 'main' (TinyModel)")
    ) as info:
        strategy.run(make_batches(1))
    assert "compile=False" in str(info.value) and "energy_and_derivatives" in str(info.value)


def test_compile_round_trips_through_the_spec():
    strategy = TrainingStrategy(
        models=painn(torch.float32),
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 1e-3}),
        loss_fn=EnergyMSELoss(),
        num_steps=1,
        compile=True,
        compile_kwargs={"mode": "max-autotune", "dynamic": False},
    )
    spec = strategy.to_spec_dict()
    assert spec["compile"] is True and spec["compile_kwargs"] == {
        "mode": "max-autotune",
        "dynamic": False,
    }
    rebuilt = TrainingStrategy.from_spec_dict(spec, models=painn(torch.float32))
    assert rebuilt.compile is True
    assert rebuilt.compile_kwargs == {"mode": "max-autotune", "dynamic": False}
    plain = TrainingStrategy.from_spec_dict(
        spec, models=painn(torch.float32), compile=False, compile_kwargs={}
    )
    spec = plain.to_spec_dict()
    assert "compile" not in spec and "compile_kwargs" not in spec  # defaults add no keys


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"fullgraf": True}, "unknown key"), (["mode"], "must be a mapping")],
)
def test_compile_kwargs_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainingStrategy(
            models=TinyModel(),
            optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 1e-3}),
            loss_fn=EnergyMSELoss(),
            num_steps=1,
            compile_kwargs=kwargs,
        )


def test_a_spec_with_a_bad_compile_entry_is_refused():
    strategy = TrainingStrategy(
        models=painn(torch.float32),
        optimizer_configs=OptimizerConfig(torch.optim.SGD, {"lr": 1e-3}),
        loss_fn=EnergyMSELoss(),
        num_steps=1,
    )
    spec = {**strategy.to_spec_dict(), "compile": "yes"}
    with pytest.raises(ValueError, match="'compile' must be a bool"):
        TrainingStrategy.from_spec_dict(spec, models=painn(torch.float32))
