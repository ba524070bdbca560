"""NeighborListHook: stage wiring, building, skipping valid lists, skin reuse, layering."""

from __future__ import annotations

import subprocess
import sys
from enum import Enum, auto
from types import SimpleNamespace

import pytest
import torch
from ase.build import bulk, molecule

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.neighbors import NeighborListTransform, compute_neighbors
from nvalchemi.hooks import Hook, HookContext
from nvalchemi.hooks.neighbor_list import NeighborListHook
from nvalchemi.hooks.registry import HookRegistryMixin


class Stage(Enum):
    BEFORE_FORWARD = auto()
    AFTER_FORWARD = auto()


class DynStage(Enum):
    BEFORE_COMPUTE = auto()


def config(cutoff=3.0, half_list=False, format="coo"):
    return SimpleNamespace(cutoff=cutoff, half_list=half_list, format=format, skin=0.0)


def make_batch(seed=0) -> Batch:
    atoms = bulk("Cu", "fcc", a=3.6) * (2, 2, 1)
    atoms.rattle(0.05, seed=seed)
    crystal = AtomicData.from_atoms(atoms, dtype=torch.float64)
    water = AtomicData.from_atoms(molecule("H2O"), dtype=torch.float64)
    return Batch.from_data_list([crystal, water])


def reference_edges(batch: Batch, cutoff: float) -> set:
    copy = Batch.from_data_list(batch.to_data_list())
    compute_neighbors(copy, cutoff)
    return set(
        zip(
            map(tuple, copy.neighbor_list.tolist()),
            map(tuple, copy.neighbor_list_shifts.tolist()),
        )
    )


def edges(batch: Batch) -> set:
    return set(
        zip(
            map(tuple, batch.neighbor_list.tolist()),
            map(tuple, batch.neighbor_list_shifts.tolist()),
        )
    )


def test_protocol_defaults_and_stage_matching():
    hook = NeighborListHook(config())
    assert isinstance(hook, Hook)
    assert hook.frequency == 1 and hook.stage is None and hook.cutoff == 3.0
    assert hook._runs_on_stage(Stage.BEFORE_FORWARD)
    assert hook._runs_on_stage(DynStage.BEFORE_COMPUTE)
    assert not hook._runs_on_stage(Stage.AFTER_FORWARD)
    pinned = NeighborListHook(config(), stage=Stage.AFTER_FORWARD)
    assert pinned._runs_on_stage(Stage.AFTER_FORWARD)
    assert not pinned._runs_on_stage(Stage.BEFORE_FORWARD)


def test_runs_at_before_forward_of_the_training_stages():
    from nvalchemi.training import TrainingStage

    hook = NeighborListHook(config())
    assert hook._runs_on_stage(TrainingStage.BEFORE_FORWARD)
    assert not hook._runs_on_stage(TrainingStage.AFTER_FORWARD)


def test_registered_in_an_engine_it_builds_lists_before_forward():
    class Engine(HookRegistryMixin):
        _stage_type = Stage

        def __init__(self, hooks):
            self.step_count = 0
            self._init_hooks(hooks)

    hook = NeighborListHook(config())
    engine = Engine([hook])
    assert engine.hooks_for(Stage.BEFORE_FORWARD) == (hook,)
    assert engine.hooks_for(Stage.AFTER_FORWARD) == ()
    batch = make_batch()
    engine._call_hooks(Stage.BEFORE_FORWARD, HookContext(batch=batch))
    assert edges(batch) == reference_edges(batch, 3.0)


def test_builds_then_skips_a_batch_that_already_has_a_valid_list():
    hook = NeighborListHook(config(half_list=True))
    batch = make_batch()
    ctx = HookContext(batch=batch)
    hook(ctx, Stage.BEFORE_FORWARD)
    first = batch.neighbor_list
    hook(ctx, Stage.BEFORE_FORWARD)
    assert (hook.builds, hook.skips) == (1, 1)
    assert batch.neighbor_list is first
    assert batch.num_edges * 2 == len(reference_edges(batch, 3.0))


def test_skips_lists_precomputed_with_the_same_cutoff_and_rebuilds_other_cutoffs():
    hook = NeighborListHook(config(cutoff=3.0))
    same = make_batch()
    compute_neighbors(same, 3.0)
    hook(HookContext(batch=same), Stage.BEFORE_FORWARD)
    assert (hook.builds, hook.skips) == (0, 1)
    other = make_batch()
    compute_neighbors(other, 2.0)
    hook(HookContext(batch=other), Stage.BEFORE_FORWARD)
    assert hook.builds == 1
    assert edges(other) == reference_edges(other, 3.0)


