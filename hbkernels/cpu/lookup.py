"""Row gather on the CPU."""
import numpy as np
from numba import prange

from .._modes import Bounds
from ._common import cached_njit, first_out_of_range


@cached_njit(parallel=True)
def gather_rows(table, ids, zero_bad, out):
    num_rows = table.shape[0]
    for i in prange(ids.shape[0]):
        row = ids[i]
        if zero_bad and (row < 0 or row >= num_rows):
            out[i, :] = 0
        else:
            out[i, :] = table[row, :]


def lookup(family, weights, ids, bounds):
    """``(out [ids.size, D], -1)`` of the ids (any shape, gathered in C order), or
    ``(None, the first bad flat position)`` under ``bounds="raise"``."""
    ids = ids.reshape(-1)
    if bounds == Bounds.RAISE:
        bad = first_out_of_range(ids, weights.shape[0])
        if bad != -1:
            return None, bad
    out = np.empty((ids.shape[0], weights.shape[1]), weights.dtype)
    if weights.dtype.itemsize == 2:  # fp16/bf16 copied as bits: Numba has no CPU float16
        gather_rows(weights.view(np.uint16), ids, bounds == Bounds.ZERO, out.view(np.uint16))
    else:
        gather_rows(weights, ids, bounds == Bounds.ZERO, out)
    return out, -1
