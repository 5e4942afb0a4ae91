"""Stable sort of non-negative integer keys and their runs, in memory allocated once,
in launches whose number and shapes depend only on the capacity and the largest key:
the grouping a step captured in a CUDA graph takes (no allocation, no library call,
no host read).

A :class:`SortSpace` holds every array the sort writes, for ``capacity`` keys at most
``max_key``. :meth:`SortSpace.group` sorts the positions ``0..capacity-1`` of a key
array stably by key and gives the same :class:`._segments.Grouping` that
:func:`._segments.group` gives (order as int64 positions, run numbers, run bounds,
distinct keys and their count), bit for bit.

The sort is least-significant-digit first, ``DIGIT_BITS`` bits a pass (``ceil(bits of
max_key / 8)`` passes, at least one). A pass cuts the keys into tiles of ``ITEMS``
keys per thread of a block; per pass:

1. ``digit_counts``: each tile's count of each digit, digit-major
   (``counts[digit * tiles + tile]``);
2. ``chunk_sums``, ``scan_rows`` (one block), ``scan_chunks``: the counts scanned
   (exclusive) as one array, so each entry becomes the first place of its digit's keys
   of its tile in the pass's output;
3. ``scatter_digits``: each tile places its keys (and their positions) there, plus the
   key's rank among the tile's keys of its digit. Ranks follow input order: the tile is
   read in rounds of one key per thread, a warp ranks its lanes by ``match_any`` and
   the lanes' order, and warps and rounds follow one another.

The runs then take three launches: each tile's count of run heads (a key unlike the
one before it), those counts scanned (``scan_rows`` again), and each position's run
number with the runs' bounds and keys: ``5 * passes + 3`` launches in all.
"""
from typing import NamedTuple

import numpy as np
from numba import cuda, int32, int64, uint32

from . import _device
from ._launch import WARP, kernel_factory, threads_per_block
from ._launcher import prepare
from ._segments import Grouping, index_dtype
from ._warp import match_any

DIGIT_BITS = 8
DIGITS = 1 << DIGIT_BITS
ITEMS = 8  # keys per thread of a tile


