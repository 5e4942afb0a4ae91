"""Several features' CSR bags joined into one batch of bags, on the CPU."""
import numpy as np


def join_bags(family, ids, starts, offsets):
    """``(values, offsets)`` int64: the bags of feature ``k`` (ids ``ids[k]``, CSR offsets
    ``offsets[k]`` from 0) one after the other, each id shifted by ``starts[k]`` (the
    feature's first row in a fused table). Nothing is checked."""
    values = np.concatenate([np.asarray(i, np.int64) + int(s) for i, s in zip(ids, starts)])
    joined, base = [np.zeros(1, np.int64)], 0
    for i, o in zip(ids, offsets):
        joined.append(np.asarray(o[1:], np.int64) + base)
        base += int(i.shape[0])
    return values, np.concatenate(joined)
