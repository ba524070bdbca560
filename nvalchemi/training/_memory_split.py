"""A batch that runs out of memory, trained in pieces with the same update.

When a training step raises ``torch.OutOfMemoryError`` in its forward, loss or
backward, the run frees what the step allocated, cuts the batch into two contiguous
halves of about the same number of atoms, and trains the halves one after the other,
accumulating their gradients: the optimizer then takes the update of the whole batch.
A half that still runs out is cut again, down to single structures; a single
structure that does not fit raises ``torch.OutOfMemoryError`` naming its size. The
run remembers the largest piece that fitted (:class:`MemoryBudget`) and cuts every
later batch above it before its forward, so one out-of-memory error costs one failed
attempt, not one per batch. The loader, its sampler and the step count are not
changed: ``len(loader)``, learning-rate schedules sized in steps, the batch counts of
the ranks and an exact resume all stay as configured.

Exactness. Each piece's loss is weighted by its share of what the whole batch's
reduction divides by, so the pieces' weighted losses sum to the whole batch's loss and
their gradients to its gradient (up to float rounding: the same sums, added in
another order). The shares of the built-in leaf losses:

* a mean over structures (``EnergyMSELoss``/``EnergyMAELoss`` with ``per_atom=False``,
  ``EnergyHuberLoss``, forces with ``normalize_by_atom_count=True``, ``StressMSELoss``,
  ``StressHuberLoss``): the piece's share of the labelled structures (structures
  without the label, ``Batch.missing_labels``, are not counted; with
  ``ignore_nonfinite=True`` an energy that is not finite is not counted either);
* a mean weighted by atom counts (``EnergyMSELoss``/``EnergyMAELoss`` with
  ``per_atom=True``): the share of the atoms of those structures;
* a mean over components (``ForceMSELoss``/``ForceHuberLoss`` with
  ``normalize_by_atom_count=False``) or over atoms (``ForceL2NormLoss`` with it
  False): the share of the counted components or atoms (finite ones with
  ``ignore_nonfinite=True``).

These are exact when the targets are batch fields (the default target assembler) and
the model treats structures independently (no batch normalisation across structures).
A loss of another class (a user's leaf) is weighted by its share of the structures,
which is exact for a mean over structures; a warning names it once. Weights (a
structure's ``loss_weight`` and ``<label>_weight``, force ``element_weights``) weight the
shares as they weight the means, so weighted losses split exactly too.

Under DDP every rank takes the same decision (see :class:`DistributedVote`): one
all-reduce per step, on the CPU, says whether some rank ran out (or must cut its
batch), and then every rank trains its batch in pieces without DDP's gradient
synchronisation and averages the pieces' gradients itself, once.

Example:
    >>> import torch
    >>> from nvalchemi.data import AtomicData, Batch
    >>> def cell(n):
    ...     return AtomicData(atomic_numbers=torch.ones(n, dtype=torch.long),
    ...                       positions=torch.randn(n, 3))
    >>> batch = Batch.from_data_list([cell(5), cell(1), cell(2), cell(4)])
    >>> first, second = halves(batch)
    >>> first.num_nodes_list, second.num_nodes_list
    ([5, 1], [2, 4])
    >>> budget = MemoryBudget()
    >>> budget.fits(batch), budget.learn(6, None), budget.fits(batch), budget.fits(first)
    (True, None, False, True)
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from nvalchemi.training.losses import terms
from nvalchemi.training.losses.base import graph_loss_weight

__all__ = [
    "DistributedVote",
    "LossShares",
    "MemoryBudget",
    "PieceResults",
    "halves",
    "train_in_pieces",
]


class MemoryBudget:
    """The largest batch (atoms, and edges where known) that trained after running out.

    ``None`` limits until the first out-of-memory error; then a batch with more atoms
    (or, when it carries a neighbour list, more edges) is cut before its forward.
    """

    __slots__ = ("max_atoms", "max_edges", "splits")

    def __init__(self) -> None:
        self.max_atoms: int | None = None
        self.max_edges: int | None = None
        self.splits = 0  # steps trained in pieces

    @property
    def active(self) -> bool:
        """Whether some batch ran out of memory in this run."""
        return self.max_atoms is not None

    def fits(self, batch: Any) -> bool:
        """Whether ``batch`` is within the budget (always, before the first error)."""
        if self.max_atoms is None:
            return True
        if batch.num_nodes > self.max_atoms:
            return False
        edges = _edges(batch)
        return self.max_edges is None or edges is None or edges <= self.max_edges

    def learn(self, atoms: int, edges: int | None) -> None:
        """Lower the budget to ``atoms`` (and ``edges``), never raise it."""
        self.max_atoms = atoms if self.max_atoms is None else min(self.max_atoms, atoms)
        if edges is not None:
            self.max_edges = edges if self.max_edges is None else min(self.max_edges, edges)

    def __repr__(self) -> str:
        return f"MemoryBudget(max_atoms={self.max_atoms}, max_edges={self.max_edges})"


def _edges(batch: Any) -> int | None:
    """Edges of ``batch`` when it carries a COO neighbour list, else ``None``."""
    return batch.num_edges if "neighbor_list" in batch else None


def halves(batch: Any) -> tuple[Any, Any]:
    """Two contiguous halves of ``batch`` (by structures) with about equal atom counts.

    The first half holds structures ``0..k-1``, the second ``k..B-1`` (``1 <= k < B``),
    so predictions of the halves, concatenated, are laid out like the whole batch's.
    Atom counts live on the host: no device synchronisation.
    """
    counts = batch.num_nodes_list
    if len(counts) < 2:
        raise ValueError(f"cannot split a batch of {len(counts)} structure(s) in two.")
    total, running, best, k = sum(counts), 0, None, 1
    for i, n in enumerate(counts[:-1], start=1):
        running += n
        gap = abs(2 * running - total)
        if best is None or gap < best:
            best, k = gap, i
    return batch.index_select(list(range(k))), batch.index_select(list(range(k, len(counts))))


# ----------------------------------------------------------------------------- loss shares
class LossShares:
    """What each built-in leaf's reduction divides by, per structure of the whole batch.

    :meth:`of` gives a piece's share (structures ``start..stop-1``) per component name.
    """

    def __init__(self, loss_fn: Any, batch: Any) -> None:
        self.names = list(loss_fn.component_names)
        self.approximate: list[str] = []
        self._prefix: dict[str, list[float]] = {}
        count = batch.num_graphs
        for name, leaf in zip(self.names, loss_fn.components):
            weights = _denominators(leaf, batch)
            if weights is None:
                self.approximate.append(f"{name} ({type(leaf).__name__})")
                weights = torch.ones(count, dtype=torch.float64)
            prefix = [0.0]
            for value in weights.tolist():
                prefix.append(prefix[-1] + value)
            self._prefix[name] = prefix

    def of(self, start: int, stop: int) -> dict[str, float]:
        """``{component name: share}`` of structures ``start..stop-1`` (0 where nothing counts)."""
        out = {}
        for name, prefix in self._prefix.items():
            total = prefix[-1]
            out[name] = (prefix[stop] - prefix[start]) / total if total > 0 else 0.0
        return out


def _denominators(leaf: Any, batch: Any) -> torch.Tensor | None:
    """Per-structure contribution to ``leaf``'s denominator (float64, host), ``None`` if unknown."""
    kind = type(leaf)
    structures = batch.num_graphs
    atoms = torch.tensor(batch.num_nodes_list, dtype=torch.float64)
    key = getattr(leaf, "target_key", None)
    missing = batch.missing_labels.get(key) if key is not None else None
    labelled = (
        torch.ones(structures, dtype=torch.float64)
        if missing is None
        else (~missing).to(device="cpu", dtype=torch.float64)
    )
    weight = graph_loss_weight(leaf, {"batch": batch})  # weighted means divide by weights
    if weight is not None:
        labelled = labelled * weight.detach().to(device="cpu", dtype=torch.float64)
    target = batch.get(key) if key is not None else None
    screen = bool(getattr(leaf, "ignore_nonfinite", False)) and isinstance(target, torch.Tensor)
    if kind in (terms.EnergyMSELoss, terms.EnergyMAELoss, terms.EnergyHuberLoss):
        valid = labelled
        if screen:
            finite = torch.isfinite(target.detach().reshape(structures, -1)).all(-1)
            valid = valid * finite.to(device="cpu", dtype=torch.float64)
        if leaf.per_atom and kind is not terms.EnergyHuberLoss:
            return valid * atoms.clamp_min(1)
        return valid
    if kind in (terms.ForceMSELoss, terms.ForceHuberLoss, terms.ForceL2NormLoss):
        if leaf.normalize_by_atom_count:
            return labelled
        components = 1 if kind is terms.ForceL2NormLoss else 3
        if screen:
            finite = torch.isfinite(target.detach()).to("cpu")
            per_atom = finite.all(-1) if components == 1 else finite.sum(-1)
            per_atom = per_atom.to(torch.float64)
        else:
            per_atom = torch.full((int(atoms.sum()),), float(components), dtype=torch.float64)
        if leaf.element_weights is not None:
            per_atom = per_atom * leaf.element_weight_of(batch.atomic_numbers, per_atom)
        owner = torch.repeat_interleave(torch.arange(structures), atoms.to(torch.long))
        per_structure = torch.zeros(structures, dtype=torch.float64).index_add_(0, owner, per_atom)
        return per_structure * labelled
    if kind in (terms.StressMSELoss, terms.StressHuberLoss):
        return labelled
    return None


