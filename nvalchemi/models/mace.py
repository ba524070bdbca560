"""``MACEWrapper``: a mace-torch model behind the nvalchemi model contract.

Needs the optional ``mace-torch`` package (``pip install 'nvalchemi-training[mace]'``),
imported only when a wrapper is built. Three ways in:

* ``MACEWrapper(model)`` around any ``mace.modules.MACE`` instance;
* :meth:`MACEWrapper.from_mace_kwargs` builds a ``ScaleShiftMACE`` from plain,
  JSON-friendly arguments (irreps as strings, block names as strings) and records
  them, so training checkpoints can rebuild the model;
* :meth:`MACEWrapper.from_checkpoint` loads a pickled mace-torch model file (trusted
  files only), optionally converted to cuEquivariance and ``torch.compile``d, and
  records its path and options.

Outputs: ``energy [B, 1]``, ``forces [V, 3]``, ``stress [B, 3, 3]`` (positive =
tensile), ``hessian``, ``atomic_energies [V]``; active by default: energy and forces.
In train mode MACE builds a differentiable force graph (``training=True``).

Multi-head MACE models (``from_mace_kwargs(heads=[...])`` or a multi-head model file)
pick a head per structure: ``wrapper(data, head="name")`` for all, else the batch's
``head`` field (an index into :attr:`MACEWrapper.head_names`), else the first head.

Example:
    >>> wrapper = MACEWrapper.from_mace_kwargs(atomic_numbers=[29, 79], r_max=4.0,
    ...     hidden_irreps="8x0e + 8x1o", num_interactions=1)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nvalchemi._optional import OptionalDependency, OptionalDependencyError
from nvalchemi._serialization import requires_trust, spec_factory
from nvalchemi.models._utils import graph_layout
from nvalchemi.models.base import BaseModelMixin, ModelConfig, NeighborConfig
from nvalchemi.models.statistics import atomic_number

__all__ = ["MACEWrapper"]

_MAX_Z = 119


def _require_mace() -> Any:
    """Import mace, undoing its import-time ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``.

    mace sets that variable process-wide, which would make every later ``torch.load``
    without an explicit ``weights_only`` unpickle arbitrary objects. Our loaders always
    pass ``weights_only=True``; restoring the variable after importing the parts of mace
    the wrapper uses protects everyone else's calls.
    """
    previous = os.environ.get(_MACE_ENV)
    try:
        package = OptionalDependency.MACE.require("MACEWrapper")
        # Submodules load e3nn constants with a plain torch.load at import time, which
        # needs mace's setting: import every part the wrapper uses while it is in force.
        importlib.import_module("mace.modules")
        importlib.import_module("mace.tools")
        return package
    finally:
        if previous is None:
            os.environ.pop(_MACE_ENV, None)
        else:
            os.environ[_MACE_ENV] = previous


_MACE_ENV = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def _chemical_symbol(z: int) -> str:
    from ase.data import chemical_symbols

    return chemical_symbols[z] if 0 <= z < len(chemical_symbols) else f"Z={z}"


def _float(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


class MACEWrapper(nn.Module, BaseModelMixin):
    """A mace-torch ``MACE`` model that trains and runs through the nvalchemi contract.

    Building one lets ``torch.compile`` trace e3nn's ``Irrep`` (its ``len()`` is made
    to return the tuple's length, 2, instead of raising), so a compiled MACE model runs.

    Args:
        model: a ``mace.modules.MACE`` (e.g. ``ScaleShiftMACE``) instance, also one
            converted to cuEquivariance or ``torch.compile``d.
        reconstruction_spec: a spec that rebuilds this wrapper (returned by
            :meth:`checkpoint_spec`); the factories record one themselves.
    """

    def __init__(self, model: nn.Module, *, reconstruction_spec: Any = None) -> None:
        super().__init__()
        _require_mace()
        _allow_e3nn_irreps_in_compile()
        self.model = model
        self.reconstruction_spec = reconstruction_spec
        self._spec_record: tuple[str, dict[str, Any]] | None = None
        self.default_head: str | None = None
        zs = [int(z) for z in model.atomic_numbers.tolist()]
        table = torch.zeros(_MAX_Z + 1, len(zs), dtype=self._model_dtype)
        table[torch.tensor(zs), torch.arange(len(zs))] = 1.0
        # One-hot species lookup; not part of the weights.
        self.register_buffer("_node_emb", table, persistent=False)
        known = torch.zeros(_MAX_Z + 1, dtype=torch.bool)
        known[torch.tensor(zs)] = True
        self.register_buffer("_known_z", known, persistent=False)
        self.model_config = ModelConfig(
            outputs={"energy", "forces", "stress", "hessian", "atomic_energies"},
            autograd_outputs={"forces", "stress", "hessian"},
            autograd_inputs={"positions"},
            optional_inputs={"cell", "pbc", "neighbor_list_shifts"},
            supports_pbc=True,
            neighbor_config=NeighborConfig(cutoff=self.cutoff),
            active_outputs={"energy", "forces"},
        )

    # ------------------------------------------------------------ properties
    @property
    def cutoff(self) -> float:
        return _float(self.model.r_max)

    @property
    def _model_dtype(self) -> torch.dtype:
        for p in self.model.parameters():
            if p.dtype.is_floating_point:
                return p.dtype
        return torch.float64

    @property
    def dtype(self) -> torch.dtype:
        return self._model_dtype

    @property
    def elements(self) -> list[int]:
        return [int(z) for z in self.model.atomic_numbers.tolist()]

    # ------------------------------------------------------------------ heads
    @property
    def head_names(self) -> tuple[str, ...]:
        """Names of the readout heads, in index order (the ``head`` field indexes them)."""
        return tuple(getattr(self.model, "heads", None) or ("Default",))

    def head_index(self, head: str | int | None) -> int:
        """The index of ``head`` (a name or an index; ``None``: the default head)."""
        names = self.head_names
        if head is None:
            return 0 if self.default_head is None else names.index(self.default_head)
        if isinstance(head, int) and not isinstance(head, bool):
            if 0 <= head < len(names):
                return head
        elif head in names:
            return names.index(head)
        raise ValueError(f"This MACE model has no head {head!r}; its heads are {list(names)}.")

    def _e0_row(self, head: str | int | None) -> torch.Tensor:
        """The ``E0`` buffer row of ``head`` (a view; MACE stores ``[E]`` or ``[H, E]``)."""
        buffer = self.model.atomic_energies_fn.atomic_energies
        index = self.head_index(head)
        return buffer if buffer.dim() == 1 else buffer[index]

    def get_reference_energies(self, head: str | int | None = None) -> dict[int, float]:
        """``{Z: E0}`` in eV of every element of the model for ``head``."""
        values = self._e0_row(head).detach().cpu().double().tolist()
        return {z: float(e) for z, e in zip(self.elements, values)}

    def set_reference_energies(
        self, values: Mapping[int | str, float], head: str | int | None = None
    ) -> None:
        """Set ``E0`` (eV) of the given elements for ``head``; the others keep theirs."""
        zs = self.elements
        updates = {atomic_number(z): float(v) for z, v in values.items()}
        unknown = sorted(z for z in updates if z not in zs)
        if unknown:
            raise ValueError(f"This MACE model has elements {zs}; cannot set E0 of {unknown}.")
        row = self._e0_row(head)
        with torch.no_grad():
            for z, value in updates.items():
                row[zs.index(z)] = value

    def _scale_shift_block(self) -> Any:
        block = getattr(self.model, "scale_shift", None)
        if block is None:
            raise ValueError(
                f"{type(self.model).__name__} has no scale_shift block (use a ScaleShiftMACE)."
            )
        return block

    def get_scale_shift(self, head: str | int | None = None) -> tuple[float, float]:
        """``(scale, shift)`` of ``head``'s interaction energy (eV)."""
        block, index = self._scale_shift_block(), self.head_index(head)
        scale, shift = torch.atleast_1d(block.scale), torch.atleast_1d(block.shift)
        return float(scale[min(index, scale.numel() - 1)]), float(
            shift[min(index, shift.numel() - 1)]
        )

    def set_scale_shift(self, scale: float, shift: float, head: str | int | None = None) -> None:
        """Set ``scale`` and ``shift`` of ``head`` (in place: the weights layout is kept)."""
        block, index = self._scale_shift_block(), self.head_index(head)
        for name, value in (("scale", scale), ("shift", shift)):
            buffer = getattr(block, name)
            if buffer.numel() == 1 and len(self.head_names) > 1:
                raise ValueError(
                    f"This MACE model shares one {name} between its heads {list(self.head_names)}; "
                    "build it with one value per head (from_mace_kwargs(atomic_inter_scale=[...], "
                    "atomic_inter_shift=[...])) to set them separately."
                )
            with torch.no_grad():
                buffer.view(-1)[0 if buffer.numel() == 1 else index] = float(value)

    @property
    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        h = sum(int(p.linear.irreps_out.dim) for p in self.model.products)
        return {"node_embeddings": (h,), "graph_embeddings": (h,)}

    # ----------------------------------------------------------------- inputs
    def _check_species(self, atomic_numbers: torch.Tensor) -> None:
        if atomic_numbers.is_cuda and self.training:
            return  # the check syncs; unknown species get all-zero node attributes
        z = atomic_numbers.clamp(0, _MAX_Z)
        unknown = ~self._known_z.index_select(0, z)
        if bool(unknown.any()):
            bad = sorted(set(atomic_numbers[unknown].tolist()))
            names = ", ".join(f"{_chemical_symbol(b)} (Z={b})" for b in bad)
            raise ValueError(
                f"This MACE model was built for elements {self.elements} and cannot handle {names}."
            )

    def adapt_input(self, data: Any, **kwargs: Any) -> dict[str, Any]:
        """MACE's input dict; the caller's tensors are never modified in place."""
        base = super().adapt_input(data, **kwargs)
        dtype = self._model_dtype
        batch_idx, num_graphs = graph_layout(data)
        positions = base["positions"]
        if not positions.requires_grad:
            positions = positions.detach()
        # MACE calls positions.requires_grad_() itself: hand it a tensor of our own.
        positions = positions.to(dtype)
        atomic_numbers = base["atomic_numbers"]
        self._check_species(atomic_numbers)
        neighbor_list = base["neighbor_list"].long()
        unit_shifts = base.get("neighbor_list_shifts")
        if unit_shifts is None:
            if "pbc" in base:
                raise ValueError(
                    "The input has 'pbc' but no 'neighbor_list_shifts'; compute neighbour lists "
                    "with nvalchemi.data.neighbors.compute_neighbors(batch, config="
                    "model.model_config.neighbor_config)."
                )
            unit_shifts = torch.zeros(neighbor_list.shape[0], 3, device=positions.device)
        unit_shifts = unit_shifts.to(dtype)
        cell = base.get("cell")
        if cell is None:
            cell = torch.zeros(num_graphs, 3, 3, dtype=dtype, device=positions.device)
        cell = cell.to(dtype).reshape(-1, 3, 3)
        edge_cell = cell.index_select(0, batch_idx.index_select(0, neighbor_list[:, 0]))
        shifts = torch.einsum("ej,ejk->ek", unit_shifts, edge_cell)
        ptr = getattr(data, "ptr", None)
        if ptr is None:
            ptr = torch.tensor([0, positions.shape[0]], device=positions.device)
        head = kwargs.get("head")
        if head is not None:
            heads = torch.full(
                (num_graphs,), self.head_index(head), dtype=torch.long, device=positions.device
            )
        else:
            heads = self._graph_heads(data, num_graphs, positions.device)
        return {
            "head": heads,
            "positions": positions,
            "node_attrs": self._node_emb.index_select(0, atomic_numbers.clamp(0, _MAX_Z)),
            "batch": batch_idx,
            "ptr": ptr,
            "edge_index": neighbor_list.T.contiguous(),
            "unit_shifts": unit_shifts,
            "shifts": shifts,
            "cell": cell,
        }

    def _graph_heads(self, data: Any, num_graphs: int, device: torch.device) -> torch.Tensor:
        per_graph = data.get("head") if isinstance(data, Mapping) else getattr(data, "head", None)
        if per_graph is None or len(self.head_names) == 1:
            default = self.head_index(None)
            return torch.full((num_graphs,), default, dtype=torch.long, device=device)
        per_graph = per_graph.reshape(-1).long().to(device)
        if not (per_graph.is_cuda and self.training):
            bad = (per_graph < 0) | (per_graph >= len(self.head_names))
            if bool(bad.any()):
                raise ValueError(
                    f"The batch's 'head' field holds {sorted(set(per_graph[bad].tolist()))}, "
                    f"but this MACE model has heads {list(self.head_names)}."
                )
        return per_graph

    # ---------------------------------------------------------------- forward
    def forward(self, data: Any, head: str | int | None = None, **kwargs: Any):
        """MACE's outputs for ``data``; ``head`` picks the readout head of every structure."""
        if head is not None:
            kwargs["head"] = head
        active = self.output_data()
        inputs = self.adapt_input(data, **kwargs)
        need_grad = bool(active & {"forces", "stress", "hessian"})
        grad_enabled = torch.is_grad_enabled()
        with torch.set_grad_enabled(grad_enabled or need_grad):
            raw = self.model(
                inputs,
                training=self.training and grad_enabled,
                compute_force="forces" in active or "hessian" in active,
                compute_stress="stress" in active,
                compute_displacement="stress" in active,
                compute_hessian="hessian" in active,
            )
        if not grad_enabled:
            raw = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in raw.items()}
        return self.adapt_output(raw, data)

    def adapt_output(self, model_output: Any, data: Any):
        mapped = dict(model_output)
        energy = mapped.get("energy")
        if isinstance(energy, torch.Tensor):
            mapped["energy"] = energy.reshape(-1, 1)
        if mapped.get("node_energy") is not None:
            mapped["atomic_energies"] = mapped["node_energy"].to(self._model_dtype)
        return super().adapt_output(mapped, data)

    def compute_embeddings(self, data: Any, **kwargs: Any) -> Any:
        """Write MACE's node features as ``node_embeddings [V, h]`` and their
        per-system sums as ``graph_embeddings [B, h]``."""
        inputs = self.adapt_input(data)
        with torch.enable_grad():  # MACE marks positions as requiring grad
            raw = self.model(inputs, training=False, compute_force=False)
        feats = raw.get("node_feats")
        if feats is None:
            raise RuntimeError("The MACE model returned no 'node_feats'; cannot embed.")
        feats = feats.detach()
        batch_idx, num_graphs = graph_layout(data)
        graphs = feats.new_zeros(num_graphs, feats.shape[-1]).index_add_(0, batch_idx, feats)
        data["node_embeddings"] = feats
        data["graph_embeddings"] = graphs
        return data

    def atomic_energy_module(self, head: str | int | None = None) -> nn.Module:
        """The per-atom energies of ``head`` as a TorchScript-compatible module (the export).

        It holds a TorchScript-compiled copy of this wrapper's MACE model (e3nn's
        compile) and calls it without forces or stress (the exporter differentiates the energies itself);
        ``forward(positions, atomic_numbers, edge_index, shifts, batch, num_systems)``
        returns ``[N]`` energies in eV from the contract's inputs (see
        :mod:`nvalchemi.models.export`); attributes ``cutoff`` and ``atomic_numbers``.
        """
        return _MACEAtomicEnergies(self, self.head_index(head))

    # --------------------------------------------------------- construction
    @classmethod
    @spec_factory  # builds from plain JSON values: safe for untrusted checkpoint specs
    def from_mace_kwargs(
        cls,
        *,
        atomic_numbers: Sequence[int],
        atomic_energies: Mapping[int | str, float] | Sequence[float] | None = None,
        r_max: float = 5.0,
        num_bessel: int = 8,
        num_polynomial_cutoff: int = 5,
        max_ell: int = 3,
        interaction: str = "RealAgnosticResidualInteractionBlock",
        interaction_first: str = "RealAgnosticResidualInteractionBlock",
        num_interactions: int = 2,
        hidden_irreps: str = "32x0e + 32x1o",
        MLP_irreps: str = "16x0e",
        correlation: int = 3,
        gate: str | None = "silu",
        avg_num_neighbors: float = 10.0,
        atomic_inter_scale: float | Sequence[float] = 1.0,
        atomic_inter_shift: float | Sequence[float] = 0.0,
        radial_MLP: Sequence[int] = (64, 64, 64),
        radial_type: str = "bessel",
        dtype: str = "float64",
        seed: int | None = None,
        heads: Sequence[str] | None = None,
        default_head: str | None = None,
    ) -> MACEWrapper:
        """Build a ``ScaleShiftMACE`` from JSON-friendly arguments and record them.

        Argument names follow mace-torch's model constructor (block and gate names as
        strings, irreps as strings). ``atomic_energies`` maps atomic numbers or
        chemical symbols to ``E0`` (eV), or is a sequence aligned with ``atomic_numbers``
        (default zeros); with several ``heads`` it may also be one such sequence per
        head, and ``atomic_inter_scale``/``atomic_inter_shift`` one value per head.
        ``seed`` fixes the initial weights; ``default_head`` is the head of structures
        that name none (default: the first). :meth:`checkpoint_spec` rebuilds the same
        architecture from these arguments (weights are restored from the checkpoint).
        """
        recorded = {k: v for k, v in locals().items() if k not in ("cls", "__class__")}
        recorded["atomic_numbers"] = [int(z) for z in atomic_numbers]
        recorded["radial_MLP"] = [int(n) for n in radial_MLP]
        recorded["heads"] = None if heads is None else [str(h) for h in heads]
        zs = recorded["atomic_numbers"]
        num_heads = 1 if heads is None else len(recorded["heads"])
        per_head = (
            heads is not None
            and isinstance(atomic_energies, Sequence)
            and len(atomic_energies) > 0
            and all(isinstance(row, (Sequence, Mapping)) for row in atomic_energies)
        )
        if per_head:
            if len(atomic_energies) != num_heads:
                raise ValueError(
                    f"atomic_energies has {len(atomic_energies)} rows for {num_heads} heads."
                )
            e0: Any = [_e0_list(row, zs) for row in atomic_energies]
        else:
            e0 = _e0_list(atomic_energies, zs)
            if heads is not None:
                e0 = [list(e0) for _ in range(num_heads)]
        recorded["atomic_energies"] = e0  # aligned with atomic_numbers: JSON-friendly
        scales = {}
        for name, value in (
            ("atomic_inter_scale", atomic_inter_scale),
            ("atomic_inter_shift", atomic_inter_shift),
        ):
            if isinstance(value, Sequence):
                if len(value) != num_heads:
                    raise ValueError(f"{name} has {len(value)} values for {num_heads} heads.")
                scales[name] = [float(v) for v in value]
            else:  # mace indexes scale and shift by head: one value per head
                scales[name] = float(value) if heads is None else [float(value)] * num_heads
            recorded[name] = scales[name]
        _require_mace()
        import numpy as np
        from e3nn import o3
        from mace import modules

        for name, value in (("interaction", interaction), ("interaction_first", interaction_first)):
            if value not in modules.interaction_classes:
                raise ValueError(
                    f"Unknown MACE {name} {value!r}; choose from "
                    f"{sorted(modules.interaction_classes)}."
                )
        gate_key = "None" if gate is None else gate
        if gate_key not in modules.gate_dict:
            raise ValueError(
                f"Unknown MACE gate {gate!r}; choose from {sorted(modules.gate_dict)}."
            )
        torch_dtype = getattr(torch, str(dtype).removeprefix("torch."))
        generator_state = torch.random.get_rng_state()
        if seed is not None:
            torch.manual_seed(seed)
        try:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(torch_dtype)  # MACE creates buffers in the default dtype
            model = modules.ScaleShiftMACE(
                r_max=float(r_max),
                num_bessel=int(num_bessel),
                num_polynomial_cutoff=int(num_polynomial_cutoff),
                max_ell=int(max_ell),
                interaction_cls=modules.interaction_classes[interaction],
                interaction_cls_first=modules.interaction_classes[interaction_first],
                num_interactions=int(num_interactions),
                num_elements=len(zs),
                hidden_irreps=o3.Irreps(hidden_irreps),
                MLP_irreps=o3.Irreps(MLP_irreps),
                atomic_energies=np.asarray(e0, dtype=float),
                avg_num_neighbors=float(avg_num_neighbors),
                atomic_numbers=zs,
                correlation=int(correlation),
                gate=modules.gate_dict[gate_key],
                radial_MLP=recorded["radial_MLP"],
                radial_type=radial_type,
                heads=recorded["heads"],
                **scales,
            )
        finally:
            torch.set_default_dtype(previous)
            if seed is not None:
                torch.random.set_rng_state(generator_state)
        wrapper = cls(model.to(torch_dtype))
        wrapper._spec_record = ("from_mace_kwargs", recorded)
        if default_head is not None:
            wrapper.head_index(default_head)  # a ValueError naming the heads if unknown
            wrapper.default_head = default_head
        return wrapper

    def add_head(
        self, name: str, copy_from: str | int | None = None, *, make_default: bool = False
    ) -> None:
        """Add a readout head ``name``, a copy of head ``copy_from`` (default: the default head).

        mace-torch heads share the readout layers (one output column, and one block of the
        last readout's hidden units, per head), so the model is rebuilt with one more head
        and every weight copied; the new head's columns are those of ``copy_from``, and
        the last readout's output weights are rescaled for its wider input (e3nn divides
        by the square root of the fan-in), so every head predicts what it did and the
        new head what ``copy_from`` does. Needs a wrapper from :meth:`from_mace_kwargs`.
        """
        if self._spec_record is None or self._spec_record[0] != "from_mace_kwargs":
            raise ValueError(
                "add_head rebuilds the MACE model from its constructor arguments: build the "
                "wrapper with MACEWrapper.from_mace_kwargs(..., heads=[...]) (a model file or "
                "object does not record them)."
            )
        names = self.head_names
        if not isinstance(name, str) or not name or name in names:
            raise ValueError(f"new head name {name!r} must be a new, non-empty name ({names}).")
        source = self.head_index(copy_from)
        kwargs = dict(self._spec_record[1])
        count = len(names)
        e0 = self.model.atomic_energies_fn.atomic_energies.detach().double().cpu()
        rows = e0.reshape(count, -1) if e0.dim() == 2 else e0.reshape(1, -1)
        kwargs["atomic_energies"] = [*rows.tolist(), rows[source].tolist()]
        block = self._scale_shift_block()
        for key, buffer in (
            ("atomic_inter_scale", block.scale),
            ("atomic_inter_shift", block.shift),
        ):
            values = torch.atleast_1d(buffer).detach().double().cpu().expand(count).tolist()
            kwargs[key] = [*values, values[source]]
        kwargs["heads"] = [*names, name]
        kwargs["default_head"] = None
        grown = type(self).from_mace_kwargs(**kwargs)
        grown.model.load_state_dict(_grown_state(self.model, grown.model, count, source))
        device = next(self.model.parameters()).device
        self.model = grown.model.to(device)
        self._spec_record = grown._spec_record
        if make_default:
            self.default_head = name
        self._spec_record[1]["default_head"] = self.default_head

    @classmethod
    @requires_trust  # unpickles the file: specs may name it only with trust=True
    def from_checkpoint(
        cls,
        checkpoint_path: str | Path,
        device: str | torch.device | None = None,
        enable_cueq: bool = False,
        dtype: str | torch.dtype | None = None,
        compile_model: bool = False,
        atomic_energies: Mapping[int | str, float] | None = None,
        atomic_energies_path: str | Path | None = None,
        *,
        map_location: str | torch.device | None = None,
        **compile_kwargs: Any,
    ) -> MACEWrapper:
        """Load a pickled mace-torch model file (e.g. ``*.model`` from ``mace_run_train``).

        .. warning:: MACE model files are Python pickles: loading one runs code from
           the file. Only load trusted files. Marked
           :func:`~nvalchemi._serialization.requires_trust`: a spec or checkpoint names it,
           or reaches it while being built, only when loaded with ``trust=True``.

        The steps, in order: load; cast to ``dtype``; convert to cuEquivariance
        (``enable_cueq``, through mace-torch's own converter); move to ``device``; set
        reference energies; ``torch.compile`` (``compile_model``).

        Args:
            checkpoint_path: a local file (named foundation models are not downloaded).
            device: device to load onto (default: the CPU); ``map_location`` is the same
                (give one of the two).
            enable_cueq: convert the model to cuEquivariance kernels (CUDA only; needs
                the ``cuequivariance`` and ``cuequivariance_torch`` packages).
            dtype: cast the model (``"float32"``/``"float64"`` or a torch dtype).
            compile_model: ``torch.compile`` the MACE model with ``compile_kwargs``
                (e.g. ``mode="max-autotune"``, ``backend=...``). The model is then
                **inference-only**: eval mode, parameters frozen.
            atomic_energies: overrides of the reference energies, keyed by atomic
                number or chemical symbol; or ``atomic_energies_path``, a JSON file of
                such a mapping (not both).

        Returns:
            The wrapper in eval mode; :meth:`checkpoint_spec` reloads the same file with
            the same options (the device is not recorded).

        Raises:
            FileNotFoundError: no such file (or no such ``atomic_energies_path``).
            ValueError: contradicting options (``device`` and ``map_location``, both
                energy sources, compile keywords without ``compile_model``,
                ``enable_cueq`` on a device that is not CUDA), or energies of elements
                the model lacks.
            OptionalDependencyError: ``enable_cueq`` without the cuEquivariance packages.

        Example:
            >>> model = MACEWrapper.from_checkpoint(  # doctest: +SKIP
            ...     "small.model", device="cuda", dtype="float32", enable_cueq=True,
            ...     compile_model=True, mode="max-autotune")
        """
        _require_mace()
        target = _one_device(device, map_location)
        if compile_kwargs and not compile_model:
            raise ValueError(
                f"{sorted(compile_kwargs)} are torch.compile keywords (or misspelt arguments "
                "of from_checkpoint); they apply only with compile_model=True."
            )
        if enable_cueq:
            _require_cueq(target)
        path = Path(checkpoint_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"MACE model file {path} does not exist (only local files are supported)."
            )
        energies = _energy_overrides(atomic_energies, atomic_energies_path)
        warnings.warn(
            f"Loading {path} with pickle (torch.load(weights_only=False)): this executes code "
            "from the file. Only load trusted MACE model files.",
            UserWarning,
            stacklevel=2,
        )
        model = torch.load(path, map_location=target, weights_only=False)
        if not isinstance(model, nn.Module) or not hasattr(model, "atomic_numbers"):
            raise TypeError(
                f"{path} holds a {type(model).__name__}, not a mace-torch model; save the model "
                "itself (torch.save(model, path)), not a state dict or a training checkpoint."
            )
        if dtype is not None:
            model = model.to(getattr(torch, str(dtype).removeprefix("torch.")))
        if enable_cueq:
            model = _to_cueq(model, target)
        model = model.to(target)
        if energies:
            _override_e0(model, energies)
        if compile_model:
            model.eval()
            for parameter in model.parameters():
                parameter.requires_grad_(False)  # inference-only, as torch.compile'd MACE is
            model = torch.compile(model, **compile_kwargs)
        from ase.data import chemical_symbols

        wrapper = cls(model)
        wrapper._spec_record = (
            "from_checkpoint",
            {
                "checkpoint_path": str(path.resolve()),
                "enable_cueq": bool(enable_cueq),
                "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
                "compile_model": bool(compile_model),
                "atomic_energies": None
                if not atomic_energies
                else {
                    chemical_symbols[atomic_number(z)]: float(e) for z, e in atomic_energies.items()
                },
                "atomic_energies_path": None
                if atomic_energies_path is None
                else str(Path(atomic_energies_path).resolve()),
                **compile_kwargs,
            },
        )
        return wrapper.eval()

    def checkpoint_spec(self) -> Any:
        """A spec that rebuilds this wrapper, or ``None`` for a wrapper around a live
        module built by hand (training checkpoints then cannot rebuild it)."""
        if self.reconstruction_spec is not None:
            return self.reconstruction_spec
        if self._spec_record is None:
            return None
        from nvalchemi.spec import create_model_spec

        factory, kwargs = self._spec_record
        return create_model_spec(getattr(type(self), factory), **kwargs)

    def export_model(self, path: str | Path, as_state_dict: bool = False) -> None:
        """Save the inner MACE module (pickled, loadable by mace-torch) or its state dict."""
        torch.save(self.model.state_dict() if as_state_dict else self.model, Path(path))


