"""Row gather on the GPU: ``out[i, d] = weights[ids[i], d]``.

Thread mapping: a group of ``G = group_size(D)`` lanes per id, grid-stride over
ids; lane ``d`` copies columns ``d, d+G, ...`` (one thread per output element
when ``D <= 32``; loads and stores coalesced along ``d``). Out-of-range ids
always give zero rows (no out-of-range read in any mode); under
``bounds="raise"`` lane 0 also records the first bad position in an error slot,
read back once. ``"unchecked"`` reads nothing back.
"""
import numpy as np
from numba import cuda

from ._launch import (
    blocks_for,
    error_slots,
    group_size,
    no_error_slots,
    read_error_slots,
    threads_per_block,
)


@cuda.jit(cache=False)
def gather_kernel(table, ids, record, group, out, slots):
    num_rows = table.shape[0]
    dim = table.shape[1]
    tid = cuda.grid(1)
    lane = tid % group
    step = cuda.gridsize(1) // group
    for i in range(tid // group, ids.shape[0], step):
        row = ids[i]
        if row < 0 or row >= num_rows:
            if record and lane == 0:
                cuda.atomic.min(slots, 0, i)
            for d in range(lane, dim, group):
                out[i, d] = np.float32(0)
        else:
            for d in range(lane, dim, group):
                out[i, d] = table[row, d]


def lookup(family, weights, ids, bounds):
    dim = weights.shape[1]
    out = family.empty((ids.shape[0], dim), weights.dtype)
    if ids.shape[0] == 0:
        return out, -1
    stream = family.stream()
    record = bounds == 0
    slots = error_slots(1) if record else no_error_slots()
    group = group_size(dim)
    tpb = threads_per_block()
    gather_kernel[blocks_for(ids.shape[0], tpb // group), tpb, stream](
        family.kernel_array(weights), family.kernel_array(ids), record, group,
        family.kernel_array(out), slots,
    )
    if not record:
        return out, -1
    (bad,) = read_error_slots(slots)
    return out, bad
