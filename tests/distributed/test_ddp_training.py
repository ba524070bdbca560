"""Real data-parallel training: two gloo ranks on the CPU, compared with one process.

The rank side lives in ``_ddp_worker.py``; every run uses torchrun's (or Slurm's)
variables on a free port, a bounded process-group timeout and a hard wall-clock limit. The launcher examples run under
``python -m torch.distributed.run --standalone --nproc_per_node=2``.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import _ddp_worker as worker
import pytest
import torch
from _ranks import free_port, run_ranks, run_torchrun

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SEED = Path("/work/shared/seeds/training-api.md")
SEED_HOOK = Path("/work/shared/seeds/ddp-hook.md")
WORKER = HERE / "_ddp_worker.py"


def run_worker(scenario, out, **kwargs):
    """Both ranks of ``scenario`` (``run_ranks`` keyword arguments); their RESULT dicts."""
    return run_ranks(WORKER, args=[scenario, str(out)], **kwargs)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # The single-process references are tiny; on a busy machine extra OpenMP threads
    # only wait for each other (100x slower steps). Ranks run with OMP_NUM_THREADS=1.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the main run
@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_train")
    r0, r1 = run_worker(
        "train", out, rendezvous="tcp", env={"NVALCHEMI_DIST_TIMEOUT_S": "60"}
    )  # torchrun's variables: the DDPHook initialises the group from them
    return out, r0, r1


@pytest.fixture(scope="module")
def data():
    return worker.structures()


def _params(state: dict) -> dict:
    names = {name for name, _ in worker.make_model().named_parameters()}
    return {k: v for k, v in state.items() if k in names}


def test_each_rank_trains_on_a_disjoint_shard_of_every_epoch(train_run):
    _, r0, r1 = train_run
    for e0, e1 in zip(r0["epochs"], r1["epochs"], strict=True):
        shard0 = {i for batch in e0["plan"] for i in batch}
        shard1 = {i for batch in e1["plan"] for i in batch}
        assert shard0.isdisjoint(shard1) and shard0 | shard1 == set(range(worker.NUM_TRAIN))
    assert r0["epoch0_plan"][0] == r0["first_batch"]


def test_set_epoch_reshuffles_every_epoch_identically_on_all_ranks(train_run):
    _, r0, r1 = train_run
    assert [e["epoch"] for e in r0["epochs"]] == [0, 1, 2]
    for rank, result in ((0, r0), (1, r1)):
        for entry in result["epochs"]:
            assert entry["sampler_epoch"] == entry["epoch"]
            # DistributedSampler's order for (seed=loader.seed, epoch), this rank's stride
            order = torch.randperm(
                worker.NUM_TRAIN,
                generator=torch.Generator().manual_seed(worker.LOADER_SEED + entry["epoch"]),
            ).tolist()[rank::2]
            expected = [order[i : i + worker.BATCH_SIZE] for i in range(0, len(order), 2)]
            assert entry["plan"] == expected
    plans = [e["plan"] for e in r0["epochs"]]
    assert plans[0] != plans[1] != plans[2]


def test_model_is_wrapped_without_unused_parameter_search_and_keeps_its_parameters(train_run):
    _, r0, r1 = train_run
    for result in (r0, r1):
        assert result["probe"] == [
            {
                "type": "DistributedDataParallel",
                "find_unused_parameters": False,
                "same_params": True,
                "groups": 2,  # the "readout.*" pattern still matches under the wrapper
            }
        ]
        assert result["unwrapped_after"] is True


def test_one_force_and_stress_step_equals_single_process_training_on_the_union(train_run, data):
    from nvalchemi.data import Batch
    from nvalchemi.training import TrainingStrategy

    out, r0, r1 = train_run
    train, _ = data
    union = Batch.from_data_list([train[i] for i in r0["first_batch"] + r1["first_batch"]])
    model = worker.make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    TrainingStrategy(
        models=model,
        optimizer_configs=worker.optimizer_config(),
        loss_fn=worker.loss_fn(),
        num_steps=1,
    ).run([union])
    reference = _params(model.state_dict())
    rank0 = _params(torch.load(out / "step1_rank0.pt", weights_only=True))
    rank1 = _params(torch.load(out / "step1_rank1.pt", weights_only=True))
    assert reference.keys() == rank0.keys() == rank1.keys() and reference
    for name, value in reference.items():
        assert torch.equal(rank0[name], rank1[name]), name
        torch.testing.assert_close(rank0[name], value, rtol=1e-5, atol=1e-6, msg=name)
    moved = max(float((reference[k] - initial[k]).abs().max()) for k in reference)
    assert moved > 1e-4  # the step did something measurable


def test_validation_metrics_equal_single_process_validation(train_run, data):
    from nvalchemi.training import TrainingStrategy, ValidationConfig

    out, r0, r1 = train_run
    _, val = data
    model = worker.make_model()
    model.load_state_dict(torch.load(out / "full_rank0.pt", weights_only=True))
    strategy = TrainingStrategy(
        models=model,
        optimizer_configs=worker.optimizer_config(),
        loss_fn=worker.loss_fn(),
        num_steps=1,
        validation_config=ValidationConfig(validation_data=worker.val_batches(val)),
    )
    reference = strategy.validate()
    assert r0["validation"] == r1["validation"]  # all-reduced: the same on every rank
    assert r0["validation"]["num_structures"] == worker.NUM_VAL
    for key in ("total_loss", "energy_mae", "energy_per_atom_rmse", "forces_rmse", "stress_mae"):
        assert r0["validation"][key] == pytest.approx(float(reference[key]), rel=1e-5), key


def test_only_rank_zero_writes_checkpoints_and_resume_with_two_ranks_is_exact(train_run):
    out, r0, r1 = train_run
    assert (out / "ckpt_full" / "manifest.json").exists()
    assert (out / "ckpt_part" / "manifest.json").exists()
    weights = sorted((out / "ckpt_full").rglob("weights.pt"))
    assert weights
    expected = set(worker.make_model().state_dict())
    for path in weights:  # plain (unwrapped) weights: no DDP "module." prefix
        assert set(torch.load(path, weights_only=True)) == expected
    # rank 1 was given its own directory: it never writes, so it never appears
    assert not r0["ckpt_rank1_exists"] and not r1["ckpt_rank1_exists"]
    assert not (out / "ckpt_rank1").exists()
    for result in (r0, r1):
        # rank 1 loaded rank 0's checkpoint right after run() returned: the write was done
        assert result["resume_counts"] == [10, 2, 10]
        assert result["resume_max_diff"] == 0.0
        assert result["resume_validation"] == result["validation"]


def test_early_stopping_stops_every_rank_at_the_same_step(train_run):
    _, r0, r1 = train_run
    assert r0["early_stop"] == r1["early_stop"] == [3, True]


def test_teardown_destroys_the_group_the_hook_created(train_run):
    _, r0, r1 = train_run
    for result in (r0, r1):
        assert result["group_after_run"] is False and result["manager_after_run"] is False
        assert result["group_at_end"] is False


# --------------------------------------------------------------------------- failures
@pytest.mark.parametrize("mode", ["exit", pytest.param("stall", marks=pytest.mark.slow)])
def test_a_rank_that_dies_or_stalls_fails_the_other_with_a_clear_bounded_error(tmp_path, mode):
    port = free_port()

    def env(rank):  # Slurm variables only: the hook initialises from them
        return {
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "NVALCHEMI_DIST_TIMEOUT_S": "4",
            "TEST_PEER_MODE": mode,
        }

    (result,) = run_worker(
        "peer_dies", tmp_path, rendezvous="none", env=env, wait_for=(0,), timeout=240
    )  # exit code 0 is checked by run_ranks
    assert result["outcome"] != "returned"
    assert "DDPHook: rank 0 of 2 lost contact" in result["message"]
    assert "NVALCHEMI_DIST_TIMEOUT_S" in result["message"]
    # bounded by the 4 s timeout, not PyTorch's 30 min (what the collective waited, not a clock)
    assert "each collective waits at most 4 s" in result["message"]
    assert mode == "exit" or "Timed out waiting 4000ms" in result["message"]
    assert result["group_after"] is False


# --------------------------------------------------------------------------- launchers
def _torchrun(args, cwd):
    return run_torchrun(args, cwd=cwd, timeout=180, env={"NVALCHEMI_DIST_TIMEOUT_S": "60"}).stdout


EXAMPLE_ARGS = [
    "--steps=4",
    "--batch-size=4",
    "--val-size=6",
    "--val-every=2",
    "--fit-size=16",
    "--hidden=8",
    "--checkpoint-every=2",
]


def test_example_runs_under_torchrun_with_two_ranks(tmp_path):
    stdout = _torchrun([str(REPO / "examples" / "ddp_training.py"), *EXAMPLE_ARGS], tmp_path)
    assert "2 rank(s) (gloo)" in stdout and "done: 4 steps" in stdout
    assert stdout.count("val loss") == 2  # rank 0 prints, at steps 2 and 4
    assert "(6 structures)" in stdout  # the whole validation set, from two slices
    assert (tmp_path / "runs/ddp_example/checkpoints/manifest.json").exists()


def test_example_runs_as_a_single_process(tmp_path, monkeypatch, capsys):
    import runpy

    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    script = str(REPO / "examples" / "ddp_training.py")
    monkeypatch.setattr(sys, "argv", [script, *EXAMPLE_ARGS])
    runpy.run_path(script, run_name="__main__")
    stdout = capsys.readouterr().out
    assert "1 rank(s) (single process)" in stdout and "done: 4 steps" in stdout
    assert not torch.distributed.is_initialized()


SEED_BLOCK = """
from nvalchemi.distributed import DistributedManager
from nvalchemi.training.hooks import DDPHook

