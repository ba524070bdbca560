"""BaseSpec, create_model_spec and safe JSON rehydration."""

import json
import sys
import textwrap

import pytest
import torch
from pydantic import BaseModel

from nvalchemi import _serialization as ser
from nvalchemi._serialization import UnsafeImportError, allow_import_path
from nvalchemi.training import BaseSpec, create_model_spec, create_model_spec_from_json
from nvalchemi.training.optimizers import OptimizerConfig

CPU = torch.device("cpu")


class Holder:
    def __init__(
        self,
        items: tuple[int, ...] = (),
        cls: type = torch.optim.SGD,
        anno_dtype: torch.dtype = torch.float32,
        raw_spec: BaseSpec | None = None,
        child=None,
        children=(),
        dtype=None,
        device=None,
        tensor=None,
        name: str = "",
        **extra,
    ):
        self.items, self.cls, self.anno_dtype, self.raw_spec = items, cls, anno_dtype, raw_spec
        self.child, self.children, self.dtype, self.device = child, children, dtype, device
        self.tensor, self.name, self.extra = tensor, name, extra

    @classmethod
    @ser.spec_factory
    def create(cls, size: int, device: torch.device = CPU) -> "Holder":
        return cls(items=tuple(range(size)), device=device)


class Strict:
    def __init__(self, a: int, b: int = 2):
        self.a, self.b = a, b


class Settings(BaseModel):
    depth: int = 1


def positional_only(a, /, b=1):
    return a + b


@pytest.fixture(autouse=True)
def trust_this_module():
    allowed = set(ser._ALLOWED)
    allow_import_path(__name__)
    yield
    ser._ALLOWED.clear()
    ser._ALLOWED.update(allowed)


def roundtrip(spec: BaseSpec) -> BaseSpec:
    return create_model_spec_from_json(json.loads(json.dumps(spec.model_dump())))


def test_torch_module_spec_round_trips_through_json():
    spec = create_model_spec(torch.nn.Linear, in_features=3, out_features=2, dtype=torch.float64)
    data = spec.model_dump()
    assert data["cls_path"] == "torch.nn.modules.linear.Linear"
    assert data["dtype"] == "torch.float64"
    again = roundtrip(spec)
    assert again.model_dump() == data  # exact, including the original timestamp
    assert again == spec
    layer = again.build()
    assert isinstance(layer, torch.nn.Linear) and layer.weight.dtype == torch.float64
    assert json.loads(spec.model_dump_json()) == data


def test_timestamp_is_utc_iso8601():
    from datetime import datetime

    stamp = datetime.fromisoformat(create_model_spec(Strict, a=1).timestamp)
    assert stamp.utcoffset().total_seconds() == 0


def test_values_of_every_kind_round_trip():
    child = create_model_spec(Strict, a=1)
    spec = create_model_spec(
        Holder,
        items=(1, 2, 3),
        cls=torch.optim.Adam,
        anno_dtype=torch.float16,
        child=child,
        children=[create_model_spec(Strict, a=2), 5],
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        tensor=torch.tensor([[1.0, 2.0]], dtype=torch.float64),
        name="torch.optim.Adam",  # looks like a path, stays a string
        extra_setting={"nested": [Settings(depth=3)]},
        extra_cls=torch.optim.SGD,
    )
    data = spec.model_dump()
    assert data["cls"] == "torch.optim.adam.Adam"  # `type`-annotated: plain dotted path
    assert data["extra_setting"]["nested"][0]["cls_path"].endswith("Settings")
    assert data["extra_cls"] == {"__type__": "torch.optim.sgd.SGD"}  # unannotated: tagged
    assert data["tensor"] == {"data": [[1.0, 2.0]], "dtype": "torch.float64", "shape": [1, 2]}
    built = roundtrip(spec).build()
    assert built.items == (1, 2, 3)  # tuple restored from the annotation
    assert built.cls is torch.optim.Adam
    assert built.anno_dtype is torch.float16 and built.dtype is torch.bfloat16
    assert built.device == torch.device("cpu")
    assert torch.equal(built.tensor, torch.tensor([[1.0, 2.0]], dtype=torch.float64))
    assert isinstance(built.child, Strict) and built.child.a == 1
    assert isinstance(built.children[0], Strict) and built.children[1] == 5
    assert built.name == "torch.optim.Adam"
    assert built.extra["extra_setting"]["nested"][0] == Settings(depth=3)
    assert built.extra["extra_cls"] is torch.optim.SGD


def test_spec_annotated_parameters_receive_the_spec_unbuilt():
    inner = create_model_spec(Strict, a=4)
    built = roundtrip(create_model_spec(Holder, raw_spec=inner)).build()
    assert isinstance(built.raw_spec, BaseSpec) and built.raw_spec.build().a == 4


