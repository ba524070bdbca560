"""``dataset.balance``: the group-balanced sampler of a job's training data.

Groups are the values of an extxyz/db info key (``config_type`` by default) of the
training structures, read once from the files' comment lines; the sampler draws each
group in proportion to ``count ** alpha`` (see
:class:`~nvalchemi.data.datapipes.GroupBalancedSampler` and ``docs/weights.md``).
"""

from __future__ import annotations

from typing import Any

from nvalchemi._errors import FieldError

__all__ = ["balanced_sampler", "balance_line"]


def balanced_sampler(
    job: Any,
    readers: list[Any],
    *,
    shuffle: bool,
    seed: int,
    whole_epoch: bool,
    replay: bool = False,
) -> Any:
    """The job's :class:`GroupBalancedSampler` over ``readers`` (``None`` without
    ``dataset.balance``). ``whole_epoch``: one replica (a budget sampler packs and shards
    its order; a plain loader's sampler is rebuilt from its ``groups`` for the ranks),
    else sharded over the process group."""
    balance = job.dataset.balance
    if balance is None:
        return None
    if replay:
        raise FieldError(
            "does not combine with finetune.replay, which mixes the replay structures into "
            "the batches itself",
            field="dataset.balance",
            fix="remove dataset.balance, or weight the rare groups with "
            "dataset.config_type_weights instead",
        )
    from nvalchemi.data.datapipes import GroupBalancedSampler
    from nvalchemi.data.groups import info_labels

    labels = info_labels(readers, balance.group_by)
    if all(label is None for label in labels):
        raise FieldError(
            f"no training structure has the info key {balance.group_by!r} (zarr stores keep "
            "no info)",
            field="dataset.balance.group_by",
            fix="name a key of the extxyz/db comment lines (`nvalchemi-training data stats "
            "--group-by KEY` lists the groups), or train from the extxyz/db files",
        )
    replicas = {"num_replicas": 1, "rank": 0} if whole_epoch else {}
    return GroupBalancedSampler(labels, alpha=balance.alpha, shuffle=shuffle, seed=seed, **replicas)


def balance_line(sampler: Any, group_by: str) -> str:
    """One console line: the groups and their draws per epoch."""
    sizes = {name: int(m.numel()) for name, m in zip(sampler.names, sampler.members)}
    parts = ", ".join(
        f"{'(none)' if name is None else name} {sizes[name]}->{count}"
        for name, count in sorted(sampler.counts.items(), key=lambda item: sizes[item[0]])
    )
    return (
        f"balanced sampling by {group_by} (alpha {sampler.alpha:g}), structures -> draws per "
        f"epoch: {parts}"
    )
