"""The model contract: what a model declares, what it reads from a batch, what it returns.

A model is ``class MyModel(nn.Module, BaseModelMixin)`` that sets
``self.model_config = ModelConfig(...)`` in ``__init__`` and implements ``forward(data)``
as ``adapt_input -> compute -> adapt_output``. Calling it on an ``AtomicData`` or a
``Batch`` returns an ordered mapping of output name to tensor (or ``None``):

* ``energy`` ``[B, 1]`` (eV), ``forces`` ``[V, 3]`` (eV/Å),
* ``stress`` ``[B, 3, 3]`` (eV/Å³, positive = tensile, ASE's sign), ...

Forces and stress are usually derivatives of the energy; the one shared implementation
is :func:`nvalchemi.models._utils.energy_and_derivatives`. Any plain ``nn.Module`` can
still be trained with a custom ``training_fn``; this contract is a convenience.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Pair(nn.Module, BaseModelMixin):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.model_config = ModelConfig(outputs={"energy"})
    ...     embedding_shapes = {}
    ...     def compute_embeddings(self, data, **kwargs):
    ...         raise NotImplementedError
    ...     def forward(self, data, **kwargs):
    ...         inputs = self.adapt_input(data)
    ...         energy = (inputs["positions"] ** 2).sum().reshape(1, 1)
    ...         return self.adapt_output({"energy": energy}, data)
    >>> Pair().output_data()
    {'energy'}
"""

from __future__ import annotations

import abc
import functools
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from nvalchemi.data import AtomicData, Batch

__all__ = ["BaseModelMixin", "ModelConfig", "NeighborConfig", "NeighborListFormat"]

_NEIGHBOR_HELP = (
    "Compute neighbour lists first, e.g. "
    "nvalchemi.data.neighbors.compute_neighbors(batch, config=model.model_config.neighbor_config), "
    "or register the hooks from model.make_neighbor_hooks(stage=...) with your training strategy."
)


class NeighborListFormat(str, Enum):
    """How a model wants its neighbours.

    ``COO``: ``neighbor_list [E, 2]`` (``[sender, receiver]``, global atom indices) and
    ``neighbor_list_shifts [E, 3]``. ``MATRIX``: ``neighbor_matrix [V, K]`` padded with
    ``V`` plus ``num_neighbors [V]``.
    """

    COO = "coo"
    MATRIX = "matrix"


class NeighborConfig(BaseModel):
    """Neighbour-list requirements of a model.

    Attributes:
        cutoff: interaction cutoff in Å.
        format: edge list (``COO``) or padded matrix (``MATRIX``).
        half_list: each unordered pair once instead of both directions.
        skin: Verlet skin in Å (0 rebuilds every call); lists are built out to
            ``cutoff + skin`` and models must ignore pairs beyond ``cutoff``.
    """

    model_config = ConfigDict(extra="forbid")

    cutoff: float = Field(gt=0.0)
    format: NeighborListFormat = NeighborListFormat.COO
    half_list: bool = False
    skin: float = Field(default=0.0, ge=0.0)


class ModelConfig(BaseModel):
    """What a model can compute and what it needs.

    Capability fields are frozensets (plain sets and lists are accepted). Runtime
    fields ``active_outputs`` (what to compute now; defaults to every output) and
    ``gradient_keys`` (extra inputs that need ``requires_grad``) may be reassigned
    freely and are not validated on assignment (they are read in the hot path).

    Example:
        >>> cfg = ModelConfig(outputs={"energy", "forces"}, autograd_outputs={"forces"})
        >>> sorted(cfg.active_outputs)
        ['energy', 'forces']
        >>> cfg.active_outputs = {"energy"}
    """

    model_config = ConfigDict(extra="forbid")

    outputs: frozenset[str] = frozenset({"energy"})
    autograd_outputs: frozenset[str] = frozenset()
    autograd_inputs: frozenset[str] = frozenset({"positions"})
    required_inputs: frozenset[str] = frozenset()
    optional_inputs: frozenset[str] = frozenset()
    supports_pbc: bool = False
    needs_pbc: bool = False
    neighbor_config: NeighborConfig | None = None
    active_outputs: set[str] | None = None
    gradient_keys: set[str] = Field(default_factory=set)

    @field_validator("active_outputs", "gradient_keys", mode="before")
    @classmethod
    def _iterable_to_set(cls, value: Any) -> Any:
        if value is None or isinstance(value, set):
            return value
        if isinstance(value, str):
            return {value}
        return set(value)

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        unknown = self.autograd_outputs - self.outputs
        if unknown:
            raise ValueError(
                f"autograd_outputs {sorted(unknown)} are not in outputs {sorted(self.outputs)}; "
                "every derived output must also be declared as an output."
            )
        if self.needs_pbc and not self.supports_pbc:
            raise ValueError("needs_pbc=True requires supports_pbc=True.")
        if self.active_outputs is None:
            self.active_outputs = set(self.outputs)
        return self

    @property
    def needs_neighborlist(self) -> bool:
        """Whether the model reads neighbour lists from its input."""
        return self.neighbor_config is not None


