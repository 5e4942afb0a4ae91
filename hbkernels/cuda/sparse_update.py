"""Sparse optimizer updates on the GPU: ``sparse_update`` from materialised gradient
rows and ``fused_sparse_update`` straight from ``embedding_bag``'s ``grad_out``.

Both run one kernel, :func:`_update_kernel`, with one row group of
``G = group_size(D)`` lanes per distinct row (fused: the row group of the first sorted
position of the id's run, which finds the run's end from the sorted keys; as the
forward, lane ``d`` owns
columns ``d, d+G, d+2G, d+3G`` of a pass, in registers; wider rows take several
passes). A group gets its gradient ``g`` either by loading ``rows[k]`` (plain)
or by summing the id's occurrences in input order (fused; the decomposition of
:mod:`.embedding_bag_backward`: ``prepare``, :func:`.occurrences` and the
partial rows of ids with more than ``CHUNK`` occurrences), then applies the rule
of :func:`_make_rule` element-wise and writes the weight back (fp16 and bf16
tables: nearest-even, or the stochastic rounding of :func:`_stochastic_round`,
whose hash matches the CPU's bit for bit).

Row-wide quantities, ``Σ_d g²`` (RowWiseAdagrad) and "is any g not finite"
(``skip_nonfinite``), are reduced over the group's lanes by a butterfly of
shuffles (every lane ends with the same bits). When the row needs more than one
pass, the first sweep keeps ``g`` in a per-lane array of the kernel's ``passes``
x 4 elements and the second applies the rule from it: each row is summed once.

The fused gradient is summed in the table's accumulator type (as the CPU).
``fused_sparse_update`` never waits for the device: its checks go to slots left
pending (:mod:`._pending`), which the update kernel reads first, writing nothing
when one holds an error.
"""
import functools
import math

import numpy as np
from numba import cuda, from_dtype, int32, int64, uint64

from .._modes import Bounds
from .._validate import is_bfloat16, raise_nonfinite, raise_ragged
from .. import _rules as rules
from . import _device, _pending
from ._launch import (
    NO_ERROR_SLOT,
    UNROLL,
    WIDEN,
    accumulator_dtype,
    as_rows,
    blocks_for,
    column_reader,
    columns_per_lane,
    dtype_key,
    error_slots,
    fmix32,
    group_size,
    inline_device,
    jit_kernel,
    kernel_factory,
    load_as_float,
    no_error_slots,
    read_error_slots,
    store_as,
    threads_per_block,
)
from ._launcher import launch
from ._nonfinite import record_nonfinite
from ._warp import group_mask, shfl_xor
from .embedding_bag import empty_batch_bad_offset
from ._runs import run_starts_at
from ._segments import device_run_end as run_end
from .embedding_bag_backward import (
    make_accumulate,
    occurrences,
    prepare,
    sum_partials,
    sum_range,
)

_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_TWO_M32 = 2.0**-32
# stochastic rounding targets, as the CPU backend's: (smallest normal exponent,
# stored significand bits, largest finite value)
STOCHASTIC_FORMATS = {"float16": (-14, 10, 65504.0),
                      "bfloat16": (-126, 7, (2.0 - 2.0**-7) * 2.0**127)}


# ---------------------------------------------------------------------------
# checks with one read-back
# ---------------------------------------------------------------------------
@cuda.jit
def _out_of_range_kernel(ids, limit, slots):
    for i in range(cuda.grid(1), ids.shape[0], cuda.gridsize(1)):
        v = ids[i]
        if v < 0 or (limit >= 0 and v >= limit):
            cuda.atomic.min(slots, 0, i)


def first_out_of_range(family, ids, limit):
    """First position with an id outside ``[0, limit)`` (``limit < 0``: no upper limit), -1 none."""
    n = ids.shape[0]
    if n == 0:
        return -1
    slots = error_slots(1)
    tpb = threads_per_block()
    launch(_out_of_range_kernel, blocks_for(n, tpb), tpb, family.kernel_array(ids), limit, slots)
    return read_error_slots(slots)[0]


