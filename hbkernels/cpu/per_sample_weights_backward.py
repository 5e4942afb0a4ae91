"""Gradient of embedding_bag w.r.t. its per-sample weights on the CPU: one bag per
iteration of a parallel loop.

For bag ``b`` with output gradient ``g_b``, ``dot_j = g_b · W[values[j]]`` and
``S_b = Σ_j w_j·dot_j``: sum gives ``dot_j``, mean (``c = 1/Σw``) gives
``c·(dot_j - c·S_b)``, sqrtn (``c = 1/sqrt(Σw²)``) gives ``c·dot_j - c³·w_j·S_b``
(``c = 0`` where the denominator is 0). An id outside ``[0, num_rows)`` gets 0
and counts in no denominator. The bag is walked twice (dots and sums, then the
scale); everything accumulates in float64, each dot product in vectors.
"""
import numpy as np
from numba import prange

from .._modes import Combiner
from ._common import cached_njit, kernel_table, widen


# reassociation lets LLVM vectorise the dot products; NaN and Inf still propagate
@cached_njit(parallel=True, fastmath={"reassoc", "nsz", "contract"})
def _weights_grad(table, grad, values, offsets, weights, combiner, out):
    num_rows = table.shape[0]
    dim = table.shape[1]
    for b in prange(offsets.shape[0] - 1):
        w_sum = 0.0
        w_sq = 0.0
        s = 0.0
        for j in range(offsets[b], offsets[b + 1]):
            row = np.uint64(values[j])
            if row >= np.uint64(num_rows):  # negatives wrap high
                out[j] = 0.0
                continue
            dot = 0.0
            for d in range(dim):
                dot += np.float64(widen(table[row, d])) * np.float64(widen(grad[b, d]))
            w = np.float64(widen(weights[j]))
            out[j] = dot
            w_sum += w
            w_sq += w * w
            s += w * dot
        if combiner == Combiner.SUM:
            continue
        c = 0.0
        if combiner == Combiner.MEAN and w_sum != 0.0:
            c = 1.0 / w_sum
        elif combiner == Combiner.SQRTN and w_sq != 0.0:
            c = 1.0 / np.sqrt(w_sq)
        for j in range(offsets[b], offsets[b + 1]):
            if np.uint64(values[j]) >= np.uint64(num_rows):
                continue
            if combiner == Combiner.MEAN:
                out[j] = c * (out[j] - c * s)
            else:
                out[j] = c * out[j] - c * c * c * np.float64(widen(weights[j])) * s


def per_sample_weights_backward(family, grad_out, weights, values, offsets, per_sample_weights,
                                combiner):
    """``[N]`` gradient in the dtype of ``per_sample_weights`` (offsets already checked)."""
    out = np.zeros(values.shape[0], np.float64)
    _weights_grad(kernel_table(weights), kernel_table(grad_out), values, offsets,
                  kernel_table(per_sample_weights), int(combiner), out)
    return out.astype(per_sample_weights.dtype)
