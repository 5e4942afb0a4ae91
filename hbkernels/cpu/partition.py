"""Stable partition of ids by owning shard on the CPU: a counting sort over shards."""
import numpy as np

from .._modes import PartitionMode, shard_block
from ._common import cached_njit, first_out_of_range


@cached_njit()
def counting_sort_by_shard(ids, num_shards, mode, block):
    n = ids.shape[0]
    shard = np.empty(n, np.int64)
    counts = np.zeros(num_shards, np.int64)
    for i in range(n):
        s = ids[i] % num_shards if mode == PartitionMode.MOD else ids[i] // block
        shard[i] = s
        counts[s] += 1
    start = np.empty(num_shards, np.int64)
    total = 0
    for s in range(num_shards):
        start[s] = total
        total += counts[s]
    parted = np.empty_like(ids)
    order = np.empty(n, np.int64)
    for i in range(n):
        k = start[shard[i]]
        start[shard[i]] = k + 1
        parted[k] = ids[i]
        order[k] = i
    return parted, counts, order


def partition(family, ids, num_shards, mode, num_rows):
    bad = first_out_of_range(ids, -1 if num_rows is None else num_rows)
    if bad != -1:
        return None, None, None, bad
    block = shard_block(mode, num_rows, num_shards)
    parted, counts, order = counting_sort_by_shard(ids, num_shards, mode, block)
    return parted, counts, order, -1
