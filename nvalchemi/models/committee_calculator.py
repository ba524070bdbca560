"""``CommitteeCalculator``: a committee as an ASE calculator that also reports its spread.

:class:`~nvalchemi.models.calculator.NvalchemiCalculator` gives a committee's spread
whenever its model (or export) computes one; this calculator insists on it. Everything
``NvalchemiCalculator`` gives (the committee mean) plus ``energy_std`` (eV),
``forces_std`` (``(N, 3)``, eV/Å), ``max_force_deviation`` (eV/Å, DP-GEN's model
deviation) and, for periodic cells, ``stress_std`` (Voigt, eV/Å³). The committee's
calibration factors are already applied (they live in the model and in its export; see
:class:`~nvalchemi.models.committee.Committee`). ``CommitteeCalculator.from_export``
loads an exported committee (torch only inside).

Example:
    >>> from ase.build import bulk
    >>> from nvalchemi.models import PaiNN
    >>> from nvalchemi.models.committee import Committee
    >>> from nvalchemi.spec import create_model_spec
    >>> member = create_model_spec(PaiNN, elements=[29], hidden_channels=8)
    >>> atoms = bulk("Cu", "fcc", a=3.6) * (2, 2, 2)
    >>> atoms.calc = CommitteeCalculator(Committee([member], size=2))
    >>> atoms.calc.get_property("forces_std", atoms).shape
    (8, 3)
"""

from __future__ import annotations

from typing import Any

from nvalchemi.models.calculator import NvalchemiCalculator
from nvalchemi.models.committee import SPREAD_NAMES

__all__ = ["SPREAD_PROPERTIES", "CommitteeCalculator"]

SPREAD_PROPERTIES = SPREAD_NAMES
"""The extra ASE properties of a committee."""


class CommitteeCalculator(NvalchemiCalculator):
    """:class:`NvalchemiCalculator` for a model or export that outputs spreads (a committee).

    Takes the same arguments (and ``from_checkpoint``, ``from_export``); a single model
    or its export is refused, since the extra properties would never be there.
    """

    def __init__(self, model: Any, **kwargs: Any) -> None:
        config = getattr(model, "model_config", None)
        if config is not None:
            spreads = set(config.outputs) & set(SPREAD_PROPERTIES)
        else:  # an export: a committee's says how many members it has
            spreads = set(SPREAD_PROPERTIES) if getattr(model, "committee_size", 1) > 1 else set()
        if not spreads:
            raise TypeError(
                f"{type(model).__name__} outputs no spread ({', '.join(SPREAD_PROPERTIES)}); "
                "use NvalchemiCalculator for a single model, or train a committee "
                "(nvalchemi.models.committee.Committee)."
            )
        super().__init__(model, **kwargs)
