"""CSR input checks on the GPU: the first bad offset, then the first id out of range."""
from numba import cuda

from .._modes import Bounds
from ._launch import blocks_for, error_slots, read_error_slots, threads_per_block
from .embedding_bag import check_bag_offsets, empty_batch_bad_offset


@cuda.jit
def _ragged_kernel(values, offsets, n_values, num_rows, record_ids, slots):
    num_bags = offsets.shape[0] - 1
    for i in range(cuda.grid(1), max(num_bags, n_values), cuda.gridsize(1)):
        if i < num_bags:
            check_bag_offsets(slots, i, offsets[i], offsets[i + 1], num_bags, n_values)
        if record_ids and i < n_values:
            v = values[i]
            if v < 0 or v >= num_rows:
                cuda.atomic.min(slots, 1, i)


def check_ragged(family, values, offsets, num_rows, bounds):
    """``(first bad offset, first bad id)`` of CSR input (-1: none), as the forward
    reports them: ``Bounds.RAISE`` checks offsets and ids, ``Bounds.ZERO`` offsets
    only, ``Bounds.UNCHECKED`` nothing (no launch, no sync)."""
    num_bags = offsets.shape[0] - 1
    n = values.shape[0]
    if bounds == Bounds.UNCHECKED:
        return -1, -1
    if num_bags == 0:
        return empty_batch_bad_offset(family, offsets, n), -1
    slots = error_slots(2)
    tpb = threads_per_block()
    _ragged_kernel[blocks_for(max(num_bags, n), tpb), tpb, family.stream()](
        family.kernel_array(values), family.kernel_array(offsets), n, num_rows, bounds == Bounds.RAISE,
        slots)
    bad_offset, bad_id = read_error_slots(slots)
    return bad_offset, (bad_id if bounds == Bounds.RAISE else -1)
