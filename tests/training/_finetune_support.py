"""Small labelled Cu/Au structures and PaiNN models for the fine-tuning tests."""

from __future__ import annotations

import numpy as np
import torch

from nvalchemi.data import AtomicData
from nvalchemi.models import PaiNN

CU, AU, AG = 29, 79, 47
CUTOFF = 4.0
SMALL = {"cutoff": CUTOFF, "hidden_channels": 8, "num_interactions": 1, "num_rbf": 6}


def structures(count: int = 8, seed: int = 0, elements=(CU, AU), dtype=torch.float64):
    """Rattled 4-atom fcc cells of varying composition with EMT labels (periodic)."""
    from ase.build import bulk
    from ase.calculators.emt import EMT

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        atoms = bulk("Cu", "fcc", a=3.7) * (2, 2, 1)
        atoms.numbers = rng.choice(list(elements), size=len(atoms))
        atoms.numbers[i % len(atoms)] = elements[i % len(elements)]  # every element appears
        atoms.rattle(0.05, seed=int(rng.integers(1 << 30)))
        atoms.calc = EMT()
        atoms.get_potential_energy()
        out.append(AtomicData.from_atoms(atoms, dtype=dtype))
    return out


def painn(seed: int = 0, elements=(CU, AU, AG), atomic_energies=None, **kwargs) -> PaiNN:
    torch.manual_seed(seed)
    energies = {CU: -3.5, AU: -3.0} if atomic_energies is None else atomic_energies
    return PaiNN(
        elements=list(elements),
        atomic_energies=energies,
        scale=0.4,
        dtype=torch.float64,
        **{**SMALL, **kwargs},
    )


def predicted_energies(model, data, head=None) -> list[float]:
    """The model's energy of every structure (eval, no grad)."""
    from nvalchemi.data import Batch
    from nvalchemi.data.neighbors import compute_neighbors

    batch = Batch.from_data_list(list(data))
    compute_neighbors(batch, config=model.model_config.neighbor_config)
    previous = model.model_config.active_outputs
    model.model_config.active_outputs = {"energy"}
    try:
        with torch.no_grad():
            out = model(batch, head=head)
    finally:
        model.model_config.active_outputs = previous
    return out["energy"].reshape(-1).tolist()


def relabelled(model, data, offsets, head=None):
    """Copies of ``data`` whose energy is the model's plus ``sum_Z count_Z * offsets[Z]``."""
    out = []
    for item, energy in zip(data, predicted_energies(model, data, head)):
        item = item.clone()
        shift = sum(v * int((item.atomic_numbers == z).sum()) for z, v in offsets.items())
        item["energy"] = torch.tensor([energy + shift], dtype=torch.float64)
        out.append(item)
    return out
