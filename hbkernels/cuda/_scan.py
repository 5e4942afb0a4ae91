"""Shared device primitives: exclusive prefix sum, stable bucket scatter, LSD radix sort.

Everything here uses shared memory and ``cuda.syncthreads`` only (no warp
shuffles), so it also runs in Numba's CUDA simulator. Kernels loop over tiles
and chunks grid-stride, so any grid size is correct; every thread of a block
runs the same number of loop trips, so each barrier is reached by all of them.

* :func:`exclusive_scan`: ``a[i] <- Σ_{j<i} a[j]`` in place. Each tile of
  ``T·I`` elements (``T`` threads, ``I`` items per thread) is scanned in
  shared memory (per-thread serial sums, then a Hillis-Steele scan of the
  ``T`` thread totals); the tile totals are scanned recursively and added back:
  ``scan(a)[t·T·I + k] = scan(totals)[t] + scan_in_tile(a)[t·T·I + k]``.
* :func:`bucket_scatter`: a stable counting sort by bucket. The input is cut
  into ``C`` chunks; ``M[b·C + c]`` counts bucket ``b`` in chunk ``c``
  (bucket-major), ``S = exclusive_scan(M)``, and element ``i`` of chunk ``c``
  in bucket ``b`` lands at ``S[b·C + c] + #{j < i in chunk c : bucket j = b}``,
  which is exactly its position in a stable sort by bucket. No atomics: the
  in-tile rank is counted by comparing against the tile in shared memory, so
  the result is deterministic.
* :func:`radix_sort`: LSD radix sort of ``(key, value)`` pairs by 4-bit
  digits of ``key - lo`` (as uint64, which maps signed order to unsigned
  order), one stable :func:`bucket_scatter` per digit.
"""
import math

import numpy as np
from numba import cuda, int64, uint64

from .._dispatch import simulator_enabled
from ._launch import blocks_for, fill, kernel_factory, threads_per_block

RADIX_BITS = 4
RADIX = 1 << RADIX_BITS


def _items_per_thread():
    return 2 if simulator_enabled() else 4


