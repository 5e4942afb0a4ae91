"""Tiered storage of one fused array: rows in host memory or in files, a cache of hot
rows in the fast tier in front of them.

A :class:`Store` holds a rank's rows of a tiered table's fused group in the slow
tier: the weights and each optimizer slot, NumPy arrays in host memory
(``"host"``, made whole at construction) or memory-mapped files in a directory
(``"mmap"``, sparse: a row is made by ``make`` the first time it is touched, and
a byte per row records which rows the files hold). Behind a cache the files hold
a record per row (weights, then state), so a row written back dirties one page.

A :class:`Tier` runs the kernels on :attr:`Tier.fast`. Without a cache that is the
store itself (the rows a batch touches are made first). With ``cache_rows=K`` it
is a ``[K, width]`` array (and its optimizer state) in the fast tier, indexed by
a :class:`~hbkernels.HashTable` from store row to cache slot with the table's
``cache_policy``. Per batch, :meth:`Tier.rows` takes the batch's store rows:

1. finds them in the cache;
2. when the missing ones do not fit in the free slots, evicts the policy's first
   victims among the rows the batch does not use, at least ``K / EVICT_SHARE``
   of them at once (so the selection over the whole cache runs once per many
   batches), and writes the evicted rows back to the store in one scatter;
3. fetches the missing rows in one gather (or takes them from a prefetch) into
   their new slots;
4. returns the batch's cache slots, which the kernels and the optimizer use as
   the rows of :attr:`Tier.fast`.

A batch with more distinct rows than the cache holds grows the cache to hold
them (twice its size, or the batch's rows), for good: the cache is never
smaller than the largest batch seen. The values are those of the uncached
table bit for bit: a row's weights and state move between tiers unchanged, and
every kernel sees the same rows in the same order.
"""
import errno
import fcntl
import mmap
import os
import threading
from typing import Any, NamedTuple

import numpy as np

from .._dispatch import device_family, host
from .._sorted import distinct, find_sorted
from ..hash_table import HashTable

EVICT_SHARE = 32  # an eviction frees at least capacity / EVICT_SHARE slots


class FusedArrays(NamedTuple):
    """The arrays of one fused group on a rank: the weights and the optimizer state
    (``init_state`` of the weights: a slot array per optimizer slot, and ``"step"``)."""

    weights: Any
    state: dict


