"""Fused backward and optimizer step of many tables of one dtype, whatever their widths,
in the launches of one table's fused step (:func:`.sparse_update.fused_sparse_update`).

The tables are 2-D blocks of one flat array (as :mod:`.pool_tables` reads them), and
their optimizer state blocks of flat state arrays: a per-element slot at the weights'
element offsets, a per-row slot at the table's *keys*. Row ``r`` of a :class:`Table`
has key ``key + r``; ``key + rows`` stands for an id outside the table (its occurrences
update nothing); the tables' key ranges follow one another in the order given. A
:class:`Pool` is the bags of one combiner over one table: its rows (table rows)
``rows[first_row:first_row + count]``, its CSR bounds ``bounds[first_bound:first_bound +
bags + 1]`` (from 0: relative to its first row), per-sample weights at the same positions
of ``weights`` (or none), and its bags' gradient rows ``bag, bag + 1, ...`` of its
table's ``[bags, dim]`` gradient block of the flat ``grad`` (fp32).

Pipeline, as the one-table step's:

1. ``prepare_tables_kernel``: one thread per bag writes each position's sort key, its
   bag in its table's gradient and its coefficient (``embedding_bag_backward.prepare``'s,
   bit for bit); a pool's positions past its last bag take the key of ids outside the
   table (so a pool's ``count`` may be a capacity its bags do not fill). With
   ``finite``, the same launch checks the gradient for NaN and Inf (one slot left
   pending; the update writes nothing when it holds an error);
2. :func:`._segments.stable_argsort` (or, into memory allocated once by :func:`reserve`,
   the radix sort of :mod:`.radix_sort`): the positions sorted by key, so a table's
   occurrences take the sorted positions ``[Σ earlier tables' ids, + its ids)``, known to
   the host;
3. ``partial_tables_kernel`` per level, then ``update_tables_kernel``: each table takes a
   range of the grid's blocks, so a block's lanes share one width, with row groups of
   :func:`group_size` lanes. The partial rows of a table's long runs are cut by windows
   that start at its first sorted position, into partial rows of its own (a row of the
   widest table's width), as its own step cuts them. The row group of the first sorted
   position of each of the table's runs finds the run's end from the sorted keys and runs
   :func:`.sparse_update.row_updater` for its row, with the
   table's hyper-parameters (Adam's step size and the stochastic rounding key follow each
   table's step count).

Sums are taken in the order the one-table step takes them, so each table's weights and
state come out with the same bits as its own ``fused_step``. The launches: the per-bag
pass (with the check), the sort (a library call; :mod:`.radix_sort`'s ``5 * passes``
into reserved memory), one per partial level (none while no table has more than
``CHUNK`` ids), the update.
"""
import functools
import math
import struct
from typing import NamedTuple

import numpy as np
from numba import cuda, int64, uint64

from .._modes import Combiner
from . import _device, _pending, _segments, radix_sort
from ._launch import (
    NO_ERROR_SLOT,
    UNROLL,
    WIDEN,
    accumulator_dtype,
    as_rows,
    blocks_for,
    dtype_key,
    float64_from_bits,
    group_size,
    inline_device,
    jit_kernel,
    kernel_factory,
    load_as_float,
    no_error_slots,
    store_as,
    threads_per_block,
)
from ._launcher import launch
from ._nonfinite import nonfinite_scan, scan_blocks
from ._segments import device_final_level as final_level
from ._segments import device_level_base as level_base
from ._segments import device_piece as piece
from ._segments import device_run_end as run_end
from ._segments import device_slot_run as slot_run
from .embedding_bag_backward import key_dtype, make_accumulate, store_columns
from .join_bags import feature_of
from .sparse_update import STOCHASTIC_FORMATS, row_updater, rule_constants, widened_hyper


