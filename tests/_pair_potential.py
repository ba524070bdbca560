"""A scripted Morse pair potential that follows the export contract (single system).

Engine tests use it as "anything that follows the contract" independently of the
export code: ``forward(inputs)`` takes positions, atomic_numbers, cell, pbc,
edge_index (both directions) and Cartesian shifts; returns energy, atomic_energies,
forces and, when any pbc, stress (ASE's sign) and virial (= -stress * volume).
"""

from __future__ import annotations

import math

import torch


class MorsePair(torch.nn.Module):
    """``E = 1/2 sum_ij D [(1 - exp(-a (r - r0)))^2 - 1] fc(r)`` with a cosine cutoff."""

    def __init__(
        self, atomic_numbers: list[int], cutoff: float = 5.0, dtype: torch.dtype = torch.float64
    ):
        super().__init__()
        self.cutoff = float(cutoff)
        self.atomic_numbers = list(atomic_numbers)
        # per-element well depth, so that types mapped to different elements differ
        depth = torch.zeros(119, dtype=dtype)
        for k, z in enumerate(atomic_numbers):
            depth[z] = 0.3 + 0.1 * k
        self.register_buffer("depth", depth)
        self.register_buffer("known", torch.zeros(119, dtype=torch.bool))
        for z in atomic_numbers:
            self.known[z] = True

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        numbers = inputs["atomic_numbers"]
        if not bool(self.known[numbers].all()):
            raise ValueError("unknown element " + str(int(numbers[~self.known[numbers]][0])))
        positions = inputs["positions"].to(self.depth.dtype)
        shifts = inputs["shifts"].to(self.depth.dtype)
        cell = inputs["cell"].to(self.depth.dtype)
        periodic = bool(inputs["pbc"].any())
        strain = torch.zeros(3, 3, dtype=positions.dtype).requires_grad_(True)
        deform = torch.eye(3, dtype=positions.dtype) + strain
        pos = positions.detach().requires_grad_(True)
        p = pos @ deform
        i, j = inputs["edge_index"][0], inputs["edge_index"][1]
        vec = p[j] - p[i] + shifts @ deform
        r = torch.linalg.vector_norm(vec, dim=1)
        d = torch.sqrt(self.depth[numbers[i]] * self.depth[numbers[j]])
        fc = 0.5 * (torch.cos(math.pi * r / self.cutoff) + 1.0)
        pair = d * ((1.0 - torch.exp(-1.4 * (r - 2.6))) ** 2 - 1.0) * fc
        atomic = 0.5 * torch.zeros_like(positions[:, 0]).index_add(0, i, pair)
        energy = atomic.sum()
        grads = torch.autograd.grad([energy], [pos, strain])
        de_dpos, de_dstrain = grads[0], grads[1]
        assert de_dpos is not None and de_dstrain is not None
        out: dict[str, torch.Tensor] = {
            "energy": energy.detach(),
            "atomic_energies": atomic.detach(),
            "forces": -de_dpos,
        }
        if periodic:
            volume = torch.det(cell).abs()
            out["stress"] = de_dstrain / volume
            out["virial"] = -de_dstrain
        return out
