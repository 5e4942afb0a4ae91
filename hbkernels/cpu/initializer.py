"""Initial rows of embedding tables on the CPU, for
:func:`hbkernels.sharding.initial_weights`: row ``row`` (a dynamic table's id, any
int64; a negative one as its two's complement) of the table whose 64-bit key is
``key`` gets the state ``s = splitmix64(row ^ key)``, and its element ``column`` is
``(2u - 1)·scale`` with ``u`` the top 24 bits of ``splitmix64(s + column·γ)`` over
``2^24`` (``γ = 0x9E3779B97F4A7C15``, 64-bit wrapping arithmetic): a row's values are
the outputs of a SplitMix64 generator started at ``s``. ``row -> s`` is a bijection
and so is ``s -> s + column·γ``, so two distinct rows never share the 64-bit draw of
any one column (let alone a whole row). Computed in float64, one parallel pass."""
import numpy as np
from numba import prange

from ._common import cached_njit, splitmix64

_UNIT = 1.0 / (1 << 24)
_GAMMA = np.uint64(0x9E3779B97F4A7C15)


@cached_njit(parallel=True)
def _uniform_rows(key, rows, c0, c1, scale, out):
    for i in prange(rows.shape[0]):
        state = splitmix64(np.uint64(rows[i]) ^ key)
        for c in range(c0, c1):
            bits = splitmix64(state + np.uint64(c) * _GAMMA)
            out[i, c - c0] = (2.0 * (np.float64(bits >> np.uint64(40)) * _UNIT) - 1.0) * scale


def uniform_rows(key, rows, c0, c1, scale):
    """``[len(rows), c1 - c0]`` float64: columns ``[c0, c1)`` of rows ``rows`` (int64)."""
    out = np.empty((rows.shape[0], c1 - c0), np.float64)
    _uniform_rows(np.uint64(key), rows, c0, c1, float(scale), out)
    return out
