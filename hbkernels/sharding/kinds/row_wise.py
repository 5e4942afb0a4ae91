"""``row_wise``: rank ``r`` holds rows ``r, r + N, ...`` of the table (row ``id`` as its
local row ``id // N``), all columns. A dynamic table (``num_rows=None``) is cut by
a hash of the id instead: rank ``splitmix64(id) % N`` owns id ``id`` and gives it
one of its ``capacity / N`` slots (:class:`hbkernels.HashTable`); its ids travel
as they are and become rows on the owner."""
import numpy as np

from ..._bits import splitmix64
from .base import EmbeddingSharding, gather_interleaved


def dynamic_owner(xp, ids, world_size):
    """The rank that owns each id of a dynamic table (int64 ``xp`` array): a hash that
    is not the one the rank's index probes with, so each rank's ids spread evenly
    over its index too."""
    if world_size == 1:
        return xp.zeros(ids.shape[0], np.int64)
    with np.errstate(over="ignore"):
        return (splitmix64(ids.astype(np.int64, copy=False).view(np.uint64))
                % np.uint64(world_size)).astype(np.int64)


def dynamic_capacity(capacity, rank, world_size):
    """Slots of a dynamic table of ``capacity`` on ``rank``: an even share."""
    return capacity // world_size + (rank < capacity % world_size)


class RowWiseSharding(EmbeddingSharding):
    kind = "row_wise"

    def holders(self, spec, place, slice_index, world_size):
        n = world_size
        if spec.dynamic:  # slots, not ids: (rank, n) only names the shard
            return [(rank, rank, n, dynamic_capacity(spec.capacity, rank, n)) for rank in range(n)]
        return [(rank, rank, n, max(0, -(-(spec.num_rows - rank) // n))) for rank in range(n)]

    def route_ids(self, xp, ids, route, world_size):
        if route.group.dynamic:  # the owner maps the ids to rows
            return dynamic_owner(xp, ids, world_size), ids
        dest = ids % world_size
        return dest, xp.asarray(route.bases)[dest] + ids // world_size

    def gather(self, comm, spec, shards, pick, per_column, dtype, xp):
        return gather_interleaved(comm, spec, shards, pick, per_column, dtype, xp)