class Table(NamedTuple):
    """One table of the step (see the module doc)."""

    at: int  # element offset of row 0 in the flat weights and per-element state
    rows: int
    dim: int
    key: int  # key of row 0 (and a per-row slot's element of row 0)
    grad: int  # element offset of its [bags, dim] gradient in the flat gradient
    bags: int
    ids: int  # its occurrences, over its pools
    step_size: float  # the rule's step size for this table's step (Adam)
    rounding_key: int  # the stochastic rounding key of this table's step


class Pool(NamedTuple):
    """One combiner's bags over one table (see the module doc)."""

    table: int  # its index in the tables
    first_row: int
    count: int
    first_bound: int
    bags: int
    bag: int  # its first bag in its table's gradient
    combiner: int  # a :class:`Combiner` value


#: int64 fields of a pool, then of a table, in the plan
POOL_FIELDS = ("table", "first_row", "count", "first_bound", "bag", "combiner")
TABLE_FIELDS = ("at", "rows", "dim", "key", "grad", "bags", "position", "ids", "group",
                "partials", "step_size", "key_lo", "key_hi")
(P_TABLE, P_FIRST_ROW, P_COUNT, P_FIRST_BOUND, P_BAG, P_COMBINER) = range(len(POOL_FIELDS))
(T_AT, T_ROWS, T_DIM, T_KEY, T_GRAD, T_BAGS, T_POSITION, T_IDS, T_GROUP, T_PARTIALS,
 T_STEP_SIZE, T_KEY_LO, T_KEY_HI) = range(len(TABLE_FIELDS))


@inline_device
def _layout(pools, tables):
    """``(the update's first blocks, pool fields, table fields)``: where each part of the
    plan starts. The plan (int64) holds the number of pools, the pools' first bags (one
    more: their total), the tables' first blocks of the update (one more), the pools'
    :data:`POOL_FIELDS`, the tables' :data:`TABLE_FIELDS`, then for each partial level the
    tables' first blocks (one more)."""
    blocks = pools + 2
    pool_fields = blocks + tables + 1
    return blocks, pool_fields, pool_fields + pools * len(POOL_FIELDS)


