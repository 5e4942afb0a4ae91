"""Backward of ``embedding_bag`` on the GPU: the row-sparse gradient ``(ids, rows)``.

With bag scale ``c_b`` (1 for sum, ``1/Σw`` for mean, ``1/sqrt(Σw²)`` for sqrtn,
0 where the denominator is 0)::

    rows[k] = Σ_{j: values[j] == ids[k]} c_{b(j)} · w_j · grad_out[b(j)]

Pipeline (all queued on the current stream):

1. ``prepare``: one thread per bag (grid-stride) checks the bag's offsets (error slot 0,
   as the forward reports them; the fused optimizer step also has it check the
   gradient's finiteness, grid-stride over its elements, into slot 2) and writes for
   every position ``j`` of the bag ``bag_of[j] = b`` (int32 when the bags fit) and the
   sort key ``keys[j] = values[j]`` (int32 when the table has fewer than 2^31 rows).
   With weights or a mean/sqrtn combiner it first sums the bag's weights (``Σw``,
   ``Σw²``, in input order, in fp64 as the CPU backend does; the weights are first cast
   to the accumulator type) and writes ``coef[j] = c_b · w_j`` (fp64 product, stored in
   the accumulator type); otherwise every coefficient is 1 and none is stored. An
   out-of-range id (recorded in error slot 1 when checked) gets the key -1, which sorts
   first and is dropped, and the bag -1, which sums as 0.
2. :func:`occurrences`: the positions stably sorted by key (CuPy's CUB radix sort),
   so each distinct id's occurrences form a run in input order; past one tile of
   sorted positions (``threads_per_block() · _runs.ITEMS``) :func:`._segments.group`
   then finds the runs' bounds.
3. ``partial_kernel`` per level, then ``gather_kernel`` (up to one tile,
   ``gather_tile_kernel``, each block of which first numbers the runs itself, into
   results sized by the occurrences: their first rows are returned): one row group of
   ``G = group_size(D)`` lanes per window slot (per distinct id), summing its items
   in order (:func:`make_accumulate`); a run of more than ``CHUNK`` occurrences is
   summed from its pieces, windows of ``CHUNK^t`` sorted positions
   (:mod:`._segments`). No row group sums more than ``CHUNK`` items and no atomics
   touch the result: the same bits every run, whatever the id frequencies. The
   group also writes its id, in the values' dtype.
   ``deterministic=False``: one row group per occurrence adds its contribution
   with ``cuda.atomic.add`` into an fp32/fp64 buffer instead.

Host syncs: one, reading the error slots (unless ``bounds="unchecked"``) and the
distinct count together. ``padded=True`` sizes the result by ``len(values)`` (the
distinct ids, then id -1 with zero rows), so nothing but the error slots is read
back: no sync at all under ``bounds="unchecked"``.
:mod:`.sparse_update` reuses ``prepare``, :func:`occurrences` and
:func:`make_accumulate` for the fused optimizer step.
"""
import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, int32

from .._modes import Bounds, Combiner
from . import _device, _runs, _segments
from ._launch import (
    UNROLL,
    WIDEN,
    accumulator_dtype,
    blocks_for,
    column_reader,
    columns_per_lane,
    dtype_key,
    error_positions,
    drop_read_back,
    error_slots,
    group_size,
    inline_device,
    jit_kernel,
    kernel_factory,
    load_as_float,
    no_error_slots,
    read_back_slots,
    read_error_slots,
    store_as,
    threads_per_block,
)
from ._launcher import launch
from ._nonfinite import nonfinite_scan, scan_blocks
from ._segments import device_final_level as final_level
from ._segments import device_level_base as level_base
from ._segments import device_partial_row as partial_row
from ._segments import device_piece as piece
from ._segments import device_slot_run as slot_run
from ._warp import group_mask, shfl_idx
from .embedding_bag import check_bag_offsets, empty_batch_bad_offset
from .segment_sum import cast_kernel

