"""``TorchSimModel``: an nvalchemi potential as a torch-sim model (batched MD and relaxations).

`torch-sim <https://github.com/Radical-AI/torch-sim>`_ (``pip install
'nvalchemi-training[md]'``) integrates many systems at once: its integrators
(``nve``, ``nvt_langevin``, ...), optimizers (``fire``, ...) and runners
(``integrate``, ``optimize``) call a ``ModelInterface`` on a batched ``SimState``.
``TorchSimModel`` is that interface for

* any ``BaseModelMixin`` model (PaiNN, ``MACEWrapper``, yours), run eagerly on an
  nvalchemi ``Batch`` with neighbour lists built for the whole batch in one pass
  (:func:`nvalchemi.data.neighbors.compute_neighbors`): the fast path; a training
  checkpoint loads into it (:meth:`TorchSimModel.from_checkpoint`);
* anything that follows the export contract (:mod:`nvalchemi.models.export`): an exported
  TorchScript file (:meth:`TorchSimModel.from_export`, torch only) or an eager
  :class:`~nvalchemi.models.export.Potential`, called in its batched form with neighbours
  from :func:`~nvalchemi.models.export.neighbor_inputs`.

Conventions: torch-sim stores cells as columns (``state.cell[b]`` has the lattice vectors
as columns), nvalchemi as rows; this adapter transposes. Energies are eV ``[B]``, forces
eV/Å ``[N, 3]``, stress eV/Å³ ``[B, 3, 3]`` with ASE's sign (positive = tensile), which is
torch-sim's (``1/V dE/dε``). A committee (or its export) also returns its calibrated
spread: ``energy_std`` and ``max_force_deviation`` ``[B]``, ``forces_std`` ``[N, 3]`` and,
with stress, ``stress_std`` ``[B, 3, 3]`` (torch-sim's integrators ignore them; read them
from the output, e.g. with a forward hook, to watch the model deviation along a run). torch-sim 0.3 has one ``pbc`` flag for a whole state: ``True``
makes every system periodic along all three cell vectors, so batch a slab or a molecule
with crystals by giving it a cell with at least the model's cutoff of vacuum (its results
then equal the open-boundary ones); a state given as a dict may also carry ``pbc`` per
system, ``[B, 3]``. Rows of the stress of a non-periodic system are zero.

Example:
    >>> import torch, torch_sim as ts
    >>> from ase.build import bulk
    >>> from nvalchemi.models import PaiNN
    >>> model = TorchSimModel(PaiNN(elements=[29], hidden_channels=8, dtype=torch.float64))
    >>> state = ts.io.atoms_to_state([bulk("Cu", cubic=True)] * 2, model.device, model.dtype)
    >>> out = model(state)
    >>> out["energy"].shape, out["forces"].shape, out["stress"].shape
    (torch.Size([2]), torch.Size([8, 3]), torch.Size([2, 3, 3]))
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nvalchemi import checkpoint_files
from nvalchemi._optional import OptionalDependency
from nvalchemi.data import AtomicData, Batch
from nvalchemi.data.neighbors import compute_neighbors
from nvalchemi.models.committee import SPREAD_NAMES
from nvalchemi.models.export import neighbor_inputs

try:
    from torch_sim.models.interface import ModelInterface
except ImportError:  # the standard "install the extra" message
    OptionalDependency.TORCH_SIM.require("nvalchemi.models.TorchSimModel")
    raise

__all__ = ["TorchSimModel"]


class TorchSimModel(ModelInterface):
    """torch-sim's ``ModelInterface`` around an nvalchemi model.

    Args:
        model: an ``nn.Module`` + ``BaseModelMixin`` model, or a module that follows the
            export contract (a loaded export, a ``Potential``). A ``BaseModelMixin`` model
            runs in eval mode with the outputs asked for (its mode and ``active_outputs``
            are restored after every call, so a model that is being trained can be
            checked in between); when ``device`` or ``dtype`` differ from the model's,
            the adapter works on a copy.
        device: where to run (default: the model's device).
        dtype: run in this dtype (default: the model's). torch-sim's runners build
            their states in ``model.dtype``.
        head: the readout head of a multi-head model (default: its first).
        compute_forces: return forces (integrators and optimizers need them).
        compute_stress: return stress (cell relaxations and NPT need it; default:
            when the model can compute it). Off saves a strain derivative per call.
        neighbor_method: algorithm of the neighbour lists (``"auto"`` or
            ``"cell_list"``, see :func:`~nvalchemi.data.neighbors.compute_neighbors`).

    Raises:
        TypeError: ``model`` is neither a ``BaseModelMixin`` model nor a contract module.
        ValueError: ``compute_stress=True`` for a model without a stress output, or a
            ``head`` the model does not have (or any ``head`` for a contract module).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        head: str | None = None,
        compute_forces: bool = True,
        compute_stress: bool | None = None,
        neighbor_method: str | None = None,
    ) -> None:
        super().__init__()
        contract = _follows_contract(model)
        if not isinstance(model, torch.nn.Module) or not (
            contract or getattr(model, "model_config", None) is not None
        ):
            raise TypeError(
                "TorchSimModel needs an nn.Module + BaseModelMixin model (with a model_config) "
                "or a module that follows the export contract (with cutoff and atomic_numbers, "
                f"e.g. torch.jit.load of an export); got {type(model).__name__}."
            )
        if contract:
            if head is not None:
                raise ValueError(
                    "head= chooses a readout head of a BaseModelMixin model; an exported "
                    "potential has its head fixed at export (export with --head)."
                )
            outputs = {"energy", "forces", "stress"}
        else:
            _check_head(model, head)
            outputs = set(model.model_config.outputs)
        for flag, name in ((compute_stress, "stress"), (compute_forces, "forces")):
            if flag and name not in outputs:
                raise ValueError(
                    f"compute_{name}=True, but {type(model).__name__} has no {name} output "
                    f"(its outputs: {sorted(outputs)})."
                )
        tensors = [*model.parameters(), *model.buffers()]
        first = next((t for t in tensors if t.dtype.is_floating_point), None)
        current_device = first.device if first is not None else torch.device("cpu")
        current_dtype = first.dtype if first is not None else torch.get_default_dtype()
        model_dtype = getattr(model, "dtype", None)
        if not isinstance(model_dtype, torch.dtype):
            model_dtype = current_dtype
        self._device = torch.device(device) if device is not None else current_device
        self._dtype = dtype or model_dtype
        if self._device != current_device or self._dtype != model_dtype:
            model = copy.deepcopy(model).to(device=self._device, dtype=self._dtype)
        if contract and isinstance(model, torch.jit.ScriptModule):
            model.eval()
        self.model = model
        self.contract = contract
        self.head = head
        self.neighbor_method = neighbor_method
        self._compute_forces = bool(compute_forces)
        self._compute_stress = "stress" in outputs if compute_stress is None else compute_stress
        self._memory_scales_with = "n_atoms_x_density"
        self._template: tuple[torch.Tensor, torch.Tensor, Any] | None = None

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        model_key: str = "main",
        checkpoint_index: int | str = "latest",
        use_ema: bool = True,
        trust: bool = False,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        head: str | None = None,
        compute_stress: bool | None = None,
    ) -> TorchSimModel:
        """Build from a training checkpoint directory, as
        :meth:`NvalchemiCalculator.from_checkpoint <nvalchemi.models.NvalchemiCalculator.from_checkpoint>`
        loads it (``weights_only`` reads; model classes through the import allow-list).

        Args:
            path: the checkpoint root folder (``.../checkpoints``).
            model_key: which saved model.
            checkpoint_index: ``"latest"`` (default), ``"best"``, ``-1`` or ``N >= 0``.
            use_ema: the EMA weights when the checkpoint has them, else the trained ones.
            trust: allow model spec paths outside the import allow-list (only for
                checkpoints you trust).
            device: where to load and run the model.
            dtype: run in this dtype (default: the saved model's).
            head: the readout head of a multi-head model.
            compute_stress: see the class (default: when the model can).

        Example:
            >>> model = TorchSimModel.from_checkpoint("runs/x/checkpoints")  # doctest: +SKIP
        """
        model = checkpoint_files.load_model_from_checkpoint(
            path,
            map_location=device,
            model_key=model_key,
            use_ema=use_ema,
            checkpoint_index=checkpoint_index,
            trust=trust,
        )
        return cls(model, device=device, dtype=dtype, head=head, compute_stress=compute_stress)

    @classmethod
    def from_export(
        cls,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        compute_stress: bool | None = None,
    ) -> TorchSimModel:
        """Load an exported potential (``nvalchemi-training export``; ``torch.jit.load``,
        nothing of this package runs inside it) and run it in its own dtype.

        Example:
            >>> model = TorchSimModel.from_export("cuau.pt", device="cuda")  # doctest: +SKIP
        """
        module = torch.jit.load(str(path), map_location=device)
        if not _follows_contract(module):
            raise ValueError(
                f"{path} is a TorchScript file but not an nvalchemi export (it has no cutoff "
                "and atomic_numbers); write one with `nvalchemi-training export CKPT OUT`."
            )
        return cls(module, device=device, compute_stress=compute_stress)

    @property
    def cutoff(self) -> float | None:
        """The model's interaction cutoff in Å (``None`` for a model without neighbours)."""
        if self.contract:
            return float(self.model.cutoff) or None  # 0.0: a potential without neighbours
        config = self.model.model_config.neighbor_config
        return None if config is None else float(config.cutoff)

    def forward(self, state: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Energies ``[B]``, forces ``[N, 3]`` and (if ``compute_stress``) stress ``[B, 3, 3]``.

        ``state``: a torch-sim ``SimState`` or a dict with its fields (``positions``,
        ``cell`` with lattice vectors as columns, ``pbc``, ``atomic_numbers``,
        ``system_idx``). The state is not modified.
        """
        positions, cell, pbc, numbers, system_idx = _state_fields(state)
        positions = positions.to(device=self._device, dtype=self._dtype)
        cell = cell.to(device=self._device, dtype=self._dtype).reshape(-1, 3, 3).mT
        num_systems = cell.shape[0]
        pbc = _per_system_pbc(pbc, num_systems, self._device)
        numbers = numbers.to(device=self._device, dtype=torch.long)
        system_idx = system_idx.to(device=self._device, dtype=torch.long)
        periodic = pbc.any(dim=1)
        if self.contract:
            out = self._run_contract(positions, cell, pbc, numbers, system_idx)
        else:
            batch = self._batch(positions, cell, pbc, numbers, system_idx, num_systems)
            wanted = {"energy"}
            if self._compute_forces:
                wanted.add("forces")
            if self._compute_stress and bool(periodic.any()):
                wanted.add("stress")
            out = self._run_model(batch, wanted)
        result = {"energy": out["energy"].detach().reshape(num_systems)}
        keep = periodic.to(result["energy"].dtype).reshape(-1, 1, 1)
        if self._compute_forces:
            result["forces"] = out["forces"].detach()
        if self._compute_stress:
            stress = out.get("stress")
            if stress is None:
                stress = positions.new_zeros(num_systems, 3, 3)
            result["stress"] = stress.detach().reshape(num_systems, 3, 3) * keep
        for name in SPREAD_NAMES:  # a committee's spread, for whoever watches the outputs
            spread = out.get(name)
            if spread is None or (name == "stress_std" and not self._compute_stress):
                continue
            if name == "forces_std":
                result[name] = spread.detach()
            elif name == "stress_std":
                result[name] = spread.detach().reshape(num_systems, 3, 3) * keep
            else:
                result[name] = spread.detach().reshape(num_systems)
        return result

    # ------------------------------------------------------------------ internals
    def _batch(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        pbc: torch.Tensor,
        numbers: torch.Tensor,
        system_idx: torch.Tensor,
        num_systems: int,
    ) -> Any:
        """An nvalchemi ``Batch`` of the state, with neighbour lists.

        The batch of the last call is reused while the systems are the same (the same
        atoms in the same order, periodic the same way): only positions and cells are
        replaced, so an MD step does not rebuild ``B`` structures.
        """
        template = self._template
        same = (
            template is not None
            and template[0].shape == numbers.shape
            and template[1].shape == pbc.shape
            and template[2].num_graphs == num_systems
            and bool(torch.equal(template[0], numbers))
            and bool(torch.equal(template[1], pbc))
            and bool(torch.equal(template[2].batch_idx, system_idx))
        )
        if same:
            batch = template[2]
            batch["positions"] = positions
            if "cell" in batch:
                batch["cell"] = cell
        else:
            batch = _new_batch(positions, cell, pbc, numbers, system_idx, num_systems)
            self._template = (numbers.clone(), pbc.clone(), batch)
        config = self.model.model_config.neighbor_config
        if config is not None:
            compute_neighbors(batch, config=config, method=self.neighbor_method)
        return batch

    def _run_contract(
        self,
        positions: torch.Tensor,
        cell: torch.Tensor,
        pbc: torch.Tensor,
        numbers: torch.Tensor,
        system_idx: torch.Tensor,
    ) -> Mapping[str, Any]:
        """The contract's batched call; neighbours from ``export.neighbor_inputs``."""
        inputs = {
            "positions": positions,
            "atomic_numbers": numbers,
            "cell": cell,
            "pbc": pbc.contiguous(),
            "batch": system_idx,
        }
        if self.cutoff is None:
            inputs["edge_index"] = torch.zeros(2, 0, dtype=torch.long, device=positions.device)
            inputs["shifts"] = positions.new_zeros(0, 3)
        else:
            inputs.update(neighbor_inputs(**inputs, cutoff=self.cutoff))
        return self.model(inputs)

    def _run_model(self, batch: Any, wanted: set[str]) -> Mapping[str, Any]:
        model = self.model
        config = model.model_config
        previous, was_training = config.active_outputs, model.training
        config.active_outputs = wanted
        model.eval()
        try:
            with torch.no_grad():
                return model(batch) if self.head is None else model(batch, head=self.head)
        finally:
            config.active_outputs = previous
            model.train(was_training)


def _follows_contract(model: Any) -> bool:
    """Whether ``model`` is called as the export contract says (not a BaseModelMixin)."""
    return (
        getattr(model, "model_config", None) is None
        and hasattr(model, "cutoff")
        and hasattr(model, "atomic_numbers")
    )


def _check_head(model: Any, head: str | None) -> None:
    if head is None:
        return
    names = getattr(model, "head_names", None)
    if names is None or head not in names:
        raise ValueError(
            f"head={head!r} is not a head of {type(model).__name__} "
            f"(its heads: {list(names or [])})."
        )


def _state_fields(state: Any) -> tuple[torch.Tensor, ...]:
    """``(positions, cell, pbc, atomic_numbers, system_idx)`` of a SimState or a dict."""
    if isinstance(state, Mapping):
        missing = [k for k in ("positions", "cell", "atomic_numbers") if k not in state]
        if missing:
            raise KeyError(f"TorchSimModel: the state has no {missing}.")
        positions = state["positions"]
        system_idx = state.get("system_idx")
        if system_idx is None:
            system_idx = torch.zeros(positions.shape[0], dtype=torch.long, device=positions.device)
        pbc = state.get("pbc", True)
        return positions, state["cell"], pbc, state["atomic_numbers"], system_idx
    return state.positions, state.cell, state.pbc, state.atomic_numbers, state.system_idx


def _per_system_pbc(pbc: Any, num_systems: int, device: torch.device) -> torch.Tensor:
    """``[B, 3]`` bool from torch-sim's one flag, a ``[3]`` pattern or per-system rows."""
    flags = torch.as_tensor(pbc, dtype=torch.bool, device=device)
    if flags.numel() == 1:
        return flags.reshape(1, 1).expand(num_systems, 3)
    if flags.shape == (3,):
        return flags.reshape(1, 3).expand(num_systems, 3)
    if flags.shape == (num_systems, 3):
        return flags
    raise ValueError(
        f"TorchSimModel: pbc must be one flag, [3] or [n_systems, 3] = [{num_systems}, 3]; "
        f"got shape {list(flags.shape)}."
    )


def _new_batch(
    positions: torch.Tensor,
    cell: torch.Tensor,
    pbc: torch.Tensor,
    numbers: torch.Tensor,
    system_idx: torch.Tensor,
    num_systems: int,
) -> Any:
    """A ``Batch`` of the systems; open systems carry no cell (as the ASE calculator does)."""
    counts = torch.bincount(system_idx, minlength=num_systems).tolist()
    starts = [0]
    for count in counts[:-1]:
        starts.append(starts[-1] + count)
    if list(system_idx.cpu().tolist()) != [g for g, n in enumerate(counts) for _ in range(n)]:
        raise ValueError(
            "TorchSimModel: the atoms of each system must be contiguous and systems "
            "numbered 0..B-1 in order (state.system_idx)."
        )
    any_periodic = bool(pbc.any())
    structures = []
    for g, (start, count) in enumerate(zip(starts, counts)):
        fields: dict[str, Any] = {
            "atomic_numbers": numbers[start : start + count],
            "positions": positions[start : start + count],
        }
        if any_periodic:
            # One batch holds one cell per system; an open system in a periodic batch
            # gets its cell with pbc False (its neighbours ignore it).
            fields["cell"] = cell[g].unsqueeze(0)
            fields["pbc"] = pbc[g].unsqueeze(0)
        structures.append(AtomicData(**fields))
    return Batch.from_data_list(structures)