def weighted_total(out: Mapping[str, Any], shares: Mapping[str, float]) -> torch.Tensor | None:
    """``sum(weight * share * loss)`` over components: a piece's part of the whole loss."""
    weights = out["per_component_weight"]
    total = None
    for name, value in out["per_component_unweighted"].items():
        factor = weights[name] * shares[name]
        if factor == 0.0:
            continue  # a piece without this label: nothing of it is in the whole loss
        term = value * factor
        total = term if total is None else total + term
    return total


# ----------------------------------------------------------------------------- the pieces
class PieceResults:
    """What training a batch in pieces produced: the summed gradients (aligned with the
    parameters), the whole batch's detached loss and loss output (:attr:`out`, in the
    layout of ``compute_supervised_loss``), the concatenated :attr:`predictions`, the
    ``(atoms, edges)`` of every piece that trained and whether some piece ran out."""

    def __init__(self, count: int) -> None:
        self.grads: list[torch.Tensor | None] = [None] * count
        self.total: torch.Tensor | None = None
        self.parts: dict[str, torch.Tensor] = {}
        self.samples: dict[str, list[torch.Tensor]] = {}
        self.weights: dict[str, float] = {}
        self.raw_weights: dict[str, float] = {}
        self.prediction_parts: dict[str, list[Any]] = {}
        self.pieces: list[tuple[int, int | None]] = []
        self.ran_out = False

    def add(
        self,
        grads: Sequence[torch.Tensor | None],
        predictions: Mapping[str, Any],
        out: Mapping[str, Any],
        total: torch.Tensor,
        shares: Mapping[str, float],
        size: tuple[int, int | None],
    ) -> None:
        for i, grad in enumerate(grads):
            if grad is not None:
                held = self.grads[i]
                self.grads[i] = grad if held is None else held.add_(grad)
        total = total.detach()
        self.total = total if self.total is None else self.total + total
        self.weights, self.raw_weights = (
            out["per_component_weight"],
            out["per_component_raw_weight"],
        )
        for name, value in out["per_component_unweighted"].items():
            part = value.detach() * shares[name]
            self.parts[name] = part if name not in self.parts else self.parts[name] + part
        for name, value in dict(out["per_component_sample"]).items():
            self.samples.setdefault(name, []).append(value)
        for key, value in predictions.items():
            self.prediction_parts.setdefault(key, []).append(
                value.detach() if isinstance(value, torch.Tensor) else value
            )
        self.pieces.append(size)

    @property
    def predictions(self) -> dict[str, Any]:
        out = {}
        for key, values in self.prediction_parts.items():
            if all(isinstance(v, torch.Tensor) and v.ndim > 0 for v in values):
                out[key] = torch.cat(values, dim=0)
            else:
                out[key] = values[-1]
        return out

    @property
    def out(self) -> dict[str, Any]:
        return {
            "total_loss": self.total,
            "per_component_unweighted": dict(self.parts),
            "per_component_weight": dict(self.weights),
            "per_component_raw_weight": dict(self.raw_weights),
            "per_component_sample": {k: torch.cat(v) for k, v in self.samples.items()},
        }


