"""``grid``: column slices of the table (the plan's ``columns``), each row-wise over the
ranks of one node: slice s on ranks ``ranks[s·G':(s+1)·G']`` (G' =
``len(ranks) / slices``), its rank j holding rows ``j, j + G', ...`` (row ``id`` as its
local row ``id // G'``). Its ids go to the ranks of one node per slice."""
from .base import EmbeddingSharding, gather_interleaved


class GridSharding(EmbeddingSharding):
    kind = "grid"

    def holders(self, spec, place, slice_index, world_size):
        ranks = place.slice_ranks(slice_index)
        g = len(ranks)
        return [(int(rank), j, g, max(0, -(-(spec.num_rows - j) // g))) for j, rank in enumerate(ranks)]

    def route_ids(self, xp, ids, route, world_size):
        holders = xp.asarray(route.holders)
        dest = holders[ids % holders.shape[0]]
        return dest, xp.asarray(route.bases)[dest] + ids // holders.shape[0]

    def gather(self, comm, spec, shards, pick, per_column, dtype, xp):
        return gather_interleaved(comm, spec, shards, pick, per_column, dtype, xp)