ITEMS_IN_FLIGHT = 2  # occurrences whose rows a lane loads before the first add


# ---------------------------------------------------------------------------
# 1. per-position bag, coefficient and sort key
# ---------------------------------------------------------------------------
@kernel_factory
def prepare_kernel(acc_dtype, weights_dtype, scaled, grad_dtype=None):
    """The per-bag pass for coefficients in ``acc_dtype`` from weights of
    ``weights_dtype`` (:func:`dtype_key`; None: unweighted). ``scaled``: write the
    coefficients (weights, or a mean/sqrtn combiner); else every coefficient is 1,
    none is written, and a bag's ids are read once, four at a time. ``grad_dtype``
    (None: no check): the same launch records the first row of ``grad`` (a 2-D array
    of that dtype) holding NaN or Inf in ``slots[2]`` (:mod:`._nonfinite`)."""
    widen = WIDEN[np.dtype(acc_dtype)]
    load_weight = load_as_float(weights_dtype or acc_dtype)
    has_weights = weights_dtype is not None
    check_grad = grad_dtype is not None
    scan_grad = nonfinite_scan(grad_dtype or acc_dtype)

    @inline_device
    def emit(j, row, b, num_rows, record_ids, keys, bag_of, slots):
        ok = row >= 0 and row < num_rows
        keys[j] = row if ok else -1
        bag_of[j] = b if ok else -1
        if record_ids and not ok:
            cuda.atomic.min(slots, 1, j)

    @cuda.jit(cache=False)
    def prepare_kernel(values, offsets, n_values, num_rows, weights, combiner, check_offsets,
                       record_ids, keys, bag_of, coef, slots, grad):
        if check_grad:
            scan_grad(grad, slots, 2)
        num_bags = offsets.shape[0] - 1
        for b in range(cuda.grid(1), num_bags, cuda.gridsize(1)):
            lo = offsets[b]
            hi = offsets[b + 1]
            start = min(max(lo, 0), n_values)  # clamped: malformed CSR never reads out of range
            end = min(max(hi, start), n_values)
            if check_offsets:
                check_bag_offsets(slots, b, lo, hi, num_bags, n_values)
            if not scaled:
                j = start
                while j + 4 <= end:
                    v0 = values[j]
                    v1 = values[j + 1]
                    v2 = values[j + 2]
                    v3 = values[j + 3]
                    emit(j, v0, b, num_rows, record_ids, keys, bag_of, slots)
                    emit(j + 1, v1, b, num_rows, record_ids, keys, bag_of, slots)
                    emit(j + 2, v2, b, num_rows, record_ids, keys, bag_of, slots)
                    emit(j + 3, v3, b, num_rows, record_ids, keys, bag_of, slots)
                    j += 4
                while j < end:
                    emit(j, values[j], b, num_rows, record_ids, keys, bag_of, slots)
                    j += 1
                continue
            w_sum = 0.0
            w_sq = 0.0
            for j in range(start, end):
                row = values[j]
                if row >= 0 and row < num_rows:
                    w = np.float64(widen(load_weight(weights[j]))) if has_weights else 1.0
                    w_sum += w
                    w_sq += w * w
                elif record_ids:
                    cuda.atomic.min(slots, 1, j)
            scale = 1.0
            if combiner == Combiner.MEAN:
                scale = 1.0 / w_sum if w_sum != 0.0 else 0.0
            elif combiner == Combiner.SQRTN:
                scale = 1.0 / math.sqrt(w_sq) if w_sq != 0.0 else 0.0
            for j in range(start, end):
                row = values[j]
                if row >= 0 and row < num_rows:
                    w = np.float64(widen(load_weight(weights[j]))) if has_weights else 1.0
                    keys[j] = row
                    bag_of[j] = b
                    coef[j] = widen(scale * w)
                else:
                    keys[j] = -1
                    bag_of[j] = -1
                    coef[j] = widen(0)

    return prepare_kernel