def first_nonfinite_row(family, a):
    """First row of the 2-D ``a`` holding NaN or Inf, -1 none."""
    if a.shape[0] * a.shape[1] == 0:
        return -1
    slots = error_slots(1)
    record_nonfinite(family, a, slots, 0)
    return read_error_slots(slots)[0]




# ---------------------------------------------------------------------------
# the rule, shared by both update paths
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _make_rule(widen):
    @inline_device
    def rule_update(rule, g, w, s1, s2, row_step, lr, eps, one_m_b1, one_m_b2, l1, two_l2,
                    neg_power, sqrt_power, step_size):
        """New ``(w, s1, s2)`` of one element. ``row_step``: RowWiseAdagrad's
        ``lr / (sqrt(m) + eps)`` of the row; ``sqrt_power``: FTRL's ``lr_power == -0.5``.
        Expressions as the CPU backend writes them (same rounding steps)."""
        if rule == rules.SGD:
            return w - lr * g, s1, s2
        if rule == rules.ADAGRAD:
            s1 = s1 + g * g
            return w - lr * g / (math.sqrt(s1) + eps), s1, s2
        if rule == rules.ROWWISE_ADAGRAD:
            return w - row_step * g, s1, s2
        if rule == rules.ADAM:
            s1 = s1 + one_m_b1 * (g - s1)
            s2 = s2 + one_m_b2 * (g * g - s2)
            return w - step_size * s1 / (math.sqrt(s2) + eps), s1, s2
        # FTRL: s1 = n (accumulator), s2 = z (linear); w on the right is the old weight
        n_new = s1 + g * g
        if sqrt_power:
            pow_new = math.sqrt(n_new)
            pow_old = math.sqrt(s1)
        else:
            pow_new = math.pow(n_new, neg_power)
            pow_old = math.pow(s1, neg_power)
        z = s2 + g - (pow_new - pow_old) / lr * w
        w_new = widen(0)
        if abs(z) > l1:
            w_new = (math.copysign(l1, z) - z) / (pow_new / lr + two_l2)
        return w_new, n_new, z

    return rule_update


@inline_device
def _uniform(key_lo, key_hi, row, col):
    """u in [0, 1) from fmix32(fmix32(fmix32(key_lo ^ row_lo) ^ row_hi ^ key_hi) ^ col) / 2^32."""
    r = uint64(row)
    h = fmix32(key_lo ^ (r & _M32))
    h = fmix32(h ^ (r >> _S32) ^ key_hi)
    h = fmix32(h ^ uint64(col))
    return np.float64(h) * _TWO_M32


@inline_device
def _stochastic_round(x32, key_lo, key_hi, row, col, min_exp, bits, max_value):
    """The value of the 2-byte format (smallest normal exponent ``min_exp``,
    ``bits`` stored significand bits, largest finite ``max_value``: fp16 or bf16,
    :data:`STOCHASTIC_FORMATS`) that stochastic rounding of ``x32`` gives, as an
    exactly representable fp32: up with probability equal to the distance to the
    lower neighbour in ulps. Non-finite values and ``|x| >= max_value`` pass through
    (nearest on store)."""
    x = np.float64(x32)
    if not math.isfinite(x) or abs(x) >= max_value:
        return x32
    a = abs(x)
    if a == 0.0:
        return x32
    _, ex = math.frexp(a)
    ulp = math.ldexp(1.0, max(ex - 1, min_exp) - bits)
    lo = np.float64(math.floor(a / ulp)) * ulp
    frac = (a - lo) / ulp
    r = lo + ulp if _uniform(key_lo, key_hi, row, col) < frac else lo
    return np.float32(math.copysign(r, x))