def _check_model_config_after_init(cls: type, init):
    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # Only the outermost __init__ checks: a parent's __init__ may run before the
        # subclass sets the config.
        if type(self).__init__ is __init__ and not isinstance(
            getattr(self, "model_config", None), ModelConfig
        ):
            raise TypeError(
                f"{type(self).__name__}.__init__() must set self.model_config = "
                "ModelConfig(...) (declaring outputs, inputs, pbc support and neighbours)."
            )

    return __init__


def _config_repr(self: BaseModelMixin) -> str:
    cfg = self.model_config
    parts = [f"outputs={sorted(cfg.outputs)}"]
    if cfg.active_outputs is not None and set(cfg.active_outputs) != set(cfg.outputs):
        parts.append(f"active={sorted(cfg.active_outputs)}")
    if cfg.autograd_outputs:
        parts.append(f"autograd={sorted(cfg.autograd_outputs)}")
    if cfg.required_inputs:
        parts.append(f"required={sorted(cfg.required_inputs)}")
    if cfg.optional_inputs:
        parts.append(f"optional={sorted(cfg.optional_inputs)}")
    parts.append(f"pbc={'required' if cfg.needs_pbc else cfg.supports_pbc}")
    if cfg.neighbor_config is not None:
        nc = cfg.neighbor_config
        parts.append(f"neighbors={nc.format.value}(cutoff={nc.cutoff:g}, half={nc.half_list})")
    return ", ".join(parts)


