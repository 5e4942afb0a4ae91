"""Pooled lookup of a row-wise quantized table (:class:`hbkernels.QuantizedTable`) on the
CPU: chunks of consecutive bags in a parallel loop, one kernel per ``(D, bits, check_ids)``.

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

from .._modes import Bounds
from ._common import cached_njit, first_bad_offset, kernel_table, prefetch_ids, prefetch_row, widen
from .embedding_bag import NONE, bag_range, combined_scale, first_of_chunks, pool_chunks

NO_WEIGHTS = np.ones(1, np.float32)


@functools.lru_cache(maxsize=None)
def quantized_pool_kernel(dim, bits, check_ids):
    """Kernel ``(codes, scale, bias, values, offsets, weighted, weights, combiner, out)
    -> (bad_id, bad_offset)`` for ``dim`` columns of ``bits``-bit codes (``scale``,
    ``bias`` as their float16 bits); out float32 ``[B, dim]``. Needs ``offsets[0] == 0``
    and ``offsets[-1] == len(values)`` when ``check_ids``."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    width = -(-dim * bits // 8)

    @cached_njit(parallel=True, fastmath=True)
    def pool(codes, scale, bias, values, offsets, weighted, weights, combiner, out):
        num_rows = codes.shape[0]
        num_bags = offsets.shape[0] - 1
        num_chunks = pool_chunks(num_bags)
        last_id = offsets[num_bags] - 1
        distance = prefetch_ids(width)
        first_bad = np.full(num_chunks, NONE, np.int64)
        bad_offset = np.full(num_chunks, NONE, np.int64)
        for c in prange(num_chunks):
            acc = np.empty(dim, np.float32)
            for b in range(c * num_bags // num_chunks, (c + 1) * num_bags // num_chunks):
                lo, hi, ok = bag_range(offsets, b, last_id, check_ids, bad_offset, c)
                if not ok:
                    continue
                for d in range(dim):
                    acc[d] = 0
                w_sum = 0.0
                w_sq = 0.0
                num_good = hi - lo
                for j in range(lo, hi):
                    ahead = values[np.uint64(min(j + distance, last_id))]
                    prefetch_row(codes, min(np.uint64(ahead), np.uint64(num_rows - 1)), width)
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
                    s = w * widen(scale[row])
                    t = w * widen(bias[row])
                    for k in range(width):
                        byte = codes[row, k]
                        for e in range(per_byte):
                            d = k * per_byte + e
                            if d < dim:
                                code = np.float32((byte >> np.uint8(e * bits)) & np.uint8(mask))
                                acc[d] += s * code + t
                if not weighted:
                    w_sum = w_sq = num_good
                factor = np.float32(combined_scale(combiner, w_sum, w_sq))
                for d in range(dim):
                    out[b, d] = acc[d] * factor
        return first_of_chunks(first_bad, bad_offset)

    return pool


def embedding_bag(family, q, values, offsets, per_sample_weights, combiner, bounds,
                  ids_name="values"):
    """``(out float32 [B, D] or None, first bad offset, first bad id)`` (-1: none) of
    the bags of ``values``/``offsets`` over the quantized table ``q`` (the caller raises,
    naming the ids ``ids_name``)."""
    check = bounds != Bounds.UNCHECKED
    n = values.shape[0]
    if check and (offsets[0] != 0 or offsets[-1] != n):
        return None, first_bad_offset(offsets, n), -1
    out = np.empty((offsets.shape[0] - 1, q.dim), np.float32)
    weighted = per_sample_weights is not None
    weights = per_sample_weights.astype(np.float32, copy=False) if weighted else NO_WEIGHTS
    kernel = quantized_pool_kernel(q.dim, q.bits, check)
    bad_id, bad_offset = kernel(q.codes, kernel_table(q.scale), kernel_table(q.bias), values,
                                offsets, weighted, weights, combiner, out)
    if bad_offset != NONE:
        return None, int(bad_offset), -1
    return out, -1, (int(bad_id) if bounds == Bounds.RAISE and bad_id != NONE else -1)
