"""CSR segment reduction on the CPU: the pooling kernel of embedding_bag over rows in place;
integer data (int32, int64; sums only) a loop of its own, summing in its dtype."""
import numpy as np
from numba import prange

from ._common import cached_njit, first_bad_offset
from .embedding_bag import pool


@cached_njit(parallel=True)
def _int_sums(data, offsets, out):
    for b in prange(out.shape[0]):
        for j in range(offsets[b], offsets[b + 1]):
            for d in range(out.shape[1]):
                out[b, d] += data[j, d]


def segment_reduce(family, data, offsets, combiner):
    bad_offset = first_bad_offset(offsets, data.shape[0])
    if bad_offset != -1:
        return None, bad_offset
    if data.dtype.kind == "i":  # combiner sum (ops checks)
        out = np.zeros((offsets.shape[0] - 1, data.shape[1]), data.dtype)
        _int_sums(data, offsets, out)
        return out, -1
    out, _, _ = pool(data, None, offsets, None, combiner, False, True)
    return out, -1