def test_build_overrides_and_positional_args():
    spec = create_model_spec(Strict, a=1, b=5)
    assert spec.build(b=7).b == 7
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = create_model_spec(torch.optim.SGD, lr=0.5).build([param])
    assert optimizer.param_groups[0]["params"] == [param]
    by_path = create_model_spec(f"{__name__}.Holder", items=(1,))  # target given as a dotted path
    assert by_path.build().items == (1,)


def test_classmethod_factory_with_runtime_device():
    spec = create_model_spec(Holder.create, size=2)
    assert spec.cls_path.endswith("Holder.create")
    built = roundtrip(spec).build(device=torch.device("meta"))
    assert built.items == (0, 1) and built.device == torch.device("meta")


def test_accepts_kwarg():
    assert create_model_spec(Strict, a=1).accepts_kwarg("b")
    assert not create_model_spec(Strict, a=1).accepts_kwarg("c")
    assert create_model_spec(Holder).accepts_kwarg("anything")  # **extra


def test_create_model_spec_rejections():
    with pytest.raises(TypeError, match=r"positional-only"):
        create_model_spec(positional_only, b=2)
    with pytest.raises(TypeError, match=r"Unknown kwargs for .*Strict: \['c'\]"):
        create_model_spec(Strict, a=1, c=3)
    with pytest.raises(TypeError, match=r"not an importable callable"):
        create_model_spec(lambda x: x, x=1)
    with pytest.raises(TypeError, match=r"must be callable"):
        create_model_spec(3)


def test_build_reports_signature_drift():
    spec = create_model_spec_from_json(
        {"cls_path": f"{__name__}.Strict", "timestamp": "2024-01-01T00:00:00+00:00", "z": 1}
    )
    with pytest.raises(
        TypeError, match=r"Failed to build .*Strict from spec \(saved at 2024-01-01"
    ):
        spec.build()


def test_from_json_errors():
    with pytest.raises(ValueError, match=r"missing required field 'cls_path'; present keys"):
        create_model_spec_from_json({"timestamp": "t"})
    with pytest.raises(ValueError, match=r"missing required field 'timestamp'"):
        create_model_spec_from_json({"cls_path": "torch.nn.Linear"})
    with pytest.raises(ValueError, match=r"Could not resolve cls_path='torch.nn.Nope'"):
        create_model_spec_from_json({"cls_path": "torch.nn.Nope", "timestamp": "t"})
    with pytest.raises(TypeError):
        create_model_spec_from_json(["cls_path"])
    with pytest.raises(ValueError, match=r"does not resolve to a torch.dtype"):
        create_model_spec_from_json(
            {"cls_path": f"{__name__}.Holder", "timestamp": "t", "dtype": "torch.load"}
        )


def test_direct_construction_checks_the_allow_list():
    assert (
        BaseSpec(cls_path="torch.nn.Linear", in_features=2, out_features=1).build().in_features == 2
    )
    with pytest.raises(ValueError, match=r"outside the import allow-list"):
        BaseSpec(cls_path="os.system", command="true")


# ------------------------------------------------------------------------------ safe loading


