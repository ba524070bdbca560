"""``CommitteeCalculator``: a committee as an ASE calculator that also reports its spread.

Everything :class:`~nvalchemi.models.calculator.NvalchemiCalculator` gives (the
committee mean) plus ``energy_std`` (eV), ``forces_std`` (``(N, 3)``, eV/Å),
``max_force_deviation`` (eV/Å, DP-GEN's model deviation) and, for periodic cells,
``stress_std`` (Voigt, eV/Å³). The committee's calibration factors are already applied
(they live in the model; see :class:`~nvalchemi.models.committee.Committee`).

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

import numpy as np
from ase.calculators.calculator import all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from nvalchemi.models.calculator import NvalchemiCalculator

__all__ = ["SPREAD_PROPERTIES", "CommitteeCalculator"]

SPREAD_PROPERTIES = ("energy_std", "forces_std", "max_force_deviation", "stress_std")
"""The extra ASE properties of a committee."""


class CommitteeCalculator(NvalchemiCalculator):
    """:class:`NvalchemiCalculator` for a model that outputs spreads (a committee).

    Takes the same arguments (and ``from_checkpoint``); a model without spread outputs
    is refused, since the extra properties would never be there.
    """

    def __init__(self, model: Any, **kwargs: Any) -> None:
        outputs = set(getattr(getattr(model, "model_config", None), "outputs", ()))
        if not outputs & set(SPREAD_PROPERTIES):
            raise TypeError(
                f"{type(model).__name__} outputs no spread ({', '.join(SPREAD_PROPERTIES)}); "
                "use NvalchemiCalculator for a single model, or train a committee "
                "(nvalchemi.models.committee.Committee)."
            )
        super().__init__(model, **kwargs)
        self.implemented_properties = [
            *self.implemented_properties,
            *(p for p in SPREAD_PROPERTIES if p in outputs),
        ]

    def calculate(
        self,
        atoms: Any = None,
        properties: list[str] | tuple[str, ...] = ("energy",),
        system_changes: list[str] = all_changes,
    ) -> None:
        outputs: dict[str, Any] = {}
        # The parent runs the model once; its forward hook hands us the spreads.
        handle = self.model.register_forward_hook(
            lambda module, args, output: outputs.update(output)
        )
        try:
            super().calculate(atoms, properties, system_changes)
        finally:
            handle.remove()
        for name in SPREAD_PROPERTIES:
            value = outputs.get(name)
            if value is None:
                continue
            value = value.detach().double().cpu().numpy()
            if name == "forces_std":
                self.results[name] = value.reshape(-1, 3)
            elif name == "stress_std":
                self.results[name] = full_3x3_to_voigt_6_stress(value.reshape(3, 3))
            else:
                self.results[name] = float(np.asarray(value).reshape(-1)[0])
