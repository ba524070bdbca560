"""Model contract, built-in potentials, the MACE wrapper and an ASE calculator."""

from nvalchemi._lazy import lazy_exports

_EXPORTS = {
    "BaseModelMixin": ".base",
    "ModelConfig": ".base",
    "NeighborConfig": ".base",
    "NeighborListFormat": ".base",
    "DemoModel": ".demo",
    "DemoModelWrapper": ".demo",
    "PaiNN": ".painn",
    "MACEWrapper": ".mace",
    "NvalchemiCalculator": ".calculator",
    "Committee": ".committee",
    "CommitteeCalculator": ".committee_calculator",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
