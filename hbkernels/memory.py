"""Host memory for tables: NumPy arrays that start on a cache line.

NumPy's large arrays start 16 bytes into a page (glibc's ``malloc`` header), so
every row of 64 bytes or a multiple of it straddles one cache line more than it
needs: a 256-byte row (D = 64, fp32) spans 5 lines instead of 4, a 64-byte row
(D = 16) 2 instead of 1. Lookups wait on lines, so on the 2-core EPYC of
``bench/results/amd-epyc.md`` ``embedding_bag`` at D = 64 ran 1.04-1.7x faster
on an aligned copy of the same table, for hbkernels and torch alike (torch's
own tensors are 64-byte aligned). Tables that hbkernels makes on the CPU
(:class:`hbkernels.EmbeddingCollection`, optimizer state) use
:func:`aligned_empty`; CuPy's allocations already start on 256 bytes.
"""
import math

import numpy as np

CACHE_LINE_BYTES = 64


def aligned_empty(shape, dtype=np.float32, *, alignment=CACHE_LINE_BYTES):
    """An uninitialised C-contiguous NumPy array whose data start on a multiple of
    ``alignment`` bytes (a power of two; default a cache line; at least the
    dtype's own alignment).

    >>> import numpy as np, hbkernels as hbk
    >>> w = hbk.aligned_empty((1000, 64), np.float32)
    >>> w.ctypes.data % 64, w.shape, w.dtype.name
    (0, (1000, 64), 'float32')
    """
    alignment = int(alignment)
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    dtype = np.dtype(dtype)
    alignment = max(alignment, dtype.alignment)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"shape must not be negative, got {shape}")
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = np.empty(nbytes + alignment, np.uint8)
    start = -buffer.ctypes.data % alignment
    return buffer[start:start + nbytes].view(dtype).reshape(shape)


def aligned_full(shape, value, dtype=np.float32, *, alignment=CACHE_LINE_BYTES):
    """:func:`aligned_empty` filled with ``value``."""
    out = aligned_empty(shape, dtype, alignment=alignment)
    out[...] = value
    return out
