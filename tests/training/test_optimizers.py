"""OptimizerConfig validation/serialization, parameter partitioning and stepping helpers."""

import copy
import json
import warnings

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from nvalchemi import _serialization as ser
from nvalchemi.training import create_model_spec_from_json
from nvalchemi.training.optimizers import (
    OptimizerConfig,
    is_metric_scheduler,
    iter_qualified_named_parameters,
    setup_optimizers,
    step_lr_schedulers,
    step_metric_schedulers,
    step_optimizers,
    zero_gradients,
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def adam(**kwargs):
    kwargs.setdefault("optimizer_kwargs", {"lr": 1e-3})
    return OptimizerConfig(optimizer_cls=torch.optim.Adam, **kwargs)


def pick_val_loss(summary):
    return summary["val_loss"] * 2


@pytest.fixture
def trust_this_module():
    allowed = set(ser._ALLOWED)
    ser.allow_import_path(__name__)
    yield
    ser._ALLOWED.clear()
    ser._ALLOWED.update(allowed)


# ------------------------------------------------------------------------------ config


def test_seed_example_and_build():
    config = OptimizerConfig(
        optimizer_cls=torch.optim.AdamW,
        optimizer_kwargs={"lr": 1e-4, "weight_decay": 1e-5},
    )
    optimizer, scheduler = config.build(Net().parameters())
    assert isinstance(optimizer, torch.optim.AdamW) and scheduler is None
    assert optimizer.param_groups[0]["weight_decay"] == 1e-5
    config = OptimizerConfig(
        "torch.optim.sgd.SGD", {"lr": 0.5}, "torch.optim.lr_scheduler.StepLR", {"step_size": 1}
    )
    optimizer, scheduler = config.build(Net().parameters())
    assert config.optimizer_cls is torch.optim.SGD and isinstance(scheduler, StepLR)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (
            {"optimizer_kwargs": {"lr": 1e-3, "bogus_kwarg": 1}},
            r"Invalid optimizer kwargs for Adam: \['bogus_kwarg'\]",
        ),
        (
            {"scheduler_cls": StepLR},
            r"Missing required scheduler kwargs for StepLR: \['step_size'\]",
        ),
        (
            {"scheduler_cls": StepLR, "scheduler_kwargs": {"step_size": 1, "gama": 0.5}},
            r"Invalid scheduler kwargs for StepLR: \['gama'\]",
        ),
        (
            {"scheduler_kwargs": {"step_size": 1}},
            r"scheduler_kwargs provided but scheduler_cls is None",
        ),
        (
            {"scheduler_metric_adapter": "val"},
            r"scheduler_metric_adapter provided but scheduler_cls is None",
        ),
        (
            {"lr": 1e-4},
            r"Unknown OptimizerConfig argument\(s\) \['lr'\]; optimizer options such as lr",
        ),
        ({"param_groups": [{"lr": 0.1}]}, r"param_groups\[0\] needs a 'params' entry"),
        (
            {"param_groups": [{"params": "*.bias", "lrr": 0.1}]},
            r"Invalid param_groups\[0\] optimizer kwargs for Adam: \['lrr'\]",
        ),
        ({"parameters": [1]}, r"parameters"),
        ({"scheduler_metric_adapter": 3, "scheduler_cls": ReduceLROnPlateau}, r"summary key"),
    ],
)
def test_invalid_configs_name_the_argument(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        adam(**kwargs)


def test_missing_required_optimizer_argument():
    with pytest.raises(
        ValueError, match=r"Missing required optimizer kwargs for Required: \['alpha'\]"
    ):
        OptimizerConfig(Required)


class Required(torch.optim.SGD):
    def __init__(self, params, alpha, lr=0.1):
        super().__init__(params, lr=lr * alpha)


def test_class_paths_go_through_the_allow_list():
    with pytest.raises(ValueError, match="must resolve to an importable class"):
        OptimizerConfig("torch.optim.NoSuchOptimizer")
    with pytest.raises(ValueError, match="outside the import allow-list"):
        OptimizerConfig("os.system")
    for bad in ("nopackage.Optimizer", "Adam", "torch.optim"):
        with pytest.raises(ValueError, match=f"'{bad}' must resolve to an importable class"):
            OptimizerConfig(bad)
        with pytest.raises(ValueError, match=f"'{bad}' must resolve to an importable class"):
            OptimizerConfig(torch.optim.Adam, {"lr": 1.0}, scheduler_cls=bad)
    with pytest.raises(ValueError, match="must be a class"):
        OptimizerConfig(torch.optim.Adam, {"lr": 1.0}, scheduler_cls="torch.nn.functional.relu")
    with pytest.raises(TypeError, match="multiple values"):
        OptimizerConfig(torch.optim.Adam, optimizer_cls=torch.optim.SGD)


def test_reduce_lr_on_plateau_is_accepted():
    config = adam(scheduler_cls=ReduceLROnPlateau, scheduler_kwargs={"patience": 0})
    assert is_metric_scheduler(config.build(Net().parameters())[1])


def test_spec_json_round_trip(trust_this_module):
    config = OptimizerConfig(
        torch.optim.Adam,
        {"lr": 1e-3, "betas": (0.8, 0.9)},
        scheduler_cls=ReduceLROnPlateau,
        scheduler_kwargs={"factor": 0.5},
        scheduler_metric_adapter=pick_val_loss,
        parameters=["head.*"],
        param_groups=[{"params": ["*.bias"], "weight_decay": 0.0}],
    )
    data = json.loads(json.dumps(config.to_spec().model_dump()))
    assert data["optimizer_cls"] == "torch.optim.adam.Adam"
    assert data["scheduler_metric_adapter"] == {"__type__": f"{__name__}.pick_val_loss"}
    again = OptimizerConfig.from_spec(create_model_spec_from_json(data))
    assert again.optimizer_cls is torch.optim.Adam and again.scheduler_cls is ReduceLROnPlateau
    assert again.scheduler_metric_adapter is pick_val_loss
    assert again.optimizer_kwargs == {"lr": 1e-3, "betas": [0.8, 0.9]}
    assert again.parameters == ["head.*"] and again.param_groups == config.param_groups
    assert again.to_spec().model_dump() | {"timestamp": data["timestamp"]} == data


def test_spec_errors():
    with pytest.raises(TypeError, match="cannot be serialized"):
        adam(scheduler_cls=ReduceLROnPlateau, scheduler_metric_adapter=lambda s: 1.0).to_spec()
    with pytest.raises(TypeError, match="not OptimizerConfig"):
        OptimizerConfig.from_spec(
            create_model_spec_from_json({"cls_path": "torch.nn.Identity", "timestamp": "t"})
        )


# ------------------------------------------------------------------------------ setup


def test_setup_single_module_and_mappings():
    net = Net()
    pairs = setup_optimizers(net, adam())
    assert list(pairs) == ["main"] and len(pairs["main"]) == 1
    assert pairs["main"][0][0].param_groups[0]["params"] == list(net.parameters())
    teacher = Net()
    pairs = setup_optimizers(
        nn.ModuleDict({"student": net, "teacher": teacher}), {"student": adam()}
    )
    assert list(pairs) == ["student"]
    assert (
        setup_optimizers({"main": net}, {0: [adam()]})["main"][0][0].param_groups[0]["lr"] == 1e-3
    )


def test_setup_errors():
    net = Net()
    with pytest.raises(
        ValueError, match=r"key 'x' is not present in models; available model keys: \['main'\]"
    ):
        setup_optimizers(net, {"x": adam()})
    with pytest.raises(ValueError, match="Unkeyed optimizer_configs require single-model input"):
        setup_optimizers({"a": net, "b": Net()}, adam())
    with pytest.raises(ValueError, match=r"optimizer_configs\['main'\] must contain at least one"):
        setup_optimizers(net, {"main": []})
    net.requires_grad_(False)
    with pytest.raises(
        ValueError,
        match=r"Configured model 'main' has no trainable parameters \(requires_grad=True\)",
    ):
        setup_optimizers(net, adam())
    net.requires_grad_(True)
    with pytest.raises(ValueError, match="after optimizer parameter filtering"):
        setup_optimizers(net, adam(), allowed_parameter_names=["other.x"])


def test_frozen_and_filtered_parameters_are_left_out():
    net = Net()
    net.body.weight.requires_grad_(False)
    params = setup_optimizers(net, adam())["main"][0][0].param_groups[0]["params"]
    assert [p is net.body.weight for p in params] == [False] * 3
    allowed = ["main.head.weight", "main.head.bias"]
    params = setup_optimizers(net, adam(), allowed_parameter_names=allowed)["main"][0][
        0
    ].param_groups[0]["params"]
    assert params == [net.head.weight, net.head.bias]


def test_two_optimizers_split_the_parameters():
    net = Net()
    pairs = setup_optimizers(
        net,
        [
            adam(parameters=["head.*"]),
            OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),  # everything else
        ],
    )["main"]
    (head_opt, _), (rest_opt, _) = pairs
    assert head_opt.param_groups[0]["params"] == [net.head.weight, net.head.bias]
    assert rest_opt.param_groups[0]["params"] == [net.body.weight, net.body.bias]


