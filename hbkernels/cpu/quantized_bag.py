"""Pooled lookup of a row-wise quantized table (:class:`hbkernels.QuantizedTable`) on the
CPU: chunks of consecutive bags in a parallel loop, one kernel per ``(D, bits, check_ids)``,
reading the table's packed rows (codes, then the float16 scale and bias as bytes: one run
of memory per id, prefetched as the float kernels prefetch rows).

Bag ``b`` gives, in float32, ``Σ_j (w_j·scale[r_j])·code[r_j, d] + w_j·bias[r_j]``
(``r_j = values[j]``, ``w_j`` the per-sample weight or 1), then the combiner's
scale, as :func:`hbkernels.embedding_bag` on the dequantized table up to float32
rounding. A row's codes are read byte by byte and each byte's ``8 / bits`` codes
unpacked in registers; with D and bits compile-time constants the loops unroll.
Ids and offsets are checked as the float kernels check them
(:mod:`.embedding_bag`): a decreasing bag is skipped and flagged, a bad id is
skipped and the first bad position of each chunk kept.
"""
import functools

import numpy as np
from numba import prange
from numba.extending import register_jitable

from .._modes import Bounds

from ._common import (
    cached_njit,
    first_bad_offset,
    prefetch_ids,
    prefetch_row,
    scratch_row,
    widen,
)
from .embedding_bag import NONE, bag_range, combined_scale, first_of_chunks, pool_chunks

NO_WEIGHTS = np.ones(1, np.float32)


@functools.lru_cache(maxsize=None)
def row_adders(dim, bits):
    """``(add, store)`` for ``dim`` columns of ``bits``-bit codes, accumulated in a row
    ``acc`` in *planar* order: code ``e`` of byte ``k`` (column ``k·P + e``, ``P = 8 /
    bits`` codes a byte) at ``acc[e·F + k]`` for the ``F = dim // P`` full bytes, then a
    last byte's codes; each ``e`` is then one loop over consecutive bytes, which LLVM
    turns into vectors (int8: ``acc`` in column order, 16 codes widened at a time).

    * ``add(acc, codes, row, s)``: ``acc += s * code[row]``;
    * ``store(out, b, acc, shift, factor)``: ``out[b, column] = (acc + shift) * factor``,
      back in column order."""
    per_byte = 8 // bits
    full = dim // per_byte
    mask = np.uint8((1 << bits) - 1)

    @register_jitable(inline="always")
    def add(acc, codes, row, s):
        for k in range(full):
            byte = codes[row, np.uint64(k)]
            for e in range(per_byte):  # unrolled: P streams of consecutive acc elements
                acc[e * full + k] += s * np.float32((byte >> np.uint8(e * bits)) & mask)
        for e in range(dim - full * per_byte):  # the last byte's columns
            byte = codes[row, np.uint64(full)]
            acc[per_byte * full + e] += s * np.float32((byte >> np.uint8(e * bits)) & mask)

    @register_jitable(inline="always")
    def store(out, b, acc, shift, factor):
        for e in range(per_byte):
            for k in range(full):
                out[b, k * per_byte + e] = (acc[e * full + k] + shift) * factor
        for e in range(per_byte * full, dim):
            out[b, e] = (acc[e] + shift) * factor

    return add, store


@register_jitable(inline="always")
def half_at(rows, row, col):
    """The float16 stored as bytes ``col``, ``col + 1`` of ``rows[row]`` (little-endian),
    as a float32."""
    low = np.uint32(rows[row, np.uint64(col)])
    high = np.uint32(rows[row, np.uint64(col + 1)])
    return widen(np.uint16(low | (high << np.uint32(8))))


@functools.lru_cache(maxsize=None)
def quantized_pool_kernel(dim, bits, check_ids):
    """Kernel ``(rows, values, offsets, weighted, weights, combiner, out) -> (bad_id,
    bad_offset)`` for ``dim`` columns of ``bits``-bit codes in packed rows (uint8 ``[E,
    width + 4]``); out float32 ``[B, dim]``. A bag sums ``(w·scale)·code`` per column in a
    stack row and ``w·bias`` once, adding it at the end. Needs ``offsets[0] == 0`` and
    ``offsets[-1] == len(values)`` when ``check_ids``."""
    width = -(-dim * bits // 8)
    add, store = row_adders(dim, bits)

    @cached_njit(parallel=True, fastmath=True)
    def pool(rows, values, offsets, weighted, weights, combiner, out):
        num_rows = rows.shape[0]
        num_bags = offsets.shape[0] - 1
        num_chunks = pool_chunks(num_bags)
        last_id = offsets[num_bags] - 1
        distance = prefetch_ids(width + 4)
        first_bad = np.full(num_chunks, NONE, np.int64)
        bad_offset = np.full(num_chunks, NONE, np.int64)
        for c in prange(num_chunks):
            for b in range(c * num_bags // num_chunks, (c + 1) * num_bags // num_chunks):
                lo, hi, ok = bag_range(offsets, b, last_id, check_ids, bad_offset, c)
                if not ok:
                    continue
                acc = scratch_row(dim, out, b)
                for d in range(dim):
                    acc[d] = 0
                biases = np.float32(0)
                w_sum = 0.0
                w_sq = 0.0
                num_good = hi - lo
                for j in range(lo, hi):
                    ahead = min(np.uint64(values[np.uint64(min(j + distance, last_id))]),
                                np.uint64(num_rows - 1))
                    prefetch_row(rows, ahead, width + 4)
                    row = np.uint64(values[np.uint64(j)])
                    if check_ids and row >= np.uint64(num_rows):  # negatives wrap high
                        if first_bad[c] == NONE:
                            first_bad[c] = j
                        num_good -= 1
                        continue
                    w = np.float32(1.0)
                    if weighted:
                        w = weights[np.uint64(j)]
                        w_sum += w
                        w_sq += w * w
                    biases += w * half_at(rows, row, width + 2)
                    add(acc, rows, row, w * half_at(rows, row, width))
                if not weighted:
                    w_sum = w_sq = num_good
                store(out, b, acc, biases, np.float32(combined_scale(combiner, w_sum, w_sq)))
        return first_of_chunks(first_bad, bad_offset)

    return pool


def embedding_bag(family, q, values, offsets, per_sample_weights, combiner, bounds,
                  lookup_ids=None):
    """``(out float32 [B, D] or None, first bad offset, first bad id)`` (-1: none) of
    the bags of ``values``/``offsets`` over the quantized table ``q`` (the caller raises;
    ``lookup_ids``: the ids of a lookup that ``values`` flattens, as the GPU takes them)."""
    check = bounds != Bounds.UNCHECKED
    n = values.shape[0]
    if check and (offsets[0] != 0 or offsets[-1] != n):
        return None, first_bad_offset(offsets, n), -1
    out = np.empty((offsets.shape[0] - 1, q.dim), np.float32)
    weighted = per_sample_weights is not None
    weights = per_sample_weights.astype(np.float32, copy=False) if weighted else NO_WEIGHTS
    kernel = quantized_pool_kernel(q.dim, q.bits, check)
    bad_id, bad_offset = kernel(q.rows, values, offsets, weighted, weights, combiner, out)
    if bad_offset != NONE:
        return None, int(bad_offset), -1
    return out, -1, (int(bad_id) if bounds == Bounds.RAISE and bad_id != NONE else -1)