# ---------------------------------------------------------------------------
# the update kernel
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def row_updater(table_dtype, grad_dtype, fused, columns, passes, any_width=False):
    """The inline device function ``update_row(weights, state1, state2, row, grad, order,
    bag_of, coef, partials, sums, r, lane, group, rule, hp, inv_dim, skip_nonfinite,
    stochastic, key_lo, key_hi) -> None`` that one row group of ``group`` lanes runs for
    distinct row ``row``: its gradient (summed as ``sums`` says when ``fused``, else
    ``grad[r]``), the rule of ``hp`` (the widened hyper-parameters of
    :func:`_make_rule`), the weight stored. ``columns`` per lane
    (:func:`columns_per_lane`) and ``passes`` passes of ``UNROLL·G`` columns are
    compile-time; ``weights.shape[1]`` gives the row's width. ``any_width``: ``columns``
    is ``UNROLL`` and ``passes`` at least the row's (a pass past the row's end does
    nothing), for rows of any width. Every lane of the group must call it for the same
    row."""
    table_acc = accumulator_dtype(table_dtype)
    widen = WIDEN[table_acc]
    acc_type = from_dtype(table_acc)
    rule_update = _make_rule(widen)
    load_weight = load_as_float(table_dtype)
    store_weight = store_as(table_dtype)
    min_exp, bits, max_value = STOCHASTIC_FORMATS.get(table_dtype.name, (0, 0, 0.0))
    accumulate = make_accumulate(dtype_key(table_acc), grad_dtype, columns)
    read_row = column_reader(grad_dtype, columns)
    zero = np.dtype(table_acc).type(0)
    kept_size = UNROLL * passes

    @inline_device
    def gradient(grad, order, bag_of, coef, partials, sums, r, c0, lane, group):
        """This lane's 4 gradient values of columns ``c0 + k·group`` (0 past the row);
        ``sums``: the run's final sum (:func:`.sum_range`) when fused."""
        if fused:
            level, first, last, lo, base, width = sums
            return accumulate(grad, order, bag_of, coef, partials, level, first, last, lo,
                              base, width, c0, lane, group)
        dim = grad.shape[1]
        g0, g1, g2, g3 = read_row(grad, r, c0 if c0 < dim else 0, group)
        return (widen(g0) if c0 < dim else zero, widen(g1) if c0 + group < dim else zero,
                widen(g2) if c0 + 2 * group < dim else zero,
                widen(g3) if c0 + 3 * group < dim else zero)

    @inline_device
    def bad(g):
        return 0 if math.isfinite(g) else 1

    @inline_device
    def state_slots(rule):
        """Whether ``rule`` keeps per-element state in slot 1 and in slot 2."""
        has1 = rule == rules.ADAGRAD or rule == rules.ADAM or rule == rules.FTRL
        return has1, rule == rules.ADAM or rule == rules.FTRL

    @inline_device
    def read_element(weights, state1, state2, row, c, rule):
        """``(w, s1, s2)`` of element ``(row, c)``: the weight and the rule's state."""
        has1, has2 = state_slots(rule)
        w = widen(load_weight(weights[row, c]))
        s1 = state1[row, c] if has1 else zero
        s2 = state2[row, c] if has2 else zero
        return w, s1, s2

    @inline_device
    def read_elements(weights, state1, state2, row, c0, group, rule):
        """:func:`read_element` of this lane's columns ``c0 + k·group``, all loads before
        any store: the compiler would not move a load above a store that may alias it.
        Columns past the row's end read column ``c0`` (or 0) and must not be written."""
        dim = weights.shape[1]
        c0 = c0 if c0 < dim else 0
        c1 = c0 + group
        c2 = c1 + group
        c3 = c2 + group
        e0 = read_element(weights, state1, state2, row, c0, rule)
        e1 = e2 = e3 = e0
        if columns > 1:
            e1 = read_element(weights, state1, state2, row, c1 if c1 < dim else c0, rule)
        if columns > 2:
            e2 = read_element(weights, state1, state2, row, c2 if c2 < dim else c0, rule)
        if columns > 3:
            e3 = read_element(weights, state1, state2, row, c3 if c3 < dim else c0, rule)
        return e0, e1, e2, e3

    @inline_device
    def apply(weights, state1, state2, row, c, g, element, rule, row_step, hp, stochastic,
              key_lo, key_hi):
        """Update element ``(row, c)``, read before as ``element``, with gradient ``g``."""
        w, s1, s2 = element
        has1, has2 = state_slots(rule)
        lr, eps, one_m_b1, one_m_b2, l1, two_l2, neg_power, sqrt_power, step_size = hp
        w_new, s1, s2 = rule_update(rule, g, w, s1, s2, row_step, lr, eps, one_m_b1, one_m_b2,
                                    l1, two_l2, neg_power, sqrt_power, step_size)
        if has1:
            state1[row, c] = s1
        if has2:
            state2[row, c] = s2
        if stochastic:  # fp16 and bf16 tables only (the launcher clears it otherwise)
            w_new = _stochastic_round(w_new, key_lo, key_hi, row, c, min_exp, bits, max_value)
        weights[row, c] = store_weight(w_new)  # fp16, bf16: to nearest even (exact if stochastic)

    @inline_device
    def update_row(weights, state1, state2, row, grad, order, bag_of, coef, partials, sums, r,
                   lane, group, rule, hp, inv_dim, skip_nonfinite, stochastic, key_lo, key_hi):
        kept = cuda.local.array(kept_size, acc_type)  # g of every pass, when row-wide
        dim = weights.shape[1]
        lr = hp[0]
        eps = hp[1]
        pass_columns = UNROLL * group
        mask = group_mask(cuda.threadIdx.x % 32, group)
        rowwise = rule == rules.ROWWISE_ADAGRAD
        need_row = rowwise or skip_nonfinite
        # pass 0's weights and state are loaded before the gradient is summed, so
        # their loads are in flight during the sum (no store comes in between)
        e0, e1, e2, e3 = read_elements(weights, state1, state2, row, lane, group, rule)
        row_step = zero
        if need_row:
            m = state1[row, 0] if rowwise else zero  # read before lane 0 writes it
            ss = zero
            nb = int32(0)
            for p in range(passes):
                g0 = g1 = g2 = g3 = zero
                if not any_width or p * pass_columns < dim:
                    g0, g1, g2, g3 = gradient(grad, order, bag_of, coef, partials, sums, r,
                                              p * pass_columns + lane, lane, group)
                kept[4 * p] = g0
                kept[4 * p + 1] = g1
                kept[4 * p + 2] = g2
                kept[4 * p + 3] = g3
                ss += g0 * g0 + g1 * g1 + g2 * g2 + g3 * g3
                nb |= bad(g0) | bad(g1) | bad(g2) | bad(g3)
            half = group // 2
            while half > 0:  # butterfly: every lane gets the same sum
                ss += shfl_xor(mask, ss, half)
                nb |= shfl_xor(mask, nb, half)
                half //= 2
            if skip_nonfinite and nb != 0:
                return
            if rowwise:
                m = m + ss * inv_dim
                if lane == 0:
                    state1[row, 0] = m
                row_step = lr / (math.sqrt(m) + eps)
        for p in range(passes):
            c0 = p * pass_columns + lane
            if need_row:
                g0 = kept[4 * p]
                g1 = kept[4 * p + 1]
                g2 = kept[4 * p + 2]
                g3 = kept[4 * p + 3]
            elif not any_width or p * pass_columns < dim:  # every lane sums (shuffles inside)
                g0, g1, g2, g3 = gradient(grad, order, bag_of, coef, partials, sums, r, c0,
                                          lane, group)
            else:  # a pass past the row's end
                return
            if c0 >= dim:
                continue
            c1 = c0 + group
            c2 = c1 + group
            c3 = c2 + group
            if p > 0:
                e0, e1, e2, e3 = read_elements(weights, state1, state2, row, c0, group, rule)
            apply(weights, state1, state2, row, c0, g0, e0, rule, row_step, hp, stochastic,
                  key_lo, key_hi)
            if c1 < dim:
                apply(weights, state1, state2, row, c1, g1, e1, rule, row_step, hp,
                      stochastic, key_lo, key_hi)
                if c2 < dim:
                    apply(weights, state1, state2, row, c2, g2, e2, rule, row_step, hp,
                          stochastic, key_lo, key_hi)
                    if c3 < dim:
                        apply(weights, state1, state2, row, c3, g3, e3, rule, row_step, hp,
                              stochastic, key_lo, key_hi)

    return update_row


