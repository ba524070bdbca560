"""Dotted import paths <-> objects under one trust rule, and JSON codecs for torch values.

Specs, configs and checkpoints name classes and functions by dotted path
(``"torch.optim.adam.Adam"``, ``"common.PairPotential"``). Importing a path taken from a
file is code execution, so :func:`import_path` resolves only paths that pass **the trust
rule** (the one check every loader uses):

1. the allow-list: ``nvalchemi.*`` (minus the trust machinery itself), ``torch.nn.*``,
   ``torch.optim.*``, ``torch.utils.data.*``, torch dtypes, ``torch.Tensor``/``device``/
   ``dtype``/``Size`` and plain builtin value types; plus prefixes you allow with
   :func:`allow_import_path` (the CLI's ``--allow-import PKG`` and a job file's
   ``imports:``) and objects given to :func:`register_trusted`;
2. **your own code that this process has already imported**: ``__main__``, and any module
   in ``sys.modules`` whose top-level package or module lies directly in the current working
   directory or in the folder of the running script (where Python imports your own files
   from), and whose top-level name no installed distribution provides (its
   ``top_level.txt``/``RECORD``, editable installs included). A script that does ``from
   common import PairPotential`` loads checkpoints naming ``common.PairPotential`` with no
   extra call. Nothing is ever imported through this door: a module that is not imported yet
   stays refused; the standard library, installed packages (editable too) and packages put
   on ``PYTHONPATH`` from elsewhere stay refused whatever is imported (allow those with
   :func:`allow_import_path` if you trust what your files name);
3. anything at all with ``trust=True`` or inside ``with trusted_imports():``.

Both the path as written and the place the object is really defined must pass, so aliases
such as ``"torch.nn.functional.torch.load"`` or ``common.system`` (after ``from os import
system``) are refused. Refusals raise :class:`UnsafeImportError` *before* anything is
imported.

What a path *resolves to* is judged too: loaders that unpickle files are marked
:func:`requires_trust` and refused without trust under any name (and refuse to run inside
an :func:`untrusted_build`); a spec's ``cls_path`` is *called* with keyword arguments taken
from the file, so :func:`check_spec_target` lets it name only classes, classmethods of your
own classes, and callables marked :func:`spec_factory`. Function fields (a ``training_fn``,
an activation) are only ever called with the framework's own arguments.

>>> import_path("torch.optim.adam.Adam").__name__
'Adam'
>>> import_path("os.system")
Traceback (most recent call last):
...
nvalchemi._serialization.UnsafeImportError: Refusing to import 'os.system': ...
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import inspect
import json
import os
import site
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Annotated, Any

import torch
from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

__all__ = [
    "UnsafeImportError",
    "import_path",
    "check_import_path",
    "is_import_allowed",
    "is_trusted_path",
    "is_user_module",
    "own_module_problem",
    "object_to_path",
    "allow_import_path",
    "register_trusted",
    "trusted_imports",
    "requires_trust",
    "is_trust_required",
    "spec_factory",
    "register_spec_factory",
    "is_spec_factory",
    "check_spec_target",
    "untrusted_build",
    "register_type_serializer",
    "encode_value",
    "decode_tagged",
    "dtype_to_str",
    "dtype_from_str",
    "device_from_str",
    "tensor_to_dict",
    "tensor_from_dict",
    "init_kwargs_from_attrs",
    "SerializableClass",
    "SerializableOptionalClass",
    "SerializableTaggedClass",
]


class UnsafeImportError(ValueError):
    """A dotted path outside the import allow-list was named by untrusted input."""


_ALLOWED: set[str] = {"nvalchemi", "torch.nn", "torch.optim", "torch.utils.data"}
_ALLOWED_EXACT: set[str] = {
    "torch.Tensor",
    "torch.device",
    "torch.dtype",
    "torch.Size",
    *(f"builtins.{t}" for t in ("bool", "int", "float", "complex", "str", "bytes")),
    *(f"builtins.{t}" for t in ("list", "tuple", "dict", "set", "frozenset")),
}
# Never importable without explicit trust, even under an allowed prefix: the trust
# machinery (a spec must not be able to widen the allow-list) and torch's loaders.
_DENIED: set[str] = {
    "nvalchemi._serialization",
    "nvalchemi._lazy",
    "nvalchemi._optional",
    "nvalchemi.spec",
    "nvalchemi.training.spec",
    "torch.hub",
    "torch.load",
    "torch.save",
    "torch.serialization",
    "torch.package",
    "torch.utils.cpp_extension",
    "torch.utils.data.datapipes",  # its decoders unpickle the files they read
    "torch.ops",
    "torch.library",
}
_TRUST_ALL = contextvars.ContextVar("nvalchemi_trust_all_imports", default=False)
_UNTRUSTED_BUILD = contextvars.ContextVar("nvalchemi_untrusted_build", default=False)


def _under(path: str, prefixes: set[str]) -> bool:
    parts = path.split(".")
    return any(".".join(parts[:i]) in prefixes for i in range(1, len(parts) + 1))


def _is_dtype_path(path: str) -> bool:
    head, _, name = path.partition(".")
    return (
        head == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype)
    )


def is_import_allowed(path: str) -> bool:
    """Whether ``path`` passes the allow-list (ignoring user code and any trust context)."""
    if _under(path, _DENIED):
        return False
    return path in _ALLOWED_EXACT or _under(path, _ALLOWED) or _is_dtype_path(path)


@functools.cache
def _installed_code_dirs() -> tuple[str, ...]:
    """Directories of the standard library and of installed packages (never user code)."""
    keys = ("stdlib", "platstdlib", "purelib", "platlib", "scripts")
    dirs = {sysconfig.get_path(key) for key in keys}
    dirs |= set(site.getsitepackages()) | {site.getusersitepackages()}
    return tuple(sorted(os.path.realpath(d) + os.sep for d in dirs if d))


def _is_installed_file(real: str) -> bool:
    parts = set(real.split(os.sep))
    return bool(parts & {"site-packages", "dist-packages"}) or real.startswith(
        _installed_code_dirs()
    )


def _user_code_dirs() -> tuple[str, ...]:
    """Where your own code lives: the working directory and the running script's folder."""
    dirs = []
    with contextlib.suppress(OSError):
        dirs.append(os.path.realpath(os.getcwd()))
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if isinstance(main_file, str):
        dirs.append(os.path.dirname(os.path.realpath(main_file)))
    return tuple(d for d in dirs if not _is_installed_file(d + os.sep))


