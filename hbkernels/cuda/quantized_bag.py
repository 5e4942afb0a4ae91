"""Pooled lookup of a row-wise quantized table (:class:`hbkernels.QuantizedTable`) on the
GPU: one kernel, one row group per bag.

Bag ``b`` gives, in float32, ``Σ_j (w_j·scale[r_j])·code[r_j, d] + w_j·bias[r_j]``, then
the combiner's scale, as :mod:`.embedding_bag` does on the dequantized table up to float32
rounding. The table's packed rows hold each row's codes, then its float16 scale and bias as
bytes. A group of ``G`` lanes owns a bag, grid-stride over bags, and reads each row's codes
in units, coalesced, with the scale and bias from the same row:

* words (:func:`quantized_word_kernel`), where a row's codes take a multiple of 4 bytes and
  the rows lie on 4-byte boundaries (:func:`word_rows`): ``G`` the next power of
  two >= the row's words, at most a warp; lane ``l`` reads 32-bit words ``l, l + G, ...`` (a
  pass per ``G`` words: one for D = 128 at 8 bits), the row's last word its scale and bias,
  :data:`.embedding_bag.ROWS_IN_FLIGHT` rows at a time (their loads issued before any is used), and unpacks
  each word's ``32 / bits`` codes into as many float32 accumulators;
* bytes (:func:`quantized_pool_kernel`) otherwise: ``G`` for the row's code bytes, lane ``l``
  reads bytes ``l, l + G, ...`` and unpacks each byte's ``8 / bits`` codes.

Offsets are
clamped to ``[0, len(values)]`` and ids outside the table skipped in every mode; the
checks go to error slots left pending (:mod:`._pending`), as the float forward's: nothing
is read back.
"""
import math

import numpy as np
from numba import cuda

from .._modes import Bounds, Combiner
from .._validate import raise_bad_id, raise_ragged
from . import _pending
from ._launch import (
    blocks_for,
    group_size,
    jit_kernel,
    half_to_float32,
    kernel_factory,
    load_as_float,
    no_error_slots,
    threads_per_block,
)
from ._launcher import launch
from ._vector import data_pointer
from .embedding_bag import ROWS_IN_FLIGHT, bag_range, empty_batch_bad_offset


@cuda.jit(device=True, inline=True)
def half_at(rows, row, col):
    """The float16 stored as bytes ``col``, ``col + 1`` of ``rows[row]`` (little-endian),
    as a float32."""
    return half_to_float32(np.uint32(rows[row, col]) | (np.uint32(rows[row, col + 1]) << 8))


@cuda.jit(device=True, inline=True)
def combiner_factor(combiner, w_sum, w_sq):
    """What a bag's float32 sum is multiplied by: 1 (sum), 1 / Σw (mean), 1 / sqrt(Σw²)
    (sqrtn); 0 where the denominator is 0."""
    if combiner == Combiner.MEAN:
        return np.float32(1) / w_sum if w_sum != 0 else np.float32(0)
    if combiner == Combiner.SQRTN:
        return np.float32(1) / math.sqrt(w_sq) if w_sq != 0 else np.float32(0)
    return np.float32(1)


