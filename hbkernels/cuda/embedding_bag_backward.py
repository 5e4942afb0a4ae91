"""Backward of ``embedding_bag`` on the GPU: the row-sparse gradient ``(ids, rows)``.

With bag scale ``c_b`` (1 for sum, ``1/Σw`` for mean, ``1/sqrt(Σw²)`` for sqrtn,
0 where the denominator is 0)::

    rows[k] = Σ_{j: values[j] == ids[k]} c_{b(j)} · w_j · grad_out[b(j)]

Pipeline (all on ``family.stream()``):

1. ``prepare``: one thread per bag (grid-stride) checks the bag's offsets (error
   slot 0, as the forward reports them), sums its weights (``Σw``, ``Σw²``, in
   input order, in fp64 as the CPU backend does; the weights are first cast to
   the accumulator type), and writes for every position ``j`` of the bag
   ``bag_of[j] = b``, ``coef[j] = c_b · w_j`` (fp64 product, stored in the
   accumulator type) and the
   hash key ``keys[j] = values[j]`` (int64). An out-of-range id is recorded in
   error slot 1 and gets the key ``EMPTY`` (int64 min), which the hash unique
   of :mod:`.unique` keeps in its reserved extra slot, compacted *last*: it
   becomes the last distinct index and is simply dropped.
2. Hash unique of ``keys`` with ``inverse`` (:func:`.unique.unique`).
3. ``deterministic=True``: the positions ``0..n-1`` are stably radix-sorted by
   ``inverse`` (:func:`._scan.radix_sort`), so each distinct id's occurrences
   are contiguous and in input order; ``starts[r]`` (CSR, ``K + 1`` entries)
   marks where distinct id ``r``'s run begins (a boundary kernel over the
   sorted keys, equivalent to an exclusive scan of the counts but with no
   atomic counting of hot ids). Then one row group of ``G = group_size(D)``
   lanes per distinct id sums its occurrences in order: lane ``d`` owns
   columns ``d, d+G, d+2G, d+3G`` in registers (fp32, fp64 for fp64 grads) and
   wider rows take further passes, as in the forward kernel. No atomics touch
   the output: the same bits every run.
   ``deterministic=False``: one row group per position adds its contribution
   with ``cuda.atomic.add`` into an fp32/fp64 buffer (rounded to fp16/bf16 after).

Host syncs: the error slots (unless ``bounds="unchecked"``) and the distinct
count of the hash unique. :mod:`.sparse_update` reuses ``prepare``,
``group_positions`` and ``make_accumulate`` for the fused optimizer step.
"""
import functools
import math

import numpy as np
from numba import cuda

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
from ._scan import radix_sort
from .embedding_bag import check_bag_offsets, empty_batch_bad_offset
from .segment_sum import cast_kernel
from .unique import EMPTY, unique


# ---------------------------------------------------------------------------
# 1. per-position bag, coefficient and hash key
# ---------------------------------------------------------------------------
@kernel_factory
def prepare_kernel(acc_dtype, weights_dtype):
    """The per-bag pass writing coefficients in ``acc_dtype`` from weights of
    ``weights_dtype`` (:func:`dtype_key`; weights None: unweighted)."""
    widen = WIDEN[np.dtype(acc_dtype)]
    load_weight = load_as_float(weights_dtype or acc_dtype)

    @cuda.jit(cache=False)
    def prepare_kernel(values, offsets, n_values, num_rows, weights, has_weights, combiner,
                       trusted, check_offsets, record_ids, keys, bag_of, coef, slots):
        num_bags = offsets.shape[0] - 1
        for b in range(cuda.grid(1), num_bags, cuda.gridsize(1)):
            lo = offsets[b]
            hi = offsets[b + 1]
            start = min(max(lo, 0), n_values)  # clamped: malformed CSR never reads out of range
            end = min(max(hi, start), n_values)
            if check_offsets:
                check_bag_offsets(slots, b, lo, hi, num_bags, n_values)
            w_sum = 0.0
            w_sq = 0.0
            for j in range(start, end):
                row = values[j]
                if trusted or (row >= 0 and row < num_rows):
                    w = np.float64(widen(load_weight(weights[j]))) if has_weights else 1.0
                    w_sum += w
                    w_sq += w * w
                elif record_ids:
                    cuda.atomic.min(slots, 1, j)
            scale = 1.0
            if combiner == 1:
                scale = 1.0 / w_sum if w_sum != 0.0 else 0.0
            elif combiner == 2:
                scale = 1.0 / math.sqrt(w_sq) if w_sq != 0.0 else 0.0
            for j in range(start, end):
                row = values[j]
                bag_of[j] = b
                if trusted or (row >= 0 and row < num_rows):
                    w = np.float64(widen(load_weight(weights[j]))) if has_weights else 1.0
                    keys[j] = row
                    coef[j] = widen(scale * w)
                else:
                    keys[j] = EMPTY
                    coef[j] = widen(0)

    return prepare_kernel