def _pth_folder_names(pth: Any) -> set[str]:
    """Top-level names importable from the folders a distribution's ``.pth`` file adds."""
    names: set[str] = set()
    with contextlib.suppress(OSError, UnicodeDecodeError):
        base = os.path.dirname(str(pth))
        for line in pth.read_text().splitlines():
            line = line.strip()
            if not line or line.startswith(("#", "import ", "import\t")):
                continue
            folder = os.path.join(base, line)
            if not os.path.isdir(folder):
                continue
            for entry in os.listdir(folder):
                stem = entry.partition(".")[0]
                if stem.isidentifier() and (
                    entry.endswith((".py", ".so", ".pyd"))
                    or os.path.isdir(os.path.join(folder, entry))
                ):
                    names.add(stem)
    return names


def _is_editable(dist: Any) -> bool:
    """Whether ``dist`` is installed in development mode (its code is not in site-packages)."""
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    if isinstance(direct_url, dict) and (direct_url.get("dir_info") or {}).get("editable"):
        return True  # PEP 660 (pip install -e)
    home = os.path.realpath(str(dist.locate_file("")))
    return not _is_installed_file(home + os.sep)  # metadata beside the code: setup.py develop


def _top_level_names(dist: Any) -> set[str]:
    names = set((dist.read_text("top_level.txt") or "").split())
    if dist.read_text("RECORD") is None:
        # An egg-info's file list is its SOURCES.txt: the whole source tree (tests, scripts),
        # not what the install makes importable; top_level.txt says that.
        return names
    for file in dist.files or ():
        if file.parts and file.parts[0] != ".." and not file.parts[0].endswith("-info"):
            names.add(file.parts[0].partition(".")[0])
        if file.suffix == ".pth":
            names |= _pth_folder_names(dist.locate_file(file))
    return names


