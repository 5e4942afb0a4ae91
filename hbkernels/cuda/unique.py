"""Hash-based dedup on the GPU: one global open-addressing table, no sort of the ids.

1. ``_insert``, one thread per id (grid-stride): linear probing from
   ``hash(id) mod 2^b`` in a table of ``2^b >= 2N`` int64 keys, claiming an
   EMPTY (int64 min) slot with ``atomic.cas``; the id's slot is recorded
   (inverse) and ``atomic.add`` counts it (counts). The int64 min id itself
   cannot live in the table, so it gets the reserved extra slot ``2^b``.
2. ``occ[s] = 1`` where slot ``s`` is occupied, then an exclusive scan:
   ``occ[s]`` is the distinct index of slot ``s`` and ``occ[2^b + 1] = K``
   (deterministic given the table). One read-back gives ``K`` (and the key
   range, for ``sorted``).
3. Compaction: ``uniq[occ[s]] = table[s]``, ``inverse[i] = occ[slot_i]``,
   ``counts[occ[s]] = hits[s]``.

``sorted=True`` sorts only the ``K`` distinct keys (with their slots) by a
device LSD radix sort (:func:`._scan.radix_sort`) and rewrites
``occ[slot] = rank`` before the inverse and counts are gathered.
"""

import numpy as np
from numba import cuda, int64, uint64

from ._launch import blocks_for, fill, kernel_factory, threads_per_block, to_host
from ._scan import exclusive_scan, radix_sort

EMPTY = np.int64(np.iinfo(np.int64).min)
_INT64_MAX = np.iinfo(np.int64).max
_M32 = np.uint64(0xFFFFFFFF)
_S13 = np.uint64(13)
_S16 = np.uint64(16)
_S32 = np.uint64(32)
_C1 = np.uint64(0x85EBCA6B)
_C2 = np.uint64(0xC2B2AE35)
_GOLD = np.uint64(0x9E3779B9)


@cuda.jit(device=True, inline=True)
def _fmix32(x):
    """MurmurHash3's 32-bit finaliser on the low 32 bits of a uint64 (no overflow:
    every product is of two values < 2^32)."""
    x ^= x >> _S16
    x = (x * _C1) & _M32
    x ^= x >> _S13
    x = (x * _C2) & _M32
    x ^= x >> _S16
    return x


@cuda.jit(device=True, inline=True)
def _hash(key):
    """64-bit hash of an int64 key from two 32-bit mixes of its halves."""
    u = uint64(key)
    lo = u & _M32
    hi = u >> _S32
    h1 = _fmix32(lo ^ _fmix32(hi ^ _GOLD))
    h2 = _fmix32(hi ^ h1)
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


@kernel_factory
def _occupancy_kernel(tpb):
    @cuda.jit
    def occupancy(table, size, occ, stats, want_range):
        """``occ[s] = table[s] != EMPTY`` for ``s < size``; with ``want_range`` the
        min/max occupied key into ``stats[2]``/``stats[3]`` (block reduce + atomics)."""
        lo_sh = cuda.shared.array(tpb, int64)
        hi_sh = cuda.shared.array(tpb, int64)
        start, step = cuda.grid(1), cuda.gridsize(1)
        lo = int64(_INT64_MAX)
        hi = int64(EMPTY)
        for s in range(start, size, step):
            k = table[s]
            if k != EMPTY:
                occ[s] = 1
                lo = min(lo, k)
                hi = max(hi, k)
            else:
                occ[s] = 0
        if want_range:
            tid = cuda.threadIdx.x
            lo_sh[tid] = lo
            hi_sh[tid] = hi
            cuda.syncthreads()
            half = tpb // 2
            while half > 0:
                if tid < half:
                    lo_sh[tid] = min(lo_sh[tid], lo_sh[tid + half])
                    hi_sh[tid] = max(hi_sh[tid], hi_sh[tid + half])
                cuda.syncthreads()
                half //= 2
            if tid == 0:
                cuda.atomic.min(stats, 2, lo_sh[0])
                cuda.atomic.max(stats, 3, hi_sh[0])

    return occupancy


@cuda.jit
def _summary(occ, size, stats):
    """``stats[0]`` = distinct keys other than the sentinel, ``stats[1]`` = all (K)."""
    if cuda.grid(1) == 0:
        stats[0] = occ[size]
        stats[1] = occ[size + 1]


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
    stream = family.stream()
    tpb = threads_per_block()
    grid_n = blocks_for(n, tpb)
    bits = max(1, (2 * n - 1).bit_length())  # 2^bits >= 2N
    size = 1 << bits
    grid_t = blocks_for(size + 1, tpb)

    table = cuda.device_array(size + 1, np.int64, stream=stream)
    fill(table, EMPTY, stream)
    occ = cuda.device_array(size + 2, np.int64, stream=stream)
    fill(occ[size:], 0, stream)
    dummy = cuda.device_array(1, np.int64, stream=stream)
    slot_of = cuda.device_array(n, np.int64, stream=stream) if return_inverse else dummy
    hits = dummy
    if return_counts:
        hits = cuda.device_array(size + 1, np.int64, stream=stream)
        fill(hits, 0, stream)
    stats = cuda.to_device(np.array([0, 0, _INT64_MAX, EMPTY], np.int64), stream=stream)

    _insert[grid_n, tpb, stream](
        family.kernel_array(ids), table, bits, slot_of, return_inverse, hits, return_counts, occ
    )
    _occupancy_kernel(tpb)[grid_t, tpb, stream](table, size, occ, stats, sorted)
    exclusive_scan(occ, stream)
    _summary[1, 1, stream](occ, size, stats)
    plain, k, lo, hi = (int(v) for v in to_host(stats, stream))
    if k > plain:  # the sentinel id is present: it is the smallest key
        lo = int(EMPTY)
        if plain == 0:
            hi = int(EMPTY)

    uniq = family.empty(k, ids.dtype)
    k_uniq = family.kernel_array(uniq)
    slots = cuda.device_array(k, np.int64, stream=stream)
    if sorted and k > 1:
        ukeys = cuda.device_array(k, ids.dtype, stream=stream)
        _compact[grid_t, tpb, stream](table, size, occ, ukeys, slots)
        sorted_slots = cuda.device_array(k, np.int64, stream=stream)
        radix_sort(ukeys, slots, k_uniq, sorted_slots, lo, hi, stream)
        slots = sorted_slots
        write_rank = True
    else:
        _compact[grid_t, tpb, stream](table, size, occ, k_uniq, slots)
        write_rank = False

    counts = family.empty(k, np.int64) if return_counts else None
    if write_rank or return_counts:
        _finalize[blocks_for(k, tpb), tpb, stream](
            slots, occ, write_rank, hits,
            family.kernel_array(counts) if return_counts else dummy, return_counts,
        )
    inverse = None
    if return_inverse:
        inverse = family.empty(n, np.int64)
        _gather_inverse[grid_n, tpb, stream](slot_of, occ, family.kernel_array(inverse))
    return uniq, inverse, counts
