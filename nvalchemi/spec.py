"""Declarative, JSON-round-trippable recipes for building objects: ``BaseSpec``.

A spec names an importable callable (``cls_path``) and the keyword arguments to call it with.
Values may be nested specs (built first), lists/tuples/dicts of them, classes and functions,
tensors, dtypes and devices; ``model_dump()`` is always plain JSON.

>>> import torch
>>> spec = create_model_spec(torch.nn.Linear, in_features=3, out_features=1, dtype=torch.float64)
>>> data = spec.model_dump()          # {"cls_path": "torch.nn.modules.linear.Linear", ...}
>>> layer = create_model_spec_from_json(data).build()
>>> layer.weight.dtype
torch.float64

Rehydrating or building a spec imports only allow-listed paths (see
:mod:`nvalchemi._serialization`): a spec naming ``os.system`` is refused with
:class:`~nvalchemi._serialization.UnsafeImportError` before anything is imported or called,
unless ``trust=True`` is passed.
"""

from __future__ import annotations

import contextlib
import inspect
import types
import typing
import warnings
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, PrivateAttr, field_validator, model_serializer

from nvalchemi._serialization import (
    _NOT_TAGGED,
    UnsafeImportError,
    check_spec_target,
    decode_tagged,
    device_from_str,
    dtype_from_str,
    encode_value,
    import_path,
    object_to_path,
    register_type_serializer,
    trusted_imports,
    untrusted_build,
)

__all__ = [
    "BaseSpec",
    "create_model_spec",
    "create_model_spec_from_json",
    "register_type_serializer",
]

_EMPTY = inspect.Parameter.empty


def _utc_now() -> str:
    return datetime.now(UTC).isoformat()


def _signature(target: Any) -> inspect.Signature | None:
    for eval_str in (True, False):
        try:
            return inspect.signature(target, eval_str=eval_str)
        except (NameError, TypeError, SyntaxError):
            continue
        except ValueError:
            return None
    return None


def _parameters(target: Any) -> dict[str, inspect.Parameter]:
    sig = _signature(target)
    return dict(sig.parameters) if sig is not None else {}


def _accepts_var_kwargs(params: Mapping[str, inspect.Parameter]) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in params.values())


def _resolve_callable(path: str, *, trust: bool = False) -> Any:
    target = import_path(path, trust=trust)
    if not callable(target):
        raise ValueError(f"cls_path={path!r} resolves to a non-callable {type(target).__name__}.")
    return target


