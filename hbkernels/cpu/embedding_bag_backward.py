"""Backward of the pooled lookup on the CPU: the gradient rows of the distinct ids.

:func:`hbkernels.cpu.grouping.group_occurrences` (shared with the fused
optimizer step of :mod:`.sparse_update`) groups the occurrences by distinct id
inside hash partitions, in parallel; then a parallel loop over the partitions
walks each one's occurrences in input order and adds ``c_b·w_j·grad_out[bag]``
into the output row of its distinct id (the partition's rows are one block of
the output, in cache): every row is summed in input order, deterministic.

Under ``bounds="zero"`` out-of-range ids get no slot and no share of the
denominators. As the forward, one accumulate kernel is compiled per D.
"""
import functools

import numpy as np
from numba import njit, prange

from .._modes import Bounds
from ..memory import recycled_empty
from ._common import (accumulator_dtype, add_row, cached_njit, first_bad_offset,
                      first_out_of_range, kernel_table, narrow, prefetch_row)
from .grouping import coefficient, group_occurrences

# LLVM fast-math flags of these kernels: no 'nnan'/'ninf' (the non-finite checks
# must survive) and no 'reassoc' (sums stay in input order).
FASTMATH = {"nsz", "arcp", "contract", "afn"}
# occurrences ahead whose gradient row is prefetched (their bags are scattered over grad_out)
PREFETCH_OCCURRENCES = 16


@njit(inline="always")
def sum_partition(rows, base, n, grad, bags, coefs, local, lo, hi, one, dim):
    """Rows ``base .. base + n - 1`` of ``rows`` become the gradient rows of one partition's
    ``n`` distinct ids: ``rows[base + u] = Σ coefs[i]·grad[bags[i]]`` over its occurrences
    ``i`` in ``[lo, hi)`` with ``local[i] == u``, in input order (``coefs`` empty: all
    ones, ``one`` in the rows' type). Shared by the backward and the fused step."""
    for u in range(n):
        for d in range(dim):
            rows[base + u, d] = 0
    for i in range(lo, hi):
        prefetch_row(grad, bags[min(i + PREFETCH_OCCURRENCES, hi - 1)], dim)
        add_row(rows[base + local[i]], grad, bags[i], coefficient(coefs, i, one), dim)


@functools.lru_cache(maxsize=None)
def accumulate_kernel(dim):
    """Kernel ``(grad, part_lo, bags, coefs, local, part_ids, first, ids, rows)`` over a
    :class:`.grouping.Groups` (``part_lo``, ``bags``, ``coefs`` its partitions';
    ``coefs`` empty: all ones): the ``u``-th distinct id of partition ``p`` is
    ``k = first[p] + u``, ``ids[k] = part_ids[part_lo[p] + u]`` and ``rows[k]`` its
    gradient row (:func:`sum_partition`)."""

    @cached_njit(parallel=True, fastmath=FASTMATH)
    def accumulate(grad, part_lo, bags, coefs, local, part_ids, first, ids, rows):
        one = np.ones(1, rows.dtype)[0]
        for p in prange(part_lo.shape[0] - 1):
            lo, hi = part_lo[p], part_lo[p + 1]
            base, n = first[p], first[p + 1] - first[p]
            for u in range(n):
                ids[base + u] = part_ids[lo + u]
            sum_partition(rows, base, n, grad, bags, coefs, local, lo, hi, one, dim)

    return accumulate


def first_errors(values, offsets, num_rows, bounds):
    """``(bad_offset, bad_id)`` as the forward: offsets under raise/zero, ids under raise."""
    if bounds == Bounds.UNCHECKED:
        return -1, -1
    bad_offset = first_bad_offset(offsets, values.shape[0])
    if bad_offset != -1:
        return bad_offset, -1
    if bounds == Bounds.RAISE:
        return -1, first_out_of_range(values, num_rows)
    return -1, -1


def embedding_bag_backward(family, grad_out, values, offsets, num_rows, per_sample_weights,
                           combiner, bounds, deterministic, padded=False):
    """The CPU is always deterministic: ``deterministic`` is accepted and ignored.
    ``padded``: one entry per value, the distinct ids first, then id -1 and zero rows."""
    bad_offset, bad_id = first_errors(values, offsets, num_rows, bounds)
    if bad_offset != -1 or bad_id != -1:
        return None, None, bad_offset, bad_id
    ids, rows = _sparse_grad(grad_out, values, offsets, num_rows, per_sample_weights, combiner,
                             bounds)
    if padded:
        pad = values.shape[0] - ids.shape[0]
        ids = np.concatenate([ids, np.full(pad, -1, values.dtype)])
        rows = np.concatenate([rows, np.zeros((pad, rows.shape[1]), rows.dtype)])
    return ids, rows, -1, -1


def _sparse_grad(grad_out, values, offsets, num_rows, per_sample_weights, combiner, bounds):
    dim = grad_out.shape[1]
    acc_dtype = accumulator_dtype(grad_out.dtype)
    if values.shape[0] == 0 or offsets.shape[0] < 2:
        return np.zeros(0, values.dtype), np.zeros((0, dim), grad_out.dtype)
    groups = group_occurrences(values, offsets, per_sample_weights, combiner, num_rows,
                               bounds != Bounds.UNCHECKED, acc_dtype)
    ids = np.empty(groups.count, values.dtype)
    rows = recycled_empty((groups.count, dim), acc_dtype)  # (a step's rows, dropped the next)
    if groups.count:
        parts = groups.parts
        accumulate_kernel(dim)(kernel_table(np.ascontiguousarray(grad_out)), parts.lo, parts.bag,
                               parts.coef, groups.local, groups.ids, groups.first, ids, rows)
    return ids, narrow(rows, grad_out.dtype)
