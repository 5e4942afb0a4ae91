"""Stable partition of ids by owning shard on the GPU: a chunked counting sort.

One thread per id computes its shard (``id % n`` or ``id // block``) and
checks it (negative, or ``>= num_rows`` when given: first bad position by
``atomic.min`` into an error slot, the id then counts as shard 0 so the rest
stays in range). :func:`._scan.bucket_scatter` then sorts the ids by shard
stably: per-(shard, chunk) counts in a shard-major matrix, an exclusive scan,
and an in-order scatter per chunk, so the result equals the CPU's exactly.
The error slot is read back once, at the end.
"""
import numpy as np
from numba import cuda

from ..cpu.partition import shard_block
from ._launch import blocks_for, error_slots, read_error_slots, threads_per_block
from ._scan import bucket_scatter


@cuda.jit
def _shard_of(ids, num_shards, mode, block, limit, shard, err):
    """``shard[i]`` of ``ids[i]``; ``err[0] = min bad i`` (``limit < 0``: no upper limit)."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, ids.shape[0], step):
        v = ids[i]
        if v < 0 or (limit >= 0 and v >= limit):
            cuda.atomic.min(err, 0, i)
            shard[i] = 0
        elif mode == 0:
            shard[i] = v % num_shards
        else:
            s = v // block
            shard[i] = s if s < num_shards else num_shards - 1


def partition(family, ids, num_shards, mode, num_rows):
    n = ids.shape[0]
    stream = family.stream()
    parted = family.empty(n, ids.dtype)
    order = family.empty(n, np.int64)
    if n == 0:
        return parted, family.zeros(num_shards, np.int64), order, -1
    counts = family.empty(num_shards, np.int64)
    block = shard_block(mode, num_rows, num_shards)
    limit = -1 if num_rows is None else num_rows
    tpb = threads_per_block()
    shard = cuda.device_array(n, np.int64, stream=stream)
    err = error_slots(1, stream)
    k_ids = family.kernel_array(ids)
    _shard_of[blocks_for(n, tpb), tpb, stream](
        k_ids, num_shards, mode, block, limit, shard, err
    )
    bucket_scatter(
        shard, num_shards, k_ids, family.kernel_array(parted), family.kernel_array(order),
        counts=family.kernel_array(counts), stream=stream,
    )
    (bad,) = read_error_slots(err, stream)
    if bad != -1:
        return None, None, None, bad
    return parted, counts, order, -1
