"""Pooled lookup on the CPU: chunks of consecutive bags in a parallel loop.

As FBGEMM JIT-generates a kernel per embedding dim, :func:`pool_kernel`
compiles one kernel per ``(D, check_ids, identity)``: with D a compile-time
constant each row is added as explicit SIMD vectors
(:func:`._common.add_row`), and the flags cost nothing when off. Whether
there are per-sample weights is an argument (a branch on a loop invariant,
which LLVM hoists out of the bag's loop): both kinds of bag share a kernel. Ids and
offsets are checked inside the parallel loop (given ``offsets[0] == 0`` and
``offsets[-1] == len(values)``, checked first): a bag whose offsets decrease
is skipped and flagged, a bad id is skipped and the first bad position of
each chunk of bags is kept, so ``bounds="raise"`` costs no extra pass and
no array of the batch's size.
Every cache line of the row :func:`._common.prefetch_ids` ids ahead (about
4 KiB of rows) is prefetched (clamped into the table, so no check is needed),
indices are unsigned so Numba adds no negative-index wraparound, and each bag
is summed in a stack row (:func:`._common.scratch_row`) that LLVM keeps in
vector registers (4 zmm registers at D = 64) and stores once; fp16 and bf16
bags are summed in a float32 stack row and rounded straight into the output
(:func:`._common.narrow_to`), with no float32 array in between. A batch of one
id per bag without weights (from :data:`ONE_ID_MIN_BAGS` bags: categorical
features of one value, the usual DLRM input) takes :func:`one_id_kernel`, a
gather that reads each bag's end only to check it and returns its status as
one scalar, where :func:`pool_kernel` runs a bag loop per id. Kernels are
cached on disk (Numba keys closures by their constants), so each D compiles
once per machine.
"""
import functools
import math

import numpy as np
from numba import prange
from numba.extending import register_jitable

from .._modes import Bounds, Combiner
from ._common import (
    accumulator_dtype,
    add_row,
    cached_njit,
    first_bad_offset,
    kernel_table,
    narrow,
    narrows_in_kernel,
    prefetch_ids,
    prefetch_row,
    scratch_row,
    stack_row_fits,
    store_row,
)

ONE_ID_MIN_BAGS = 256  # batches of one id per bag from this many bags take one_id_kernel
MIN_CHUNK_BAGS, MAX_CHUNKS = 16, 256  # see pool_chunks
NO_WEIGHTS = {np.dtype(t): np.ones(1, t) for t in (np.float32, np.float64)}  # by accumulator
NO_IDS = np.zeros(1, np.int64)
NONE = np.iinfo(np.int64).max  # "no bad position" in the per-bag arrays
NOT_ONE_ID = -1  # one_id_kernel met a bag that does not hold one id