# ---------------------------------------------------------------------------
# exclusive prefix sum
# ---------------------------------------------------------------------------
@kernel_factory
def _scan_kernels(tpb, items):
    tile = tpb * items

    @cuda.jit
    def block_scan(a, sums, n):
        """Exclusive scan of each tile of ``a`` in place; tile totals to ``sums``."""
        buf = cuda.shared.array(tile, int64)
        part = cuda.shared.array(tpb, int64)
        tid = cuda.threadIdx.x
        num_tiles = (n + tile - 1) // tile
        for t in range(cuda.blockIdx.x, num_tiles, cuda.gridDim.x):
            base = t * tile
            for k in range(items):  # coalesced load
                idx = base + k * tpb + tid
                buf[k * tpb + tid] = a[idx] if idx < n else 0
            cuda.syncthreads()
            run = 0
            for k in range(items):  # this thread's run buf[tid·I : (tid+1)·I]
                run += buf[tid * items + k]
            part[tid] = run
            cuda.syncthreads()
            offset = 1
            while offset < tpb:  # Hillis-Steele inclusive scan of the thread totals
                v = part[tid - offset] if tid >= offset else 0
                cuda.syncthreads()
                part[tid] += v
                cuda.syncthreads()
                offset *= 2
            acc = part[tid] - run  # exclusive prefix of this thread's run
            for k in range(items):
                v = buf[tid * items + k]
                buf[tid * items + k] = acc
                acc += v
            cuda.syncthreads()
            for k in range(items):  # coalesced store
                idx = base + k * tpb + tid
                if idx < n:
                    a[idx] = buf[k * tpb + tid]
            if tid == 0:
                sums[t] = part[tpb - 1]
            cuda.syncthreads()  # buf and part are reused by the next tile

    @cuda.jit
    def add_tile_offsets(a, offsets, n):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for i in range(start + tile, n, step):  # tile 0 has offset 0
            a[i] += offsets[i // tile]

    return block_scan, add_tile_offsets


def exclusive_scan(a, stream=0, tpb=None, items=None):
    """In place ``a[i] <- Σ_{j<i} a[j]`` of a 1-D int64 device array.

    Append a zero to get the total: the scan of ``[x_0 .. x_{n-1}, 0]`` ends
    with ``Σ x``. ``tpb``/``items`` override the tile shape (tests).
    """
    n = a.shape[0]
    if n == 0:
        return
    tpb = tpb or threads_per_block()
    items = items or _items_per_thread()
    block_scan, add_offsets = _scan_kernels(tpb, items)
    tile = tpb * items
    num_tiles = (n + tile - 1) // tile
    sums = cuda.device_array(num_tiles, np.int64, stream=stream)
    block_scan[blocks_for(num_tiles, 1), tpb, stream](a, sums, n)
    if num_tiles > 1:
        exclusive_scan(sums, stream, tpb, items)
        add_offsets[blocks_for(n - tile, tpb), tpb, stream](a, sums, n)


# ---------------------------------------------------------------------------
# stable bucket scatter
# ---------------------------------------------------------------------------
@kernel_factory
def _bucket_kernels(tpb):
    @cuda.jit(device=True)
    def _rank_in_tile(sh, tid, width):
        """(# earlier, # later) elements of the tile with the bucket of ``tid``."""
        b = sh[tid]
        before = 0
        after = 0
        for k in range(width):
            if sh[k] == b:
                if k < tid:
                    before += 1
                elif k > tid:
                    after += 1
        return before, after

    @cuda.jit
    def count_chunks(bkt, mat, n, num_chunks, chunk_len):
        """``mat[b·C + c] += #{i in chunk c : bkt[i] = b}`` (``mat`` zeroed)."""
        sh = cuda.shared.array(tpb, int64)
        tid = cuda.threadIdx.x
        for c in range(cuda.blockIdx.x, num_chunks, cuda.gridDim.x):
            lo = c * chunk_len
            hi = min(lo + chunk_len, n)
            for t0 in range(lo, hi, tpb):
                i = t0 + tid
                width = min(tpb, hi - t0)
                if i < hi:
                    sh[tid] = bkt[i]
                cuda.syncthreads()
                if i < hi:
                    before, after = _rank_in_tile(sh, tid, width)
                    if after == 0:  # the tile's last element of its bucket adds the count
                        mat[sh[tid] * num_chunks + c] += before + 1
                cuda.syncthreads()

    @cuda.jit
    def scatter_chunks(bkt, start, n, num_chunks, chunk_len,
                       keys, vals, use_iota, out_keys, out_vals):
        """Element ``i`` -> ``start[b·C + c] + rank``; ``start`` advances per tile."""
        sh = cuda.shared.array(tpb, int64)
        tid = cuda.threadIdx.x
        for c in range(cuda.blockIdx.x, num_chunks, cuda.gridDim.x):
            lo = c * chunk_len
            hi = min(lo + chunk_len, n)
            for t0 in range(lo, hi, tpb):
                i = t0 + tid
                width = min(tpb, hi - t0)
                if i < hi:
                    sh[tid] = bkt[i]
                cuda.syncthreads()
                before = 0
                after = 1
                cell = 0
                base = 0
                if i < hi:
                    before, after = _rank_in_tile(sh, tid, width)
                    cell = sh[tid] * num_chunks + c
                    base = start[cell]
                    pos = base + before
                    out_keys[pos] = keys[i]
                    if use_iota:
                        out_vals[pos] = i
                    else:
                        out_vals[pos] = vals[i]
                cuda.syncthreads()  # every read of start[cell] happens before the update
                if i < hi and after == 0:
                    start[cell] = base + before + 1
                cuda.syncthreads()

    @cuda.jit
    def bucket_totals(start, num_buckets, num_chunks, counts):
        """``counts[b] = S[(b+1)·C] - S[b·C]`` (``S`` has ``B·C + 1`` entries)."""
        begin, step = cuda.grid(1), cuda.gridsize(1)
        for b in range(begin, num_buckets, step):
            counts[b] = start[(b + 1) * num_chunks] - start[b * num_chunks]

    return count_chunks, scatter_chunks, bucket_totals


def _chunking(n, num_buckets, tpb, budget):
    """(chunk_len, num_chunks): chunks of whole tiles, ``B·C`` kept near ``budget``."""
    tiles = (n + tpb - 1) // tpb
    max_chunks = max(1, budget // num_buckets)
    tiles_per_chunk = max(1, -(-tiles // max_chunks))
    num_chunks = -(-tiles // tiles_per_chunk)
    return tiles_per_chunk * tpb, num_chunks


def bucket_scatter(bkt, num_buckets, keys, out_keys, out_vals, vals=None,
                   counts=None, stream=0, budget=None):
    """Stable sort by bucket: ``out_keys[p(i)] = keys[i]``, ``out_vals[p(i)] = vals[i]``
    (``i`` itself when ``vals`` is None), where ``p(i)`` is ``i``'s position when
    the elements are ordered by ``bkt[i]`` (int64 in ``[0, num_buckets)``), ties
    in input order. ``counts`` (int64 ``[num_buckets]``), if given, gets the
    bucket sizes. ``budget`` bounds the count-matrix size (default ``max(2^20, 2n)``).
    """
    n = bkt.shape[0]
    if n == 0:
        if counts is not None:
            fill(counts, 0, stream)
        return
    tpb = threads_per_block()
    count_chunks, scatter_chunks, bucket_totals = _bucket_kernels(tpb)
    budget = budget or max(1 << 20, 2 * n)
    chunk_len, num_chunks = _chunking(n, num_buckets, tpb, budget)
    cells = num_buckets * num_chunks
    mat = cuda.device_array(cells + 1, np.int64, stream=stream)
    fill(mat, 0, stream)
    grid = blocks_for(num_chunks, 1)
    count_chunks[grid, tpb, stream](bkt, mat, n, num_chunks, chunk_len)
    exclusive_scan(mat, stream)
    if counts is not None:
        bucket_totals[blocks_for(num_buckets, tpb), tpb, stream](
            mat, num_buckets, num_chunks, counts
        )
    use_iota = vals is None
    scatter_chunks[grid, tpb, stream](
        bkt, mat, n, num_chunks, chunk_len,
        keys, out_vals if use_iota else vals, use_iota, out_keys, out_vals,
    )


# ---------------------------------------------------------------------------
# LSD radix sort
# ---------------------------------------------------------------------------
_SIGN = np.uint64(1 << 63)
_DIGIT_MASK = np.uint64(RADIX - 1)


@cuda.jit
def _digits(keys, lo, shift, bkt):
    """``bkt[i] = ((u(key_i) - u(lo)) >> shift) & (RADIX - 1)``, ``u(x) = x ^ 2^63`` as uint64.

    ``u`` maps signed order onto unsigned order, so ``u(key) - u(lo)`` equals
    ``key - lo`` and never wraps (keys are ``>= lo``).
    """
    start, step = cuda.grid(1), cuda.gridsize(1)
    ulo = uint64(int64(lo)) ^ _SIGN
    ushift = uint64(shift)
    for i in range(start, keys.shape[0], step):
        u = uint64(int64(keys[i])) ^ _SIGN
        bkt[i] = int64(((u - ulo) >> ushift) & _DIGIT_MASK)


def radix_passes(lo, hi):
    """4-bit passes to sort keys in ``[lo, hi]`` by ``key - lo`` (Python ints)."""
    return math.ceil((int(hi) - int(lo)).bit_length() / RADIX_BITS)


def radix_sort(keys, vals, out_keys, out_vals, lo, hi, stream=0):
    """Stable sort of ``(keys, vals)`` by key into ``(out_keys, out_vals)``.

    ``lo <= key <= hi`` for every key (host ints); ``ceil(bits(hi - lo) / 4)``
    passes, each a stable :func:`bucket_scatter` on one 4-bit digit of
    ``key - lo`` taken as uint64 (so signed order becomes unsigned order).
    The inputs are used as ping-pong scratch and are clobbered.
    """
    n = keys.shape[0]
    passes = radix_passes(lo, hi)
    if n == 0:
        return
    if passes == 0:
        out_keys.copy_to_device(keys, stream=stream)
        out_vals.copy_to_device(vals, stream=stream)
        return
    tpb = threads_per_block()
    bkt = cuda.device_array(n, np.int64, stream=stream)
    # ping-pong so that the last pass writes into (out_keys, out_vals)
    bufs = [(keys, vals), (out_keys, out_vals)]
    src = 0 if passes % 2 == 1 else 1
    if src == 1:
        out_keys.copy_to_device(keys, stream=stream)
        out_vals.copy_to_device(vals, stream=stream)
    for p in range(passes):
        k_in, v_in = bufs[src]
        k_out, v_out = bufs[1 - src]
        _digits[blocks_for(n, tpb), tpb, stream](k_in, int(lo), p * RADIX_BITS, bkt)
        bucket_scatter(bkt, RADIX, k_in, k_out, v_out, vals=v_in, stream=stream)
        src = 1 - src