@functools.lru_cache(maxsize=4)
def _editable_names(search_path: tuple[str, ...]) -> dict[str, str]:
    """``{top-level name: distribution}`` of the editable installs found on ``search_path``.

    Regular installs need no entry: their code lies in site-packages, which never passes.
    """
    import importlib.metadata as metadata  # lazy: only the user-code door needs it

    out: dict[str, str] = {}
    for dist in metadata.distributions(path=list(search_path)):
        with contextlib.suppress(Exception):  # a broken install must not break loading
            if _is_editable(dist):
                for name in _top_level_names(dist):
                    out.setdefault(name, dist.metadata["Name"])
    return out


def _not_user_code(name: str) -> str | None:
    """Why module ``name`` is not your own imported code (``None`` when it is)."""
    module = sys.modules.get(name)
    top = name.partition(".")[0]
    if module is None:
        return f"module {name!r} is not imported"
    if top == "__main__":
        return None
    if top == "nvalchemi":
        return "nvalchemi is governed by the allow-list alone"
    if top in sys.stdlib_module_names:
        return f"{top!r} is part of the standard library"
    file = getattr(module, "__file__", None)
    if not isinstance(file, str):
        return f"{name!r} has no source file (a builtin, frozen or namespace module)"
    real = os.path.realpath(file)
    if _is_installed_file(real):
        return f"{name!r} is installed code ({real})"
    dist = _editable_names(tuple(sys.path)).get(top)
    if dist is not None:
        return f"{top!r} belongs to the installed (editable) distribution {dist!r}"
    top_module = sys.modules.get(top)
    if hasattr(top_module, "__path__"):  # a package, regular or namespace
        folders = [os.path.realpath(p) for p in top_module.__path__]
        inside = [f for f in folders if real.startswith(f + os.sep)]
        if not inside:
            return f"{name!r} is loaded from {real}, outside its package {top!r}"
        home = os.path.dirname(inside[0])
    else:
        home = os.path.dirname(real)
    if home not in _user_code_dirs():
        return (
            f"{top!r} is imported from {home}, which is neither the working directory nor the "
            "folder of the running script"
        )
    return None


