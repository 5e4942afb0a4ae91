"""Dynamic tables: :class:`HashTable` maps any int64 id to a row slot.

The map is an open-addressing index (linear probing, Fibonacci hashing; kernels
in :mod:`hbkernels.cpu.hash_table` and :mod:`hbkernels.cuda.hash_table`) beside
per-slot state (the id, the call of last use, the calls that used it) and a
stack of free slots on the host. A call with ``insert=True``:

1. finds every id (one parallel probe each; no sort, no dedup of the hits);
2. takes the distinct missing ids (:func:`hbkernels.unique`, by hashing) and,
   with ``admit_count > 1``, admits those seen in ``admit_count`` calls;
3. checks that the admitted ids fit (free slots, plus evictable ones) and
   raises :class:`~hbkernels.CapacityError` before changing anything if not;
4. notes the use of every hit slot, evicts, and indexes the admitted ids.

On the CPU a call of fewer than ``SERIAL_BELOW`` ids that admits every new id
(``admit_count=1``) does all four in one serial pass (``admit_small``), falling
back to these steps only when its new ids do not fit in the free slots.

Eviction is global and exact: the victims are the live ids not used in the
call with the lowest ``(last use, id)`` (LRU) or ``(uses, last use, id)``
(LFU), found by selection (``partition``), not by sorting; both backends
pick the same victims.
"""
import numpy as np

from . import _validate as check
from ._dispatch import classify, device_family, host, kernel_ready, kernels
from ._modes import Eviction, codes
from .errors import CapacityError

EVICTIONS = codes(Eviction)
MAX_FILL = 3 / 4  # live plus tombstoned index positions, at most; a rebuild clears tombstones


