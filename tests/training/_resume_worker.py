"""Training process for the crash/resume tests (``test_exact_resume.py``).

Two ways to run it:

* ``python _resume_worker.py run '<json job>'``: one training job in this process.
* ``python _resume_worker.py serve``: a fork server. It imports torch and nvalchemi once
  (several seconds), then for each JSON request on stdin forks a child process that runs
  one job; the test signals and kills those children directly. Requests:
  ``{"cmd": "run", "job": {...}, "log": path}`` -> ``{"pid": n}``;
  ``{"cmd": "wait", "pid": n}`` -> ``{"exitcode": code}`` (negative: killed by a signal).

A job trains a tiny PaiNN (a small MLP if PaiNN is missing) on 16 random molecules with
shuffling, EMA (if ``EMAHook`` exists), a StepLR scheduler, validation and a
``CheckpointHook``; it appends ``"<step> <loss as float.hex>"`` per optimizer step to
``loss_file`` and writes the final weights to ``final_file``. Job keys: ``root``,
``loss_file``, ``final_file``, ``mode`` (``"steps"``/``"epochs"``), ``resume``,
``pause_at_step`` (flush checkpoints, then sleep until killed), ``slow_writes`` (seconds),
``preempt`` (register a ``PreemptionHandler``), ``step_delay`` (seconds of sleep after
each step), ``async_save``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

from torch import nn  # noqa: E402

from nvalchemi.data import AtomicData  # noqa: E402
from nvalchemi.data.datapipes import DataLoader, InMemoryDataset  # noqa: E402
from nvalchemi.training import (  # noqa: E402
    EnergyMSELoss,
    ForceMSELoss,
    OptimizerConfig,
    TrainingStage,
    TrainingStrategy,
    ValidationConfig,
)
from nvalchemi.training.checkpoint import CheckpointManifest  # noqa: E402
from nvalchemi.training.hooks.checkpoint import CheckpointHook  # noqa: E402
from nvalchemi.training.hooks.early_stopping import EarlyStoppingHook  # noqa: E402
from nvalchemi.training.preemption import PreemptionHandler  # noqa: E402

try:
    from nvalchemi.training.hooks.ema import EMAHook
except ImportError:  # the EMA hook is optional for these tests
    EMAHook = None

STEPS = 14  # mode "steps": num_steps, checkpoint every 3 steps, validate every 4
EPOCHS = 3  # mode "epochs": 4 batches per epoch, checkpoint and validate every epoch


def molecules(count: int, seed: int) -> list[AtomicData]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = 3 + i % 3
        pairs = torch.tensor([[a, b] for a in range(n) for b in range(n) if a != b])
        out.append(
            AtomicData(
                atomic_numbers=torch.randint(1, 4, (n,), generator=generator),
                positions=1.2 * torch.randn(n, 3, generator=generator),
                energy=torch.randn(1, 1, generator=generator),
                forces=torch.randn(n, 3, generator=generator),
                neighbor_list=pairs,
                neighbor_list_shifts=torch.zeros(len(pairs), 3, dtype=torch.long),
            )
        )
    return out


def make_model() -> nn.Module:
    try:
        from nvalchemi.models.painn import PaiNN
    except ImportError:
        from nvalchemi.models.demo import DemoModel, DemoModelWrapper

        return DemoModelWrapper(DemoModel(num_atom_types=8, hidden_dim=8))
    return PaiNN(cutoff=4.0, hidden_channels=8, num_interactions=1, num_rbf=4, elements=[1, 2, 3])


class LossLog:
    """Appends ``step loss`` per optimizer step; optionally parks the process at a step."""

    frequency = 1
    stage = TrainingStage.AFTER_BATCH

    def __init__(self, path: str, pause_at_step: int | None, step_delay: float = 0.0) -> None:
        self.handle = open(path, "a")  # noqa: SIM115 - lives as long as the process
        self.pause_at_step = pause_at_step
        self.step_delay = step_delay
        self.last = -1

    def __call__(self, ctx: Any, stage: Any) -> None:
        if ctx.step_count <= self.last:
            return
        self.last = ctx.step_count
        self.handle.write(f"{ctx.step_count} {float(ctx.loss).hex()}\n")
        self.handle.flush()
        if self.step_delay:
            time.sleep(self.step_delay)  # leaves a signal time to arrive mid-run
        if ctx.step_count == self.pause_at_step:
            for hook in ctx.workflow.hooks:
                if isinstance(hook, CheckpointHook):
                    hook.flush()  # not inside a save when the test kills us
            Path(self.handle.name + ".paused").write_text(str(ctx.step_count))
            while True:
                time.sleep(1.0)


# ---------------------------------------------------------------------------- loader kinds
LOADER_KINDS = ("shuffle", "generator", "random_sampler", "distributed", "ours")


def make_loader(kind: str, workers: int) -> Any:
    """The training loader of a ``loaders`` job: the ways people shuffle (16 molecules, batch 4)."""
    from torch.utils.data import DataLoader as TorchLoader
    from torch.utils.data import DistributedSampler, RandomSampler

    from nvalchemi.data import Batch

    frames = molecules(16, 0)
    common = {"batch_size": 4, "collate_fn": Batch.from_data_list, "num_workers": workers}
    if kind == "shuffle":
        return TorchLoader(frames, shuffle=True, **common)
    if kind == "generator":
        return TorchLoader(
            frames, shuffle=True, generator=torch.Generator().manual_seed(1234), **common
        )
    if kind == "random_sampler":
        sampler = RandomSampler(frames, generator=torch.Generator().manual_seed(99))
        return TorchLoader(frames, sampler=sampler, **common)
    if kind == "distributed":
        sampler = DistributedSampler(frames, num_replicas=1, rank=0, shuffle=True, seed=1234)
        return TorchLoader(frames, sampler=sampler, **common)
    return DataLoader(
        InMemoryDataset(data_list=frames), batch_size=4, shuffle=True, seed=7, num_workers=workers
    )


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))
    )


def loader_strategy(job: dict[str, Any], hooks: list[Any]) -> TrainingStrategy:
    torch.manual_seed(0)
    return TrainingStrategy(
        models=make_model(),
        optimizer_configs=OptimizerConfig(
            torch.optim.AdamW,
            {"lr": 1e-2},
            torch.optim.lr_scheduler.StepLR,
            {"step_size": 3, "gamma": 0.7},
        ),
        loss_fn=EnergyMSELoss() + ForceMSELoss(),
        hooks=hooks,
        num_epochs=3,
    )


def run_loader_job(job: dict[str, Any]) -> int:
    """``mode``: ``reference`` (checkpoint every step), ``resume_all`` (resume from each of the
    reference's checkpoints in turn, compare), ``train`` (checkpoint every 3 steps, may
    pause to be killed) or ``resume`` (from the latest checkpoint)."""
    import warnings

    warnings.simplefilter("ignore")  # resumed without the saved hooks, on purpose
    root, kind, workers = Path(job["root"]), job["loader"], job.get("workers", 0)
    mode = job["mode"]
    if mode == "resume_all":
        reference = torch.load(job["final_file"], weights_only=True)["model"]
        losses = dict(
            tuple(line.split()) for line in Path(job["loss_file"]).read_text().splitlines()
        )
        out = []
        for entry in CheckpointManifest.read(root).checkpoints:
            log = Path(job["scratch"]) / f"resume-{entry.index}.loss"
            log.unlink(missing_ok=True)
            hooks = [LossLog(str(log), None)]
            strategy = TrainingStrategy.load_checkpoint(
                root, entry.index, map_location="cpu", hooks=hooks
            )
            strategy.run(make_loader(kind, workers))
            hooks[0].handle.close()
            after = [tuple(line.split()) for line in log.read_text().splitlines()]
            final = strategy.unwrapped_models()["main"].state_dict()
            same = all(_bitwise_equal(final[k], reference[k]) for k in reference)
            out.append(
                {
                    "index": entry.index,
                    "step": entry.step_count,
                    "epoch_step": entry.epoch_step_count,
                    "losses": all(losses[s] == v for s, v in after)
                    and len(after) == 12 - entry.step_count,
                    "final": same,
                }
            )
        Path(job["result_file"]).write_text(json.dumps(out))
        return 0
    cadence = 1 if mode == "reference" else 3
    hooks = [
        LossLog(job["loss_file"], job.get("pause_at_step")),
        CheckpointHook(root, step_interval=cadence, async_save=mode != "reference"),
    ]
    if mode == "resume":
        strategy = TrainingStrategy.load_checkpoint(root, map_location="cpu", hooks=hooks)
    else:
        strategy = loader_strategy(job, hooks)
    strategy.run(make_loader(kind, workers))
    torch.save({"model": strategy.unwrapped_models()["main"].state_dict()}, job["final_file"])
    return 0


def run_job(job: dict[str, Any]) -> int:
    if "loader" in job:
        return run_loader_job(job)
    if job.get("slow_writes"):
        os.environ["NVALCHEMI_CHECKPOINT_SLOW_WRITES"] = str(job["slow_writes"])
    mode = job.get("mode", "steps")
    root = Path(job["root"])
    loader = DataLoader(
        InMemoryDataset(data_list=molecules(16, 0)), batch_size=4, shuffle=True, seed=7
    )
    val = DataLoader(InMemoryDataset(data_list=molecules(4, 1)), batch_size=4)
    every = {"every_n_steps": 4} if mode == "steps" else {"every_n_epochs": 1}
    validation = ValidationConfig(validation_data=val, **every)
    cadence = {"step_interval": 3} if mode == "steps" else {"epoch_interval": 1}
    hooks: list[Any] = [
        LossLog(job["loss_file"], job.get("pause_at_step"), job.get("step_delay", 0.0)),
        CheckpointHook(
            root, keep_last=2, keep_best=1, async_save=job.get("async_save", True), **cadence
        ),
        EarlyStoppingHook(patience=100),
    ]
    if EMAHook is not None:
        hooks.append(EMAHook(decay=0.9))
    if job.get("preempt"):
        hooks.append(PreemptionHandler())
    if job.get("resume") and (root / "manifest.json").is_file():
        strategy = TrainingStrategy.load_checkpoint(
            root, map_location="cpu", hooks=hooks, overrides={"validation_config": validation}
        )
    else:
        torch.manual_seed(0)
        duration = {"num_steps": STEPS} if mode == "steps" else {"num_epochs": EPOCHS}
        strategy = TrainingStrategy(
            models=make_model(),
            optimizer_configs=OptimizerConfig(
                torch.optim.Adam,
                {"lr": 1e-2},
                torch.optim.lr_scheduler.StepLR,
                {"step_size": 3, "gamma": 0.7},
            ),
            loss_fn=EnergyMSELoss() + ForceMSELoss(),
            validation_config=validation,
            hooks=hooks,
            **duration,
        )
    strategy.run(loader)
    final = {"model": strategy.unwrapped_models()["main"].state_dict()}
    for hook in hooks:
        if EMAHook is not None and isinstance(hook, EMAHook):
            final["ema"] = hook.get_averaged_model().state_dict()
    torch.save(final, job["final_file"])
    return 0


# ---------------------------------------------------------------------------- fork server
def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _child(job: dict[str, Any], log: str) -> None:
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        code = run_job(job)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    # Import what the first optimizer and run would import (torch._dynamo takes seconds).
    torch.optim.Adam(nn.Linear(1, 1).parameters())
    _reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if request["cmd"] == "run":
            pid = os.fork()
            if pid == 0:
                _child(request["job"], request["log"])
            _reply({"pid": pid})
        elif request["cmd"] == "wait":
            _, status = os.waitpid(request["pid"], 0)
            _reply({"exitcode": os.waitstatus_to_exitcode(status)})
        else:
            break


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        sys.exit(run_job(json.loads(sys.argv[2])))