def train_in_pieces(
    batch: Any,
    run_piece: Callable[[Any], tuple[Mapping[str, Any], Mapping[str, Any]]],
    params: Sequence[torch.Tensor],
    shares: LossShares,
    budget: MemoryBudget,
    *,
    ran_out: bool,
    scale: float = 1.0,
    where: str = "",
) -> PieceResults:
    """Forward, loss and gradients of ``batch`` piece by piece (see the module docstring).

    ``run_piece(piece) -> (predictions, loss output)`` runs the forward and the loss
    of one piece. ``ran_out``: the whole batch ran out of memory already (it is cut at
    once). Pieces above the budget are cut before they run. The gradients of ``scale *
    loss`` are taken with ``torch.autograd.grad``, so a piece that runs out leaves
    nothing behind and is cut again. After an out-of-memory error the budget becomes
    the largest piece that trained.
    """
    results = PieceResults(len(params))
    queue: deque[tuple[int, int, Any]] = deque()
    whole = (0, batch.num_graphs, batch)
    if ran_out:
        if batch.num_graphs < 2:
            raise _single_structure_error(0, batch, "the step ran out of memory", where)
        results.ran_out = True
        queue.extend(_cut(*whole))
    else:
        queue.append(whole)
    while queue:
        start, stop, piece = queue.popleft()
        if stop - start > 1 and not budget.fits(piece):
            queue.extendleft(reversed(_cut(start, stop, piece)))
            continue
        failure = None
        try:
            share = shares.of(start, stop)
            predictions, out = run_piece(piece)
            total = weighted_total(out, share)
            grads: Sequence[torch.Tensor | None] = [None] * len(params)
            if total is not None and params:
                grads = torch.autograd.grad(
                    total * scale if scale != 1.0 else total, params, allow_unused=True
                )
        except torch.OutOfMemoryError as exc:
            failure = str(exc).splitlines()[0] if str(exc) else "out of memory"
        if failure is not None:  # outside the handler: its traceback holds the piece's graph
            predictions = out = total = grads = None
            release_memory(piece)
            if stop - start == 1:
                raise _single_structure_error(start, piece, failure, where)
            results.ran_out = True
            edges = _edges(piece)
            budget.learn(piece.num_nodes - 1, None if edges is None else edges - 1)
            queue.extendleft(reversed(_cut(start, stop, piece)))
            continue
        zero = total if total is not None else torch.zeros(())
        results.add(grads, predictions, out, zero, share, (piece.num_nodes, _edges(piece)))
        del predictions, out, total, grads
    if results.ran_out:
        atoms = max(a for a, _ in results.pieces)
        edges = [e for _, e in results.pieces if e is not None]
        budget.learn(atoms, max(edges) if edges else None)
    budget.splits += 1
    if shares.approximate:
        warnings.warn(
            "A batch that ran out of memory was trained in pieces; the pieces of "
            f"{', '.join(shares.approximate)} are weighted by their share of the structures, "
            "which equals the whole batch's loss only for a mean over structures.",
            UserWarning,
            stacklevel=2,
        )
    return results


