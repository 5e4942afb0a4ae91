"""``row_wise``: rank ``r`` holds rows ``r, r + N, ...`` of the table (row ``id`` as its
local row ``id // N``), all columns."""
import numpy as np

from .base import EmbeddingSharding


class RowWiseSharding(EmbeddingSharding):
    kind = "row_wise"

    def holders(self, spec, place, slice_index, world_size):
        n = world_size
        return [(rank, rank, n, max(0, -(-(spec.num_rows - rank) // n))) for rank in range(n)]

    def route_ids(self, xp, ids, route, world_size):
        dest = ids % world_size
        return dest, xp.asarray(route.bases)[dest] + ids // world_size

    def gather(self, comm, spec, shards, pick, per_column, dtype, xp):
        n = comm.world_size
        local = pick(shards[comm.rank])
        blocks, counts = (local.copy(), [local.shape[0]]) if n == 1 else comm.allgatherv(local)
        out = xp.empty((spec.num_rows,) + tuple(local.shape[1:]), dtype)
        start = 0
        for rank, count in enumerate(np.asarray(counts).tolist()):
            out[rank::n] = blocks[start:start + count]
            start += count
        return out
