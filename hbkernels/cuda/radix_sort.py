"""Stable sort of non-negative integer keys in memory allocated once, in launches whose
number and shapes depend only on the capacity and the largest key: the sort a step
captured in a CUDA graph takes (no allocation, no library call, no host read).

A :class:`SortSpace` holds every array the sort writes, for ``capacity`` keys at most
``max_key``. :meth:`SortSpace.sort` gives the positions ``0..capacity-1`` of a key array
sorted stably by key (int64), as :func:`._segments.stable_argsort` gives them, bit for
bit.

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

``5 * passes`` launches in all.
"""
from typing import NamedTuple

import numpy as np
from numba import cuda, int32, int64, uint32

from . import _device
from ._launch import WARP, kernel_factory, threads_per_block
from ._launcher import prepare
from ._runs import ITEMS, scan_kernels, tiles_of
from ._warp import match_any

DIGIT_BITS = 8
DIGITS = 1 << DIGIT_BITS


def passes_for(max_key):
    """Passes of ``DIGIT_BITS`` bits that sort keys in ``[0, max_key]``."""
    return max(1, -(-int(max_key).bit_length() // DIGIT_BITS))


@kernel_factory
def radix_kernels(tpb):
    """``(digit_counts, chunk_sums, scan_chunks, scatter_digits)`` for blocks of ``tpb``
    threads (a multiple of the warp dividing ``DIGITS``)."""
    warps = tpb // WARP
    tile = tpb * ITEMS
    warp_digits = warps * DIGITS  # (a shared array's size: a constant of the closure)

    block_scan = scan_kernels(tpb)[0]

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

    return digit_counts, chunk_sums, scan_chunks, scatter_digits


class _Arrays(NamedTuple):
    keys: object  # [2, capacity]: each pass's sorted keys, in turn
    order: object  # [2, capacity] int64: their input positions
    counts: object  # [DIGITS * tiles] int32
    sums: object  # [chunks of the counts] int32
    total: object  # [1] int32


class SortSpace:
    """Arrays for sorting ``capacity`` keys of ``key_dtype`` in ``[0, max_key]``,
    allocated once (see the module doc)."""

    def __init__(self, capacity, max_key, key_dtype):
        if capacity < 1 or capacity >= 2**31 - 1:
            raise ValueError(f"capacity must be in [1, 2**31 - 1), got {capacity}")
        self.capacity = int(capacity)
        self.passes = passes_for(max_key)
        self.tpb = threads_per_block()
        self.tiles = tiles_of(self.capacity, self.tpb)
        self.chunks = -(-DIGITS * self.tiles // (self.tpb * ITEMS))
        xp = _device.xp()
        self.arrays = _Arrays(
            xp.empty((2, self.capacity), key_dtype), xp.empty((2, self.capacity), np.int64),
            xp.empty(DIGITS * self.tiles, np.int32), xp.empty(self.chunks, np.int32),
            xp.empty(1, np.int32))
        self.order = self.arrays.order[(self.passes - 1) % 2]
        self._launches = None  # (keys, their prepared launches)

    def sort(self, keys):
        """:attr:`order`, the positions of ``keys`` (``capacity`` keys of the space's dtype,
        each in ``[0, max_key]``) sorted stably by key, queued on the current stream. The
        launches of the last keys array given are kept, their arguments packed
        (:func:`._launcher.prepare`)."""
        if self._launches is None or self._launches[0] is not keys:
            self._launches = (keys, self._prepare(keys))
        for run in self._launches[1]:
            run()
        return self.order

    def _prepare(self, keys):
        a = self.arrays
        n, tiles, chunks, tpb = self.capacity, self.tiles, self.chunks, self.tpb
        digit_counts, chunk_sums, scan_chunks, scatter_digits = radix_kernels(tpb)
        scan_rows = scan_kernels(tpb)[1]
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
        return out
