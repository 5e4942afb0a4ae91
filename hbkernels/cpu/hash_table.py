"""The id -> slot index of a :class:`hbkernels.HashTable` on the CPU.

The index is open addressing with linear probing over ``P = 2^bits`` positions,
interleaved in one int64 array of ``2P``: ``index[2p]`` an id (or
:class:`~hbkernels._modes.IndexKey` ``EMPTY`` / ``TOMBSTONE``), ``index[2p + 1]``
its slot, so a probe's key and slot share a cache line. An id's probe starts at
the top ``bits`` bits of its Fibonacci hash and walks up (wrapping) to the id or
an ``EMPTY`` position. The two ids equal to the markers live in ``reserved[0]``
and ``reserved[1]`` (their slot, or -1). The front end keeps live plus
tombstoned positions at most 3/4 of ``P``, so every probe ends.

Per slot ``s``: ``slot_ids[s]`` the id living there; ``uses[2s]`` the call that
last used it (-1: free) and ``uses[2s + 1]`` the calls that used it, side by side
for the same reason.
"""
import numba
import numpy as np
from numba import njit, prange

from .._modes import IndexKey
from ._common import cached_njit, chunk_count, fib_hash, prefetch


def xp():
    return np


def as_xp(family, ids):
    return ids


def to_family(family, a):
    return a


@njit(inline="always")
def _reserved(key):
    """0 or 1 for the ids equal to the markers (kept in ``reserved``), else -1."""
    if key == IndexKey.EMPTY:
        return 0
    if key == IndexKey.TOMBSTONE:
        return 1
    return -1


@njit(inline="always")
def _shift(index):
    """64 minus log2 of the positions (a power of two): the hash's top bits index them."""
    bits = 0
    while (np.int64(2) << bits) < index.shape[0]:
        bits += 1
    return np.uint64(64 - bits)


@njit(inline="always")
def _probe(index, key, h):
    """The index position holding ``key``, probing from position ``h``, or -1."""
    mask = (index.shape[0] >> 1) - 1
    while True:
        k = index[2 * h]
        if k == key:
            return h
        if k == IndexKey.EMPTY:
            return -1
        h = (h + 1) & mask


@njit(inline="always")
def _position(index, key, shift):
    """The index position holding ``key``, or -1."""
    return _probe(index, key, np.int64(fib_hash(np.uint64(key)) >> shift))


PREFETCH_GROUP = 64  # ids whose first positions are requested before any is probed
SERIAL_BELOW = 1 << 14  # ids a call probes on one thread: below, a parallel launch costs more


@njit(inline="always")
def _find_range(index, reserved, ids, out, lo, hi, shift, homes):
    pairs = index.reshape(-1, 2)  # (id, slot) rows, for the prefetch
    for g in range(lo, hi, PREFETCH_GROUP):
        end = min(g + PREFETCH_GROUP, hi)
        for i in range(g, end):  # a group's cache misses overlap
            h = np.int64(fib_hash(np.uint64(np.int64(ids[i]))) >> shift)
            homes[i - g] = h
            prefetch(pairs, h, 0)
        for i in range(g, end):
            key = np.int64(ids[i])
            r = _reserved(key)
            if r >= 0:
                out[i] = reserved[r]
            else:
                p = _probe(index, key, homes[i - g])
                out[i] = index[2 * p + 1] if p >= 0 else -1