def test_parameter_claims_must_be_unambiguous():
    net = Net()
    with pytest.raises(
        ValueError,
        match=r"Parameter 'main.head.bias' is claimed by optimizer_configs\['main'\]\[0\] and \[1\]",
    ):
        setup_optimizers(net, [adam(parameters=["head.*"]), adam(parameters=["*.bias"])])
    with pytest.raises(
        ValueError, match=r"\[0\] and \[1\] both leave `parameters` unset.*'main.body.weight'"
    ):
        setup_optimizers(net, [adam(), adam()])
    with pytest.raises(
        ValueError, match=r"pattern 'tail.\*' matches no trainable parameter of model 'main'"
    ):
        setup_optimizers(net, [adam(parameters=["tail.*"])])
    with pytest.raises(ValueError, match=r"optimizer_configs\['main'\]\[1\] has no parameters"):
        setup_optimizers(net, [adam(parameters=["*"]), adam()])
    with pytest.warns(UserWarning, match=r"will not be updated: \['body.weight', 'body.bias'\]"):
        setup_optimizers(net, [adam(parameters=["head.*"])])


def test_param_groups_with_per_group_options():
    net = Net()
    config = OptimizerConfig(
        torch.optim.SGD,
        {"lr": 0.1, "weight_decay": 1e-4},
        param_groups=[
            {"params": "*.bias", "weight_decay": 0.0},
            {"params": ["head.weight"], "lr": 0.01},
        ],
    )
    optimizer, _ = setup_optimizers(net, config)["main"][0]
    groups = optimizer.param_groups
    assert [g["params"] for g in groups] == [
        [net.body.bias, net.head.bias],
        [net.head.weight],
        [net.body.weight],
    ]
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(0.1, 0.0), (0.01, 1e-4), (0.1, 1e-4)]
    overlapping = OptimizerConfig(
        torch.optim.SGD, {"lr": 0.1}, param_groups=[{"params": "*.bias"}, {"params": "head.*"}]
    )
    with pytest.raises(
        ValueError, match=r"Parameter 'head.bias' matches param_groups\[0\] and param_groups\[1\]"
    ):
        setup_optimizers(net, overlapping)
    missing = OptimizerConfig(torch.optim.SGD, {"lr": 0.1}, param_groups=[{"params": "tail.*"}])
    with pytest.raises(ValueError, match=r"param_groups\[0\] pattern 'tail.\*' matches none"):
        setup_optimizers(net, missing)


