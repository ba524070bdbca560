"""The active-learning loop: :func:`run_learning` (``nvalchemi-training learn job.yaml``).

Iteration ``i`` runs five phases, each finished and recorded in the store
(:class:`~nvalchemi.app.learn.store.LearnStore`) before the next starts:

1. **explore**: MD with the committee of iteration ``i - 1`` (:mod:`.explore`; torch-sim,
   every trajectory in one batch, when installed, else ASE);
2. **select**: frames whose max force deviation lies between the trust levels, most
   uncertain first, no near-duplicates (:mod:`.select`);
3. **label**: the reference calculator in worker processes, each label stored as it
   arrives (:mod:`.label`);
4. **train**: fine-tune the committee on the new labels with replay of every earlier
   label, then calibrate its spread on the validation data (:mod:`.train`);
5. **report**: test errors (overall, per ``config_type``), the spread's quality, a short
   MD check of the committee (:mod:`nvalchemi.app.md_check`), labels so far, frames per
   deviation band, time per phase (``iterations/<i>/report.json``, ``report.json``) and
   ``learning_curve.png`` (test error against labels).

Before iteration 0 the start job (a committee ``train`` job) is run, or resumed, when
its checkpoint root holds no finished run. ``learn`` killed at any moment (SIGKILL
included) resumes at the iteration and phase it was in; no label is lost or computed
twice, and the result is the one an uninterrupted run gives.

Example:
    >>> result = run_learning("learn.yaml")  # doctest: +SKIP
    >>> result.reports[-1]["test"]["forces_mae"]  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvalchemi.app.learn.spec import LearnJob, read_learn_job
from nvalchemi.app.learn.store import PHASES, LearnStore

__all__ = [
    "LearnResult",
    "Progress",
    "learning_curve",
    "run_learning",
    "start_structures",
    "test_errors",
]

Progress = Callable[[int, str, int, int], None]
"""``progress(iteration, phase, done, total)``: called as a phase advances."""

MANIFEST = "manifest.json"


@dataclass
class LearnResult:
    """What a learn run left: its store, the committee of the last iteration, the reports."""

    work_dir: Path
    model: Path
    """The checkpoint root of the latest committee."""
    reports: list[dict[str, Any]] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)


@dataclass
class _Data:
    """The labelled data the loop starts from (readers), and the start committee."""

    model: Path
    train: list[Any]
    validation: list[Any]
    test: list[Any]
    dtype: str
    closers: list[Any] = field(default_factory=list)

    def close(self) -> None:
        for closer in self.closers:
            closer()


# ----------------------------------------------------------------------------- start
def _open(paths: list[str], dtype: str, where: str) -> list[Any]:
    from nvalchemi.data.sources import open_reader

    return [open_reader(p, field=where, dtype=dtype) for p in paths]


def _start(job: LearnJob, console: Any) -> _Data:
    """Run (or resume) the start job when needed; open the start data."""
    start = job.start
    if start.checkpoint is not None:
        root = Path(start.checkpoint)
        if not (root / MANIFEST).is_file():
            from nvalchemi._errors import FieldError

            raise FieldError(
                f"{root} holds no checkpoints (no {MANIFEST})",
                field="start.checkpoint",
                fix="point it at the checkpoint root of a committee run",
            )
        dtype = str(_committee(root, "cpu").dtype).removeprefix("torch.")  # labels alike
        data = _Data(root, [], [], [], dtype)
    else:
        data = _run_start_job(Path(str(start.job)), console)
    if start.train:
        data.train = _open(start.train, data.dtype, "start.train")
    if start.validation:
        data.validation = _open(start.validation, data.dtype, "start.validation")
    data.test = _open(start.test, data.dtype, "start.test")
    for reader in (*data.train, *data.validation, *data.test):
        data.closers.append(reader.close)
    return data


def _run_start_job(path: Path, console: Any) -> _Data:
    from nvalchemi.app.jobs import load_job
    from nvalchemi.app.jobs.run import RunOptions, run_job, saved_progress

    job, resolved = load_job(path)
    root = Path(job.output.checkpoint_root)
    finished = (root / MANIFEST).is_file() and saved_progress(root, "latest").complete
    if not finished:
        if console is not None:
            console.print(f"start: training the committee of {path} into {root}")
        resume = root if (root / MANIFEST).is_file() else None
        run_job(job, resolved, RunOptions(), resume_from=resume)
    sources = job.dataset.open_sources()
    data = _Data(root, list(sources.train), list(sources.validation), [], job.dataset.dtype)
    data.closers.append(sources.close)
    return data


# ---------------------------------------------------------------------------- models
def _model_root(store: LearnStore, data: _Data, iteration: int) -> Path:
    """The committee after iteration ``iteration`` (the start model for ``-1``)."""
    for index in range(iteration, -1, -1):
        root = store.checkpoints(index)
        if (root / MANIFEST).is_file():
            return root
    return data.model


def _committee(root: Path, device: str) -> Any:
    from nvalchemi.training.checkpoint import load_model_from_checkpoint

    model = load_model_from_checkpoint(root, map_location=device, use_ema=True)
    if "max_force_deviation" not in model.model_config.outputs:
        from nvalchemi._errors import FieldError

        raise FieldError(
            f"the model in {root} is a {type(model).__name__}, not a committee: it has no "
            "force deviation to select with",
            field="start",
            fix="train a committee first (nvalchemi-training train init --committee 4 ...)",
        )
    return model.eval()


def start_structures(job: LearnJob, iteration: int) -> list[Any]:
    """The structures iteration ``iteration`` explores from: every structure of every
    file of ``explore.structures``, or with ``explore.max_structures`` (n) that many
    per file, in turn: iteration i takes structures ``i*n`` to ``i*n + n - 1`` of each
    file, wrapping around, so the iterations cover every structure before any twice."""
    from ase.io import read

    starts = []
    for path in job.explore.structures:
        found = read(path, index=":")
        n = job.explore.max_structures
        if n is None or n >= len(found):
            starts += found
        else:
            starts += [found[(iteration * n + k) % len(found)] for k in range(n)]
    return starts


# ---------------------------------------------------------------------------- phases
class _Loop:
    def __init__(
        self, job: LearnJob, store: LearnStore, data: _Data, progress: Progress | None
    ) -> None:
        self.job, self.store, self.data = job, store, data
        self.progress = progress

    def _report_progress(self, iteration: int, phase: str) -> Callable[[int, int], None]:
        def report(done: int, total: int) -> None:
            if self.progress is not None:
                self.progress(iteration, phase, done, total)

        return report

    def explore(self, i: int) -> None:
        from nvalchemi.app.learn.explore import engine_of, explore
        from nvalchemi.app.learn.select import bands

        model = _committee(_model_root(self.store, self.data, i - 1), self.job.train.device)
        frames, runs = explore(
            model,
            start_structures(self.job, i),
            self.job.explore,
            self.job.select,
            seed=self.job.seed,
            iteration=i,
            progress=self._report_progress(i, "explore"),
        )
        folder = self.store.iteration(i)
        self.store.write_structures(folder / "candidates.extxyz", frames)
        summary = {
            "engine": engine_of(self.job.explore),
            "trajectories": runs,
            "bands": bands(frames, self.job.select),
        }
        self.store.write_json(folder / "explore.json", summary)

    def select(self, i: int) -> None:
        from nvalchemi.app.learn.select import select

        folder = self.store.iteration(i)
        frames = self.store.read_structures(folder / "candidates.extxyz")
        self._report_progress(i, "select")(0, len(frames))
        chosen, counts = select(frames, self.job.select, seed=self.job.seed * 100_003 + i)
        selected = []
        for index in chosen:
            frame = frames[index]
            frame.info["learn_candidate"] = index
            selected.append(frame)
        self.store.write_structures(folder / "selected.extxyz", selected)
        self.store.write_json(folder / "select.json", counts)

    def label(self, i: int) -> None:
        from nvalchemi.app.learn.label import label_structures, labelled_structures

        folder = self.store.iteration(i)
        selected = self.store.read_structures(folder / "selected.extxyz")
        label_structures(
            selected,
            lambda k: self.store.label_path(i, k),
            self.job.label,
            imports=self.job.imports,
            progress=self._report_progress(i, "label"),
        )
        labelled, failures = labelled_structures(selected, self.store.stored_labels(i))
        self.store.write_structures(folder / "labelled.extxyz", labelled)
        self.store.write_json(
            folder / "label.json", {"labelled": len(labelled), "failures": failures}
        )

    def _labelled_readers(self, iterations: range) -> list[Any]:
        paths = [
            str(self.store.iteration(k) / "labelled.extxyz")
            for k in iterations
            if self.store.read_json(self.store.iteration(k) / "label.json")["labelled"]
        ]
        return _open(paths, self.data.dtype, "labelled") if paths else []

    def train(self, i: int) -> None:
        from nvalchemi.app.learn.train import finetune_committee

        folder = self.store.iteration(i)
        new = self._labelled_readers(range(i, i + 1))
        if not new:
            self.store.write_json(folder / "train.json", {"skipped": "no new labels"})
            return
        replay = [*self.data.train, *self._labelled_readers(range(i))]
        try:
            factors = finetune_committee(
                _model_root(self.store, self.data, i - 1),
                self.store.checkpoints(i),
                new,
                replay,
                self.data.validation,
                self.job.train,
                seed=self.job.seed + i,
                progress=self._report_progress(i, "train"),
            )
        finally:
            for reader in new:
                reader.close()
        self.store.write_json(folder / "train.json", {"calibration_factors": factors})

    def report(self, i: int, state: dict[str, Any]) -> dict[str, Any]:
        folder = self.store.iteration(i)
        labels = sum(len(r) for r in self.data.train) + sum(
            self.store.read_json(self.store.iteration(k) / "label.json")["labelled"]
            for k in range(i + 1)
        )
        report: dict[str, Any] = {
            "iteration": i,
            "labels": labels,
            "bands": self.store.read_json(folder / "explore.json")["bands"],
            "selected": self.store.read_json(folder / "select.json")["selected"],
            "labelled": self.store.read_json(folder / "label.json")["labelled"],
            "failed": len(self.store.read_json(folder / "label.json")["failures"]),
            "model": str(_model_root(self.store, self.data, i)),
            "md_check": None,
            "seconds": {
                phase: round(state.get("times", {}).get(f"{i}/{phase}", 0.0), 2)
                for phase in PHASES
                if phase != "report"
            },
        }
        if self.data.test:
            report.update(test_errors(_model_root(self.store, self.data, i), self.data.test))
        if self.job.md_check is not None:
            report["md_check"] = self._md_check(i)
            report["seconds"]["md_check"] = report["md_check"].pop("seconds")
        self.store.write_json(folder / "report.json", report)
        return report

    def _md_check(self, i: int) -> dict[str, Any]:
        """The MD check of iteration ``i``'s committee on the held-out data (its report)."""
        from nvalchemi.app.md_check import md_check

        readers = self.data.test or self.data.validation or self.data.train
        root = _model_root(self.store, self.data, i)
        model = _committee(root, self.job.train.device)
        return md_check(model, readers, self.job.md_check, device=self.job.train.device).report()


