"""Gradient of embedding_bag w.r.t. its per-sample weights on the GPU.

The formulas are those of :mod:`hbkernels.cpu.per_sample_weights_backward`.
Two kernels, no host synchronisation:

* dots: a row group of ``G = group_size(D)`` lanes per position ``j`` (grid-stride),
  finds its bag by binary search in ``offsets`` and sums ``g_b · W[values[j]]``
  over columns ``lane, lane + G, ...`` (coalesced row reads), reduced by a
  butterfly of shuffles; an id outside ``[0, num_rows)`` gets 0.
* scale: a thread per bag sums ``Σw``, ``Σw²`` and ``Σw·dot`` over its positions
  (sum skips this) and writes each position's gradient in the weights' dtype.
  Its serial chain is the longest bag's length, in scalar steps.

Sums are in the accumulator dtype (fp64 if any input is fp64, else fp32).
Positions outside every bag (only with unchecked offsets) get 0.
"""
import math

from numba import cuda

from .._modes import Combiner
from . import _device
from ._launch import (
    WIDEN,
    accumulator_dtype,
    blocks_for,
    dtype_key,
    group_size,
    kernel_factory,
    load_as_float,
    store_as,
    threads_per_block,
)
from ._launcher import launch
from ._warp import group_mask, shfl_xor


@cuda.jit(device=True, inline=True)
def bag_of_position(offsets, j):
    """The bag ``b`` with ``offsets[b] <= j < offsets[b + 1]`` (non-decreasing
    offsets), -1 where ``j`` lies outside ``[offsets[0], offsets[-1])``; always in
    ``[-1, B)``, so garbage offsets never index out of range."""
    lo = 0
    hi = offsets.shape[0] - 1
    if hi <= 0 or j < offsets[0] or j >= offsets[hi]:
        return -1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if offsets[mid] <= j:
            lo = mid
        else:
            hi = mid
    return lo


@kernel_factory
def weights_grad_kernels(table_dtype, grad_dtype, weights_dtype, acc_dtype):
    """``(dots, scale)`` kernels for these dtypes (:func:`dtype_key` each)."""
    load_table = load_as_float(table_dtype)
    load_grad = load_as_float(grad_dtype)
    load_weight = load_as_float(weights_dtype)
    store = store_as(weights_dtype)
    acc = WIDEN[acc_dtype]

    @cuda.jit(cache=False)
    def dots_kernel(table, grad, values, offsets, group, dots):
        num_rows = table.shape[0]
        dim = table.shape[1]
        tid = cuda.grid(1)
        lane = tid % group
        mask = group_mask(cuda.threadIdx.x % 32, group)
        for j in range(tid // group, values.shape[0], cuda.gridsize(1) // group):
            row = values[j]
            b = bag_of_position(offsets, j)
            total = acc(0)
            if b >= 0 and row >= 0 and row < num_rows:
                for d in range(lane, dim, group):
                    total += acc(load_table(table[row, d])) * acc(load_grad(grad[b, d]))
            half = group // 2
            while half > 0:  # butterfly: every lane of the group gets the sum
                total += shfl_xor(mask, total, half)
                half //= 2
            if lane == 0:
                dots[j] = total

    @cuda.jit(cache=False)
    def scale_kernel(values, offsets, weights, num_rows, combiner, dots, out):
        n = values.shape[0]
        for b in range(cuda.grid(1), offsets.shape[0] - 1, cuda.gridsize(1)):
            lo = max(offsets[b], 0)
            hi = min(offsets[b + 1], n)
            w_sum = acc(0)
            w_sq = acc(0)
            s = acc(0)
            if combiner != Combiner.SUM:
                for j in range(lo, hi):
                    if values[j] >= 0 and values[j] < num_rows:
                        w = acc(load_weight(weights[j]))
                        w_sum += w
                        w_sq += w * w
                        s += w * dots[j]
            c = acc(0)
            if combiner == Combiner.MEAN and w_sum != 0:
                c = acc(1) / w_sum
            elif combiner == Combiner.SQRTN and w_sq != 0:
                c = acc(1) / acc(math.sqrt(w_sq))
            for j in range(lo, hi):
                g = acc(0)
                if values[j] >= 0 and values[j] < num_rows:
                    if combiner == Combiner.SUM:
                        g = dots[j]
                    elif combiner == Combiner.MEAN:
                        g = c * (dots[j] - c * s)
                    else:
                        g = c * dots[j] - c * c * c * acc(load_weight(weights[j])) * s
                out[j] = store(g)

    return dots_kernel, scale_kernel


def per_sample_weights_backward(family, grad_out, weights, values, offsets, per_sample_weights,
                                combiner):
    """``[N]`` gradient in the dtype of ``per_sample_weights`` (offsets already checked)."""
    n = values.shape[0]
    out = family.zeros((n,), per_sample_weights.dtype)
    if n == 0 or offsets.shape[0] <= 1:
        return out
    acc_dtype = max((accumulator_dtype(a.dtype) for a in (weights, grad_out, per_sample_weights)),
                    key=lambda d: d.itemsize)
    dots_kernel, scale_kernel = weights_grad_kernels(
        dtype_key(weights.dtype), dtype_key(grad_out.dtype), dtype_key(per_sample_weights.dtype),
        acc_dtype)
    dots = _device.scratch(n, acc_dtype)
    tpb = threads_per_block()
    group = group_size(weights.shape[1])
    k_values, k_offsets = family.kernel_array(values), family.kernel_array(offsets)
    launch(dots_kernel, blocks_for(n, tpb // group), tpb, family.kernel_array(weights),
           family.kernel_array(grad_out), k_values, k_offsets, group, dots)
    num_bags = offsets.shape[0] - 1
    launch(scale_kernel, blocks_for(num_bags, tpb), tpb, k_values, k_offsets,
           family.kernel_array(per_sample_weights), weights.shape[0], int(combiner), dots,
           family.kernel_array(out))
    return out