def test_qualified_names_ignore_wrappers():
    net = Net()
    names = [n for n, _ in iter_qualified_named_parameters({"student": nn.DataParallel(net)})]
    assert names == [
        "student.body.weight",
        "student.body.bias",
        "student.head.weight",
        "student.head.bias",
    ]
    assert next(iter_qualified_named_parameters(net))[0] == "main.body.weight"
    pairs = setup_optimizers(
        nn.DataParallel(net),
        adam(parameters=["head.*"]),
        allowed_parameter_names=["main.head.weight"],
    )
    assert pairs["main"][0][0].param_groups[0]["params"] == [net.head.weight]


# ------------------------------------------------------------------------------ stepping


def test_zero_step_and_time_based_schedulers():
    net = Net()
    (opt, sched), (opt2, plateau) = setup_optimizers(
        net,
        [
            OptimizerConfig(
                torch.optim.SGD,
                {"lr": 0.5},
                StepLR,
                {"step_size": 1, "gamma": 0.9},
                parameters=["head.*"],
            ),
            adam(scheduler_cls=ReduceLROnPlateau),
        ],
    )["main"]
    for _ in range(4):
        zero_gradients([opt, opt2])
        net(torch.ones(2, 3)).sum().backward()
        before = net.head.weight.detach().clone()
        step_optimizers([opt, opt2])
        assert not torch.equal(before, net.head.weight)
        step_lr_schedulers([sched, plateau, None])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 0.9**4)
    assert opt2.param_groups[0]["lr"] == 1e-3  # metric scheduler not stepped
    zero_gradients([opt, opt2])
    assert all(p.grad is None for p in net.parameters())


