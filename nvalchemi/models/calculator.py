"""``NvalchemiCalculator``: an nvalchemi model, checkpoint or exported file as an ASE calculator.

Computes ``energy``, ``free_energy`` (equal to the energy), ``forces`` and, for
periodic systems, ``stress`` (Voigt, eV/Å³, ASE's sign); for a committee (a model or an
export of one) also its calibrated spread: ``energy_std`` (eV), ``forces_std``
(``(N, 3)``, eV/Å), ``max_force_deviation`` (eV/Å) and ``stress_std`` (Voigt, eV/Å³),
read with ``atoms.calc.get_property("max_force_deviation", atoms)``. Every call goes through the
export contract (:mod:`nvalchemi.models.export`): the neighbour inputs are built by
:func:`~nvalchemi.models.export.neighbor_inputs` and handed to a model behind
:class:`~nvalchemi.models.export.Potential`, to an exported file
(:meth:`NvalchemiCalculator.from_export`) or to any module that follows the contract;
results are cached by ASE's contract (recomputed only when positions, numbers, cell or
pbc change).

Example:
    >>> from ase.build import bulk
    >>> from nvalchemi.models import PaiNN
    >>> atoms = bulk("Cu", "fcc", a=3.6) * (2, 2, 2)
    >>> atoms.calc = NvalchemiCalculator(PaiNN(elements=[29], hidden_channels=8))
    >>> atoms.get_forces().shape
    (8, 3)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from nvalchemi import checkpoint_files
from nvalchemi.models.committee import SPREAD_NAMES
from nvalchemi.models.export import Potential, check_head, neighbor_inputs, quiet_torchscript

__all__ = ["NvalchemiCalculator"]


# The keyword arguments of ase.calculators.calculator.Calculator.__init__; ASE would
# keep any other keyword as a "parameter" that nothing here reads.
_ASE_KEYWORDS = ("restart", "ignore_bad_restart_file", "label", "atoms", "directory")
_PROPERTIES = ("energy", "free_energy", "forces", "stress")


def _check_ase_keywords(kwargs: dict[str, Any], where: str) -> None:
    unknown = sorted(set(kwargs) - set(_ASE_KEYWORDS))
    if unknown:
        raise TypeError(
            f"{where}() got unexpected keyword argument(s) {unknown}; it accepts its own "
            f"arguments and the ASE Calculator options {list(_ASE_KEYWORDS)}."
        )


class NvalchemiCalculator(Calculator):
    """ASE calculator around an nvalchemi model or anything that follows the export contract.

    Args:
        model: an ``nn.Module`` + ``BaseModelMixin`` model (run through
            :class:`~nvalchemi.models.export.Potential`: in eval mode, its own mode
            restored after every call; when ``device`` or ``dtype`` differ from the
            model's, the calculator works on a copy), or a module that follows the
            export contract, such as an exported file loaded with ``torch.jit.load``
            (see :meth:`from_export`).
        device: where to run (default: the model's device).
        dtype: run in this dtype (default: the model's dtype; models only).
        head: the readout head of a multi-head model (a name from
            ``model.head_names``); default: the model's first head (models only: an
            export holds the head it was exported with).
        **kwargs: ASE ``Calculator`` options (``restart``, ``ignore_bad_restart_file``,
            ``label``, ``atoms``, ``directory``); anything else raises ``TypeError``
            (the model has no calculator parameters that ASE could store).

    Attributes:
        model: the nvalchemi model (``None`` for an export or other contract module).
        potential: what every call runs (a ``Potential`` or the contract module).

    Raises:
        PropertyNotImplementedError: stress of a non-periodic system or of a periodic
            one whose cell has zero volume (give it a full cell, e.g.
            ``atoms.center(vacuum=10.0, axis=2)``), or a property the model cannot
            compute.
    """

    implemented_properties = list(_PROPERTIES)

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        head: str | None = None,
        **kwargs: Any,
    ) -> None:
        _check_ase_keywords(kwargs, "NvalchemiCalculator")
        if not hasattr(model, "model_config"):  # an export, or another contract module
            if head is not None or dtype is not None:
                raise TypeError(
                    "head= and dtype= choose how an nvalchemi model runs; an exported "
                    "model has the head and dtype it was exported with (export again "
                    "to change them)."
                )
            super().__init__(**kwargs)
            self.head, self.model, self.potential = None, None, model
            self.device = torch.device(device) if device is not None else _device_of(model)
            if int(getattr(model, "committee_size", 1)) > 1:  # an exported committee
                self.implemented_properties = [*_PROPERTIES, *SPREAD_NAMES]
            return
        check_head(model, head)
        self.head = head
        super().__init__(**kwargs)
        current_device = _device_of(model)
        first = next(iter(model.parameters()), None)
        current_dtype = first.dtype if first is not None else None
        self.device = torch.device(device) if device is not None else current_device
        if self.device != current_device or (dtype is not None and dtype != current_dtype):
            model = copy.deepcopy(model).to(device=self.device, dtype=dtype)
        self.model = model
        self.potential = Potential(model, head)
        outputs = set(model.model_config.outputs) | {"free_energy"}
        self.implemented_properties = [p for p in (*_PROPERTIES, *SPREAD_NAMES) if p in outputs]

    @classmethod
    def from_export(
        cls, path: str | Path, *, device: str | torch.device = "cpu", **kwargs: Any
    ) -> NvalchemiCalculator:
        """Load a file written by ``nvalchemi-training export`` (or ``export_model``).

        Needs torch only to run the model; neighbours are built here as for any model.

        Args:
            path: the exported ``.pt`` file.
            device: where to load and run it (``map_location``).
            **kwargs: ASE ``Calculator`` options (``label``, ``directory``, ...).

        Example:
            >>> atoms.calc = NvalchemiCalculator.from_export("potential.pt")  # doctest: +SKIP
        """
        _check_ase_keywords(kwargs, "NvalchemiCalculator.from_export")
        with quiet_torchscript():
            module = torch.jit.load(str(path), map_location=device)
        return cls(module, device=device, **kwargs)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        model_key: str = "main",
        checkpoint_index: int | str = "latest",
        use_ema: bool = True,
        trust: bool = False,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        head: str | None = None,
        **kwargs: Any,
    ) -> NvalchemiCalculator:
        """Build from a training checkpoint directory (the weights of model ``model_key``).

        Args:
            path: the checkpoint root folder (``.../checkpoints``).
            model_key: which saved model.
            checkpoint_index: which checkpoint: ``"latest"`` (default), ``"best"``,
                ``-1`` (latest) or a checkpoint number ``N >= 0``.
            use_ema: load the EMA (averaged) weights when the checkpoint has them,
                else the trained weights.
            trust: allow model spec paths outside the import allow-list (only for
                checkpoints you trust).
            device: where to load and run the model (``map_location``).
            dtype: run in this dtype (default: the saved model's).
            head: the readout head of a multi-head model (default: its first).
            **kwargs: ASE ``Calculator`` options (``label``, ``directory``, ...).

        Raises:
            TypeError: an unknown keyword argument.

        Example:
            >>> calc = NvalchemiCalculator.from_checkpoint(
            ...     "runs/x/checkpoints", checkpoint_index=0, use_ema=False)  # doctest: +SKIP
        """
        _check_ase_keywords(kwargs, "NvalchemiCalculator.from_checkpoint")
        model = checkpoint_files.load_model_from_checkpoint(
            path,
            map_location=device,
            model_key=model_key,
            use_ema=use_ema,
            checkpoint_index=checkpoint_index,
            trust=trust,
        )
        return cls(model, device=device, dtype=dtype, head=head, **kwargs)

    def _inputs(self, atoms: Any) -> dict[str, torch.Tensor]:
        """The export contract's inputs of ``atoms`` (float64, on the calculator's device)."""
        numbers = np.asarray(atoms.numbers)
        known = getattr(self.potential, "atomic_numbers", None)
        if known:
            unknown = sorted(set(numbers.tolist()) - set(known))
            if unknown:
                from ase.data import chemical_symbols

                names = ", ".join(f"{chemical_symbols[z]} (Z={z})" for z in unknown)
                raise ValueError(
                    f"NvalchemiCalculator: the model knows the elements {sorted(known)} "
                    f"and cannot handle {names}."
                )
        inputs = {
            "positions": torch.as_tensor(np.asarray(atoms.positions), dtype=torch.float64),
            "atomic_numbers": torch.as_tensor(numbers, dtype=torch.long),
            "cell": torch.as_tensor(np.asarray(atoms.cell.array), dtype=torch.float64),
            "pbc": torch.as_tensor(np.asarray(atoms.pbc, dtype=bool)),
        }
        cutoff = float(self.potential.cutoff)
        if cutoff > 0:
            from nvalchemi.data.neighbors import check_neighbor_explosion

            check_neighbor_explosion(atoms, cutoff, where="NvalchemiCalculator")
            inputs.update(neighbor_inputs(**inputs, cutoff=cutoff))
        else:  # a model without neighbours
            inputs["edge_index"] = torch.zeros(2, 0, dtype=torch.long)
            inputs["shifts"] = torch.zeros(0, 3, dtype=torch.float64)
        return {key: value.to(self.device) for key, value in inputs.items()}

    def calculate(
        self,
        atoms: Any = None,
        properties: list[str] | tuple[str, ...] = ("energy",),
        system_changes: list[str] = all_changes,
    ) -> None:
        super().calculate(atoms, properties, system_changes)
        pbc = np.asarray(self.atoms.pbc, dtype=bool)
        periodic = bool(pbc.any())
        # ASE allows a zero cell vector along a non-periodic direction (a slab from
        # fcc111(..., vacuum=None)); stress divides by the volume, so it has none.
        has_volume = abs(float(np.linalg.det(self.atoms.cell.array))) > 1e-12
        if "stress" in properties:
            if not periodic:
                raise PropertyNotImplementedError("stress is only defined for periodic systems.")
            if not has_volume:
                raise PropertyNotImplementedError(
                    f"stress needs the cell volume, but this periodic system (pbc={pbc.tolist()}) "
                    "has a zero-volume cell (a zero cell vector along a non-periodic "
                    "direction). Give it a full cell, e.g. atoms.center(vacuum=10.0, axis=2) "
                    "for a slab."
                )
        inputs = self._inputs(self.atoms)
        # On the CPU, TorchScript's profiling optimizations (an export) cost ~10 % per MD
        # step and gain nothing; on accelerators they may fuse kernels.
        with torch.jit.optimized_execution(self.device.type != "cpu"):
            out = self.potential(inputs)
        energy = float(out["energy"].detach().double().sum().cpu())
        self.results = {"energy": energy, "free_energy": energy}
        if out.get("forces") is not None:
            self.results["forces"] = out["forces"].detach().double().cpu().numpy()
        if periodic and has_volume and out.get("stress") is not None:
            stress = out["stress"].detach().double().cpu().numpy().reshape(3, 3)
            self.results["stress"] = full_3x3_to_voigt_6_stress(stress)
        self._spread_results(out, periodic and has_volume)

    def _spread_results(self, out: dict[str, Any], with_stress: bool) -> None:
        """A committee's spread (any contract module that returns it) into the results."""
        for name in SPREAD_NAMES:
            value = out.get(name)
            if value is None or (name == "stress_std" and not with_stress):
                continue
            value = value.detach().double().cpu().numpy()
            if name == "forces_std":
                self.results[name] = value.reshape(-1, 3)
            elif name == "stress_std":
                self.results[name] = full_3x3_to_voigt_6_stress(value.reshape(3, 3))
            else:
                self.results[name] = float(value.reshape(-1)[0])


def _device_of(module: torch.nn.Module) -> torch.device:
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")