class BaseSpec(BaseModel):
    """Recipe for ``import(cls_path)(**kwargs)``; extra fields are the keyword arguments.

    Attributes:
        cls_path: dotted path of an importable callable (class, function, classmethod).
        timestamp: ISO-8601 UTC time the spec was created (kept across JSON round trips).
    """

    model_config = ConfigDict(
        extra="allow", arbitrary_types_allowed=True, revalidate_instances="never"
    )

    cls_path: str
    timestamp: str = ""
    _target: Any = PrivateAttr(default=None)
    _trusted: bool = PrivateAttr(default=False)
    # read from JSON without trust: building may not reach code that unpickles files
    _untrusted_json: bool = PrivateAttr(default=False)

    @field_validator("cls_path")
    @classmethod
    def _importable_callable(cls, value: str) -> str:
        _resolve_callable(value)
        return value

    def model_post_init(self, __context: Any) -> None:
        if not self.timestamp:
            self.timestamp = _utc_now()

    @property
    def kwargs(self) -> dict[str, Any]:
        """The stored keyword arguments (nested specs not built)."""
        return dict(self.model_extra or {})

    def target(self) -> Any:
        """The callable this spec builds (imported through the allow-list)."""
        if self._target is None:
            self._target = _resolve_callable(self.cls_path, trust=self._trusted)
        return self._target

    def accepts_kwarg(self, name: str) -> bool:
        """Whether the target takes keyword ``name`` (explicitly or through ``**kwargs``)."""
        params = _parameters(self.target())
        return name in params or _accepts_var_kwargs(params)

    def built_kwargs(self, target: Any = None) -> dict[str, Any]:
        """The stored kwargs with nested specs built, as :meth:`build` passes them to
        ``target`` (default: this spec's target; e.g. its ``from_data`` classmethod): a
        parameter that ``target`` annotates as a spec keeps its spec."""
        params = _parameters(self.target() if target is None else target)
        return {
            k: _build_value(v, params[k].annotation if k in params else _EMPTY)
            for k, v in self.kwargs.items()
        }

    def build(self, *args: Any, strict: bool = False, **extra_kwargs: Any) -> Any:
        """Call the target with ``*args`` and the stored kwargs (``extra_kwargs`` win).

        Nested specs are built first unless the target annotates that parameter as a spec.
        Stored kwargs the target no longer accepts (its signature changed since the spec
        was written) raise ``TypeError`` with ``strict=True``; otherwise they are dropped
        with a warning.
        """
        target = self.target()
        params = _parameters(target)
        stored = self.kwargs
        unknown = (
            [] if not params or _accepts_var_kwargs(params) else sorted(set(stored) - set(params))
        )
        if unknown:
            message = (
                f"Spec of {self.cls_path} (saved at {self.timestamp}) has keyword(s) {unknown} "
                f"that {self.cls_path} does not accept (its signature changed since the spec was "
                "written)"
            )
            if strict:
                raise TypeError(f"{message}; update the spec's keyword arguments to match.")
            warnings.warn(f"{message}; dropping them.", UserWarning, stacklevel=2)
            stored = {k: v for k, v in stored.items() if k not in unknown}
        kwargs = {
            k: _build_value(v, params[k].annotation if k in params else _EMPTY)
            for k, v in stored.items()
        }
        kwargs.update(extra_kwargs)
        if self._trusted:
            scope = trusted_imports()
        elif self._untrusted_json:
            scope = untrusted_build()
        else:
            scope = contextlib.nullcontext()
        with scope:
            try:
                return target(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(
                    f"Failed to build {self.cls_path} from spec (saved at {self.timestamp}): {exc}. "
                    "The callable signature may have changed since the spec was written; "
                    "update the spec's keyword arguments to match."
                ) from exc

    @model_serializer(mode="plain")
    def _dump(self) -> dict[str, Any]:
        try:
            params = _parameters(self.target())
        except (ValueError, TypeError):
            params = {}
        out = {"cls_path": self.cls_path, "timestamp": self.timestamp}
        for key, value in self.kwargs.items():
            annotation = params[key].annotation if key in params else _EMPTY
            if isinstance(value, type) and _wants_class(annotation):
                out[key] = object_to_path(value)  # a `type`-annotated parameter: plain dotted path
            else:
                out[key] = encode_value(value)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BaseSpec):
            return NotImplemented
        return self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"BaseSpec({self.cls_path}({args}))"


def _is_spec_annotation(annotation: Any) -> bool:
    return any(isinstance(a, type) and issubclass(a, BaseSpec) for a in _union_members(annotation))


def _build_value(value: Any, annotation: Any) -> Any:
    if isinstance(value, BaseSpec):
        return value if _is_spec_annotation(annotation) else value.build()
    if isinstance(value, (list, tuple)):
        item = _item_annotation(annotation)
        return type(value)(_build_value(v, item) for v in value)
    if isinstance(value, dict):
        return {k: _build_value(v, _EMPTY) for k, v in value.items()}
    return value