class BaseModelMixin(abc.ABC):
    """Mixin giving an ``nn.Module`` the nvalchemi model contract.

    Subclasses must set ``self.model_config`` in ``__init__`` (checked after
    construction), implement ``forward(data, **kwargs)`` (usually
    ``adapt_input -> compute -> adapt_output``), the property ``embedding_shapes``
    and ``compute_embeddings(data)``.

    Checkpoints rebuild a model from its constructor: store every constructor
    argument under an attribute of the same name, or define ``checkpoint_spec()``.
    """

    model_config: ModelConfig

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _check_model_config_after_init(cls, cls.__dict__["__init__"])
        if "extra_repr" not in cls.__dict__:
            cls.extra_repr = _config_repr

    # ------------------------------------------------------------- embeddings
    @property
    @abc.abstractmethod
    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        """Trailing shapes of the embeddings ``compute_embeddings`` writes (``{}`` if none)."""

    @abc.abstractmethod
    def compute_embeddings(self, data: AtomicData | Batch, **kwargs: Any) -> AtomicData | Batch:
        """Write ``node_embeddings [V, H]`` / ``graph_embeddings [B, H]`` onto ``data``."""

    # ------------------------------------------------------------- inputs
    def input_data(self) -> set[str]:
        """Names of the batch fields the model reads (optional inputs excluded)."""
        cfg = self.model_config
        keys = {"positions", "atomic_numbers"}
        if cfg.neighbor_config is not None:
            if cfg.neighbor_config.format == NeighborListFormat.COO:
                keys.add("neighbor_list")
            else:
                keys |= {"neighbor_matrix", "num_neighbors"}
        if cfg.needs_pbc:
            keys |= {"pbc", "cell"}
        return keys | set(cfg.required_inputs)

    def output_data(self) -> set[str]:
        """Outputs to compute now: ``active_outputs`` that the model supports.

        Requested outputs the model cannot produce are dropped with a ``UserWarning``.
        """
        cfg = self.model_config
        active = set(cfg.active_outputs if cfg.active_outputs is not None else cfg.outputs)
        unsupported = active - cfg.outputs
        if unsupported:
            warnings.warn(
                f"{type(self).__name__} cannot compute {sorted(unsupported)}; supported outputs "
                f"are {sorted(cfg.outputs)}. They are ignored.",
                UserWarning,
                stacklevel=2,
            )
        return active & cfg.outputs

    def gradient_inputs(self) -> set[str]:
        """Inputs that need ``requires_grad`` for the active outputs."""
        cfg = self.model_config
        keys = set(cfg.gradient_keys)
        if cfg.autograd_outputs & self.output_data():
            keys |= cfg.autograd_inputs
        return keys

    def adapt_input(self, data: AtomicData | Batch, **kwargs: Any) -> dict[str, Any]:
        """Collect the model's inputs from ``data`` into a dict.

        Inputs that need gradients are returned as *detached aliases* with
        ``requires_grad=True`` (tensors that already require grad are kept so an
        upstream graph stays connected); the tensors stored on ``data`` are never
        modified.

        Checks, besides presence: a neighbour list whose stamp (see
        :func:`nvalchemi.data.neighbors.has_neighbor_list`) says it was built with a
        smaller cutoff or the other half/full choice than ``neighbor_config`` is
        rejected (a larger cutoff is fine: models ignore pairs beyond their cutoff);
        unstamped lists are trusted. A model with ``needs_pbc`` rejects systems
        whose ``pbc`` is all False (e.g. a molecule collated with crystals).

        Raises:
            KeyError: a required input is missing (all missing names are listed).
            TypeError: an input that needs gradients is not a tensor.
            ValueError: the neighbour list does not fit the model, or a system is not
                periodic for a model that needs PBC.
        """
        inputs: dict[str, Any] = {}
        grad_keys = self.gradient_inputs()
        required = self.input_data()
        missing = sorted(k for k in required | grad_keys if _get(data, k) is None)
        if missing:
            help_ = ""
            if {"neighbor_list", "neighbor_matrix", "num_neighbors"} & set(missing):
                help_ = " " + _NEIGHBOR_HELP
            raise KeyError(
                f"{type(self).__name__} needs {missing} but the input data has no such field "
                f"(present: {sorted(_keys(data))}).{help_}"
            )
        self._check_neighbor_stamp(data)
        if self.model_config.needs_pbc:
            _check_all_periodic(type(self).__name__, _get(data, "pbc"))
        for key in grad_keys:
            value = _get(data, key)
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"'{key}' is needed for gradient computation but is a "
                    f"{type(value).__name__} (not a tensor)."
                )
            if not value.requires_grad:
                value = value.detach().requires_grad_(True)
            inputs[key] = value
        for key in required:
            inputs.setdefault(key, _get(data, key))
        for key in self.model_config.optional_inputs:
            value = _get(data, key)
            if value is not None:
                inputs.setdefault(key, value)
        return inputs

    def _check_neighbor_stamp(self, data: AtomicData | Batch) -> None:
        """Reject a stamped neighbour list built for other options (Python only, no sync)."""
        config = self.model_config.neighbor_config
        if config is None:
            return
        from nvalchemi.data._neighbor_stamps import stamp_of

        stamp = stamp_of(data, config.format.value)
        if stamp is None:
            return
        cutoff, half_list = stamp
        # Lists may reach further than the cutoff (Verlet skin): models drop those pairs.
        too_short = cutoff < config.cutoff * (1.0 - 1e-9)
        if not too_short and half_list == config.half_list:
            return

        def kind(half: bool) -> str:
            return "half" if half else "full"

        raise ValueError(
            f"{type(self).__name__} needs a {kind(config.half_list)} neighbour list with cutoff "
            f">= {config.cutoff:g} Å, but the input's list was built as a {kind(half_list)} list "
            f"with cutoff {cutoff:g} Å. Rebuild it with "
            "nvalchemi.data.neighbors.compute_neighbors(batch, "
            "config=model.model_config.neighbor_config), or use the NeighborListHook from "
            "model.make_neighbor_hooks(...)."
        )

    def adapt_output(self, model_output: Any, data: AtomicData | Batch) -> OrderedDict:
        """Map the raw model output to the standard keys of the active outputs.

        Every active output gets an entry (``None`` when the model did not produce
        it); a 1-D ``energy`` becomes ``[B, 1]``. Tensors stay attached to the graph.
        """
        out: OrderedDict[str, torch.Tensor | None] = OrderedDict(
            (k, None) for k in sorted(self.output_data())
        )
        if isinstance(model_output, Mapping):
            for key in out:
                value = model_output.get(key)
                if value is not None:
                    out[key] = value
        energy = out.get("energy")
        if isinstance(energy, torch.Tensor) and energy.dim() <= 1:
            out["energy"] = energy.reshape(-1, 1)
        return out

    def direct_derivative_keys(self) -> set[str]:
        """Outputs this model computes analytically even inside an autograd pipeline."""
        return set()

    def set_config(self, key: str, value: Any) -> None:
        """Set a field of ``model_config`` (e.g. ``set_config("active_outputs", {"energy"})``)."""
        if key not in ModelConfig.model_fields:
            raise AttributeError(
                f"ModelConfig has no field {key!r}; fields: {sorted(ModelConfig.model_fields)}."
            )
        if key in ("active_outputs", "gradient_keys") and value is not None:
            value = {value} if isinstance(value, str) else set(value)
        setattr(self.model_config, key, value)

    # ------------------------------------------------------------ neighbours
    def make_neighbor_hooks(
        self,
        max_neighbors: int | None = None,
        neighbor_list_method: str | None = None,
        *,
        stage: Enum | None = None,
    ) -> list:
        """Hooks that keep this model's neighbour lists up to date.

        Args:
            max_neighbors: initial neighbour capacity hint (``MATRIX`` format).
            neighbor_list_method: algorithm name forwarded to the hook.
            stage: engine stage to run at, e.g. ``TrainingStage.BEFORE_FORWARD``;
                ``None`` leaves it to the registration call.

        Returns:
            ``[]`` when the model needs no neighbours, else one ``NeighborListHook``.
        """
        config = self.model_config.neighbor_config
        if config is None:
            return []
        from nvalchemi.data.neighbor_hook import NeighborListHook

        return [
            NeighborListHook(
                config,
                skin=config.skin,
                max_neighbors=max_neighbors,
                stage=stage,
                method=neighbor_list_method,
            )
        ]

    # ------------------------------------------------------------- exporting
    def add_output_head(self, prefix: str) -> None:
        """Add a new output head (not supported by default)."""
        raise NotImplementedError(f"{type(self).__name__} does not support extra output heads.")

    def export_model(self, path: str | Path, as_state_dict: bool = False) -> None:
        """Save the model: its ``state_dict`` or, by default, the pickled module.

        A pickled module needs ``torch.load(path, weights_only=False)``, which runs
        code from the file: load only files you trust.
        """
        if not isinstance(self, torch.nn.Module):
            raise TypeError(f"{type(self).__name__} is not an nn.Module; nothing to export.")
        torch.save(self.state_dict() if as_state_dict else self, Path(path))


