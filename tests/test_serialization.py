"""Import allow-list, trust controls and value codecs of nvalchemi._serialization."""

import inspect
import json
import sys
import textwrap
import types

import pytest
import torch
from pydantic import BaseModel

from nvalchemi import _serialization as ser
from nvalchemi._serialization import (
    SerializableClass,
    SerializableOptionalClass,
    SerializableTaggedClass,
    UnsafeImportError,
    allow_import_path,
    check_spec_target,
    decode_tagged,
    device_from_str,
    dtype_from_str,
    encode_value,
    import_path,
    init_kwargs_from_attrs,
    is_import_allowed,
    is_spec_factory,
    is_trust_required,
    object_to_path,
    register_spec_factory,
    register_trusted,
    register_type_serializer,
    requires_trust,
    spec_factory,
    tensor_from_dict,
    tensor_to_dict,
    trusted_imports,
    untrusted_build,
)


@pytest.fixture
def restore_allow_list():
    allowed, exact = set(ser._ALLOWED), set(ser._ALLOWED_EXACT)
    serializers = dict(ser._TYPE_SERIALIZERS)
    yield
    ser._ALLOWED.clear()
    ser._ALLOWED.update(allowed)
    ser._ALLOWED_EXACT.clear()
    ser._ALLOWED_EXACT.update(exact)
    ser._TYPE_SERIALIZERS.clear()
    ser._TYPE_SERIALIZERS.update(serializers)


