"""Errors for bad user input that name where the problem is and how to fix it.

:class:`FieldError` is what library functions behind the command line (data sources, job
files, devices) raise for input they refuse: a ``ValueError`` whose text is one paragraph,
``"<field>: <what is wrong>. Fix: <what to do>."``, so a Python caller and the CLI show
the same message.

Example:
    >>> str(FieldError("must be >= 1; got 0", field="dataset.batch_size", fix="set it to 8"))
    'dataset.batch_size: must be >= 1; got 0. Fix: set it to 8.'
"""

from __future__ import annotations

__all__ = ["FieldError", "field_path", "validation_lines"]


class FieldError(ValueError):
    """Bad input: what is wrong, the field it is in (when there is one) and the fix.

    Attributes:
        message: what is wrong, without the field and the fix.
        field: where (``"dataset.path"``, ``"--device"``, ``"INPUT"``), or ``None``.
        fix: what to do, or ``None``.
    """

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        self.message = message.rstrip()
        self.field = field
        self.fix = fix
        text = f"{field}: {self.message}" if field else self.message
        if fix:
            text = f"{text.rstrip('.')}. Fix: {fix.rstrip('.')}."
        super().__init__(text)


def field_path(loc: tuple | list, prefix: str = "") -> str:
    """A pydantic error location as a field path: ``("a", "b", 0, "c")`` -> ``"a.b[0].c"``.

    >>> field_path(("optimizer_configs", "main", 0, "lr"), "strategy")
    'strategy.optimizer_configs.main[0].lr'
    """
    text = prefix
    for part in loc:
        if part == "__root__":
            continue
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text = f"{text}.{part}" if text else str(part)
    return text


def _position(data: object, loc: tuple | list) -> tuple:
    """Where ``loc`` is in ``data`` in reading order (key order of each mapping)."""
    out: list[int] = []
    for part in loc:
        if isinstance(data, dict) and part in data:
            out.append(list(data).index(part))
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            out.append(part)
            data = data[part]
        else:
            out.append(len(data) if isinstance(data, (dict, list)) else 0)
            break
    return tuple(out)


def validation_lines(exc: object, data: object = None, prefix: str = "") -> list[str]:
    """One ``"<field path>: <message> (got <value>)"`` line per error of a pydantic
    ``ValidationError``, in the order the fields appear in ``data`` (the input) when given.
    """
    errors = list(exc.errors(include_url=False))  # type: ignore[attr-defined]
    if isinstance(data, dict):
        errors.sort(key=lambda e: _position(data, e.get("loc", ())))
    lines = []
    for error in errors:
        where = field_path(error.get("loc", ()), prefix)
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        value = error.get("input")
        shown = ""
        if error.get("type") not in ("missing", "model_type") and not isinstance(value, dict):
            shown = f" (got {value!r})" if len(repr(value)) < 80 else ""
        lines.append(f"{where}: {message}{shown}" if where else f"{message}{shown}")
    return lines