def prepare(family, values, offsets, weights, combiner, num_rows, acc_dtype, trusted,
            check_offsets, record_ids, stream):
    """Launch the per-bag pass. Returns ``(keys, bag_of, coef, slots)`` (device arrays;
    ``slots`` holds (first bad offset, first bad id) when anything is recorded).

    ``trusted``: ids are not range-checked (``bounds="unchecked"``); otherwise an
    out-of-range id gets key ``EMPTY``, coefficient 0 and no share of a denominator.
    """
    n = values.shape[0]
    num_bags = offsets.shape[0] - 1
    keys = cuda.device_array(n, np.int64, stream=stream)
    bag_of = cuda.device_array(n, np.int64, stream=stream)
    coef = cuda.device_array(n, acc_dtype, stream=stream)
    record = check_offsets or record_ids
    slots = error_slots(2, stream) if record else no_error_slots()
    k_values = family.kernel_array(values)
    k_weights = k_values if weights is None else family.kernel_array(weights)
    tpb = threads_per_block()
    kernel = prepare_kernel(dtype_key(acc_dtype),
                            dtype_key(None if weights is None else weights.dtype))
    kernel[blocks_for(num_bags, tpb), tpb, stream](
        k_values, family.kernel_array(offsets), n, num_rows, k_weights, weights is not None,
        combiner, trusted, check_offsets, record_ids, keys, bag_of, coef, slots,
    )
    return keys, bag_of, coef, slots


# ---------------------------------------------------------------------------
# 2-3. distinct ids, and their occurrences grouped in input order
# ---------------------------------------------------------------------------
@cuda.jit
def _iota(a):
    for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        a[i] = i


@cuda.jit
def _run_starts(sorted_keys, starts):
    """``starts[k]`` = first index of key ``k`` in ``sorted_keys`` (every key in
    ``[0, K)`` occurs), ``starts[K] = n``."""
    n = sorted_keys.shape[0]
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        k = sorted_keys[i]
        if i == 0 or sorted_keys[i - 1] != k:
            starts[k] = i
        if i == n - 1:
            starts[starts.shape[0] - 1] = n


def group_positions(inverse, num_distinct, stream):
    """``(starts [K + 1], pos [n])``: ``pos[starts[r]:starts[r + 1]]`` are the positions
    ``j`` with ``inverse[j] == r``, increasing (stable LSD radix sort of
    ``(inverse, j)``). ``inverse`` (an int64 device array) is clobbered."""
    n = inverse.shape[0]
    tpb = threads_per_block()
    grid = blocks_for(n, tpb)
    iota = cuda.device_array(n, np.int64, stream=stream)
    _iota[grid, tpb, stream](iota)
    sorted_keys = cuda.device_array(n, np.int64, stream=stream)
    pos = cuda.device_array(n, np.int64, stream=stream)
    radix_sort(inverse, iota, sorted_keys, pos, 0, num_distinct - 1, stream)
    starts = cuda.device_array(num_distinct + 1, np.int64, stream=stream)
    _run_starts[grid, tpb, stream](sorted_keys, starts)
    return starts, pos