@pytest.fixture
def evil_module(tmp_path, monkeypatch):
    """A module whose import leaves a marker file (to prove refusals import nothing)."""
    marker = tmp_path / "imported.txt"
    (tmp_path / "nv_evil_mod.py").write_text(
        textwrap.dedent(
            f"""
            open({str(marker)!r}, "w").write("imported")
            def run(**kwargs):
                open({str(marker)!r}, "w").write("called")
            class Thing:
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop("nv_evil_mod", None)
    ser._resolve.cache_clear()


@pytest.mark.parametrize(
    "path",
    [
        "torch.optim.adam.Adam",
        "torch.optim.Adam",
        "torch.optim.lr_scheduler.StepLR",
        "torch.nn.modules.linear.Linear",
        "torch.nn.functional.gelu",
        "torch.float64",
        "torch.Tensor",
        "builtins.float",
        "nvalchemi.training.losses.terms.EnergyMSELoss",
    ],
)
def test_allowed_paths_import(path):
    assert import_path(path) is not None


@pytest.mark.parametrize(
    "path",
    [
        "os.system",
        "builtins.eval",
        "builtins.exec",
        "subprocess.Popen",
        "torch.load",
        "torch.hub.load",
        "torch.serialization.load",
        "torch.utils.cpp_extension.load_inline",
        "nvalchemi._serialization.allow_import_path",
        "nvalchemi._serialization.trusted_imports",
        "nvalchemi.training.spec.create_model_spec_from_json",
    ],
)
def test_unsafe_paths_are_refused_with_a_hint(path):
    with pytest.raises(UnsafeImportError, match=r"trust=True") as info:
        import_path(path)
    assert repr(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_aliases_through_other_modules_are_refused():
    with pytest.raises(UnsafeImportError, match=r"alias of module 'torch'"):
        import_path("torch.nn.functional.torch.load")
    with pytest.raises(UnsafeImportError, match=r"dunder"):
        import_path("torch.nn.Module.__init__")


def test_reexport_of_foreign_object_is_refused(restore_allow_list, tmp_path, monkeypatch):
    (tmp_path / "nv_reexport.py").write_text("from os import system\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    allow_import_path("nv_reexport")
    with pytest.raises(UnsafeImportError, match=r"really 'posix.system'|really 'nt.system'"):
        import_path("nv_reexport.system")
    sys.modules.pop("nv_reexport", None)


def test_refusal_imports_and_calls_nothing(evil_module):
    with pytest.raises(UnsafeImportError):
        import_path("nv_evil_mod.run")
    assert "nv_evil_mod" not in sys.modules
    assert not evil_module.exists()


def test_trust_flag_and_context_allow_everything(evil_module):
    assert import_path("os.path.join", trust=True) is __import__("os").path.join
    with trusted_imports():
        run = import_path("nv_evil_mod.run")
        assert import_path("json.dumps") is __import__("json").dumps
    assert evil_module.read_text() == "imported"
    with pytest.raises(UnsafeImportError):
        import_path("json.dumps")  # trust does not outlive the block
    assert callable(run)


def test_allow_import_path_and_register_trusted(evil_module, restore_allow_list):
    assert not is_import_allowed("nv_evil_mod.run")
    allow_import_path("nv_evil_mod")  # allowed prefixes may be imported by the loader
    assert import_path("nv_evil_mod.run").__name__ == "run"
    assert evil_module.read_text() == "imported"
    import json

    with pytest.raises(UnsafeImportError):
        import_path("json.dumps")
    register_trusted(json.dumps)
    assert import_path("json.dumps") is json.dumps
    with pytest.raises(UnsafeImportError):
        import_path("json.loads")  # only the registered object is trusted


# ---------------------------------------------------- the user's own imported code


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """``nv_user_pkg`` (a class, a re-export of os.system) and a submodule marking its import."""
    root = tmp_path / "nv_user_pkg"
    root.mkdir()
    marker = tmp_path / "sub-imported.txt"
    (root / "__init__.py").write_text(
        "import torch\n"
        "from os import system\n"
        "class PairPotential(torch.nn.Module):\n"
        "    def __init__(self, width: int = 2):\n"
        "        super().__init__()\n"
        "        self.width = width\n"
        "    @classmethod\n"
        "    def from_width(cls, width):\n"
        "        return cls(width)\n"
        "def energy_fn(model, batch):\n"
        "    return {}\n"
    )
    (root / "sub.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass X: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)  # your own code lives in the working directory
    yield marker
    for name in ("nv_user_pkg", "nv_user_pkg.sub"):
        sys.modules.pop(name, None)
    ser._resolve.cache_clear()


def test_user_code_loads_once_imported_and_never_before(user_package):
    with pytest.raises(UnsafeImportError, match=r"import your module 'nv_user_pkg' before"):
        import_path("nv_user_pkg.PairPotential")
    assert "nv_user_pkg" not in sys.modules  # refusing imported nothing
    import nv_user_pkg

    assert import_path("nv_user_pkg.PairPotential") is nv_user_pkg.PairPotential
    assert import_path("nv_user_pkg.energy_fn") is nv_user_pkg.energy_fn
    assert ser.is_user_module("nv_user_pkg") and not is_import_allowed("nv_user_pkg.energy_fn")
    check_spec_target(nv_user_pkg.PairPotential.from_width, path="x", expect=torch.nn.Module)
    with pytest.raises(ValueError):  # a submodule that is not imported is not imported now
        import_path("nv_user_pkg.sub.X")
    assert not user_package.exists() and "nv_user_pkg.sub" not in sys.modules


def test_user_code_cannot_reach_the_standard_library_or_installed_packages(user_package):
    import json

    import numpy  # noqa: F401 - imported, but an installed package
    import nv_user_pkg  # noqa: F401

    for path, pattern in (
        ("nv_user_pkg.system", r"really '(posix|nt)\.system'"),
        ("nv_user_pkg.torch", r"alias of module 'torch'"),
        ("json.dumps", r"standard library is never reached"),
        ("numpy.load", r"outside the import allow-list"),
    ):
        with pytest.raises(UnsafeImportError, match=pattern):
            import_path(path)
    assert not ser.is_user_module("json") and not ser.is_user_module("numpy")
    assert not ser.is_user_module("torch") and not ser.is_user_module("nvalchemi.spec")
    assert ser.is_user_module("__main__") and json


def _package(folder, name):
    """A tiny package ``name`` in ``folder`` (a class, and a marker of its import)."""
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text("class Thing:\n    pass\n")
    return folder


@pytest.fixture
def forget_packages():
    yield
    for name in [n for n in sys.modules if n.startswith("nv_far_")]:
        sys.modules.pop(name)
    ser._resolve.cache_clear()
    ser._editable_names.cache_clear()


def test_a_package_on_the_path_from_elsewhere_is_not_your_code(
    tmp_path, monkeypatch, forget_packages
):
    vendor = _package(tmp_path / "vendor", "nv_far_vendor")
    _package(tmp_path / "work", "nv_far_mine")
    monkeypatch.syspath_prepend(str(vendor))  # as PYTHONPATH=vendor
    monkeypatch.syspath_prepend(str(tmp_path / "work"))
    monkeypatch.chdir(tmp_path / "work")
    import nv_far_mine
    import nv_far_vendor

    assert import_path("nv_far_mine.Thing") is nv_far_mine.Thing
    with pytest.raises(UnsafeImportError, match=r"neither the working directory nor the folder"):
        import_path("nv_far_vendor.Thing")
    monkeypatch.chdir(tmp_path)  # the working directory is the vendor folder's parent
    assert not ser.is_user_module("nv_far_mine") and not ser.is_user_module("nv_far_vendor")
    monkeypatch.chdir(vendor)  # from inside the checkout, it is the user's code being worked on
    assert ser.is_user_module("nv_far_vendor")
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "work" / "train.py")
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert ser.is_user_module("nv_far_mine")  # next to the running script
    assert nv_far_vendor


@pytest.mark.parametrize("kind", ["pep660_top_level", "pep660_pth", "develop_egg_info"])
def test_an_editable_install_is_not_your_code_even_in_the_working_directory(
    tmp_path, monkeypatch, forget_packages, kind
):
    work = _package(tmp_path / "work", "nv_far_installed")
    metadata = "Metadata-Version: 2.1\nName: nv-far-installed\nVersion: 1.0\n"
    editable = json.dumps({"url": f"file://{work}", "dir_info": {"editable": True}})
    if kind == "develop_egg_info":  # `setup.py develop`: the metadata sits beside the code
        info = work / "nv_far_installed.egg-info"
        info.mkdir()
        (info / "PKG-INFO").write_text(metadata)
        (info / "top_level.txt").write_text("nv_far_installed\n")
        # The source tree's files (pip -e writes this beside the code): not importable names.
        (info / "SOURCES.txt").write_text("nv_far_installed/__init__.py\nnv_far_tests/t.py\n")
    else:
        site_dir = tmp_path / "lib" / "site-packages"  # where installers put metadata
        info = site_dir / "nv_far_installed-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(metadata)
        (info / "direct_url.json").write_text(editable)
        if kind == "pep660_top_level":  # a finder module maps the name to the project
            (info / "top_level.txt").write_text("nv_far_installed\n")
            (info / "RECORD").write_text("__editable___nv_far_installed_finder.py,,\n")
        else:  # a .pth file puts the project folder on the path
            (site_dir / "_nv_far_installed.pth").write_text(f"{work}\n")
            (info / "RECORD").write_text("_nv_far_installed.pth,,\n")
        monkeypatch.syspath_prepend(str(site_dir))
    monkeypatch.syspath_prepend(str(work))
    monkeypatch.chdir(work)
    import nv_far_installed

    with pytest.raises(
        UnsafeImportError, match=r"installed \(editable\) distribution 'nv-far-installed'"
    ) as info_:
        import_path("nv_far_installed.Thing")
    assert "allow_import_path('nv_far_installed')" in str(info_.value)
    if kind == "develop_egg_info":  # the project's other folders stay the user's own code
        assert "nv_far_tests" not in ser._editable_names(tuple(sys.path))
    allow_import_path("nv_far_installed")  # what the hint says: an explicit allowance
    try:
        assert import_path("nv_far_installed.Thing") is nv_far_installed.Thing
    finally:
        ser._ALLOWED.discard("nv_far_installed")


def test_a_namespace_package_of_yours_counts_and_its_name_alone_does_not(
    tmp_path, monkeypatch, forget_packages
):
    (tmp_path / "nv_far_space").mkdir()  # no __init__.py: a namespace package
    (tmp_path / "nv_far_space" / "models.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    import nv_far_space.models

    assert import_path("nv_far_space.models.Thing") is nv_far_space.models.Thing
    assert not ser.is_user_module("nv_far_space")  # no file: nothing of it is callable


def test_allow_import_path_rejects_empty_prefix():
    with pytest.raises(ValueError, match=r"dotted prefix"):
        allow_import_path("")


def test_missing_paths_raise_value_error():
    with pytest.raises(ValueError, match=r"has no attribute 'NotThere'"):
        import_path("torch.optim.NotThere")
    with pytest.raises(ValueError, match=r"not a dotted path"):
        import_path("nvalchemi..x")
    with pytest.raises(TypeError):
        import_path(42)


def test_object_to_path():
    assert object_to_path(torch.optim.Adam) == "torch.optim.adam.Adam"
    with pytest.raises(TypeError, match=r"not an importable callable"):
        object_to_path(lambda: None)

    def local():
        pass

    with pytest.raises(TypeError, match=r"module level"):
        object_to_path(local)


def test_dtype_codec_and_guard():
    assert dtype_from_str("torch.float32") is torch.float32
    assert dtype_from_str("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match=r"does not resolve to a torch.dtype"):
        dtype_from_str("torch.load")
    with pytest.raises(TypeError, match=r"expected str"):
        dtype_from_str(32)


def test_device_and_tensor_codecs():
    assert device_from_str("cpu") == torch.device("cpu")
    with pytest.raises(TypeError):
        device_from_str(0)
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    d = tensor_to_dict(t)
    assert d == {
        "data": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
        "dtype": "torch.float64",
        "shape": [2, 3],
    }
    assert torch.equal(tensor_from_dict(d), t)
    empty = torch.zeros(0, 3, dtype=torch.int64)
    assert tensor_from_dict(tensor_to_dict(empty)).shape == (0, 3)


def test_encode_value_handles_nested_torch_values_and_classes():
    value = {
        "a": (1, 2.5),
        "dtype": torch.float16,
        "dev": torch.device("cpu"),
        "cls": torch.optim.SGD,
    }
    assert encode_value(value) == {
        "a": [1, 2.5],
        "dtype": "torch.float16",
        "dev": "cpu",
        "cls": {"__type__": "torch.optim.sgd.SGD"},
    }
    with pytest.raises(TypeError, match=r"register_type_serializer"):
        encode_value(object())
    with pytest.raises(TypeError, match=r"str keys"):
        encode_value({1: 2})


def test_decode_tagged():
    assert decode_tagged({"__type__": "torch.optim.sgd.SGD"}) is torch.optim.SGD
    assert decode_tagged({"a": 1}) is ser._NOT_TAGGED
    with pytest.raises(UnsafeImportError):
        decode_tagged({"__type__": "os.system"})
    with pytest.raises(ValueError, match=r"No serializer registered"):
        decode_tagged({"__type__": "nvalchemi.Unknown", "value": 1})


class Celsius:
    def __init__(self, degrees):
        self.degrees = degrees


def test_register_type_serializer_round_trip(restore_allow_list):
    register_type_serializer(Celsius, lambda c: c.degrees, Celsius)
    encoded = encode_value(Celsius(21.5))
    assert encoded == {"__type__": f"{__name__}.Celsius", "value": 21.5}
    assert decode_tagged(encoded).degrees == 21.5
    assert import_path(f"{__name__}.Celsius") is Celsius  # registration trusts the type
    with pytest.raises(TypeError):
        register_type_serializer("Celsius", str, str)


class _Model(BaseModel):
    cls: SerializableClass
    maybe: SerializableOptionalClass = None
    tagged: SerializableTaggedClass = torch.optim.SGD


def test_pydantic_class_fields():
    m = _Model(cls="torch.optim.adam.Adam", maybe=None, tagged={"__type__": "torch.optim.sgd.SGD"})
    assert m.cls is torch.optim.Adam and m.tagged is torch.optim.SGD
    assert m.model_dump() == {
        "cls": "torch.optim.adam.Adam",
        "maybe": None,
        "tagged": {"__type__": "torch.optim.sgd.SGD"},
    }
    with pytest.raises(ValueError, match=r"outside the import allow-list"):
        _Model(cls="os.system")
    with pytest.raises(ValueError, match=r"must resolve to an importable class"):
        _Model(cls="torch.optim.Nope")
    with pytest.raises(ValueError, match=r"must be a class"):
        _Model(cls=3)


class _WithAttrs:
    def __init__(self, a, b=2, *args, c=3, **kwargs):
        self.a, self.c = a, c


def test_init_kwargs_from_attrs_skips_missing_attributes():
    assert init_kwargs_from_attrs(_WithAttrs(1, c=5)) == {"a": 1, "c": 5}


# ------------------------------------------------ markers judged on resolved objects
@pytest.mark.parametrize(
    "path",
    [
        "nvalchemi.models.mace.MACEWrapper.from_checkpoint",
        "nvalchemi.models.MACEWrapper.from_checkpoint",  # lazy re-export: same object
        "nvalchemi.training.finetune.FineTuningStrategy.from_mace",
        "nvalchemi.training.FineTuningStrategy.from_mace",
    ],
)
def test_pickle_loaders_are_refused_by_any_path_without_trust(path):
    with pytest.raises(UnsafeImportError, match=r"loads pickled files.*trust=True"):
        import_path(path)
    assert is_trust_required(import_path(path, trust=True))
    with trusted_imports():
        assert callable(import_path(path))


@requires_trust
def _unpickle(path):
    return f"loaded {path}"


class _Factories:
    def __init__(self, width: int = 1):
        self.width = width

    @classmethod
    @requires_trust
    def from_pickle(cls, path: str) -> "_Factories":
        return cls()

    @requires_trust  # either order with classmethod
    @classmethod
    def from_pickle_too(cls, path: str) -> "_Factories":
        return cls()

    @classmethod
    @spec_factory
    def from_width(cls, width: int) -> "_Factories":
        return cls(width)

    @classmethod
    def unmarked(cls) -> "_Factories":
        return cls()


def test_requires_trust_guard_refuses_to_run_only_inside_untrusted_builds():
    assert _unpickle("a") == "loaded a"  # direct calls are the caller's decision
    assert list(inspect.signature(_Factories.from_pickle).parameters) == ["path"]
    with untrusted_build():
        for call in (lambda: _unpickle("a"), lambda: _Factories.from_pickle_too("a")):
            with pytest.raises(
                UnsafeImportError, match=r"Refusing to run .*(_unpickle|from_pickle_too) while"
            ):
                call()
        with trusted_imports():  # a trusted spec built inside lifts the guard
            assert isinstance(_Factories.from_pickle("a"), _Factories)
    assert is_trust_required(_Factories.from_pickle) and is_trust_required(_unpickle)
    assert not is_trust_required(_Factories.from_width)


def test_check_spec_target_allows_classes_and_marked_factories_only(restore_spec_factories):
    check_spec_target(_Factories, path="x")
    check_spec_target(_Factories.from_width, path="x", expect=_Factories)
    for obj, pattern in (
        (torch.nn.Embedding.from_pretrained, "neither a class nor a callable marked safe"),
        (torch.nn.init.zeros_, "neither a class nor a callable marked safe"),
        (_Factories.from_pickle, "loads pickled files"),
        (_unpickle, "loads pickled files"),
    ):
        with pytest.raises(UnsafeImportError, match=pattern) as info:
            check_spec_target(obj, path="p", where="spec.json, key 'model.cls_path'")
        assert str(info.value).startswith("spec.json, key 'model.cls_path': ")
        check_spec_target(obj, path="p", trust=True)
    with pytest.raises(RuntimeError, match=r"not a subclass of nn.Module: expected nn.Module"):
        check_spec_target(_Factories, path="p", expect=torch.nn.Module)
    with pytest.raises(RuntimeError, match=r"expected nn.Module"):
        check_spec_target(_Factories.from_width, path="p", expect=torch.nn.Module)
    check_spec_target(_Factories.unmarked, path="x")  # a classmethod of your own class
    assert not is_spec_factory(torch.nn.Embedding.from_pretrained)
    register_spec_factory(torch.nn.Embedding.from_pretrained)
    assert is_spec_factory(torch.nn.Embedding.from_pretrained)
    check_spec_target(torch.nn.Embedding.from_pretrained, path="x")
    assert not is_spec_factory(register_spec_factory(_unpickle))  # trust marker wins


@pytest.fixture
def restore_spec_factories():
    saved = set(ser._SPEC_FACTORIES)
    yield
    ser._SPEC_FACTORIES.clear()
    ser._SPEC_FACTORIES.update(saved)
