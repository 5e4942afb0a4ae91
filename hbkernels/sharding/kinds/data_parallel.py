"""``data_parallel``: every rank holds the whole table. Forward is a local lookup;
backward all-gathers every rank's sparse gradient and applies the same update
everywhere, so the replicas stay bit-identical."""
from .base import EmbeddingSharding


class DataParallelSharding(EmbeddingSharding):
    kind = "data_parallel"
    replicated = True

    def holders(self, spec, place, slice_index, world_size):
        return [(rank, 0, 1, spec.num_rows) for rank in range(world_size)]

    def gather(self, comm, spec, shards, pick, per_column, dtype, xp):
        """Rank 0's replica."""
        local = pick(shards[comm.rank])
        return local.copy() if comm.world_size == 1 else comm.broadcast(local, root=0)
