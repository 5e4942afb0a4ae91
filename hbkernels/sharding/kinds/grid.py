"""``grid``: column slices of the table (the plan's ``columns``), each row-wise over the
ranks of one node: slice s on ranks ``ranks[s·G':(s+1)·G']`` (G' =
``len(ranks) / slices``), its rank j holding rows ``j, j + G', ...`` (row ``id`` as its
local row ``id // G'``). Its ids go to the ranks of one node per slice."""
import numpy as np

from .base import EmbeddingSharding


def _slice_ranks(place, slice_index):
    per_slice = len(place.ranks) // (len(place.columns) - 1)
    return place.ranks[slice_index * per_slice:(slice_index + 1) * per_slice]


class GridSharding(EmbeddingSharding):
    kind = "grid"

    def holders(self, spec, place, slice_index, world_size):
        ranks = _slice_ranks(place, slice_index)
        g = len(ranks)
        return [(int(rank), j, g, max(0, -(-(spec.num_rows - j) // g))) for j, rank in enumerate(ranks)]

    def route_ids(self, xp, ids, route, world_size):
        holders = xp.asarray(route.holders)
        dest = holders[ids % holders.shape[0]]
        return dest, xp.asarray(route.bases)[dest] + ids // holders.shape[0]

    def gather(self, comm, spec, shards, pick, per_column, dtype, xp):
        """Each slice all-gathered from its holders and interleaved; slices side by side."""
        pieces = []
        for s in sorted({shard.slice for shard in shards}):
            held = [shard for shard in shards if shard.slice == s]
            mine = [shard for shard in held if shard.rank == comm.rank]
            shape = ((0, held[0].c1 - held[0].c0) if per_column else (0,))
            local = pick(mine[0]) if mine else xp.zeros(shape, dtype)
            blocks, counts = (local.copy(), [local.shape[0]]) if comm.world_size == 1 else comm.allgatherv(local)
            counts = np.asarray(counts).tolist()
            starts = np.cumsum([0] + counts).tolist()
            out = xp.empty((spec.num_rows,) + tuple(local.shape[1:]), dtype)
            for shard in held:
                out[shard.row_start::shard.row_step] = blocks[starts[shard.rank]:starts[shard.rank]
                                                              + counts[shard.rank]]
            pieces.append(out)
        return pieces[0] if len(pieces) == 1 else xp.concatenate(pieces, axis=1)