DistributedManager.initialize()  # also handles single-process runs
manager = DistributedManager()

strategy = TrainingStrategy(
    models=model,
    optimizer_configs=OptimizerConfig(
        optimizer_cls=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-4}
    ),
    loss_fn=EnergyMSELoss() + ForceMSELoss(),
    distributed_manager=manager,
    hooks=[DDPHook(), CheckpointHook("runs/ddp/checkpoints", epoch_interval=1)],
    num_epochs=20,
)
strategy.run(train_loader)
"""

SEED_HOOK_BLOCK = """
>>> import torch
>>> from nvalchemi.training import (
...     EnergyMSELoss, OptimizerConfig, TrainingStrategy, default_training_fn,
... )
>>> from nvalchemi.training.hooks.ddp import DDPHook
>>> strategy = TrainingStrategy(
...     models=model,
...     optimizer_configs=OptimizerConfig(
...         optimizer_cls=torch.optim.Adam, optimizer_kwargs={"lr": 1e-3},
...     ),
...     training_fn=default_training_fn,
...     loss_fn=EnergyMSELoss(),
...     num_epochs=10,
...     devices=[torch.device("cuda")],
...     hooks=[DDPHook()],
... )
>>> strategy.run(train_loader)
"""

SEED_HOOK_OPTIONS = """
>>> hook = DDPHook(
...     model_keys=("main",),
...     backend="gloo",
...     find_unused_parameters=True,
...     broadcast_buffers=False,
... )
"""

SEED_SCRIPT = """
import json
import torch
from nvalchemi.data import AtomicData
from nvalchemi.data.datapipes import DataLoader, InMemoryDataset
from nvalchemi.models.demo import DemoModel, DemoModelWrapper
from nvalchemi.training import (
    CheckpointHook, EnergyMSELoss, ForceMSELoss, OptimizerConfig, TrainingStrategy,
)

