"""``NeighborListHook``: build the neighbour lists of ``ctx.batch`` before the model runs.

The documented import path of :class:`~nvalchemi.data.neighbor_hook.NeighborListHook`,
which lives in the data layer (see there for what it does) so that models can build it
without importing the hooks package.

Example:
    >>> from nvalchemi.hooks.neighbor_list import NeighborListHook
    >>> NeighborListHook(5.0).cutoff
    5.0
"""

from nvalchemi.data.neighbor_hook import NeighborListHook

__all__ = ["NeighborListHook"]