@pytest.fixture
def evil(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    (tmp_path / "nv_spec_evil.py").write_text(
        textwrap.dedent(
            f"""
            open({str(marker)!r} + ".import", "w").close()
            def run(path):
                open(path, "w").close()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop("nv_spec_evil", None)
    ser._resolve.cache_clear()


def test_spec_naming_os_system_is_refused_and_runs_nothing(tmp_path):
    target = tmp_path / "created-by-os-system"
    payload = {"cls_path": "os.system", "timestamp": "t", "command": f"touch {target}"}
    with pytest.raises(UnsafeImportError, match=r"'os.system'.*trust=True"):
        create_model_spec_from_json(payload)
    nested = {
        "cls_path": f"{__name__}.Holder",
        "timestamp": "t",
        "child": payload,
        "cls": {"__type__": "subprocess.Popen"},
    }
    with pytest.raises(UnsafeImportError, match=r"os.system"):
        create_model_spec_from_json(nested)
    with pytest.raises(UnsafeImportError, match=r"subprocess.Popen"):
        create_model_spec_from_json({**nested, "child": None})
    with pytest.raises(UnsafeImportError, match=r"'os.system'"):  # `type`-annotated string
        create_model_spec_from_json({**nested, "child": None, "cls": "os.system"})
    assert not target.exists()


def test_untrusted_spec_cannot_grant_itself_trust():
    nested = {"cls_path": "torch.nn.Identity", "timestamp": "t", "trust": True}
    with pytest.raises(UnsafeImportError, match="may not grant trust"):
        create_model_spec_from_json(
            {"cls_path": f"{__name__}.Holder", "timestamp": "t", "child": nested}
        )
    assert create_model_spec_from_json(nested, trust=True).kwargs == {"trust": True}


def test_refused_module_is_never_imported(evil):
    payload = {"cls_path": "nv_spec_evil.run", "timestamp": "t", "path": str(evil)}
    with pytest.raises(UnsafeImportError, match=r"nv_spec_evil.run"):
        create_model_spec_from_json(payload)
    assert "nv_spec_evil" not in sys.modules
    assert not evil.exists() and not (evil.parent / "pwned.import").exists()


def test_trust_flag_opts_in(evil):
    spec = create_model_spec_from_json(
        {"cls_path": "nv_spec_evil.run", "timestamp": "t", "path": str(evil)}, trust=True
    )
    spec.build()
    assert evil.exists()


class MySGD(torch.optim.SGD):
    pass


def test_strings_resolved_while_building_follow_the_spec_trust():
    data = OptimizerConfig(torch.optim.SGD, {"lr": 0.1}).to_spec().model_dump()
    data["optimizer_cls"] = "nv_untrusted_pkg.MySGD"
    with pytest.raises(ValueError, match=r"outside the import allow-list"):
        create_model_spec_from_json(data).build()
    ser._ALLOWED.discard(__name__)
    data["optimizer_cls"] = f"{__name__}.MySGD"  # this (imported) module is the user's code
    assert create_model_spec_from_json(data).build().optimizer_cls is MySGD
    data["optimizer_cls"] = "json.JSONDecoder"
    with pytest.raises(ValueError, match=r"outside the import allow-list"):
        create_model_spec_from_json(data).build()
    assert create_model_spec_from_json(data, trust=True).kwargs["optimizer_cls"] == (
        "json.JSONDecoder"
    )


@pytest.mark.parametrize(
    "module",
    [
        "nvalchemi._serialization",
        "nvalchemi.spec",
        "nvalchemi.training.losses.base",
        "nvalchemi.training.losses.terms",
        "nvalchemi.training.losses.reductions",
        "nvalchemi.training.losses.composition",
        "nvalchemi.training.losses.schedules",
        "nvalchemi.training.optimizers",
    ],
)
def test_docstring_examples_run(module):
    import doctest
    import importlib

    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(importlib.import_module(module), optionflags=flags, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_hook_constructors_take_every_argument_by_keyword_so_specs_build_them(tmp_path):
    from nvalchemi.training.hooks.checkpoint import CheckpointHook
    from nvalchemi.training.hooks.gradients import (
        GradientAccumulationHook,
        GradientClipHook,
        LossSpikeSkipHook,
    )
    from nvalchemi.training.hooks.mixed_precision import MixedPrecisionHook

    cases = [
        (CheckpointHook, {"checkpoint_dir": str(tmp_path), "step_interval": 2}, "step_interval", 2),
        (MixedPrecisionHook, {"precision": "bf16"}, "precision", torch.bfloat16),
        (GradientAccumulationHook, {"steps": 3}, "steps", 3),
        (GradientClipHook, {"max_norm": 1.5}, "max_norm", 1.5),
        (LossSpikeSkipHook, {"factor": 4.0}, "factor", 4.0),
    ]
    for cls, kwargs, field, value in cases:
        spec = create_model_spec(cls, **kwargs)
        hook = create_model_spec_from_json(json.loads(json.dumps(spec.model_dump()))).build()
        assert isinstance(hook, cls) and getattr(hook, field) == value, cls.__name__


def test_build_strict_refuses_and_lenient_drops_keywords_the_target_lost():
    data = create_model_spec(Strict, a=1).model_dump()
    data["gone"] = 5  # the class no longer takes it
    spec = create_model_spec_from_json(data)
    with pytest.raises(TypeError, match=r"\['gone'\].*does not accept"):
        spec.build(strict=True)
    with pytest.warns(UserWarning, match=r"\['gone'\].*dropping them"):
        built = spec.build()
    assert built.a == 1 and built.b == 2


def test_unresolvable_and_non_module_model_specs_are_named_before_building(tmp_path):
    from nvalchemi.checkpoint_files import build_model, load_spec

    missing = {"cls_path": "torch.nn.NoSuchLayer", "timestamp": "t"}
    with pytest.raises(ValueError, match=r"Could not resolve cls_path='torch.nn.NoSuchLayer'"):
        create_model_spec_from_json(missing)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"cls_path": "torch.optim.SGD", "timestamp": "t", "params": []}))
    with pytest.raises(RuntimeError, match=r"spec.json.*expected nn.Module.*Nothing was built"):
        build_model(load_spec(path, trust=False, expect=torch.nn.Module), None)


class Sized:
    def __init__(self, size: int = 1):
        self.size = size

    @classmethod
    def from_size(cls, size: int) -> "Sized":  # not marked: allowed as the user's own code
        return cls(size)


def test_an_unmarked_classmethod_of_the_users_own_class_builds_from_json():
    ser._ALLOWED.discard(__name__)  # through the user-code door, not the allow-list
    spec = create_model_spec_from_json(
        {"cls_path": f"{__name__}.Sized.from_size", "timestamp": "t", "size": 4}
    )
    assert spec.build().size == 4
    with pytest.raises(UnsafeImportError, match="neither a class nor a callable marked safe"):
        create_model_spec_from_json(
            {"cls_path": "torch.nn.Embedding.from_pretrained", "timestamp": "t"}
        )
