"""Deterministic generator for the bundled EMT data set.

Builds small fcc metal structures (Al, Cu, Ni, Pd, Ag, Pt, Au and a few binary
alloys), labels them with ASE's EMT calculator and writes fixed
train/validation/test splits as extended XYZ files.

Families (``atoms.info["config_type"]``):

* ``bulk``: pure fcc supercells (primitive or conventional), lightly rattled.
* ``alloy``: random binary substitutional alloys, rattled.
* ``strain_iso``: isotropic strain of up to 4 %, rattled.
* ``strain_shear``: general symmetric strain (triclinic cells), rattled.
* ``rattle``: thermal-like Gaussian displacements at several amplitudes.
* ``surface_100`` / ``surface_111``: slabs with 6 Å of vacuum on each side,
  periodic in-plane (``pbc = (T, T, F)``) or fully periodic.
* ``vacancy``: supercells with one or two atoms removed, rattled.
* ``cluster``: small open-boundary clusters (``pbc`` False, no cell, no stress).

Every structure is drawn from its own random stream seeded by
``(seed, family, index)``, so structure ``rattle-0007`` is the same whatever the
total size of the set, and two runs with the same arguments write identical
bytes. Labels: ``energy`` (eV), ``forces`` (eV/Å) and, for periodic cells,
``stress`` (eV/Å³, ASE sign convention: positive = tensile), attached through a
``SinglePointCalculator`` so ``ase.io.read`` returns them.

Files are plain extxyz (about 7 MB for the default 3000 structures). ASE can read
``.extxyz.gz`` directly, but its extxyz reader seeks backwards, which in a gzip
stream means decompressing again from the start: reading 2400 frames took 77 s
instead of 0.8 s, and lazy by-index readers would suffer the same.

EMT's cutoff is global (smooth step at 5.38 Å, neighbour search to 5.88 Å), so a
model needs a cutoff of about 5.5-6 Å to see everything that shapes the labels.

Example::

    from nvalchemi.data.emt_generator import write_dataset
    paths = write_dataset("/tmp/emt", num_structures=60)
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nvalchemi._fileio import write_atomic

if TYPE_CHECKING:
    from ase import Atoms

DEFAULT_NUM_STRUCTURES = 3000
DEFAULT_SEED = 20240611
SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = {"train": 0.8, "val": 0.1, "test": 0.1}

ELEMENTS = ("Al", "Cu", "Ni", "Pd", "Ag", "Pt", "Au")
# Binary alloys: every element appears in at least one pair.
ALLOY_PAIRS = (
    ("Cu", "Au"),
    ("Cu", "Ni"),
    ("Ag", "Au"),
    ("Pd", "Pt"),
    ("Cu", "Pd"),
    ("Ni", "Pt"),
    ("Al", "Ag"),
)

# Share of the data set per family (sums to 1).
FAMILY_FRACTIONS = {
    "bulk": 0.12,
    "alloy": 0.14,
    "strain_iso": 0.10,
    "strain_shear": 0.12,
    "rattle": 0.16,
    "surface_100": 0.09,
    "surface_111": 0.09,
    "vacancy": 0.12,
    "cluster": 0.06,
}
FAMILIES = tuple(FAMILY_FRACTIONS)

# Gaussian displacement standard deviations (Å, per Cartesian component).
RATTLE_AMPLITUDES = (0.02, 0.04, 0.06, 0.08)
# Structures whose largest force exceeds this (eV/Å) are redrawn: keeps labels physical.
MAX_FORCE = 6.0
SLAB_VACUUM = 6.0  # Å on each side of a slab
POSITION_DECIMALS = 6  # positions and cells are rounded before labelling (labels stay exact)
FORCE_DECIMALS = 6
ENERGY_DECIMALS = 8  # eV; shortens the extxyz header without losing anything a model can see
STRESS_DECIMALS = 9  # eV/Å³ (1e-9 eV/Å³ is 0.16 Pa)

# (repetitions, weight) for the 1-atom primitive and 4-atom conventional fcc cells.
# Mostly 4-36 atoms (mean about 18) so the uncompressed files stay small; a few up to 128.
PRIMITIVE_REPEATS = (
    ((2, 2, 1), 2.0),
    ((2, 2, 2), 3.0),
    ((2, 2, 3), 3.0),
    ((3, 3, 2), 2.0),
    ((3, 3, 3), 1.5),
    ((3, 3, 4), 0.7),
    ((4, 4, 4), 0.3),
)
CONVENTIONAL_REPEATS = (
    ((1, 1, 1), 2.0),
    ((1, 1, 2), 3.0),
    ((2, 2, 1), 3.0),
    ((2, 2, 2), 1.5),
    ((2, 2, 3), 0.5),
    ((3, 3, 2), 0.25),
    ((3, 3, 3), 0.12),
    ((2, 4, 4), 0.08),
)

ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class _Material:
    """One element, or a binary alloy with a target fraction of ``minor``."""

    major: str
    minor: str | None = None
    fraction: float = 0.0

    @property
    def name(self) -> str:
        """``"Cu"`` for an element, ``"Au-Cu"`` (sorted) for an alloy."""
        return self.major if self.minor is None else "-".join(sorted((self.major, self.minor)))


_LATTICE_CACHE: dict[str, float] = {}


def emt_lattice_constant(symbol: str) -> float:
    """Zero-pressure fcc lattice constant (Å) of ``symbol`` under EMT, found by bisection."""
    if symbol not in _LATTICE_CACHE:
        from ase.build import bulk
        from ase.calculators.emt import EMT

        low, high = 3.0, 4.6
        for _ in range(28):  # bracket of 1.6 Å down to 1e-8 Å
            mid = 0.5 * (low + high)
            atoms = bulk(symbol, "fcc", a=mid)
            atoms.calc = EMT()
            pressure = -float(np.mean(atoms.get_stress()[:3]))
            low, high = (mid, high) if pressure > 0 else (low, mid)
        _LATTICE_CACHE[symbol] = round(0.5 * (low + high), 6)
    return _LATTICE_CACHE[symbol]


def structure_hash(atoms: Atoms, decimals: int = 4) -> str:
    """Hash of species, rounded positions, cell and pbc: equal for identical structures."""
    digest = hashlib.sha1()
    digest.update(np.asarray(atoms.numbers, dtype=np.int64).tobytes())
    digest.update(np.round(atoms.positions, decimals).astype(np.float64).tobytes())
    digest.update(np.round(np.asarray(atoms.cell), decimals).astype(np.float64).tobytes())
    digest.update(np.asarray(atoms.pbc, dtype=bool).tobytes())
    return digest.hexdigest()


def family_counts(num_structures: int) -> dict[str, int]:
    """Number of structures per family for a data set of ``num_structures`` (largest remainder)."""
    if num_structures < len(FAMILIES):
        raise ValueError(
            f"num_structures={num_structures} is too small: need at least {len(FAMILIES)} "
            "(one per family)."
        )
    exact = {f: FAMILY_FRACTIONS[f] * num_structures for f in FAMILIES}
    counts = {f: max(1, math.floor(x)) for f, x in exact.items()}
    by_remainder = sorted(FAMILIES, key=lambda f: (counts[f] - exact[f], FAMILIES.index(f)))
    i = 0
    while sum(counts.values()) < num_structures:
        counts[by_remainder[i % len(FAMILIES)]] += 1
        i += 1
    while sum(counts.values()) > num_structures:
        largest = max(FAMILIES, key=lambda f: counts[f])
        counts[largest] -= 1
    return counts


# --------------------------------------------------------------------------- builders


def _choose(rng: np.random.Generator, options: tuple) -> object:
    return options[int(rng.integers(len(options)))]


def _weighted(rng: np.random.Generator, options: tuple) -> object:
    weights = np.array([w for _, w in options], dtype=float)
    return options[int(rng.choice(len(options), p=weights / weights.sum()))][0]


def _pick_material(rng: np.random.Generator, alloy_probability: float) -> _Material:
    if rng.random() < alloy_probability:
        first, second = _choose(rng, ALLOY_PAIRS)
        if rng.random() < 0.5:
            first, second = second, first
        return _Material(first, second, float(rng.uniform(0.05, 0.5)))
    return _Material(_choose(rng, ELEMENTS))


def _lattice_constant(material: _Material) -> float:
    a = emt_lattice_constant(material.major)
    if material.minor is None:
        return a
    # Vegard's law.
    return (1 - material.fraction) * a + material.fraction * emt_lattice_constant(material.minor)


def _substitute(atoms: Atoms, material: _Material, rng: np.random.Generator) -> None:
    """Replace a random ``fraction`` of the atoms (at least one) by ``material.minor``."""
    if material.minor is None:
        return
    count = max(1, round(material.fraction * len(atoms)))
    count = min(count, len(atoms) - 1) if len(atoms) > 1 else 1
    chosen = rng.choice(len(atoms), size=count, replace=False)
    symbols = atoms.get_chemical_symbols()
    for i in chosen:
        symbols[int(i)] = material.minor
    atoms.set_chemical_symbols(symbols)


def _rattle(atoms: Atoms, rng: np.random.Generator, sigma: float) -> None:
    atoms.positions = atoms.positions + rng.normal(0.0, sigma, size=atoms.positions.shape)


def _fcc_supercell(material: _Material, rng: np.random.Generator) -> Atoms:
    from ase.build import bulk

    a = _lattice_constant(material)
    if rng.random() < 0.5:
        atoms = bulk(material.major, "fcc", a=a) * _weighted(rng, PRIMITIVE_REPEATS)
    else:
        atoms = bulk(material.major, "fcc", a=a, cubic=True) * _weighted(rng, CONVENTIONAL_REPEATS)
    _substitute(atoms, material, rng)
    return atoms


def _strain(atoms: Atoms, epsilon: np.ndarray) -> None:
    """Apply the symmetric strain ``epsilon`` (cell rows are lattice vectors)."""
    deformation = np.eye(3) + epsilon
    atoms.set_cell(np.asarray(atoms.cell) @ deformation, scale_atoms=True)


def _build_bulk(rng: np.random.Generator) -> tuple[Atoms, dict]:
    material = _pick_material(rng, alloy_probability=0.0)
    atoms = _fcc_supercell(material, rng)
    sigma = float(rng.uniform(0.005, 0.03))
    _strain(atoms, np.eye(3) * rng.uniform(-0.005, 0.005))
    _rattle(atoms, rng, sigma)
    return atoms, {"material": material.name, "rattle": sigma}


def _build_alloy(rng: np.random.Generator) -> tuple[Atoms, dict]:
    material = _pick_material(rng, alloy_probability=1.0)
    atoms = _fcc_supercell(material, rng)
    sigma = float(_choose(rng, RATTLE_AMPLITUDES[:3]))
    _rattle(atoms, rng, sigma)
    return atoms, {"material": material.name, "rattle": sigma}


def _build_strain_iso(rng: np.random.Generator) -> tuple[Atoms, dict]:
    material = _pick_material(rng, alloy_probability=0.3)
    atoms = _fcc_supercell(material, rng)
    scale = float(rng.uniform(-0.04, 0.04))
    _strain(atoms, np.eye(3) * scale)
    sigma = float(_choose(rng, RATTLE_AMPLITUDES[:3]))
    _rattle(atoms, rng, sigma)
    return atoms, {"material": material.name, "rattle": sigma, "strain": scale}


def _build_strain_shear(rng: np.random.Generator) -> tuple[Atoms, dict]:
    material = _pick_material(rng, alloy_probability=0.3)
    atoms = _fcc_supercell(material, rng)
    epsilon = np.diag(rng.uniform(-0.03, 0.03, size=3))
    off_diagonal = rng.uniform(-0.05, 0.05, size=3)
    for value, (i, j) in zip(off_diagonal, ((0, 1), (0, 2), (1, 2))):
        epsilon[i, j] = epsilon[j, i] = value
    _strain(atoms, epsilon)
    sigma = float(_choose(rng, RATTLE_AMPLITUDES[:3]))
    _rattle(atoms, rng, sigma)
    return atoms, {"material": material.name, "rattle": sigma}


def _build_rattle(rng: np.random.Generator) -> tuple[Atoms, dict]:
    material = _pick_material(rng, alloy_probability=0.3)
    atoms = _fcc_supercell(material, rng)
    _strain(atoms, np.eye(3) * rng.uniform(-0.01, 0.01))
    sigma = float(_choose(rng, RATTLE_AMPLITUDES))
    _rattle(atoms, rng, sigma)
    return atoms, {"material": material.name, "rattle": sigma}


def _build_vacancy(rng: np.random.Generator) -> tuple[Atoms, dict]:
    from ase.build import bulk

    material = _pick_material(rng, alloy_probability=0.3)
    a = _lattice_constant(material)
    if rng.random() < 0.5:
        repeats = _weighted(rng, (((2, 2, 3), 2.0), ((3, 3, 2), 2.0), ((3, 3, 3), 1.0)))
        atoms = bulk(material.major, "fcc", a=a) * repeats
    else:
        repeats = _weighted(rng, (((2, 2, 1), 2.0), ((2, 2, 2), 2.0), ((3, 3, 2), 0.3)))
        atoms = bulk(material.major, "fcc", a=a, cubic=True) * repeats
    _substitute(atoms, material, rng)
    vacancies = 1 if rng.random() < 0.7 else 2
    del atoms[sorted(int(i) for i in rng.choice(len(atoms), size=vacancies, replace=False))]
    sigma = float(_choose(rng, RATTLE_AMPLITUDES[:3]))
    _rattle(atoms, rng, sigma)
    return atoms, {"material": material.name, "rattle": sigma, "vacancies": vacancies}


def _build_surface(rng: np.random.Generator, facet: str) -> tuple[Atoms, dict]:
    from ase.build import fcc100, fcc111

    material = _pick_material(rng, alloy_probability=0.3)
    a = _lattice_constant(material)
    width = int(_weighted(rng, ((2, 4.0), (3, 1.0))))
    layers = int(rng.integers(3, 6))
    periodic = bool(rng.random() < 0.4)
    builder = fcc100 if facet == "100" else fcc111
    atoms = builder(
        material.major, size=(width, width, layers), a=a, vacuum=SLAB_VACUUM, periodic=periodic
    )
    _substitute(atoms, material, rng)
    in_plane = float(rng.uniform(-0.02, 0.02))
    _strain(atoms, np.diag([in_plane, in_plane, 0.0]))
    sigma = float(_choose(rng, RATTLE_AMPLITUDES[:3]))
    _rattle(atoms, rng, sigma)
    return atoms, {"material": material.name, "rattle": sigma, "layers": layers}


def _build_surface_100(rng: np.random.Generator) -> tuple[Atoms, dict]:
    return _build_surface(rng, "100")


def _build_surface_111(rng: np.random.Generator) -> tuple[Atoms, dict]:
    return _build_surface(rng, "111")


def _build_cluster(rng: np.random.Generator) -> tuple[Atoms, dict]:
    from ase import Atoms
    from ase.cluster import Decahedron, Icosahedron, Octahedron

    material = _pick_material(rng, alloy_probability=0.2)
    a = _lattice_constant(material) * float(rng.uniform(0.98, 1.0))
    shape = int(rng.integers(6))
    symbol = material.major
    if shape == 0:
        atoms = Icosahedron(symbol, noshells=2, latticeconstant=a)  # 13
    elif shape == 1:
        atoms = Icosahedron(symbol, noshells=3, latticeconstant=a)  # 55
    elif shape == 2:
        atoms = Octahedron(symbol, length=3, cutoff=1, latticeconstant=a)  # 13 (cuboctahedron)
    elif shape == 3:
        atoms = Octahedron(symbol, length=4, cutoff=1, latticeconstant=a)  # 38
    elif shape == 4:
        atoms = Decahedron(symbol, p=2, q=2, r=0, latticeconstant=a)  # 13
    else:
        atoms = Decahedron(symbol, p=3, q=1, r=0, latticeconstant=a)  # 23
    # A plain Atoms without a cell (the cluster classes carry extra state).
    atoms = Atoms(numbers=atoms.numbers, positions=atoms.positions, pbc=False)
    atoms.positions = atoms.positions - atoms.positions.mean(axis=0)
    _substitute(atoms, material, rng)
    sigma = float(_choose(rng, RATTLE_AMPLITUDES[:3]))
    _rattle(atoms, rng, sigma)
    return atoms, {"material": material.name, "rattle": sigma}


_BUILDERS: dict[str, Callable[[np.random.Generator], tuple[Atoms, dict]]] = {
    "bulk": _build_bulk,
    "alloy": _build_alloy,
    "strain_iso": _build_strain_iso,
    "strain_shear": _build_strain_shear,
    "rattle": _build_rattle,
    "surface_100": _build_surface_100,
    "surface_111": _build_surface_111,
    "vacancy": _build_vacancy,
    "cluster": _build_cluster,
}


# --------------------------------------------------------------------------- labelling


def _label(atoms: Atoms) -> None:
    """Attach EMT energy, forces and (for periodic cells) stress as a SinglePointCalculator."""
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms.calc = EMT()
    energy = round(float(atoms.get_potential_energy()), ENERGY_DECIMALS)
    forces = np.round(atoms.get_forces(), FORCE_DECIMALS)
    results: dict = {"energy": energy, "forces": forces}
    if atoms.pbc.any():
        results["stress"] = np.round(atoms.get_stress(voigt=True), STRESS_DECIMALS)
    atoms.calc = SinglePointCalculator(atoms, **results)


def make_structure(family: str, index: int, seed: int = DEFAULT_SEED) -> Atoms:
    """Build and label structure ``index`` of ``family``; independent of the data-set size.

    Candidates whose largest force exceeds ``MAX_FORCE`` eV/Å are redrawn from the
    next random stream, so the result is deterministic.
    """
    if family not in _BUILDERS:
        raise KeyError(f"Unknown family {family!r}; expected one of {list(FAMILIES)}.")
    family_id = FAMILIES.index(family)
    for attempt in range(100):
        rng = np.random.default_rng([seed, family_id, index, attempt])
        atoms, extra = _BUILDERS[family](rng)
        atoms.positions = np.round(atoms.positions, POSITION_DECIMALS)
        if atoms.pbc.any():
            atoms.set_cell(np.round(np.asarray(atoms.cell), POSITION_DECIMALS))
        _label(atoms)
        if np.linalg.norm(atoms.get_forces(), axis=1).max() <= MAX_FORCE:
            break
    else:  # pragma: no cover - would need 100 unlucky draws
        raise RuntimeError(f"Could not draw a physical {family} structure #{index}.")
    atoms.info = {
        "config_type": family,
        "structure_id": f"{family}-{index:04d}",
        **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in extra.items()},
    }
    return atoms


def generate_structures(
    num_structures: int = DEFAULT_NUM_STRUCTURES,
    seed: int = DEFAULT_SEED,
    progress: ProgressFn | None = None,
) -> list[Atoms]:
    """All structures of the data set, family by family, labelled."""
    counts = family_counts(num_structures)
    structures: list[Atoms] = []
    for family in FAMILIES:
        for index in range(counts[family]):
            structures.append(make_structure(family, index, seed))
        if progress is not None:
            progress(f"  {family:<13s} {counts[family]:5d} structures ({len(structures)} total)")
    return structures


def assign_splits(structures: list[Atoms], seed: int = DEFAULT_SEED) -> dict[str, list[Atoms]]:
    """Split 80/10/10 within each family (stratified), deterministically from ``seed``."""
    by_family: dict[str, list[int]] = {}
    for i, atoms in enumerate(structures):
        by_family.setdefault(atoms.info["config_type"], []).append(i)
    assignment: dict[int, str] = {}
    for family, indices in by_family.items():
        family_id = FAMILIES.index(family) if family in FAMILIES else len(FAMILIES)
        order = np.random.default_rng([seed, family_id, 999_999]).permutation(len(indices))
        n_val = round(SPLIT_FRACTIONS["val"] * len(indices))
        n_test = round(SPLIT_FRACTIONS["test"] * len(indices))
        for rank, position in enumerate(order):
            split = "val" if rank < n_val else "test" if rank < n_val + n_test else "train"
            assignment[indices[int(position)]] = split
    return {s: [structures[i] for i in sorted(assignment) if assignment[i] == s] for s in SPLITS}


def split_filename(split: str) -> str:
    """File name of ``split`` inside a data-set folder, e.g. ``train.extxyz``."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; expected one of {list(SPLITS)}.")
    return f"{split}.extxyz"


