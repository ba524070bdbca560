"""Rank side of the distributed validation test (run as a script, one process per rank).

Every rank builds the same batches and model; each validates its shard with a
``ValidationLoop`` under a 2-process gloo group and reports the summaries of two sharding scenarios: uneven shards (3 batches vs 1) and a rank with no
batches at all. :func:`single_process_summary` is the reference the test compares to.
"""

from __future__ import annotations

import torch
from _ranks import init_group, report, teardown

from nvalchemi.data import AtomicData, Batch
from nvalchemi.training import (
    EnergyMSELoss,
    ForceMSELoss,
    ValidationConfig,
    ValidationLoop,
    default_training_fn,
)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(8, 4)
        self.out = torch.nn.Linear(7, 1)

    def forward(self, batch):
        with torch.enable_grad():
            positions = batch.positions.detach().requires_grad_(True)
            features = torch.cat([self.embedding(batch.atomic_numbers), positions], dim=-1)
            atom = self.out(features).squeeze(-1)
            energy = atom.new_zeros(batch.num_graphs).index_add(0, batch.batch_idx, atom)
            (grad,) = torch.autograd.grad(energy.sum(), positions)
        return {"energy": energy.unsqueeze(-1), "forces": -grad}


def batches() -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for i, (count, atoms) in enumerate([(2, 3), (3, 2), (1, 5), (4, 1)]):
        structures = []
        for j in range(count):
            fields = {
                "atomic_numbers": torch.randint(1, 8, (atoms,), generator=generator),
                "positions": torch.randn(atoms, 3, generator=generator),
                "energy": torch.randn(1, 1, generator=generator),
                "forces": torch.randn(atoms, 3, generator=generator),
            }
            if i == 1 and j == 0:
                del fields["energy"]  # a missing label (NaN in the batch)
            structures.append(AtomicData(**fields))
        out.append(Batch.from_data_list(structures))
    return out


def summary(data: list[Batch]) -> dict:
    config = ValidationConfig(validation_data=data)
    loop = ValidationLoop(
        validation_data=data,
        config=config,
        device="cpu",
        model=Model(),
        loss_fn=EnergyMSELoss(per_atom=True) + ForceMSELoss(),
        validation_fn=default_training_fn,
    )
    with loop:
        return loop.execute()


def single_process_summary() -> dict:
    return summary(batches())


def floats(result: dict) -> dict:
    values = {
        k: float(v)
        for k, v in result.items()
        if isinstance(v, torch.Tensor) or (isinstance(v, (int, float)) and not isinstance(v, bool))
    }
    return {"values": values, "distributed_reduced": result["distributed_reduced"]}


def main() -> None:
    rank = init_group()
    data = batches()
    uneven = data[:3] if rank == 0 else data[3:]
    empty_rank = data if rank == 0 else []
    result = {"uneven": floats(summary(uneven)), "empty_rank": floats(summary(empty_rank))}
    report(**result)
    teardown()


if __name__ == "__main__":
    main()
