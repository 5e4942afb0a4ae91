"""The hierarchical exchange of the sharded placements, where the ranks span nodes (ranks
``[k·G, (k+1)·G)`` on node k, G = :attr:`~hbkernels.EmbeddingCollection.ranks_per_node`).

An id for the rank of index l on node k (its owner) goes first to the rank of index l on
the sender's node (its relay; where that node has no rank l, the owner itself), within the
node. The relay keeps each id once, whichever ranks of its node asked for it, and sends
the distinct ids to their owners, one message to each: an id crosses between two nodes
once per step, however many ranks of a node ask for it. The rows come back the same way
(the relay hands each of its node's ranks the rows it asked for), and backward's
gradients go out the same way, the relay summing its node's gradients of each row before
they cross. Forward's rows are the flat exchange's, bit for bit; the updates differ from
it by the order in which float32 gradients are summed."""
import numpy as np

from .._dispatch import host
from ..ops import lookup, partition, segment_sum, unique
from ._records import Relay, Sent
from .kinds.row_wise import dynamic_owner


class HierarchicalExchange:
    """The hierarchical exchange's methods of :class:`~hbkernels.EmbeddingCollection`."""

    def _relays(self, xp, owners):
        """The relay of each owner: the rank of its index on this rank's node (the owner
        itself where this node has no rank of that index)."""
        g, n = self.ranks_per_node, self.comm.world_size
        relay = (self.comm.rank // g) * g + owners % g
        return xp.where(relay < n, relay, owners)

    def _relay_ids(self, group, inputs):
        """:meth:`~._alltoall.AlltoallExchange._send_ids` through the relays: this rank's
        distinct ids to their relays, then each relay's distinct ids to their owners."""
        space = self._family(group.device)
        xp, n = space.xp, self.comm.world_size
        requests, starts, total, keys, owners = self._routed(group, inputs)
        with self._phase("kernels"):
            # a static table's row and its owner in one value; a dynamic table's id names its owner
            values = keys if group.dynamic else keys * n + owners
            parted = partition(self._relays(xp, owners), n)
            values = values[parted.order]
        counts = host(parted.counts)
        relayed, relayed_counts = self._exchange(values, counts)
        with self._phase("kernels"):
            if self.dedup:
                distinct, inverse = unique(relayed, return_inverse=True)
            else:
                distinct, inverse = relayed, xp.arange(relayed.shape[0], dtype=np.int64)
            if group.dynamic:
                onward, owned_by = distinct, dynamic_owner(xp, distinct, n)
            else:
                onward, owned_by = distinct // n, distinct % n
            parted_onward = partition(owned_by, n)
            onward = onward[parted_onward.order]
        onward_counts = host(parted_onward.counts)
        recv_keys, recv_counts = self._exchange(onward, onward_counts)
        self._count_sent("ids_bytes", counts, 8)
        self._count_sent("ids_bytes", onward_counts, 8)
        relay = Relay(relayed_counts, inverse, int(distinct.shape[0]), parted_onward.order,
                      onward_counts)
        return Sent(requests, starts, total, values, counts, parted.order, recv_keys, recv_counts,
                    relay)

    def _relay_rows(self, xp, rows, sent, row_bytes):
        """The rows an owner serves (``rows``, for ``sent.recv_keys``) back through the
        relays: this rank's requested rows in its send order."""
        relay = sent.relay
        rows, _ = self._exchange(rows, sent.recv_counts, wire=True)
        self._count_sent("rows_bytes", sent.recv_counts, row_bytes)
        with self._phase("kernels"):
            rows = lookup(rows, self._inverse_permutation(xp, relay.order), bounds="unchecked")
            rows = lookup(rows, relay.inverse, bounds="unchecked")
        rows, _ = self._exchange(rows, relay.recv_counts, wire=True)
        self._count_sent("rows_bytes", relay.recv_counts, row_bytes)
        return rows

    def _relay_grads(self, grads, ctx, row_bytes):
        """This rank's gradients of its requested rows (``grads``, in its send order)
        through the relays, each relay summing its node's gradients of a row: the
        gradients this rank's rows receive, aligned with ``ctx.recv_keys``."""
        relay = ctx.relay
        received, _ = self._exchange(grads, ctx.send_counts, wire=True)
        self._count_sent("grads_bytes", ctx.send_counts, row_bytes)
        with self._phase("kernels"):
            summed = segment_sum(received, relay.inverse, relay.distinct, bounds="unchecked")
            summed = lookup(summed, relay.order, bounds="unchecked")
        received, _ = self._exchange(summed, relay.send_counts, wire=True)
        self._count_sent("grads_bytes", relay.send_counts, row_bytes)
        return received
