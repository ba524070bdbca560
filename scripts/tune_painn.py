"""Find a PaiNN training recipe for the bundled EMT data set on a small CPU budget.

A deliberately plain PyTorch loop (no nvalchemi trainer): AdamW, per-atom energy +
force MSE, linear warm-up then cosine learning-rate decay, parameter EMA, gradient
clipping. Neighbour lists are computed once per structure. Prints one JSON line per
evaluation (the learning curve) and a final JSON summary with test-split MAEs.

The schedule is defined over ``--epochs``; with ``--minutes`` instead, it is defined
over wall-clock time (the fraction of the budget used), so a run always finishes its
decay inside the budget.

The defaults are the recipe found for the bundled EMT set (2400 training
structures): ``PaiNN.from_data(train, cutoff=5.0, hidden_channels=32,
num_interactions=2, num_rbf=16)`` (27k parameters), batch size 8, AdamW lr 3e-3
(no weight decay), 3 % linear warm-up then cosine decay to 1 % of the peak, loss
``10 * MSE(E/N) + MSE(F)`` (eV/atom and eV/Å), gradient clipping at 10, EMA 0.995
of the weights for evaluation. In 14 minutes on 2 CPU cores (about 36 epochs) it
reached test MAEs of 1.8 meV/atom (energy) and 11 meV/Å (forces). A small model
that sees many epochs beats a larger one in a fixed CPU budget; a larger energy
weight (30) or a 5.5 Å cutoff did not help.

Usage::

    python scripts/tune_painn.py --minutes 14 --threads 2
    python scripts/tune_painn.py --epochs 20 --hidden 64 --cutoff 5.5 --energy-weight 30
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.neighbors import neighbor_list_for_system
from nvalchemi.models import PaiNN


def load_split(split: str, data_dir: str | None):
    """ase.Atoms of a split: the bundled files, or a freshly generated copy in data_dir."""
    from nvalchemi.data import bundled

    try:
        return bundled.load_bundled_atoms(split, data_dir)
    except FileNotFoundError:
        from nvalchemi.data.emt_generator import write_dataset

        out = Path(data_dir or "/tmp/nvalchemi_emt")
        if not (out / f"{split}.extxyz.gz").exists():
            write_dataset(out)
        from ase.io import read

        return list(read(out / f"{split}.extxyz.gz", index=":"))


def to_data(atoms_list, cutoff: float, dtype: torch.dtype) -> list[AtomicData]:
    """AtomicData with labels and a precomputed full neighbour list."""
    out = []
    for atoms in atoms_list:
        data = AtomicData.from_atoms(atoms, dtype=dtype)
        cell = data.cell[0].double() if "cell" in data else None
        pbc = data.pbc[0] if "pbc" in data else None
        pairs, shifts = neighbor_list_for_system(data.positions, cell, pbc, cutoff)
        data.neighbor_list = torch.from_numpy(pairs)
        data.neighbor_list_shifts = torch.from_numpy(shifts)
        out.append(data)
    return out


def batches(data: list[AtomicData], batch_size: int, shuffle: bool, rng: random.Random):
    order = list(range(len(data)))
    if shuffle:
        rng.shuffle(order)
    for start in range(0, len(order), batch_size):
        yield Batch.from_data_list([data[i] for i in order[start : start + batch_size]])


@torch.no_grad()
def evaluate(model, data: list[AtomicData], batch_size: int = 32) -> dict[str, float]:
    """Energy MAE (meV/atom), force MAE (meV/Å, per component), energy RMSE (meV/atom)."""
    was_training = model.training
    model.eval()
    e_abs, e_sq, f_abs, n_struct, n_comp = 0.0, 0.0, 0.0, 0, 0
    for batch in batches(data, batch_size, False, random.Random(0)):
        out = model(batch)
        natoms = batch.num_nodes_per_graph.unsqueeze(-1)
        de = ((out["energy"] - batch.energy) / natoms).double()
        df = (out["forces"] - batch.forces).double()
        e_abs += float(de.abs().sum())
        e_sq += float((de**2).sum())
        f_abs += float(df.abs().sum())
        n_struct += batch.num_graphs
        n_comp += df.numel()
    model.train(was_training)
    return {
        "energy_mae_mev_atom": 1000 * e_abs / n_struct,
        "energy_rmse_mev_atom": 1000 * math.sqrt(e_sq / n_struct),
        "force_mae_mev_a": 1000 * f_abs / n_comp,
    }


def lr_factor(progress: float, warmup: float, final: float) -> float:
    """Linear warm-up over ``warmup`` of the run, then cosine decay to ``final``."""
    if progress < warmup:
        return max(progress / warmup, 0.01)
    t = min((progress - warmup) / max(1.0 - warmup, 1e-9), 1.0)
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * t))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=None, help="wall-clock budget")
    p.add_argument("--epochs", type=int, default=None, help="epoch budget (overrides minutes)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--limit", type=int, default=None, help="use the first N train structures")
    p.add_argument("--cutoff", type=float, default=5.0)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rbf", type=int, default=16)
    p.add_argument("--cutoff-fn", default="cosine")
    p.add_argument("--normalize", action="store_true", help="divide messages by avg neighbours")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--final-lr", type=float, default=0.01, help="final lr / peak lr")
    p.add_argument("--warmup", type=float, default=0.03, help="fraction of the run")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--energy-weight", type=float, default=10.0)
    p.add_argument("--force-weight", type=float, default=1.0)
    p.add_argument("--ema", type=float, default=0.995, help="0 disables EMA")
    p.add_argument("--clip", type=float, default=10.0)
    p.add_argument("--eval-every", type=float, default=60.0, help="seconds between evals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, help="write the final (EMA) model here")
    args = p.parse_args(argv)
    if args.minutes is None and args.epochs is None:
        args.minutes = 14.0

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    np.random.seed(args.seed)

    t0 = time.perf_counter()
    splits = {s: load_split(s, args.data_dir) for s in ("train", "val", "test")}
    if args.limit:
        splits["train"] = splits["train"][: args.limit]
    data = {s: to_data(a, args.cutoff, torch.float32) for s, a in splits.items()}
    prep_s = time.perf_counter() - t0

    model = PaiNN.from_data(
        data["train"],
        cutoff=args.cutoff,
        hidden_channels=args.hidden,
        num_interactions=args.layers,
        num_rbf=args.rbf,
        cutoff_fn=args.cutoff_fn,
        dtype=torch.float32,
        avg_num_neighbors="auto" if args.normalize else None,
    )
    ema = None
    if args.ema > 0:
        ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(args.ema)
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "event": "start",
                "args": vars(args),
                "params": num_params,
                "prep_s": round(prep_s, 1),
                "train_structures": len(data["train"]),
                "mean_neighbors": model.avg_num_neighbors,
                "scale": model.scale,
                "shift": model.shift,
            }
        ),
        flush=True,
    )

    start = time.perf_counter()
    budget = None if args.epochs is not None else args.minutes * 60.0
    steps_per_epoch = math.ceil(len(data["train"]) / args.batch_size)
    total_steps = None if args.epochs is None else args.epochs * steps_per_epoch
    step, epoch, last_eval, curve = 0, 0, start, []
    loss = torch.zeros(())

    def progress() -> float:
        if total_steps is not None:
            return step / total_steps
        return (time.perf_counter() - start) / budget

    def log_eval(now: float) -> None:
        val = evaluate(ema.module if ema is not None else model, data["val"])
        point = {
            "event": "eval",
            "epoch": round(step / steps_per_epoch, 2),
            "step": step,
            "minutes": round((now - start) / 60, 2),
            "lr": optimizer.param_groups[0]["lr"],
            "train_loss": float(loss),
            **{f"val_{k}": round(v, 2) for k, v in val.items()},
        }
        curve.append(point)
        print(json.dumps(point), flush=True)

    done = False
    while not done:
        model.train()
        for batch in batches(data["train"], args.batch_size, True, rng):
            for group in optimizer.param_groups:
                group["lr"] = args.lr * lr_factor(progress(), args.warmup, args.final_lr)
            out = model(batch)
            natoms = batch.num_nodes_per_graph.unsqueeze(-1)
            e_loss = (((out["energy"] - batch.energy) / natoms) ** 2).mean()
            f_loss = ((out["forces"] - batch.forces) ** 2).mean()
            loss = args.energy_weight * e_loss + args.force_weight * f_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            if ema is not None:
                ema.update_parameters(model)
            step += 1
            if progress() >= 1.0:
                done = True
                break
            now = time.perf_counter()
            if now - last_eval >= args.eval_every:
                eval_start = time.perf_counter()
                log_eval(now)
                # Evaluation time does not count against a wall-clock budget.
                start += time.perf_counter() - eval_start
                last_eval = time.perf_counter()
        epoch += 1
    log_eval(time.perf_counter())

    final = ema.module if ema is not None else model
    train_minutes = (time.perf_counter() - start) / 60
    test = evaluate(final, data["test"])
    val = evaluate(final, data["val"])
    summary = {
        "event": "final",
        "epochs": round(step / steps_per_epoch, 2),
        "steps": step,
        "train_minutes": round(train_minutes, 2),
        "seconds_per_epoch": round(train_minutes * 60 / max(step / steps_per_epoch, 1e-9), 1),
        "params": num_params,
        **{f"test_{k}": round(v, 2) for k, v in test.items()},
        **{f"val_{k}": round(v, 2) for k, v in val.items()},
    }
    if ema is not None:  # how much the EMA helps
        raw = evaluate(model, data["test"])
        summary.update({f"test_no_ema_{k}": round(v, 2) for k, v in raw.items()})
    print(json.dumps(summary), flush=True)
    if args.save:
        final.export_model(args.save)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
