"""One case of ``benchmarks/gpu_check.sh``: a training-step measurement as one JSON line.

Cases (``--case``):

* ``step:MODEL:PRECISION:MODE``: ``MODEL`` ``painn`` or ``mace``, ``PRECISION``
  ``float32`` or ``bf16`` (``MixedPrecisionHook``), ``MODE`` ``eager`` or ``compiled``
  (``TrainingStrategy(compile=True)``). The median step time of ``TrainingStrategy.run``
  over pre-collated batches with lists (``step_ms``, ``structures_per_s``), the first
  step's time (``first_step_s``: the compilation for ``compiled``) and the peak memory.
  A model that cannot be compiled reports ``"status": "unsupported"`` and the reason.
* ``neighbors``: the batched neighbour-list builder on the device (median ms per batch),
  and whether its lists equal those built on the CPU.
* ``syncs``: host-device synchronisations inside one training step (``BEFORE_BATCH`` to
  ``AFTER_BATCH``, step 3 of a run), with lists precomputed and with lists built by the
  strategy on the device: ``torch.cuda.set_sync_debug_mode`` warnings and the
  ``cuda*Synchronize`` / device-to-host copies a ``torch.profiler`` trace shows. CUDA only.

Structures: rattled fcc Cu/Au cells (32 atoms, 16 per batch on CUDA; 4 atoms, 4 per
batch on the CPU), energy + forces + stress trained (PaiNN defaults; a small MACE).

Usage: ``python benchmarks/gpu_check.py --case step:painn:bf16:compiled [--device cuda]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings


def structures(device, count: int | None = None):
    import numpy as np
    import torch
    from ase.build import bulk
    from ase.calculators.emt import EMT

    from nvalchemi.data import AtomicData

    cuda = device.type == "cuda"
    count = count or (16 if cuda else 4)
    out = []
    for i in range(count):
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True) * ((2, 2, 2) if cuda else (1, 1, 1))
        atoms.numbers[np.random.default_rng(i).random(len(atoms)) < 0.25] = 79
        atoms.rattle(0.05, seed=i)
        atoms.calc = EMT()
        atoms.get_stress()
        out.append(AtomicData.from_atoms(atoms, dtype=torch.float32))
    return out


def batches(device, model, count: int, with_lists: bool = True):
    from nvalchemi.data import Batch
    from nvalchemi.data.neighbors import compute_neighbors

    data = structures(device)
    out = []
    for _ in range(count):
        batch = Batch.from_data_list(data)
        if with_lists:
            compute_neighbors(batch, config=model.model_config.neighbor_config)
        out.append(batch.to(device))
    return out


def build_model(name: str):
    import torch

    if name == "painn":
        from nvalchemi.models import PaiNN

        model = PaiNN(elements=[29, 79], dtype=torch.float32)
    else:
        from nvalchemi.models import MACEWrapper

        model = MACEWrapper.from_mace_kwargs(
            atomic_numbers=[29, 79],
            hidden_irreps="32x0e + 32x1o",
            max_ell=2,
            correlation=2,
            dtype="float32",
            seed=0,
        )
    model.set_config("active_outputs", {"energy", "forces", "stress"})
    return model


def strategy_for(model, device, precision: str, compiled: bool, steps: int, hooks=()):
    import torch

    from nvalchemi.training import (
        EnergyMSELoss,
        ForceMSELoss,
        OptimizerConfig,
        StressMSELoss,
        TrainingStrategy,
    )
    from nvalchemi.training.hooks import MixedPrecisionHook

    hooks = list(hooks)
    if precision == "bf16":
        hooks.append(MixedPrecisionHook(precision="bf16"))
    return TrainingStrategy(
        models=model,
        devices=[device],
        num_steps=steps,
        hooks=hooks,
        compile=compiled,
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-4}),
        loss_fn=EnergyMSELoss() + ForceMSELoss() + StressMSELoss(),
    )


class StepClock:
    """Hook timing every step from BEFORE_BATCH to AFTER_BATCH (synchronised on CUDA)."""

    frequency = 1
    stage = None

    def __init__(self, device) -> None:
        self.device = device
        self.times: list[float] = []
        self._start = 0.0

    def _runs_on_stage(self, stage) -> bool:
        return stage.name in ("BEFORE_BATCH", "AFTER_BATCH")

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, ctx, stage) -> None:
        self._sync()
        if stage.name == "BEFORE_BATCH":
            self._start = time.perf_counter()
        else:
            self.times.append(time.perf_counter() - self._start)


def case_step(args, device) -> dict:
    import torch

    _, model_name, precision, mode = args.case.split(":")
    model = build_model(model_name)
    clock = StepClock(device)
    steps = args.steps + args.warmup
    strategy = strategy_for(model, device, precision, mode == "compiled", steps, [clock])
    data = batches(device, model, 4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    loader = [data[i % len(data)] for i in range(steps)]
    result = {"model": model_name, "precision": precision, "mode": mode}
    try:
        strategy.run(loader)
    except Exception as exc:
        text = " ".join(str(exc).split())
        unsupported = "cannot train model" in text or "not supported" in text
        return {
            **result,
            "status": "unsupported" if unsupported else "error",
            "reason": f"{type(exc).__name__}: {text[:400]}",
        }
    timed = clock.times[args.warmup :]
    median = statistics.median(timed)
    batch = data[0]
    result.update(
        status="ok",
        atoms=batch.num_nodes,
        structures=batch.num_graphs,
        edges=batch.num_edges,
        steps=len(timed),
        step_ms=round(1000 * median, 3),
        structures_per_s=round(batch.num_graphs / median, 1),
        first_step_s=round(clock.times[0], 2),
        params=sum(p.numel() for p in model.parameters()),
    )
    if mode == "compiled":
        result["compiled_graphs"] = strategy.compiled_graphs
    if device.type == "cuda":
        result["peak_mem_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return result


def case_neighbors(args, device) -> dict:
    import torch

    from nvalchemi.data import Batch
    from nvalchemi.data.neighbors import compute_neighbors

    config = build_model("painn").model_config.neighbor_config
    data = structures(device)
    reference = Batch.from_data_list(data)
    compute_neighbors(reference, config=config)
    times = []
    for _ in range(args.warmup + args.steps):
        batch = Batch.from_data_list(data).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        compute_neighbors(batch, config=config)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    same = torch.equal(batch.neighbor_list.cpu(), reference.neighbor_list) and torch.equal(
        batch.neighbor_list_shifts.cpu(), reference.neighbor_list_shifts
    )
    median = statistics.median(times[args.warmup :])
    return {
        "atoms": batch.num_nodes,
        "structures": batch.num_graphs,
        "edges": batch.num_edges,
        "cutoff": config.cutoff,
        "ms_per_batch": round(1000 * median, 3),
        "structures_per_s": round(batch.num_graphs / median, 1),
        "matches_cpu_lists": same,
    }


class SyncCounter:
    """Hook counting synchronisations from BEFORE_BATCH to AFTER_BATCH of step ``at``."""

    frequency = 1
    stage = None

    def __init__(self, at: int) -> None:
        self.at = at
        self.warnings = 0
        self.profiled: dict[str, int] = {}
        self._catch = None
        self._profile = None

    def _runs_on_stage(self, stage) -> bool:
        return stage.name in ("BEFORE_BATCH", "AFTER_BATCH")

    def __call__(self, ctx, stage) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if ctx.step_count != self.at - 1 and self._catch is None:
            return
        if stage.name == "BEFORE_BATCH":
            torch.cuda.synchronize()
            self._catch = warnings.catch_warnings(record=True)
            self._records = self._catch.__enter__()
            warnings.simplefilter("always")
            self._profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._profile.__enter__()
            torch.cuda.set_sync_debug_mode("warn")
        elif self._catch is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._profile.__exit__(None, None, None)
            self._catch.__exit__(None, None, None)
            self.warnings = sum("synchroniz" in str(w.message).lower() for w in self._records)
            counts: dict[str, int] = {}
            for event in self._profile.events():
                name = event.name
                if "Synchronize" in name or "DtoH" in name or "Memcpy DtoH" in name:
                    counts[name] = counts.get(name, 0) + 1
            self.profiled = counts
            self._catch = None


def case_syncs(args, device) -> dict:
    if device.type != "cuda":
        return {"status": "skipped", "reason": "CUDA is absent: synchronisations are a GPU matter"}
    out = {}
    for label, with_lists in (("lists_precomputed", True), ("lists_built_by_strategy", False)):
        model = build_model("painn")
        counter = SyncCounter(at=3)
        strategy = strategy_for(model, device, "float32", False, 4, [counter])
        strategy.run(batches(device, model, 4, with_lists=with_lists))
        out[label] = {"sync_debug_warnings": counter.warnings, "profiled": counter.profiled}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    import torch

    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(2)
    kind = args.case.split(":")[0]
    run = {"step": case_step, "neighbors": case_neighbors, "syncs": case_syncs}[kind]
    start = time.perf_counter()
    try:
        result = run(args, device)
    except Exception as exc:  # one case failing never stops the others
        result = {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:400]}"}
    result = {"check": kind, "case": args.case, "device": str(device), **result}
    result.setdefault("status", "ok")
    result["wall_s"] = round(time.perf_counter() - start, 1)
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    print(json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
