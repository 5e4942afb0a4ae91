"""Warp shuffles, on a GPU and in Numba's simulator.

``shfl_idx(mask, value, src)`` returns ``value`` of lane ``src`` (0-31, in this
thread's warp); ``shfl_xor(mask, value, m)`` that of lane ``lane ^ m``. ``mask``
names the lanes taking part: every lane in it must make the same call
(:func:`group_mask` gives a row group's lanes). ``match_any(value)`` (every lane of
a full warp calls it) returns the mask of the lanes holding the same ``value``. On
a GPU these are ``cuda.shfl_sync`` and ``cuda.match_any_sync``. The simulator has no
shuffles; there a lane writes its value to its warp's exchange row, waits at the
simulator's barrier (which releases when every live thread of the block waits at
one), reads the source lane's entry (or every lane's) and waits again. Lanes of one row group run the same sequence of barriers, so the
exchange is exact as long as values only move inside a group, which is how the
kernels use it.
"""
import threading
import weakref

import numpy as np
from numba import cuda

from .._machine import simulator_enabled

FULL_MASK = np.uint32(0xFFFFFFFF)


@cuda.jit(device=True, inline=True)
def group_mask(lane_in_warp, group):
    """The lanes of the ``group``-lane row group (a power of two <= 32) holding
    ``lane_in_warp``, as a shuffle mask."""
    if group >= 32:
        return FULL_MASK
    ones = (np.uint32(1) << np.uint32(group)) - np.uint32(1)
    return ones << np.uint32(lane_in_warp - lane_in_warp % group)


if simulator_enabled():
    _LOCK = threading.Lock()
    _EXCHANGE = weakref.WeakKeyDictionary()  # block manager -> {warp: 32 values}

    def _slots():
        thread = threading.current_thread()
        with _LOCK:
            warps = _EXCHANGE.setdefault(thread._manager, {})
            return thread, warps.setdefault(thread.thread_id // 32, [None] * 32)

    def shfl_idx(mask, value, src):
        thread, slots = _slots()
        slots[thread.thread_id % 32] = value
        thread.syncthreads()
        out = slots[int(src) % 32]
        thread.syncthreads()
        return out

    def shfl_xor(mask, value, lane_mask):
        lane = threading.current_thread().thread_id % 32
        return shfl_idx(mask, value, lane ^ int(lane_mask))

    def match_any(value):
        thread, slots = _slots()
        slots[thread.thread_id % 32] = value
        thread.syncthreads()
        peers = sum(1 << k for k, other in enumerate(slots) if other is not None and other == value)
        thread.syncthreads()
        return np.uint32(peers)

else:

    @cuda.jit(device=True, inline=True)
    def shfl_idx(mask, value, src):
        return cuda.shfl_sync(mask, value, src)

    @cuda.jit(device=True, inline=True)
    def shfl_xor(mask, value, lane_mask):
        return cuda.shfl_xor_sync(mask, value, lane_mask)

    @cuda.jit(device=True)
    def match_any(value):
        return cuda.match_any_sync(FULL_MASK, value)
