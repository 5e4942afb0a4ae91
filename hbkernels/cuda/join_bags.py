"""Several features' CSR bags joined into one batch of bags on the GPU: two copies
(CuPy's ``concatenate``), one host-to-device copy of the features' bounds and one launch
that shifts ids and offsets in place, whatever the number of features."""
import numpy as np
from numba import cuda

from ._launch import blocks_for, threads_per_block
from ._launcher import launch


@cuda.jit(device=True, inline=True)
def feature_of(bounds, base, count, i):
    """The last feature ``f < count`` with ``bounds[base + f] <= i`` (``bounds`` ascending
    from 0: empty features share a bound with the next one)."""
    lo, hi = 0, count - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if bounds[base + mid] <= i:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cuda.jit
def _join_kernel(values, offsets, table, features):
    """``values[j] += start of j's feature``; ``offsets[b + 1] += first value of b's
    feature``. ``table``: the features' first values, first bags and starts."""
    n_values = values.shape[0]
    n_bags = offsets.shape[0] - 1
    for i in range(cuda.grid(1), max(n_values, n_bags), cuda.gridsize(1)):
        if i < n_values:
            values[i] += table[2 * features + feature_of(table, 0, features, i)]
        if i < n_bags:
            offsets[i + 1] += table[feature_of(table, features, features, i)]


def join_bags(family, ids, starts, offsets):
    """``(values, offsets)`` int64: the bags of feature ``k`` (ids ``ids[k]``, CSR offsets
    ``offsets[k]`` from 0) one after the other, each id shifted by ``starts[k]`` (the
    feature's first row in a fused table). Nothing is checked."""
    xp = family.xp
    features = len(ids)
    table = np.empty(3 * features, np.int64)  # first values, first bags, starts
    value, bag = 0, 0
    for k in range(features):
        table[k], table[features + k], table[2 * features + k] = value, bag, starts[k]
        value += ids[k].shape[0]
        bag += offsets[k].shape[0] - 1
    values = xp.concatenate(ids, dtype=np.int64)
    joined = xp.concatenate([offsets[0]] + [o[1:] for o in offsets[1:]], dtype=np.int64)
    if max(value, bag):
        tpb = threads_per_block()
        launch(_join_kernel, blocks_for(max(value, bag), tpb), tpb, family.kernel_array(values),
               family.kernel_array(joined), family.kernel_array(family.put(table)), features)
    return values, joined