class _MACEAtomicEnergies(nn.Module):
    """Per-atom energies of one MACE head from the export contract's inputs (scriptable).

    MACE reads Cartesian ``shifts`` for its edge vectors
    (``positions[receiver] - positions[sender] + shifts``, the contract's convention),
    so a strain the caller applies to positions and shifts gives the stress; its cell
    and integer shifts are only read for its own stress, which is not asked for.
    """

    def __init__(self, wrapper: MACEWrapper, head: int) -> None:
        super().__init__()
        # e3nn generates some of MACE's modules; its compile scripts or traces each as
        # it needs (mace-torch's own LAMMPS export does the same), on a copy.
        from e3nn.util import jit  # a dependency of mace-torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit's notice
            self.model = jit.compile(wrapper.model, in_place=False)
        self.register_buffer("node_attrs_of", wrapper._node_emb.detach().clone())
        self.head = int(head)
        self.cutoff = wrapper.cutoff
        self.atomic_numbers = wrapper.elements

    def forward(
        self,
        positions: torch.Tensor,
        atomic_numbers: torch.Tensor,
        edge_index: torch.Tensor,
        shifts: torch.Tensor,
        batch: torch.Tensor,
        num_systems: int,
    ) -> torch.Tensor:
        counts = torch.bincount(batch, minlength=num_systems)
        ptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, dim=0)])
        data = {
            "positions": positions,
            "node_attrs": self.node_attrs_of.index_select(0, atomic_numbers),
            "edge_index": edge_index,
            "shifts": shifts,
            "unit_shifts": torch.zeros_like(shifts),
            "cell": positions.new_zeros(num_systems, 3, 3),
            "batch": batch,
            "ptr": ptr,
            "head": torch.full([num_systems], self.head, dtype=torch.long, device=batch.device),
        }
        out = self.model(data, training=False, compute_force=False)
        energies = out["node_energy"]
        if energies is None:
            raise RuntimeError("The MACE model returned no node_energy.")
        return energies.to(positions.dtype)