def passes_for(max_key):
    """Passes of ``DIGIT_BITS`` bits that sort keys in ``[0, max_key]``."""
    return max(1, -(-int(max_key).bit_length() // DIGIT_BITS))


@kernel_factory
def radix_kernels(tpb):
    """``(digit_counts, chunk_sums, scan_rows, scan_chunks, scatter_digits, head_counts,
    runs)`` for blocks of ``tpb`` threads (a multiple of the warp dividing ``DIGITS``)."""
    warps = tpb // WARP
    tile = tpb * ITEMS
    warp_digits = warps * DIGITS  # (a shared array's size: a constant of the closure)

    @cuda.jit(device=True)
    def block_scan(buf, t, value):
        """``(exclusive prefix, total)`` of ``value`` over the block's threads in
        thread order (``buf``: ``tpb`` shared int32; every thread calls it)."""
        buf[t] = value
        cuda.syncthreads()
        offset = 1
        while offset < tpb:
            x = buf[t - offset] if t >= offset else 0
            cuda.syncthreads()
            buf[t] += x
            cuda.syncthreads()
            offset *= 2
        inclusive = buf[t]
        total = buf[tpb - 1]
        cuda.syncthreads()
        return inclusive - value, total

    @cuda.jit(cache=False)
    def digit_counts(keys, n, shift, counts, tiles):
        """``counts[d * tiles + tile]``: keys of tile ``tile`` whose digit at ``shift`` is ``d``."""
        t = cuda.threadIdx.x
        here = cuda.blockIdx.x
        hist = cuda.shared.array(DIGITS, int32)
        for d in range(t, DIGITS, tpb):
            hist[d] = 0
        cuda.syncthreads()
        for k in range(ITEMS):
            i = here * tile + k * tpb + t
            if i < n:
                cuda.atomic.add(hist, int32((keys[i] >> shift) & (DIGITS - 1)), 1)
        cuda.syncthreads()
        for d in range(t, DIGITS, tpb):
            counts[d * tiles + here] = hist[d]

    @cuda.jit(cache=False)
    def chunk_sums(values, length, sums):
        """``sums[c]``: the sum of chunk ``c`` (``tile`` entries) of ``values[:length]``."""
        t = cuda.threadIdx.x
        here = cuda.blockIdx.x
        total = cuda.shared.array(1, int32)
        if t == 0:
            total[0] = 0
        cuda.syncthreads()
        s = 0
        for k in range(ITEMS):
            i = here * tile + t * ITEMS + k
            if i < length:
                s += values[i]
        cuda.atomic.add(total, 0, s)
        cuda.syncthreads()
        if t == 0:
            sums[here] = total[0]

    @cuda.jit(cache=False)
    def scan_rows(counts, rows, length, totals):
        """Each row ``counts[r * length:(r + 1) * length]`` scanned in place (exclusive),
        its sum to ``totals[r]``; rows taken by blocks in turn."""
        t = cuda.threadIdx.x
        buf = cuda.shared.array(tpb, int32)
        for r in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            carry = 0
            for c0 in range(0, length, tpb):
                c = c0 + t
                v = counts[r * length + c] if c < length else 0
                before, total = block_scan(buf, t, v)
                if c < length:
                    counts[r * length + c] = carry + before
                carry += total
            if t == 0:
                totals[r] = carry

    @cuda.jit(cache=False)
    def scan_chunks(values, length, sums):
        """``values[:length]`` scanned in place (exclusive), ``sums`` holding each
        chunk's first value (the scanned chunk sums)."""
        t = cuda.threadIdx.x
        here = cuda.blockIdx.x
        buf = cuda.shared.array(tpb, int32)
        s = 0
        for k in range(ITEMS):
            i = here * tile + t * ITEMS + k
            if i < length:
                s += values[i]
        before, _ = block_scan(buf, t, s)
        at = sums[here] + before
        for k in range(ITEMS):
            i = here * tile + t * ITEMS + k
            if i < length:
                v = values[i]
                values[i] = at
                at += v

    @cuda.jit(cache=False)
    def scatter_digits(keys_in, order_in, keys_out, order_out, counts, n, shift, tiles, first):
        """One pass's stable placement, ``counts`` holding each digit's first place in each
        tile (the digit-major counts scanned); ``first``: positions are the input's own."""
        t = cuda.threadIdx.x
        here = cuda.blockIdx.x
        lane = t % WARP
        warp = t // WARP
        base = cuda.shared.array(DIGITS, int32)
        per_warp = cuda.shared.array(warp_digits, int32)
        for d in range(t, DIGITS, tpb):
            base[d] = counts[d * tiles + here]
        below = uint32((1 << lane) - 1)
        for k in range(ITEMS):
            if here * tile + k * tpb >= n:  # the same for every thread of the block
                break
            i = here * tile + k * tpb + t
            valid = i < n
            key = keys_in[i] if valid else keys_in[0]
            d = int32((key >> shift) & (DIGITS - 1)) if valid else int32(DIGITS)
            for x in range(t, warp_digits, tpb):
                per_warp[x] = 0
            cuda.syncthreads()
            peers = match_any(d)
            rank = cuda.popc(peers & below)
            if valid and rank == 0:
                per_warp[warp * DIGITS + d] = cuda.popc(peers)
            cuda.syncthreads()
            if valid:
                at = base[d] + rank
                for w in range(warp):
                    at += per_warp[w * DIGITS + d]
                keys_out[at] = key
                order_out[at] = int64(i) if first else order_in[i]
            cuda.syncthreads()
            for x in range(t, DIGITS, tpb):
                s = 0
                for w in range(warps):
                    s += per_warp[w * DIGITS + x]
                base[x] += s

    @cuda.jit(device=True)
    def heads_before(keys, n, here, t):
        """Run heads among the thread's ``ITEMS`` consecutive positions of tile ``here``."""
        c = 0
        for k in range(ITEMS):
            i = here * tile + t * ITEMS + k
            if i < n and (i == 0 or keys[i] != keys[i - 1]):
                c += 1
        return c

    @cuda.jit(cache=False)
    def head_counts(keys, n, heads):
        """``heads[tile]``: positions of tile ``tile`` that start a run of the sorted ``keys``."""
        t = cuda.threadIdx.x
        buf = cuda.shared.array(tpb, int32)
        _, total = block_scan(buf, t, heads_before(keys, n, cuda.blockIdx.x, t))
        if t == 0:
            heads[cuda.blockIdx.x] = total

    @cuda.jit(cache=False)
    def runs(keys, n, heads, run, starts, ids, count):
        """Run numbers (1 + distinct index), run bounds, distinct keys and their count,
        ``heads`` holding each tile's first run (the scanned head counts)."""
        t = cuda.threadIdx.x
        here = cuda.blockIdx.x
        buf = cuda.shared.array(tpb, int32)
        before, _ = block_scan(buf, t, heads_before(keys, n, here, t))
        r = heads[here] + before
        for k in range(ITEMS):
            i = here * tile + t * ITEMS + k
            if i < n:
                if i == 0 or keys[i] != keys[i - 1]:
                    starts[r] = i
                    ids[r] = keys[i]
                    r += 1
                run[i] = r
                if i == n - 1:
                    starts[r] = n
                    count[0] = r

    return digit_counts, chunk_sums, scan_rows, scan_chunks, scatter_digits, head_counts, runs


class _Arrays(NamedTuple):
    keys: object  # [2, capacity]: each pass's sorted keys, in turn
    order: object  # [2, capacity] int64: their input positions
    counts: object  # [DIGITS * tiles] int32
    sums: object  # [chunks of the counts] int32
    heads: object  # [tiles] int32
    total: object  # [1] int32
    run: object
    starts: object
    ids: object
    count: object  # [1] int64


class SortSpace:
    """Arrays for grouping ``capacity`` keys of ``key_dtype`` in ``[0, max_key]``,
    allocated once (see the module doc)."""

    def __init__(self, capacity, max_key, key_dtype):
        if capacity < 1 or capacity >= 2**31 - 1:
            raise ValueError(f"capacity must be in [1, 2**31 - 1), got {capacity}")
        self.capacity = int(capacity)
        self.passes = passes_for(max_key)
        self.tpb = threads_per_block()
        self.tiles = -(-self.capacity // (self.tpb * ITEMS))
        self.chunks = -(-DIGITS * self.tiles // (self.tpb * ITEMS))
        xp = _device.xp()
        index = index_dtype(self.capacity)
        self.arrays = _Arrays(
            xp.empty((2, self.capacity), key_dtype), xp.empty((2, self.capacity), np.int64),
            xp.empty(DIGITS * self.tiles, np.int32), xp.empty(self.chunks, np.int32),
            xp.empty(self.tiles, np.int32), xp.empty(1, np.int32),
            xp.empty(self.capacity, index), xp.empty(self.capacity + 1, index),
            xp.empty(self.capacity, key_dtype), xp.empty(1, np.int64))
        out = (self.passes - 1) % 2
        self.grouping = Grouping(self.arrays.order[out], self.arrays.run, self.arrays.starts,
                                 self.arrays.ids, self.arrays.count)
        self._launches = None  # (keys, their prepared launches)

    def group(self, keys):
        """:attr:`grouping` of ``keys`` (``capacity`` keys of the space's dtype, each in
        ``[0, max_key]``), queued on the current stream. The launches of the last keys
        array given are kept, their arguments packed (:func:`._launcher.prepare`)."""
        if self._launches is None or self._launches[0] is not keys:
            self._launches = (keys, self._prepare(keys))
        for run in self._launches[1]:
            run()
        return self.grouping

    def _prepare(self, keys):
        a = self.arrays
        n, tiles, chunks, tpb = self.capacity, self.tiles, self.chunks, self.tpb
        digit_counts, chunk_sums, scan_rows, scan_chunks, scatter_digits, head_counts, runs = (
            radix_kernels(tpb))
        out = []
        source, order = keys, a.order[1]
        for p in range(self.passes):
            shift = p * DIGIT_BITS
            out += [prepare(digit_counts, tiles, tpb, source, n, shift, a.counts, tiles),
                    prepare(chunk_sums, chunks, tpb, a.counts, DIGITS * tiles, a.sums),
                    prepare(scan_rows, 1, tpb, a.sums, 1, chunks, a.total),
                    prepare(scan_chunks, chunks, tpb, a.counts, DIGITS * tiles, a.sums),
                    prepare(scatter_digits, tiles, tpb, source, order, a.keys[p % 2],
                            a.order[p % 2], a.counts, n, shift, tiles, p == 0)]
            source, order = a.keys[p % 2], a.order[p % 2]
        return out + [prepare(head_counts, tiles, tpb, source, n, a.heads),
                      prepare(scan_rows, 1, tpb, a.heads, 1, tiles, a.total),
                      prepare(runs, tiles, tpb, source, n, a.heads, a.run, a.starts, a.ids,
                              a.count)]