@register_jitable
def pool_chunks(num_bags):
    """How many chunks of consecutive bags the kernels cut a batch into: chunks of at
    least :data:`MIN_CHUNK_BAGS` bags, at most :data:`MAX_CHUNKS` (so at least 4 a
    thread up to 64 threads; Numba hands each thread an equal run of them), at least 1.
    Computed in the kernel from the batch alone: asking Numba for its thread count
    costs a Python call that takes tens of microseconds once the rows a call reads have
    evicted the interpreter's data, and a kernel that asks cannot be cached."""
    return max(1, min(MAX_CHUNKS, (num_bags + MIN_CHUNK_BAGS - 1) // MIN_CHUNK_BAGS))


@register_jitable
def bag_range(offsets, b, last_id, check_ids, bad_offset, c):
    """``(lo, hi, ok)`` of bag ``b``; with ``check_ids``, a bag outside ``[0, last_id]``
    is not ok, and one whose offsets decrease is also flagged in ``bad_offset[c]`` (its
    first of chunk ``c``). Indices are unsigned, so Numba emits no negative-index
    wraparound."""
    lo = offsets[np.uint64(b)]
    hi = offsets[np.uint64(b + 1)]
    if check_ids and not (0 <= lo <= hi <= last_id + 1):
        if hi < lo and bad_offset[c] == NONE:
            bad_offset[c] = b + 1
        return lo, hi, False
    return lo, hi, True


@register_jitable
def combined_scale(combiner, w_sum, w_sq):
    """The factor of a bag's sum: 1 for sum, ``1 / w_sum`` for mean, ``1 / sqrt(w_sq)`` for
    sqrtn, 0 where that denominator is 0."""
    if combiner == Combiner.MEAN:
        return 1.0 / w_sum if w_sum != 0.0 else 0.0
    if combiner == Combiner.SQRTN:
        return 1.0 / math.sqrt(w_sq) if w_sq != 0.0 else 0.0
    return 1.0


@register_jitable
def first_of_chunks(first_bad, bad_offset):
    """``(first bad id position, first bad offset position)`` over the chunks (a serial
    loop: ``.min()`` would be another parallel region)."""
    bad_id, bad_bag = NONE, NONE
    for c in range(first_bad.shape[0]):
        bad_id = min(bad_id, first_bad[c])
        bad_bag = min(bad_bag, bad_offset[c])
    return bad_id, bad_bag


@functools.lru_cache(maxsize=None)
def pool_kernel(dim, check_ids, identity):
    """Kernel ``(table, values, offsets, weighted, weights, combiner, out) -> (bad_id,
    bad_offset)``:
    out[b] = combine_j w_j * table[row_j] over j in [offsets[b], offsets[b+1]),
    w_j = weights[j] when ``weighted``, else 1,
    row_j = values[j] (or j when ``identity``); ``combiner`` a :class:`~hbkernels._modes.Combiner`.
    The bags are cut into :func:`pool_chunks` chunks of equal counts. With
    ``check_ids``: ``bad_id`` is the first position of an id outside the table,
    ``bad_offset`` the first ``b + 1`` with ``offsets[b+1] < offsets[b]`` (the bag is
    skipped), :data:`NONE` where there is none. Needs ``offsets[0] == 0`` and
    ``offsets[-1] == len(values)``."""

    @cached_njit(parallel=True, fastmath=True)
    def pool(table, values, offsets, weighted, weights, combiner, out):
        num_rows = table.shape[0]
        num_bags = offsets.shape[0] - 1
        num_chunks = pool_chunks(num_bags)
        last_id = offsets[num_bags] - 1
        distance = prefetch_ids(dim * table.itemsize)
        first_bad = np.full(num_chunks, NONE, np.int64)  # per chunk
        bad_offset = np.full(num_chunks, NONE, np.int64)
        for c in prange(num_chunks):
            for b in range(c * num_bags // num_chunks, (c + 1) * num_bags // num_chunks):
                lo, hi, ok = bag_range(offsets, b, last_id, check_ids, bad_offset, c)
                if not ok:
                    continue
                acc = scratch_row(dim, out, b)
                for d in range(dim):
                    acc[d] = 0  # sums start at +0.0 (as in torch, NumPy): a bag of -0.0 gives +0.0
                w_sum = 0.0
                w_sq = 0.0
                num_good = hi - lo
                for j in range(lo, hi):
                    ahead = min(j + distance, last_id)
                    ahead_row = ahead if identity else values[np.uint64(ahead)]
                    prefetch_row(table, min(np.uint64(ahead_row), np.uint64(num_rows - 1)), dim)
                    row = np.uint64(j if identity else values[np.uint64(j)])
                    if check_ids and row >= np.uint64(num_rows):  # negatives wrap high
                        if first_bad[c] == NONE:
                            first_bad[c] = j
                        num_good -= 1
                        continue
                    if weighted:
                        w = weights[np.uint64(j)]
                        w_sum += w
                        w_sq += w * w
                        add_row(acc, table, row, w, dim)
                    else:
                        add_row(acc, table, row, None, dim)
                if combiner == Combiner.SUM:
                    store_row(out, b, acc, None, dim)
                    continue
                if not weighted:
                    w_sum = w_sq = num_good
                store_row(out, b, acc, combined_scale(combiner, w_sum, w_sq), dim)
        return first_of_chunks(first_bad, bad_offset)

    return pool


@functools.lru_cache(maxsize=None)
def one_id_kernel(dim):
    """Kernel ``(table, values, offsets, check_ids, out) -> status`` for a
    batch of as many ids as bags, without weights: ``out[b] = table[values[b]]``, zeros
    for an id outside the table, as :func:`pool_kernel` gives it under every combiner.
    ``status``: :data:`NOT_ONE_ID` when a bag does not hold one id (``offsets[b+1] !=
    b+1``, checked for a chunk's bags before it reads a row; the caller then pools
    the batch with :func:`pool_kernel`), else the first position of a bad id (with
    ``check_ids``) or :data:`NONE`. Needs ``offsets[0] == 0``."""

    @cached_njit(parallel=True, fastmath=True)
    def one_id(table, values, offsets, check_ids, out):
        num_rows = table.shape[0]
        num_bags = values.shape[0]
        num_chunks = pool_chunks(num_bags)
        distance = prefetch_ids(dim * table.itemsize)
        first_bad = np.full(num_chunks, NONE, np.int64)
        for c in prange(num_chunks):
            lo = c * num_bags // num_chunks
            hi = (c + 1) * num_bags // num_chunks
            other = False  # a loop of its own, with no branch: it runs as vectors
            for b in range(lo, hi):
                other |= offsets[np.uint64(b + 1)] != b + 1
            if other:
                first_bad[c] = NOT_ONE_ID
                continue
            for b in range(lo, hi):
                ahead = values[np.uint64(min(b + distance, num_bags - 1))]
                prefetch_row(table, min(np.uint64(ahead), np.uint64(num_rows - 1)), dim)
                row = np.uint64(values[np.uint64(b)])  # negatives wrap high
                acc = scratch_row(dim, out, b)
                for d in range(dim):
                    acc[d] = 0
                if row < np.uint64(num_rows):
                    add_row(acc, table, row, None, dim)
                elif check_ids and first_bad[c] == NONE:
                    first_bad[c] = b
                store_row(out, b, acc, None, dim)
        status = first_bad[0]  # a serial loop (.min() would be another parallel region)
        for c in range(1, num_chunks):
            status = min(status, first_bad[c])
        return status

    return one_id


def pool(table, values, offsets, weights, combiner, check_ids, identity):
    """Run the pooling kernel; fp16 and bf16 rows are summed in float32.

    The kernel rounds each bag straight into the output (a 2-byte float row
    is rounded from its stack row); where it cannot (fp16 without F16C, rows
    too wide for the stack), it writes a float32 array that :func:`narrow`
    rounds. Returns ``(out in the table's dtype, first bad offset position or -1,
    first bad id position or -1)``; offsets and ids are checked (bad ids skipped)
    only when ``check_ids``, which needs ``offsets[0] == 0`` and ``offsets[-1] ==
    len(values)``."""
    kernel_tab = kernel_table(table)
    acc_dtype = accumulator_dtype(table.dtype)
    num_bags, dim = offsets.shape[0] - 1, table.shape[1]
    direct = table.dtype == acc_dtype or (
        narrows_in_kernel(table.dtype) and stack_row_fits(dim, np.dtype(acc_dtype).itemsize))
    out = np.empty((num_bags, dim), table.dtype if direct else acc_dtype)
    weighted = weights is not None
    if one_id_batch(values, offsets, weighted, identity):
        status = one_id_kernel(dim)(kernel_tab, values, offsets, check_ids, kernel_table(out))
        if status != NOT_ONE_ID:
            return narrow(out, table.dtype), -1, (-1 if status == NONE else status)
    weights = weights.astype(acc_dtype, copy=False) if weighted else NO_WEIGHTS[acc_dtype]
    kernel = pool_kernel(dim, check_ids, identity)
    bad_id, bad_offset = kernel(kernel_tab, NO_IDS if identity else values, offsets, weighted,
                                weights, combiner, kernel_table(out))
    return (narrow(out, table.dtype), -1 if bad_offset == NONE else bad_offset,
            -1 if bad_id == NONE else bad_id)


def one_id_batch(values, offsets, weighted, identity):
    """Whether :func:`one_id_kernel` may pool the batch: as many ids as bags (at least
    :data:`ONE_ID_MIN_BAGS`), no weights, ``offsets[0] == 0``."""
    num_bags = offsets.shape[0] - 1
    return (not (weighted or identity) and num_bags >= ONE_ID_MIN_BAGS
            and values.shape[0] == num_bags and offsets[0] == 0)


def embedding_bag(family, weights, values, offsets, per_sample_weights, combiner, bounds):
    check = bounds != Bounds.UNCHECKED
    if check and (offsets[0] != 0 or offsets[-1] != values.shape[0]):
        return None, first_bad_offset(offsets, values.shape[0]), -1
    out, bad_offset, bad_id = pool(weights, values, offsets, per_sample_weights, combiner, check,
                                   False)
    if bad_offset != -1:
        return None, bad_offset, -1
    return out, -1, (bad_id if bounds == Bounds.RAISE else -1)
