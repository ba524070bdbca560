"""Compiled training steps: ``TrainingStrategy(compile=True)``.

Each ``run()`` (or ``train_batch`` session) wraps every trained model in
``torch.compile(model, dynamic=True, **compile_kwargs)`` and hands the wrappers to
``training_fn``; the strategy's own models, their ``state_dict`` names, validation and
checkpoints stay eager. What compiles:

* the model's forward, with the forces and stress inside it: for models that take
  them from :func:`nvalchemi.models._utils.energy_and_derivatives` (PaiNN, DemoModel)
  the derivatives are traced with ``torch.func.grad``, so energy, forces, stress and
  the backward of the loss through them are one compiled graph (AOTAutograd); torch
  2.13 cannot differentiate a compiled backward a second time, which is what
  ``torch.autograd.grad(create_graph=True)`` over a compiled graph would need;
* not the loss, the optimizer step or the hooks (eager, cheap); Python checks in a
  model's input handling (e.g. PaiNN's unknown-element check) are graph breaks, run
  eagerly between the compiled pieces.

Shapes: ``dynamic=True`` (unless ``compile_kwargs`` says otherwise) compiles for
symbolic atom, edge and structure counts, so batches of other sizes reuse the graphs;
a size of 0 or 1 (a one-structure batch) is specialised once. The graphs compiled in
each epoch are reported in :attr:`TrainingStrategy.compiled_graphs
<nvalchemi.training.TrainingStrategy.compiled_graphs>` (read from
``torch._dynamo``'s counters, so other compiled code in the process counts too).

A model whose forces come from its own ``autograd.grad(create_graph=True)`` (MACE
through mace-torch, a hand-written ``nn.Module``) fails at its first compiled step;
the error says so and how to train it (``compile=False``).

Example:
    >>> check_compile_kwargs({"mode": "reduce-overhead"})
    {'mode': 'reduce-overhead'}
    >>> check_compile_kwargs({"fullgraf": True})
    Traceback (most recent call last):
    ...
    ValueError: compile_kwargs has unknown key(s) ['fullgraf']; torch.compile takes ['backend', 'disable', 'dynamic', 'fullgraph', 'mode', 'options'].
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["CompiledModels", "check_compile_kwargs", "compiled_graph_count"]

_log = logging.getLogger("nvalchemi.training")

COMPILE_KEYS = ("backend", "disable", "dynamic", "fullgraph", "mode", "options")

# What torch says when a compiled backward would have to be differentiated again.
_DOUBLE_BACKWARD = ("does not currently support double backward", "donated buffers")


def check_compile_kwargs(value: Any) -> dict[str, Any]:
    """``compile_kwargs`` as a dict of ``torch.compile`` keyword arguments (``ValueError`` else)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"compile_kwargs must be a mapping of torch.compile keyword arguments; got "
            f"{type(value).__name__}. Example: compile_kwargs={{'mode': 'max-autotune'}}."
        )
    unknown = sorted(str(k) for k in value if k not in COMPILE_KEYS)
    if unknown:
        raise ValueError(
            f"compile_kwargs has unknown key(s) {unknown}; torch.compile takes "
            f"{list(COMPILE_KEYS)}."
        )
    return dict(value)


def compiled_graph_count() -> int:
    """Graphs ``torch.compile`` has built in this process so far (0 before the first)."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled: keep the import light
        return 0
    from torch._dynamo.utils import counters  # light

    return int(counters["stats"]["unique_graphs"])


def _unsupported_reason() -> str | None:
    try:
        import torch._dynamo as dynamo  # light
    except Exception as exc:  # a build without dynamo
        return f"torch._dynamo cannot be imported ({exc})"
    if not dynamo.is_dynamo_supported():
        return f"torch {torch.__version__} has no torch.compile for Python {sys.version.split()[0]}"
    return None


class CompiledModels:
    """The compiled wrappers of one run's trained models (built once, reused per step)."""

    def __init__(self, trained: Mapping[str, nn.Module], kwargs: Mapping[str, Any]) -> None:
        reason = _unsupported_reason()
        if reason is not None:
            raise RuntimeError(
                f"TrainingStrategy(compile=True): torch.compile is not supported here: "
                f"{reason}. Train with compile=False."
            )
        self.kwargs = {"dynamic": True, **kwargs}
        self.names = {key: type(model).__name__ for key, model in trained.items()}
        self._wrappers: dict[str, tuple[nn.Module, Any]] = {}
        self.graphs_at_start = compiled_graph_count()

    def models(self, models: Mapping[str, nn.Module], trained: Any) -> dict[str, Any]:
        """``models`` with each trained one replaced by its compiled wrapper."""
        out: dict[str, Any] = dict(models)
        for key in trained:
            model = models[key]
            held = self._wrappers.get(key)
            if held is None or held[0] is not model:
                held = (model, torch.compile(model, **self.kwargs))
                self._wrappers[key] = held
            out[key] = held[1]
        return out

    def explain(self, exc: BaseException) -> RuntimeError | None:
        """A clear error for a model torch.compile cannot train (else ``None``)."""
        text = str(exc)
        if not isinstance(exc, RuntimeError) or not any(m in text for m in _DOUBLE_BACKWARD):
            return None
        names = ", ".join(f"{k!r} ({v})" for k, v in self.names.items())
        return RuntimeError(
            f"TrainingStrategy(compile=True) cannot train model {names}: its forces (or "
            "stress) come from torch.autograd.grad(create_graph=True) over a compiled graph, "
            "and torch.compile (AOTAutograd) cannot differentiate a compiled backward again "
            f"(torch {torch.__version__}: {text.splitlines()[0][:160]}). Models that compute "
            "them with nvalchemi.models._utils.energy_and_derivatives (PaiNN, DemoModel) "
            "compile; for this one set compile=False."
        )

    def report_epoch(self, epoch: int, graphs_before: int) -> int:
        """Log and return the graphs compiled since ``graphs_before`` (one epoch)."""
        count = compiled_graph_count() - graphs_before
        _log.info("torch.compile: %d graph(s) compiled in epoch %d", count, epoch)
        return count
