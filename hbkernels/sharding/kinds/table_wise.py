"""``table_wise``: one rank holds the whole table."""
import numpy as np

from .base import EmbeddingSharding


class OwnedSharding(EmbeddingSharding):
    """Each column slice held whole by one rank (``place.ranks``, one per slice)."""

    def holders(self, spec, place, slice_index, world_size):
        return [(int(place.ranks[self.owner_index(slice_index)]), 0, 1, spec.num_rows)]

    def owner_index(self, slice_index):
        """Which of ``place.ranks`` holds column slice ``slice_index``."""
        raise NotImplementedError

    def route_ids(self, xp, ids, route, world_size):
        return xp.full(ids.shape[0], route.owner, np.int64), ids + int(route.bases[route.owner])

    def gather(self, comm, spec, shards, pick, per_column, dtype, xp):
        """Each slice broadcast from its holder; slices side by side."""
        pieces = []
        for s in shards:
            shape = (spec.num_rows, s.c1 - s.c0) if per_column else (spec.num_rows,)
            local = pick(s) if s.rank == comm.rank else xp.zeros(shape, dtype)
            pieces.append(local.copy() if comm.world_size == 1 else comm.broadcast(local, root=s.rank))
        return pieces[0] if len(pieces) == 1 else xp.concatenate(pieces, axis=1)


class TableWiseSharding(OwnedSharding):
    kind = "table_wise"

    def owner_index(self, slice_index):
        return 0