@functools.lru_cache(maxsize=None)
def widened_hyper(table_dtype):
    """The inline device function ``(lr64, eps64, one_m_b1_64, one_m_b2_64, l1_64,
    two_l2_64, neg_power64, sqrt_power, step64) -> hp``: the rule's hyper-parameters in
    the accumulator type of ``table_dtype``, as :func:`row_updater`'s ``hp``."""
    widen = WIDEN[accumulator_dtype(table_dtype)]

    @inline_device
    def hyper(lr64, eps64, one_m_b1_64, one_m_b2_64, l1_64, two_l2_64, neg_power64, sqrt_power,
              step64):
        return (widen(lr64), widen(eps64), widen(one_m_b1_64), widen(one_m_b2_64), widen(l1_64),
                widen(two_l2_64), widen(neg_power64), sqrt_power, widen(step64))

    return hyper


@cuda.jit(device=True, inline="always")  # returns a view: inlined by Numba, not NVVM
def _per_row(state):
    """A per-row state ``[E]`` as the ``[E, 1]`` rows the row update indexes."""
    return as_rows(state, 0, state.shape[0], 1)


@cuda.jit(device=True, inline="always")
def _as_is(state):
    return state


@kernel_factory
def _update_kernel(table_dtype, grad_dtype, fused, columns, passes, per_row=False):
    """Update kernel for a table of ``table_dtype`` (a :func:`dtype_key`), computing in
    its accumulator type, ``columns`` per lane (:func:`columns_per_lane`) and
    ``passes`` passes of ``UNROLL·G`` columns over a row. ``fused``: the gradient is
    summed from ``grad_out`` (of ``grad_dtype``) in that type, else loaded from
    ``rows`` (``grad``, of ``grad_dtype``). ``per_row``: ``state1`` is a per-row state
    ``[E]`` (else ``[E, D]`` or ``[0, 1]``, as ``state2``)."""
    widen = WIDEN[accumulator_dtype(table_dtype)]
    update_row = row_updater(table_dtype, grad_dtype, fused, columns, passes)
    hyper = widened_hyper(table_dtype)
    view1 = _per_row if per_row else _as_is

    @jit_kernel(min_blocks_per_sm=2)
    def update_kernel(weights, state1, state2, ids, num_ids, grad, order, bag_of, coef, partials,
                      chunk, rule, lr64, eps64, one_m_b1_64, one_m_b2_64, l1_64, two_l2_64,
                      neg_power64, sqrt_power, step64, inv_dim64, skip_nonfinite, stochastic,
                      key_lo, key_hi, group, checks):
        """``fused``: a row group per sorted position, the first of each run (``ids``
        the sort keys, ``num_ids`` unused) summing the run; else a row group per row
        ``ids[r]``, ``r < num_ids``, of gradient row ``grad[r]``."""
        for k in range(checks.shape[0]):  # a failed input check: nothing is written
            if checks[k] != NO_ERROR_SLOT:
                return
        state1 = view1(state1)
        num_rows = weights.shape[0]
        inv_dim = widen(inv_dim64)
        hp = hyper(lr64, eps64, one_m_b1_64, one_m_b2_64, l1_64, two_l2_64, neg_power64,
                   sqrt_power, step64)
        tid = cuda.grid(1)
        lane = tid % group
        step = cuda.gridsize(1) // group
        if fused:
            n = order.shape[0]
            for i in range(tid // group, n, step):
                if not run_starts_at(ids, order, 0, i):
                    continue
                row = int64(ids[order[i]])
                if row < 0 or row >= num_rows:  # the -1 key (bad id) or untrusted garbage
                    continue
                sums = sum_range(i, run_end(ids, order, i, n), n, chunk)
                update_row(weights, state1, state2, row, grad, order, bag_of, coef, partials,
                           sums, i, lane, group, rule, hp, inv_dim, skip_nonfinite, stochastic,
                           key_lo, key_hi)
        else:
            for r in range(tid // group, num_ids, step):
                row = int64(ids[r])
                if row < 0 or row >= num_rows:  # untrusted garbage
                    continue
                update_row(weights, state1, state2, row, grad, order, bag_of, coef, partials,
                           (0, 0, 0, 0, 0, 1), r, lane, group, rule, hp, inv_dim,
                           skip_nonfinite, stochastic, key_lo, key_hi)

    return update_kernel


def _launch_update(family, rule, weights, state1, state2, hp, ids, grad, occ, grad_dtype,
                   num_ids_bound, skip_nonfinite, stochastic, key, checks):
    """The update kernel's launch: ``occ`` (:class:`.Occurrences`) when fused (``ids``
    the sort keys), else ``ids`` (``num_ids_bound`` of them) the rows of ``grad``."""
    dim = weights.shape[1]
    fused = occ is not None
    per_row = state1 is not None and state1.ndim == 1
    signature = (weights.dtype, grad_dtype, fused, dim, per_row, _device.device_id())
    plan = _PLANS.get(signature)
    if plan is None:
        group = group_size(dim)
        columns = columns_per_lane(dim, group)
        table_acc = accumulator_dtype(weights.dtype)
        plan = _PLANS[signature] = (
            np.dtype(weights.dtype).name in STOCHASTIC_FORMATS, group, threads_per_block(),
            _update_kernel(dtype_key(weights.dtype), dtype_key(grad_dtype), fused, columns,
                           -(-dim // (UNROLL * group)), per_row),
            _device.scratch((0, 1), table_acc),
            (_device.scratch(0, np.int64), _device.scratch(0, np.int64),
             _device.scratch(0, table_acc), _device.scratch((0, dim), table_acc), 1),
            is_bfloat16(weights.dtype))
    can_round, group, tpb, kernel, no_state, no_sums, bf16 = plan
    if bf16:  # (the state is fp32)
        weights = family.kernel_array(weights)
    stochastic = bool(stochastic) and can_round
    key = int(key)
    sums = (*occ.kernel_arrays(), occ.chunk) if fused else no_sums
    launch(kernel, blocks_for(num_ids_bound, tpb // group), tpb, weights,
           no_state if state1 is None else state1, no_state if state2 is None else state2,
           ids, num_ids_bound, grad, *sums, int(rule), *rule_constants(hp), 1.0 / dim,
           bool(skip_nonfinite), stochastic,
           np.uint64(key & 0xFFFFFFFF), np.uint64((key >> 32) & 0xFFFFFFFF), group,
           no_error_slots() if checks is None else checks)


_PLANS = {}  # (table and gradient dtypes, fused, D, per-row state, device) -> what
#             _launch_update derives from them


def rule_constants(hp):
    """The update kernels' float64 scalars of the hyper-parameters ``hp``: lr, eps,
    1 - beta1, 1 - beta2, l1, 2 l2, -lr_power, lr_power == -0.5, then the step size."""
    key = hp.tobytes()
    found = _CONSTANTS.get(key)
    if found is None:
        h = hp.tolist()
        found = (h[rules.LR], h[rules.EPS], 1.0 - h[rules.BETA1], 1.0 - h[rules.BETA2],
                 h[rules.L1], 2.0 * h[rules.L2], -h[rules.LR_POWER], h[rules.LR_POWER] == -0.5,
                 h[rules.STEP_SIZE])
        if len(_CONSTANTS) > 64:  # (Adam's step size changes every step)
            _CONSTANTS.clear()
        _CONSTANTS[key] = found
    return found


_CONSTANTS = {}  # hyper-parameters' bytes -> rule_constants of them


def sparse_update(family, rule, weights, state1, state2, hp, ids, rows, skip_nonfinite,
                  stochastic, key):
    """Update rows ``ids[k]`` (distinct, in range) of ``weights``/state from ``rows[k]``."""
    num_ids = ids.shape[0]
    if num_ids == 0:
        return
    _launch_update(family, rule, weights, state1, state2, hp, family.kernel_array(ids),
                   family.kernel_array(rows), None, rows.dtype, num_ids, skip_nonfinite,
                   stochastic, key, None)


def fused_sparse_update(family, rule, weights, state1, state2, hp, grad_out, values, offsets,
                        psw, combiner, bounds, finite, skip_nonfinite, stochastic, key,
                        on_error=None):
    """``sparse_update(*embedding_bag_backward(...))`` without materialising the rows.
    Returns ``(-1, -1, -1, -1)`` (no check is read back here; an empty batch's offset
    excepted, reported as the third entry).

    The checks, into four slots left pending (:mod:`._pending`; its report calls
    ``on_error()``, then raises as the CPU step does): offsets and ids under ``bounds``
    (0: both, 1: offsets, 2: none) and, when ``finite``, the gradient's finiteness, in
    ``prepare``'s launch; the weights' finiteness in a launch of its own. Then one row
    group per distinct id sums its occurrences (for an id
    with more than ``CHUNK`` of them, its partial rows) in order in registers and
    applies the rule, unless a slot holds an error: then the update kernel writes
    nothing. Ids out of range are skipped in every mode."""
    n = values.shape[0]
    num_bags = offsets.shape[0] - 1
    clean = (-1, -1, -1, -1)
    if bounds != Bounds.UNCHECKED and num_bags == 0:
        bad = empty_batch_bad_offset(family, offsets, n)
        if bad != -1:
            return -1, -1, bad, -1
    num_rows = weights.shape[0]
    raise_ids = bounds == Bounds.RAISE

    def report(bad):
        if on_error is not None:
            on_error()
        raise_nonfinite("grad_out", bad[2])
        raise_nonfinite("per_sample_weights", bad[3])
        raise_ragged(family, values, offsets, bad[0], bad[1] if raise_ids else -1, num_rows)

    checked = finite or bounds != Bounds.UNCHECKED
    with _pending.checks(4, "fused_step", report, (values, offsets), when=checked) as slots:
        if finite and psw is not None:
            record_nonfinite(family, psw.reshape(-1, 1), slots, 3)
        dim = weights.shape[1]
        grad_acc = accumulator_dtype(weights.dtype)  # as the CPU: summed in the table's type
        keys, bag_of, coef, _ = prepare(family, values, offsets, psw, combiner, num_rows,
                                        grad_acc, bounds != Bounds.UNCHECKED, raise_ids,
                                        slots=slots, grad=grad_out if finite else None)
        if n == 0 or num_bags == 0:
            return clean
        occ = occurrences(keys, bag_of, coef, dim, grad_acc)
        sum_partials(family, grad_out, occ)
        _launch_update(family, rule, weights, state1, state2, hp, keys,
                       family.kernel_array(grad_out), occ, grad_out.dtype, n, skip_nonfinite,
                       stochastic, key, slots)
    return clean