@cuda.jit(cache=False)
def unset_kernel(keys, bag_of):
    """``keys[j] = bag_of[j] = -1`` for every position (grid-stride): positions no bag
    covers then hold an out-of-range key and bag."""
    for j in range(cuda.grid(1), keys.shape[0], cuda.gridsize(1)):
        keys[j] = -1
        bag_of[j] = -1


def key_dtype(num_rows):
    """Sort keys: int32 (half the radix passes) when every row id and -1 fit."""
    return np.dtype(np.int32) if num_rows < 2**31 else np.dtype(np.int64)


def prepare(family, values, offsets, weights, combiner, num_rows, acc_dtype, check_offsets,
            record_ids, slots=None, grad=None):
    """Launch the per-bag pass. Returns ``(keys, bag_of, coef, slots)`` (``xp`` arrays;
    ``coef`` is empty when every coefficient is 1: no weights, combiner sum; ``slots``
    holds (first bad offset, first bad id), or nothing when nothing is recorded; the
    caller may pass the slots). Positions no bag covers get key and bag -1 (a launch of
    their own before the pass), unless the offsets are checked: valid offsets cover every
    position, and with invalid ones the caller returns before the keys are used. ``grad`` (a 2-D array; the caller
    passes ``slots``, three at least): its first row holding NaN or Inf goes to
    ``slots[2]``, in the same launch."""
    n = values.shape[0]
    num_bags = offsets.shape[0] - 1
    scaled = weights is not None or combiner != Combiner.SUM
    signature = (num_rows < 2**31, num_bags < 2**31 - 1, acc_dtype,
                 None if weights is None else weights.dtype, scaled,
                 None if grad is None else grad.dtype, _device.device_id())
    plan = _PREPARE.get(signature)
    if plan is None:
        plan = _PREPARE[signature] = (
            key_dtype(num_rows), _segments.index_dtype(num_bags),
            prepare_kernel(dtype_key(acc_dtype), dtype_key(signature[3]), scaled,
                           dtype_key(signature[5])),
            _device.scratch(0, acc_dtype), _device.scratch((0, 1), acc_dtype))
    keys_dtype, bags_dtype, kernel, no_coef, no_grad = plan
    keys = _device.scratch(n, keys_dtype)
    bag_of = _device.scratch(n, bags_dtype)
    tpb = threads_per_block()
    if not check_offsets and n:  # every position first -1: unchecked offsets may miss some
        launch(unset_kernel, blocks_for(n, tpb), tpb, keys, bag_of)
    coef = _device.scratch(n, acc_dtype) if scaled else no_coef
    if slots is None:
        slots = error_slots(2) if check_offsets or record_ids else no_error_slots()
    k_weights = values if weights is None else family.kernel_array(weights)
    blocks = blocks_for(num_bags, tpb)
    if grad is not None:
        blocks = max(blocks, scan_blocks(grad, tpb))
    launch(kernel, blocks, tpb, values, offsets, n, num_rows, k_weights,
           combiner, check_offsets, record_ids, keys, bag_of, coef, slots,
           no_grad if grad is None else family.kernel_array(grad))
    return keys, bag_of, coef, slots


_PREPARE = {}  # what prepare derives from its call's signature: key and bag dtypes, kernel,
#               zero-sized coefficients and gradient


# ---------------------------------------------------------------------------
# 2. occurrences grouped by id
# ---------------------------------------------------------------------------
class Occurrences(NamedTuple):
    """Everything the summing kernels read: the sorted positions ``order`` (sorted
    position -> input position) of the sort ``keys``, each position's bag and coefficient
    (``coef`` empty: all 1), the partial buffer of ``levels`` levels, and the chunk the
    sums are cut by. A sorted position's run (its key's occurrences) is found from
    ``keys[order[...]]`` (:func:`._segments.run_end`)."""

    order: object
    keys: object
    bag_of: object
    coef: object
    partials: object
    levels: int
    chunk: int

    def kernel_arrays(self):
        """``(order, bag_of, coef, partials)`` as the kernels take them."""
        return (self.order, self.bag_of, self.coef, self.partials)


