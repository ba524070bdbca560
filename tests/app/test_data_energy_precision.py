"""Large total energies survive a store exactly; rounding them to float32 for a batch warns.

A total energy of -4.6e5 eV lies where float32 numbers are 0.03 eV apart. Stores written by
``data convert`` keep total energies (and virials) in float64; readers hand out labels in the
positions' dtype (what a float32 model's loss needs) and warn once when that costs more
than 0.1 meV/atom.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from ase.io import read, write

from nvalchemi.data.io.ase import ASEReader
from nvalchemi.data.io.zarr import AtomicDataZarrReader
from nvalchemi.data.sources import make_dataset, make_loader, open_reader

from ._support import TINY_PAINN, VAL, invoke

SHIFT = -460000.0137  # eV: float32 rounds it to -460000.0 (13.7 meV off)


@pytest.fixture
def heavy(tmp_path):
    """Eight structures with total energies near -4.6e5 eV, as an extxyz and a store."""
    frames = read(VAL, index=":8")
    for atoms in frames:
        atoms.calc.results["energy"] += SHIFT
        atoms.calc.results["free_energy"] = atoms.calc.results["energy"]
    source = tmp_path / "heavy.extxyz"
    write(source, frames, format="extxyz")
    store = tmp_path / "heavy.zarr"
    assert invoke("data", "convert", source, store).exit_code == 0
    exact = np.array([a.get_potential_energy() for a in read(source, index=":")])
    assert np.abs(exact - exact.astype(np.float32)).max() > 1e-3  # float32 would lose them
    return source, store, exact, np.array([len(a) for a in frames])


def test_the_store_keeps_total_energies_exact(heavy):
    source, store, exact, atoms = heavy
    reader = AtomicDataZarrReader(str(store))
    samples = [reader.read(i)[0] for i in range(len(reader))]
    assert samples[0]["energy"].dtype == torch.float64
    for key in ("positions", "forces", "stress"):  # 7 digits are plenty: the bulk stays small
        assert samples[0][key].dtype == torch.float32
    energies = np.array([float(s["energy"]) for s in samples])
    assert np.array_equal(energies, exact)
    stress = read(source, index="0").get_stress(voigt=False)
    assert np.allclose(samples[0]["stress"].numpy()[0], stress, rtol=1e-6, atol=0)
    result = invoke("data", "stats", store, "--json")
    assert result.exit_code == 0, result.stderr
    per_atom = json.loads(result.stdout)["energy_per_atom"]
    assert per_atom["min"] == pytest.approx((exact / atoms).min(), abs=1e-9)


def test_reading_labels_as_float32_warns_once_naming_the_structure(heavy):
    source, store, exact, atoms = heavy
    for reader in (open_reader(store), ASEReader(source)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            energies = [reader.read(i)[0]["energy"] for i in range(len(reader))]
        assert all(e.dtype == torch.float32 for e in energies)
        texts = [str(w.message) for w in caught if "meV/atom" in str(w.message)]
        assert len(texts) == 1, texts  # once per source, not once per structure
        loss = np.abs(exact - exact.astype(np.float32)) / atoms * 1000  # meV/atom
        first = int(np.flatnonzero(loss > 0.1)[0])  # the first structure read that loses more
        assert f"structure {first}:" in texts[0] or f"frame {first}:" in texts[0], texts[0]
        assert f"loses {loss[first]:.2g} meV/atom" in texts[0]
        assert "float64" in texts[0] and "prediction_to_target" in texts[0]
    quiet = open_reader(VAL, max_structures=4)  # small energies: rounding costs nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        [quiet.read(i) for i in range(len(quiet))]


def test_a_float32_painn_trains_on_the_store_with_the_default_strict_loss(heavy):
    from nvalchemi.models import PaiNN
    from nvalchemi.training import (
        ComposedLossFunction,
        EnergyMSELoss,
        ForceMSELoss,
        OptimizerConfig,
        StressMSELoss,
        TrainingStrategy,
    )

    _, store, _, _ = heavy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rounding warning, pinned above
        reader = open_reader(store)
        model = PaiNN(
            elements=[13, 28, 29, 46, 47, 78, 79],
            active_outputs=("energy", "forces", "stress"),
            **TINY_PAINN,
        )
        loader = make_loader(
            make_dataset([reader], neighbor_config=model.model_config.neighbor_config), batch_size=4
        )
        batch = next(iter(loader))
        assert batch.energy.dtype == batch.positions.dtype == torch.float32
        loss = ComposedLossFunction([EnergyMSELoss(), ForceMSELoss(), StressMSELoss()])
        strategy = TrainingStrategy(
            models=model,
            optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
            loss_fn=loss,
            num_steps=1,
        )
        strategy.run(loader)
    assert strategy.step_count == 1
