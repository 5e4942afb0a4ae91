"""CSR input checks on the GPU: the first bad offset, then the first id out of range,
left pending (:mod:`._pending`): one launch, nothing read back."""
from numba import cuda

from .._modes import Bounds
from .._validate import raise_ragged
from . import _pending
from ._launch import blocks_for, threads_per_block
from ._launcher import launch
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
    """``(-1, -1)``, the check of CSR input left pending as the forward leaves its own:
    ``Bounds.RAISE`` checks offsets and ids, ``Bounds.ZERO`` offsets only,
    ``Bounds.UNCHECKED`` nothing (no launch). An empty batch's one offset is read
    back at once."""
    num_bags = offsets.shape[0] - 1
    n = values.shape[0]
    if bounds == Bounds.UNCHECKED:
        return -1, -1
    if num_bags == 0:
        return empty_batch_bad_offset(family, offsets, n), -1
    raise_ids = bounds == Bounds.RAISE

    def report(bad):
        raise_ragged(family, values, offsets, bad[0], bad[1] if raise_ids else -1, num_rows)

    tpb = threads_per_block()
    with _pending.checks(2, "check_ragged", report, (values, offsets)) as slots:
        launch(_ragged_kernel, blocks_for(max(num_bags, n), tpb), tpb, family.kernel_array(values),
               family.kernel_array(offsets), n, num_rows, raise_ids, slots)
    return -1, -1
