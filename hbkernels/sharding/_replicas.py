"""The exchange of the replicated placement (``data_parallel``): a rank pools its
features from its own replica; backward all-gathers every rank's sparse gradient of the
replica so that every rank applies the same update (the replicas stay bit-identical).
Bytes sent are counted in :attr:`~hbkernels.EmbeddingCollection.stats`."""
import numpy as np


class ReplicaExchange:
    """The replicated placement's exchange of :class:`~hbkernels.EmbeddingCollection`."""

    def _gather_replica_grads(self, group, ids, rows):
        """``(ids, rows)``: the sparse gradients ``(ids, rows)`` of replicated fused array
        ``group`` of every rank, one after another (world size > 1). Collective."""
        space = self._family(group.device)
        with self._phase("comm"):
            wire = self._wire_itemsize(np.float32)
            self._count_sent("replica_grads_bytes", np.full(self.comm.world_size, int(ids.shape[0])),
                             8 + group.width * wire)
            if group in self.tiers:  # rows of each rank's own cache: send store rows
                ids = space.put(self.tiers[group].store_rows(ids))
            ids, _ = self.comm.allgatherv(ids)
            rows, _ = self.comm.allgatherv(rows, wire_dtype=self.wire_dtype)
            if group in self.tiers:
                ids = self.tiers[group].rows(ids)
        return ids, rows