# ---------------------------------------------------------------------------
# 2. per-position key, bag and coefficient
# ---------------------------------------------------------------------------
@kernel_factory
def prepare_tables_kernel(acc_dtype, weights_dtype, scaled, grad_dtype=None):
    """The per-bag pass for coefficients in ``acc_dtype`` from weights of
    ``weights_dtype`` (:func:`dtype_key`; None: unweighted). ``scaled``: write the
    coefficients (weights, or a mean/sqrtn combiner in some pool). ``grad_dtype``
    (None: no check): the same launch records the first row of ``grad`` (a 2-D array of
    that dtype) holding NaN or Inf in ``slots[0]`` (:mod:`._nonfinite`)."""
    widen = WIDEN[np.dtype(acc_dtype)]
    load_weight = load_as_float(weights_dtype or acc_dtype)
    has_weights = weights_dtype is not None
    check_grad = grad_dtype is not None
    scan_grad = nonfinite_scan(grad_dtype or acc_dtype)
    pool_width = len(POOL_FIELDS)
    table_width = len(TABLE_FIELDS)

    @cuda.jit(cache=False)
    def prepare_tables_kernel(rows, bounds, weights, plan, tables, keys, bag_of, coef, slots,
                              grad):
        if check_grad:
            scan_grad(grad, slots, 0)
        pools = plan[0]
        _, pool_fields, table_fields = _layout(pools, tables)
        for b in range(cuda.grid(1), plan[1 + pools], cuda.gridsize(1)):
            p = feature_of(plan, 1, pools, b)
            at = pool_fields + p * pool_width
            t = table_fields + plan[at + P_TABLE] * table_width
            first = plan[at + P_FIRST_ROW]
            n_values = plan[at + P_COUNT]
            local = b - plan[1 + p]
            lo = bounds[plan[at + P_FIRST_BOUND] + local]
            hi = bounds[plan[at + P_FIRST_BOUND] + local + 1]
            start = min(max(lo, 0), n_values)  # clamped: malformed CSR never reads out of range
            end = min(max(hi, start), n_values)
            key0 = plan[t + T_KEY]
            num_rows = plan[t + T_ROWS]
            bag = plan[at + P_BAG] + local
            if local == plan[2 + p] - plan[1 + p] - 1:  # the pool's rows past its last bag
                for j in range(first + end, first + n_values):
                    keys[j] = key0 + num_rows
                    bag_of[j] = -1
                    if scaled:
                        coef[j] = widen(0)
            if not scaled:
                for j in range(first + start, first + end):
                    row = rows[j]
                    ok = row >= 0 and row < num_rows
                    keys[j] = key0 + (row if ok else num_rows)
                    bag_of[j] = bag if ok else -1
                continue
            combiner = plan[at + P_COMBINER]
            w_sum = 0.0
            w_sq = 0.0
            for j in range(first + start, first + end):
                row = rows[j]
                if row >= 0 and row < num_rows:
                    w = np.float64(widen(load_weight(weights[j]))) if has_weights else 1.0
                    w_sum += w
                    w_sq += w * w
            scale = 1.0
            if combiner == Combiner.MEAN:
                scale = 1.0 / w_sum if w_sum != 0.0 else 0.0
            elif combiner == Combiner.SQRTN:
                scale = 1.0 / math.sqrt(w_sq) if w_sq != 0.0 else 0.0
            for j in range(first + start, first + end):
                row = rows[j]
                if row >= 0 and row < num_rows:
                    w = np.float64(widen(load_weight(weights[j]))) if has_weights else 1.0
                    keys[j] = key0 + row
                    bag_of[j] = bag
                    coef[j] = widen(scale * w)
                else:
                    keys[j] = key0 + num_rows
                    bag_of[j] = -1
                    coef[j] = widen(0)

    return prepare_tables_kernel


@cuda.jit(device=True, inline="always")  # returns a view: inlined by Numba, not NVVM
def _gradient_of(grad, plan, t):
    """Table ``t``'s (its fields' offset) ``[bags, dim]`` gradient."""
    return as_rows(grad, plan[t + T_GRAD], plan[t + T_BAGS], plan[t + T_DIM])


@inline_device
def _table_of_block(plan, at, tables, block):
    """``(table fields' offset, index of the thread's block among the table's, the table's
    blocks)`` of ``block`` when the plan's block starts at ``at`` give each table its
    range."""
    which = feature_of(plan, at, tables, block)
    first = plan[at + which]
    _, _, table_fields = _layout(plan[0], tables)
    return table_fields + which * len(TABLE_FIELDS), block - first, plan[at + which + 1] - first


@inline_device
def _table_sum_range(lo, hi, position, ids, chunk, base):
    """:func:`.embedding_bag_backward.sum_range` of the run of sorted positions ``[lo,
    hi)`` of a table whose ``ids`` sorted positions start at ``position`` and whose
    partial rows at ``base``: the windows are the table's own, as in its own step (level
    0 items are positions of the whole sort)."""
    level, first, last, width = final_level(lo - position, hi - position, chunk)
    if level == 0:
        first += position
        last += position
    return level, first, last, lo - position, base + level_base(ids, level, chunk), width


