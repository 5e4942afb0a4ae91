"""The runs of keys in sorted order, found on the device with no library call: each
sorted position's run number (1 + the distinct index of its key), the runs' bounds,
their keys and their count.

The sorted positions are cut into *tiles* of ``ITEMS`` positions per thread of a block.
Keys up to one tile take one launch (:func:`find_runs`: ``runs`` alone; or none, where a
kernel numbers them itself with :func:`tile_runs`); more take three:
``head_counts`` (each tile's run heads: a key unlike the one before it), ``scan_rows``
(those counts scanned by one block) and ``runs`` (each tile numbers its heads from its
scanned count). The key at sorted position ``i`` is ``keys[order[i]]``.

``block_scan`` and ``scan_rows`` also serve :mod:`.radix_sort`'s digit counts.
"""
import functools

import numpy as np
from numba import cuda, int32

from . import _device
from ._launch import inline_device, kernel_factory, threads_per_block
from ._launcher import launch

ITEMS = 8  # sorted positions per thread of a tile


def index_dtype(n):
    """Positions and run numbers of ``n`` items: int32 when they fit."""
    return np.dtype(np.int32) if n < 2**31 - 1 else np.dtype(np.int64)


@inline_device
def run_starts_at(keys, order, first, i):
    """Whether sorted position ``i`` (at least ``first``) starts a run among the sorted
    positions from ``first``: ``i == first`` or its key (``keys[order[i]]``) differs from
    the one before it."""
    return i == first or keys[order[i]] != keys[order[i - 1]]


@kernel_factory
def scan_kernels(tpb):
    """``(block_scan, scan_rows)`` for blocks of ``tpb`` threads: a device function
    scanning one value per thread, and a kernel scanning rows of counts in place."""

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

    return block_scan, scan_rows


@functools.lru_cache(maxsize=None)
def _heads_before(tpb):
    """Device function ``heads_before(keys, order, n, here, t)``: the run heads among
    thread ``t``'s ``ITEMS`` consecutive positions of tile ``here`` (``tpb`` threads)."""
    tile = tpb * ITEMS

    @cuda.jit(device=True)
    def heads_before(keys, order, n, here, t):
        c = 0
        for k in range(ITEMS):
            i = here * tile + t * ITEMS + k
            if i < n and run_starts_at(keys, order, 0, i):
                c += 1
        return c

    return heads_before


@kernel_factory
def run_kernels(tpb):
    """``(head_counts, runs)`` for blocks of ``tpb`` threads (see the module doc)."""
    tile = tpb * ITEMS
    block_scan = scan_kernels(tpb)[0]
    heads_before = _heads_before(tpb)

    @cuda.jit(cache=False)
    def head_counts(keys, order, n, heads):
        """``heads[tile]``: the sorted positions of tile ``tile`` that start a run."""
        t = cuda.threadIdx.x
        buf = cuda.shared.array(tpb, int32)
        _, total = block_scan(buf, t, heads_before(keys, order, n, cuda.blockIdx.x, t))
        if t == 0:
            heads[cuda.blockIdx.x] = total

    @cuda.jit(cache=False)
    def runs(keys, order, n, heads, run, starts, ids, count):
        """Run numbers, run bounds, distinct keys and their count (``count[0]``; the first
        key too, in ``count[1]``, where ``count`` has two entries), ``heads`` holding each
        tile's first run (the scanned head counts; empty: one tile, from run 0). An empty
        ``run`` or ``ids`` is not written."""
        t = cuda.threadIdx.x
        here = cuda.blockIdx.x
        buf = cuda.shared.array(tpb, int32)
        before, _ = block_scan(buf, t, heads_before(keys, order, n, here, t))
        r = (heads[here] if heads.shape[0] != 0 else 0) + before
        for k in range(ITEMS):
            i = here * tile + t * ITEMS + k
            if i < n:
                if run_starts_at(keys, order, 0, i):
                    starts[r] = i
                    if ids.shape[0] != 0:
                        ids[r] = keys[order[i]]
                    if i == 0 and count.shape[0] > 1:
                        count[1] = keys[order[i]]
                    r += 1
                if run.shape[0] != 0:
                    run[i] = r
                if i == n - 1:
                    starts[r] = n
                    count[0] = r

    return head_counts, runs


@functools.lru_cache(maxsize=None)
def tile_runs(tpb):
    """Device function ``tile_runs(keys, order, n, starts) -> count``: the run starts of
    the ``n <= tpb · ITEMS`` sorted positions (one tile) into ``starts`` (``count + 1``
    bounds, the last ``n``; a block's shared array), numbered by the calling block alone;
    every thread of the block calls it and gets the count once every bound is written."""
    block_scan = scan_kernels(tpb)[0]
    heads_before = _heads_before(tpb)

    @cuda.jit(device=True)
    def tile_runs(keys, order, n, starts):
        t = cuda.threadIdx.x
        buf = cuda.shared.array(tpb, int32)
        r, total = block_scan(buf, t, heads_before(keys, order, n, 0, t))
        for k in range(ITEMS):
            i = t * ITEMS + k
            if i < n and run_starts_at(keys, order, 0, i):
                starts[r] = i
                r += 1
        if t == 0:
            starts[total] = n
        cuda.syncthreads()
        return total

    return tile_runs


def tiles_of(n, tpb):
    """Tiles of ``n`` sorted positions in blocks of ``tpb`` threads."""
    return -(-n // (tpb * ITEMS))


def find_runs(keys, order, run, starts, ids, count):
    """Queue the launches writing ``run``, ``starts``, ``ids`` and ``count`` (int64: the
    count, then the first key where it has a second entry) of the ``order.shape[0] >= 1``
    keys ``keys`` in the order ``order`` (see the module doc; ``run`` and ``ids`` may be
    empty: not written)."""
    n = order.shape[0]
    tpb = threads_per_block()
    tiles = tiles_of(n, tpb)
    head_counts, runs = run_kernels(tpb)
    if tiles == 1:
        heads = _device.scratch(0, np.int32)
    else:
        heads = _device.scratch(tiles + 1, index_dtype(n))  # the total last
        launch(head_counts, tiles, tpb, keys, order, n, heads)
        launch(scan_kernels(tpb)[1], 1, tpb, heads, 1, tiles, heads[tiles:])
    launch(runs, tiles, tpb, keys, order, n, heads, run, starts, ids, count)
