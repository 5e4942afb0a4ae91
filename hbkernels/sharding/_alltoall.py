"""The exchange of the sharded placements (``row_wise``, ``table_wise``,
``column_wise``; :mod:`~hbkernels.sharding.kinds`): each rank sends each distinct id
of a sharded slice to the rank holding it (:meth:`~.kinds.base.EmbeddingSharding.route_ids`)
in one ``alltoallv`` per fused array, the owners look the rows up and send them back in
another (optionally as ``wire_dtype``), and backward sends each row's gradient to its
owner the same way. Where the ranks span nodes the ids, rows and gradients go through a
rank of the sender's node instead (:mod:`~hbkernels.sharding._hierarchical`). Bytes that
leave a rank are counted in :attr:`~hbkernels.EmbeddingCollection.stats`."""
import numpy as np

from .._dispatch import host
from ..errors import CapacityError
from ..ops import lookup, partition, unique
from ._records import ExchangeContext, Sent
from .kinds import SHARDINGS


class AlltoallExchange:
    """The sharded placements' exchange of :class:`~hbkernels.EmbeddingCollection`."""

    def _routed(self, group, inputs):
        """``(requests, their starts in the distinct ids, total, keys, owners)`` of
        ``group``'s sharded requests: each distinct id's key (its row on its owner, or a
        dynamic table's id) and owner, in the requests' order (device arrays)."""
        space = self._family(group.device)
        xp, n = space.xp, self.comm.world_size
        requests = self._requests(group, inputs, replicated=False)
        keys, dests, starts, total = [], [], [], 0
        for f, route in requests:
            uniq = space.put(inputs[f].uniq)
            dest, key = SHARDINGS[route.kind].route_ids(xp, uniq, route, n)
            keys.append(key)
            dests.append(dest)
            starts.append(total)
            total += int(uniq.shape[0])
        keys = xp.concatenate(keys) if keys else xp.zeros(0, np.int64)
        dests = xp.concatenate(dests) if dests else keys
        return requests, starts, total, keys, dests

    def _send_ids(self, group, inputs):
        """Send each distinct id of ``group``'s sharded requests to its owner: a
        :class:`~._records.Sent`, with the keys this rank owns as received. Across nodes
        (:attr:`~hbkernels.EmbeddingCollection.exchange` ``"hierarchical"``) through the
        ranks of this node (:meth:`_relay_ids`)."""
        if self.exchange == "hierarchical":
            return self._relay_ids(group, inputs)
        requests, starts, total, keys, dests = self._routed(group, inputs)
        n = self.comm.world_size
        with self._phase("kernels"):
            if not group.dynamic:  # a row and its rank in one key: one partition moves both
                parted = partition(keys * n + dests, n)
                keys = parted.ids // n
            else:  # raw ids: any int64
                parted = partition(dests, n)
                keys = keys[parted.order]
        counts = host(parted.counts)
        recv_keys, recv_counts = self._exchange(keys, counts)
        self._count_sent("ids_bytes", counts, 8)
        return Sent(requests, starts, total, keys, counts, parted.order, recv_keys, recv_counts)

    def _forward_exchange(self, group, inputs, outputs, sent):
        """Pool ``group``'s sharded requests from the rows their owners send back;
        ``sent``: what :meth:`_send_ids` gave for ``group``."""
        space = self._family(group.device)
        xp, recv_keys = space.xp, sent.recv_keys
        with self._phase("kernels"):
            bounds = "unchecked"
            if group.dynamic:  # the owner turns ids into rows (-1: not admitted)
                bounds = "zero"
                try:
                    if self.dedup:
                        owned, again = unique(recv_keys, return_inverse=True)
                        recv_keys = self._rows_of_ids(group.table, owned)[again]
                    else:  # (the table's own array on this rank: its slots are its rows)
                        recv_keys = self._rows_of_ids(group.table, recv_keys)
                except CapacityError as error:  # the peers are in the rows' exchange
                    self.comm.fail_collectively("alltoallv", error)
                    raise
            if group in self.tiers:  # store rows -> rows of the fast tier
                recv_keys = self.tiers[group].rows(recv_keys)
            table = self._fast(group).weights if group in self.arrays else None
            if recv_keys.shape[0] == 0:
                rows = xp.empty((0, group.width), group.dtype)
            elif self.dedup and not group.dynamic:
                owned, again = unique(recv_keys, return_inverse=True)
                rows = lookup(lookup(table, owned, bounds=bounds), again, bounds="unchecked")
            else:
                rows = lookup(table, recv_keys, bounds=bounds)
        row_bytes = group.width * self._wire_itemsize(group.dtype)
        if sent.relay is not None:
            rows = self._relay_rows(xp, rows, sent, row_bytes)
        else:
            rows, _ = self._exchange(rows, sent.recv_counts, wire=True)
            self._count_sent("rows_bytes", sent.recv_counts, row_bytes)
        with self._phase("kernels"):
            rows = lookup(rows, self._inverse_permutation(xp, sent.order), bounds="unchecked")
        requests = sent.requests
        pools = self._pool(space, rows, requests, sent.starts, inputs,
                           lambda k: inputs[requests[k][0]].inverse, outputs)
        return ExchangeContext(group, pools, sent.total, sent.order, sent.send_counts, recv_keys,
                               sent.recv_counts, sent.relay)

    def _backward_exchange(self, ctx, grads):
        """``(rows, gradients)`` this rank owns of the fused array of ``ctx`` (the
        :class:`~._records.ExchangeContext` of its forward): each requested row's
        gradient summed over this rank's bags, sent to the row's owner."""
        group = ctx.group
        space = self._family(group.device)
        with self._phase("kernels"):
            request_grads = space.xp.zeros((ctx.rows, group.width), np.float32)
            for ids, rows in self._pool_backward(space, ctx.pools, grads, ctx.rows):
                request_grads[ids] = rows
            request_grads = lookup(request_grads, ctx.order, bounds="unchecked")
        row_bytes = group.width * self._wire_itemsize(np.float32)
        if ctx.relay is not None:
            return ctx.recv_keys, self._relay_grads(request_grads, ctx, row_bytes)
        received, _ = self._exchange(request_grads, ctx.send_counts, wire=True)
        self._count_sent("grads_bytes", ctx.send_counts, row_bytes)
        return ctx.recv_keys, received

    def _prefetch_exchange(self, group, inputs):
        """Send the ids of ``group``'s sharded requests to their owners, which read the
        rows their caches lack ahead (:meth:`~hbkernels.EmbeddingCollection.prefetch`)."""
        recv_keys = self._send_ids(group, inputs).recv_keys
        if group in self.tiers:
            self.tiers[group].prefetch(self._rows_of_ids(group.table, recv_keys)
                                       if group.dynamic else recv_keys)