def _single_structure_error(
    index: int, piece: Any, message: str, where: str
) -> torch.OutOfMemoryError:
    edges = _edges(piece)
    return torch.OutOfMemoryError(
        f"A single structure does not fit in memory{where}: structure {index} of the batch "
        f"has {piece.num_nodes} atoms"
        + (f" and {edges} edges" if edges is not None else "")
        + f"; training it alone ran out ({message}). Fix: leave such structures out of the "
        "training set (BudgetBatchSampler warns about structures above its budget), or use "
        "a smaller model, a shorter cutoff or a device with more memory."
    )


def _cut(start: int, stop: int, piece: Any) -> list[tuple[int, int, Any]]:
    first, second = halves(piece)
    middle = start + first.num_graphs
    return [(start, middle, first), (middle, stop, second)]


def release_memory(batch: Any) -> None:
    """Return cached blocks to the device after an out-of-memory error (CUDA only)."""
    device = getattr(batch, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def add_gradients(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], factor: Any
) -> None:
    """``param.grad += factor * grad`` for every parameter a piece reached."""
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        grad = grad * factor
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


# ----------------------------------------------------------------------------- DDP
class DistributedVote:
    """One all-reduce per step: did some rank run out of memory, or must cut its batch?

    Every rank calls :meth:`__call__` once per step at the same point (after the
    forward and loss, before any gradient synchronisation), so a rank that ran out
    in its forward and the ranks that did not take the same decision. The vote
    travels on a CPU (gloo) group: no device synchronisation. A rank that runs out
    in its backward cannot be matched (DDP's gradient all-reduce is already under
    way on the others): that error is raised as it is.
    """

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        found = (getattr(manager, name, None) for name in ("process_group", "group"))
        group = next((g for g in found if g is not None), None)
        self.gradient_group = group  # the pieces' gradients go where DDP's would
        backend = dist.get_backend(group) if group is not None else dist.get_backend()
        if str(backend).lower() != "gloo":
            ranks = None if group is None else dist.get_process_group_ranks(group)
            group = dist.new_group(ranks=ranks, backend="gloo")
        self.group = group
        self.flag = torch.zeros(1, dtype=torch.int32)

    def __call__(self, wants_split: bool) -> bool:
        """Whether any rank wants to train this step in pieces (a collective: call on all)."""
        flag = self.flag
        flag.fill_(1 if wants_split else 0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag[0])


def average_gradients(
    grads: list[torch.Tensor | None], params: Sequence[torch.Tensor], group: Any = None
) -> None:
    """Average the pieces' gradients over the ranks in place (DDP's mean; one all-reduce
    per parameter dtype). Every rank sends every parameter, zeros where none was reached."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, param in enumerate(params):
        by_kind.setdefault((param.dtype, param.device), []).append(i)
    world = dist.get_world_size(group)
    for indices in by_kind.values():
        flat = torch.cat(
            [
                (grads[i] if grads[i] is not None else torch.zeros_like(params[i])).reshape(-1)
                for i in indices
            ]
        )
        dist.all_reduce(flat, group=group)
        flat /= world
        offset = 0
        for i in indices:
            n = params[i].numel()
            grads[i] = flat[offset : offset + n].view_as(params[i])
            offset += n
