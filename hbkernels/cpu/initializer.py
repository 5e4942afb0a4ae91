"""Initial rows of embedding tables on the CPU, for
:func:`hbkernels.sharding.initial_weights`: element ``(row, column)`` is
``(2u - 1)·scale`` with ``u`` the top 24 bits of ``splitmix64((row·dim + column) ^ key)``
over ``2^24`` (64-bit arithmetic, wrapping; a negative row, a dynamic table's id, as
its two's complement), in float64, one parallel pass."""
import numpy as np
from numba import prange

from ._common import cached_njit, splitmix64

_UNIT = 1.0 / (1 << 24)


@cached_njit(parallel=True)
def _uniform_rows(key, rows, dim, c0, c1, scale, out):
    for i in prange(rows.shape[0]):
        base = np.uint64(rows[i]) * np.uint64(dim)
        for c in range(c0, c1):
            bits = splitmix64((base + np.uint64(c)) ^ key)
            out[i, c - c0] = (2.0 * (np.float64(bits >> np.uint64(40)) * _UNIT) - 1.0) * scale


def uniform_rows(key, rows, dim, c0, c1, scale):
    """``[len(rows), c1 - c0]`` float64: columns ``[c0, c1)`` of rows ``rows`` (int64)."""
    out = np.empty((rows.shape[0], c1 - c0), np.float64)
    _uniform_rows(np.uint64(key), rows, dim, c0, c1, float(scale), out)
    return out
