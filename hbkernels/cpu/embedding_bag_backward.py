"""Backward of the pooled lookup on the CPU: the gradient rows of the distinct ids.

Grouping (shared with the fused optimizer step of :mod:`.sparse_update`):

1. :func:`hbkernels.cpu.unique.hash_unique` gives the distinct ids in first
   occurrence order, the inverse and the counts;
2. one sequential pass over the bags computes each bag's scale ``c_b`` (1,
   ``1/Σw`` or ``1/sqrt(Σw²)``, 0 where the denominator is 0) and places every
   occurrence ``j`` by a counting sort on its distinct id: the occurrences of
   id ``k`` land in ``[starts[k], starts[k+1])`` as ``(bag, c_b·w_j)``, in input
   order (stable), so every sum below runs in input order: deterministic;
3. a parallel loop over distinct ids sums ``coef·grad_out[bag]`` per id.
   Zipf ids put the hot ids first (first-occurrence order), so the ids are
   cut into per-thread chunks of balanced work (occurrences plus a per-id
   cost), not of equal id counts.

Under ``bounds="zero"`` out-of-range ids get no slot and no share of the
denominators. As the forward, one accumulate kernel is compiled per D.
"""
import functools
import math

import numba
import numpy as np
from numba import prange

from .._modes import Bounds, Combiner
from ._common import (accumulator_dtype, add_row, cached_njit, first_bad_offset, first_out_of_range,
                      kernel_table, narrow)
from .unique import hash_unique

# LLVM fast-math flags of these kernels: no 'nnan'/'ninf' (the non-finite checks
# must survive) and no 'reassoc' (sums stay in input order).
FASTMATH = {"nsz", "arcp", "contract", "afn"}
# balancing weight of one distinct id against one occurrence (row update vs row add)
ID_COST = 4
CHUNKS_PER_THREAD = 4


@cached_njit()
def _place(values, offsets, weights, weighted, combiner, num_rows, skip_bad, uniq, inverse,
           counts):
    """Drop bad distinct ids (``skip_bad``), then counting-sort the occurrences by
    distinct id with their bag and coefficient ``c_b·w_j`` (dtype of ``weights``)."""
    num_uniq = uniq.shape[0]
    remap = np.empty(num_uniq, np.int64)
    num_ids = 0
    for u in range(num_uniq):
        v = uniq[u]
        if skip_bad and (v < 0 or v >= num_rows):
            remap[u] = -1
        else:
            remap[u] = num_ids
            num_ids += 1
    ids = np.empty(num_ids, uniq.dtype)
    starts = np.empty(num_ids + 1, np.int64)
    total = 0
    for u in range(num_uniq):
        k = remap[u]
        if k >= 0:
            ids[k] = uniq[u]
            starts[k] = total
            total += counts[u]
    starts[num_ids] = total
    fill = starts[:num_ids].copy()
    occ_bag = np.empty(total, np.int64)
    occ_coef = np.empty(total, weights.dtype)
    for b in range(offsets.shape[0] - 1):
        lo, hi = offsets[b], offsets[b + 1]
        scale = 1.0
        if combiner != Combiner.SUM:
            w_sum = 0.0
            w_sq = 0.0
            for j in range(lo, hi):
                if remap[inverse[j]] < 0:
                    continue
                w = weights[j] if weighted else 1.0
                w_sum += w
                w_sq += w * w
            if combiner == Combiner.MEAN:
                scale = 1.0 / w_sum if w_sum != 0.0 else 0.0
            else:
                scale = 1.0 / math.sqrt(w_sq) if w_sq != 0.0 else 0.0
        for j in range(lo, hi):
            k = remap[inverse[j]]
            if k < 0:
                continue
            slot = fill[k]
            fill[k] = slot + 1
            occ_bag[slot] = b
            occ_coef[slot] = scale * weights[j] if weighted else scale
    return ids, starts, occ_bag, occ_coef


def group_occurrences(values, offsets, per_sample_weights, combiner, num_rows, skip_bad,
                      coef_dtype):
    """``(ids, starts, occ_bag, occ_coef)``: the distinct (in-range when ``skip_bad``)
    ids in first-occurrence order and their occurrences in input order, as
    ``(bag, c_b·w_j)`` in ``[starts[k], starts[k+1])``; coefficients in ``coef_dtype``."""
    uniq, inverse, counts = hash_unique(values, True, True)
    weighted = per_sample_weights is not None
    weights = (per_sample_weights.astype(coef_dtype, copy=False) if weighted
               else np.ones(1, coef_dtype))
    return _place(values, offsets, weights, weighted, combiner, num_rows, skip_bad, uniq,
                  inverse, counts)


def balanced_chunks(starts, id_cost=ID_COST, chunks_per_thread=CHUNKS_PER_THREAD):
    """Boundaries (int64, first 0, last K) cutting ids ``[0, K)`` into chunks of about
    equal work ``occurrences + id_cost`` for the parallel loops."""
    num_ids = starts.shape[0] - 1
    num_chunks = max(1, min(num_ids, numba.get_num_threads() * chunks_per_thread))
    if num_chunks == 1:
        return np.array([0, num_ids], np.int64)
    work = starts[1:] + id_cost * np.arange(1, num_ids + 1, dtype=np.int64)  # cumulative
    targets = np.arange(1, num_chunks, dtype=np.float64) * (work[-1] / num_chunks)
    inner = np.searchsorted(work, targets, side="left") + 1
    return np.concatenate(([0], np.minimum(inner, num_ids), [num_ids])).astype(np.int64)


@functools.lru_cache(maxsize=None)
def accumulate_kernel(dim):
    """Kernel ``(grad, starts, occ_bag, occ_coef, chunks, rows)``:
    ``rows[k] = Σ occ_coef[s]·grad[occ_bag[s]]`` over ``s`` in ``[starts[k], starts[k+1])``."""

    @cached_njit(parallel=True, fastmath=FASTMATH)
    def accumulate(grad, starts, occ_bag, occ_coef, chunks, rows):
        for c in prange(chunks.shape[0] - 1):
            for k in range(chunks[c], chunks[c + 1]):
                for d in range(dim):
                    rows[k, d] = 0
                row = rows[k]
                for s in range(starts[k], starts[k + 1]):
                    add_row(row, grad, occ_bag[s], occ_coef[s], dim)

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