g = torch.Generator().manual_seed(0)
structures = [
    AtomicData(
        atomic_numbers=torch.randint(1, 5, (3,), generator=g),
        positions=torch.randn(3, 3, generator=g),
        energy=torch.randn(1, 1, generator=g),
        forces=torch.randn(3, 3, generator=g),
    )
    for _ in range(8)
]
train_loader = DataLoader(InMemoryDataset(data_list=structures), batch_size=2, shuffle=True)
model = DemoModelWrapper(DemoModel(num_atom_types=10, hidden_dim=8))
{seed_block}
first = dict(steps=strategy.step_count, epochs=strategy.epoch_count,
             unwrapped=strategy.models["main"] is model, rank=manager.rank,
             world=manager.world_size, batches_per_epoch=len(train_loader))
model = DemoModelWrapper(DemoModel(num_atom_types=10, hidden_dim=8))
train_loader = DataLoader(InMemoryDataset(data_list=structures), batch_size=2, shuffle=True)
{hook_block}
{hook_options}
with open(f"result_{{manager.rank}}.json", "w") as f:  # stdout of both ranks interleaves
    json.dump(dict(first=first, second_steps=strategy.step_count,
                   find_unused=hook.find_unused_parameters, backend=hook.backend), f)
DistributedManager.cleanup()
"""


def _doctest_code(block: str) -> str:
    lines = [line[4:] for line in block.strip().splitlines() if line[:4] in (">>> ", "... ")]
    return "\n".join(lines)


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


@pytest.mark.skipif(not (SEED.exists() and SEED_HOOK.exists()), reason="seed files not available")
def test_seed_blocks_are_verbatim():
    assert _squash(SEED_BLOCK) in _squash(SEED.read_text())
    hook_seed = _squash(SEED_HOOK.read_text())
    assert _squash(SEED_HOOK_BLOCK) in hook_seed and _squash(SEED_HOOK_OPTIONS) in hook_seed


def _seed_script(directory: Path) -> Path:
    hook_block = _doctest_code(SEED_HOOK_BLOCK)
    if not torch.cuda.is_available():  # the seed targets GPUs; the same code on CPU ranks
        hook_block = hook_block.replace('torch.device("cuda")', 'torch.device("cpu")')
    script = directory / "seed_ddp.py"
    script.write_text(
        SEED_SCRIPT.format(
            seed_block=textwrap.dedent(SEED_BLOCK),
            hook_block=hook_block,
            hook_options=_doctest_code(SEED_HOOK_OPTIONS),
        )
    )
    return script


def test_seed_ddp_examples_run_as_a_single_process(tmp_path, monkeypatch):
    import runpy

    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    runpy.run_path(str(_seed_script(tmp_path)), run_name="__main__")
    result = json.loads((tmp_path / "result_0.json").read_text())
    assert result["first"]["world"] == 1 and result["first"]["batches_per_epoch"] == 4
    assert result["first"]["steps"] == 80 and result["second_steps"] == 40
    assert (tmp_path / "runs/ddp/checkpoints/manifest.json").exists()


def test_seed_ddp_examples_run_under_torchrun(tmp_path):
    script = _seed_script(tmp_path)
    _torchrun([str(script)], tmp_path)
    results = [json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        first = result["first"]
        assert first["world"] == 2 and first["batches_per_epoch"] == 2  # 8 structures / 2 / 2
        assert first["epochs"] == 20 and first["steps"] == 40 and first["unwrapped"]
        assert result["second_steps"] == 20
        assert result["find_unused"] is True and result["backend"] == "gloo"
    assert sorted(r["first"]["rank"] for r in results) == [0, 1]
    assert (tmp_path / "runs/ddp/checkpoints/manifest.json").exists()
