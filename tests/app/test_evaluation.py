"""``nvalchemi.app.evaluation``: errors per structure type, element, file, force magnitude."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from nvalchemi.app.evaluation import Evaluation, structure_groups
from nvalchemi.data.bundled import bundled_split_path
from nvalchemi.data.sources import open_reader, split_reader


def _evaluation() -> Evaluation:
    """Two bulk structures predicted well, one slab predicted badly (2 atoms each)."""
    forces_ref = np.array(
        [[0.05, 0, 0], [0, 0.05, 0], [0.5, 0, 0], [0, 0.5, 0], [2.0, 0, 0], [0, 0, 4.0]]
    )
    forces_pred = forces_ref + np.array([0.001, 0.001, 0.01, 0.01, 0.3, 0.3])[:, None] * [1, 0, 0]
    stress_ref = np.zeros((3, 9))
    stress_pred = np.zeros((3, 9))
    stress_pred[2] = 0.002
    return Evaluation(
        energy_per_atom_pred=np.array([1.001, 2.001, 3.05]),
        energy_per_atom_ref=np.array([1.0, 2.0, 3.0]),
        forces_pred=forces_pred,
        forces_ref=forces_ref,
        stress_pred=stress_pred,
        stress_ref=stress_ref,
        species=np.array([29, 29, 29, 79, 79, 79]),
        num_atoms=6,
        atoms_per_structure=np.array([2, 2, 2]),
        groups=np.array(["bulk", "bulk", "slab"]),
        sources=np.array(["a.xyz", "a.xyz", "b.xyz"]),
    )


def test_errors_per_structure_type_show_what_the_overall_numbers_hide():
    ev = _evaluation()
    by_group = ev.by_group()
    assert list(by_group) == ["bulk", "slab"]
    bulk, slab = by_group["bulk"], by_group["slab"]
    assert (bulk["structures"], bulk["atoms"], slab["structures"], slab["atoms"]) == (2, 4, 1, 2)
    assert bulk["energy_per_atom_mae"] == pytest.approx(0.001)
    assert slab["energy_per_atom_mae"] == pytest.approx(0.05)
    assert slab["forces_mae"] > 20 * bulk["forces_mae"]
    assert slab["stress_mae"] == pytest.approx(0.002) and bulk["stress_mae"] == 0  # stress too
    assert ev.by_source()["b.xyz"] == slab  # per input file, the same keys


def test_per_element_errors_take_each_elements_atoms_and_structures():
    per = _evaluation().per_element()
    cu, au = per["Cu"], per["Au"]
    assert (cu["atoms"], cu["structures"], au["atoms"], au["structures"]) == (3, 2, 3, 2)
    assert cu["forces_mae"] == pytest.approx((0.001 * 2 + 0.01) / 9)
    assert au["energy_per_atom_mae"] == pytest.approx((0.001 + 0.05) / 2)  # bulk 2 + slab
    assert "stress_mae" in cu


def test_force_errors_are_binned_by_the_reference_magnitude():
    bins = _evaluation().force_bins()
    assert [(b["low"], b["high"], b["atoms"]) for b in bins] == [
        (0.0, 0.1, 2),
        (0.3, 1.0, 2),
        (1.0, 3.0, 1),
        (3.0, np.inf, 1),
    ]
    assert bins[0]["forces_mae"] == pytest.approx(0.001 / 3)
    assert bins[-1]["relative_mae"] == pytest.approx((0.3 / 3) / 4.0)


def test_the_report_is_json_ready_with_units():
    import json

    report = _evaluation().report()
    assert report["units"] == {"energy_per_atom": "eV/atom", "forces": "eV/Å", "stress": "eV/Å³"}
    assert report["force_bins"][-1]["high"] is None  # infinity is not JSON
    json.dumps(report)


def test_structures_are_grouped_by_config_type_a_key_or_atom_count():
    reader = open_reader(bundled_split_path("val"), max_structures=12)
    try:
        groups, by = structure_groups([reader])
        assert by == "config_type" and len(groups) == 12 and "bulk" in set(groups)
        groups, by = structure_groups([reader], group_by="material")
        assert by == "material"
        assert list(groups) == [str(reader.get_atoms(i).info["material"]) for i in range(12)]
        groups, by = structure_groups([reader], group_by="no_such_key")
        assert by == "atoms" and all(g.endswith(" atoms") for g in groups)
        _, held = split_reader(reader, 0.5, seed=0)  # through a subset, to the right frames
        sub, _ = structure_groups([held])
        assert len(sub) == len(held)
    finally:
        reader.close()


def test_doctests_of_the_library_modules():
    import doctest

    for name in (
        "nvalchemi._errors",
        "nvalchemi.app.evaluation",
        "nvalchemi.training.time_budget",
        "nvalchemi.training.strategy_payload",
        "nvalchemi.app.devices",
        "nvalchemi.data.sources",
        "nvalchemi.data.inspect",
        "nvalchemi.app.jobs",
        "nvalchemi.app.jobs.spec",
        "nvalchemi.app.jobs.resolve",
        "nvalchemi.app.jobs.checks",
        "nvalchemi.app.jobs.scaffold",
        "nvalchemi.hooks.reporting.units",
    ):
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, name
