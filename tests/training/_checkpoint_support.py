"""Small strategies and components for the checkpoint tests."""

from __future__ import annotations

from typing import Any

import torch

from nvalchemi.data import AtomicData, Batch
from nvalchemi.models.demo import DemoModel, DemoModelWrapper
from nvalchemi.training import EnergyMSELoss, ForceMSELoss, OptimizerConfig, TrainingStrategy


def batches(n: int = 3, seed: int = 0, nan: bool = False) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        structures = []
        for _ in range(2):
            positions = torch.randn(3, 3, generator=generator)
            if nan:
                positions[0, 0] = float("nan")
            structures.append(
                AtomicData(
                    atomic_numbers=torch.randint(1, 5, (3,), generator=generator),
                    positions=positions,
                    energy=torch.randn(1, 1, generator=generator),
                    forces=torch.randn(3, 3, generator=generator),
                )
            )
        out.append(Batch.from_data_list(structures))
    return out


def demo_model(seed: int = 0, hidden: int = 4) -> DemoModelWrapper:
    torch.manual_seed(seed)
    return DemoModelWrapper(DemoModel(num_atom_types=8, hidden_dim=hidden))


def strategy(
    model: Any = None,
    *,
    lr: float = 1e-2,
    scheduler: bool = True,
    num_steps: int = 4,
    hooks: list[Any] | None = None,
    **kwargs: Any,
) -> TrainingStrategy:
    config = OptimizerConfig(
        torch.optim.Adam,
        {"lr": lr},
        torch.optim.lr_scheduler.StepLR if scheduler else None,
        {"step_size": 2, "gamma": 0.5} if scheduler else {},
    )
    return TrainingStrategy(
        models=model if model is not None else demo_model(),
        optimizer_configs=config,
        loss_fn=EnergyMSELoss() + ForceMSELoss(),
        num_steps=num_steps,
        hooks=hooks or [],
        **kwargs,
    )


def linear_components(seed: int = 0) -> tuple[dict, dict, dict]:
    """``models``, ``optimizers``, ``schedulers`` for the component form (a Linear layer)."""
    from nvalchemi.training import create_model_spec

    torch.manual_seed(seed)
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    return (
        {"main": (layer, create_model_spec(torch.nn.Linear, in_features=3, out_features=2))},
        {"opt": (optimizer, create_model_spec(torch.optim.SGD, lr=0.1, momentum=0.9))},
        {
            "sched": (
                scheduler,
                create_model_spec(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
            )
        },
    )


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