def test_a_batch_stamped_elsewhere_is_trusted_until_its_atoms_move():
    import pickle

    built = make_batch()
    compute_neighbors(built, 3.0)
    batch = pickle.loads(pickle.dumps(built))  # as from a loader worker
    hook = NeighborListHook(config(cutoff=3.0))
    ctx = HookContext(batch=batch)
    hook(ctx, Stage.BEFORE_FORWARD)
    assert (hook.builds, hook.skips) == (0, 1)
    with torch.no_grad():
        batch.positions[0] += 0.3
    hook(ctx, Stage.BEFORE_FORWARD)
    assert hook.builds == 1
    assert edges(batch) == reference_edges(batch, 3.0)
    assert pickle.loads(pickle.dumps(hook)).cutoff == 3.0


def test_lists_of_unknown_origin_are_rebuilt():
    data = [d for d in make_batch().to_data_list()]
    data = [NeighborListTransform(2.0)(d, {})[0] for d in data]
    batch = Batch.from_data_list(data)  # carries a list, but no batch stamp
    hook = NeighborListHook(config(cutoff=3.0))
    hook(HookContext(batch=batch), Stage.BEFORE_FORWARD)
    assert hook.builds == 1
    assert edges(batch) == reference_edges(batch, 3.0)


def test_moved_atoms_get_a_new_list():
    hook = NeighborListHook(config(cutoff=3.0))
    batch = make_batch()
    ctx = HookContext(batch=batch)
    hook(ctx, Stage.BEFORE_FORWARD)
    with torch.no_grad():
        batch.positions[:4] += 0.4
    hook(ctx, Stage.BEFORE_FORWARD)
    assert hook.builds == 2
    assert edges(batch) == reference_edges(batch, 3.0)


def test_skin_reuses_the_list_until_an_atom_moves_half_the_skin():
    hook = NeighborListHook(config(cutoff=2.6), skin=0.4)
    batch = make_batch()
    ctx = HookContext(batch=batch)
    hook(ctx, DynStage.BEFORE_COMPUTE)
    assert edges(batch) == reference_edges(batch, 3.0)  # built to cutoff + skin
    with torch.no_grad():
        batch.positions[0] += torch.tensor([0.15, 0.0, 0.0], dtype=torch.float64)
    hook(ctx, DynStage.BEFORE_COMPUTE)
    assert (hook.builds, hook.reuses) == (1, 1)
    with torch.no_grad():
        batch.positions[0] += torch.tensor([0.1, 0.0, 0.0], dtype=torch.float64)
    hook(ctx, DynStage.BEFORE_COMPUTE)
    assert hook.builds == 2
    assert edges(batch) == reference_edges(batch, 3.0)
    other = make_batch(seed=1)  # a new batch object never reuses
    hook(HookContext(batch=other), DynStage.BEFORE_COMPUTE)
    assert hook.builds == 3


def test_matrix_format_and_no_batch():
    hook = NeighborListHook(config(format="matrix"), max_neighbors=40)
    hook(HookContext(batch=None), Stage.BEFORE_FORWARD)  # nothing to do
    batch = make_batch()
    hook(HookContext(batch=batch), Stage.BEFORE_FORWARD)
    assert batch.neighbor_matrix.shape == (batch.num_nodes, 40)
    hook(HookContext(batch=batch), Stage.BEFORE_FORWARD)
    assert hook.skips == 1


def test_invalid_arguments():
    with pytest.raises(ValueError, match="skin"):
        NeighborListHook(config(), skin=-1.0)
    with pytest.raises(ValueError, match="max_neighbors"):
        NeighborListHook(config(), max_neighbors=0)
    with pytest.raises(ValueError, match="method"):
        NeighborListHook(config(), method="octree")
    with pytest.raises(TypeError, match="cutoff"):
        NeighborListHook(object())
    assert NeighborListHook(4.0).cutoff == 4.0
    assert NeighborListHook(config(), method="naive").method == "naive"


def test_hook_module_does_not_import_training():
    code = (
        "import sys, nvalchemi.hooks.neighbor_list; "
        "assert not any(m.startswith('nvalchemi.training') for m in sys.modules), 'training'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