@kernel_factory
def quantized_pool_kernel(bits, weights_dtype, group):
    """The kernel for ``bits``-bit codes, weights of ``weights_dtype`` (None: no weights),
    ``group`` lanes per bag."""
    per_byte = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    load_weight = load_as_float(weights_dtype or np.dtype(np.float32))
    weighted = weights_dtype is not None

    @cuda.jit(device=True, inline=True)
    def code(byte, e):
        return np.float32((byte >> np.uint8(e * bits)) & mask)

    @jit_kernel(min_blocks_per_sm=2)
    def quantized_pool_kernel(rows, values, offsets, n_values, weights, combiner,
                              check_offsets, record_ids, dim, out, slots):
        num_rows = rows.shape[0]
        width = rows.shape[1] - 4
        num_bags = offsets.shape[0] - 1
        tid = cuda.grid(1)
        lane = tid % group
        for b in range(tid // group, num_bags, cuda.gridsize(1) // group):
            start, end = bag_range(offsets, b, n_values, check_offsets, lane, slots)
            for k0 in range(0, width, group):
                k = k0 + lane
                a0 = np.float32(0)
                a1 = np.float32(0)
                a2 = np.float32(0)
                a3 = np.float32(0)
                w_sum = np.float32(0)
                w_sq = np.float32(0)
                for j in range(start, end):
                    r = values[j]
                    if r < 0 or r >= num_rows:
                        if record_ids and k0 == 0 and lane == 0:
                            cuda.atomic.min(slots, 1, j)
                        continue
                    w = np.float32(load_weight(weights[j])) if weighted else np.float32(1)
                    w_sum += w
                    w_sq += w * w
                    if k < width:
                        s = w * half_at(rows, r, width)
                        t = w * half_at(rows, r, width + 2)
                        byte = rows[r, k]
                        a0 += s * code(byte, 0) + t
                        if per_byte > 1:
                            a1 += s * code(byte, 1) + t
                        if per_byte > 2:
                            a2 += s * code(byte, 2) + t
                            a3 += s * code(byte, 3) + t
                factor = combiner_factor(combiner, w_sum, w_sq)
                d = k * per_byte
                if k < width and d < dim:
                    out[b, d] = a0 * factor
                if per_byte > 1 and k < width and d + 1 < dim:
                    out[b, d + 1] = a1 * factor
                if per_byte > 2 and k < width and d + 2 < dim:
                    out[b, d + 2] = a2 * factor
                if per_byte > 2 and k < width and d + 3 < dim:
                    out[b, d + 3] = a3 * factor

    return quantized_pool_kernel


@kernel_factory
def quantized_word_kernel(bits, weights_dtype, group):
    """The kernel over 32-bit words of codes (``rows`` uint32 ``[E, words + 1]``, the last
    word a row's scale and bias) for ``bits``-bit codes, weights of ``weights_dtype``
    (None: no weights), ``group`` lanes per bag."""
    per_word = 32 // bits
    mask = np.uint32((1 << bits) - 1)
    U = ROWS_IN_FLIGHT
    load_weight = load_as_float(weights_dtype or np.dtype(np.float32))
    weighted = weights_dtype is not None

    @cuda.jit(device=True, inline=True)
    def add_row(acc, word, scale_bias, w):
        s = w * half_to_float32(scale_bias & np.uint32(0xFFFF))
        t = w * half_to_float32(scale_bias >> np.uint32(16))
        for e in range(per_word):
            acc[e] += s * np.float32((word >> np.uint32(e * bits)) & mask) + t

    @jit_kernel(min_blocks_per_sm=2)
    def quantized_word_kernel(rows, values, offsets, n_values, weights, combiner,
                              check_offsets, record_ids, dim, out, slots):
        num_rows = rows.shape[0]
        words = rows.shape[1] - 1
        num_bags = offsets.shape[0] - 1
        tid = cuda.grid(1)
        lane = tid % group
        acc = cuda.local.array(per_word, np.float32)
        word = cuda.local.array(U, np.uint32)
        scale_bias = cuda.local.array(U, np.uint32)
        live = cuda.local.array(U, np.uint8)
        for b in range(tid // group, num_bags, cuda.gridsize(1) // group):
            start, end = bag_range(offsets, b, n_values, check_offsets, lane, slots)
            for k0 in range(0, words, group):
                k = min(k0 + lane, words - 1)  # a lane past the row reads its last word again
                for e in range(per_word):
                    acc[e] = np.float32(0)
                w_sum = np.float32(0)
                w_sq = np.float32(0)
                for j0 in range(start, end, U):
                    for u in range(U):  # every row's loads before any is used, no branch
                        r = values[min(j0 + u, end - 1)]
                        ok = (j0 + u < end) & (r >= 0) & (r < num_rows)
                        at = r if ok else 0
                        word[u] = rows[at, k]
                        scale_bias[u] = rows[at, words]
                        live[u] = ok
                    for u in range(U):
                        j = j0 + u
                        if live[u]:
                            w = np.float32(load_weight(weights[j])) if weighted else np.float32(1)
                            w_sum += w
                            w_sq += w * w
                            add_row(acc, word[u], scale_bias[u], w)
                        elif record_ids and k0 == 0 and lane == 0 and j < end:
                            cuda.atomic.min(slots, 1, j)
                factor = combiner_factor(combiner, w_sum, w_sq)
                if k0 + lane < words:
                    for e in range(per_word):
                        d = (k0 + lane) * per_word + e
                        if d < dim:
                            out[b, d] = acc[e] * factor

    return quantized_word_kernel


def word_rows(q):
    """``q``'s rows as uint32 words ``[E, row words + 1]`` (a view), or None where they
    cannot be read so: a row's code bytes not a multiple of 4, rows not on 4-byte
    boundaries (the array's start or its row stride), rows not contiguous, or no rows."""
    rows = q.rows
    if q.width % 4 or not q.num_rows or data_pointer(rows) % 4 or rows.strides[0] % 4 \
            or rows.strides[1] != 1:
        return None
    return rows.view(np.uint32)


def embedding_bag(family, q, values, offsets, per_sample_weights, combiner, bounds,
                  lookup_ids=None):
    """``(out float32 [B, D], -1, -1)``: one launch; the checks (offsets unless
    ``bounds="unchecked"``, ids under ``"raise"``) are left pending. An empty batch's
    one offset is read back at once. ``lookup_ids``: the ids of a lookup (any shape),
    which ``values`` flattens, one per bag: a bad id is reported as theirs (``ids``),
    else as ``values``'."""
    ids_name, named = ("values", values) if lookup_ids is None else ("ids", lookup_ids)
    n = values.shape[0]
    check = bounds != Bounds.UNCHECKED
    raise_ids = bounds == Bounds.RAISE
    num_bags = offsets.shape[0] - 1
    if num_bags == 0:
        bad_offset = empty_batch_bad_offset(family, offsets, n) if check else -1
        return family.empty((0, q.dim), np.float32), bad_offset, -1
    out = family.empty((num_bags, q.dim), np.float32)
    tpb = threads_per_block()
    weights = per_sample_weights
    weights_dtype = None if weights is None else np.dtype(weights.dtype)
    rows = word_rows(q)
    if rows is not None:
        group = group_size(rows.shape[1] - 1)
        kernel = quantized_word_kernel(q.bits, weights_dtype, group)
    else:
        rows, group = q.rows, group_size(q.width)
        kernel = quantized_pool_kernel(q.bits, weights_dtype, group)

    def report(bad):
        if ids_name == "values":
            raise_ragged(family, values, offsets, bad[0], bad[1] if raise_ids else -1,
                         q.num_rows)
        raise_bad_id(family, ids_name, named, bad[1], q.num_rows)

    k_values = family.kernel_array(values)
    op = "lookup" if ids_name == "ids" else "embedding_bag"
    with _pending.checks(2, op, report, (values, offsets), when=check) as slots:
        launch(kernel, blocks_for(num_bags, tpb // group), tpb, rows, k_values,
               family.kernel_array(offsets), n, k_values if weights is None else weights,
               combiner, check, raise_ids, q.dim, out, no_error_slots() if slots is None else slots)
    return out, -1, -1