# The last accelerator ``pbc`` tensor found valid (weakly, with its in-place version):
# a batch that is run again (dynamics, a calculator) is not read back a second time.
_PERIODIC_CHECKED: list[tuple[weakref.ref, int]] = []


def _check_all_periodic(model_name: str, pbc: Any) -> None:
    """Raise when a system's ``pbc`` is all False for a model that needs PBC.

    Collation gives a molecule in a batch of crystals a zero cell and ``pbc`` False,
    on which such a model would silently return nonsense. The check reads one
    value back from the device (once per ``pbc`` tensor); on the CPU it is free.
    """
    if not isinstance(pbc, torch.Tensor):
        return
    on_device = pbc.device.type != "cpu"
    if on_device and _PERIODIC_CHECKED:
        ref, version = _PERIODIC_CHECKED[0]
        if ref() is pbc and pbc._version == version:
            return
    open_systems = ~pbc.reshape(-1, 3).any(dim=-1)
    if bool(open_systems.any()):
        indices = open_systems.nonzero().flatten().tolist()
        raise ValueError(
            f"{model_name} needs periodic systems (needs_pbc=True), but system(s) {indices} "
            "of the input have pbc all False (a molecule batched with crystals gets a zero "
            "cell and pbc False). Give every structure a cell and pbc, or use a model that "
            "supports open boundaries for those structures."
        )
    if on_device:
        _PERIODIC_CHECKED[:] = [(weakref.ref(pbc), pbc._version)]


def _get(data: Any, key: str) -> Any:
    """A field of an ``AtomicData``/``Batch``/mapping, or a derived attribute (``batch_idx``)."""
    if isinstance(data, Mapping):
        return data.get(key)
    if key in data:
        return data[key]
    return getattr(data, key, None)


def _keys(data: Any) -> Iterable[str]:
    keys = getattr(data, "keys", None)
    if callable(keys):
        keys = keys()
    if isinstance(keys, Mapping):  # Batch.keys: {"node": {...}, "edge": {...}, ...}
        return set().union(*keys.values())
    return keys or []
