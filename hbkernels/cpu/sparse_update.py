"""Sparse optimizer updates on the CPU, plain and fused with the embedding-bag backward.

Every rule lives in one njit function, :func:`apply_rule`, inlined into both
kernels: :func:`update_kernel` (gradient rows given: one distinct id per
iteration of a parallel loop) and :func:`fused_kernel` (one hash partition of
the batch's occurrences per iteration, :func:`.grouping.group_occurrences`:
each distinct id's ``c_b·w_j·grad_out[b]`` summed in input order into a row of
the partition's scratch block, then the rule per row; the gradient rows are never
materialised and the occurrences never sorted). One kernel of each is
compiled per D (cached on disk); the rule, the fp16 rounding and the
non-finite skip are run-time switches taken once per row.

Arithmetic runs in the accumulator type (fp32; fp64 for fp64 tables): the
hyper-parameters, the gradient rows and the per-sample weights are cast to it
before the kernels run, so no fp32 kernel silently widens to fp64.

fp16 and bf16 tables: Numba's CPU target has neither, so the kernels read the
table as its bits (:func:`._common.kernel_table`, widened exactly by
:func:`._common.widen`) and write each new row, in fp32, to a scratch ``[K, D]``;
the wrapper rounds it to nearest even (:func:`._common.narrow`) and scatters it.
Stochastic rounding is done in the kernel in float64 and gives exact fp16 (or
bf16) values, so the cast keeps them. Its uniform ``u`` comes from a murmur3
``fmix32`` chain of ``(key, row, column)``, the same bits as the CUDA kernels.
"""
import functools
import math

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .._modes import Bounds
from .. import _rules as rules
from .._validate import is_bfloat16
from ._common import (accumulator_dtype, cached_njit, fmix32, kernel_table, narrow,
                      prefetch_ids, prefetch_row, widen)
from ._common import first_out_of_range as _first_out_of_range
from .ragged import check_ragged
from .embedding_bag_backward import FASTMATH, sum_partition
from .grouping import group_occurrences

# kernel parameter vector: the front end's hyper-parameters, then derived constants
INV_DIM, TWO_L2, NEG_POWER, SQRT_POWER, ZERO, ONE_M_B1, ONE_M_B2 = range(
    rules.NUM_HYPER, rules.NUM_HYPER + 7)
NUM_PARAMS = rules.NUM_HYPER + 7

_MASK32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_TWO_POW_M32 = 2.0 ** -32
# stochastic rounding targets (the kernels' ``stochastic`` code):
# (smallest normal exponent, stored significand bits, largest finite value)
ROUND_NEAREST, ROUND_FP16, ROUND_BF16 = 0, 1, 2
FP16_MIN_EXP, FP16_BITS, FP16_MAX = -14, 10, 65504.0
BF16_MIN_EXP, BF16_BITS, BF16_MAX = -126, 7, (2.0 - 2.0 ** -7) * 2.0 ** 127


# -- checks ---------------------------------------------------------------------
def first_out_of_range(family, ids, limit):
    return int(_first_out_of_range(ids, limit))


@cached_njit(parallel=True)  # no fast-math: NaN and Inf must stay visible
def _first_nonfinite_row(a, num_chunks):
    """First row holding NaN/Inf (x - x is NaN exactly for those), -1 if none; rows are
    scanned in parallel chunks with a branch-free (vectorisable) test per row."""
    n = a.shape[0]
    size = (n + num_chunks - 1) // num_chunks
    first = np.full(num_chunks, -1, np.int64)
    for c in prange(num_chunks):
        for i in range(c * size, min(n, (c + 1) * size)):
            bad = False
            for d in range(a.shape[1]):
                x = widen(a[i, d])
                bad |= not (x - x == 0)
            if bad:
                first[c] = i
                break
    for c in range(num_chunks):
        if first[c] >= 0:
            return first[c]
    return -1


def first_nonfinite_row(family, a):
    table = kernel_table(a)
    num_chunks = max(1, min(a.shape[0], 4 * numba.get_num_threads()))
    return int(_first_nonfinite_row(table, num_chunks))


