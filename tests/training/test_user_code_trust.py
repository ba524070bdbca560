"""The seed's workflow with the user's own model class and training_fn, in fresh processes.

A user module ``common.py`` (not installed, not allow-listed) defines the model and the
``training_fn``; ``train.py`` trains with a ``CheckpointHook``; ``resume.py`` is a fresh
process that imports ``common`` and calls ``TrainingStrategy.load_checkpoint`` and
``FineTuningStrategy.from_pretrained_checkpoint`` exactly as the seed writes them. A
process that has not imported ``common`` is refused, and the refusal imports nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

COMMON = '''
import pathlib

import torch
from torch import nn

from nvalchemi.data import AtomicData, Batch
from nvalchemi.models.base import BaseModelMixin, ModelConfig

pathlib.Path(__file__).with_name("common-imported").touch()  # proves who imported it


class PairPotential(nn.Module, BaseModelMixin):
    """A pair potential the user wrote: E = sum over pairs of a * exp(-b * r)."""

    def __init__(self, a: float = 1.0, b: float = 1.0):
        super().__init__()
        self.a, self.b = a, b
        self.model_config = ModelConfig(outputs={"energy", "forces"})
        self.log_a = nn.Parameter(torch.tensor(float(a)).log())
        self.b_param = nn.Parameter(torch.tensor(float(b)))

    embedding_shapes = {}

    def compute_embeddings(self, data, **kwargs):
        raise NotImplementedError

    def forward(self, data, **kwargs):
        positions = data["positions"].requires_grad_(True)
        index = data.batch_idx
        distances = ((positions[:, None] - positions[None, :]).pow(2).sum(-1) + 1e-9).sqrt()
        same = index[:, None] == index[None, :]
        mask = same & ~torch.eye(len(positions), dtype=torch.bool)
        pair = torch.where(mask, self.log_a.exp() * torch.exp(-self.b_param * distances), 0.0)
        energy = torch.zeros(int(index.max()) + 1, dtype=positions.dtype).index_add(0, index, pair.sum(1) / 2)
        forces = -torch.autograd.grad(energy.sum(), positions, create_graph=self.training)[0]
        return {"energy": energy[:, None], "forces": forces}


def training_fn(model, batch):
    out = model(batch)
    return {"predicted_energy": out["energy"], "predicted_forces": out["forces"]}


def loader():
    generator = torch.Generator().manual_seed(0)
    frames = [
        AtomicData(
            atomic_numbers=torch.ones(3, dtype=torch.long),
            positions=2.0 * torch.rand(3, 3, generator=generator),
            energy=torch.rand(1, 1, generator=generator),
            forces=torch.rand(3, 3, generator=generator),
        )
        for _ in range(8)
    ]
    return torch.utils.data.DataLoader(frames, batch_size=4, shuffle=True, collate_fn=Batch.from_data_list,
                                       generator=torch.Generator().manual_seed(1234))
'''

TRAIN = """
import torch
from common import PairPotential, loader, training_fn
from nvalchemi.training import (CheckpointHook, ComposedLossFunction, EnergyMSELoss, ForceMSELoss,
                                OptimizerConfig, TrainingStrategy)

torch.manual_seed(0)
loss_fn = ComposedLossFunction([EnergyMSELoss(), ForceMSELoss()], weights=[1.0, 10.0],
                               normalize_weights=False)
strategy = TrainingStrategy(
    models=PairPotential(a=0.5, b=1.5),
    training_fn=training_fn,
    optimizer_configs=OptimizerConfig(optimizer_cls=torch.optim.AdamW,
                                      optimizer_kwargs={"lr": 1e-2, "weight_decay": 1e-5}),
    loss_fn=loss_fn,
    hooks=[CheckpointHook("runs/example/checkpoints", epoch_interval=1)],
    num_epochs=2,
)
strategy.run(loader())
"""

RESUME = """
import json, sys
import torch
import common  # the user's own module, imported as in the training script
from nvalchemi.training import FineTuningStrategy, TrainingStrategy
from nvalchemi.training.checkpoint import load_model_from_checkpoint

strategy = TrainingStrategy.load_checkpoint("runs/example/checkpoints", map_location="cpu")
resumed = {"model": type(strategy.models["main"]).__name__, "fn": strategy.training_fn.__name__,
           "epochs": strategy.epoch_count}
strategy.num_epochs = 3
strategy.run(common.loader())
fine = FineTuningStrategy.from_pretrained_checkpoint(
    "runs/example/checkpoints", use_original_loss=True, use_original_opt_class=True, num_steps=2)
fine.run(common.loader())
model = load_model_from_checkpoint("runs/example/checkpoints", map_location="cpu")
print(json.dumps({**resumed, "after": strategy.epoch_count, "fine_steps": fine.step_count,
                  "fine_model": type(fine.models["main"]).__name__, "loaded": type(model).__name__}))
"""

UNIMPORTED = """
import json, sys
from nvalchemi._serialization import UnsafeImportError
from nvalchemi.training import TrainingStrategy

try:
    TrainingStrategy.load_checkpoint("runs/example/checkpoints", map_location="cpu")
except UnsafeImportError as exc:
    print(json.dumps({"error": str(exc), "imported": "common" in sys.modules}))
"""


def _python(cwd: Path, source: str) -> str:
    script = cwd / "script.py"
    script.write_text(textwrap.dedent(source))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("user-code")
    (root / "common.py").write_text(textwrap.dedent(COMMON))
    _python(root, TRAIN)
    return root


def test_seed_resume_and_finetune_load_the_users_own_classes_and_functions(trained):
    out = json.loads(_python(trained, RESUME).strip().splitlines()[-1])
    assert out == {
        "model": "PairPotential",
        "fn": "training_fn",
        "epochs": 2,
        "after": 3,
        "fine_steps": 2,
        "fine_model": "PairPotential",
        "loaded": "PairPotential",
    }


def test_a_process_that_did_not_import_the_users_module_is_refused_and_imports_nothing(trained):
    (trained / "common-imported").unlink(missing_ok=True)
    out = json.loads(_python(trained, UNIMPORTED).strip().splitlines()[-1])
    assert (
        "'common.PairPotential'" in out["error"] and "import your module 'common'" in out["error"]
    )
    assert "spec.json" in out["error"]  # names the file
    assert out["imported"] is False and not (trained / "common-imported").exists()
