"""CSR segment reduction on the GPU: the pooling kernel of embedding_bag over rows in place.

Segment ``b`` reduces rows ``data[offsets[b]:offsets[b+1]]`` (row = position,
weight 1): sum, mean (/ length) or sqrtn (/ sqrt(length)); empty gives zeros.
Integer data (int32, int64; sums only) takes :func:`int_sum_kernel`: a row group of
lanes per segment, each lane summing its columns in the data's dtype.
Offsets are always validated; the check is left pending (:mod:`._pending`).
"""
from numba import cuda

from .._validate import raise_bad_offsets
from . import _pending
from ._launch import blocks_for, dtype_key, group_size, kernel_factory, threads_per_block
from ._launcher import launch
from .embedding_bag import check_bag_offsets, empty_batch_bad_offset, pool


@kernel_factory
def int_sum_kernel(dtype):
    """``out[b] = Σ data[offsets[b]:offsets[b + 1]]`` for integer data of ``dtype`` (a
    :func:`dtype_key`), ``out`` zeros of it; lane 0 of a segment's group records its CSR
    faults in ``slots[0]``."""

    @cuda.jit(cache=False)
    def int_sum_kernel(data, offsets, n_rows, group, out, slots):
        num_bags = offsets.shape[0] - 1
        tid = cuda.grid(1)
        lane = tid % group
        for b in range(tid // group, num_bags, cuda.gridsize(1) // group):
            lo = offsets[b]
            hi = offsets[b + 1]
            if lane == 0:
                check_bag_offsets(slots, b, lo, hi, num_bags, n_rows)
            start = min(max(lo, 0), n_rows)  # clamped: malformed CSR never reads out of range
            end = min(max(hi, start), n_rows)
            for d in range(lane, out.shape[1], group):
                acc = out[b, d]
                for j in range(start, end):
                    acc += data[j, d]
                out[b, d] = acc

    return int_sum_kernel


def segment_reduce(family, data, offsets, combiner):
    n_rows = data.shape[0]
    if offsets.shape[0] == 1:
        bad_offset = empty_batch_bad_offset(family, offsets, n_rows)
        return family.empty((0, data.shape[1]), data.dtype), bad_offset

    def report(bad):
        raise_bad_offsets(family, offsets, n_rows, bad[0], "data.shape[0]")

    with _pending.checks(2, "segment_reduce", report, (offsets,)) as slots:
        if data.dtype.kind == "i":  # combiner sum (ops checks)
            out = family.zeros((offsets.shape[0] - 1, data.shape[1]), data.dtype)
            group, tpb = group_size(data.shape[1]), threads_per_block()
            launch(int_sum_kernel(dtype_key(data.dtype)), blocks_for(offsets.shape[0] - 1, tpb // group),
                   tpb, family.kernel_array(data), family.kernel_array(offsets), n_rows, group,
                   family.kernel_array(out), slots)
            return out, -1
        out = pool(family, data, None, offsets, n_rows, None, combiner, True, True, False, slots)
    return out, -1