def test_errors(root: Path, readers: list[Any]) -> dict[str, Any]:
    """The committee in checkpoint root ``root`` on ``readers``: errors overall (``test``),
    per group (``test_by_group``) and its spread's quality (``uncertainty``)."""
    from nvalchemi.app.evaluation import evaluate_readers
    from nvalchemi.training.checkpoint import load_model_from_checkpoint

    model = load_model_from_checkpoint(root, use_ema=True)
    evaluation, grouping = evaluate_readers(model, readers)
    report = evaluation.report()
    return {
        "test": report["metrics"],
        "test_by_group": report["by_group"],
        "grouping": grouping,
        "uncertainty": report.get("uncertainty"),
    }


# ----------------------------------------------------------------------------- plots
def learning_curve(reports: list[dict[str, Any]], out: Path) -> Path | None:
    """``learning_curve.png``: test force and energy errors against the number of labels."""
    from nvalchemi.hooks.reporting.presets import plots_available

    rows = [r for r in reports if "test" in r]
    if not rows or not plots_available():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["labels"] for r in rows]
    figure, (forces, energy) = plt.subplots(1, 2, figsize=(10, 4))
    forces.plot(labels, [1000 * r["test"]["forces_mae"] for r in rows], "o-", label="all")
    groups = sorted({g for r in rows for g in r.get("test_by_group", {})})
    for group in groups:
        values = [
            1000 * r["test_by_group"].get(group, {}).get("forces_mae", float("nan")) for r in rows
        ]
        forces.plot(labels, values, ".--", label=group)
    forces.set(xlabel="labelled structures", ylabel="test force MAE (meV/Å)")
    forces.legend(fontsize=8)
    energy.plot(labels, [1000 * r["test"]["energy_per_atom_mae"] for r in rows], "o-")
    energy.set(xlabel="labelled structures", ylabel="test energy MAE (meV/atom)")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


