"""Labellers for the active-learning tests (imported by the labelling workers).

``CountingEMT``: EMT that appends one line to ``$LEARN_CALLS`` per finished labelling call
and, on call ``$LEARN_PAUSE_CALL``, writes ``$LEARN_MARKER`` and sleeps first (a call in
flight when the test kills the run). ``PickyEMT``: EMT that fails on 4-atom structures.
``CrashingEMT``: EMT whose process dies on 4-atom structures.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ase.calculators.emt import EMT


class CountingEMT(EMT):
    def get_potential_energy(self, atoms=None, force_consistent=False):
        calls = Path(os.environ["LEARN_CALLS"])
        done = len(calls.read_text().splitlines()) if calls.is_file() else 0
        if os.environ.get("LEARN_PAUSE_CALL") == str(done + 1):
            Path(os.environ["LEARN_MARKER"]).write_text("label")
            time.sleep(600)
        energy = super().get_potential_energy(atoms, force_consistent)
        with calls.open("a") as handle:
            handle.write(f"{len(atoms)} {energy:.10f}\n")
        return energy


class PickyEMT(EMT):
    def get_potential_energy(self, atoms=None, force_consistent=False):
        if len(atoms) == 4:
            raise RuntimeError("SCF did not converge")
        return super().get_potential_energy(atoms, force_consistent)


class CrashingEMT(EMT):
    def get_potential_energy(self, atoms=None, force_consistent=False):
        if len(atoms) == 4:
            os._exit(3)
        return super().get_potential_energy(atoms, force_consistent)