@cached_njit(parallel=True)
def _find(index, reserved, ids, out, chunks):
    n = ids.shape[0]
    shift = _shift(index)
    for c in prange(chunks):
        homes = np.empty(PREFETCH_GROUP, np.int64)
        _find_range(index, reserved, ids, out, c * n // chunks, (c + 1) * n // chunks, shift, homes)


@cached_njit()
def _find_serial(index, reserved, ids, out):
    homes = np.empty(PREFETCH_GROUP, np.int64)
    _find_range(index, reserved, ids, out, 0, ids.shape[0], _shift(index), homes)


def find(family, index, reserved, ids):
    """The slot of each id of ``ids`` (1-D, int32 or int64), -1 where absent."""
    out = np.empty(ids.shape[0], np.int64)
    if ids.shape[0] < SERIAL_BELOW:
        _find_serial(index, reserved, ids, out)
    else:
        _find(index, reserved, ids, out, chunk_count(ids.shape[0]))
    return out


@cached_njit()
def _insert(index, reserved, ids, slots, slot_ids, uses, step, assign):
    mask, shift = (index.shape[0] >> 1) - 1, _shift(index)
    reused = 0
    for i in range(ids.shape[0]):
        key = np.int64(ids[i])
        s = slots[i]
        if assign:
            slot_ids[s] = key
            uses[2 * s] = step
            uses[2 * s + 1] = 1
        r = _reserved(key)
        if r >= 0:
            reserved[r] = s
            continue
        h = np.int64(fib_hash(np.uint64(key)) >> shift)
        while index[2 * h] != IndexKey.EMPTY and index[2 * h] != IndexKey.TOMBSTONE:
            h = (h + 1) & mask
        if index[2 * h] == IndexKey.TOMBSTONE:
            reused += 1
        index[2 * h] = key
        index[2 * h + 1] = s
    return reused


def insert(family, index, reserved, ids, slots, slot_ids, uses, step, assign=True):
    """Index the distinct absent ``ids`` at ``slots``; with ``assign``, the slots become
    theirs, used once, at call ``step`` (without, the slot state is left as it is: a
    rebuilt index). Returns how many tombstoned positions they took."""
    return int(_insert(index, reserved, ids, slots, slot_ids, uses, step, assign))


@cached_njit()
def _erase(index, reserved, ids, uses, out):
    shift = _shift(index)
    erased = 0
    for i in range(ids.shape[0]):
        key = np.int64(ids[i])
        r = _reserved(key)
        s = -1
        if r >= 0:
            s = reserved[r]
            reserved[r] = -1
        else:
            p = _position(index, key, shift)
            if p >= 0:
                s = index[2 * p + 1]
                index[2 * p] = IndexKey.TOMBSTONE
                erased += 1
        out[i] = s
        if s >= 0:
            uses[2 * s] = -1
            uses[2 * s + 1] = 0
    return erased


def erase(family, index, reserved, ids, uses):
    """Remove the distinct ``ids``: ``(their former slots, -1 where absent; positions
    tombstoned)``; a freed slot's last use becomes -1 and its use count 0."""
    out = np.empty(ids.shape[0], np.int64)
    erased = _erase(index, reserved, ids, uses, out)
    return out, int(erased)


@cached_njit(parallel=True)
def _touch(found, uses, step, parts):
    capacity = uses.shape[0] >> 1
    for t in prange(parts):  # part t owns slots [lo, hi): no two threads write one slot
        _touch_range(found, uses, step, t * capacity // parts, (t + 1) * capacity // parts)


@njit(inline="always")
def _touch_range(found, uses, step, lo, hi):
    for i in range(found.shape[0]):
        s = found[i]
        if lo <= s < hi and uses[2 * s] != step:
            uses[2 * s] = step
            uses[2 * s + 1] += 1


@cached_njit()
def _touch_serial(found, uses, step):
    _touch_range(found, uses, step, 0, uses.shape[0] >> 1)


def touch(family, found, uses, step):
    """Note call ``step``'s use of each slot in ``found`` (-1 skipped): its last use
    becomes ``step`` and, once per slot however often it occurs, its count grows by 1."""
    if found.shape[0] < SERIAL_BELOW:
        _touch_serial(found, uses, step)
    else:
        _touch(found, uses, step, numba.get_num_threads())


def clear(index):
    """Every position ``EMPTY`` (the slots are left as they are)."""
    index[0::2] = IndexKey.EMPTY


@cached_njit()
def _admit_small(index, reserved, ids, out, slot_ids, uses, free, num_free, step,
                 new_ids, new_slots):
    """One serial pass of a whole small call that admits every new id (``admit_count``
    1): find; the distinct missing ids in first-occurrence order; when they fit in the
    ``num_free`` free slots, the hits' uses, then each new id the next free slot (the
    top of the stack ``free`` first). Returns ``(new ids, tombstones reused)``, or
    ``(-1, 0)`` with ``out`` the find's result and nothing changed when they do not fit."""
    n = ids.shape[0]
    _find_range(index, reserved, ids, out, 0, n, _shift(index), np.empty(PREFETCH_GROUP, np.int64))
    misses = 0
    for i in range(n):
        misses += out[i] < 0
    m = 0
    if misses:
        bits = 4
        while (1 << bits) < 2 * misses:
            bits += 1
        seen = np.full(1 << bits, -1, np.int64)  # position in new_ids
        mask = (1 << bits) - 1
        for i in range(n):  # a miss's out becomes -2 - (its new id's position)
            if out[i] >= 0:
                continue
            key = np.int64(ids[i])
            h = np.int64(fib_hash(np.uint64(key)) >> np.uint64(64 - bits))
            while True:
                j = seen[h]
                if j == -1:
                    seen[h] = m
                    new_ids[m] = key
                    out[i] = -2 - m
                    m += 1
                    break
                if new_ids[j] == key:
                    out[i] = -2 - j
                    break
                h = (h + 1) & mask
        if m > num_free:
            for i in range(n):
                if out[i] < -1:
                    out[i] = -1
            return -1, 0
    for i in range(n):
        s = out[i]
        if s >= 0 and uses[2 * s] != step:
            uses[2 * s] = step
            uses[2 * s + 1] += 1
    for j in range(m):
        new_slots[j] = free[num_free - 1 - j]
    reused = _insert(index, reserved, new_ids[:m], new_slots[:m], slot_ids, uses, step, True)
    for i in range(n):
        if out[i] < -1:
            out[i] = new_slots[-2 - out[i]]
    return m, reused


def admit_small(family, index, reserved, ids, slot_ids, uses, free, num_free, step):
    """:func:`_admit_small` for ``ids`` (fewer than :data:`SERIAL_BELOW`): ``(slots,
    new_ids, new_slots, tombstones reused)``, or ``(slots of the find, None, None, 0)``
    when the new ids do not fit."""
    n = ids.shape[0]
    out, new_ids, new_slots = (np.empty(n, np.int64) for _ in range(3))
    m, reused = _admit_small(index, reserved, ids, out, slot_ids, uses, free, num_free, step,
                             new_ids, new_slots)
    if m < 0:
        return out, None, None, 0
    return out, new_ids[:m].copy(), new_slots[:m].copy(), int(reused)