def distinct_keys(family, keys):
    """Hash unique of the int64 ``keys``: ``(uniq, inverse)`` as family arrays. The
    ``EMPTY`` key, when present, is the last distinct index (the reserved slot of
    :mod:`.unique` comes last in its compaction)."""
    uniq, inverse, _ = unique(family, keys, True, False, False)
    return uniq, inverse


@functools.lru_cache(maxsize=None)
def make_accumulate(acc_dtype, grad_dtype, columns):
    """Device function summing one lane's ``columns`` columns (1 to 4) of a distinct
    id's gradient: ``Σ_{i in [lo, hi)} coef[p]·grad[bag_of[p], c]`` with ``p = pos[i]``,
    in order, in ``acc_dtype`` from a ``grad`` of ``grad_dtype`` (:func:`dtype_key`;
    columns ``>= D`` give 0: row-wise Adagrad sums the squares of all four). Each
    occurrence's loads are in flight together (:func:`._launch.column_reader`)."""
    widen = WIDEN[np.dtype(acc_dtype)]
    read_columns = column_reader(grad_dtype, columns)

    @cuda.jit(device=True, inline=True)
    def accumulate(grad, lo, hi, pos, bag_of, coef, c0, group):
        dim = grad.shape[1]
        num_bags = grad.shape[0]
        a0 = widen(0)
        a1 = widen(0)
        a2 = widen(0)
        a3 = widen(0)
        if c0 < dim:
            for i in range(lo, hi):
                p = pos[i]
                b = bag_of[p]
                if b < 0 or b >= num_bags:  # only reachable with malformed unchecked CSR
                    continue
                cf = coef[p]
                v0, v1, v2, v3 = read_columns(grad, b, c0, group)
                a0 += cf * widen(v0)
                a1 += cf * widen(v1)
                a2 += cf * widen(v2)
                a3 += cf * widen(v3)
        # column_reader read column c0 in place of those past the row's end
        if c0 + group >= dim:
            a1 = widen(0)
        if c0 + 2 * group >= dim:
            a2 = widen(0)
        if c0 + 3 * group >= dim:
            a3 = widen(0)
        return a0, a1, a2, a3

    return accumulate