class HashTable:
    """Any int64 id -> a slot in ``[0, capacity)`` of an ordinary ``[capacity, D]`` array.

    ``slots(ids, insert=True)`` returns each id's slot (int64, ``ids.shape``; -1 for
    an id not admitted yet). ``evict``: ``"lru"``, ``"lfu"`` or ``"none"`` (a full
    table raises :class:`~hbkernels.CapacityError`). ``admit_count=k``: an id gets a
    slot in the ``k``-th call that asks for it; until then it is counted in a
    pending table of ``pending_capacity`` ids (default ``capacity``) that forgets
    its least recently seen id when full, so an id is never admitted early, and
    late only when more than ``pending_capacity`` other not-yet-admitted ids came
    between two of its calls. ``device``: ``"cpu"`` (NumPy ids) or ``"cuda"``
    (CUDA ids); results come back in the ids' array family.

    >>> import numpy as np, hbkernels as hbk
    >>> t = hbk.HashTable(4, evict="lru")
    >>> t.slots(np.array([2**63 - 1, -5, 2**63 - 1])).tolist()
    [0, 1, 0]
    >>> t.slots(np.array([7, 8, 9])).tolist()  # two slots free; evicts -5 (older call, then smaller id)
    [2, 3, 1]
    >>> t.size, t.ids().tolist()
    (4, [7, 8, 9, 9223372036854775807])
    """

    def __init__(self, capacity, *, evict="lru", admit_count=1, device="cpu",
                 pending_capacity=None, name="HashTable"):
        if int(capacity) != capacity or capacity < 1:
            raise ValueError(f"{name}: capacity must be an integer >= 1, got {capacity!r}")
        if evict not in EVICTIONS:
            raise ValueError(f"{name}: evict must be one of {sorted(EVICTIONS)}, got {evict!r}")
        if int(admit_count) != admit_count or admit_count < 1:
            raise ValueError(f"{name}: admit_count must be an integer >= 1, got {admit_count!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"{name}: device must be 'cpu' or 'cuda', got {device!r}")
        self.name, self.capacity, self.evict = name, int(capacity), evict
        self.admit_count, self.device = int(admit_count), device
        self._family = device_family(device)
        self._k = kernels(self._family, "hash_table")
        self._unique = kernels(self._family, "unique")
        xp = self._xp = self._k.xp()
        positions = 1 << max(4, (2 * self.capacity - 1).bit_length())  # >= 2 * capacity
        self._index = xp.full(2 * positions, -1, np.int64)  # (id, slot) per position
        self._k.clear(self._index)
        self._reserved = xp.full(2, -1, np.int64)  # slots of the ids equal to the two markers
        self._slot_ids = xp.zeros(self.capacity, np.int64)
        self._uses = xp.zeros(2 * self.capacity, np.int64)  # (last use, uses) per slot
        self._last = self._uses[0::2]  # the call that last used the slot; -1: free
        self._count = self._uses[1::2]  # the calls that used it
        self._last[:] = -1
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # a stack: top at the end
        self._num_free = self.capacity
        self._tombstones = 0
        self.step = 0  # calls with insert=True so far (those without ids too)
        self.admitted = 0  # ids given a slot so far
        self.evicted = 0  # ids evicted so far
        self.dropped = 0  # a pending table's: new ids a call brought beyond its room
        self._pending = None
        if self.admit_count > 1:
            self._pending = HashTable(pending_capacity or self.capacity, evict="lru",
                                      device=device, name=f"{name} (pending admission)")

    # -- public ------------------------------------------------------------------------------
    @property
    def size(self):
        """Live ids."""
        return self.capacity - self._num_free

    @property
    def forgotten(self):
        """Not-yet-admitted ids whose sightings the full pending table forgot so far (it
        holds ``pending_capacity`` of them): each then starts its count again. 0 with
        ``admit_count=1``."""
        return 0 if self._pending is None else self._pending.evicted + self._pending.dropped

    def slots(self, ids, *, insert=True, return_new=False):
        """Each id's slot (int64, ``ids.shape``; -1 where absent). With ``insert``, the
        call is a use of every id it asks for, and admits (and, when full, evicts).
        ``return_new``: return ``(slots, new_ids, new_slots)``, with the ids given a
        slot in this call and their slots (int64, 1-D), whose rows and optimizer
        state the caller resets."""
        family, flat, shape = self._flat(ids)
        new_ids = new_slots = self._xp.empty(0, np.int64)
        small = getattr(self._k, "admit_small", None)  # the CPU's one-pass path
        if (insert and small is not None and self.admit_count == 1
                and 0 < flat.shape[0] < self._k.SERIAL_BELOW):
            out, admitted, given, reused = small(family, self._index, self._reserved, flat,
                                                 self._slot_ids, self._uses, self._free,
                                                 self._num_free, self.step + 1)
            if admitted is None:  # not all fit: eviction or CapacityError
                new_ids, new_slots = self._admit(family, flat, out)
            else:
                new_ids, new_slots = admitted, given
                self.step += 1
                self._num_free -= admitted.shape[0]
                self.admitted += admitted.shape[0]
                self._tombstones -= reused
                self._maybe_rebuild()
        else:
            out = self._k.find(family, self._index, self._reserved, flat)
            if insert and flat.shape[0]:
                new_ids, new_slots = self._admit(family, flat, out)
            elif insert:  # a call with no ids counts too: the shards of a table keep one clock
                self.step += 1
        out = self._k.to_family(family, out.reshape(shape))
        if not return_new:
            return out
        return out, self._k.to_family(family, new_ids), self._k.to_family(family, new_slots)

    def erase(self, ids):
        """Remove ``ids`` (absent ones are ignored; a pending id's count is forgotten);
        returns how many live ids were removed."""
        family, flat, _ = self._flat(ids)
        if self._pending is not None:
            self._pending.erase(ids)
        if not flat.shape[0]:
            return 0
        slots, tombstoned = self._k.erase(family, self._index, self._reserved,
                                          self._distinct(flat), self._uses)
        self._tombstones += tombstoned
        freed = host(slots)
        freed = freed[freed >= 0]
        self._free[self._num_free:self._num_free + freed.shape[0]] = freed
        self._num_free += freed.shape[0]
        return int(freed.shape[0])

    def clear(self):
        """Remove every id, live and pending, and restart the call counter (``admitted``
        and ``evicted`` keep their totals)."""
        self.erase(self.ids())
        if self._pending is not None:
            self._pending.clear()
        self.step = 0

    def evict_lowest(self, count, keep=None):
        """Evict the ``count`` live ids the policy picks first (as a full call would),
        never one of ``keep`` (ids); returns ``(ids, slots)`` evicted (in the table's
        array family). :class:`CapacityError` when fewer are evictable; under
        ``evict="none"`` always (when ``count > 0``)."""
        xp = self._xp
        if count <= 0:
            return xp.empty(0, np.int64), xp.empty(0, np.int64)
        found = xp.empty(0, np.int64)
        if keep is not None:
            family, flat, _ = self._flat(keep)
            found = self._k.find(family, self._index, self._reserved, flat)
        victims = self._victims(int(count), found)
        ids = self._slot_ids[victims].copy()
        _, tombstoned = self._k.erase(self._family, self._index, self._reserved, ids, self._uses)
        self._tombstones += tombstoned
        self.evicted += int(victims.shape[0])
        freed = host(victims)
        self._free[self._num_free:self._num_free + freed.shape[0]] = freed
        self._num_free += freed.shape[0]
        self._maybe_rebuild()
        return self._k.to_family(self._family, ids), self._k.to_family(self._family, victims)

    def ids(self):
        """The live ids, ascending."""
        return self.items()[0]

    def items(self):
        """``(ids, slots)`` of the live ids, ascending by id, in the table's array family."""
        ids, slots = self._by_id(self._xp.flatnonzero(self._last >= 0))
        return self._k.to_family(self._family, ids), self._k.to_family(self._family, slots)

    def state(self):
        """What a checkpoint keeps, as NumPy arrays: ``ids`` (live, ascending), their
        ``slots``, ``last`` (call of last use) and ``count`` (calls that used them),
        and ``step``; ``pending``: the same of the ids waiting for admission (their
        sightings in ``count``, the call that last saw them in ``last``), or None.
        Every call that counts leaves its number in ``last`` or ``pending["last"]``
        unless :meth:`erase` removed its ids since, so the call counter is the
        largest of them."""
        ids, slots = (host(a) for a in self.items())
        on = self._xp.asarray(slots)
        return {"ids": ids, "slots": slots, "last": host(self._last[on]),
                "count": host(self._count[on]), "step": self.step,
                "pending": self.pending_state()}

    def pending_state(self):
        """``pending`` of :meth:`state` alone (without a pass over the live ids)."""
        return None if self._pending is None else self._pending.state()

    def mark(self):
        """What :meth:`changes` compares with later, in host memory (9 bytes per slot,
        whatever the device): copies of the id in each slot and of which slots are
        live, the call counter, and the same of the pending ids' table (``pending``, or
        None)."""
        return {"slot_ids": host(self._slot_ids).copy(), "live": host(self._last >= 0),
                "step": self.step, "pending": None if self._pending is None else self._pending.mark()}

    def changes(self, mark):
        """What changed since ``mark`` (:meth:`mark`, taken since the last :meth:`clear`
        or :meth:`restore`), as NumPy arrays: ``ids`` used since (ascending; every
        admission is a use) with their ``slots``, ``last`` and ``count``; ``evicted``:
        ids live at the mark and not now (ascending), evicted or erased; ``pending``:
        the same of the ids waiting for admission (used: seen; evicted: admitted,
        forgotten or erased), or None. Passes over the slots, no sort of the live ids:
        what is sorted is the ids used or removed."""
        ids, used = self._by_id(self._xp.flatnonzero(self._last > mark["step"]))
        out = {"ids": host(ids), "slots": host(used), "last": host(self._last[used]),
               "count": host(self._count[used]),
               "pending": None if self._pending is None else self._pending.changes(mark["pending"])}
        live, slot_ids = host(self._last >= 0), host(self._slot_ids)
        moved = np.flatnonzero(mark["live"] & (~live | (slot_ids != mark["slot_ids"])))
        gone = mark["slot_ids"][moved]  # an id live elsewhere now was admitted since: used
        out["evicted"] = np.sort(gone[~np.isin(gone, out["ids"])])
        return out

    def live_at(self, slots):
        """``(ids, slots)`` (NumPy) of the live ids among ``slots`` (distinct slots in
        ``[0, capacity)``), ascending by id."""
        slots = self._xp.asarray(slots, np.int64)
        ids, slots = self._by_id(slots[self._last[slots] >= 0])
        return host(ids), host(slots)

    def restore(self, ids, last, count, step, pending=None):
        """Give the distinct absent ``ids`` (NumPy) free slots with these scores (a
        loaded checkpoint); the call counter becomes at least ``step``; ``pending``:
        ``(ids, last, count, step)`` of ids waiting for admission. Returns the slots
        (NumPy). When there are more ids than free slots (a checkpoint of a full table
        loaded at another world size), those the policy would evict first are left out
        (slot -1, counted in :attr:`evicted`); under ``evict="none"`` that is a
        :class:`CapacityError`."""
        if pending is not None and self._pending is not None:
            self._pending.restore(*pending)
        ids = np.ascontiguousarray(ids, np.int64)
        last, count = np.asarray(last, np.int64), np.asarray(count, np.int64)
        out = np.full(ids.shape[0], -1, np.int64)
        keep = np.arange(ids.shape[0])
        excess = ids.shape[0] - self._num_free
        if excess > 0:
            if self.evict == "none":
                raise CapacityError(f"{self.name}: {ids.shape[0]} ids to restore, only "
                                    f"{self._num_free} of its capacity {self.capacity} free "
                                    f"(evict='none')")
            keys = [last, ids] if self.evict == "lru" else [count, last, ids]
            keep = np.setdiff1d(keep, smallest(np, keys, excess))
            self.evicted += excess
        slots = self._free[self._num_free - keep.shape[0]:self._num_free][::-1].copy()
        self._num_free -= keep.shape[0]
        xp = self._xp
        on = xp.asarray(slots)
        self._tombstones -= self._k.insert(self._family, self._index, self._reserved,
                                           xp.asarray(ids[keep]), on, self._slot_ids, self._uses, 0)
        self._last[on] = xp.asarray(last[keep])
        self._count[on] = xp.asarray(count[keep])
        self.step = max(self.step, int(step))
        out[keep] = slots
        return out

    def scores(self, ids):
        """Each id's eviction score (int64, ``ids.shape``): calls that used it under
        ``"lfu"``, else the call (1, 2, ...) that used it last; -1 where absent."""
        family, flat, shape = self._flat(ids)
        found = self._k.find(family, self._index, self._reserved, flat)
        score = self._count if self.evict == "lfu" else self._last
        xp = self._xp
        out = xp.where(found >= 0, score[xp.maximum(found, 0)], -1)
        return self._k.to_family(family, out.reshape(shape))

    def probe_lengths(self):
        """``(home, length)`` per live id in the index (NumPy int64): the position its
        probe starts at and how many positions a lookup of it reads, for modelling the
        memory traffic of a lookup (the two marker ids, kept aside, are left out)."""
        from ._bits import fib_hash

        keys = host(self._index[0::2])
        size = keys.shape[0]
        positions = np.flatnonzero(keys > -(2**63) + 1)
        with np.errstate(over="ignore"):
            home = (fib_hash(keys[positions].view(np.uint64))
                    >> np.uint64(65 - size.bit_length())).astype(np.int64)
        return home, (positions - home) % size + 1

    def __repr__(self):
        return (f"HashTable({self.name!r}, size={self.size}, capacity={self.capacity}, "
                f"evict={self.evict!r}, admit_count={self.admit_count}, device={self.device!r})")

    def _by_id(self, slots):
        """``(ids, slots)`` (``xp``) of live ``slots``, ascending by id."""
        ids = self._slot_ids[slots]
        order = self._xp.argsort(ids)
        return ids[order], slots[order]

    # -- one call --------------------------------------------------------------------------
    def _flat(self, ids):
        family, ids = classify(ids)
        if family.is_cuda != self._family.is_cuda:
            raise TypeError(f"{self.name} lives on {self.device!r}: pass "
                            f"{'CUDA' if self._family.is_cuda else 'NumPy'} ids, got a "
                            f"{family.name} array")
        ids = kernel_ready(ids)  # C-contiguous, native byte order: as every op takes them
        check.ids("ids", ids)
        shape = tuple(ids.shape)
        return family, self._k.as_xp(family, ids).reshape(-1), shape

    def _distinct(self, flat):
        ukeys = self._unique.unique(self._family, self._k.to_family(self._family, flat),
                                    False, False, False)[0]
        return self._k.as_xp(self._family, ukeys).astype(np.int64, copy=False)

    def check_fits(self, ids):
        """Raise the :class:`~hbkernels.CapacityError` that ``slots(ids)`` (``insert=True``)
        would raise, changing nothing (not even the ids' uses): for a caller that must
        know that several tables' calls all fit before making any of them. A call of at
        most :attr:`capacity` ids (``evict="none"``: of at most the free slots) always
        fits, so only a larger one is looked up: its new ids and the live ids it uses
        together are at most as many as its ids, and every other live id can be evicted."""
        family, flat, _ = self._flat(ids)
        if flat.shape[0] > (self._num_free if self.evict == "none" else self.capacity):
            self._plan(flat, self._k.find(family, self._index, self._reserved, flat))

    def _plan(self, flat, out):
        """What admitting the call's ids ``flat`` (found at ``out``, -1: missing) takes
        (step 2-3 of the module's list): ``(miss, the missing ids, the ids to admit,
        those left waiting, the slots to evict or None)``, or None where every id is
        live; :class:`CapacityError` where they do not fit. Changes nothing."""
        miss = out < 0
        if not bool(miss.any()):
            return None
        misses = flat[miss]
        new = self._distinct(misses)
        admitted, waiting = new, new[:0]
        if self._pending is not None and new.shape[0]:
            seen = self._pending._score_of(new, self._pending._count)
            ready = seen + 1 >= self.admit_count
            admitted, waiting = new[ready], new[~ready]
        m = int(admitted.shape[0])
        victims = self._victims(m - self._num_free, out) if m > self._num_free else None
        return miss, misses, admitted, waiting, victims

    def _admit(self, family, flat, out):
        """Admit the call's missing ids (step 2-4 of the module's list), filling ``out``;
        returns ``(the admitted ids, their slots)``."""
        xp = self._xp
        step = self.step + 1
        plan = self._plan(flat, out)
        if plan is None:  # every id is live: a use of each, nothing to admit
            self.step = step
            self._k.touch(family, out, self._uses, step)
            return xp.empty(0, np.int64), xp.empty(0, np.int64)
        miss, misses, admitted, waiting, victims = plan
        m = int(admitted.shape[0])
        # nothing has changed up to here; from here on nothing raises
        self.step = step
        self._k.touch(family, out, self._uses, step)
        reuse = xp.empty(0, np.int64)
        if victims is not None:
            reuse = victims
            _, tombstoned = self._k.erase(family, self._index, self._reserved,
                                          self._slot_ids[victims], self._uses)
            self._tombstones += tombstoned
            self.evicted += int(victims.shape[0])
        take = m - int(reuse.shape[0])
        slots = xp.asarray(self._free[self._num_free - take:self._num_free][::-1].copy())
        self._num_free -= take
        if reuse.shape[0]:
            slots = xp.concatenate([slots, reuse])
        self._tombstones -= self._k.insert(family, self._index, self._reserved, admitted,
                                           slots, self._slot_ids, self._uses, step)
        self.admitted += m
        if self._pending is not None:  # the admitted ids leave it first, making room
            if m:
                self._pending.erase(self._k.to_family(self._family, admitted))
            self._pending._see(waiting, step)
        self._maybe_rebuild()
        if m:
            out[miss] = self._k.find(family, self._index, self._reserved, misses)
        return admitted, slots

    def _victims(self, needed, found):
        """The ``needed`` slots to evict: the lowest scores among the live slots the call
        does not use; :class:`CapacityError` when there are fewer."""
        xp = self._xp
        if self.evict == "none":
            raise CapacityError(
                f"{self.name} is full: capacity {self.capacity}, {self._num_free} slots free, "
                f"{needed} more needed for this call's new ids (evict='none'); raise its "
                f"capacity or pass evict='lru' or 'lfu'")
        used = xp.zeros(self.capacity, bool)
        used[found[found >= 0]] = True
        candidates = xp.flatnonzero((self._last >= 0) & ~used)
        if candidates.shape[0] < needed:
            raise CapacityError(
                f"{self.name}: this call's distinct new ids need {needed} more slots than "
                f"are free, but only {int(candidates.shape[0])} of its capacity "
                f"{self.capacity} are live and unused by the call; raise its capacity "
                f"or pass fewer ids per call")
        keys = [self._last, self._slot_ids]
        if self.evict == "lfu":
            keys = [self._count] + keys
        return candidates[smallest(xp, [k[candidates] for k in keys], needed)]

    def _score_of(self, ids, score):
        """``score[slot]`` of each id (``xp``), 0 where absent; no use is noted."""
        xp = self._xp
        found = self._k.find(self._family, self._index, self._reserved, ids)
        return xp.where(found >= 0, score[xp.maximum(found, 0)], 0)

    def _see(self, ids, step):
        """A pending table's call, numbered ``step`` (its owner's call): count one sighting
        of each distinct id of ``ids``; when more than ``capacity`` are new and cannot
        all be held, the smallest are kept."""
        if not ids.shape[0]:
            return
        self.step = step - 1  # the owner's calls only grow: the LRU order is kept
        xp = self._xp
        known = self._score_of(ids, self._last) > 0
        new = ids[~known]
        room = self.capacity - int(known.sum())
        if new.shape[0] > room:
            self.dropped += new.shape[0] - room
            ids = xp.concatenate([ids[known], xp.sort(new)[:room]])
        self.slots(self._k.to_family(self._family, ids))

    def _maybe_rebuild(self):
        if self.size + self._tombstones > MAX_FILL * (self._index.shape[0] // 2):
            self._rebuild()

    def _rebuild(self):
        """Index the live ids afresh: no tombstones left."""
        xp = self._xp
        live = xp.flatnonzero(self._last >= 0)
        self._k.clear(self._index)
        self._reserved[:] = -1
        self._k.insert(self._family, self._index, self._reserved, self._slot_ids[live], live,
                       self._slot_ids, self._uses, 0, assign=False)
        self._tombstones = 0


def smallest(xp, keys, k):
    """Indexes of the ``k`` smallest rows by the lexicographic order of ``keys`` (equal-
    length arrays, the last one distinct), by selection: each key narrows the set to
    the rows tied at the ``k``-th value (``partition``), never a sort of all rows."""
    rows = xp.arange(keys[0].shape[0])
    chosen = []
    for key in keys:
        values = key[rows]
        if k == rows.shape[0]:
            break
        kth = xp.partition(values, k - 1)[k - 1]
        below = rows[values < kth]
        chosen.append(below)
        k -= int(below.shape[0])
        rows = rows[values == kth]
    chosen.append(rows[:k])
    return xp.concatenate(chosen)