def occurrences(keys, bag_of, coef, dim, acc_dtype):
    """Sort the positions by ``keys`` (no host synchronisation) and take the partial
    buffer."""
    chunk = _segments.CHUNK
    levels, rows = _segments.partial_levels(keys.shape[0], chunk)
    partials = _device.scratch((rows, dim), acc_dtype)  # (zero-sized: made once)
    return Occurrences(_segments.stable_argsort(_device.xp(), keys), keys, bag_of, coef,
                       partials, levels, chunk)


# ---------------------------------------------------------------------------
# 3. the sums
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def make_accumulate(acc_dtype, grad_dtype, columns):
    """Device function ``(grad, order, bag_of, coef, partials, level, first, last, lo,
    base, width, c0, lane, group) -> (a0, a1, a2, a3)``: one lane's ``columns``
    columns (1 to 4; ``c0 + k·group``) of an in-order sum, in ``acc_dtype``. Level 0:
    the occurrences at sorted positions ``[first, last)``, ``coef[p]·grad[bag_of[p]]``
    with ``p = order[i]`` (``grad`` of ``grad_dtype``; ``coef`` empty: 1). Level >= 1:
    the partial rows of windows ``[first, last)`` of size ``width`` holding the run
    that starts at ``lo`` (:func:`._segments.partial_row` from row ``base``). Every
    lane of the row group must call it with the same items (the bags and
    coefficients of ``group`` occurrences are read coalesced, one per lane, and
    broadcast by shuffles); a lane's columns at or past the row's end give 0.
    ``ITEMS_IN_FLIGHT`` rows are loaded before their adds."""
    widen = WIDEN[np.dtype(acc_dtype)]
    zero = np.dtype(acc_dtype).type(0)
    one = np.dtype(acc_dtype).type(1)
    read_grad = column_reader(grad_dtype, columns)
    read_partial = column_reader(acc_dtype, columns)

    @inline_device
    def accumulate(grad, order, bag_of, coef, partials, level, first, last, lo, base, width,
                   c0, lane, group):
        dim = grad.shape[1]
        num_bags = grad.shape[0]
        scaled = coef.shape[0] != 0
        cc = c0 if c0 < dim else 0  # past the row: read column 0, return zeros
        a0 = zero
        a1 = zero
        a2 = zero
        a3 = zero
        if level == 0:
            warp_lane = cuda.threadIdx.x % 32
            lane0 = warp_lane - lane
            mask = group_mask(warp_lane, group)
            for batch in range(first, last, group):
                k = batch + lane
                my_bag = 0
                my_coef = zero
                if k < last:
                    p = order[k]
                    my_bag = bag_of[p]
                    my_coef = widen(coef[p]) if scaled else one
                if my_bag < 0 or my_bag >= num_bags:  # a bad id, or malformed unchecked CSR
                    my_bag = 0
                    my_coef = zero
                count = min(group, last - batch)
                for u in range(0, count, ITEMS_IN_FLIGHT):
                    b0 = shfl_idx(mask, my_bag, lane0 + u)
                    f0 = shfl_idx(mask, my_coef, lane0 + u)
                    has1 = u + 1 < count
                    b1 = shfl_idx(mask, my_bag, lane0 + (u + 1 if has1 else u))
                    f1 = shfl_idx(mask, my_coef, lane0 + (u + 1 if has1 else u))
                    v0, v1, v2, v3 = read_grad(grad, b0, cc, group)
                    x0, x1, x2, x3 = read_grad(grad, b1, cc, group)
                    a0 += f0 * widen(v0)
                    a1 += f0 * widen(v1)
                    a2 += f0 * widen(v2)
                    a3 += f0 * widen(v3)
                    if has1:
                        a0 += f1 * widen(x0)
                        a1 += f1 * widen(x1)
                        a2 += f1 * widen(x2)
                        a3 += f1 * widen(x3)
        else:
            for m in range(first, last, ITEMS_IN_FLIGHT):
                has1 = m + 1 < last
                v0, v1, v2, v3 = read_partial(partials, partial_row(lo, m, width, base), cc,
                                              group)
                x0, x1, x2, x3 = read_partial(
                    partials, partial_row(lo, m + 1 if has1 else m, width, base), cc, group)
                a0 += v0
                a1 += v1
                a2 += v2
                a3 += v3
                if has1:
                    a0 += x0
                    a1 += x1
                    a2 += x2
                    a3 += x3
        # column_reader read column cc in place of those past the row's end
        if c0 >= dim:
            a0 = zero
        if c0 + group >= dim:
            a1 = zero
        if c0 + 2 * group >= dim:
            a2 = zero
        if c0 + 3 * group >= dim:
            a3 = zero
        return a0, a1, a2, a3

    return accumulate


