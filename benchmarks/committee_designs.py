"""Two ways to train a committee of N PaiNN members on one batch: which is faster?

* ``loop``: :class:`nvalchemi.models.committee.Committee`, one process where every batch
  feeds every member in turn (collation and neighbour lists paid once); the committee
  loss is each member's loss, averaged (``nvalchemi.app.committee.committee_loss``).
* ``stacked``: the members' parameters stacked into one batched model
  (``torch.func.stack_module_state``) and evaluated with ``torch.func.vmap``; forces by
  ``torch.func.grad`` inside the ``vmap``. PaiNN's message passing accumulates into a
  fresh tensor in place, which ``vmap`` refuses, so this design runs a copy of PaiNN's
  interaction block written with out-of-place ``index_add`` (checked against the loop's
  energies and forces before timing).

Also timed: one member alone (``single``), and collation + neighbour lists of a batch,
which N separate training runs would pay N times.

One step: forward (energy and forces, forces by autograd with a differentiable graph),
a per-atom energy + force MSE averaged over the members, backward, Adam step. Bulk fcc
Cu/Au cells of 32 atoms (rattled), 16 per batch, float32, the quickstart PaiNN (32
channels, 2 blocks, 16 radial functions, cutoff 5 Å). Prints one JSON line per design.

Measured (2 shared CPU cores, ``OMP_WAIT_POLICY=PASSIVE``, 2 threads, N = 4): single
1.48 steps/s, loop 0.39, stacked 0.34; with 1 thread: 1.45, 0.36, 0.32. The loop costs
what N single models cost and the stacked design about 15 % more, so ``Committee`` loops.
On a machine loaded by other processes, OpenMP's default spin-waiting slows the loop's
many small operations more than the stacked design's few large ones (then stacked came
out ahead, 0.15 against 0.09 steps/s): set ``OMP_WAIT_POLICY=PASSIVE`` there. Not
measured on a GPU, where the stacked design's fewer kernel launches may pay.

Usage: ``python benchmarks/committee_designs.py [--members 4] [--steps 10] [--threads 2]``
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
from torch import nn

MEMBER = {"cutoff": 5.0, "hidden_channels": 32, "num_interactions": 2, "num_rbf": 16}


def _cells(count: int, atoms_per_cell: int):
    import numpy as np
    from ase.build import bulk

    from nvalchemi.data import AtomicData

    repeat = round((atoms_per_cell / 4) ** (1 / 3))
    out = []
    for i in range(count):
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True) * (repeat, repeat, repeat)
        atoms.numbers[np.random.default_rng(i).random(len(atoms)) < 0.25] = 79
        atoms.rattle(0.05, seed=i)
        out.append(AtomicData.from_atoms(atoms, dtype=torch.float32))
    return out


def _collate(cells, cutoff):
    from nvalchemi.data import Batch
    from nvalchemi.data.neighbors import compute_neighbors

    batch = Batch.from_data_list(cells)
    compute_neighbors(batch, cutoff=cutoff)
    return batch


class _OutOfPlaceInteraction(nn.Module):
    """PaiNN's interaction block with out-of-place accumulation (what ``vmap`` accepts).

    The same parameters and arithmetic as ``nvalchemi.models.painn._Interaction``.
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.hidden = block.hidden
        self.filter_net = block.filter_net
        self.message_mlp = block.message_mlp
        self.vector_mix = block.vector_mix
        self.update_mlp = block.update_mlp

    def forward(self, s, v, radial, directions, centers, neighbors, norm):
        f = self.hidden
        phi = self.message_mlp(s)
        if v is None:  # as PaiNN: the v-gating third of the first block's message is zero
            phi = torch.cat([phi[..., :f], phi[..., 2 * f :]], dim=-1)
            weight = self.filter_net.weight
            filters = nn.functional.linear(radial, torch.cat([weight[:f], weight[2 * f :]]))
            ds_edge, dvs_edge = (phi.index_select(0, neighbors) * filters).split(f, dim=-1)
            dv_edge = dvs_edge.unsqueeze(1) * directions.unsqueeze(-1)
        else:
            x = phi.index_select(0, neighbors) * self.filter_net(radial)
            ds_edge, dvv_edge, dvs_edge = x.split(f, dim=-1)
            dv_edge = dvs_edge.unsqueeze(1) * directions.unsqueeze(-1)
            dv_edge = dv_edge + v.index_select(0, neighbors) * dvv_edge.unsqueeze(1)
        s = s + norm * torch.zeros_like(s).index_add(0, centers, ds_edge)
        dv = s.new_zeros(s.shape[0], 3, f).index_add(0, centers, dv_edge)
        v = norm * dv if v is None else v + norm * dv
        u_v, v_v = self.vector_mix(v).split(f, dim=-1)
        v_norm = torch.sqrt((v_v * v_v).sum(dim=1) + 1e-8)
        a = self.update_mlp(torch.cat([s, v_norm], dim=-1))
        a_vv, a_sv, a_ss = a.split(f, dim=-1)
        s = s + a_sv * (u_v * v_v).sum(dim=1) + a_ss
        return s, v + a_vv.unsqueeze(1) * u_v


