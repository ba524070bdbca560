"""Framework overhead of ``TrainingStrategy`` with EMA + gradient clipping enabled.

Extends ``benchmarks/overhead.py`` (same small-MLP workload, imported from it): the strategy runs with ``EMAHook(decay=0.999)`` and
``GradientClipHook(max_norm=10.0)``; the hand-written loop does the same work by hand in
plain PyTorch (``F.mse_loss``, ``clip_grad_norm_`` and one fused ``torch._foreach_lerp_``
EMA update per step; none of our loss modules). The
``ratio`` (strategy / hand-written steps per second, target >= 0.85) measures what the
update-hook machinery adds; ``ratio_vs_plain`` compares with a plain loop without EMA
or clipping (the cost of the features themselves).

On CPU the clock is the process CPU time (robust on a shared machine), else wall time
with synchronisation. Output: one JSON line per workload. Usage::

    python benchmarks/overhead_update_hooks.py [--rounds 9] [--steps 300] [--device cpu]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
from overhead import SmallMLP, clock, hand_loss, make_batches, sync  # a sibling script

from nvalchemi.training import EnergyMSELoss, ForceMSELoss, OptimizerConfig, TrainingStrategy
from nvalchemi.training.hooks import EMAHook, GradientClipHook


def hand_loop(model, shadow, optimizer, batches, steps, forces, *, extras) -> None:
    """zero_grad, forward, loss, backward, [clip], step, [EMA update]."""
    params = list(model.parameters())
    shadow_tensors = [*shadow.parameters(), *shadow.buffers()]
    live_tensors = [*model.parameters(), *model.buffers()]
    n = len(batches)
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        hand_loss(model, batches[i % n], forces).backward()
        if extras:
            torch.nn.utils.clip_grad_norm_(params, 10.0)
        optimizer.step()
        if extras:
            with torch.no_grad():
                torch._foreach_lerp_(shadow_tensors, live_tensors, 1.0 - 0.999)


def measure(workload: str, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    forces = workload == "forces"
    atoms, size = (16, 32) if forces else (4, 8)
    batches = make_batches(16, atoms, size, device)
    torch.manual_seed(0)
    model_s = SmallMLP(32, forces).to(device)
    model_h = copy.deepcopy(model_s).train()
    model_p = copy.deepcopy(model_s).train()
    shadow = copy.deepcopy(model_s)
    loss = EnergyMSELoss() + ForceMSELoss() if forces else EnergyMSELoss()
    strategy = TrainingStrategy(
        models=model_s,
        optimizer_configs=OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
        loss_fn=loss,
        num_steps=args.steps,
        devices=[device],
        hooks=[EMAHook(decay=0.999), GradientClipHook(max_norm=10.0)],
    )
    opt_h = torch.optim.Adam(model_h.parameters(), lr=1e-3)
    opt_p = torch.optim.Adam(model_p.parameters(), lr=1e-3)
    now = clock(device)
    steps = args.steps
    rates: dict[str, list[float]] = {"strategy": [], "hand": [], "plain": []}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        if round_index:
            strategy.num_steps += steps
        timings = {}
        for name in ("strategy", "hand", "plain"):
            sync(device)
            start = now()
            if name == "strategy":
                strategy.run(batches)
            else:
                model, opt = (model_h, opt_h) if name == "hand" else (model_p, opt_p)
                hand_loop(model, shadow, opt, batches, steps, forces, extras=name == "hand")
            sync(device)
            timings[name] = now() - start
        if round_index:
            for name, seconds in timings.items():
                rates[name].append(steps / seconds)
    s, h, p = (statistics.median(rates[k]) for k in ("strategy", "hand", "plain"))
    return {
        "benchmark": "overhead_update_hooks",
        "workload": workload,
        "hooks": ["EMAHook(decay=0.999)", "GradientClipHook(max_norm=10.0)"],
        "atoms_per_structure": atoms,
        "batch_size": size,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps_per_round": steps,
        "strategy_steps_per_s": round(s, 1),
        "hand_written_steps_per_s": round(h, 1),
        "plain_loop_steps_per_s": round(p, 1),
        "ratio": round(s / h, 4),
        "ratio_vs_plain": round(s / p, 4),
        "overhead_us_per_step": round((1 / s - 1 / h) * 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workloads", default="mlp,forces")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for workload in args.workloads.split(","):
        print(json.dumps(measure(workload, args)), flush=True)


if __name__ == "__main__":
    main()
