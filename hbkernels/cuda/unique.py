"""Hash-based dedup on the GPU: one global open-addressing table, no sort of the ids.

1. ``_insert``, one thread per id (grid-stride): linear probing from
   ``hash(id) mod 2^b`` in a table of ``2^b >= 2N`` int64 keys, claiming an
   EMPTY (int64 min) slot with ``atomic.cas``; the id's slot is recorded
   (inverse) and ``atomic.add`` counts it (counts). The int64 min id itself
   cannot live in the table, so it gets the reserved extra slot ``2^b``.
2. ``occ[s] = 1`` where slot ``s`` is occupied, then an exclusive scan
   (``xp.cumsum``: CUB on a GPU): ``rank[s]`` is the distinct index of slot ``s``
   and ``rank[2^b + 1] = K`` (deterministic given the table). Reading ``K`` back
   to size the result is the op's one host synchronisation.
3. Compaction: ``uniq[rank[s]] = table[s]``, ``inverse[i] = rank[slot_i]``,
   ``counts[rank[s]] = hits[s]``.

``sorted=True`` sorts only the ``K`` distinct keys (with their slots) by
:func:`._segments.stable_argsort` (CUB radix sort on a GPU) and rewrites
``rank[slot]`` before the inverse and counts are gathered.
"""

import numpy as np
from numba import cuda, int64, uint64

from . import _device
from ._launch import blocks_for, fmix32, threads_per_block
from ._launcher import launch
from ._segments import stable_argsort

EMPTY = np.int64(np.iinfo(np.int64).min)
_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_GOLD = np.uint64(0x9E3779B9)


@cuda.jit(device=True, inline=True)
def _hash(key):
    """64-bit hash of an int64 key from two 32-bit mixes of its halves."""
    u = uint64(key)
    lo = u & _M32
    hi = u >> _S32
    h1 = fmix32(lo ^ fmix32(hi ^ _GOLD))
    h2 = fmix32(hi ^ h1)
    return (h2 << _S32) | h1


@cuda.jit
def _insert(ids, table, bits, slot_of, want_slot, hits, want_hits, occ):
    start, step = cuda.grid(1), cuda.gridsize(1)
    size = int64(1) << bits
    mask = size - 1
    for i in range(start, ids.shape[0], step):
        key = int64(ids[i])
        if key == EMPTY:  # only int64 ids can hit the sentinel: reserved slot `size`
            s = size
            occ[size] = 1
        else:
            s = int64(_hash(key) & uint64(mask))
            while True:
                cur = table[s]
                if cur == key:
                    break
                if cur == EMPTY:
                    old = cuda.atomic.cas(table, s, EMPTY, key)
                    if old == EMPTY or old == key:
                        break
                s = (s + 1) & mask
        if want_slot:
            slot_of[i] = s
        if want_hits:
            cuda.atomic.add(hits, s, 1)


@cuda.jit
def _occupancy(table, occ):
    """``occ[s] = 1`` where slot ``s < 2^b`` holds a key, else 0 (``occ[2^b]``, the
    reserved slot, was set by ``_insert``)."""
    for s in range(cuda.grid(1), table.shape[0] - 1, cuda.gridsize(1)):
        occ[s] = 1 if table[s] != EMPTY else 0


@cuda.jit
def _compact(table, size, occ, ukeys, slots):
    """``ukeys[occ[s]] = table[s]``, ``slots[occ[s]] = s`` for occupied ``s <= size``."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for s in range(start, size + 1, step):
        r = occ[s]
        if occ[s + 1] != r:
            ukeys[r] = table[s]  # table[size] stays EMPTY: the sentinel key itself
            slots[r] = s


@cuda.jit
def _finalize(slots, occ, write_rank, hits, counts, want_counts):
    """For distinct index ``r`` at slot ``s``: ``occ[s] = r`` (after sorting),
    ``counts[r] = hits[s]``."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for r in range(start, slots.shape[0], step):
        s = slots[r]
        if write_rank:
            occ[s] = r
        if want_counts:
            counts[r] = hits[s]


@cuda.jit
def _gather_inverse(slot_of, occ, inverse):
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, slot_of.shape[0], step):
        inverse[i] = occ[slot_of[i]]


def unique(family, ids, return_inverse, return_counts, sorted):
    n = ids.shape[0]
    if n == 0:
        return (
            family.empty(0, ids.dtype),
            family.empty(0, np.int64) if return_inverse else None,
            family.empty(0, np.int64) if return_counts else None,
        )
    xp = _device.xp()
    tpb = threads_per_block()
    grid_n = blocks_for(n, tpb)
    bits = max(1, (2 * n - 1).bit_length())  # 2^bits >= 2N
    size = 1 << bits
    grid_t = blocks_for(size + 1, tpb)

    table = _device.full(size + 1, EMPTY, np.int64)
    occ = _device.zeros(size + 1, np.int64)
    dummy = _device.scratch(1, np.int64)
    slot_of = _device.scratch(n, np.int64) if return_inverse else dummy
    hits = _device.zeros(size + 1, np.int64) if return_counts else dummy
    launch(_insert, grid_n, tpb, family.kernel_array(ids), table, bits, slot_of, return_inverse,
           hits, return_counts, occ)
    launch(_occupancy, grid_t, tpb, table, occ)
    rank = _device.zeros(size + 2, np.int64)  # rank[s]: distinct index of slot s; rank[-1] = K
    rank[1:] = xp.cumsum(occ)
    k = int(_device.to_host(rank[-1:])[0])

    ukeys = _device.scratch(k, ids.dtype)
    slots = _device.scratch(k, np.int64)
    launch(_compact, grid_t, tpb, table, size, rank, ukeys, slots)
    write_rank = sorted and k > 1
    if write_rank:
        order = stable_argsort(xp, ukeys)
        ukeys, slots = ukeys[order], slots[order]
    counts = family.empty(k, np.int64) if return_counts else None
    if write_rank or return_counts:
        launch(_finalize, blocks_for(k, tpb), tpb, slots, rank, write_rank, hits,
               family.kernel_array(counts) if return_counts else dummy, return_counts)
    inverse = None
    if return_inverse:
        inverse = family.empty(n, np.int64)
        launch(_gather_inverse, grid_n, tpb, slot_of, rank, family.kernel_array(inverse))
    return _device.to_family(family, ukeys), inverse, counts
