"""Hash-based dedup on the CPU: open addressing with linear probing, first-occurrence order.

The table starts small and doubles at half load, so it stays cache-resident
when there are few distinct ids (the Zipf case) and never needs a sort. A slot
is the top bits of ``splitmix64(id)``, not of the Fibonacci hash that
partitions ids in :mod:`.grouping`: ids that arrive grouped by those bits (the
backward's distinct ids do) would otherwise fill one stretch of the table at a
time and probe along it.
"""
import numpy as np
from numba import njit

from ._common import cached_njit, splitmix64

_MIN_BITS = 10


@njit(inline="always")
def _slot(key, shift):
    return np.int64(splitmix64(np.uint64(key)) >> np.uint64(shift))


@cached_njit()
def _rehash(uniq, num_uniq, bits):
    size = 1 << bits
    slots = np.full(size, -1, np.int64)
    mask = size - 1
    shift = 64 - bits
    for u in range(num_uniq):
        h = _slot(uniq[u], shift)
        while slots[h] != -1:
            h = (h + 1) & mask
        slots[h] = u
    return slots


@cached_njit()
def hash_unique(ids, want_inverse, want_counts):
    """(uniq, inverse, counts): distinct ids in first-occurrence order."""
    n = ids.shape[0]
    uniq = np.empty(n, ids.dtype)
    inverse = np.empty(n if want_inverse else 0, np.int64)
    counts = np.zeros(n if want_counts else 0, np.int64)
    bits = _MIN_BITS
    slots = np.full(1 << bits, -1, np.int64)
    num_uniq = 0
    for i in range(n):
        key = ids[i]
        mask = (1 << bits) - 1
        h = _slot(key, 64 - bits)
        while True:
            u = slots[h]
            if u == -1:
                u = num_uniq
                slots[h] = u
                uniq[u] = key
                num_uniq += 1
                if 2 * num_uniq > (1 << bits):
                    bits += 1
                    slots = _rehash(uniq, num_uniq, bits)
                break
            if uniq[u] == key:
                break
            h = (h + 1) & mask
        if want_inverse:
            inverse[i] = u
        if want_counts:
            counts[u] += 1
    return uniq[:num_uniq], inverse, counts[:num_uniq]


@cached_njit()
def _sort_distinct(uniq, inverse, counts):
    order = np.argsort(uniq)
    rank = np.empty(order.shape[0], np.int64)
    for r in range(order.shape[0]):
        rank[order[r]] = r
    for i in range(inverse.shape[0]):
        inverse[i] = rank[inverse[i]]
    sorted_counts = counts[order] if counts.shape[0] else counts
    return uniq[order], inverse, sorted_counts


def unique(family, ids, return_inverse, return_counts, sorted):
    uniq, inverse, counts = hash_unique(ids, return_inverse, return_counts)
    if sorted:
        uniq, inverse, counts = _sort_distinct(uniq, inverse, counts)
    return uniq.copy(), inverse, counts.copy()
