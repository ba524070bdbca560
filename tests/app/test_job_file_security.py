"""Crafted job files and checkpoints run no code: each attack writes a marker file if it runs.

Every entry asserts that no marker appears and that a clear error names the file (or the
job field) and the key at fault. The user's legitimate cases (their own package next to the
job, ``--allow-import``, ``--trust``) keep working: see ``test_user_code.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from ._support import write_job

PICKLE_TRAJECTORY = "ase.io.pickletrajectory.PickleTrajectory"


class _Payload:
    """Unpickling this runs ``touch <marker>`` (what a hostile pickle file carries)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _ase_checkout(folder: Path) -> Path:
    """A copy of ASE outside site-packages (hard links), as a checkout put on PYTHONPATH."""
    import ase

    shutil.copytree(
        Path(ase.__file__).parent,
        folder / "ase",
        copy_function=_link_or_copy,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return folder


def _old_trajectory(path: Path, marker: Path) -> Path:
    """An "old pickle trajectory": unpickling its header runs the payload."""
    path.write_bytes(b"PickleTrajectory" + pickle.dumps(_Payload(marker)))
    return path


def _python(code: str, cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    env.pop("NVALCHEMI_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        env=env,
        check=False,
    )


# ------------------------------------------ item 1: a third-party package is not your code
def test_a_checkpoint_cannot_reach_a_pickle_reader_of_a_package_on_pythonpath(
    tmp_path, trained_run
):
    vendor = _ase_checkout(tmp_path / "vendor")
    marker = tmp_path / "marker"
    trajectory = _old_trajectory(tmp_path / "x.traj", marker)
    root = tmp_path / "checkpoints"
    shutil.copytree(trained_run["checkpoints"], root)
    evil = {
        "cls_path": PICKLE_TRAJECTORY,
        "timestamp": "t",
        "filename": str(trajectory),
        "mode": "r",
        "_warn": False,
    }
    spec_files = sorted(root.glob("checkpoints/*/models/main/spec.json"))
    for spec_file in spec_files:
        wrapper = {"cls_path": "nvalchemi.models.demo.DemoModelWrapper", "timestamp": "t"}
        spec_file.write_text(json.dumps({**wrapper, "model": evil}))

    loaded = _python(
        f"""
        import json
        import ase.io  # any process that has read an extxyz file has imported it
        from nvalchemi.models.calculator import NvalchemiCalculator
        from nvalchemi.training.checkpoint import load_model_from_checkpoint

        out = {{"ase": ase.__file__}}
        for name, load in (
            ("load_model_from_checkpoint", load_model_from_checkpoint),
            ("NvalchemiCalculator.from_checkpoint", NvalchemiCalculator.from_checkpoint),
        ):
            try:
                load({str(root)!r})
                out[name] = "built"
            except Exception as exc:
                out[name] = f"{{type(exc).__name__}}: {{exc}}"
        print(json.dumps(out))
        """,
        cwd=tmp_path,
        pythonpath=vendor,
    )
    assert loaded.returncode == 0, loaded.stderr
    out = json.loads(loaded.stdout.splitlines()[-1])
    assert out.pop("ase").startswith(str(vendor))  # the checkout, not the installed ASE
    assert not marker.exists(), out
    for name, message in out.items():
        assert message.startswith("UnsafeImportError"), (name, message)
        assert str(spec_files[-1]) in message and "key 'model.cls_path'" in message, message
        assert PICKLE_TRAJECTORY in message, message

    job = json.loads(json.dumps(trained_run["job"]))
    job["output"].update({"run_dir": str(tmp_path / "run"), "checkpoint_dir": str(root)})
    job["source"]["hooks"][0]["spec"]["checkpoint_dir"] = str(root)
    job_path = write_job(tmp_path / "job.json", job)
    resumed = _python(
        f"""
        import sys
        import ase.io
        from nvalchemi.training.cli import main

        sys.argv = ["nvalchemi-training", "spec", "resume", {str(root)!r}, "--spec",
                    {str(job_path)!r}, "--num-steps", "6"]
        main()
        """,
        cwd=tmp_path,
        pythonpath=vendor,
    )
    assert not marker.exists(), resumed.stderr
    assert resumed.returncode == 1, resumed.stderr
    assert "Traceback" not in resumed.stderr, resumed.stderr
    assert PICKLE_TRAJECTORY in resumed.stderr and "model.cls_path" in resumed.stderr

