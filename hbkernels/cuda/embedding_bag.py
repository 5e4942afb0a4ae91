"""Pooled lookup on the GPU: one fused kernel, one row group per bag.

Bag ``b`` (ids ``i_j``, weights ``w_j``, ``j`` in ``[offsets[b], offsets[b+1])``)::

    s = Σ w_j·W[i_j]      sum: s      mean: s / Σ w_j      sqrtn: s / sqrt(Σ w_j²)

(a zero denominator gives zeros, so an empty bag gives zeros).

Thread mapping: a row is ``D / V`` vectors of ``V`` elements (:func:`._vector.vector_width`:
16 bytes where ``D`` and the table's alignment allow, else 8, 4, 2 or 1 element). A
group of ``G`` lanes (the next power of two >= ``D / V``, at most a warp; several bags
per warp when ``G < 32``) owns a bag, grid-stride over bags; lane ``l`` accumulates
vectors ``l`` and ``l + G`` of the row (``K = chunks_per_lane`` of them, 1 or 2; wider
rows take further passes over the bag's ids) in registers: fp32 for fp16/bf16/fp32
tables, fp64 for fp64, bf16 read as its bits and rounded back to nearest even.

Ids go by batches of ``max(G, U)`` positions: lane ``l`` reads positions ``l``,
``l + G``, ... of the batch (coalesced, with their weights), checks them and records
the first bad position, and reads the next batch's ids before the current batch's
rows. Then, ``U = ROWS_IN_FLIGHT`` ids at a time, the group broadcasts ids and weights
by warp shuffles (:mod:`._warp`), every lane loads its vectors of the ``U`` rows (no
branch between the loads: a position past the bag's end or a bad id loads row 0 and
its contribution is selected away), then adds them in order.

The same kernel checks its input on the way: offsets are clamped to
``[0, len(values)]`` so malformed CSR never reads out of range, the group's lane 0
records the first malformed offset position in error slot 0 and the lane that read an
out-of-range id its position in slot 1 (``cuda.atomic.min``); out-of-range ids are
always skipped. The slots are read at the next flush of :mod:`._pending` (the op
itself never waits for the device); ``bounds="unchecked"`` records nothing.
"""
import math

import numpy as np
from numba import cuda

from .._modes import Bounds, Combiner
from .._validate import raise_ragged
from . import _device, _pending, _vector
from ._launch import (
    WIDEN,
    accumulator_dtype,
    blocks_for,
    dtype_key,
    jit_kernel,
    kernel_factory,
    load_as_float,
    no_error_slots,
    store_as,
    threads_per_block,
)
from ._launcher import launch
from ._warp import group_mask, shfl_idx

ROWS_IN_FLIGHT = 4  # U: rows whose vectors a lane loads before the first add


def min_blocks(table_dtype, chunks_per_lane):
    """Blocks of 256 threads per SM the register cap (launch bounds) keeps room for: 3
    (80 registers) hold 4 rows x 16 bytes in flight per lane with an fp32 accumulator;
    2 (128 registers) for fp64 accumulators or 2 vectors per lane (sm_90, no spills)."""
    return 3 if chunks_per_lane == 1 and accumulator_dtype(table_dtype) == np.float32 else 2


@cuda.jit(device=True, inline=True)
def check_bag_offsets_at(slots, slot, b, lo, hi, num_bags, n_values):
    """Record bag ``b``'s CSR faults in error slot ``slot``: the first bad position is 0
    for ``offsets[0] != 0``, ``b + 1`` for a decrease, ``B`` for ``offsets[B] != len(values)``."""
    if b == 0 and lo != 0:
        cuda.atomic.min(slots, slot, 0)
    if hi < lo:
        cuda.atomic.min(slots, slot, b + 1)
    if b == num_bags - 1 and hi != n_values:
        cuda.atomic.min(slots, slot, num_bags)


@cuda.jit(device=True, inline=True)
def check_bag_offsets(slots, b, lo, hi, num_bags, n_values):
    """:func:`check_bag_offsets_at` error slot 0."""
    check_bag_offsets_at(slots, 0, b, lo, hi, num_bags, n_values)