def _write_extxyz(path: Path, structures: list[Atoms]) -> None:
    """Write ``structures`` to ``path`` atomically (plain text: see the module docstring)."""
    from ase.io import write

    buffer = io.StringIO()
    write(buffer, structures, format="extxyz")
    write_atomic(path, buffer.getvalue().encode())


def write_dataset(
    out_dir: str | Path,
    num_structures: int = DEFAULT_NUM_STRUCTURES,
    seed: int = DEFAULT_SEED,
    progress: ProgressFn | None = print,
) -> dict[str, Path]:
    """Generate, split and write the data set; return ``{split: path}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if progress is not None:
        progress(f"Generating {num_structures} EMT structures (seed {seed}) into {out}")
    structures = generate_structures(num_structures, seed, progress)
    hashes = [structure_hash(a) for a in structures]
    if len(set(hashes)) != len(hashes):  # pragma: no cover - guarded by the random streams
        raise RuntimeError("Duplicate structures generated; change the seed.")
    paths: dict[str, Path] = {}
    for split, members in assign_splits(structures, seed).items():
        path = out / split_filename(split)
        _write_extxyz(path, members)
        paths[split] = path
        if progress is not None:
            progress(f"  wrote {path} ({len(members)} structures, {path.stat().st_size} bytes)")
    return paths
