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

import pytest

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


# ------------------------------------------------- item 2: a job file cannot run commands
def test_spec_report_does_not_run_a_command_named_by_the_job_file(tmp_path):
    from ._support import run_cli, tiny_job

    marker = tmp_path / "marker"
    job = tiny_job(tmp_path)
    job["imports"] = ["subprocess"]
    hook = {"cls_path": "subprocess.Popen", "args": ["sh", "-c", f"touch {marker}"]}
    job["source"]["hooks"].append({"spec": hook})
    path = write_job(tmp_path / "job.json", job)
    result = run_cli("spec", "report", path, cwd=tmp_path)
    assert not marker.exists(), result.stderr
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "imports[0]" in result.stderr and "subprocess" in result.stderr, result.stderr


_NOT_A_HOOK = '''
import pathlib


class Toucher:
    """Your own class whose constructor acts on the file a spec names (not a hook, not a
    model, not a loss, not an optimizer config)."""

    def __init__(self, path: str = "x", **kwargs):
        pathlib.Path(path).touch()
'''


@pytest.fixture
def job_dir(tmp_path, monkeypatch):
    """A job folder with the user's module ``nv_job_own`` in it; the allow-list, the import
    path and the imported modules are restored afterwards."""
    from nvalchemi import _serialization as ser

    (tmp_path / "nv_job_own.py").write_text(_NOT_A_HOOK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    allowed = set(ser._ALLOWED)
    yield tmp_path
    ser._ALLOWED.clear()
    ser._ALLOWED.update(allowed)
    sys.modules.pop("nv_job_own", None)
    ser._resolve.cache_clear()


def _crafted(case: str, tmp_path: Path, marker: Path) -> tuple[dict, list[str], str]:
    """A job edited by ``case``: (the job, extra CLI options, the field the error names)."""
    from ._support import tiny_job

    job = tiny_job(tmp_path)
    touch = ["sh", "-c", f"touch {marker}"]
    own = {"cls_path": "nv_job_own.Toucher", "path": str(marker)}
    hooks, strategy = job["source"]["hooks"], job["strategy"]
    if case.startswith("imports:") and case != "imports:elsewhere":  # stdlib, installed
        module, hook = {
            "imports:subprocess": ("subprocess", {"cls_path": "subprocess.Popen", "args": touch}),
            "imports:os": ("os", {"cls_path": "os.system", "command": f"touch {marker}"}),
            "imports:shutil": ("shutil", {"cls_path": "shutil.rmtree", "path": str(marker)}),
            "imports:ase": ("ase.io", {"cls_path": PICKLE_TRAJECTORY, "filename": str(marker)}),
        }[case]
        job["imports"] = [module]
        hooks.append({"spec": hook})
        return job, [], "imports[0]"
    if case == "imports:elsewhere":  # a module found on the path, not beside the job
        (tmp_path / "vendor").mkdir()
        (tmp_path / "vendor" / "nv_job_far.py").write_text(_NOT_A_HOOK)
        sys.path.insert(0, str(tmp_path / "vendor"))
        job["imports"] = ["nv_job_far"]
        hooks.append({"spec": {**own, "cls_path": "nv_job_far.Toucher"}})
        return job, [], "imports[0]"
    job["imports"] = ["nv_job_own"]
    if case == "trusted_popen_hook":
        job["imports"] = ["subprocess"]
        hooks.append({"spec": {"cls_path": "subprocess.Popen", "args": touch}})
        return job, ["--trust"], f"source.hooks[{len(hooks) - 1}].spec.cls_path"
    if case == "own_class_as_hook":
        hooks.append({"spec": own})
        return job, [], f"source.hooks[{len(hooks) - 1}].spec.cls_path"
    if case == "own_class_as_model":
        strategy["model_specs"]["main"] = own
        return job, [], "strategy.model_specs.main"
    if case == "own_class_nested_in_model":
        wrapper = "nvalchemi.models.demo.DemoModelWrapper"
        strategy["model_specs"]["main"] = {"cls_path": wrapper, "model": own}
        return job, [], "strategy.model_specs.main"
    if case == "own_class_as_loss":
        strategy["loss_fn_spec"] = own
        return job, [], "strategy.loss_fn_spec"
    if case == "own_class_nested_in_loss":
        strategy["loss_fn_spec"]["components"][0] = own
        return job, [], "strategy.loss_fn_spec"
    if case == "own_class_as_optimizer":
        strategy["optimizer_configs"]["main"][0] = own
        return job, [], "strategy.optimizer_configs.main[0]"
    assert case == "own_class_as_patch"
    strategy["module_patches"] = {"model.layer": own}
    return job, [], "strategy.module_patches.model.layer"


_CASES = [
    "imports:subprocess",
    "imports:os",
    "imports:shutil",
    "imports:ase",
    "imports:elsewhere",
    "trusted_popen_hook",
    "own_class_as_hook",
    "own_class_as_model",
    "own_class_nested_in_model",
    "own_class_as_loss",
    "own_class_nested_in_loss",
    "own_class_as_optimizer",
    "own_class_as_patch",
]


@pytest.mark.parametrize("case", _CASES)
def test_a_crafted_job_file_runs_nothing_and_names_the_field(job_dir, case):
    from ._support import assert_user_error, invoke

    marker = job_dir / "marker"
    job, options, field = _crafted(case, job_dir, marker)
    path = write_job(job_dir / "job.json", job)
    result = invoke("spec", "report", path, *options)
    assert not marker.exists(), result.stderr
    assert_user_error(result, field)
    if case.startswith("imports:"):
        assert "is not your own code" in result.stderr, result.stderr
    else:
        assert "nv_job_own.Toucher" in result.stderr or "subprocess.Popen" in result.stderr
    assert "nv_job_far" not in sys.modules and not marker.exists()


def test_a_job_naming_its_own_module_and_trusted_imports_still_work(job_dir):
    from ._support import invoke, tiny_job

    (job_dir / "nv_job_own.py").write_text(
        "from nvalchemi.training.hooks.early_stopping import EarlyStoppingHook\n\n\n"
        "class Patience(EarlyStoppingHook):\n    pass\n"
    )
    job = tiny_job(job_dir)
    job["imports"] = ["nv_job_own"]
    job["source"]["hooks"].append({"spec": {"cls_path": "nv_job_own.Patience"}})
    path = write_job(job_dir / "job.json", job)
    result = invoke("spec", "report", path)
    assert result.exit_code == 0, result.stderr
    job["imports"] = ["json"]  # the standard library, by a job file you wrote: --trust
    write_job(path, job)
    assert invoke("spec", "report", path).exit_code == 1
    result = invoke("spec", "report", path, "--trust")
    assert result.exit_code == 0, result.stderr
