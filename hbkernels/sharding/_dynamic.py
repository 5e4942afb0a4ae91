"""Dynamic tables (``TableSpec(num_rows=None, capacity=...)``) of an
:class:`~hbkernels.EmbeddingCollection`: each rank's share is a
:class:`~hbkernels.HashTable` from id to a row of its fused array (rows made as ids
are admitted), its ids gathered, counted and restored over the ranks."""
import warnings
from collections import defaultdict

import numpy as np

from .._dispatch import host
from ..errors import CapacityError
from .kinds.row_wise import dynamic_owner
from .layout import initial_rows


class DynamicTables:
    """The dynamic tables' methods of :class:`~hbkernels.EmbeddingCollection`."""

    def _hash_table_name(self, table):
        """How errors name dynamic ``table``'s hash table on this rank: at world size > 1
        a share of the table's capacity (ids go to ranks by a hash of the id)."""
        n = self.comm.world_size
        if n == 1:
            return table
        return (f"{table} on rank {self.comm.rank} (its share of capacity "
                f"{self.tables[table].capacity} over {n} ranks, which take ids by a hash of the id)")

    def _dynamic_shard(self, name):
        """This rank's shard of dynamic table ``name``."""
        return next(s for s in self.layout.shards[name] if s.rank == self.comm.rank)

    def _rows_of_ids(self, name, ids):
        """Dynamic table ``name``'s slots for ``ids`` (one call of its hash table: every
        id is a use; -1 for an id not admitted yet). Slots given out in the call get the
        rows their ids start with and fresh optimizer state."""
        if not self._insert:
            return self.hash_tables[name].slots(ids, insert=False)
        slots, new_ids, new_slots = self.hash_tables[name].slots(ids, return_new=True)
        if new_slots.shape[0]:
            shard = self._dynamic_shard(name)
            fused, space = self.arrays[shard.group], self._family(shard.group.device)
            at = new_slots + shard.base
            self._mark_changed(shard.group, at, store=True)
            rows = initial_rows(self.tables[name], self.seed, host(new_ids))
            if shard.group in self.tiers:
                self.tiers[shard.group].write(host(at), rows, self._fresh_state(shard.group, host=True))
                return slots
            fused.weights[at] = space.put(rows)
            for slot, value in self._fresh_state(shard.group).items():
                fused.state[slot][at] = value
        return slots

    def _local_ids(self, inputs):
        """``{dynamic table: its ids in this forward}`` at world size 1 where this
        forward asks several dynamic tables for ids (else ``{}``: see
        :meth:`_check_capacity`)."""
        by_table = defaultdict(list)
        for group in self.layout.exchange_groups:
            if group.dynamic:
                for f, route in self._requests(group, inputs, replicated=False):
                    by_table[route.table].append(inputs[f].values)
        if len(by_table) < 2:
            return {}
        xp = self._family(self.device).xp
        return {t: v[0] if len(v) == 1 else xp.concatenate(v) for t, v in by_table.items()}

    def _check_capacity(self, ids, collective=False):
        """Raise :class:`~hbkernels.CapacityError` before any dynamic table admits an id
        when the ids of some table (``{table: ids}``: those it would be asked for) do not
        fit, so that a forward that fails changes nothing; ``collective``: the ranks
        agree (the failing one raises, the others :class:`~hbkernels.dist.CommError`).
        One table's own call is already all or nothing: alone, it needs no check."""
        if not self._insert or len(ids) + collective < 2:
            return
        if collective and self.comm.world_size > 1:
            try:
                for table, keys in ids.items():
                    self.hash_tables[table].check_fits(keys)
            except CapacityError as error:
                self.comm.fail_collectively("allreduce", error)
                raise
            self.comm.allreduce(np.zeros(1, np.int64))  # every rank's ids fit: admit them
            return
        for table, keys in ids.items():
            self.hash_tables[table].check_fits(keys)

    def _gather_dynamic(self, name, pick):
        """``(ids, rows)`` of dynamic table ``name``: its live ids over all ranks, ascending,
        and their rows of ``pick(fused arrays)``, the same on every rank. Collective."""
        shard = self._dynamic_shard(name)
        space = self._family(self._store_device(shard.group))
        ids, slots = (space.put(a) for a in self.hash_tables[name].items())
        rows = space.xp.ascontiguousarray(pick(self.arrays[shard.group])[slots + shard.base])
        if self.comm.world_size > 1:
            ids, _ = self.comm.allgatherv(ids)
            rows, _ = self.comm.allgatherv(rows)
            order = space.xp.argsort(ids)
            ids, rows = ids[order], rows[order]
        return ids, rows

    def dynamic_scores(self, name):
        """``(ids, last, count)`` of dynamic table ``name`` over all ranks, ascending by
        id: each live id's last use and its uses, as its rank's hash table counts
        them. Collective."""
        state = self.hash_tables[name].state()
        return self._gathered_by_id(state["ids"], state["last"], state["count"])

    def dynamic_pending(self, name):
        """``(ids, last, count)`` of the ids of dynamic table ``name`` waiting for
        admission, over all ranks, ascending by id (``count``: their sightings), or
        None for a table that admits on first sight (``admit_count=1``). Collective."""
        pending = self.hash_tables[name].pending_state()
        if pending is None:
            return None
        return self._gathered_by_id(pending["ids"], pending["last"], pending["count"])

    def _gathered_by_id(self, ids, last, count):
        if self.comm.world_size > 1:
            ids, last, count = (host(self.comm.allgatherv(a)[0]) for a in (ids, last, count))
            order = np.argsort(ids)
            ids, last, count = ids[order], last[order], count[order]
        return ids, last, count

    def restore_dynamic(self, name, ids, last, count, rows, pending=None, clock=0):
        """Put the saved ids of dynamic table ``name`` back (NumPy arrays over all
        ranks; this rank takes the ids it owns), replacing what the table held here:
        ``last`` and ``count`` their scores, ``rows`` ``{"weights" or an optimizer slot:
        rows}`` aligned with ``ids``, ``pending`` ``(ids, last, count)`` of ids waiting
        for admission. The table's call counter (one clock for every rank's share: each
        counts every call) becomes the largest of ``clock`` and the ``last`` of the ids
        given, live and pending. A shard given more ids than its slots leaves out
        those its policy evicts first (:meth:`hbkernels.HashTable.restore`), with a
        ``RuntimeWarning``. Not collective."""
        shard = self._dynamic_shard(name)
        n, me = self.comm.world_size, self.comm.rank
        table = self.hash_tables[name]
        table.clear()
        self.rows_written_elsewhere()
        mine = dynamic_owner(np, ids, n) == me
        step = max(int(clock), int(last.max()) if last.shape[0] else 0)  # the call counter
        waiting = None
        if pending is not None:
            theirs = dynamic_owner(np, pending[0], n) == me
            waiting = tuple(a[theirs] for a in pending)
            if pending[1].shape[0]:
                step = max(step, int(pending[1].max()))
            waiting += (step,)
        slots = table.restore(ids[mine], last[mine], count[mine], step, waiting)
        kept = slots >= 0
        if not kept.all():
            warnings.warn(f"{table.name}: {int((~kept).sum())} of the {kept.shape[0]} ids restored "
                          f"here do not fit its capacity; those its policy "
                          f"(evict={table.evict!r}) evicts first were left out", RuntimeWarning,
                          stacklevel=2)
        fused = self.arrays[shard.group]
        space = self._family(shard.group.device)
        if shard.group in self.tiers:  # into the store, the cache emptied
            self.tiers[shard.group].clear()
            space = self._family(self._store_device(shard.group))
        at = space.put(slots[kept] + shard.base)
        for array, values in rows.items():
            target = fused.weights if array == "weights" else fused.state[array]
            target[at] = space.put(np.ascontiguousarray(np.asarray(values)[mine][kept]))

    def dynamic_counts(self, name):
        """``{"size", "admitted", "evicted", "forgotten"}`` of dynamic table ``name``,
        summed over the ranks: live ids, ids given a row or evicted so far, and ids
        waiting for admission whose sightings were forgotten so far because the pending
        table (``capacity`` ids per rank's share) was full. Collective."""
        table = self.hash_tables[name]
        counts = np.array([table.size, table.admitted, table.evicted, table.forgotten], np.int64)
        if self.comm.world_size > 1:
            counts = host(self.comm.allreduce(counts))
        return dict(zip(("size", "admitted", "evicted", "forgotten"), counts.tolist()))
