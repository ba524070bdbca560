"""``NvalchemiCalculator``: any nvalchemi model (or training checkpoint) as an ASE calculator.

Computes ``energy``, ``free_energy`` (equal to the energy), ``forces`` and, for
periodic systems, ``stress`` (Voigt, eV/Å³, ASE's sign). Neighbour lists are built
for every call from the model's ``neighbor_config``; results are cached by ASE's
contract (recomputed only when positions, numbers, cell or pbc change).

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
from nvalchemi.data.atomic_data import AtomicData

__all__ = ["NvalchemiCalculator"]


# The keyword arguments of ase.calculators.calculator.Calculator.__init__; ASE would
# keep any other keyword as a "parameter" that nothing here reads.
_ASE_KEYWORDS = ("restart", "ignore_bad_restart_file", "label", "atoms", "directory")


def _check_ase_keywords(kwargs: dict[str, Any], where: str) -> None:
    unknown = sorted(set(kwargs) - set(_ASE_KEYWORDS))
    if unknown:
        raise TypeError(
            f"{where}() got unexpected keyword argument(s) {unknown}; it accepts its own "
            f"arguments and the ASE Calculator options {list(_ASE_KEYWORDS)}."
        )


def _check_head(model: Any, head: str | None) -> None:
    if head is None:
        return
    names = getattr(model, "head_names", None)
    if names is None:
        raise ValueError(
            f"head={head!r}: {type(model).__name__} has no readout heads to choose from; "
            "drop head= (or use a multi-head model such as PaiNN(heads=[...]))."
        )
    if head not in names:
        raise ValueError(f"head={head!r} is not a head of this model; its heads are {list(names)}.")


class NvalchemiCalculator(Calculator):
    """ASE calculator around an nvalchemi model.

    Args:
        model: an ``nn.Module`` + ``BaseModelMixin`` model. It is run in eval mode
            (its own mode is restored after every call); when ``device`` or ``dtype``
            differ from the model's, the calculator works on a copy.
        device: where to run (default: the model's device).
        dtype: run in this dtype (default: the model's dtype).
        head: the readout head of a multi-head model (a name from
            ``model.head_names``); default: the model's first head.
        **kwargs: ASE ``Calculator`` options (``restart``, ``ignore_bad_restart_file``,
            ``label``, ``atoms``, ``directory``); anything else raises ``TypeError``
            (the model has no calculator parameters that ASE could store).

    Raises:
        PropertyNotImplementedError: stress of a non-periodic system or of a periodic
            one whose cell has zero volume (give it a full cell, e.g.
            ``atoms.center(vacuum=10.0, axis=2)``), or a property the model cannot
            compute.
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress"]

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
        _check_head(model, head)
        self.head = head
        super().__init__(**kwargs)
        first = next(iter(model.parameters()), None)
        current_device = first.device if first is not None else torch.device("cpu")
        current_dtype = first.dtype if first is not None else None
        self.device = torch.device(device) if device is not None else current_device
        if self.device != current_device or (dtype is not None and dtype != current_dtype):
            model = copy.deepcopy(model).to(device=self.device, dtype=dtype)
        self.model = model
        outputs = set(model.model_config.outputs)
        self.implemented_properties = [
            p
            for p in ("energy", "free_energy", "forces", "stress")
            if p in outputs | {"free_energy"}
        ]

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

    @property
    def model_dtype(self) -> torch.dtype:
        dtype = getattr(self.model, "dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
        return next(p.dtype for p in self.model.parameters() if p.dtype.is_floating_point)

    def _to_data(self, atoms: Any) -> AtomicData:
        numbers = torch.as_tensor(atoms.numbers, dtype=torch.long)
        positions = torch.as_tensor(np.asarray(atoms.positions), dtype=self.model_dtype)
        fields: dict[str, Any] = {"atomic_numbers": numbers, "positions": positions}
        pbc = np.asarray(atoms.pbc, dtype=bool)
        cell = np.asarray(atoms.cell.array, dtype=float)
        if pbc.any():
            fields["cell"] = torch.as_tensor(cell, dtype=self.model_dtype).unsqueeze(0)
            fields["pbc"] = torch.as_tensor(pbc).unsqueeze(0)
        config = self.model.model_config.neighbor_config
        if config is not None:
            from nvalchemi.data.neighbors import check_neighbor_explosion, neighbor_list_for_system

            check_neighbor_explosion(atoms, config.cutoff, where="NvalchemiCalculator")
            pairs, shifts = neighbor_list_for_system(
                atoms.positions,
                cell if pbc.any() else None,
                pbc if pbc.any() else None,
                config.cutoff,
                full_list=not config.half_list,
            )
            fields["neighbor_list"] = torch.from_numpy(pairs)
            fields["neighbor_list_shifts"] = torch.from_numpy(shifts)
        return AtomicData(**fields).to(self.device)

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
        wanted = {"energy", "forces"} & set(self.model.model_config.outputs)
        if periodic and has_volume and "stress" in self.model.model_config.outputs:
            wanted.add("stress")
        config = self.model.model_config
        previous, was_training = config.active_outputs, self.model.training
        config.active_outputs = wanted
        self.model.eval()
        try:
            with torch.no_grad():
                data = self._to_data(self.atoms)
                out = self.model(data) if self.head is None else self.model(data, head=self.head)
        finally:
            config.active_outputs = previous
            self.model.train(was_training)
        energy = float(out["energy"].detach().double().sum().cpu())
        self.results = {"energy": energy, "free_energy": energy}
        if out.get("forces") is not None:
            self.results["forces"] = out["forces"].detach().double().cpu().numpy()
        if out.get("stress") is not None:
            stress = out["stress"].detach().double().cpu().numpy().reshape(3, 3)
            self.results["stress"] = full_3x3_to_voigt_6_stress(stress)
