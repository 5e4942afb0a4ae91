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

Large results that a training loop makes once a step and drops a step later (the CPU
backward's gradient rows) come from :func:`recycled_empty`: glibc returns a freed block
of more than 32 MiB to the system at once, so a new one of that size costs a page fault
per 4 KiB on first touch, which took longer than filling it; a recycled buffer is
touched already.
"""
import math
import os
import threading

import numpy as np

CACHE_LINE_BYTES = 64
#: smaller blocks glibc keeps for reuse itself (its mmap threshold rises to 32 MiB)
RECYCLE_FROM_BYTES = 32 << 20
#: the most bytes :func:`recycled_empty` keeps for reuse (buffers nobody holds)
RECYCLE_KEEP_BYTES = 1 << 30
_KEPT = {}  # size class -> buffers (uint8 arrays on a cache line) nobody holds
_KEPT_BYTES = [0]
_LOCK = threading.Lock()


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


def _size_class(nbytes):
    """``nbytes`` rounded up to an eighth of its power of two: requests that differ by a
    little (a batch's distinct ids) share buffers, at most 1/8 of one unused."""
    step = 1 << max(0, nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class _Loan:
    """An array's memory lent out of the kept buffers: arrays made from it (and their
    views) hold it; when the last of them goes, its buffer is kept for the next
    :func:`recycled_empty` (within :data:`RECYCLE_KEEP_BYTES`)."""

    __slots__ = ("buffer", "size", "__array_interface__")

    def __init__(self, buffer, size, shape, dtype):
        self.buffer, self.size = buffer, size
        self.__array_interface__ = {"shape": shape, "typestr": dtype.str, "version": 3,
                                    "data": (buffer.ctypes.data, False)}

    def __del__(self):
        if _KEPT is None:  # (interpreter shutdown)
            return
        # never waits: a buffer dropped while the lock is held (by another thread, or by
        # this one inside recycled_empty when a collection runs there) is freed, not kept
        if not _LOCK.acquire(blocking=False):
            return
        try:
            if _KEPT_BYTES[0] + self.size <= RECYCLE_KEEP_BYTES:
                _KEPT.setdefault(self.size, []).append(self.buffer)
                _KEPT_BYTES[0] += self.size
        finally:
            _LOCK.release()


def recycled_empty(shape, dtype):
    """An uninitialised C-contiguous NumPy array starting on a cache line, as
    :func:`aligned_empty`; from :data:`RECYCLE_FROM_BYTES` on, its memory is a buffer that
    an earlier such array left (where one of its size class is kept), and goes back to be
    kept when the array and every view of it are gone."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < RECYCLE_FROM_BYTES:
        return aligned_empty(shape, dtype)
    size = _size_class(nbytes)
    with _LOCK:
        kept = _KEPT.get(size)
        buffer = kept.pop() if kept else None
        if buffer is not None:
            _KEPT_BYTES[0] -= size
    if buffer is None:
        buffer = aligned_empty(size, np.uint8)
    return np.asarray(_Loan(buffer, size, shape, dtype))


def release_recycled():
    """Free the buffers :func:`recycled_empty` keeps for reuse (arrays in use keep theirs,
    and leave them to be kept when they go). Returns the bytes freed."""
    with _LOCK:
        freed = _KEPT_BYTES[0]
        _KEPT.clear()
        _KEPT_BYTES[0] = 0
    return freed


def _new_lock():
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # a child forked while another thread held the lock
    os.register_at_fork(after_in_child=_new_lock)