@inline_device
def sum_range(lo, hi, n, chunk):
    """``(level, first, last, lo, base, width)``: the final sum of the run of sorted
    positions ``[lo, hi)`` of ``n`` as :func:`make_accumulate`'s accumulate takes it."""
    level, first, last, width = final_level(lo, hi, chunk)
    return level, first, last, lo, level_base(n, level, chunk), width


@inline_device
def run_sum_range(starts, r, num, n, chunk):
    """:func:`sum_range` of run ``r`` (an empty sum for ``r >= num``)."""
    return sum_range(starts[r] if r < num else 0, starts[r + 1] if r < num else 0, n, chunk)


@inline_device
def store_columns(out, row, c0, group, store, a0, a1, a2, a3):
    """``out[row, c0 + k·group] = store(a_k)`` for the columns inside the row."""
    dim = out.shape[1]
    c1 = c0 + group
    c2 = c1 + group
    c3 = c2 + group
    if c0 < dim:
        out[row, c0] = store(a0)
        if c1 < dim:
            out[row, c1] = store(a1)
            if c2 < dim:
                out[row, c2] = store(a2)
                if c3 < dim:
                    out[row, c3] = store(a3)


@kernel_factory
def partial_kernel(acc_dtype, grad_dtype, columns):
    """Kernel writing the partial rows of one level ``>= 1``: slot ``s`` of the level
    (window ``s // 2``; :mod:`._segments`) gets its run's piece, for the runs whose
    final level is at least this one (other slots are not written). A slot finds its
    run's bounds from the sorted keys (:func:`._segments.slot_run`)."""
    accumulate = make_accumulate(acc_dtype, grad_dtype, columns)
    store = store_as(acc_dtype)

    @jit_kernel(min_blocks_per_sm=2)
    def partial_kernel(grad, order, bag_of, coef, partials, keys, level, chunk, group):
        n = order.shape[0]
        dim = grad.shape[1]
        width = 1
        for _ in range(level):
            width *= chunk
        base = level_base(n, level, chunk)
        below = level_base(n, level - 1, chunk)
        tid = cuda.grid(1)
        lane = tid % group
        step = cuda.gridsize(1) // group
        for s in range(tid // group, 2 * ((n + width - 1) // width), step):
            window = s // 2
            w_lo = window * width
            w_hi = min(w_lo + width, n)
            if keys[order[w_lo if s % 2 == 0 else w_hi - 1]] < 0:  # the ids out of range
                continue
            lo, hi = slot_run(keys, order, 0, n, w_lo, w_hi, s % 2 == 1)
            if lo < 0:
                continue
            final, _, _, _ = final_level(lo, hi, chunk)
            if final < level:
                continue
            first, last = piece(lo, hi, level, window, chunk)
            for cb in range(0, dim, UNROLL * group):
                a0, a1, a2, a3 = accumulate(grad, order, bag_of, coef, partials, level - 1,
                                            first, last, lo, below, width // chunk, cb + lane,
                                            lane, group)
                store_columns(partials, base + s, cb + lane, group, store, a0, a1, a2, a3)

    return partial_kernel


def sum_partials(family, grad, occ):
    """Launch the partial kernels, level by level (none when no run can be long)."""
    if not occ.levels:
        return
    group = group_size(grad.shape[1])
    columns = columns_per_lane(grad.shape[1], group)
    tpb = threads_per_block()
    n = occ.order.shape[0]
    kernel = partial_kernel(dtype_key(occ.partials.dtype), dtype_key(grad.dtype), columns)
    args = (family.kernel_array(grad), *occ.kernel_arrays(), occ.keys)
    width = 1
    for level in range(1, occ.levels + 1):
        width *= occ.chunk
        slots = 2 * -(-n // width)
        launch(kernel, blocks_for(slots, tpb // group), tpb, *args, level, occ.chunk, group)


@functools.lru_cache(maxsize=None)
def _gather_rows(grad_dtype, columns):
    """Device function ``gather_rows(grad, order, bag_of, coef, partials, starts, num,
    chunk, skip, end, group, keys, ids, rows)``: for runs ``r`` in ``[skip, end)``, one
    row group each (grid-stride), ``rows[r - skip]`` = the sum of run ``r``'s occurrences
    and ``ids[r - skip]`` its key (``keys[order[starts[r]]]``); zeros and -1 for
    ``r >= num`` (padding). Sums in the accumulator type of ``grad_dtype``, stores rows of
    ``grad_dtype``."""
    accumulate = make_accumulate(dtype_key(accumulator_dtype(grad_dtype)), grad_dtype, columns)
    store = store_as(grad_dtype)

    @inline_device
    def gather_rows(grad, order, bag_of, coef, partials, starts, num, chunk, skip, end, group,
                    keys, ids, rows):
        n = order.shape[0]
        dim = grad.shape[1]
        tid = cuda.grid(1)
        lane = tid % group
        step = cuda.gridsize(1) // group
        for r in range(tid // group + skip, end, step):
            if lane == 0:
                ids[r - skip] = keys[order[starts[r]]] if r < num else -1
            level, first, last, lo, base, width = run_sum_range(starts, r, num, n, chunk)
            for cb in range(0, dim, UNROLL * group):
                a0, a1, a2, a3 = accumulate(grad, order, bag_of, coef, partials, level, first,
                                            last, lo, base, width, cb + lane, lane, group)
                store_columns(rows, r - skip, cb + lane, group, store, a0, a1, a2, a3)

    return gather_rows


@kernel_factory
def gather_kernel(grad_dtype, columns):
    """The deterministic kernel for a gradient of ``grad_dtype`` (a :func:`dtype_key`),
    ``columns`` per lane (:func:`columns_per_lane`), summing in its accumulator type
    and storing rows of ``grad_dtype``."""
    gather_rows = _gather_rows(grad_dtype, columns)

    @jit_kernel(min_blocks_per_sm=2)
    def gather_kernel(grad, order, bag_of, coef, partials, starts, count, chunk, skip, group,
                      keys, ids, rows):
        """Runs ``[skip, rows + skip)`` of the ``count[0]`` in ``starts`` (as
        ``gather_rows``)."""
        gather_rows(grad, order, bag_of, coef, partials, starts, count[0], chunk, skip,
                    rows.shape[0] + skip, group, keys, ids, rows)

    return gather_kernel


@kernel_factory
def gather_tile_kernel(grad_dtype, columns, tpb):
    """:func:`gather_kernel` for at most one tile of sorted positions (``tpb · ITEMS``,
    :mod:`._runs`) in blocks of ``tpb`` threads: each block numbers the tile's runs in its
    shared memory first (:func:`._runs.tile_runs`), so no launch finds them."""
    gather_rows = _gather_rows(grad_dtype, columns)
    tile_runs = _runs.tile_runs(tpb)
    bounds = tpb * _runs.ITEMS + 1  # (a constant: the shared array's size)

    @jit_kernel(min_blocks_per_sm=2)
    def gather_tile_kernel(grad, order, bag_of, coef, partials, chunk, group, keys, padded,
                           count, ids, rows):
        """The runs' sums, from the first run unless its key is -1 (the out-of-range ids)
        and not ``padded``; ``padded``: every row of ``rows`` written (zeros and -1 past
        the runs). ``count`` (may be empty): the runs' count, then the first key."""
        starts = cuda.shared.array(bounds, int32)
        num = tile_runs(keys, order, order.shape[0], starts)
        first = keys[order[0]]
        if cuda.grid(1) == 0 and count.shape[0] != 0:
            count[0] = num
            count[1] = first
        skip = 1 if not padded and first < 0 else 0
        gather_rows(grad, order, bag_of, coef, partials, starts, num, chunk, skip,
                    rows.shape[0] + skip if padded else num, group, keys, ids, rows)

    return gather_tile_kernel


@kernel_factory
def scatter_kernel(grad_dtype):
    """The atomic kernel for a gradient of ``grad_dtype`` (a :func:`dtype_key`),
    adding into a buffer of its accumulator type."""
    load = load_as_float(grad_dtype)

    @cuda.jit(cache=False)
    def scatter_kernel(grad, order, bag_of, coef, run, skip, group, acc):
        """acc[run[i] - 1 - skip] += coef[p]·grad[bag_of[p]], p = order[i], with atomics
        (one row group per sorted position i)."""
        dim = grad.shape[1]
        num_bags = grad.shape[0]
        scaled = coef.shape[0] != 0
        tid = cuda.grid(1)
        lane = tid % group
        step = cuda.gridsize(1) // group
        for i in range(tid // group, order.shape[0], step):
            r = run[i] - 1 - skip
            p = order[i]
            b = bag_of[p]
            if r < 0 or b < 0 or b >= num_bags:  # the -1 key, or malformed unchecked CSR
                continue
            cf = coef[p] if scaled else 1.0
            for c in range(lane, dim, group):
                cuda.atomic.add(acc, (r, c), cf * load(grad[b, c]))

    return scatter_kernel


class _Sums(NamedTuple):
    """What the sums of a gradient's rows derive from its dtype and width."""

    acc_dtype: object
    group: int  # lanes per row
    tpb: int
    tile: int  # the sorted positions one block numbers (:func:`._runs.tile_runs`)
    gather_tile: object  # the kernels
    gather: object
    scatter: object


@functools.lru_cache(maxsize=None)
def _sums(grad_dtype, dim, tpb):
    group = group_size(dim)
    columns = columns_per_lane(dim, group)
    key = dtype_key(grad_dtype)
    return _Sums(accumulator_dtype(grad_dtype), group, tpb, tpb * _runs.ITEMS,
                 gather_tile_kernel(key, columns, tpb), gather_kernel(key, columns),
                 scatter_kernel(key))


def embedding_bag_backward(family, grad_out, values, offsets, num_rows, per_sample_weights,
                           combiner, bounds, deterministic, padded=False):
    n = values.shape[0]
    num_bags = offsets.shape[0] - 1
    dim = grad_out.shape[1]
    check = bounds != Bounds.UNCHECKED

    def empty():
        return family.empty(0, values.dtype), family.empty((0, dim), grad_out.dtype)

    if num_bags == 0:
        bad_offset = empty_batch_bad_offset(family, offsets, n) if check else -1
        return (*empty(), bad_offset, -1)
    sums = _sums(grad_out.dtype, dim, threads_per_block())
    acc_dtype, group, tpb = sums.acc_dtype, sums.group, sums.tpb
    # at most one tile of occurrences: the sums' launch numbers the runs itself, into
    # outputs sized by the occurrences (their first rows returned)
    one_tile = deterministic and n <= sums.tile
    # what the host reads, in one array: the distinct count, the first key, the error slots
    info, slots = (None, None) if padded or n == 0 else read_back_slots(2, 2)
    try:
        keys, bag_of, coef, slots = prepare(family, values, offsets, per_sample_weights,
                                            combiner, num_rows, acc_dtype, check, check,
                                            slots=slots)
        if n == 0:
            bad_offset = read_error_slots(slots)[0] if check else -1
            return (*empty(), bad_offset, -1)
        occ = occurrences(keys, bag_of, coef, dim, acc_dtype)
        k_grad = family.kernel_array(grad_out)
        if one_tile:
            sum_partials(family, grad_out, occ)
            ids = family.empty(n, values.dtype)
            rows = family.empty((n, dim), grad_out.dtype)
            launch(sums.gather_tile, blocks_for(n, tpb // group), tpb, k_grad,
                   *occ.kernel_arrays(), occ.chunk, group, keys, padded,
                   _device.scratch(0, np.int64) if info is None else info, ids,
                   family.kernel_array(rows))
        else:  # the runs: where each id's row goes (the atomic sums' need their numbers)
            grouping = _segments.group(keys, info, occ.order, numbered=not deterministic)
        read = None if info is None else _device.to_host(info).tolist()
    except BaseException:  # (the wait may raise an earlier op's error): slots not seen
        if info is not None:
            drop_read_back(info)
        raise
    if padded:  # every distinct key (-1 for out-of-range ids), then -1: no count read back
        if check:
            bad_offset, bad_id = read_error_slots(slots)
            if bad_offset != -1 or (bounds == Bounds.RAISE and bad_id != -1):
                return (*empty(), bad_offset, bad_id if bounds == Bounds.RAISE else -1)
        if one_tile:
            return ids, rows, -1, -1
        skip, num_ids = 0, n
        if not deterministic:
            ids = grouping.ids.astype(values.dtype)
            ids[_device.xp().arange(n) >= grouping.count] = -1
    else:  # one read: distinct count, first key (-1: the out-of-range ids), error slots
        bad_offset, bad_id = error_positions(read[2:])
        if bad_offset != -1 or bad_id != -1:
            drop_read_back(info)
        if not check:
            bad_offset = bad_id = -1
        if bad_offset != -1 or (bounds == Bounds.RAISE and bad_id != -1):
            return (*empty(), bad_offset, bad_id if bounds == Bounds.RAISE else -1)
        skip = 1 if read[1] < 0 else 0
        num_ids = read[0] - skip
        if num_ids == 0:
            return (*empty(), -1, -1)
        if one_tile:
            return ids[:num_ids], rows[:num_ids], -1, -1
        if not deterministic:
            ids = grouping.ids[skip:skip + num_ids].astype(values.dtype, copy=False)
    if deterministic:  # the ids in the values' dtype come with the rows
        sum_partials(family, grad_out, occ)
        ids = family.empty(num_ids, values.dtype)
        rows = family.empty((num_ids, dim), grad_out.dtype)
        launch(sums.gather, blocks_for(num_ids, tpb // group), tpb, k_grad, *occ.kernel_arrays(),
               grouping.starts, grouping.count, occ.chunk, skip, group, keys,
               ids, family.kernel_array(rows))
        return ids, rows, -1, -1
    ids = _device.to_family(family, ids)
    acc = family.zeros((num_ids, dim), acc_dtype)
    k_acc = family.kernel_array(acc)
    order, bag_of, coef, _ = occ.kernel_arrays()
    launch(sums.scatter, blocks_for(n, tpb // group), tpb,
           k_grad, order, bag_of, coef, grouping.run, skip, group, k_acc)
    if acc_dtype == np.dtype(grad_out.dtype):
        return ids, acc, -1, -1
    rows = family.empty((num_ids, dim), grad_out.dtype)
    launch(cast_kernel(dtype_key(rows.dtype)), blocks_for(acc.size, tpb), tpb,
           k_acc.reshape(acc.size), family.kernel_array(rows).reshape(acc.size))
    return ids, rows, -1, -1