@kernel_factory
def gather_kernel(grad_dtype, columns):
    """The deterministic kernel for a gradient of ``grad_dtype`` (a :func:`dtype_key`),
    ``columns`` per lane (:func:`columns_per_lane`), summing in its accumulator type
    and storing rows of ``grad_dtype``."""
    accumulate = make_accumulate(dtype_key(accumulator_dtype(grad_dtype)), grad_dtype, columns)
    store = store_as(grad_dtype)

    @cuda.jit(cache=False)
    def gather_kernel(grad, starts, pos, bag_of, coef, num_ids, group, rows):
        """rows[r] = in-order sum of distinct id r's occurrences (one row group each)."""
        dim = grad.shape[1]
        tid = cuda.grid(1)
        lane = tid % group
        step = cuda.gridsize(1) // group
        chunk = UNROLL * group
        for r in range(tid // group, num_ids, step):
            lo = starts[r]
            hi = starts[r + 1]
            for c0 in range(lane, dim, chunk):
                a0, a1, a2, a3 = accumulate(grad, lo, hi, pos, bag_of, coef, c0, group)
                c1 = c0 + group
                c2 = c1 + group
                c3 = c2 + group
                rows[r, c0] = store(a0)
                if c1 < dim:
                    rows[r, c1] = store(a1)
                    if c2 < dim:
                        rows[r, c2] = store(a2)
                        if c3 < dim:
                            rows[r, c3] = store(a3)

    return gather_kernel


@kernel_factory
def scatter_kernel(grad_dtype):
    """The atomic kernel for a gradient of ``grad_dtype`` (a :func:`dtype_key`),
    adding into a buffer of its accumulator type."""
    load = load_as_float(grad_dtype)

    @cuda.jit(cache=False)
    def scatter_kernel(grad, keys, inverse, bag_of, coef, group, acc):
        """acc[inverse[j]] += coef[j]·grad[bag_of[j]] with atomics (one row group per j)."""
        dim = grad.shape[1]
        num_bags = grad.shape[0]
        tid = cuda.grid(1)
        lane = tid % group
        step = cuda.gridsize(1) // group
        for j in range(tid // group, keys.shape[0], step):
            if keys[j] == EMPTY:  # out-of-range id: absent
                continue
            b = bag_of[j]
            if b < 0 or b >= num_bags:
                continue
            r = inverse[j]
            cf = coef[j]
            for c in range(lane, dim, group):
                cuda.atomic.add(acc, (r, c), cf * load(grad[b, c]))

    return scatter_kernel


def _ids_out(family, uniq, count, dtype, stream):
    """The first ``count`` distinct keys in the ids' dtype."""
    if np.dtype(dtype) == np.int64:
        return uniq if uniq.shape[0] == count else uniq[:count]
    out = family.empty(count, dtype)
    tpb = threads_per_block()
    cast_kernel(dtype_key(dtype))[blocks_for(count, tpb), tpb, stream](
        family.kernel_array(uniq)[:count], family.kernel_array(out)
    )
    return out


def embedding_bag_backward(family, grad_out, values, offsets, num_rows, per_sample_weights,
                           combiner, bounds, deterministic):
    n = values.shape[0]
    num_bags = offsets.shape[0] - 1
    dim = grad_out.shape[1]
    check = bounds != 2

    def empty():
        return family.empty(0, values.dtype), family.empty((0, dim), grad_out.dtype)

    if num_bags == 0:
        bad_offset = empty_batch_bad_offset(family, offsets, n) if check else -1
        return (*empty(), bad_offset, -1)
    stream = family.stream()
    acc_dtype = accumulator_dtype(grad_out.dtype)
    keys, bag_of, coef, slots = prepare(
        family, values, offsets, per_sample_weights, combiner, num_rows, acc_dtype,
        not check, check, check, stream,
    )
    has_bad = False
    if check:
        bad_offset, bad_id = read_error_slots(slots, stream)
        if bad_offset != -1 or (bounds == 0 and bad_id != -1):
            return (*empty(), bad_offset, bad_id if bounds == 0 else -1)
        has_bad = bad_id != -1  # bounds="zero": those ids share the EMPTY key, dropped below
    if n == 0:
        return (*empty(), -1, -1)
    uniq, inverse = distinct_keys(family, keys)
    num_ids = uniq.shape[0] - (1 if has_bad else 0)
    if num_ids == 0:
        return (*empty(), -1, -1)
    ids = _ids_out(family, uniq, num_ids, values.dtype, stream)
    group = group_size(dim)
    tpb = threads_per_block()
    k_grad = family.kernel_array(grad_out)
    if deterministic:
        starts, pos = group_positions(family.kernel_array(inverse), uniq.shape[0], stream)
        rows = family.empty((num_ids, dim), grad_out.dtype)
        kernel = gather_kernel(dtype_key(grad_out.dtype), columns_per_lane(dim, group))
        kernel[blocks_for(num_ids, tpb // group), tpb, stream](
            k_grad, starts, pos, bag_of, coef, num_ids, group, family.kernel_array(rows),
        )
        return ids, rows, -1, -1
    acc = family.zeros((num_ids, dim), acc_dtype)
    k_acc = family.kernel_array(acc)
    scatter_kernel(dtype_key(grad_out.dtype))[blocks_for(n, tpb // group), tpb, stream](
        k_grad, keys, family.kernel_array(inverse), bag_of, coef, group, k_acc,
    )
    if acc_dtype == np.dtype(grad_out.dtype):
        return ids, acc, -1, -1
    rows = family.empty((num_ids, dim), grad_out.dtype)
    cast_kernel(dtype_key(rows.dtype))[blocks_for(acc.size, tpb), tpb, stream](
        k_acc.reshape(acc.size), family.kernel_array(rows).reshape(acc.size)
    )
    return ids, rows, -1, -1