@cuda.jit(device=True, inline=True)
def bag_range(offsets, b, n_values, check_offsets, lane, slots):
    """``(start, end)``: bag ``b``'s positions, its offsets clamped to ``[0, n_values]``
    so malformed CSR never reads out of range; with ``check_offsets`` the group's lane 0
    records the bag's CSR faults (:func:`check_bag_offsets`)."""
    lo = offsets[b]
    hi = offsets[b + 1]
    start = min(max(lo, 0), n_values)
    if check_offsets and lane == 0:
        check_bag_offsets(slots, b, lo, hi, offsets.shape[0] - 1, n_values)
    return start, min(max(hi, start), n_values)


def pooling_parts(table_dtype, weights_dtype, width):
    """``(widen, load, load_weight, store, zero)`` of a pooling kernel over a
    ``table_dtype`` table read ``width`` elements at a time, weights of ``weights_dtype``
    (None: none): the accumulator's conversion, the row loader, the weight reader, the
    output's store and the accumulator's zero vector."""
    return (WIDEN[accumulator_dtype(table_dtype)], _vector.loader(table_dtype, width),
            load_as_float(weights_dtype or table_dtype), store_as(table_dtype),
            _vector.zeros(table_dtype, width))


@kernel_factory
def pool_kernel(table_dtype, weights_dtype, width, group, chunks_per_lane, identity, narrow):
    """The pooling kernel for a table of ``table_dtype`` (:func:`dtype_key`), weights of
    ``weights_dtype`` (None: no weights), :func:`._vector.geometry` ``(width, group,
    chunks_per_lane)``; ``identity``: row ``j`` for position ``j`` (no ids);
    ``narrow``: the table has fewer than 2^31 rows (ids travel as int32)."""
    U = ROWS_IN_FLIGHT
    per_lane = max(1, U // group)  # ids a lane reads per batch
    batch = group * per_lane
    two = chunks_per_lane > 1
    widen, load, load_weight, store, zero = pooling_parts(table_dtype, weights_dtype, width)
    weighted = weights_dtype is not None
    row_type = np.int32 if narrow else np.int64

    @cuda.jit(device=True, inline=True)
    def read_id(values, j, end):
        """The raw id at position ``j`` (-1 past ``end``)."""
        if identity:
            return j if j < end else -1
        return values[j] if j < end else -1

    @cuda.jit(device=True, inline=True)
    def read_weight(weights, j, end):
        if weighted and j < end:
            return widen(load_weight(weights[j]))
        return widen(1)

    @cuda.jit(device=True, inline=True)
    def read_batch(values, weights, j, end):
        """A lane's raw ids and weights of a batch: positions ``j + k·G``, ``k < per_lane``
        (the other slots repeat slot 0)."""
        x0 = read_id(values, j, end)
        y0 = read_weight(weights, j, end)
        if per_lane == 1:
            return (x0, x0, x0, x0), (y0, y0, y0, y0)
        x1 = read_id(values, j + group, end)
        y1 = read_weight(weights, j + group, end)
        if per_lane == 2:
            return (x0, x1, x0, x0), (y0, y1, y0, y0)
        return ((x0, x1, read_id(values, j + 2 * group, end), read_id(values, j + 3 * group, end)),
                (y0, y1, read_weight(weights, j + 2 * group, end),
                 read_weight(weights, j + 3 * group, end)))

    @cuda.jit(device=True, inline=True)
    def checked(row, j, end, num_rows, record, slots):
        """``row`` if in range, else -1 (recording position ``j < end`` when ``record``)."""
        if j < end and (row < 0 or row >= num_rows):
            if record:
                cuda.atomic.min(slots, 1, j)
            return row_type(-1)
        return row_type(row)  # -1 past the end

    @cuda.jit(device=True, inline=True)
    def check_batch(xs, j, end, num_rows, record, slots):
        return (checked(xs[0], j, end, num_rows, record, slots),
                checked(xs[1], j + group, end, num_rows, record, slots),
                checked(xs[2], j + 2 * group, end, num_rows, record, slots),
                checked(xs[3], j + 3 * group, end, num_rows, record, slots))

    @cuda.jit(device=True, inline=True)
    def broadcast(mask, first, i, xs):
        """Batch position ``i``'s value: slot ``i // G`` of lane ``i % G`` of the group."""
        x = xs[0]
        if per_lane > 1:  # then i < U: the slot is a constant
            k = i // group
            x = xs[0] if k == 0 else (xs[1] if k == 1 else (xs[2] if k == 2 else xs[3]))
        return shfl_idx(mask, x, first | np.int32(i & (group - 1)))

    @cuda.jit(device=True, inline=True)
    def add_weight(ok, w, w_sum, w_sq):
        if ok:
            return w_sum + w, w_sq + w * w
        return w_sum, w_sq

    @jit_kernel(min_blocks(table_dtype, chunks_per_lane))
    def pool_kernel(table, values, offsets, n_values, weights, combiner, check_offsets,
                    record_ids, out, slots):
        """out[b] = combine_j w_j * table[row_j], row_j = values[j] (or j when ``identity``)."""
        num_rows = table.shape[0]
        vectors = table.shape[1] // width
        num_bags = offsets.shape[0] - 1
        tid = cuda.grid(1)
        lane = tid % group
        first = np.int32(tid % 32 - lane)  # the group's lane 0 in the warp
        mask = group_mask(tid % 32, group)
        for b in range(tid // group, num_bags, cuda.gridsize(1) // group):
            start, end = bag_range(offsets, b, n_values, check_offsets, lane, slots)
            for c0 in range(0, vectors, chunks_per_lane * group):
                ca = c0 + lane
                cb = ca + group
                col_a = ca * width if ca < vectors else 0  # a lane past the row reads vector 0
                col_b = cb * width if cb < vectors else 0
                record = record_ids and c0 == 0
                acc_a = zero
                acc_b = zero
                w_sum = widen(0)
                w_sq = widen(0)
                xs, ys = read_batch(values, weights, start + lane, end)
                for base in range(start, end, batch):
                    rs = check_batch(xs, base + lane, end, num_rows, record, slots)
                    ws = ys
                    # the next batch's ids and weights, in flight during this batch's rows
                    xs, ys = read_batch(values, weights, base + batch + lane, end)
                    n = min(batch, end - base) if num_rows > 0 else 0
                    for t in range(0, n, U):
                        i0 = broadcast(mask, first, t, rs)
                        i1 = broadcast(mask, first, t + 1, rs)
                        i2 = broadcast(mask, first, t + 2, rs)
                        i3 = broadcast(mask, first, t + 3, rs)
                        v0 = broadcast(mask, first, t, ws) if weighted else ws[0]
                        v1 = broadcast(mask, first, t + 1, ws) if weighted else ws[0]
                        v2 = broadcast(mask, first, t + 2, ws) if weighted else ws[0]
                        v3 = broadcast(mask, first, t + 3, ws) if weighted else ws[0]
                        ok0 = i0 >= 0
                        ok1 = i1 >= 0
                        ok2 = i2 >= 0
                        ok3 = i3 >= 0
                        s0 = i0 if ok0 else 0  # a safe row: the table has one (n > 0)
                        s1 = i1 if ok1 else 0
                        s2 = i2 if ok2 else 0
                        s3 = i3 if ok3 else 0
                        e0a = load(table, s0, col_a)
                        e1a = load(table, s1, col_a)
                        e2a = load(table, s2, col_a)
                        e3a = load(table, s3, col_a)
                        e0b = load(table, s0, col_b) if two else zero
                        e1b = load(table, s1, col_b) if two else zero
                        e2b = load(table, s2, col_b) if two else zero
                        e3b = load(table, s3, col_b) if two else zero
                        acc_a = _vector.fma_where(ok0, acc_a, v0, e0a)
                        acc_a = _vector.fma_where(ok1, acc_a, v1, e1a)
                        acc_a = _vector.fma_where(ok2, acc_a, v2, e2a)
                        acc_a = _vector.fma_where(ok3, acc_a, v3, e3a)
                        if two:
                            acc_b = _vector.fma_where(ok0, acc_b, v0, e0b)
                            acc_b = _vector.fma_where(ok1, acc_b, v1, e1b)
                            acc_b = _vector.fma_where(ok2, acc_b, v2, e2b)
                            acc_b = _vector.fma_where(ok3, acc_b, v3, e3b)
                        if combiner != Combiner.SUM:  # the denominators, in position order
                            w_sum, w_sq = add_weight(ok0, v0, w_sum, w_sq)
                            w_sum, w_sq = add_weight(ok1, v1, w_sum, w_sq)
                            w_sum, w_sq = add_weight(ok2, v2, w_sum, w_sq)
                            w_sum, w_sq = add_weight(ok3, v3, w_sum, w_sq)
                scale = widen(1)
                if combiner == Combiner.MEAN:
                    scale = widen(1) / w_sum if w_sum != 0 else widen(0)
                elif combiner == Combiner.SQRTN:
                    scale = widen(1) / math.sqrt(w_sq) if w_sq != 0 else widen(0)
                if ca < vectors:
                    for k in range(width):
                        out[b, col_a + k] = store(acc_a[k] * scale)
                if two and cb < vectors:
                    for k in range(width):
                        out[b, col_b + k] = store(acc_b[k] * scale)

    return pool_kernel


def empty_batch_bad_offset(family, offsets, n_values):
    """First bad offset when ``B == 0``: ``offsets == [x]`` is CSR iff ``x == 0`` and
    there are no values; either failure is at position 0 (reads one element)."""
    if n_values != 0:
        return 0
    return 0 if int(_device.to_host(family.kernel_array(offsets)[:1])[0]) != 0 else -1


def pool(family, table, values, offsets, n_values, weights, combiner, identity, check_offsets,
         record_ids, slots):
    """Launch the pooling kernel: ``out`` ``[B, D]`` in the table's dtype. ``slots``: two
    error slots (first bad offset, first bad id) when ``check_offsets`` or
    ``record_ids``, else None."""
    num_bags = offsets.shape[0] - 1
    dim = table.shape[1]
    out = family.empty((num_bags, dim), table.dtype)
    if num_bags == 0:
        return out
    k_table = family.kernel_array(table)  # ids and offsets are integers: their own kernel arrays
    k_values = offsets if identity else values
    k_weights = k_values if weights is None else family.kernel_array(weights)
    w_dtype = None if weights is None else weights.dtype
    key = (table.dtype, w_dtype, bool(identity), table.shape[0] < 2**31, dim,
           table.shape[0] <= 1, k_table.strides, _vector.data_pointer(k_table) % _vector.VECTOR_BYTES)
    plan = _PLANS.get(key)
    if plan is None:
        width, group, chunks_per_lane = _vector.geometry(k_table)
        tpb = threads_per_block()
        plan = _PLANS[key] = (pool_kernel(dtype_key(table.dtype), dtype_key(w_dtype), width, group,
                                          chunks_per_lane, bool(identity), table.shape[0] < 2**31),
                              tpb // group, tpb)
    kernel, bags_per_block, tpb = plan
    launch(kernel, blocks_for(num_bags, bags_per_block), tpb,
           k_table, k_values, offsets, n_values, k_weights, combiner, check_offsets, record_ids,
           out if k_table is table else family.kernel_array(out),
           no_error_slots() if slots is None else slots)
    return out


_PLANS = {}  # what pool's kernel and geometry depend on -> (kernel, bags per block, threads)


def embedding_bag(family, weights, values, offsets, per_sample_weights, combiner, bounds):
    """One launch; the checks (offsets unless ``bounds="unchecked"``, ids under
    ``"raise"``) are left pending (:mod:`._pending`): nothing is read back."""
    n_values = values.shape[0]
    check = bounds != Bounds.UNCHECKED
    raise_ids = bounds == Bounds.RAISE
    if offsets.shape[0] == 1:
        bad_offset = empty_batch_bad_offset(family, offsets, n_values) if check else -1
        return family.empty((0, weights.shape[1]), weights.dtype), bad_offset, -1
    num_rows = weights.shape[0]

    def report(bad):
        raise_ragged(family, values, offsets, bad[0], bad[1] if raise_ids else -1, num_rows)

    with _pending.checks(2, "embedding_bag", report, (values, offsets), when=check) as slots:
        out = pool(family, weights, values, offsets, n_values, per_sample_weights, combiner,
                   False, check, raise_ids, slots)
    return out, -1, -1