# ---------------------------------------------------------------------------
# 4. partial rows of long runs
# ---------------------------------------------------------------------------
@kernel_factory
def partial_tables_kernel(acc_dtype, grad_dtype):
    """Kernel writing the partial rows of one level ``>= 1`` (as
    :func:`.embedding_bag_backward.partial_kernel` for each table on its own: its windows
    start at its first sorted position, its partial rows at its own), each table on its
    range of the grid's blocks, a row group of its width per slot."""
    accumulate = make_accumulate(acc_dtype, grad_dtype, UNROLL)
    store = store_as(acc_dtype)

    @jit_kernel(min_blocks_per_sm=2)
    def partial_tables_kernel(grad, order, bag_of, coef, partials, widest, keys, level, chunk,
                              plan, tables):
        _, _, table_fields = _layout(plan[0], tables)
        t, local, blocks = _table_of_block(
            plan, table_fields + tables * len(TABLE_FIELDS) + (level - 1) * (tables + 1), tables,
            cuda.blockIdx.x)
        position = plan[t + T_POSITION]
        n = plan[t + T_IDS]
        width = 1
        for _ in range(level):
            width *= chunk
        base = plan[t + T_PARTIALS] + level_base(n, level, chunk)
        below = plan[t + T_PARTIALS] + level_base(n, level - 1, chunk)
        dim = plan[t + T_DIM]
        rows = as_rows(partials, 0, partials.shape[0] // widest, widest)[:, 0:dim]
        g = _gradient_of(grad, plan, t)
        group = plan[t + T_GROUP]
        threads = cuda.blockDim.x
        tid = local * threads + cuda.threadIdx.x
        lane = tid % group
        for s in range(tid // group, 2 * ((n + width - 1) // width), blocks * threads // group):
            window = s // 2
            w_lo = window * width
            w_hi = min(w_lo + width, n)
            at = position + (w_lo if s % 2 == 0 else w_hi - 1)
            if keys[order[at]] - plan[t + T_KEY] >= plan[t + T_ROWS]:  # ids outside the table
                continue
            lo, hi = slot_run(keys, order, position, position + n, position + w_lo,
                              position + w_hi, s % 2 == 1)
            if lo < 0:
                continue
            lo -= position
            hi -= position
            final, _, _, _ = final_level(lo, hi, chunk)
            if final < level:
                continue
            first, last = piece(lo, hi, level, window, chunk)
            if level == 1:  # positions of the whole sort
                first += position
                last += position
            for cb in range(0, dim, UNROLL * group):
                a0, a1, a2, a3 = accumulate(g, order, bag_of, coef, rows, level - 1, first, last,
                                            lo, below, width // chunk, cb + lane, lane, group)
                store_columns(rows, base + s, cb + lane, group, store, a0, a1, a2, a3)

    return partial_tables_kernel


# ---------------------------------------------------------------------------
# 5. the update
# ---------------------------------------------------------------------------
@kernel_factory
def update_tables_kernel(table_dtype, grad_dtype, passes):
    """The update kernel for tables of ``table_dtype`` (:func:`dtype_key`), a gradient of
    ``grad_dtype`` summed in the tables' accumulator type, rows of at most ``passes``
    passes of ``UNROLL·G`` columns."""
    widen = WIDEN[accumulator_dtype(table_dtype)]
    update_row = row_updater(table_dtype, grad_dtype, True, UNROLL, passes, True)
    hyper = widened_hyper(table_dtype)

    @jit_kernel(min_blocks_per_sm=2)
    def update_tables_kernel(weights, state1, state2, per_row1, per_row2, keys, grad, order,
                             bag_of, coef, partials, widest, chunk, plan, tables,
                             rule, lr64, eps64, one_m_b1_64, one_m_b2_64, l1_64, two_l2_64,
                             neg_power64, sqrt_power, skip_nonfinite, stochastic, checks):
        for k in range(checks.shape[0]):  # a failed input check: nothing is written
            if checks[k] != NO_ERROR_SLOT:
                return
        first_blocks, _, _ = _layout(plan[0], tables)
        t, local, blocks = _table_of_block(plan, first_blocks, tables, cuda.blockIdx.x)
        position = plan[t + T_POSITION]
        n_ids = plan[t + T_IDS]
        end = position + n_ids
        num_rows = plan[t + T_ROWS]
        dim = plan[t + T_DIM]
        key0 = plan[t + T_KEY]
        at = plan[t + T_AT]
        group = plan[t + T_GROUP]
        partial_base = plan[t + T_PARTIALS]
        threads = cuda.blockDim.x
        tid = local * threads + cuda.threadIdx.x
        lane = tid % group
        w = as_rows(weights, at, num_rows, dim)
        s1 = as_rows(state1, key0 if per_row1 else at, num_rows if state1.shape[0] else 0,
                     1 if per_row1 else dim)
        s2 = as_rows(state2, key0 if per_row2 else at, num_rows if state2.shape[0] else 0,
                     1 if per_row2 else dim)
        g = _gradient_of(grad, plan, t)
        # the partial rows at the widest width: the sums read a row's first ``dim`` columns
        # (and zero what they read past them)
        rows = as_rows(partials, 0, partials.shape[0] // widest, widest)
        hp = hyper(lr64, eps64, one_m_b1_64, one_m_b2_64, l1_64, two_l2_64, neg_power64,
                   sqrt_power, float64_from_bits(plan[t + T_STEP_SIZE]))
        inv_dim = widen(1.0 / np.float64(dim))
        key_lo = uint64(plan[t + T_KEY_LO])
        key_hi = uint64(plan[t + T_KEY_HI])
        for i in range(position + tid // group, end, blocks * threads // group):
            key = keys[order[i]]  # (read once: with run_starts_at ptxas spills here)
            if i > position and keys[order[i - 1]] == key:  # not the run's first position
                continue
            row = int64(key) - key0
            if row < 0 or row >= num_rows:  # ids outside the table
                continue
            sums = _table_sum_range(i, run_end(keys, order, i, end), position, n_ids, chunk,
                                    partial_base)
            update_row(w, s1, s2, row, g, order, bag_of, coef, rows, sums, i, lane, group, rule,
                       hp, inv_dim, skip_nonfinite, stochastic, key_lo, key_hi)

    return update_tables_kernel


_FLOAT64, _INT64 = struct.Struct("<d"), struct.Struct("<q")  # a step size's bits in the plan


def _plan(tables, pools, tpb, chunk):
    """``(the int64 plan array (host), the update's blocks, each partial level's blocks,
    the partial rows)``."""
    firsts = [0]
    for p in pools:
        firsts.append(firsts[-1] + p.bags)
    partials = [_segments.partial_levels(t.ids, chunk) for t in tables]
    levels = max(own[0] for own in partials)
    blocks = [[0] for _ in range(levels + 1)]  # the update's, then each level's
    position, partial_rows, fields = 0, 0, []
    for t, (own_levels, own_rows) in zip(tables, partials):
        group = group_size(t.dim)
        blocks[0].append(blocks[0][-1] + (blocks_for(t.ids, tpb // group) if t.ids else 0))
        width = 1
        for level in range(1, levels + 1):
            width *= chunk
            slots = 2 * -(-t.ids // width) if level <= own_levels else 0
            blocks[level].append(blocks[level][-1] + (blocks_for(slots, tpb // group) if slots else 0))
        step_bits = _INT64.unpack(_FLOAT64.pack(t.step_size))[0]
        fields += [t.at, t.rows, t.dim, t.key, t.grad, t.bags, position, t.ids, group,
                   partial_rows, step_bits, t.rounding_key & 0xFFFFFFFF,
                   (t.rounding_key >> 32) & 0xFFFFFFFF]
        position += t.ids
        partial_rows += own_rows
    pool_fields = [x for p in pools for x in (p.table, p.first_row, p.count, p.first_bound, p.bag,
                                              p.combiner)]
    plan = np.array([len(pools)] + firsts + blocks[0] + pool_fields + fields +
                    [b for level in blocks[1:] for b in level], np.int64)
    return plan, [level[-1] for level in blocks], partial_rows


class StepSpace(NamedTuple):
    """The arrays of an update of fixed tables and pools, allocated once (:func:`reserve`)."""

    plan_host: object  # the plan as last copied to the device
    plan: object
    keys: object
    bag_of: object
    coef: object
    partials: object
    sort: object  # a radix_sort.SortSpace


def _arrays(tables, pools, acc, scaled, partial_rows, n):
    """``(keys, bag_of, coef, partials)`` of an update of ``n`` positions."""
    keys = _device.scratch(n, key_dtype(tables[-1].key + tables[-1].rows + 1))
    bag_of = _device.scratch(n, _segments.index_dtype(max(t.bags for t in tables)))
    coef = _device.scratch(n if scaled else 0, acc)
    partials = _device.scratch(partial_rows * max(t.dim for t in tables), acc)
    return keys, bag_of, coef, partials


def _totals(pools, psw):
    """``(positions, bags, scaled)`` of ``pools``: their counts, their bags, and whether the
    coefficients are written (weights ``psw``, or a mean or sqrtn pool)."""
    n = bags = 0
    scaled = psw is not None
    for p in pools:
        n += p.count
        bags += p.bags
        scaled = scaled or p.combiner != Combiner.SUM
    return n, bags, scaled


def reserve(family, tables, pools, weights_dtype, weighted):
    """The :class:`StepSpace` of updates of ``tables`` through ``pools`` (each pool at least
    one bag; rows past a pool's last bag update nothing, so a pool's ``count`` may be its
    capacity), ``weights_dtype`` the tables', ``weighted`` whether per-sample weights come.
    The sort is :mod:`.radix_sort`'s: no step allocates, calls a library or reads the
    device (a step whose plan changed, an Adam step size, copies it to the device)."""
    if any(not p.bags for p in pools):
        raise ValueError("a reserved update's pools each need at least one bag")
    plan, _, partial_rows = _plan(tables, pools, threads_per_block(), _segments.CHUNK)
    n, _, scaled = _totals(pools, None)
    acc = accumulator_dtype(weights_dtype)
    keys, bag_of, coef, partials = _arrays(tables, pools, acc, weighted or scaled, partial_rows, n)
    last = tables[-1].key + tables[-1].rows
    return StepSpace(plan, family.kernel_array(family.put(plan)), keys, bag_of, coef, partials,
                     radix_sort.SortSpace(n, last, keys.dtype))


def _copy_plan(family, into, plan_host):
    """Copy ``plan_host`` into ``into`` (a :class:`StepSpace`) when it differs from the plan
    there (a step size or a rounding key changed)."""
    if not np.array_equal(plan_host, into.plan_host):
        family.copy_in(into.plan, plan_host)
        into.plan_host[:] = plan_host


def upload_plan(family, into, tables, pools):
    """Copy the plan of ``tables`` and ``pools`` into ``into`` when it changed: what an
    :func:`update_tables` call with ``upload=False`` left to the host (a replay of a step
    captured into a CUDA graph runs with the plan in ``into``)."""
    _copy_plan(family, into, _plan(tables, pools, threads_per_block(), _segments.CHUNK)[0])


class _Kernels(NamedTuple):
    """What an update derives from its dtypes, weights, checks and widths (:func:`_kernels`)."""

    acc: object  # the accumulator dtype
    prepare: object  # the kernels
    partial: object
    update: object
    widest: int
    stochastic: bool  # whether the weights' format rounds stochastically


@functools.lru_cache(maxsize=None)
def _kernels(weights_dtype, grad_dtype, psw_dtype, scaled, finite, dims):
    acc = accumulator_dtype(weights_dtype)
    # at least two passes: with one, the row's kept gradient stays in registers and ptxas
    # spills under the launch bounds (sm_90); with two it lives in local memory
    passes = max(2, *(-(-d // (UNROLL * group_size(d))) for d in dims))
    return _Kernels(acc, prepare_tables_kernel(dtype_key(acc), dtype_key(psw_dtype), scaled,
                                               dtype_key(grad_dtype) if finite else None),
                    partial_tables_kernel(dtype_key(acc), dtype_key(grad_dtype)),
                    update_tables_kernel(dtype_key(weights_dtype), dtype_key(grad_dtype), passes),
                    max(dims), np.dtype(weights_dtype).name in STOCHASTIC_FORMATS)


def update_tables(family, rule, weights, state1, state2, per_row, hp, tables, pools, grad, rows,
                  bounds, psw, finite, skip_nonfinite, stochastic, report, into=None, upload=True):
    """Apply the rule ``rule`` (hyper-parameters ``hp``, their step size taken from each
    table) to ``tables`` from ``grad`` through ``pools`` (see the module doc; ``state1``,
    ``state2``: the flat state arrays or None, ``per_row`` whether each is per row).
    ``grad``: the flat gradient, or its rows where every table has one width (a C-contiguous
    ``[rows, width]`` array). ``finite``: the gradient is checked first, ``report(element)``
    called at the wait that reads a NaN or Inf in the row of ``grad`` starting at that
    element of the flat gradient (nothing is written then). ``into``:
    the :func:`reserve` d arrays of these tables and pools; ``upload=False``: the plan in
    ``into`` is left as it is (see :func:`upload_plan`)."""
    n, bags, scaled = _totals(pools, psw)
    if not n:
        return
    tpb = threads_per_block()
    chunk = _segments.CHUNK
    plan_host, blocks, partial_rows = _plan(tables, pools, tpb, chunk)
    kern = _kernels(weights.dtype, grad.dtype, None if psw is None else psw.dtype, scaled, finite,
                    tuple(t.dim for t in tables))
    acc = kern.acc
    if into is None:
        plan = family.kernel_array(family.put(plan_host))
        keys, bag_of, coef, partials = _arrays(tables, pools, acc, scaled, partial_rows, n)
    else:
        plan, keys, bag_of, coef, partials = into.plan, into.keys, into.bag_of, into.coef, into.partials
        if upload:
            _copy_plan(family, into, plan_host)
    width = grad.shape[1] if grad.ndim == 2 else 1
    k_grad = family.kernel_array(grad.reshape(-1) if grad.ndim == 2 else grad)
    with _pending.checks(1, "fused_step", lambda bad: report(bad[0] * width), (grad,),
                         when=finite) as slots:
        k_rows = family.kernel_array(rows)
        bag_blocks = blocks_for(bags, tpb)
        if finite:  # the gradient's check in the same launch, by rows
            flat = grad if grad.ndim == 2 else grad.reshape(-1, 1)
            args = (slots, family.kernel_array(flat))
            bag_blocks = max(bag_blocks, scan_blocks(flat, tpb))
        else:
            args = (no_error_slots(), _device.scratch((0, 1), acc))
        launch(kern.prepare, bag_blocks, tpb, k_rows, family.kernel_array(bounds),
               k_rows if psw is None else family.kernel_array(psw), plan, len(tables), keys,
               bag_of, coef, *args)
        order = (_segments.stable_argsort(_device.xp(), keys) if into is None
                 else into.sort.sort(keys))
        sums = (order, bag_of, coef, partials, kern.widest)
        for level, level_blocks in enumerate(blocks[1:], 1):
            launch(kern.partial, level_blocks, tpb, k_grad, *sums, keys, level, chunk, plan,
                   len(tables))
        none = _device.scratch(0, acc)
        constants = rule_constants(np.asarray(hp, np.float64))[:-1]  # (step sizes: the plan's)
        launch(kern.update, blocks[0], tpb, family.kernel_array(weights),
               none if state1 is None else family.kernel_array(state1),
               none if state2 is None else family.kernel_array(state2), bool(per_row[0]),
               bool(per_row[1]), keys, k_grad, *sums, chunk, plan, len(tables), int(rule),
               *constants, bool(skip_nonfinite),
               bool(stochastic) and kern.stochastic,
               slots if finite else no_error_slots())
