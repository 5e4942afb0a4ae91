"""Backward of the pooled lookup on the CPU: the gradient rows of the distinct ids.

:func:`hbkernels.cpu.grouping.group_occurrences` (shared with the fused
optimizer step of :mod:`.sparse_update`) groups the occurrences by distinct
id, in parallel, as ``(bag, c_b·w_j)`` in input order; then a parallel loop
over distinct ids sums ``coef·grad_out[bag]`` per id, in input order:
deterministic. Zipf ids make a few ids hold many occurrences, so the ids are
cut into per-thread chunks of balanced work (occurrences plus a per-id cost),
not of equal id counts.

Under ``bounds="zero"`` out-of-range ids get no slot and no share of the
denominators. As the forward, one accumulate kernel is compiled per D.
"""
import functools

import numpy as np
from numba import prange

from .._modes import Bounds
from ._common import (accumulator_dtype, add_row, cached_njit, chunk_count, first_bad_offset,
                      first_out_of_range, kernel_table, narrow, prefetch_row)
from .grouping import coefficient, group_occurrences

# LLVM fast-math flags of these kernels: no 'nnan'/'ninf' (the non-finite checks
# must survive) and no 'reassoc' (sums stay in input order).
FASTMATH = {"nsz", "arcp", "contract", "afn"}
# balancing weight of one distinct id against one occurrence (row update vs row add)
ID_COST = 4
# occurrences ahead whose gradient row is prefetched (their bags are scattered over grad_out)
PREFETCH_OCCURRENCES = 16


def balanced_chunks(starts, id_cost=ID_COST):
    """Boundaries (int64, first 0, last K) cutting ids ``[0, K)`` into chunks of about
    equal work ``occurrences + id_cost`` for the parallel loops."""
    num_ids = starts.shape[0] - 1
    num_chunks = chunk_count(num_ids)
    if num_chunks == 1:
        return np.array([0, num_ids], np.int64)
    work = starts[1:] + id_cost * np.arange(1, num_ids + 1, dtype=np.int64)  # cumulative
    targets = np.arange(1, num_chunks, dtype=np.float64) * (work[-1] / num_chunks)
    inner = np.searchsorted(work, targets, side="left") + 1
    return np.concatenate(([0], np.minimum(inner, num_ids), [num_ids])).astype(np.int64)


@functools.lru_cache(maxsize=None)
def accumulate_kernel(dim):
    """Kernel ``(grad, starts, occ_bag, occ_coef, chunks, rows)``:
    ``rows[k] = Σ occ_coef[s]·grad[occ_bag[s]]`` over ``s`` in ``[starts[k], starts[k+1])``
    (``occ_coef`` empty: all ones)."""

    @cached_njit(parallel=True, fastmath=FASTMATH)
    def accumulate(grad, starts, occ_bag, occ_coef, chunks, rows):
        one = np.ones(1, rows.dtype)[0]
        for c in prange(chunks.shape[0] - 1):
            last = starts[chunks[c + 1]] - 1
            for k in range(chunks[c], chunks[c + 1]):
                for d in range(dim):
                    rows[k, d] = 0
                row = rows[k]
                for s in range(starts[k], starts[k + 1]):
                    prefetch_row(grad, occ_bag[min(s + PREFETCH_OCCURRENCES, last)], dim)
                    add_row(row, grad, occ_bag[s], coefficient(occ_coef, s, one), dim)

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
    ids, starts, occ_bag, occ_coef = group_occurrences(
        values, offsets, per_sample_weights, combiner, num_rows, bounds != Bounds.UNCHECKED, acc_dtype)
    rows = np.empty((ids.shape[0], dim), acc_dtype)
    if ids.shape[0]:
        kernel_grad = kernel_table(np.ascontiguousarray(grad_out))
        accumulate_kernel(dim)(kernel_grad, starts, occ_bag, occ_coef,
                               balanced_chunks(starts), rows)
    return ids, narrow(rows, grad_out.dtype)
