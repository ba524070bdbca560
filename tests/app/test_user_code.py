"""Jobs that name the user's own code: ``imports:`` in the job file and ``--allow-import``.

Each command runs in a fresh process whose working directory is not the job's, so the
user's module is found only because the job (or the option) names it.
"""

from __future__ import annotations

import textwrap

from ._support import assert_user_error, run_cli, tiny_job, write_job

MODULE = """
import pathlib

from nvalchemi.training import TrainingStage, default_training_fn

pathlib.Path(__file__).with_name("imported.txt").touch()


def energy_and_forces(model, batch):
    return default_training_fn(model, batch)


class CountSteps:
    frequency = 1
    stage = TrainingStage.AFTER_BATCH

    def __init__(self, path: str = "steps.txt"):
        self.path = path

    def __call__(self, ctx, stage):
        with open(self.path, "a") as handle:
            handle.write(f"{ctx.step_count}\\n")
"""


def _job(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "mymodels.py").write_text(textwrap.dedent(MODULE))
    job = tiny_job(tmp_path, num_steps=2, checkpoint_every=1)
    job["strategy"]["training_fn"] = "mymodels.energy_and_forces"
    steps = str(tmp_path / "steps.txt")
    job["source"]["hooks"].append({"spec": {"cls_path": "mymodels.CountSteps", "path": steps}})
    return project, job


def test_a_job_naming_user_code_is_refused_until_its_imports_list_it(tmp_path):
    project, job = _job(tmp_path)
    path = write_job(project / "job.json", job)
    refused = run_cli("spec", "report", path, cwd=tmp_path)
    assert_user_error(refused, "strategy.training_fn", "mymodels", fix="imports:")
    assert not (project / "imported.txt").exists()  # a refusal imports nothing

    job["imports"] = ["mymodels"]
    write_job(path, job)
    run = run_cli("spec", "run", path, "--no-report", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "steps.txt").read_text().split() == ["1", "2"]


def test_resume_and_evaluate_take_allow_import_for_a_job_without_imports(tmp_path):
    project, job = _job(tmp_path)
    job["imports"] = ["mymodels"]
    path = write_job(project / "job.json", job)
    assert run_cli("spec", "run", path, "--no-report", cwd=tmp_path).returncode == 0
    job.pop("imports")
    plain = write_job(project / "plain.json", job)
    checkpoints = tmp_path / "run" / "checkpoints"
    args = ("spec", "resume", checkpoints, "--spec", plain, "--num-steps", 3)
    assert_user_error(run_cli(*args, cwd=tmp_path), "mymodels", fix="imports:")
    resumed = run_cli(*args, "--allow-import", "mymodels", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert (tmp_path / "steps.txt").read_text().split() == ["1", "2", "3"]