def _as_spec_value(value: Any) -> Any:
    """Turn objects that know their spec (``to_spec()``) and pydantic models into specs."""
    if isinstance(value, BaseSpec):
        return value
    to_spec = getattr(value, "to_spec", None)
    if callable(to_spec) and not isinstance(value, type):
        spec = to_spec()
        if not isinstance(spec, BaseSpec):
            raise TypeError(
                f"{type(value).__name__}.to_spec() returned {type(spec).__name__}, not a BaseSpec."
            )
        return spec
    if isinstance(value, BaseModel):
        fields = {name: getattr(value, name) for name in type(value).model_fields}
        return create_model_spec(type(value), **fields)
    if isinstance(value, (list, tuple)):
        return type(value)(_as_spec_value(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_spec_value(v) for k, v in value.items()}
    return value


def create_model_spec(target: Any, **kwargs: Any) -> BaseSpec:
    """Spec for calling ``target(**kwargs)``.

    ``target`` is an importable class or function (or its dotted path). Values that have a
    ``to_spec()`` method (losses, schedules) and pydantic models are stored as nested specs.

    Raises ``TypeError`` for targets that are not importable, take positional-only
    parameters, or do not accept one of ``kwargs``.
    """
    if isinstance(target, str):
        target = _resolve_callable(target)
    if not callable(target):
        raise TypeError(f"create_model_spec target must be callable, got {target!r}")
    path = object_to_path(target)
    resolved = import_path(path, trust=True)
    if resolved is not target and resolved != target:
        raise TypeError(f"{target!r} is not an importable callable: {path!r} names another object.")
    params = _parameters(target)
    positional_only = [n for n, p in params.items() if p.kind is p.POSITIONAL_ONLY]
    if positional_only:
        raise TypeError(
            f"{path} has positional-only param(s) {positional_only}; create_model_spec only "
            "supports kwargs."
        )
    if not _accepts_var_kwargs(params):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise TypeError(f"Unknown kwargs for {path}: {unknown}")
    stored = {k: _as_spec_value(v) for k, v in kwargs.items()}
    return _make_spec(path, _utc_now(), stored, target, trusted=False)


def _make_spec(path: str, timestamp: str, kwargs: dict, target: Any, trusted: bool) -> BaseSpec:
    reserved = sorted({"cls_path", "timestamp"} & set(kwargs))
    if reserved:
        raise TypeError(f"Spec kwargs may not be named {reserved} (reserved by BaseSpec)")
    spec = BaseSpec.model_construct(cls_path=path, timestamp=timestamp)
    spec.__pydantic_extra__ = kwargs
    spec._target, spec._trusted = target, trusted
    return spec


def create_model_spec_from_json(
    spec_dict: Mapping[str, Any],
    *,
    trust: bool = False,
    expect: type | tuple[type, ...] | None = None,
    where: str = "",
) -> BaseSpec:
    """Rehydrate a spec from its JSON dict (as written by ``spec.model_dump()``).

    This is the one place where what a file names is checked (every loader comes here):
    unless ``trust=True``, every dotted path inside (the target, nested specs,
    ``{"__type__": ...}`` values, class arguments) must pass the trust rule of
    :mod:`nvalchemi._serialization`, each ``cls_path`` must name a class (a subclass of
    ``expect`` at the top level, when given), a classmethod of your own class or a marked
    factory, and nothing that unpickles files; refusals raise
    :class:`~nvalchemi._serialization.UnsafeImportError` naming ``where`` (e.g. the file)
    and the key, before anything is built. Strings are decoded to classes, dtypes or
    devices where the target's parameter is annotated ``type``/``torch.dtype``/
    ``torch.device`` (or, unannotated, named ``dtype``/``device``/``*_dtype``/
    ``*_device``); lists become tuples where the parameter is annotated as a tuple.
    """
    return _rehydrate(spec_dict, trust, expect, where, "")


def _located(where: str, key: str) -> str:
    if where and key:
        return f"{where}, key {key!r}"
    return where or (f"key {key!r}" if key else "")


def _refuse_at(exc: UnsafeImportError, where: str) -> UnsafeImportError:
    return UnsafeImportError(f"{where}: {exc}") if where else exc


def _refuse(exc: UnsafeImportError, path: Any, where: str) -> UnsafeImportError:
    """A refused ``cls_path``: the reference's words first, then where and why."""
    at = f" ({where})" if where else ""
    return UnsafeImportError(f"Could not resolve cls_path={path!r}{at}: {exc}")


def _rehydrate(spec_dict: Any, trust: bool, expect: Any, where: str, key: str) -> BaseSpec:
    if not isinstance(spec_dict, Mapping):
        raise TypeError(f"spec JSON must be a mapping, got {type(spec_dict).__name__}")
    for name in ("cls_path", "timestamp"):
        if name not in spec_dict:
            raise ValueError(
                f"Spec JSON missing required field {name!r}; present keys: {sorted(spec_dict)}"
            )
    path = spec_dict["cls_path"]
    at = _located(where, f"{key}.cls_path" if key else "cls_path")
    if not trust and spec_dict.get("trust"):
        # A spec must not lift the trust rule for what it loads itself (e.g. a loader called
        # with trust=True on a directory the spec's author controls).
        raise _refuse(
            UnsafeImportError(
                f"Spec for {path!r} asks for trust=True; an untrusted spec may not grant trust. "
                "Pass trust=True to create_model_spec_from_json yourself if you trust its source."
            ),
            path,
            _located(where, key),
        )
    if not isinstance(path, str):
        raise ValueError(f"Spec JSON field 'cls_path' must be a str, got {path!r}")
    try:
        target = _resolve_callable(path, trust=trust)
    except UnsafeImportError as exc:
        raise _refuse(exc, path, at) from None
    except (ValueError, ImportError, TypeError) as exc:
        raise ValueError(
            f"Could not resolve cls_path={path!r} while rehydrating spec JSON"
            f"{' (' + at + ')' if at else ''}: {exc}"
        ) from exc
    try:
        check_spec_target(target, path=path, trust=trust, expect=expect)
    except UnsafeImportError as exc:
        raise _refuse(exc, path, at) from None
    except RuntimeError as exc:  # not the expected kind: say where, as the refusals do
        raise RuntimeError(f"{at}: {exc}" if at else str(exc)) from None
    params = _parameters(target)
    kwargs = {
        k: _decode(
            v,
            params[k].annotation if k in params else _EMPTY,
            k,
            trust,
            where,
            f"{key}.{k}" if key else k,
        )
        for k, v in spec_dict.items()
        if k not in ("cls_path", "timestamp")
    }
    spec = _make_spec(path, str(spec_dict["timestamp"]), kwargs, target, trusted=trust)
    spec._untrusted_json = not trust
    return spec


# ------------------------------------------------------------------- annotation helpers


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if annotation is _EMPTY or annotation is Any or isinstance(annotation, str):
        return ()
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _union_members(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return tuple(m for a in typing.get_args(annotation) for m in _union_members(a))
    return (annotation,)


def _wants(annotation: Any, tp: type) -> bool:
    return any(m is tp for m in _union_members(annotation))


def _wants_class(annotation: Any) -> bool:
    return any(m is type or typing.get_origin(m) is type for m in _union_members(annotation))


def _class_argument(annotation: Any) -> tuple[type, ...] | None:
    """``(X,)`` for a parameter annotated ``type[X]`` (``None`` when any class will do)."""
    out = []
    for member in _union_members(annotation):
        if typing.get_origin(member) is type:
            expected = _expected_type(typing.get_args(member)[0])
            if expected is None:
                return None
            out.extend(expected)
        elif member is type:
            return None
    return tuple(out) or None


def _wants_tuple(annotation: Any) -> bool:
    return any(m is tuple or typing.get_origin(m) is tuple for m in _union_members(annotation))


def _item_annotation(annotation: Any) -> Any:
    """Element annotation of ``list[X]``/``tuple[X, ...]``/``Sequence[X]`` (else unannotated)."""
    for member in _union_members(annotation):
        args = typing.get_args(member)
        if typing.get_origin(member) is tuple:
            return args[0] if len(args) == 2 and args[1] is Ellipsis else _EMPTY
        if typing.get_origin(member) is not None and len(args) == 1:
            return args[0]
    return _EMPTY


def _expected_type(annotation: Any) -> tuple[type, ...] | None:
    """The classes a nested spec for a parameter annotated ``annotation`` must build.

    ``None`` when the annotation does not say (absent, ``Any``, ``object``, a spec kept
    unbuilt, a protocol ``issubclass`` cannot check): then only the trust rule applies.
    Generic aliases count as their origin (``Callable[..., T]`` wants a class with
    ``__call__``, ``Sequence[T]`` a sequence).
    """
    members = _union_members(annotation)
    out = []
    for member in members:
        cls = typing.get_origin(member) or member
        if not isinstance(cls, type) or cls is object or issubclass(cls, BaseSpec):
            return None
        try:
            issubclass(object, cls)
        except TypeError:  # a protocol with data members
            return None
        out.append(cls)
    return tuple(out) or None


def _value_annotation(annotation: Any) -> Any:
    """Value annotation of ``dict[K, V]``/``Mapping[K, V]`` (else unannotated)."""
    for member in _union_members(annotation):
        origin, args = typing.get_origin(member), typing.get_args(member)
        if isinstance(origin, type) and issubclass(origin, Mapping) and len(args) == 2:
            return args[1]
    return _EMPTY


def _decode(value: Any, annotation: Any, name: str, trust: bool, where: str, key: str) -> Any:
    if isinstance(value, Mapping):
        if "cls_path" in value:
            # a nested spec is built before the object that receives it: judge its class
            # against what the receiving parameter accepts now, before anything is built
            return _rehydrate(value, trust, _expected_type(annotation), where, key)
        try:
            decoded = decode_tagged(value, trust=trust)
        except UnsafeImportError as exc:
            raise _refuse_at(exc, _located(where, f"{key}.__type__")) from None
        if decoded is not _NOT_TAGGED:
            return decoded
        item = _value_annotation(annotation)
        return {k: _decode(v, item, k, trust, where, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        item = _item_annotation(annotation)
        items = [_decode(v, item, "", trust, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if _wants_tuple(annotation) else items
    if isinstance(value, str):
        if _wants_class(annotation):
            try:
                cls = import_path(value, trust=trust)
                # it is called later: it must be a class of the kind the parameter names
                check_spec_target(cls, path=value, trust=trust, expect=_class_argument(annotation))
            except UnsafeImportError as exc:
                raise _refuse_at(exc, _located(where, key)) from None
            return cls
        unannotated = not _union_members(annotation)
        if _wants(annotation, torch.dtype) or (
            unannotated and (name == "dtype" or name.endswith("_dtype"))
        ):
            return dtype_from_str(value)
        if _wants(annotation, torch.device) or (
            unannotated and (name == "device" or name.endswith("_device"))
        ):
            return device_from_str(value)
    return value
