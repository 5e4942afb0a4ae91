"""Pooled lookup on the GPU: one fused kernel, one row group per bag.

Bag ``b`` (ids ``i_j``, weights ``w_j``, ``j`` in ``[offsets[b], offsets[b+1])``)::

    s = Σ w_j·W[i_j]      sum: s      mean: s / Σ w_j      sqrtn: s / sqrt(Σ w_j²)

(a zero denominator gives zeros, so an empty bag gives zeros).

Thread mapping: a group of ``G = group_size(D)`` lanes (a warp, or a power-of-two
slice of one when ``D < 32``, several bags per warp) owns a bag, grid-stride over
bags. Lane ``d`` accumulates columns ``d, d+G, d+2G, d+3G`` in registers (fp32
for fp16/bf16/fp32 tables, fp64 for fp64; bf16 is read as its int16 bits and
rounded back to nearest even), so each table row is read coalesced; wider
rows take further passes over the bag's ids. A lane's loads of one row have no
branch between them (:func:`._launch.column_reader`), so they are all in flight
before the first multiply-add waits. No atomics touch the output and
no warp shuffles are used, so the kernel runs unchanged in Numba's simulator.

The same kernel checks its input on the way: offsets are clamped to
``[0, len(values)]`` so malformed CSR never reads out of range, lane 0 records
the first malformed offset position in error slot 0 and the first out-of-range
id in slot 1 (``cuda.atomic.min``), and out-of-range ids are always skipped.
The slots are read back once, except under ``bounds="unchecked"`` (no host sync).
"""
import math

from numba import cuda

from . import _device
from ._launch import (
    UNROLL,
    WIDEN,
    accumulator_dtype,
    blocks_for,
    column_reader,
    columns_per_lane,
    dtype_key,
    error_slots,
    group_size,
    kernel_factory,
    load_as_float,
    no_error_slots,
    read_error_slots,
    store_as,
    threads_per_block,
)


@cuda.jit(device=True, inline=True)
def check_bag_offsets(slots, b, lo, hi, num_bags, n_values):
    """Record bag ``b``'s CSR faults in error slot 0: the first bad position is 0 for
    ``offsets[0] != 0``, ``b + 1`` for a decrease, ``B`` for ``offsets[B] != len(values)``."""
    if b == 0 and lo != 0:
        cuda.atomic.min(slots, 0, 0)
    if hi < lo:
        cuda.atomic.min(slots, 0, b + 1)
    if b == num_bags - 1 and hi != n_values:
        cuda.atomic.min(slots, 0, num_bags)