def test_metric_schedulers_use_their_adapters():
    net = Net()
    scheds = [
        ReduceLROnPlateau(torch.optim.SGD(net.parameters(), lr=1.0), patience=0, factor=0.5)
        for _ in range(3)
    ]
    adapters = [None, "val_loss", lambda summary: summary["val_loss"] * 2]
    step_metric_schedulers(
        [*scheds, StepLR(torch.optim.SGD(net.parameters(), lr=1.0), 1), None],
        [*adapters, None, None],
        {"total_loss": torch.tensor(1.0), "val_loss": 5.0},
    )
    assert [s.best for s in scheds] == [1.0, 5.0, 10.0]
    with pytest.raises(
        KeyError,
        match=r"Scheduler metric key 'nope' not found in validation summary; available keys: \['total_loss'\]",
    ):
        step_metric_schedulers([scheds[0]], ["nope"], {"total_loss": 1.0})
    with pytest.raises(ValueError, match="2 schedulers but 1 adapters"):
        step_metric_schedulers(scheds[:2], [None], {"total_loss": 1.0})


# -- zero_gradients / step_optimizers: torch's own calls ------------------------------------


def _trained_pair(make_optimizer, steps=4, scheduler=None):
    """Two identical models; one stepped with torch's calls, one with the helpers."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    ours = copy.deepcopy(reference)
    opt_ref, opt_ours = make_optimizer(reference), make_optimizer(ours)
    scheds = [scheduler(opt_ref), scheduler(opt_ours)] if scheduler else None
    x = torch.randn(5, 3)
    for _ in range(steps):
        opt_ref.zero_grad(set_to_none=True)
        reference(x).pow(2).sum().backward()
        opt_ref.step()
        zero_gradients([opt_ours])
        ours(x).pow(2).sum().backward()
        step_optimizers([opt_ours])
        if scheds:
            for s in scheds:
                s.step()
    return reference, ours, opt_ref, opt_ours


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
        lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True),
    ],
    ids=["adam", "adamw", "sgd"],
)
def test_helpers_update_exactly_like_torch_calls(make_optimizer):
    reference, ours, opt_ref, opt_ours = _trained_pair(make_optimizer)
    for a, b in zip(reference.parameters(), ours.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(a.grad, b.grad)
    zero_gradients([opt_ours])
    assert all(p.grad is None for p in ours.parameters())
    ref_state, our_state = opt_ref.state_dict(), opt_ours.state_dict()
    assert ref_state["param_groups"] == our_state["param_groups"]
    assert ref_state["state"].keys() == our_state["state"].keys()
    for index, entries in ref_state["state"].items():
        assert entries.keys() == our_state["state"][index].keys()
        for key, value in entries.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(our_state["state"][index][key])
            )


def test_step_hooks_still_run():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    handles = [
        opt.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
        opt.register_step_post_hook(lambda o, a, k: calls.append("post")),
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append("global post")),
    ]
    try:
        model(torch.ones(1, 2)).sum().backward()
        step_optimizers([opt])
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["global pre", "pre", "post", "global post"]


def test_overridden_and_patched_methods_are_called():
    calls = []

    class OwnZero(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            calls.append(("class zero_grad", set_to_none))
            super().zero_grad(set_to_none)

    class OwnStep(torch.optim.SGD):
        def step(self, closure=None):
            calls.append("class step")
            return super().step(closure)

    model = nn.Linear(2, 1)
    own_zero = OwnZero(model.parameters(), lr=0.1)
    own_step = OwnStep(model.parameters(), lr=0.1)
    patched = torch.optim.SGD(model.parameters(), lr=0.1)
    patched.zero_grad = lambda set_to_none=True: calls.append("instance zero_grad")
    patched.step = lambda: calls.append("instance step")
    model(torch.ones(1, 2)).sum().backward()
    zero_gradients([own_zero, patched])
    model(torch.ones(1, 2)).sum().backward()
    step_optimizers([own_step, patched])
    assert calls == [
        ("class zero_grad", True),
        "instance zero_grad",
        "class step",
        "instance step",
    ]


def test_lr_scheduler_sees_the_step_and_schedules_alike():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        reference, ours, opt_ref, opt_ours = _trained_pair(
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            scheduler=lambda o: StepLR(o, step_size=2, gamma=0.5),
        )
    assert opt_ours.param_groups[0]["lr"] == opt_ref.param_groups[0]["lr"] == 0.025
    for a, b in zip(reference.parameters(), ours.parameters()):
        assert torch.equal(a, b)


def test_a_running_profiler_records_the_optimizer_ranges():
    model = nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step_optimizers([opt])
        zero_gradients([opt])
    names = {event.name for event in prof.events()}
    assert "Optimizer.step#Adam.step" in names
    assert "Optimizer.zero_grad#Adam.zero_grad" in names