class _StackedEnergy(nn.Module):
    """Per-structure energies of one PaiNN as a function of positions (for ``vmap``)."""

    def __init__(self, member: nn.Module, inputs: dict) -> None:
        super().__init__()
        self.member = copy.deepcopy(member)
        self.member.interactions = nn.ModuleList(
            _OutOfPlaceInteraction(b) for b in self.member.interactions
        )
        self.inputs = inputs

    def forward(self, positions):
        x, m = self.inputs, self.member
        s = m.node_features(
            x["species"], positions, x["neighbor_list"], x["shifts"], x["cell"], x["batch_idx"]
        )
        per_atom = m.atomic_energy(x["species"], s, 0)
        return per_atom.new_zeros(x["num_graphs"]).index_add(0, x["batch_idx"], per_atom)


def _loop_step(committee, loss_fn, batch, optimizer):
    from nvalchemi.training.strategy import default_training_fn

    def step():
        predictions = default_training_fn(committee, batch)
        loss = loss_fn(
            predictions,
            {"energy": batch.energy, "forces": batch.forces},
            batch=batch,
        )["total_loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def _stacked(committee, batch):
    """``(step, outputs)`` of the stacked design for the committee's members."""
    from torch.func import functional_call, grad, stack_module_state, vmap

    members = list(committee.members)
    inputs = members[0]._prepare(batch)
    energy_module = _StackedEnergy(members[0], inputs)
    stacked, _ = stack_module_state(members)
    params = {f"member.{k}": v.detach().clone().requires_grad_(True) for k, v in stacked.items()}
    buffers = {k: v for k, v in energy_module.named_buffers()}
    positions = inputs["positions"].detach()
    atoms = batch.num_nodes_per_graph.to(positions.dtype).reshape(-1, 1)

    def total(p, pos):
        energy = functional_call(energy_module, {**p, **buffers}, (pos,))
        return energy.sum(), energy

    def outputs():
        gradient, energy = vmap(grad(total, argnums=1, has_aux=True), in_dims=(0, None))(
            params, positions
        )
        return energy.unsqueeze(-1), -gradient  # [M, B, 1], [M, V, 3]

    optimizer = torch.optim.Adam(params.values(), lr=1e-3)

    def step():
        energy, forces = outputs()
        energy_loss = ((energy - batch.energy) / atoms).pow(2).mul(atoms).sum((1, 2))
        energy_loss = energy_loss / atoms.sum()
        force_loss = (forces - batch.forces).pow(2).mean((1, 2))
        loss = (10.0 * energy_loss + force_loss).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step, outputs


def _time_interleaved(steps: dict, count: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each step, the designs taking turns (a shared machine's load
    then weighs on all of them alike)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(count):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--atoms", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    from ase.calculators.emt import EMT

    from nvalchemi.app.committee import committee_loss
    from nvalchemi.models import PaiNN
    from nvalchemi.models.committee import Committee
    from nvalchemi.spec import create_model_spec
    from nvalchemi.training import EnergyMSELoss, ForceMSELoss

    torch.set_num_threads(args.threads)
    cells = _cells(args.batch_size, args.atoms)
    for data in cells:  # EMT labels, so the loss is a real one
        atoms = data.to_atoms()
        atoms.calc = EMT()
        data["energy"] = torch.tensor([[atoms.get_potential_energy()]], dtype=torch.float32)
        data["forces"] = torch.tensor(atoms.get_forces(), dtype=torch.float32)
    start = time.perf_counter()
    for _ in range(5):
        batch = _collate(cells, MEMBER["cutoff"])
    collate_ms = 1000 * (time.perf_counter() - start) / 5

    member = create_model_spec(PaiNN, elements=[29, 79], dtype=torch.float32, **MEMBER)
    loss_one = 10.0 * EnergyMSELoss(per_atom=True) + ForceMSELoss()
    single = PaiNN(elements=[29, 79], dtype=torch.float32, **MEMBER).train()
    single_opt = torch.optim.Adam(single.parameters(), lr=1e-3)
    committee = Committee([member], size=args.members).train()
    loop_opt = torch.optim.Adam(committee.parameters(), lr=1e-3)
    loss = committee_loss(loss_one, args.members)
    stacked_step, stacked_outputs = _stacked(committee, batch)
    with torch.no_grad():  # the stacked design computes what the loop computes
        reference = committee.eval()(batch)
        energy, forces = stacked_outputs()
    agree = max(
        max(
            float((energy[i] - reference[f"energy_m{i}"]).abs().max()) for i in range(args.members)
        ),
        max(
            float((forces[i] - reference[f"forces_m{i}"]).abs().max()) for i in range(args.members)
        ),
    )
    committee.train()
    steps = {
        "single": _loop_step(single, loss_one, batch, single_opt),
        "loop": _loop_step(committee, loss, batch, loop_opt),
        "stacked": stacked_step,
    }
    times = _time_interleaved(steps, args.steps, args.warmup)
    rows = [(name, 1 if name == "single" else args.members, times[name]) for name in steps]
    for design, members, times in rows:
        median = statistics.median(times)
        print(
            json.dumps(
                {
                    "benchmark": "committee_designs",
                    "design": design,
                    "members": members,
                    "atoms_per_structure": args.atoms,
                    "batch_size": args.batch_size,
                    "threads": torch.get_num_threads(),
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                    "steps_per_s": round(1 / median, 3),
                    "ms_per_step": round(1000 * median, 1),
                    "best_ms_per_step": round(1000 * min(times), 1),
                    "collate_and_neighbours_ms": round(collate_ms, 1),
                    "stacked_vs_loop_max_abs_diff": agree,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