@kernel_factory
def pool_kernel(table_dtype, weights_dtype, columns):
    """The pooling kernel for a table of ``table_dtype`` (:func:`dtype_key`),
    weights of ``weights_dtype`` (None: no weights) and ``columns`` per lane
    (:func:`columns_per_lane`), accumulating in the table's accumulator type;
    bf16 elements are converted from their bits."""
    widen = WIDEN[accumulator_dtype(table_dtype)]
    read_columns = column_reader(table_dtype, columns)
    load_weight = load_as_float(weights_dtype or table_dtype)
    store = store_as(table_dtype)

    @cuda.jit(cache=False)
    def pool_kernel(table, values, offsets, n_values, weights, has_weights, combiner, identity,
                    check_offsets, record_ids, group, out, slots):
        """out[b] = combine_j w_j * table[row_j], row_j = values[j] (or j when ``identity``)."""
        num_rows = table.shape[0]
        dim = table.shape[1]
        num_bags = offsets.shape[0] - 1
        tid = cuda.grid(1)
        lane = tid % group
        step = cuda.gridsize(1) // group
        chunk = UNROLL * group
        for b in range(tid // group, num_bags, step):
            lo = offsets[b]
            hi = offsets[b + 1]
            start = min(max(lo, 0), n_values)
            end = min(max(hi, start), n_values)
            if check_offsets and lane == 0:
                check_bag_offsets(slots, b, lo, hi, num_bags, n_values)
            for c0 in range(lane, dim, chunk):
                a0 = widen(0)
                a1 = widen(0)
                a2 = widen(0)
                a3 = widen(0)
                w_sum = widen(0)
                w_sq = widen(0)
                for j in range(start, end):
                    row = j if identity else values[j]
                    if row < 0 or row >= num_rows:
                        if record_ids and c0 == 0:  # lane 0, first pass: once per id
                            cuda.atomic.min(slots, 1, j)
                        continue
                    w = widen(load_weight(weights[j])) if has_weights else widen(1)
                    w_sum += w
                    w_sq += w * w
                    v0, v1, v2, v3 = read_columns(table, row, c0, group)
                    a0 += w * v0
                    a1 += w * v1
                    a2 += w * v2
                    a3 += w * v3
                scale = widen(1)
                if combiner == 1:
                    scale = widen(1) / w_sum if w_sum != 0 else widen(0)
                elif combiner == 2:
                    scale = widen(1) / math.sqrt(w_sq) if w_sq != 0 else widen(0)
                c1 = c0 + group
                c2 = c1 + group
                c3 = c2 + group
                out[b, c0] = store(a0 * scale)
                if c1 < dim:
                    out[b, c1] = store(a1 * scale)
                    if c2 < dim:
                        out[b, c2] = store(a2 * scale)
                        if c3 < dim:
                            out[b, c3] = store(a3 * scale)

    return pool_kernel


def empty_batch_bad_offset(family, offsets, n_values):
    """First bad offset when ``B == 0``: ``offsets == [x]`` is CSR iff ``x == 0`` and
    there are no values; either failure is at position 0 (reads one element)."""
    if n_values != 0:
        return 0
    return 0 if int(_device.to_host(family.kernel_array(offsets)[:1])[0]) != 0 else -1


def pool(family, table, values, offsets, n_values, weights, combiner, identity, check_offsets,
         record_ids):
    """Launch the pooling kernel. Returns ``(out [B, D] in the table's dtype, stream, slots)``;
    ``slots`` (first bad offset, first bad id) is None when nothing was recorded or launched."""
    stream = family.stream()
    num_bags = offsets.shape[0] - 1
    dim = table.shape[1]
    out = family.empty((num_bags, dim), table.dtype)
    if num_bags == 0:
        return out, stream, None
    record = check_offsets or record_ids
    slots = error_slots(2) if record else no_error_slots()
    k_offsets = family.kernel_array(offsets)
    k_values = k_offsets if identity else family.kernel_array(values)
    k_weights = k_values if weights is None else family.kernel_array(weights)
    group = group_size(dim)
    tpb = threads_per_block()
    kernel = pool_kernel(dtype_key(table.dtype),
                         dtype_key(None if weights is None else weights.dtype),
                         columns_per_lane(dim, group))
    kernel[blocks_for(num_bags, tpb // group), tpb, stream](
        family.kernel_array(table), k_values, k_offsets, n_values, k_weights, weights is not None,
        combiner, identity, check_offsets, record_ids, group, family.kernel_array(out), slots,
    )
    return out, stream, (slots if record else None)


def embedding_bag(family, weights, values, offsets, per_sample_weights, combiner, bounds):
    n_values = values.shape[0]
    check = bounds != 2
    if offsets.shape[0] == 1:
        bad_offset = empty_batch_bad_offset(family, offsets, n_values) if check else -1
        return family.empty((0, weights.shape[1]), weights.dtype), bad_offset, -1
    out, stream, slots = pool(
        family, weights, values, offsets, n_values, per_sample_weights, combiner, False,
        check, bounds == 0,
    )
    if slots is None:
        return out, -1, -1
    bad_offset, bad_id = read_error_slots(slots)
    return out, bad_offset, (bad_id if bounds == 0 else -1)
