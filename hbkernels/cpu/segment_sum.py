"""Unsorted segment sum on the CPU: out[s] = Σ data[i] over i with segment_ids[i] == s.

Scatter-adds race when rows share a segment, so each of the T threads owns
the segments ``s % T == t``: every thread scans all segment ids and adds only
the rows it owns (ids are read T times, each data row once, no atomics, and
the summation order per segment is the input order: deterministic). As in
:mod:`.embedding_bag`, one kernel is compiled per row width D (and for integer data,
int32 or int64, summed in its dtype).
"""
import functools

import numba
import numpy as np
from numba import prange

from .._modes import Bounds
from ._common import accumulator_dtype, add_row, cached_njit, first_out_of_range, kernel_table, narrow


@functools.lru_cache(maxsize=None)
def scatter_add_kernel(dim, skip_bad, integer=False):
    """Kernel ``(data, segment_ids, num_owners, out)`` adding rows into ``out``
    (``integer``: int32/int64 rows in their dtype, wrapping on overflow)."""

    @cached_njit(parallel=True, fastmath=not integer)
    def scatter_add(data, segment_ids, num_owners, out):
        num_segments = out.shape[0]
        for owner in prange(num_owners):
            for i in range(segment_ids.shape[0]):
                s = segment_ids[i]
                if skip_bad and (s < 0 or s >= num_segments):
                    continue
                if s % num_owners != owner:
                    continue
                if integer:
                    for d in range(dim):
                        out[s, d] += data[i, d]
                else:
                    add_row(out[s], data, i, None, dim)

    return scatter_add


def segment_sum(family, data, segment_ids, num_segments, bounds):
    if bounds == Bounds.RAISE:
        bad = first_out_of_range(segment_ids, num_segments)
        if bad != -1:
            return None, bad
    integer = data.dtype.kind == "i"
    acc = np.zeros((num_segments, data.shape[1]),
                   data.dtype if integer else accumulator_dtype(data.dtype))
    owners = max(1, min(numba.get_num_threads(), num_segments))
    scatter_add_kernel(data.shape[1], bounds == Bounds.ZERO, integer)(
        data if integer else kernel_table(data), segment_ids, owners, acc)
    return (acc if integer else narrow(acc, data.dtype)), -1