class Store:
    """A rank's rows of a tiered fused group in the slow tier.

    ``arrays``: :class:`FusedArrays` of NumPy arrays (host memory or memory-mapped
    files). ``touched``: for a file store, a byte per row, nonzero once the files
    hold the row; ``make(rows)`` then gives the weights of rows never touched and
    ``fresh`` ``{slot: value}`` their optimizer state."""

    def __init__(self, arrays, slots, touched=None, make=None, fresh=None):
        self.arrays, self.slots = arrays, [name for name, _ in slots]
        self.touched, self.make, self.fresh = touched, make, fresh
        self.lock = None  # a file store's lock on its files, held while it lives
        self.directory = None  # a file store's directory

    @classmethod
    def in_files(cls, directory, prefix, rows, width, dtype, slots, make, fresh, records=False):
        """A store of ``rows`` rows in files ``directory/prefix.*``, created empty: sparse
        files whose rows are made on first touch (``make`` None: rows are written before
        they are read, as a dynamic table's slots are), a byte per row in
        ``prefix.touched``. The rows are ``prefix.weights`` and a file per optimizer slot,
        or with ``records`` one file, ``prefix.rows``, of a record per row (the weights,
        then each slot's values), for a store only a cache reads and writes."""
        os.makedirs(directory, exist_ok=True)
        lock = open(os.path.join(directory, f"{prefix}.lock"), "wb")  # noqa: SIM115 - held while the store lives
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise ValueError(f"{directory}: the files {prefix}.* are in use (by another table "
                             f"of this width, or another live collection here or in another "
                             f"process); give this table another path") from None

        def mapped(array, shape, dt):
            size = int(np.prod(shape)) * np.dtype(dt).itemsize
            with open(os.path.join(directory, f"{prefix}.{array}"), "w+b") as f:
                f.truncate(size)  # a fresh, sparse file of the full size
                if not size:
                    return np.zeros(shape, dt)
                view = mmap.mmap(f.fileno(), size)
            view.madvise(mmap.MADV_RANDOM)  # rows are read at random: no read-ahead
            return np.frombuffer(view, dt).reshape(shape)

        state = {"step": np.zeros(1, np.int64)}
        if not records:  # an array per file, each C-contiguous: the kernels update them in place
            weights = mapped("weights", (rows, width), dtype)
            for name, per_row in slots:
                state[name] = mapped(name, (rows,) if per_row else (rows, width), np.float32)
        else:  # a record per row: a row written back dirties one page of the files, not one per array
            itemsize, offsets = np.dtype(dtype).itemsize, {}
            end = -(-width * itemsize // 4) * 4  # each slot's values 4-byte aligned
            for name, per_row in slots:
                offsets[name] = (end, 1 if per_row else width)
                end += 4 * offsets[name][1]
            table = mapped("rows", (rows, end), np.uint8)
            weights = table[:, :width * itemsize].view(dtype)
            for name, per_row in slots:
                start, n = offsets[name]
                values = table[:, start:start + 4 * n].view(np.float32)
                state[name] = values[:, 0] if per_row else values
        touched = None if make is None else mapped("touched", (rows,), np.uint8)
        store = cls(FusedArrays(weights, state), slots, touched, make, fresh)
        store.lock, store.directory = lock, directory
        return store

    @property
    def num_rows(self):
        return int(self.arrays.weights.shape[0])

    def _untouched(self, rows):
        if self.touched is None or not rows.shape[0]:
            return rows[:0]
        return rows[self.touched[rows] == 0]

    def read(self, rows):
        """``(weights, {slot: values})`` of distinct ``rows`` (NumPy int64); rows never
        touched read as ``make`` makes them (nothing is written; their pages of the
        files are not read)."""
        if self.touched is None or not rows.shape[0]:
            return (np.asarray(self.arrays.weights[rows]),
                    {s: np.asarray(self.arrays.state[s][rows]) for s in self.slots})
        new = self.touched[rows] == 0
        old = rows[~new]
        weights = np.empty((rows.shape[0],) + self.arrays.weights.shape[1:], self.arrays.weights.dtype)
        weights[~new] = self.arrays.weights[old]
        weights[new] = self.make(rows[new])
        state = {}
        for s in self.slots:
            array = self.arrays.state[s]
            state[s] = np.empty((rows.shape[0],) + array.shape[1:], array.dtype)
            state[s][~new] = array[old]
            state[s][new] = self.fresh[s]
        return weights, state

    def write(self, rows, weights, state):
        """Put rows ``rows`` (distinct, NumPy int64) of the weights and of each slot; a
        file store first checks that the disk can take them (a write to a mapped file
        past a full disk would kill the process)."""
        if not rows.shape[0]:
            return
        if self.directory is not None:
            self._check_space(rows.shape[0])
        self.arrays.weights[rows] = weights
        for s in self.slots:
            self.arrays.state[s][rows] = state[s]
        if self.touched is not None:
            self.touched[rows] = 1

    def _check_space(self, rows):
        """``OSError(ENOSPC)`` unless the disk has room for ``rows`` rows, each on a page
        of its own in every file (the most a write can allocate)."""
        disk = os.statvfs(self.directory)
        need = rows * mmap.PAGESIZE * (2 + len(self.slots))
        if disk.f_bavail * disk.f_frsize < need:
            raise OSError(errno.ENOSPC, f"{self.directory}: {disk.f_bavail * disk.f_frsize} bytes "
                                        f"free on its disk, {need} needed to write {rows} rows "
                                        f"of the table's files")

    def ensure(self, rows):
        """Make and write the rows of distinct ``rows`` never touched."""
        new = self._untouched(rows)
        if new.shape[0]:
            self.write(new, self.make(new), {s: self.fresh[s] for s in self.slots})

    def ensure_all(self, chunk=1 << 20):
        for r0 in range(0, self.num_rows, chunk):
            self.ensure(np.arange(r0, min(r0 + chunk, self.num_rows), dtype=np.int64))

    def touched_rows(self):
        """The rows the files hold (a host store: all), ascending."""
        if self.touched is None:
            return np.arange(self.num_rows, dtype=np.int64)
        return np.flatnonzero(self.touched).astype(np.int64)


class Tier:
    """A :class:`Store` of ``width``-wide rows of ``dtype`` with an optional cache of
    ``cache_rows`` rows on ``device``, evicted by ``policy`` (module doc)."""

    def __init__(self, store, width, dtype, device, cache_rows=None, policy="lru", name="tier"):
        self.store, self.width, self.dtype, self.device = store, width, np.dtype(dtype), device
        self.policy, self.name = policy, name
        self.stats = {"lookups": 0, "misses": 0, "evictions": 0, "prefetched": 0}
        self._family = device_family(device)
        self._staged = None  # (rows ascending, weights, state, usable) read ahead by prefetch
        self._thread = None
        self._error = None  # what the background work raised, for the next _join
        self.cache = None
        if cache_rows is not None:
            self._make_cache(min(int(cache_rows), max(1, store.num_rows)))

    # -- the fast tier --------------------------------------------------------------------------
    @property
    def fast(self):
        """:class:`FusedArrays` the kernels and the optimizer run on."""
        return self.store.arrays if self.cache is None else self.cache

    @property
    def capacity(self):
        return 0 if self.cache is None else self.index.capacity

    def _make_cache(self, capacity, old=None):
        """A cache of ``capacity`` rows; ``old`` ``(index, cache, owner)`` moves in."""
        space = self._family
        index = self._new_index(capacity)
        weights = space.zeros((capacity, self.width), self.dtype)
        state = {"step": self.store.arrays.state["step"]}  # one step counter for both tiers
        for s in self.store.slots:
            shape = (capacity,) + tuple(self.store.arrays.state[s].shape[1:])
            state[s] = space.zeros(shape, np.float32)
        owner = np.full(capacity, -1, np.int64)  # cache slot -> store row
        if old is not None:
            kept = old[0].state()
            slots = index.restore(kept["ids"], kept["last"], kept["count"], kept["step"])
            at, was = space.put(slots), space.put(kept["slots"])
            weights[at] = old[1].weights[was]
            for s in self.store.slots:
                state[s][at] = old[1].state[s][was]
            owner[slots] = kept["ids"]
        self.index, self.cache, self.owner = index, FusedArrays(weights, state), owner

    def _new_index(self, capacity):
        return HashTable(capacity, evict=self.policy, device=self.device,
                         name=f"{self.name} (cache)")

    def _put_cache(self, slots, weights, state):
        """Cache slots ``slots`` (NumPy) take rows ``weights`` and ``state`` (NumPy)."""
        at = self._family.put(slots)
        self.cache.weights[at] = self._family.put(np.ascontiguousarray(weights))
        for s in self.store.slots:
            self.cache.state[s][at] = self._family.put(np.ascontiguousarray(state[s]))

    def rows(self, keys):
        """The rows of :attr:`fast` for store rows ``keys`` (int64 on the tier's device;
        -1 stays -1): the cache's slots, the rows fetched (and others evicted) as
        needed; without a cache ``keys`` themselves, their rows made."""
        self._join()
        xp = self._family.xp
        keys = self._family.compute(keys)
        valid = keys[keys >= 0] if bool((keys < 0).any()) else keys
        if self.cache is None:
            if self.store.touched is not None:
                self.store.ensure(distinct(host(valid)))
            return self._family.from_compute(keys)
        found = self._family.compute(self.index.slots(self._family.from_compute(valid), insert=False))
        wanted, first = np.unique(host(valid), return_index=True)
        cached = host(found)[first] >= 0  # distinct rows have distinct slots
        missing = wanted[~cached]
        used = int(cached.sum())
        self.stats["lookups"] += used + int(missing.shape[0])
        self.stats["misses"] += int(missing.shape[0])
        need = int(missing.shape[0]) - (self.index.capacity - self.index.size)
        evictable = self.index.size - used
        if need > evictable:  # the batch alone overflows the cache: grow it
            self._grow(max(2 * self.index.capacity, used + int(missing.shape[0])))
            need = int(missing.shape[0]) - (self.index.capacity - self.index.size)
        if need > 0:
            self._evict(min(evictable, max(need, self.index.capacity // EVICT_SHARE)),
                        self._family.from_compute(valid[found >= 0]))
        slots, new_ids, new_slots = self.index.slots(self._family.from_compute(valid), return_new=True)
        new_ids, new_slots = host(new_ids), host(new_slots)
        order = np.argsort(new_ids)
        new_ids, new_slots = new_ids[order], new_slots[order]
        self._put_cache(new_slots, *self._fetch(new_ids))
        self.owner[new_slots] = new_ids
        if valid.shape[0] == keys.shape[0]:
            return slots
        out = xp.full(keys.shape[0], -1, np.int64)
        out[keys >= 0] = self._family.compute(slots)
        return self._family.from_compute(out)

    def _fetch(self, rows):
        """The store's rows ``rows`` (ascending), the prefetched ones from the staging."""
        staged, self._staged = self._staged, None
        if staged is None or not rows.shape[0]:
            return self.store.read(rows)
        ready, weights, state, usable = staged
        at, hit = find_sorted(ready, rows)
        if ready.shape[0]:
            hit &= usable[at]
        if hit.all():
            self.stats["prefetched"] += int(rows.shape[0])
            return weights[at], {s: state[s][at] for s in self.store.slots}
        out_w, out_s = self.store.read(rows)
        out_w[hit] = weights[at[hit]]
        for s in self.store.slots:
            out_s[s][hit] = state[s][at[hit]]
        self.stats["prefetched"] += int(hit.sum())
        return out_w, out_s

    def _evict(self, count, keep):
        ids, slots = self.index.evict_lowest(count, keep)
        self._write_back(host(ids), slots, wait=False)  # rows the call does not read
        self.owner[host(slots)] = -1
        self.stats["evictions"] += int(ids.shape[0])

    def _write_back(self, rows, slots, wait=True):
        """Write cache slots ``slots`` (device) to store rows ``rows`` (NumPy); unless
        ``wait``, in the background (the rows are copied out first)."""
        if not rows.shape[0]:
            return
        order = np.argsort(rows)  # ascending: the files are written in order
        rows, at = rows[order], self._family.put(host(slots)[order])
        self._unstage(rows)
        weights = host(self.cache.weights[at])
        state = {s: host(self.cache.state[s][at]) for s in self.store.slots}
        if wait:
            self.store.write(rows, weights, state)
        else:
            self._background(lambda: self.store.write(rows, weights, state), "write-back")

    def _grow(self, capacity):
        self._make_cache(capacity, (self.index, self.cache, self.owner))

    def store_rows(self, rows):
        """Store rows of rows ``rows`` of :attr:`fast` (device; -1 stays -1), NumPy."""
        rows = host(rows)
        if self.cache is None:
            return rows
        return np.where(rows >= 0, self.owner[np.maximum(rows, 0)], -1)

    # -- whole-store access ---------------------------------------------------------------------------
    def flush(self):
        """Write every cached row back to the store (they stay cached)."""
        self._join()
        if self.cache is None:
            return
        live = np.flatnonzero(self.owner >= 0)
        self._write_back(self.owner[live], live)

    def clear(self):
        """Write every cached row back and empty the cache (its capacity kept), so that
        writes made straight to the store are what the next batch reads."""
        self.flush()
        if self.cache is not None:
            self.index = self._new_index(self.index.capacity)
            self.owner[:] = -1

    def write(self, rows, weights, state):
        """Set store rows ``rows`` (distinct, NumPy) to ``weights`` and ``state`` ``{slot:
        values}`` (NumPy; a value may be one row for all), in the cache where it holds them."""
        self._join()
        rows = np.asarray(rows, np.int64)
        n = rows.shape[0]
        weights = np.asarray(weights)
        state = {s: np.broadcast_to(np.asarray(state[s]), (n,) + self.store.arrays.state[s].shape[1:])
                 for s in self.store.slots}
        if self.cache is not None and n:
            found = host(self.index.slots(self._family.put(rows), insert=False))
            hit = found >= 0
            if hit.any():
                self._put_cache(found[hit], weights[hit], {s: v[hit] for s, v in state.items()})
                rows, weights = rows[~hit], weights[~hit]
                state = {s: v[~hit] for s, v in state.items()}
        self._unstage(rows)
        self.store.write(rows, weights, state)

    # -- prefetch -------------------------------------------------------------------------------------
    def prefetch(self, keys):
        """Read, in a background thread, the store rows of ``keys`` the cache lacks now
        (after the write-backs under way); the next :meth:`rows` takes them from there
        instead of the store."""
        if self.cache is None:
            return
        rows = distinct(host(keys))
        rows = rows[rows >= 0]
        found = host(self.index.slots(self._family.put(rows), insert=False))
        rows = rows[found < 0]

        def read():
            weights, state = self.store.read(rows)
            self._staged = (rows, weights, state, np.ones(rows.shape[0], bool))

        self._background(read, "prefetch")

    def _background(self, work, what):
        """Run ``work`` in a thread after the one running now (one at a time, in order);
        an error it raises is raised by the next :meth:`_join`."""
        before = self._thread

        def run():
            if before is not None:
                before.join()
            if self._error is None:
                try:
                    work()
                except BaseException as error:  # noqa: BLE001 - raised in the caller's thread
                    self._error = error

        self._thread = threading.Thread(target=run, name=f"{self.name} {what}", daemon=True)
        self._thread.start()

    def _join(self):
        """Wait for the background work (write-backs, reads ahead); raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _unstage(self, rows):
        """Staged copies of ``rows`` (written to the store now) are stale."""
        if self._staged is None or not rows.shape[0]:
            return
        ready, usable = self._staged[0], self._staged[3]
        at, hit = find_sorted(ready, rows)
        usable[at[hit]] = False
