"""Rank side of the real DDP tests (``python _ddp_worker.py <scenario> <out_dir>``).

Each rank prints one ``RESULT {json}`` line (and may save tensors under ``out_dir``).
The data and model builders are shared with the parent test, which recomputes the
single-process references.

Data: the first eight-atom periodic structures of the bundled EMT training split (equal
atom counts on every rank, so a mean force loss over a rank's atoms averages exactly
like the mean over the union batch).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from _ranks import report as _report

NUM_TRAIN = 16
NUM_VAL = 10
VAL_BATCH_SIZES = (3, 2, 2, 2, 1)  # rank 0 gets batches 0, 2, 4; rank 1 gets 1, 3
BATCH_SIZE = 2
LOADER_SEED = 5
LR = 0.05


# --------------------------------------------------------------------------- shared builders
def structures() -> tuple[list, list]:
    """``(train, val)`` AtomicData lists with neighbour lists (deterministic)."""
    from nvalchemi.data import ASEReader, bundled_split_path
    from nvalchemi.data.neighbors import NeighborListTransform

    reader = ASEReader(bundled_split_path("train"))
    transform = NeighborListTransform(CUTOFF)
    picked = []
    for index in range(len(reader)):
        data = reader.read_data(index)
        if data.num_nodes == 8 and "stress" in data:
            picked.append(transform(data, {"index": index})[0])
            if len(picked) == NUM_TRAIN + NUM_VAL:
                break
    return picked[:NUM_TRAIN], picked[NUM_TRAIN:]


CUTOFF = 4.0


def make_model():
    from nvalchemi.models import PaiNN

    torch.manual_seed(0)
    model = PaiNN(
        cutoff=CUTOFF,
        hidden_channels=16,
        num_interactions=2,
        num_rbf=8,
        elements=[13, 28, 29, 46, 47, 78, 79],
        scale=0.5,
    )
    model.set_config("active_outputs", {"energy", "forces", "stress"})
    return model


def loss_fn():
    from nvalchemi.training import EnergyMSELoss, ForceMSELoss, StressMSELoss

    return EnergyMSELoss() + 10.0 * ForceMSELoss() + 100.0 * StressMSELoss()


def optimizer_config(cls=None):
    from nvalchemi.training import OptimizerConfig

    # name patterns must keep matching after DDP wraps the model (no ".module." prefix)
    return OptimizerConfig(
        cls or torch.optim.SGD,
        {"lr": LR},
        param_groups=[{"params": ["readout.*"], "lr": 2 * LR}],
    )


def val_batches(val: list) -> list:
    from nvalchemi.data import Batch

    out, start = [], 0
    for size in VAL_BATCH_SIZES:
        out.append(Batch.from_data_list(val[start : start + size]))
        start += size
    return out


def train_loader(train: list):
    from nvalchemi.data.datapipes import DataLoader, InMemoryDataset

    return DataLoader(
        InMemoryDataset(data_list=train), batch_size=BATCH_SIZE, shuffle=True, seed=LOADER_SEED
    )


# --------------------------------------------------------------------------- rank side
def _floats(summary: dict) -> dict:
    return {
        k: float(v)
        for k, v in summary.items()
        if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool)
    }


class _Probe:
    """Records what the loop did on this rank (model type, sampler epochs, shard plans)."""

    frequency = 1
    stage = None

    def __init__(self) -> None:
        self.wrapped = []
        self.epochs = []

    def _runs_on_stage(self, stage):
        from nvalchemi.training import TrainingStage

        return stage in (TrainingStage.BEFORE_TRAINING, TrainingStage.BEFORE_EPOCH)

    def __call__(self, ctx, stage):
        from nvalchemi.training import TrainingStage

        strategy = ctx.workflow
        loader = strategy.active_dataloader
        if stage is TrainingStage.BEFORE_TRAINING:
            model = strategy.models["main"]
            params = {id(p) for g in strategy._optimizers[0].param_groups for p in g["params"]}
            self.wrapped.append(
                {
                    "type": type(model).__name__,
                    "find_unused_parameters": getattr(model, "find_unused_parameters", None),
                    "same_params": params == {id(p) for p in model.module.parameters()},
                    "groups": len(strategy._optimizers[0].param_groups),
                }
            )
        else:
            sampler = loader.batch_sampler.sampler
            self.epochs.append(
                {
                    "epoch": ctx.epoch,
                    "sampler_epoch": sampler.epoch,
                    "plan": list(loader.index_batches()),
                }
            )


def scenario_train(out: Path) -> None:
    """Equivalence, validation, rank-0 checkpoints, exact resume, set_epoch, early stopping.

    No manager: the DDPHook initialises the group from RANK/WORLD_SIZE and destroys it
    at teardown (every run() re-creates it).
    """
    import torch.distributed as dist

    from nvalchemi.distributed import DistributedManager
    from nvalchemi.training import TrainingStrategy, ValidationConfig
    from nvalchemi.training.hooks import CheckpointHook, DDPHook, EarlyStoppingHook

    rank = int(os.environ["RANK"])
    train, val = structures()
    batches = val_batches(val)[rank::2]
    result: dict = {"rank": rank}

    # 1. one optimizer step: weights equal across ranks and to the union batch
    model = make_model()
    probe = _Probe()
    loader = train_loader(train)
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=optimizer_config(),
        loss_fn=loss_fn(),
        num_steps=1,
        hooks=[DDPHook(), probe],
    )
    strategy.run(loader)
    torch.save(model.state_dict(), out / f"step1_rank{rank}.pt")
    loader.set_epoch(0)
    result.update(
        probe=probe.wrapped,
        first_batch=next(iter(loader.index_batches())),
        epoch0_plan=list(loader.index_batches()),
        unwrapped_after=strategy.models["main"] is model,
        group_after_run=dist.is_initialized(),
        manager_after_run=DistributedManager.is_initialized(),
    )

    # 2a. uninterrupted: 6 steps (1.5 epochs), validation each epoch, checkpoints every 3
    def build(hooks, num_steps, ckpt_root):
        ckpt = CheckpointHook(ckpt_root if rank == 0 else out / "ckpt_rank1", step_interval=3)
        return TrainingStrategy(
            models=make_model(),
            optimizer_configs=optimizer_config(torch.optim.Adam),
            loss_fn=loss_fn(),
            num_steps=num_steps,
            validation_config=ValidationConfig(validation_data=batches, every_n_epochs=1),
            hooks=[DDPHook(), ckpt, *hooks],
        )

    probe = _Probe()
    full = build([probe], 10, out / "ckpt_full")
    full.run(train_loader(train))
    torch.save(full.models["main"].state_dict(), out / f"full_rank{rank}.pt")
    result.update(
        epochs=probe.epochs,
        validation=_floats(full.last_validation),
        ckpt_rank1_exists=(out / "ckpt_rank1").exists(),
    )

    # 2b. interrupted after 4 steps, then resumed from rank 0's checkpoint to 10
    part = build([], 4, out / "ckpt_part")
    part.run(train_loader(train))
    # rank 1 reads what rank 0 wrote right after run() returns: the write must be done
    resumed = TrainingStrategy.load_checkpoint(
        out / "ckpt_part",
        hooks=[DDPHook(), CheckpointHook(out / "ckpt_part", step_interval=3)],
        overrides={"num_steps": 10},
    )
    resumed.validation_config = ValidationConfig(validation_data=batches, every_n_epochs=1)
    # active outputs are a runtime setting, not a constructor argument of the model spec
    resumed.models["main"].set_config("active_outputs", {"energy", "forces", "stress"})
    resumed.run(train_loader(train))
    full_params = dict(full.models["main"].named_parameters())
    diffs = [
        float((full_params[k] - v).abs().max())
        for k, v in resumed.models["main"].named_parameters()
    ]
    result.update(
        resume_counts=[resumed.step_count, resumed.epoch_count, resumed.batch_count],
        resume_max_diff=max(diffs),
        resume_validation=_floats(resumed.last_validation),
    )

    # 3. early stopping: the stop decision is the same on every rank
    stopper = TrainingStrategy(
        models=make_model(),
        optimizer_configs=optimizer_config(),
        loss_fn=loss_fn(),
        num_steps=20,
        validation_config=ValidationConfig(validation_data=batches, every_n_steps=1),
        hooks=[DDPHook(), EarlyStoppingHook(patience=2, min_delta=1e9)],
    )
    stopper.run(train_loader(train))
    result.update(
        early_stop=[stopper.step_count, stopper.stop_reason is not None],
        group_at_end=dist.is_initialized(),
    )
    _report(**result)


def scenario_peer_dies(out: Path) -> None:
    """Launched with Slurm variables only; rank 1 dies (or stalls) after the first step."""
    import torch.distributed as dist

    from nvalchemi.data import Batch
    from nvalchemi.training import TrainingStage, TrainingStrategy
    from nvalchemi.training.hooks import DDPHook

    rank = int(os.environ["SLURM_PROCID"])
    train, _ = structures()

    class Die:
        frequency = 1
        stage = TrainingStage.BEFORE_BATCH

        def __call__(self, ctx, stage):
            if ctx.step_count == 1:
                if rank == 1:
                    _report(rank=1, world=dist.get_world_size(), left=True)
                    if os.environ.get("TEST_PEER_MODE") == "stall":
                        time.sleep(300)  # alive but silent; the parent kills it
                    os._exit(3)
                time.sleep(0.5)  # let rank 1 go first

    batches = [Batch.from_data_list(train[i : i + 2]) for i in range(0, 8, 2)]
    strategy = TrainingStrategy(
        models=make_model(),
        optimizer_configs=optimizer_config(),
        loss_fn=loss_fn(),
        num_steps=4,
        hooks=[DDPHook(), Die()],
    )
    start = time.monotonic()
    try:
        strategy.run(batches)
        outcome, message = "returned", ""
    except Exception as exc:
        notes = "\n".join(getattr(exc, "__notes__", []))
        outcome, message = type(exc).__name__, f"{exc}\n{notes}"[-1500:]
    _report(
        rank=rank,
        outcome=outcome,
        message=message,
        waited_s=time.monotonic() - start,
        group_after=dist.is_initialized(),
    )
    os._exit(0)


SCENARIOS = {"train": scenario_train, "peer_dies": scenario_peer_dies}

if __name__ == "__main__":
    torch.set_num_threads(1)
    SCENARIOS[sys.argv[1]](Path(sys.argv[2]))
