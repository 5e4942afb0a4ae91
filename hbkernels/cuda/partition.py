"""Stable partition of ids by owning shard on the GPU.

One thread per id computes its shard (``id % n`` or ``id // block``) and checks
it (negative, or ``>= num_rows`` when given: first bad position by
``atomic.min`` into an error slot; the id then counts as shard 0 so the rest
stays in range). The shards are then sorted stably (:func:`._segments.stable_argsort`:
CUB radix sort on a GPU), ``counts`` come from a binary search of the sorted
shards, so the result equals the CPU's exactly. The error slot is read back
once, at the end.
"""
import numpy as np
from numba import cuda

from .._modes import PartitionMode, shard_block
from . import _device
from ._launch import blocks_for, error_slots, read_error_slots, threads_per_block
from ._launcher import launch
from ._segments import stable_argsort


@cuda.jit
def _shard_of(ids, num_shards, mode, block, limit, shard, err):
    """``shard[i]`` of ``ids[i]``; ``err[0] = min bad i`` (``limit < 0``: no upper limit)."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, ids.shape[0], step):
        v = np.int64(ids[i])  # 64-bit arithmetic whatever the ids' dtype: block may pass 2^31
        if v < 0 or (limit >= 0 and v >= limit):
            cuda.atomic.min(err, 0, i)
            shard[i] = 0
        elif mode == PartitionMode.MOD:
            shard[i] = v % num_shards
        else:
            s = v // block
            shard[i] = s if s < num_shards else num_shards - 1


def partition(family, ids, num_shards, mode, num_rows):
    n = ids.shape[0]
    if n == 0:
        return family.empty(0, ids.dtype), family.zeros(num_shards, np.int64), \
            family.empty(0, np.int64), -1
    xp = _device.xp()
    block = shard_block(mode, num_rows, num_shards)
    limit = -1 if num_rows is None else num_rows
    tpb = threads_per_block()
    shard = _device.scratch(n, np.int64)
    err = error_slots(1)
    launch(_shard_of, blocks_for(n, tpb), tpb, family.kernel_array(ids), num_shards, mode, block,
           limit, shard, err)
    order = stable_argsort(xp, shard)
    bounds = xp.searchsorted(shard[order], xp.arange(num_shards + 1), side="left")
    (bad,) = read_error_slots(err)
    if bad != -1:
        return None, None, None, bad
    parted = _device.array(family.kernel_array(ids))[order]
    return (_device.to_family(family, parted), _device.to_family(family, xp.diff(bounds)),
            _device.to_family(family, order.astype(np.int64)), -1)
