"""Lazy re-exports for package ``__init__`` modules.

Packages list their public names and the module that defines each; the module
is imported only when a name is first used. This keeps ``import nvalchemi.training``
cheap (no zarr, matplotlib, tensorboard or mace at import time).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` resolving ``exports`` on first access.

    ``exports`` maps a public name to the module (relative to ``package`` when it
    starts with a dot) that defines it.
    """

    def __getattr__(name: str) -> object:
        try:
            module_name = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module = importlib.import_module(module_name, package)
        value = getattr(module, name)
        importlib.import_module(package).__dict__[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(importlib.import_module(package).__dict__))

    return __getattr__, __dir__
