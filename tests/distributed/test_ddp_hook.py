"""DDPHook in one process: wrapping, the sampler-injection matrix, teardown (stub managers).

``torch.nn.parallel.DistributedDataParallel`` is replaced by a recording wrapper, and a
stub manager reports the rank and world size, so no process group is needed. The real
two-process runs are in ``test_ddp_training.py``.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.datapipes import (
    DataLoader,
    InMemoryDataset,
    MultiDataset,
    MultiDatasetBatchSampler,
    ShuffleSampler,
)
from nvalchemi.training import EnergyMSELoss, OptimizerConfig, TrainingStage, TrainingStrategy
from nvalchemi.training.hooks import DDPHook

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


class StubManager:
    """Duck-typed manager: rank/world size and an init/destroy pair that counts calls."""

    def __init__(self, rank: int = 0, world_size: int = 2, initialized: bool = True, **attrs):
        self.rank = rank
        self.world_size = world_size
        self.initialized = initialized
        self.device = torch.device("cpu")
        self.inits = self.destroys = 0
        for name, value in attrs.items():
            setattr(self, name, value)

    def is_initialized(self) -> bool:
        return self.initialized

    def init_process_group(self, backend=None) -> None:
        self.inits += 1
        self.initialized = True

    def destroy_process_group(self) -> None:
        self.destroys += 1
        self.initialized = False


class RecordingDDP(nn.Module):
    """Stands in for DistributedDataParallel: remembers its keyword arguments."""

    created: list[RecordingDDP] = []

    def __init__(self, module: nn.Module, **kwargs) -> None:
        super().__init__()
        self.module = module
        self.kwargs = kwargs
        RecordingDDP.created.append(self)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@pytest.fixture
def fake_ddp(monkeypatch):
    RecordingDDP.created = []
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", RecordingDDP)
    return RecordingDDP


class Energy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, batch):
        atom = self.head(self.embedding(batch.atomic_numbers)).squeeze(-1)
        energy = atom.new_zeros(batch.num_graphs).index_add(0, batch.batch_idx, atom)
        return {"energy": energy.unsqueeze(-1)}


def structures(n: int = 10, offset: int = 0) -> list[AtomicData]:
    return [
        AtomicData(
            atomic_numbers=torch.tensor([1 + (i % 3)] * (1 + i % 2)),
            positions=torch.zeros(1 + i % 2, 3),
            energy=torch.full((1, 1), float(i + offset)),
        )
        for i in range(n)
    ]


def batches(n: int = 3) -> list[Batch]:
    data = structures(2 * n)
    return [Batch.from_data_list(data[2 * i : 2 * i + 2]) for i in range(n)]


def strategy_for(models, hooks, manager=None, **kwargs) -> TrainingStrategy:
    configs = kwargs.pop("optimizer_configs", OptimizerConfig(torch.optim.SGD, {"lr": 0.1}))
    return TrainingStrategy(
        models=models,
        optimizer_configs=configs,
        loss_fn=EnergyMSELoss(),
        num_steps=kwargs.pop("num_steps", 2),
        hooks=hooks,
        distributed_manager=manager,
        **kwargs,
    )


class Probe:
    """Records the models and the loader the loop actually uses."""

    frequency = 1
    stage = TrainingStage.BEFORE_TRAINING

    def __init__(self) -> None:
        self.models = None
        self.loader = None

    def __call__(self, ctx, stage) -> None:
        self.models = dict(ctx.workflow.models)
        self.loader = ctx.workflow.active_dataloader


def prepared(loader, rank=0, world_size=2, **hook_kwargs):
    hook = DDPHook(**hook_kwargs)
    hook._manager = StubManager(rank=rank, world_size=world_size)
    return hook.prepare_dataloader(loader)


def torch_loader(**kwargs) -> torch.utils.data.DataLoader:
    kwargs.setdefault("batch_size", 2)
    return torch.utils.data.DataLoader(structures(), collate_fn=Batch.from_data_list, **kwargs)


def our_loader(**kwargs) -> DataLoader:
    kwargs.setdefault("batch_size", 2)
    return DataLoader(InMemoryDataset(data_list=structures()), **kwargs)


# --------------------------------------------------------------------------- fields
def test_fields_defaults_and_setup_stage():
    hook = DDPHook()
    assert DDPHook.stage is TrainingStage.SETUP and DDPHook.frequency == 1
    assert hook.model_keys is None and hook.process_group is None and hook.backend is None
    assert hook.find_unused_parameters is None and hook.broadcast_buffers is None
    assert hook.static_graph is False and hook.auto_init is True
    assert hook.sampler_cls is DistributedSampler and hook.sampler_kwargs == {}
    assert DDPHook().sampler_kwargs is not hook.sampler_kwargs
    assert DDPHook(model_keys=["main"]).model_keys == ("main",)
    with pytest.raises(ValidationError):
        DDPHook(find_unused=True)


# --------------------------------------------------------------------------- world size one
def test_world_size_one_wraps_nothing_and_leaves_the_loader_alone(monkeypatch):
    class Refuse(nn.Module):
        def __init__(self, *args, **kwargs):
            raise AssertionError("DistributedDataParallel must not be constructed")

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", Refuse)
    model, probe = Energy(), Probe()
    loader = our_loader(shuffle=True)
    sampler = loader.sampler
    strategy = strategy_for(model, [DDPHook(), probe])
    strategy.run(loader)
    assert probe.models["main"] is model and probe.loader is loader
    assert loader.sampler is sampler and loader.batch_sampler is None
    assert not torch.distributed.is_initialized()
    torch_one = torch_loader(shuffle=True)
    assert prepared(torch_one, world_size=1) is torch_one


# --------------------------------------------------------------------------- wrapping
def test_a_manager_reporting_one_process_is_never_asked_to_initialise(fake_ddp):
    manager = StubManager(world_size=1, initialized=False)
    model, probe = Energy(), Probe()
    loader = our_loader(shuffle=True)
    strategy = strategy_for(model, [DDPHook(), probe], manager=manager)
    strategy.run(loader)
    assert manager.inits == 0 and manager.destroys == 0
    assert not torch.distributed.is_initialized()
    assert probe.models["main"] is model and probe.loader is loader
    assert fake_ddp.created == []


def test_wraps_trainable_models_with_the_exact_options_and_restores_them(fake_ddp):
    student, teacher = Energy(), Energy()
    probe = Probe()

    def training_fn(models, batch):
        return {"predicted_energy": models["student"](batch)["energy"]}

    strategy = strategy_for(
        {"student": student, "teacher": teacher},
        [DDPHook(), probe],
        StubManager(),
        optimizer_configs={"student": OptimizerConfig(torch.optim.SGD, {"lr": 0.1})},
        training_fn=training_fn,
    )
    strategy.run(batches())
    assert len(fake_ddp.created) == 1
    wrapper = fake_ddp.created[0]
    assert wrapper.module is student and probe.models["student"] is wrapper
    assert probe.models["teacher"] is teacher
    assert wrapper.kwargs == {
        "find_unused_parameters": False,
        "broadcast_buffers": False,
        "static_graph": False,
    }
    assert strategy.models == {"student": student, "teacher": teacher}  # unwrapped again
    optimizer = strategy.ensure_optimizers()[0][0]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in params] == [id(p) for p in student.parameters()]


def test_optimizers_built_before_wrapping_stay_in_use(fake_ddp):
    model = Energy()
    adam = OptimizerConfig(torch.optim.Adam, {"lr": 0.1})
    strategy = strategy_for(model, [DDPHook()], StubManager(), optimizer_configs=adam)
    (optimizer,), _ = strategy.ensure_optimizers()
    before = [p.detach().clone() for p in model.parameters()]
    strategy.run(batches())
    assert strategy.ensure_optimizers()[0][0] is optimizer  # not rebuilt for the wrapper
    assert optimizer.state and all(p in optimizer.state for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_options_come_from_the_manager_unless_set_on_the_hook(fake_ddp):
    group = object()
    manager = StubManager(find_unused_parameters=True, broadcast_buffers=True, process_group=group)
    strategy_for(Energy(), [DDPHook(static_graph=True)], manager).run(batches())
    assert fake_ddp.created[-1].kwargs == {
        "find_unused_parameters": True,
        "broadcast_buffers": True,
        "static_graph": True,
        "process_group": group,
    }
    mine = object()
    hook = DDPHook(find_unused_parameters=False, broadcast_buffers=False, process_group=mine)
    strategy_for(Energy(), [hook], manager).run(batches())
    kwargs = fake_ddp.created[-1].kwargs
    assert kwargs["find_unused_parameters"] is False and kwargs["broadcast_buffers"] is False
    assert kwargs["process_group"] is mine


def test_model_keys_select_models_and_unknown_keys_raise(fake_ddp):
    models = {"a": Energy(), "b": Energy()}
    configs = {k: OptimizerConfig(torch.optim.SGD, {"lr": 0.1}) for k in models}

    def training_fn(models, batch):
        energy = models["a"](batch)["energy"] + models["b"](batch)["energy"]
        return {"predicted_energy": energy}

    kwargs = {"optimizer_configs": configs, "training_fn": training_fn}
    strategy_for(models, [DDPHook(model_keys=("b",))], StubManager(), **kwargs).run(batches())
    assert [w.module for w in fake_ddp.created] == [models["b"]]
    strategy = strategy_for(models, [DDPHook(model_keys=("b", "c"))], StubManager(), **kwargs)
    with pytest.raises(KeyError, match=r"unknown model\(s\) \['c'\]; available model keys"):
        strategy.run(batches())


def test_already_wrapped_models_are_kept(fake_ddp):
    inner = Energy()
    wrapped = RecordingDDP(inner)
    strategy = strategy_for(wrapped, [DDPHook()], StubManager())
    strategy.run(batches())
    assert len(fake_ddp.created) == 1  # only the user's own wrapper
    assert strategy.models["main"] is wrapped  # not "restored" to the inner module


def test_uninitialised_communication_raises_without_auto_init(fake_ddp):
    manager = StubManager(initialized=False)
    strategy = strategy_for(Energy(), [DDPHook(auto_init=False)], manager)
    with pytest.raises(RuntimeError, match="requires initialized distributed communication"):
        strategy.run(batches())
    assert manager.inits == 0 and not fake_ddp.created


def test_auto_init_creates_and_teardown_destroys_only_its_own_group(fake_ddp):
    manager = StubManager(initialized=False)
    strategy_for(Energy(), [DDPHook()], manager).run(batches())
    assert (manager.inits, manager.destroys) == (1, 1)
    ready = StubManager(initialized=True)
    strategy_for(Energy(), [DDPHook()], ready).run(batches())
    assert (ready.inits, ready.destroys) == (0, 0)


def test_teardown_restores_the_model_after_a_failed_run(fake_ddp):
    class Boom:
        frequency = 1
        stage = TrainingStage.BEFORE_BATCH

        def __call__(self, ctx, stage):
            raise ValueError("boom")

    model, manager = Energy(), StubManager(initialized=False)
    strategy = strategy_for(model, [DDPHook(), Boom()], manager)
    with pytest.raises(ValueError, match="boom"):
        strategy.run(batches())
    assert strategy.models["main"] is model and manager.destroys == 1


def test_train_batch_session_wraps_once_and_close_unwraps(fake_ddp):
    model = Energy()
    strategy = strategy_for(model, [DDPHook()], StubManager())
    for batch in batches(3):
        strategy.train_batch(batch)
    assert len(fake_ddp.created) == 1 and strategy.models["main"] is fake_ddp.created[0]
    strategy.close()
    assert strategy.models["main"] is model


def test_hook_needs_the_strategy_at_setup_and_ignores_other_stages():
    hook = DDPHook()
    with pytest.raises(RuntimeError, match=r"ctx\.workflow"):
        hook(SimpleNamespace(workflow=None), TrainingStage.SETUP)
    hook(SimpleNamespace(workflow=None), TrainingStage.AFTER_BATCH)  # no-op


def test_warns_when_an_exiting_hook_is_registered_before_a_group_creating_ddphook(fake_ddp):
    class Exiting:
        frequency = 1
        stage = TrainingStage.AFTER_BATCH

        def __call__(self, ctx, stage):
            pass

        def __exit__(self, *exc):
            pass

    manager = StubManager(initialized=False)
    with pytest.warns(UserWarning, match="register DDPHook first"):
        strategy_for(Energy(), [Exiting(), DDPHook()], manager).run(batches())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy_for(Energy(), [DDPHook(), Exiting()], StubManager(initialized=False)).run(
            batches()
        )


# --------------------------------------------------------------------------- torch loaders
def test_torch_loader_is_rebuilt_with_a_distributed_sampler_and_its_options(fake_ddp):
    loader = torch_loader(shuffle=True, drop_last=True)
    probe = Probe()
    strategy = strategy_for(Energy(), [DDPHook(), probe], StubManager(rank=1), num_steps=1)
    strategy.run(loader)
    new = probe.loader
    assert new is not loader and type(new) is type(loader)
    sampler = new.sampler
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed) == (2, 1, True, 0)
    assert sampler.drop_last is True and new.drop_last is True
    assert new.batch_size == 2 and new.collate_fn == Batch.from_data_list


def test_torch_loader_options_shuffle_and_kept_distributed_samplers():
    sequential = prepared(torch_loader(shuffle=False))
    assert sequential.sampler.shuffle is False
    seeded = prepared(torch_loader(shuffle=True), sampler_kwargs={"seed": 11})
    assert seeded.sampler.seed == 11 and seeded.sampler.shuffle is True
    already = torch_loader(sampler=DistributedSampler(structures(), num_replicas=2, rank=0))
    assert prepared(already) is already


def test_torch_loader_built_with_a_batch_sampler_is_rejected():
    loader = torch.utils.data.DataLoader(
        structures(),
        batch_sampler=BatchSampler(SequentialSampler(range(10)), 2, False),
        collate_fn=Batch.from_data_list,
    )
    with pytest.raises(ValueError, match="constructed with batch_sampler"):
        prepared(loader)


# --------------------------------------------------------------------------- our loader
def test_our_loader_gets_a_distributed_batch_sampler_in_place_with_disjoint_shards():
    shards = []
    for rank in (0, 1):
        loader = our_loader(shuffle=True, seed=7)
        assert prepared(loader, rank=rank) is loader
        assert loader.sampler is None and isinstance(loader.batch_sampler, BatchSampler)
        inner = loader.batch_sampler.sampler
        assert type(inner) is DistributedSampler
        assert (inner.num_replicas, inner.rank, inner.shuffle, inner.seed) == (2, rank, True, 7)
        assert len(loader) == math.ceil(10 / 2 / 2)
        shards.append([i for b in loader.index_batches() for i in b])
        assert sum(b.num_graphs for b in loader) == 5
    assert set(shards[0]).isdisjoint(shards[1]) and set(shards[0] + shards[1]) == set(range(10))


def test_our_loader_shuffle_and_seed_are_inferred_from_the_loader_not_the_sampler_type():
    plain = prepared(our_loader())  # shuffle=False, seed=0 by default
    assert plain.batch_sampler.sampler.shuffle is False and plain.batch_sampler.sampler.seed == 0
    custom = our_loader(sampler=ShuffleSampler(10, seed=3, shuffle=True), seed=4)
    inner = prepared(custom).batch_sampler.sampler
    assert inner.shuffle is True and inner.seed == 4
    overridden = prepared(
        our_loader(shuffle=True, seed=7), sampler_kwargs={"shuffle": False, "seed": 11}
    )
    assert overridden.batch_sampler.sampler.shuffle is False
    assert overridden.batch_sampler.sampler.seed == 11
    dropping = prepared(our_loader(drop_last=True))
    assert dropping.batch_sampler.drop_last is True
    assert dropping.batch_sampler.sampler.drop_last is True


def test_our_loader_with_a_non_distributed_batch_sampler_is_rejected():
    loader = our_loader(batch_size=1, batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="non-distributed batch_sampler"):
        prepared(loader)


def test_multidataset_gets_a_multidataset_batch_sampler():
    parts = [InMemoryDataset(data_list=structures(6)), InMemoryDataset(data_list=structures(4))]
    loader = DataLoader(MultiDataset(parts), batch_size=4, shuffle=True, seed=9, drop_last=True)
    assert prepared(loader, rank=1, sampler_kwargs={"weights": [1.0, 1.0]}) is loader
    sampler = loader.batch_sampler
    assert isinstance(sampler, MultiDatasetBatchSampler) and loader.sampler is None
    assert (sampler.num_replicas, sampler.rank, sampler.seed) == (2, 1, 9)
    assert sampler.shuffle is True and sampler.drop_last is True
    assert sampler.samples_per_dataset == [2, 2]  # from the forwarded weights


def test_distributed_batch_samplers_are_kept_and_mismatched_replicas_warn():
    dataset = MultiDataset([InMemoryDataset(data_list=structures(8))])
    mine = MultiDatasetBatchSampler(dataset, batch_size=2, num_replicas=2, rank=0)
    loader = DataLoader(dataset, batch_sampler=mine)
    assert prepared(loader) is loader and loader.batch_sampler is mine
    single = DataLoader(dataset, batch_sampler=MultiDatasetBatchSampler(dataset, batch_size=2))
    with pytest.warns(UserWarning, match="num_replicas=1 while the world size is 2"):
        prepared(single)


# --------------------------------------------------------------------------- custom samplers
class MySampler(DistributedSampler):
    pass


def test_a_distributed_sampler_subclass_is_used_as_given_on_our_loader():
    loader = prepared(our_loader(shuffle=True), sampler_cls=MySampler)
    assert type(loader.batch_sampler.sampler) is MySampler
    parts = [InMemoryDataset(data_list=structures(4))]
    multi = prepared(DataLoader(MultiDataset(parts), batch_size=2), sampler_cls=MySampler)
    assert type(multi.batch_sampler.sampler) is MySampler


class Recorded:
    """Sample-level sampler from a factory; remembers its keyword arguments."""

    def __init__(self, dataset, kwargs) -> None:
        self.dataset, self.kwargs = dataset, kwargs

    def __iter__(self):
        return iter(range(len(self.dataset)))

    def __len__(self) -> int:
        return len(self.dataset)


def test_custom_factories_receive_only_the_defaults_they_accept():
    def ranks_only(dataset, num_replicas, rank):
        return Recorded(dataset, {"num_replicas": num_replicas, "rank": rank})

    def anything(dataset, **kwargs):
        return Recorded(dataset, kwargs)

    def plain(dataset, order="forward"):
        return Recorded(dataset, {"order": order})

    loader = SimpleNamespace(dataset=structures(), sampler=None, batch_size=2, drop_last=True)
    prepared(loader, rank=1, sampler_cls=ranks_only)
    assert loader.sampler.kwargs == {"num_replicas": 2, "rank": 1}
    prepared(loader, sampler_cls=anything, sampler_kwargs={"seed": 5})
    assert loader.sampler.kwargs == {
        "num_replicas": 2,
        "rank": 0,
        "shuffle": False,
        "seed": 5,
        "drop_last": True,
    }
    prepared(loader, sampler_cls=plain, sampler_kwargs={"order": "reverse"})
    assert loader.sampler.kwargs == {"order": "reverse"}


def test_custom_sampler_on_torch_and_our_loaders():
    def anything(dataset, **kwargs):
        return Recorded(dataset, kwargs)

    rebuilt = prepared(torch_loader(shuffle=True), sampler_cls=anything)
    assert isinstance(rebuilt.sampler, Recorded) and rebuilt.sampler.kwargs["shuffle"] is True
    ours = our_loader(shuffle=True)
    assert prepared(ours, sampler_cls=anything) is ours
    assert isinstance(ours.sampler, Recorded) and ours.batch_sampler is None
    kept = SimpleNamespace(dataset=structures(), sampler=Recorded(structures(), {}))
    assert prepared(kept, sampler_cls=Recorded).sampler.kwargs == {}  # already a sampler_cls


def test_loaders_without_samplers_or_datasets():
    plain = batches()
    assert prepared(plain) is plain and prepared(None) is None
    with pytest.raises(ValueError, match="no dataset attribute"):
        prepared(SimpleNamespace(sampler=None))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(structures())

    stream = torch.utils.data.DataLoader(Stream(), batch_size=2, collate_fn=Batch.from_data_list)
    assert prepared(stream) is stream


# --------------------------------------------------------------------------- budget batching
def test_a_loader_built_with_budgets_gets_the_budget_sampler_of_its_rank():
    from nvalchemi.data.datapipes import BudgetBatchSampler

    data = structures(12)
    ours = DataLoader(
        InMemoryDataset(data_list=data),
        batch_sampler=BudgetBatchSampler([d.num_nodes for d in data], max_atoms=3, seed=4),
    )
    plans = []
    for rank in (0, 1):
        loader = DataLoader(
            ours.dataset,
            batch_sampler=BudgetBatchSampler([d.num_nodes for d in data], max_atoms=3, seed=4),
        )
        same = prepared(loader, rank=rank, world_size=2)
        assert same is loader  # in place on our loader
        sampler = loader.batch_sampler
        assert (sampler.num_replicas, sampler.rank, sampler.seed) == (2, rank, 4)
        plans.append(list(loader.index_batches()))
    assert len(plans[0]) == len(plans[1])
    assert sorted(i for p in plans for b in p for i in b) == list(range(12))


def test_a_torch_loader_built_with_budgets_is_rebuilt_around_its_rank_sampler():
    from nvalchemi.data.datapipes import BudgetBatchSampler

    data = structures(12)
    sampler = BudgetBatchSampler([d.num_nodes for d in data], max_atoms=4)
    loader = torch.utils.data.DataLoader(
        data, batch_sampler=sampler, collate_fn=Batch.from_data_list, worker_init_fn=print
    )
    rebuilt = prepared(loader, rank=1, world_size=2)
    assert rebuilt is not loader and rebuilt.collate_fn == Batch.from_data_list
    assert rebuilt.worker_init_fn is print
    assert (rebuilt.batch_sampler.num_replicas, rebuilt.batch_sampler.rank) == (2, 1)
    assert (
        sum(b.num_graphs for b in rebuilt)
        + sum(b.num_graphs for b in prepared(loader, rank=0, world_size=2))
        == 12
    )
