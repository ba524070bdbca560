"""nvalchemi: train machine-learned interatomic potentials in PyTorch."""

from nvalchemi._lazy import lazy_exports

__version__ = "0.1.0"
version = __version__

_EXPORTS = {
    "OptionalDependency": "._optional",
    "OptionalDependencyError": "._optional",
}
__all__ = ["__version__", "version", *_EXPORTS]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