def _one_device(device: Any, map_location: Any) -> torch.device:
    """``device`` or its older name ``map_location`` (default: the CPU)."""
    both = device is not None and map_location is not None
    if both and torch.device(device) != torch.device(map_location):
        raise ValueError(f"device={device!r} and map_location={map_location!r} disagree; give one.")
    return torch.device(device if device is not None else map_location or "cpu")


_CUEQ_PACKAGES = ("cuequivariance", "cuequivariance_torch")


def _require_cueq(device: torch.device) -> None:
    """Refuse ``enable_cueq`` off CUDA, or without the cuEquivariance packages."""
    if device.type != "cuda":
        raise ValueError(
            f"enable_cueq=True converts the model to cuEquivariance's CUDA kernels; the "
            f"device is {device}. Load it on a CUDA device (device='cuda') or leave "
            "enable_cueq off."
        )
    missing = [name for name in _CUEQ_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise OptionalDependencyError(
            f"enable_cueq=True needs the package(s) {missing}, which are not installed. "
            "Install them with: pip install cuequivariance-torch cuequivariance-ops-torch-cu12 "
            "(cu13 for CUDA 13)."
        )


def _to_cueq(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` converted by mace-torch's own e3nn -> cuEquivariance converter."""
    from mace.cli.convert_e3nn_cueq import run as convert

    previous = torch.get_default_dtype()
    try:  # the converter sets the default dtype to the model's and leaves it there
        return convert(model, return_model=True, device=device.type)
    finally:
        torch.set_default_dtype(previous)


_MAX_ENERGIES_BYTES = 1 << 20


def _energy_overrides(
    atomic_energies: Mapping[int | str, float] | None, path: str | Path | None
) -> Mapping[int | str, float] | None:
    """The ``E0`` overrides given as a mapping or as a JSON file of one (not both)."""
    if path is None:
        if atomic_energies is not None and not isinstance(atomic_energies, Mapping):
            raise TypeError(
                "atomic_energies must map elements (symbols or atomic numbers) to E0 in eV; "
                f"got a {type(atomic_energies).__name__}."
            )
        return atomic_energies
    if atomic_energies is not None:
        raise ValueError("give atomic_energies or atomic_energies_path, not both.")
    file = Path(path)
    if not file.is_file() or file.stat().st_size > _MAX_ENERGIES_BYTES:
        raise FileNotFoundError(
            f"atomic_energies_path {file} is not a JSON file of at most 1 MiB "
            '(e.g. {"Cu": -3.71, "Au": -3.2}).'
        )
    try:
        values = json.loads(file.read_text())
    except ValueError as exc:
        raise ValueError(f"atomic_energies_path {file} is not valid JSON: {exc}") from None
    if not isinstance(values, Mapping):
        raise TypeError(
            f"atomic_energies_path {file} holds a JSON {type(values).__name__}; it must map "
            'elements to E0 in eV (e.g. {"Cu": -3.71}).'
        )
    return {key: float(value) for key, value in values.items()}


def _allow_e3nn_irreps_in_compile() -> None:
    """Let ``torch.compile`` guard on e3nn's ``Irrep`` (idempotent).

    ``Irrep`` is a ``(l, p)`` tuple whose ``len()`` raises ``NotImplementedError``;
    dynamo takes the length of the tuples it guards on, so a compiled MACE fails on
    its first call. The length of the tuple (2) is what it asks for.
    """
    from e3nn.o3 import Irrep  # a dependency of mace-torch

    if Irrep.__len__ is not _irrep_length:
        Irrep.__len__ = _irrep_length


def _irrep_length(_irrep: Any) -> int:
    return 2


def _grown_state(old: nn.Module, new: nn.Module, heads: int, source: int) -> dict[str, Any]:
    """``old``'s weights laid out for ``new`` (one more head, a copy of head ``source``).

    Same-shaped tensors are copied; reference energies and scale/shift come with ``new``
    (it was built from their values); every readout's per-head weights grow a copy of
    head ``source``'s block.
    """
    state = new.state_dict()
    rebuilt_with_values = ("atomic_energies_fn", "scale_shift")
    for key, value in old.state_dict().items():
        if state[key].shape == value.shape and not key.startswith(rebuilt_with_values):
            state[key] = value
    for i, before in enumerate(old.readouts):
        prefix = f"readouts.{i}."
        if hasattr(before, "linear_1"):  # gated MLP: per-head hidden blocks, masked
            hidden = before.linear_1.irreps_out.num_irreps // heads
            state[prefix + "linear_1.weight"] = _with_block(
                before.linear_1.weight, heads, hidden, source
            )
            w = before.linear_2.weight.detach().reshape(heads, hidden, heads)
            grown = torch.zeros(heads + 1, hidden, heads + 1, dtype=w.dtype, device=w.device)
            for h in range(heads):
                grown[h, :, h] = w[h, :, h]
            grown[heads, :, heads] = w[source, :, source]
            # e3nn scales by 1/sqrt(fan-in); the fan-in grew from heads to heads + 1 blocks.
            state[prefix + "linear_2.weight"] = grown.reshape(-1) * math.sqrt((heads + 1) / heads)
        else:
            state[prefix + "linear.weight"] = _with_block(before.linear.weight, heads, 1, source)
    return state


def _with_block(weight: torch.Tensor, heads: int, width: int, source: int) -> torch.Tensor:
    """A flat e3nn ``[mul_in, heads * width]`` weight with head ``source``'s columns appended."""
    w = weight.detach().reshape(-1, heads, width)
    return torch.cat([w, w[:, source : source + 1]], dim=1).reshape(-1)


def _e0_list(values: Any, zs: list[int]) -> list[float]:
    """``E0`` aligned with ``zs`` from a ``{Z or symbol: E0}`` mapping, a sequence or ``None``."""
    if values is None:
        return [0.0] * len(zs)
    if isinstance(values, Mapping):
        by_z = {atomic_number(z): float(e) for z, e in values.items()}
        unknown = sorted(z for z in by_z if z not in zs)
        if unknown:
            raise ValueError(f"atomic_energies names elements {unknown} not in {zs}.")
        return [by_z.get(z, 0.0) for z in zs]
    if len(values) != len(zs):
        raise ValueError(f"atomic_energies has {len(values)} values for {len(zs)} elements.")
    return [float(e) for e in values]


def _override_e0(model: nn.Module, atomic_energies: Mapping[int | str, float]) -> None:
    zs = [int(z) for z in model.atomic_numbers.tolist()]
    by_z = {atomic_number(z): float(e) for z, e in atomic_energies.items()}
    unknown = sorted(z for z in by_z if z not in zs)
    if unknown:
        raise ValueError(f"atomic_energies names elements {unknown} not in the model's {zs}.")
    buffer = model.atomic_energies_fn.atomic_energies
    with torch.no_grad():
        for z, value in by_z.items():
            buffer[..., zs.index(z)] = value
