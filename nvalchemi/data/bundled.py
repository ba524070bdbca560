"""The bundled EMT data set: paths, loading, a summary, and regeneration.

About 3000 small fcc-metal structures (Al, Cu, Ni, Pd, Ag, Pt, Au and binary
alloys) labelled with ASE's EMT calculator, split 80/10/10 into
``train``/``val``/``test`` extxyz files under :data:`BUNDLED_DIR`. Labels:
energy (eV), forces (eV/Å) and stress (eV/Å³, ASE sign convention; absent for
the open-boundary clusters). ``atoms.info["config_type"]`` names the structure
family. See :mod:`nvalchemi.data.emt_generator` for how it is made.

Example::

    from nvalchemi.data.bundled import load_bundled_atoms, bundled_split_path
    train = load_bundled_atoms("train")
    train[0].get_potential_energy(), train[0].get_forces().shape
    path = bundled_split_path("val")  # for readers that take a file
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from nvalchemi.data import emt_generator

if TYPE_CHECKING:
    from ase import Atoms

Split = Literal["train", "val", "test"]
BUNDLED_DIR = Path(__file__).resolve().with_name("bundled")
SPLITS: tuple[str, ...] = emt_generator.SPLITS


def bundled_split_path(split: Split, directory: str | Path | None = None) -> Path:
    """Path of the extxyz file of ``split`` (in :data:`BUNDLED_DIR` unless ``directory``)."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; expected one of {list(SPLITS)}.")
    path = Path(directory or BUNDLED_DIR) / emt_generator.split_filename(split)
    if not path.is_file():
        raise FileNotFoundError(
            f"Bundled data file {path} is missing. Recreate it with "
            f"nvalchemi.data.bundled.regenerate({str(path.parent)!r}) or "
            f"`python scripts/generate_emt_dataset.py --out {path.parent}`."
        )
    return path


def load_bundled_atoms(split: Split, directory: str | Path | None = None) -> list[Atoms]:
    """All structures of ``split`` as ``ase.Atoms`` with their EMT labels attached."""
    from ase.io import read

    return list(read(bundled_split_path(split, directory), index=":", format="extxyz"))


def bundled_summary(directory: str | Path | None = None) -> dict:
    """Counts and label statistics of the bundled data set (reads all three files).

    Returns a dict with ``directory``, ``num_structures``, ``splits`` (per split:
    ``structures``, ``atoms``, ``file_bytes``), ``families`` (family -> split ->
    count), ``elements``, ``num_atoms_range``, ``labels`` (label -> number of
    structures that carry it), ``energy_per_atom_range`` (eV) and ``max_force``
    (largest per-atom force norm, eV/Å).
    """
    import numpy as np

    splits: dict[str, dict] = {}
    families: dict[str, dict[str, int]] = {}
    labels = {"energy": 0, "forces": 0, "stress": 0}
    elements: set[str] = set()
    sizes: list[int] = []
    energies_per_atom: list[float] = []
    max_force = 0.0
    for split in SPLITS:
        path = bundled_split_path(split, directory)
        structures = load_bundled_atoms(split, directory)
        splits[split] = {
            "structures": len(structures),
            "atoms": sum(len(a) for a in structures),
            "file_bytes": path.stat().st_size,
        }
        for atoms in structures:
            family = families.setdefault(atoms.info.get("config_type", "unknown"), {})
            family[split] = family.get(split, 0) + 1
            results = atoms.calc.results if atoms.calc is not None else {}
            for key in labels:
                labels[key] += key in results
            elements.update(atoms.get_chemical_symbols())
            sizes.append(len(atoms))
            if "energy" in results:
                energies_per_atom.append(float(results["energy"]) / len(atoms))
            if "forces" in results:
                max_force = max(max_force, float(np.linalg.norm(results["forces"], axis=1).max()))
    return {
        "directory": str(Path(directory or BUNDLED_DIR)),
        "num_structures": sum(s["structures"] for s in splits.values()),
        "splits": splits,
        "families": {f: {s: c.get(s, 0) for s in SPLITS} for f, c in sorted(families.items())},
        "elements": sorted(elements),
        "num_atoms_range": (min(sizes), max(sizes)) if sizes else (0, 0),
        "labels": labels,
        "energy_per_atom_range": (
            (min(energies_per_atom), max(energies_per_atom)) if energies_per_atom else None
        ),
        "max_force": max_force,
    }


def regenerate(
    out_dir: str | Path,
    num_structures: int = emt_generator.DEFAULT_NUM_STRUCTURES,
    seed: int = emt_generator.DEFAULT_SEED,
    progress: emt_generator.ProgressFn | None = print,
) -> dict[str, Path]:
    """Rebuild the data set into ``out_dir`` (the defaults reproduce the shipped files).

    Takes about 20-30 s on two CPU cores; returns ``{split: path}``.
    """
    return emt_generator.write_dataset(out_dir, num_structures, seed, progress=progress)
