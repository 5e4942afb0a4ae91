"""Unsorted segment sum on the GPU: ``out[s] = Σ data[i] over i with segment_ids[i] == s``.

Thread mapping: a group of ``G = group_size(D)`` lanes per input row, grid-stride
over rows; lane ``d`` adds columns ``d, d+G, ...`` with ``cuda.atomic.add`` into
``acc[segment_ids[i], d]`` (coalesced along ``d``). ``acc`` is the output for
fp32, fp64, int32 and int64 data (integers wrap on overflow; their sums do not depend
on the order); fp16 and bf16 data sum into an fp32 buffer, then a cast
kernel rounds it into the output (to nearest even). Rows with a segment id
outside ``[0, num_segments)`` are always dropped; under ``bounds="raise"``
lane 0 also records the first bad position in an error slot left pending
(:mod:`._pending`): nothing is read back.
"""

from numba import cuda

from .._modes import Bounds
from .._validate import raise_bad_id
from . import _pending
from ._launch import (
    accumulator_dtype,
    blocks_for,
    dtype_key,
    group_size,
    inline_device,
    kernel_factory,
    load_as_float,
    no_error_slots,
    store_as,
    threads_per_block,
)
from ._launcher import launch


@inline_device
def _same(x):
    return x


def integer(dtype):
    """Whether data of ``dtype`` sums in its own integer dtype (int32, int64)."""
    return dtype.kind == "i"


@kernel_factory
def scatter_add_kernel(data_dtype):
    """The scatter-add kernel for data of ``data_dtype`` (a :func:`dtype_key`; integers
    added as they are)."""
    load = _same if integer(data_dtype) else load_as_float(data_dtype)

    @cuda.jit(cache=False)
    def scatter_add_kernel(data, segment_ids, record, group, acc, slots):
        num_segments = acc.shape[0]
        dim = data.shape[1]
        tid = cuda.grid(1)
        lane = tid % group
        step = cuda.gridsize(1) // group
        for i in range(tid // group, data.shape[0], step):
            s = segment_ids[i]
            if s < 0 or s >= num_segments:
                if record and lane == 0:
                    cuda.atomic.min(slots, 0, i)
                continue
            for d in range(lane, dim, group):
                cuda.atomic.add(acc, (s, d), load(data[i, d]))

    return scatter_add_kernel


@kernel_factory
def cast_kernel(dst_dtype):
    """Kernel ``(src, dst)``: dst[k] = src[k] converted to ``dst_dtype`` (a
    :func:`dtype_key`; bf16 rounded to nearest even into its bits); 1-D, same length."""
    store = store_as(dst_dtype)

    @cuda.jit(cache=False)
    def cast(src, dst):
        for k in range(cuda.grid(1), src.shape[0], cuda.gridsize(1)):
            dst[k] = store(src[k])

    return cast


def segment_sum(family, data, segment_ids, num_segments, bounds):
    n, dim = data.shape[0], data.shape[1]
    acc_dtype = data.dtype if integer(data.dtype) else accumulator_dtype(data.dtype)
    acc = family.zeros((num_segments, dim), acc_dtype)
    if n == 0:
        return (acc if acc_dtype == data.dtype else family.zeros(acc.shape, data.dtype)), -1
    record = bounds == Bounds.RAISE

    def report(bad):
        raise_bad_id(family, "segment_ids", segment_ids, bad[0], num_segments)

    group = group_size(dim)
    tpb = threads_per_block()
    k_acc = family.kernel_array(acc)
    with _pending.checks(1, "segment_sum", report, (segment_ids,), when=record) as slots:
        launch(scatter_add_kernel(dtype_key(data.dtype)), blocks_for(n, tpb // group), tpb,
               family.kernel_array(data), family.kernel_array(segment_ids), record, group, k_acc,
               no_error_slots() if slots is None else slots)
    out = acc
    if acc_dtype != data.dtype:
        out = family.empty(acc.shape, data.dtype)
        if out.size:
            flat_out = family.kernel_array(out).reshape(out.size)
            launch(cast_kernel(dtype_key(out.dtype)), blocks_for(out.size, tpb), tpb,
                   k_acc.reshape(acc.size), flat_out)
    return out, -1