# ------------------------------------------------------------------------------ entry
def run_learning(
    job: LearnJob | str | Path,
    *,
    iterations: int | None = None,
    progress: Progress | None = None,
    console: Any = None,
) -> LearnResult:
    """Run (or resume) an active-learning job until ``iterations`` (default: the job's).

    ``job`` is a :class:`LearnJob` (paths absolute) or a job file. ``console`` (anything
    with ``print``) gets a line per finished phase.

    Raises:
        FieldError: a bad job, an untrusted labeller, or another learn process running
            in the same ``work_dir``.
    """
    from nvalchemi.app.jobs.resolve import allow_user_code
    from nvalchemi.app.learn.label import check_labeller

    folder = Path.cwd()
    if not isinstance(job, LearnJob):
        folder = Path(job).resolve().parent  # the job's own code may sit next to it
        job = read_learn_job(job)
    total = job.iterations if iterations is None else iterations
    store = LearnStore(job.work_dir)
    allow_user_code(job.imports, folder)
    check_labeller(job.label.calculator, job.imports)
    with store.locked():
        store.write_json(store.root / "job.json", job.model_dump(mode="json"))
        data = _start(job, console)
        try:
            loop = _Loop(job, store, data, progress)
            state = store.state()
            while state["iteration"] < total:
                i, phase = state["iteration"], state["phase"]
                began = time.perf_counter()
                if phase == "report":
                    store.add_time(state, 0.0)
                    loop.report(i, state)
                else:
                    getattr(loop, phase)(i)
                state = store.advance(state, time.perf_counter() - began)
                if console is not None:
                    console.print(f"iteration {i}: {phase} done")
            reports = [
                store.read_json(store.iteration(k) / "report.json")
                for k in range(total)
                if (store.iteration(k) / "report.json").is_file()
            ]
            store.write_json(store.root / "report.json", reports)
            plot = learning_curve(reports, store.root / "learning_curve.png")
            return LearnResult(
                store.root,
                _model_root(store, data, total - 1),
                reports,
                [] if plot is None else [plot],
            )
        finally:
            data.close()