def own_module_problem(name: str, folders: Iterable[str | os.PathLike[str]]) -> str | None:
    """Why importing ``name`` would not import your own code from one of ``folders``.

    ``None`` when the top-level package (or module) of ``name`` would be imported from
    directly inside one of ``folders`` and is neither the standard library nor provided by
    an installed distribution (editable ones included); else the reason, in words. Nothing
    is imported (only located). Used for a job file's ``imports:``.

    >>> own_module_problem("subprocess", ["."])
    "'subprocess' is part of the standard library"
    """
    top = name.partition(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return f"{top!r} is part of the standard library"
    dist = _editable_names(tuple(sys.path)).get(top)
    if dist is not None:
        return f"{top!r} is provided by the installed (editable) distribution {dist!r}"
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: located, nothing imported
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"no module {top!r} is found"
    if spec.submodule_search_locations:
        homes = {os.path.dirname(os.path.realpath(p)) for p in spec.submodule_search_locations}
    elif spec.origin and os.path.isfile(spec.origin):
        homes = {os.path.dirname(os.path.realpath(spec.origin))}
    else:
        return f"{top!r} has no source file (a builtin or frozen module)"
    wanted = {os.path.realpath(f) for f in folders}
    outside = sorted(h for h in homes if h not in wanted or _is_installed_file(h + os.sep))
    if outside:
        return f"{top!r} would be imported from {outside[0]}"
    return None


def is_user_module(name: str) -> bool:
    """Whether module ``name`` is the user's own code that this process already imported.

    ``__main__`` counts; so does an imported module whose top-level package (or module)
    lies directly in the current working directory or the running script's folder and
    whose top-level name no installed distribution provides. The standard library,
    installed packages (editable ones too), packages found elsewhere on ``PYTHONPATH`` and
    ``nvalchemi`` (governed by the allow-list) never count. Nothing is imported to answer.
    """
    return _not_user_code(name) is None


def _imported_prefix(path: str) -> str | None:
    """The longest prefix of ``path`` that is an imported module, if any."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name in sys.modules:
            return name
    return None


def _in_user_code(path: str) -> bool:
    prefix = _imported_prefix(path)
    return prefix is not None and is_user_module(prefix)


def is_trusted_path(path: str) -> bool:
    """Whether ``path`` passes the trust rule without ``trust=True`` (see the module doc)."""
    return is_import_allowed(path) or _in_user_code(path)


def check_import_path(path: str, *, trust: bool = False) -> None:
    """Raise :class:`UnsafeImportError` unless ``path`` may be imported."""
    if trust or _TRUST_ALL.get() or is_trusted_path(path):
        return
    top = path.split(".")[0]
    if top in sys.stdlib_module_names:
        hint = "note that the standard library is never reached from files without trust"
    elif top not in sys.modules:
        hint = (
            f"import your module {top!r} before loading (loaders never import new code), or "
            f"allow it with allow_import_path({top!r}) (CLI: --allow-import {top}, or "
            f"`imports: [{top}]` in the job file)"
        )
    else:
        reason = _not_user_code(_imported_prefix(path) or top)
        hint = (
            f"{reason + '; ' if reason else ''}allow it explicitly with "
            f"allow_import_path({top!r}) or register_trusted(<obj>) if you trust what names it"
        )
    raise UnsafeImportError(
        f"Refusing to import {path!r}: it is outside the import allow-list (nvalchemi.*, "
        "torch.nn.*, torch.optim.*, torch.utils.data.*, torch dtypes, registered types) and "
        "is not code of yours that this process has imported. Specs, configs and checkpoints "
        f"from untrusted sources could run arbitrary code this way ({hint}). If you trust this "
        "input, pass trust=True (or use `with nvalchemi._serialization.trusted_imports():`)."
    )


def allow_import_path(prefix: str) -> None:
    """Trust every dotted path equal to ``prefix`` or below it (``"mypkg"``, ``"mypkg.MyModel"``)."""
    if not isinstance(prefix, str) or not prefix.strip("."):
        raise ValueError(
            f"allow_import_path expects a dotted prefix such as 'mypkg'; got {prefix!r}"
        )
    _ALLOWED.add(prefix.strip("."))


def register_trusted(obj: Any) -> Any:
    """Trust one importable class or function by its defining path; returns ``obj`` (decorator-friendly)."""
    _ALLOWED_EXACT.add(object_to_path(obj))
    return obj


@contextlib.contextmanager
def trusted_imports() -> Iterator[None]:
    """Inside this block every importable path is accepted (use only for trusted input)."""
    token = _TRUST_ALL.set(True)
    try:
        yield
    finally:
        _TRUST_ALL.reset(token)


# ------------------------------------------------------- markers on resolved objects

REQUIRES_TRUST_ATTR = "__nvalchemi_requires_trust__"
SPEC_FACTORY_ATTR = "__nvalchemi_spec_factory__"
_SPEC_FACTORIES: set[Any] = set()  # functions marked safe from outside their module


def _function_of(obj: Any) -> Any:
    """The plain function behind a (class/static/bound) method; else ``obj`` itself."""
    return getattr(obj, "__func__", obj)


def _trusted_now(trust: bool = False) -> bool:
    return trust or _TRUST_ALL.get()


def requires_trust(obj: Any) -> Any:
    """Mark a callable (or class) that loads files with full unpickling: untrusted input may
    neither name it nor reach it.

    Put it under ``@classmethod``. The marked function is refused by :func:`import_path`
    without trust, and refuses to run inside an :func:`untrusted_build` block (unless a
    :func:`trusted_imports` block is open), so a spec cannot reach it through another
    factory either. Direct calls from Python code are not affected.

    >>> @requires_trust
    ... def load_pickle(path): ...
    >>> is_trust_required(load_pickle)
    True
    """
    if isinstance(obj, type):
        setattr(obj, REQUIRES_TRUST_ATTR, True)
        return obj
    wrapper = type(obj) if isinstance(obj, (classmethod, staticmethod)) else None
    func = _function_of(obj)

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _UNTRUSTED_BUILD.get() and not _TRUST_ALL.get():
            raise UnsafeImportError(
                f"Refusing to run {func.__module__}.{func.__qualname__} while building an "
                "untrusted spec or checkpoint: it loads pickled files, and unpickling runs code "
                "from the file. Pass trust=True to the loader only if you trust the input and "
                "every file it names."
            )
        return func(*args, **kwargs)

    setattr(guarded, REQUIRES_TRUST_ATTR, True)
    return wrapper(guarded) if wrapper is not None else guarded


def is_trust_required(obj: Any) -> bool:
    """Whether ``obj`` (a class, function or method) is marked with :func:`requires_trust`."""
    return getattr(_function_of(obj), REQUIRES_TRUST_ATTR, False) is True


def spec_factory(obj: Any) -> Any:
    """Mark a function or classmethod as safe for an untrusted spec to call.

    Only for factories that build from their plain keyword arguments and read no files
    with pickle (``MACEWrapper.from_mace_kwargs``); without the mark, untrusted specs may
    call classes only. Put it under ``@classmethod``.
    """
    setattr(_function_of(obj), SPEC_FACTORY_ATTR, True)
    return obj


def register_spec_factory(obj: Any) -> Any:
    """Like :func:`spec_factory` for a callable you do not own (no attribute is set)."""
    _SPEC_FACTORIES.add(_function_of(obj))
    return obj


def is_spec_factory(obj: Any) -> bool:
    """Whether ``obj`` is a routine marked safe with :func:`spec_factory` (classes are not)."""
    if isinstance(obj, type) or is_trust_required(obj):
        return False
    func = _function_of(obj)
    try:
        registered = func in _SPEC_FACTORIES
    except TypeError:  # unhashable callable
        registered = False
    return registered or getattr(func, SPEC_FACTORY_ATTR, False) is True


def _defined_path(obj: Any) -> str:
    try:
        return object_to_path(obj)
    except TypeError:
        return repr(obj)


def _pickle_refusal(path: str, obj: Any, where: str) -> UnsafeImportError:
    prefix = f"{where}: " if where else ""
    return UnsafeImportError(
        f"{prefix}Refusing {path!r} without trust=True: it resolves to "
        f"{_defined_path(obj)!r}, which loads pickled files (full unpickling runs code stored "
        "in the file). Pass trust=True only if you trust this input and every file it names."
    )


def _returned_class(obj: Any) -> type | None:
    """The class a routine says it returns (its return annotation), if it says."""
    try:
        returned = inspect.signature(obj, eval_str=True).return_annotation
    except (NameError, TypeError, ValueError, SyntaxError):
        return None
    return returned if isinstance(returned, type) else None


def _expected_names(expect: type | tuple[type, ...]) -> str:
    items = expect if isinstance(expect, tuple) else (expect,)
    return " or ".join("nn.Module" if t is torch.nn.Module else t.__name__ for t in items)


def check_spec_target(
    obj: Any,
    *,
    path: str,
    where: str = "",
    expect: type | tuple[type, ...] | None = None,
    trust: bool = False,
) -> None:
    """Refuse what a spec may not call, judged on the resolved object ``obj`` before any call.

    Without trust (``trust=True`` or a :func:`trusted_imports` block) the target must be a
    class, a classmethod of a class of your own imported code, or a callable marked with
    :func:`spec_factory` / :func:`register_spec_factory`, and never one marked with
    :func:`requires_trust` (else :class:`UnsafeImportError`). With ``expect``, the class (the
    class owning a classmethod factory, or the class a factory is annotated to return) must
    subclass it, trusted or not (else ``RuntimeError`` saying what was expected); a trusted
    routine that does not say what it returns is not judged. ``where`` (e.g. the spec file
    and key) starts the error message.
    """
    prefix = f"{where}: " if where else ""
    owner = getattr(obj, "__self__", None)
    owner = owner if isinstance(owner, type) else None
    if _trusted_now(trust):
        cls = obj if isinstance(obj, type) else owner or _returned_class(obj)
        if cls is None:
            return
    elif is_trust_required(obj):
        raise _pickle_refusal(path, obj, where)
    elif isinstance(obj, type):
        cls = obj
    elif is_spec_factory(obj) or (owner is not None and is_user_module(owner.__module__)):
        cls = owner or _returned_class(obj)
    else:
        raise UnsafeImportError(
            f"{prefix}{path!r} resolves to {_defined_path(obj)!r}, which is neither a class nor "
            "a callable marked safe for specs; an untrusted spec may only call those. Pass "
            "trust=True only if you trust this input; or mark a safe factory with "
            "nvalchemi._serialization.spec_factory."
        )
    if expect is not None and (cls is None or not issubclass(cls, expect)):
        wanted, defined = _expected_names(expect), _defined_path(cls or obj)
        named = repr(path) if defined == path else f"{path!r} names {defined!r}, which"
        raise RuntimeError(
            f"{prefix}{named} is not a subclass of {wanted}: expected {wanted} (or a marked "
            "factory of one). Nothing was built."
        )


@contextlib.contextmanager
def untrusted_build() -> Iterator[None]:
    """Code in this block runs for untrusted input: :func:`requires_trust` callables refuse
    to run in it (a :func:`trusted_imports` block inside lifts that again)."""
    token = _UNTRUSTED_BUILD.set(True)
    try:
        yield
    finally:
        _UNTRUSTED_BUILD.reset(token)


def object_to_path(obj: Any) -> str:
    """Dotted path ``"module.QualName"`` of an importable class or function.

    Raises ``TypeError`` for lambdas and objects defined inside functions.
    """
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        raise TypeError(
            f"{obj!r} is not an importable callable (lambdas, local functions and instances have "
            "no dotted path); define it at module level."
        )
    return f"{module}.{qualname}"


@functools.lru_cache(maxsize=512)
def _resolve(path: str) -> tuple[Any, str | None]:
    """Import ``path``; return the object and why it is suspicious (or None)."""
    parts = path.split(".")
    if not all(parts):
        raise ValueError(f"{path!r} is not a dotted path such as 'package.module.Name'.")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue
            raise ValueError(f"Importing {module_name!r} for {path!r} failed: {exc}") from exc
        return _walk(module, module_name, parts[i:], path)
    raise ValueError(f"Cannot import {path!r}: module {parts[0]!r} not found.")


def _resolve_imported(path: str) -> tuple[Any, str | None]:
    """Resolve ``path`` from an already-imported module, importing nothing."""
    prefix = _imported_prefix(path)
    if prefix is None:
        raise ValueError(f"Cannot resolve {path!r}: no module of it is imported.")
    return _walk(sys.modules[prefix], prefix, path.split(".")[prefix.count(".") + 1 :], path)


def _walk(obj: Any, current: str, attrs: list[str], path: str) -> tuple[Any, str | None]:
    problem = None
    for attr in attrs:
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ValueError(
                f"Cannot import {path!r}: {current!r} has no attribute {attr!r}."
            ) from None
        current = f"{current}.{attr}"
        if attr.startswith("__"):
            problem = problem or f"it walks through the dunder attribute {attr!r}"
        if isinstance(obj, types.ModuleType) and obj.__name__ != current:
            problem = problem or f"{current!r} is an alias of module {obj.__name__!r}"
    return obj, problem


def _defined_at_problem(path: str, obj: Any) -> str | None:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    defined = f"{module}.{qualname}"
    torch_internal = module.split(".")[0] == "torch" and not _under(defined, _DENIED)
    if defined == path or torch_internal or is_trusted_path(defined):
        return None
    return f"it is really {defined!r}, which is outside the allow-list and not your own code"


def import_path(path: str, *, trust: bool = False) -> Any:
    """Import the object named by dotted ``path`` under the trust rule (module docstring).

    Raises :class:`UnsafeImportError` (a ``ValueError``) for untrusted paths, before importing
    anything; for an allowed path whose object is marked :func:`requires_trust` (whatever
    alias names it), before it is called; and ``ValueError`` when the path does not resolve.
    """
    if not isinstance(path, str):
        raise TypeError(f"import path must be a str, got {type(path).__name__}")
    check_import_path(path, trust=trust)
    if _trusted_now(trust) or is_import_allowed(path):
        obj, problem = _resolve(path)
    else:  # the user-code door: imported modules only, nothing new is imported
        obj, problem = _resolve_imported(path)
    if not _trusted_now(trust):
        problem = problem or _defined_at_problem(path, obj)
        if problem:
            raise UnsafeImportError(
                f"Refusing to import {path!r}: {problem}. Name objects by the trusted module that "
                "defines them, or pass trust=True if you trust this input."
            )
        if is_trust_required(obj):  # judged on the object: aliases and re-exports too
            raise _pickle_refusal(path, obj, "")
    return obj


# ---------------------------------------------------------------------------- value codecs


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"torch.float32"``."""
    return str(dtype)


def dtype_from_str(value: Any) -> torch.dtype:
    """``"torch.float32"`` or ``"float32"`` -> ``torch.float32`` (nothing but dtypes resolves)."""
    if not isinstance(value, str):
        raise TypeError(f"dtype deserialization expected str, got {type(value).__name__}")
    dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{value!r} does not resolve to a torch.dtype (e.g. 'torch.float32').")
    return dtype


def device_from_str(value: Any) -> torch.device:
    """``"cuda:0"`` -> ``torch.device("cuda:0")``."""
    if not isinstance(value, str):
        raise TypeError(f"device deserialization expected str, got {type(value).__name__}")
    return torch.device(value)


def tensor_to_dict(tensor: torch.Tensor) -> dict[str, Any]:
    """``{"data": nested list, "dtype": "torch.float32", "shape": [...]}``."""
    t = tensor.detach().cpu()
    return {"data": t.tolist(), "dtype": dtype_to_str(t.dtype), "shape": list(t.shape)}


def tensor_from_dict(value: Mapping[str, Any]) -> torch.Tensor:
    """Inverse of :func:`tensor_to_dict`."""
    dtype = dtype_from_str(value["dtype"])
    return torch.tensor(value["data"], dtype=dtype).reshape([int(n) for n in value["shape"]])


# type -> (serialize, deserialize, tagged). Untagged types have a fixed JSON form that spec
# rehydration recognises by annotation or structure; tagged ones are written as
# {"__type__": path, "value": ...} so they decode without any annotation.
_TYPE_SERIALIZERS: dict[type, tuple[Callable[[Any], Any], Callable[[Any], Any], bool]] = {
    torch.dtype: (dtype_to_str, dtype_from_str, False),
    torch.device: (str, device_from_str, False),
    torch.Tensor: (tensor_to_dict, tensor_from_dict, False),
}
_UNTAGGED = (torch.dtype, torch.device, torch.Tensor)


def register_type_serializer(
    type_: type, serialize: Callable[[Any], Any], deserialize: Callable[[Any], Any]
) -> None:
    """Register JSON (de)serializers for ``type_`` (replacing an existing entry) and trust it.

    Values of a registered type inside specs are written as ``{"__type__": "<path>",
    "value": serialize(v)}`` and read back with ``deserialize``.

    >>> class Unit:
    ...     def __init__(self, name): self.name = name
    >>> register_type_serializer(Unit, lambda u: u.name, Unit)  # doctest: +SKIP
    """
    if not isinstance(type_, type):
        raise TypeError(f"register_type_serializer expects a type, got {type_!r}")
    if type_ not in _UNTAGGED:
        register_trusted(type_)
    _TYPE_SERIALIZERS[type_] = (serialize, deserialize, type_ not in _UNTAGGED)


def _serializer_for(tp: type) -> tuple[type, tuple] | None:
    for base in tp.__mro__:
        if base in _TYPE_SERIALIZERS:
            return base, _TYPE_SERIALIZERS[base]
    return None


def encode_value(value: Any) -> Any:
    """JSON-ready form of ``value``: containers recursively, torch values and classes by codec.

    Objects with a ``model_dump()`` (pydantic models such as specs) are dumped.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"Only str keys can be serialized to JSON; got keys {bad!r}")
        return {k: encode_value(v) for k, v in value.items()}
    found = _serializer_for(type(value))
    if found is not None:
        tp, (serialize, _, tagged) = found
        return (
            {"__type__": object_to_path(tp), "value": serialize(value)}
            if tagged
            else serialize(value)
        )
    if callable(getattr(value, "model_dump", None)):
        return encode_value(value.model_dump())
    if isinstance(value, type) or inspect.isroutine(value):
        return {"__type__": object_to_path(value)}
    raise TypeError(
        f"Cannot serialize a value of type {type(value).__name__!r} to JSON; register it with "
        "register_type_serializer(type_, serialize, deserialize)."
    )


_NOT_TAGGED = object()


def decode_tagged(value: Mapping[str, Any], *, trust: bool = False) -> Any:
    """Decode a self-describing JSON dict (tensor dict, ``{"__type__": ...}``); else ``_NOT_TAGGED``."""
    keys = set(value)
    if keys == {"data", "dtype", "shape"}:
        return tensor_from_dict(value)
    if "__type__" in keys and keys <= {"__type__", "value"} and isinstance(value["__type__"], str):
        if "value" not in keys:
            return import_path(value["__type__"], trust=trust)
        for tp, (_, deserialize, tagged) in _TYPE_SERIALIZERS.items():
            if tagged and object_to_path(tp) == value["__type__"]:
                return deserialize(value["value"])
        raise ValueError(
            f"No serializer registered for {value['__type__']!r}; call register_type_serializer "
            "for that type before loading."
        )
    return _NOT_TAGGED


def init_kwargs_from_attrs(obj: Any) -> dict[str, Any]:
    """Constructor keyword arguments of ``obj`` recovered from same-named attributes.

    Parameters without a same-named attribute are skipped (their defaults apply on rebuild).
    """
    out = {}
    for name, param in inspect.signature(type(obj)).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if hasattr(obj, name):
            out[name] = getattr(obj, name)
    return out


# ------------------------------------------------------------------ pydantic field types


def _to_class(value: Any, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, Mapping) and "__type__" in value:
        value = value["__type__"]
    if isinstance(value, str):
        try:
            value = import_path(value)
        except UnsafeImportError:
            raise
        except (ValueError, ImportError) as exc:
            raise ValueError(f"{value!r} must resolve to an importable class: {exc}") from exc
    if not isinstance(value, type):
        raise ValueError(f"{value!r} must be a class or the dotted path of an importable class.")
    return value


def _class_path_or_none(value: Any) -> str | None:
    return None if value is None else object_to_path(value)


SerializableClass = Annotated[
    Any,
    BeforeValidator(_to_class),
    PlainSerializer(object_to_path, return_type=str),
    WithJsonSchema({"type": "string", "description": "dotted path of a class"}),
]
"""A class, given as the class or a dotted path (allow-listed); dumped as ``"module.QualName"``."""

SerializableOptionalClass = Annotated[
    Any,
    BeforeValidator(functools.partial(_to_class, optional=True)),
    PlainSerializer(_class_path_or_none),
    WithJsonSchema({"type": ["string", "null"], "description": "dotted path of a class"}),
]
"""Like :data:`SerializableClass` but ``None`` is allowed."""

SerializableTaggedClass = Annotated[
    Any,
    BeforeValidator(_to_class),
    PlainSerializer(lambda cls: {"__type__": object_to_path(cls)}),
    WithJsonSchema({"type": "object", "properties": {"__type__": {"type": "string"}}}),
]
"""A class dumped as ``{"__type__": "module.QualName"}``."""