def fused_checks(family, grad_out, per_sample_weights, values, offsets, num_rows, bounds,
                 finite):
    """``(first non-finite row of grad_out, of per_sample_weights, first bad offset,
    first bad id)`` (-1: none); finiteness checked when ``finite``."""
    bad_grad = bad_psw = -1
    if finite:
        bad_grad = first_nonfinite_row(family, grad_out)
        if per_sample_weights is not None:
            bad_psw = first_nonfinite_row(family, per_sample_weights.reshape(-1, 1))
    return (bad_grad, bad_psw, *check_ragged(family, values, offsets, num_rows, bounds))


@intrinsic
def fsqrt(typingctx, x):
    """``llvm.sqrt`` (one instruction, vectorisable; NaN for x < 0), where ``math.sqrt``
    calls libm's ``sqrtf`` for errno."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        lty = context.get_value_type(sig.args[0])
        name = "llvm.sqrt.f32" if sig.args[0] == types.float32 else "llvm.sqrt.f64"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(lty, [lty]), name)
        return builder.call(fn, args)

    return x(x), codegen


# -- stochastic rounding to fp16 and bf16 -------------------------------------------
@njit(inline="always")
def uniform(key, row, d):
    """u in [0, 1) from (key, row, column): identical on CPU and GPU."""
    r = np.uint64(row)
    h = fmix32(fmix32((key & _MASK32) ^ (r & _MASK32)) ^ (r >> _S32) ^ (key >> _S32))
    return np.float64(fmix32(h ^ np.uint64(d))) * _TWO_POW_M32


@cached_njit()
def stochastic_round(value, u, min_exp, bits, max_value):
    """``value`` rounded down or up to a neighbouring value of the 2-byte format
    (fp16: ``FP16_*``, bf16: ``BF16_*``), up with probability equal to its
    distance from the lower one in ulps (nearest, left to the cast, for
    non-finite values and beyond the format's range)."""
    x = np.float64(value)
    a = abs(x)
    if math.isfinite(x) and 0.0 < a < max_value:
        ulp = math.ldexp(1.0, max(math.frexp(a)[1] - 1, min_exp) - bits)
        lo = math.floor(a / ulp) * ulp
        x = math.copysign(lo + ulp if u < (a - lo) / ulp else lo, x)
    return x


def store(weights, out, row, k, d, value, stochastic, key):
    """Write the new weight of ``(row, d)``: in place, or to the fp16/bf16 scratch
    ``out[k]`` (``stochastic``: a ``ROUND_*`` code)."""


@overload(store, inline="always")
def _store(weights, out, row, k, d, value, stochastic, key):
    if isinstance(weights.dtype, types.Integer):  # the bits of an fp16 (uint16) or bf16 (int16) table

        def impl(weights, out, row, k, d, value, stochastic, key):
            if stochastic == ROUND_FP16:
                out[k, d] = stochastic_round(value, uniform(key, row, d), FP16_MIN_EXP,
                                             FP16_BITS, FP16_MAX)
            elif stochastic == ROUND_BF16:
                out[k, d] = stochastic_round(value, uniform(key, row, d), BF16_MIN_EXP,
                                             BF16_BITS, BF16_MAX)
            else:
                out[k, d] = value

        return impl

    def impl(weights, out, row, k, d, value, stochastic, key):
        weights[row, d] = value

    return impl


# -- the rules --------------------------------------------------------------------
@njit(inline="always", fastmath=FASTMATH)
def apply_rule(rule, dim, p, g, weights, row, s1, s2, out, k, stochastic, key):
    """Update row ``row`` of ``weights`` (and ``s1``/``s2``) from its gradient ``g``
    ``[dim]``; every scalar of ``p`` (kernel parameters) is in the accumulator type.
    ``s1`` is ``[E, 1]`` for the row-wise rule."""
    lr = p[rules.LR]
    eps = p[rules.EPS]
    if rule == rules.SGD:
        for d in range(dim):
            store(weights, out, row, k, d, widen(weights[row, d]) - lr * g[d],
                  stochastic, key)
    elif rule == rules.ADAGRAD:
        for d in range(dim):
            s = s1[row, d] + g[d] * g[d]
            s1[row, d] = s
            store(weights, out, row, k, d,
                  widen(weights[row, d]) - lr * g[d] / (fsqrt(s) + eps), stochastic, key)
    elif rule == rules.ROWWISE_ADAGRAD:
        m = s1[row, 0] + sum_of_squares(g, dim, p[ZERO]) * p[INV_DIM]
        s1[row, 0] = m
        step = lr / (fsqrt(m) + eps)
        for d in range(dim):
            store(weights, out, row, k, d, widen(weights[row, d]) - step * g[d],
                  stochastic, key)
    elif rule == rules.ADAM:
        b1 = p[ONE_M_B1]  # 1 - beta1
        b2 = p[ONE_M_B2]
        step_size = p[rules.STEP_SIZE]
        for d in range(dim):
            m = s1[row, d]
            v = s2[row, d]
            m += b1 * (g[d] - m)
            v += b2 * (g[d] * g[d] - v)
            s1[row, d] = m
            s2[row, d] = v
            store(weights, out, row, k, d,
                  widen(weights[row, d]) - step_size * m / (fsqrt(v) + eps),
                  stochastic, key)
    elif p[SQRT_POWER] != 0:  # FTRL, lr_power = -0.5: a loop of its own, so no pow is speculated
        for d in range(dim):
            n = s1[row, d]
            n_new = n + g[d] * g[d]
            ftrl_element(p, g[d], n_new, fsqrt(n_new), fsqrt(n), weights, row, s1, s2, out,
                         k, d, stochastic, key)
    else:  # FTRL
        q = p[NEG_POWER]  # -lr_power
        for d in range(dim):
            n = s1[row, d]
            n_new = n + g[d] * g[d]
            ftrl_element(p, g[d], n_new, n_new ** q, n ** q, weights, row, s1, s2, out,
                         k, d, stochastic, key)


@njit(inline="always", fastmath=FASTMATH)
def sum_of_squares(g, dim, zero):
    """``Σ g[d]²`` in a fixed order that runs as vectors: eight partial sums (lane
    ``d % 8``), then the tail, added pairwise; ``zero`` gives the type."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    body = dim - dim % 8
    for d in range(0, body, 8):
        s0 += g[d] * g[d]
        s1 += g[d + 1] * g[d + 1]
        s2 += g[d + 2] * g[d + 2]
        s3 += g[d + 3] * g[d + 3]
        s4 += g[d + 4] * g[d + 4]
        s5 += g[d + 5] * g[d + 5]
        s6 += g[d + 6] * g[d + 6]
        s7 += g[d + 7] * g[d + 7]
    tail = zero
    for d in range(body, dim):
        tail += g[d] * g[d]
    return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + tail


@njit(inline="always", fastmath=FASTMATH)
def ftrl_element(p, g, n_new, pow_new, pow_old, weights, row, s1, s2, out, k, d,
                 stochastic, key):
    """One FTRL coordinate, given n' = n + g² and n'^-p, n^-p."""
    lr = p[rules.LR]
    l1 = p[rules.L1]
    w = widen(weights[row, d])
    z = s2[row, d] + g - (pow_new - pow_old) / lr * w
    s2[row, d] = z
    s1[row, d] = n_new
    if z > l1:
        w = (l1 - z) / (pow_new / lr + p[TWO_L2])
    elif z < -l1:
        w = (-l1 - z) / (pow_new / lr + p[TWO_L2])
    else:
        w = p[ZERO]
    store(weights, out, row, k, d, w, stochastic, key)


@njit(inline="always")
def prefetch_update_rows(weights, s1, s2, row, dim):
    """Bring the table and state lines of ``row`` in ahead of its update."""
    prefetch_row(weights, row, dim)
    if s1.shape[0] == weights.shape[0]:
        prefetch_row(s1, row, s1.shape[1])
    if s2.shape[0] == weights.shape[0]:
        prefetch_row(s2, row, dim)


@njit(inline="always")
def all_finite(g, dim):
    ok = True
    for d in range(dim):
        ok &= math.isfinite(g[d])
    return ok


@functools.lru_cache(maxsize=None)
def update_kernel(dim):
    """Kernel ``(rule, p, rows, ids, weights, s1, s2, out, skip, stochastic, key,
    updated, ahead)``: row ``ids[k]`` from ``rows[k]``, ids distinct; the rows of the
    id ``ahead`` places on are prefetched."""

    @cached_njit(parallel=True, fastmath=FASTMATH)
    def update(rule, p, rows, ids, weights, s1, s2, out, skip, stochastic, key, updated, ahead):
        num_ids = ids.shape[0]
        for k in prange(num_ids):
            if k + ahead < num_ids:
                prefetch_update_rows(weights, s1, s2, ids[k + ahead], dim)
            g = rows[k]
            if skip and not all_finite(g, dim):
                updated[k] = False
                continue
            updated[k] = True
            apply_rule(rule, dim, p, g, weights, ids[k], s1, s2, out, k, stochastic, key)

    return update


@functools.lru_cache(maxsize=None)
def fused_kernel(dim):
    """Kernel ``(rule, p, grad, part_lo, s_bag, s_coef, local, t_ids, first, ids, weights,
    s1, s2, out, skip, stochastic, key, updated, ahead)`` over a :class:`.grouping.Groups`:
    per partition (its occurrences in input order, each one's distinct id ``local``),
    every distinct id's gradient summed in input order into a row of a scratch block,
    then the rule, prefetching the rows of the id ``ahead`` places on; the ``u``-th
    distinct id of partition ``p`` is ``k = first[p] + u`` (``ids[k]``, ``out[k]``,
    ``updated[k]``)."""

    @cached_njit(parallel=True, fastmath=FASTMATH)
    def fused(rule, p, grad, part_lo, s_bag, s_coef, local, t_ids, first, ids, weights, s1,
              s2, out, skip, stochastic, key, updated, ahead):
        one = np.ones(1, grad.dtype)[0]
        for q in prange(part_lo.shape[0] - 1):
            lo, hi = part_lo[q], part_lo[q + 1]
            n = first[q + 1] - first[q]
            for u in range(min(n, ahead)):
                prefetch_update_rows(weights, s1, s2, t_ids[lo + u], dim)
            g = np.empty((n, dim), grad.dtype)
            sum_partition(g, 0, n, grad, s_bag, s_coef, local, lo, hi, one, dim)
            for u in range(n):
                if u + ahead < n:
                    prefetch_update_rows(weights, s1, s2, t_ids[lo + u + ahead], dim)
                k = first[q] + u
                row = t_ids[lo + u]
                ids[k] = row
                if skip and not all_finite(g[u], dim):
                    updated[k] = False
                    continue
                updated[k] = True
                apply_rule(rule, dim, p, g[u], weights, row, s1, s2, out, k, stochastic, key)

    return fused


# -- wrappers -----------------------------------------------------------------------
def _kernel_params(hp, dim, acc_dtype):
    p = np.zeros(NUM_PARAMS, np.float64)
    p[: rules.NUM_HYPER] = hp
    p[INV_DIM] = 1.0 / dim
    p[TWO_L2] = 2.0 * hp[rules.L2]
    p[NEG_POWER] = -hp[rules.LR_POWER]
    p[SQRT_POWER] = 1.0 if hp[rules.LR_POWER] == -0.5 else 0.0
    p[ONE_M_B1] = 1.0 - hp[rules.BETA1]
    p[ONE_M_B2] = 1.0 - hp[rules.BETA2]
    return p.astype(acc_dtype)


class _Target:
    """The table and state as the kernels see them, and the fp16/bf16 write-back."""

    def __init__(self, weights, state1, state2, num_ids, stochastic):
        self.weights = weights
        self.half = weights.dtype.itemsize == 2
        acc = accumulator_dtype(weights.dtype)
        self.acc_dtype = acc
        dummy = np.zeros((1, 1), acc)
        self.table = kernel_table(weights)
        self.rounding = ROUND_NEAREST
        if self.half:
            self.out = np.empty((num_ids, weights.shape[1]), np.float32)
            if stochastic:
                self.rounding = ROUND_BF16 if is_bfloat16(weights.dtype) else ROUND_FP16
        else:
            self.out = np.zeros((1, 1), acc)
        self.s1 = dummy if state1 is None else (
            state1[:, None] if state1.ndim == 1 else state1)  # a view: updates land in state1
        self.s2 = dummy if state2 is None else state2
        self.updated = np.empty(num_ids, np.bool_)
        self.ahead = prefetch_ids(self.table.shape[1] * self.table.itemsize)

    def finish(self, ids):
        if not self.half or ids.shape[0] == 0:
            return
        if self.updated.all():
            self.weights[ids] = narrow(self.out, self.weights.dtype)
        else:
            self.weights[ids[self.updated]] = narrow(self.out[self.updated], self.weights.dtype)


def sparse_update(family, rule, weights, state1, state2, hp, ids, rows, skip_nonfinite,
                  stochastic, key):
    dim = weights.shape[1]
    if ids.shape[0] == 0:
        return
    target = _Target(weights, state1, state2, ids.shape[0], stochastic)
    rows = np.ascontiguousarray(rows, dtype=target.acc_dtype)
    update_kernel(dim)(
        rule, _kernel_params(hp, dim, target.acc_dtype), rows, ids, target.table,
        target.s1, target.s2, target.out, bool(skip_nonfinite), target.rounding,
        np.uint64(key), target.updated, target.ahead,
    )
    target.finish(ids)


def checks_before_grouping(bounds):
    """The bounds :func:`fused_sparse_update` checks its input under before grouping its
    occurrences: the offsets alone under ``"raise"`` (the grouping's first pass finds
    the first id out of range), else ``bounds``."""
    return Bounds.ZERO if bounds == Bounds.RAISE else bounds


def fused_sparse_update(family, rule, weights, state1, state2, hp, grad_out, values, offsets,
                        psw, combiner, bounds, finite, skip_nonfinite, stochastic, key,
                        on_error=None):
    """The checks of :func:`fused_checks`, then, when all pass, the update. Returns the
    checks' first bad positions (all -1: the update ran); the caller raises, so
    ``on_error`` (for checks read later, as on the GPU) is not used. Under ``"raise"``
    the ids are checked by the grouping's first pass over them (nothing is written when
    one is out of range), the offsets before it."""
    bad = fused_checks(family, grad_out, psw, values, offsets, weights.shape[0],
                       checks_before_grouping(bounds), finite)
    if any(b != -1 for b in bad):
        return bad
    bad_id = _fused_update(family, rule, weights, state1, state2, hp, grad_out, values, offsets,
                           psw, combiner, bounds, skip_nonfinite, stochastic, key)
    return bad[:3] + (bad_id,)


def _fused_update(family, rule, weights, state1, state2, hp, grad_out, values, offsets, psw,
                  combiner, bounds, skip_nonfinite, stochastic, key):
    """The update (after the checks); under ``"raise"`` the first out-of-range id's
    position, with nothing updated (-1: none)."""
    dim = weights.shape[1]
    if values.shape[0] == 0 or offsets.shape[0] < 2:
        return -1
    acc = accumulator_dtype(weights.dtype)
    raising = bounds == Bounds.RAISE
    groups = group_occurrences(values, offsets, psw, combiner, weights.shape[0],
                               bounds != Bounds.UNCHECKED, acc, stop_at_bad=raising)
    if raising and groups.parts.first_bad != -1:
        return groups.parts.first_bad
    num_ids = groups.count
    if num_ids == 0:
        return -1
    ids = np.empty(num_ids, values.dtype)
    target = _Target(weights, state1, state2, num_ids, stochastic)
    grad = np.ascontiguousarray(grad_out, dtype=acc)
    parts = groups.parts
    fused_kernel(dim)(
        rule, _kernel_params(hp, dim, acc), grad, parts.lo, parts.bag, parts.coef, groups.local,
        groups.ids, groups.first, ids, target.table, target.s1, target.s2, target.out,
        bool(skip_nonfinite), target.rounding, np.uint64(key), target.updated, target.ahead,
    )
    target.finish(ids)
    return -1
