"""Unsorted segment sum on the CPU: serial over rows, parallel over column blocks."""
import numpy as np
from numba import njit, prange

from ._common import accumulator_dtype, first_out_of_range, kernel_table, widen

COLUMN_BLOCK = 16


@njit(parallel=True, cache=True)
def scatter_add_rows(data, lut, segment_ids, skip_bad, out):
    num_segments = out.shape[0]
    dim = data.shape[1]
    for block in prange((dim + COLUMN_BLOCK - 1) // COLUMN_BLOCK):
        d0 = block * COLUMN_BLOCK
        d1 = min(d0 + COLUMN_BLOCK, dim)
        for i in range(data.shape[0]):
            s = segment_ids[i]
            if skip_bad and (s < 0 or s >= num_segments):
                continue
            for d in range(d0, d1):
                out[s, d] += widen(data[i, d], lut)


def segment_sum(family, data, segment_ids, num_segments, bounds):
    if bounds == 0:
        bad = first_out_of_range(segment_ids, num_segments)
        if bad != -1:
            return None, bad
    kernel_data, lut = kernel_table(data)
    acc = np.zeros((num_segments, data.shape[1]), accumulator_dtype(data.dtype))
    scatter_add_rows(kernel_data, lut, segment_ids, bounds == 1, acc)
    return (acc if acc.dtype == data.dtype else acc.astype(data.dtype)), -1
