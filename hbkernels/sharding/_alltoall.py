"""The exchange of the sharded placements (``row_wise``, ``table_wise``,
``column_wise``; :mod:`~hbkernels.sharding.kinds`): each rank sends each distinct id
of a sharded slice to the rank holding it (:meth:`~.kinds.base.EmbeddingSharding.route_ids`)
in one ``alltoallv`` per fused array, the owners look the rows up and send them back in
another (optionally as ``wire_dtype``), and backward sends each row's gradient to its
owner the same way. Bytes that leave a rank are counted in
:attr:`~hbkernels.EmbeddingCollection.stats`."""
import numpy as np

from .._dispatch import host
from ..errors import CapacityError
from ..ops import lookup, partition, unique
from ._records import ExchangeContext
from .kinds import SHARDINGS


class AlltoallExchange:
    """The sharded placements' exchange of :class:`~hbkernels.EmbeddingCollection`."""

    def _send_keys(self, group, inputs):
        """Route the ids of ``group``'s sharded requests: ``(requests, their starts in the
        distinct ids, total, keys in send order, send counts, the partition's order)``."""
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
        with self._phase("kernels"):
            if not group.dynamic:  # a row and its rank in one key: one partition moves both
                parted = partition(keys * n + dests, n)
                keys = parted.ids // n
            else:  # raw ids: any int64
                parted = partition(dests, n)
                keys = keys[parted.order]
        return requests, starts, total, keys, host(parted.counts), parted.order

    def _send_ids(self, group, inputs):
        """:meth:`_send_keys` of ``group`` plus the keys and counts this rank receives
        in their exchange."""
        sent = self._send_keys(group, inputs)
        return sent + self._exchange(sent[3], sent[4])

    def _forward_exchange(self, group, inputs, outputs, sent):
        """Pool ``group``'s sharded requests from the rows their owners send back;
        ``sent``: what :meth:`_send_ids` gave for ``group``."""
        space = self._family(group.device)
        xp, me = space.xp, self.comm.rank
        requests, starts, total, keys, send_counts, order, recv_keys, recv_counts = sent
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
        rows, _ = self._exchange(rows, recv_counts, wire=True)
        with self._phase("kernels"):
            rows = lookup(rows, self._inverse_permutation(xp, order), bounds="unchecked")
        away_ids = int(send_counts.sum() - send_counts[me])
        away_rows = int(recv_counts.sum() - recv_counts[me])
        self.stats["ids_bytes"] += 8 * away_ids
        self.stats["rows_bytes"] += away_rows * group.width * self._wire_itemsize(group.dtype)
        pools = self._pool(space, rows, requests, starts, inputs,
                           lambda k: inputs[requests[k][0]].inverse, outputs)
        return ExchangeContext(group, pools, total, order, send_counts, recv_keys, recv_counts)

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
        received, _ = self._exchange(request_grads, ctx.send_counts, wire=True)
        self.stats["grads_bytes"] += (int(ctx.send_counts.sum() - ctx.send_counts[self.comm.rank])
                                      * group.width * self._wire_itemsize(np.float32))
        return ctx.recv_keys, received

    def _prefetch_exchange(self, group, inputs):
        """Send the ids of ``group``'s sharded requests to their owners, which read the
        rows their caches lack ahead (:meth:`~hbkernels.EmbeddingCollection.prefetch`)."""
        keys, counts = self._send_keys(group, inputs)[3:5]
        recv_keys, _ = self._exchange(keys, counts)
        if group in self.tiers:
            self.tiers[group].prefetch(self._rows_of_ids(group.table, recv_keys)
                                       if group.dynamic else recv_keys)
