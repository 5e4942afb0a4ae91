"""Pooled lookup of many tables of one dtype, whatever their widths, in one launch.

The tables are 2-D blocks of one flat array (``table``, each block C-contiguous at an
element offset). A :class:`Segment` names the bags of one feature over one block: its
ids ``values[first value:first value + count]`` (each plus ``row_start``, the feature's
first row in the block), its CSR ``offsets[first offset:first offset + bags + 1]``
(from 0, relative to its first value), its combiner, and where its ``[bags, dim]``
output goes: columns ``[column, column + dim)`` of a ``[bags, out_stride]`` block of
``out`` at element offset ``out``. Bag ``b`` pools as ``embedding_bag`` of its block
does (:mod:`.embedding_bag`): ``w_j · row_j`` added in position order with the same
fused steps, the denominators in position order, the scale applied once, so the bits
are the same; an id outside its block adds nothing and counts in no denominator.
Nothing is checked or recorded: the caller has checked the ids and offsets.

On the way it writes what a backward takes (what ``join_bags`` gives, with no launch of
its own): the segment's rows ``values[j] + row_start`` at ``rows[rows_at + j]`` (-1 for
positions past its last bag, a count its bags do not fill), and its
bags' bounds, each plus ``pool_first_value``, at ``pool_offsets[pool_offsets_at + b]``
(``b <= bags``). Segments laid out one after another there (each starting at the
previous one's last bound and at its first value plus its count) make one batch of
their bags.

Each segment takes a range of the grid's blocks, so a block's lanes share one row
layout; a block finds its segment by a binary search over the segments' first blocks.
A row group of ``G`` lanes (the next power of two >= the row's vectors, at most a
warp; a run-time value) owns a bag; lane ``l`` sums vectors ``l, l + G, ...`` of the
rows, ``V`` elements each (:func:`._vector.vector_width` of the block). The kernel
holds one body per vector width its tables have (at most four), so its size does not
grow with the number of tables or widths.
"""
import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda

from .._modes import Combiner
from . import _vector
from ._launch import (
    as_rows, blocks_for, dtype_key, group_size, jit_kernel, kernel_factory, threads_per_block,
)
from ._launcher import launch
from .embedding_bag import pooling_parts
from .join_bags import feature_of

#: the int64 fields of a segment on the device, in order (after the segments' first blocks)
FIELDS = ("first_value", "count", "first_offset", "bags", "row_start", "table", "rows", "dim",
          "combiner", "out", "out_stride", "column", "rows_at", "pool_offsets_at",
          "pool_first_value", "geometry", "group")
(FIRST_VALUE, COUNT, FIRST_OFFSET, BAGS, ROW_START, TABLE, ROWS, DIM, COMBINER, OUT, OUT_STRIDE,
 COLUMN, ROWS_AT, POOL_OFFSETS_AT, POOL_FIRST_VALUE, GEOMETRY, GROUP) = range(len(FIELDS))


class Block(NamedTuple):
    """Where one table lies in the flat array, and how a bag reads its rows
    (:func:`block_of`)."""

    at: int  # element offset of its row 0
    rows: int
    dim: int
    width: int  # elements per vector load
    group: int  # lanes per bag


def block_of(family, flat, view):
    """The :class:`Block` of ``view``, a 2-D C-contiguous view of the 1-D ``flat``."""
    k_view = family.kernel_array(view)
    width = _vector.vector_width(k_view)
    at = (_vector.data_pointer(k_view) - _vector.data_pointer(family.kernel_array(flat)))
    return Block(at // flat.dtype.itemsize, int(view.shape[0]), int(view.shape[1]), width,
                 group_size(view.shape[1] // width))


class Segment(NamedTuple):
    """One feature's bags over one table :class:`Block` (see the module doc)."""

    block: Block
    first_value: int
    count: int
    first_offset: int
    bags: int
    row_start: int
    combiner: int
    out: int
    out_stride: int
    column: int
    rows_at: int
    pool_offsets_at: int
    pool_first_value: int


@functools.lru_cache(maxsize=None)
def segment_pooler(table_dtype, weights_dtype, width):
    """The device function ``pool_segment(tid, stride, group, table, values, offsets,
    weights, combiner, out, row_start, rows, pool_offsets, pool_first_value)``: bags
    ``tid // G, (tid + stride) // G, ...`` of one segment (``tid`` the thread's index
    among the segment's ``stride`` threads, ``group`` = G) into ``out[b]``, their rows
    into ``rows`` and their bounds, plus ``pool_first_value``, into ``pool_offsets``;
    ``V = width``."""
    widen, load, load_weight, store, zero = pooling_parts(table_dtype, weights_dtype, width)
    weighted = weights_dtype is not None

    @cuda.jit(device=True)
    def pool_segment(tid, stride, group, table, values, offsets, weights, combiner, out,
                     row_start, rows, pool_offsets, pool_first_value):
        num_rows = table.shape[0]
        vectors = table.shape[1] // width
        n_values = values.shape[0]
        lane = tid % group
        if tid == 0:
            pool_offsets[0] = pool_first_value + min(max(offsets[0], 0), n_values)
        for b in range(tid // group, offsets.shape[0] - 1, stride // group):
            start = min(max(offsets[b], 0), n_values)
            end = min(max(offsets[b + 1], start), n_values)
            if lane == 0:
                pool_offsets[b + 1] = pool_first_value + end
                for j in range(start, end):
                    rows[j] = values[j] + row_start
                if b == offsets.shape[0] - 2:  # ids past the last bag (padding): no row
                    for j in range(end, n_values):
                        rows[j] = -1
            for c in range(lane, vectors, group):
                col = c * width
                acc = zero
                w_sum = widen(0)
                w_sq = widen(0)
                for j in range(start, end):
                    row = values[j] + row_start
                    if row >= 0 and row < num_rows:
                        w = widen(load_weight(weights[j])) if weighted else widen(1)
                        acc = _vector.fma_where(True, acc, w, load(table, row, col))
                        w_sum += w
                        w_sq += w * w
                scale = widen(1)
                if combiner == Combiner.MEAN:
                    scale = widen(1) / w_sum if w_sum != 0 else widen(0)
                elif combiner == Combiner.SQRTN:
                    scale = widen(1) / math.sqrt(w_sq) if w_sq != 0 else widen(0)
                for k in range(width):
                    out[b, col + k] = store(acc[k] * scale)

    return pool_segment


def _chain(bodies):
    """``run(which, ...)``: ``bodies[which](...)``, one call (bodies not inlined)."""
    head = bodies[0]
    if len(bodies) == 1:

        @cuda.jit(device=True, inline=True)
        def run(which, tid, stride, group, table, values, offsets, weights, combiner, out,
                row_start, rows, pool_offsets, pool_first_value):
            head(tid, stride, group, table, values, offsets, weights, combiner, out, row_start,
                 rows, pool_offsets, pool_first_value)

        return run
    rest = _chain(bodies[1:])

    @cuda.jit(device=True, inline=True)
    def run(which, tid, stride, group, table, values, offsets, weights, combiner, out, row_start,
            rows, pool_offsets, pool_first_value):
        if which == 0:
            head(tid, stride, group, table, values, offsets, weights, combiner, out, row_start,
                 rows, pool_offsets, pool_first_value)
        else:
            rest(which - 1, tid, stride, group, table, values, offsets, weights, combiner, out,
                 row_start, rows, pool_offsets, pool_first_value)

    return run


@kernel_factory
def pool_tables_kernel(table_dtype, weights_dtype, widths):
    """The kernel for tables of ``table_dtype`` (:func:`dtype_key`) whose rows are read
    ``widths[k]`` elements at a time (a segment's ``geometry`` field is ``k``), weights
    of ``weights_dtype`` (None: none)."""
    run = _chain([segment_pooler(table_dtype, weights_dtype, v) for v in widths])
    fields = len(FIELDS)

    @jit_kernel(2)
    def pool_tables_kernel(table, values, offsets, weights, plan, base, count, out, rows,
                           pool_offsets):
        """The segments' plan is ``plan[base:]``: segment ``s`` (of ``count``) runs on
        blocks ``[segments[s], segments[s + 1])``; its fields follow the ``count + 1``
        first blocks, :data:`FIELDS` each. Without weights, ``weights`` is ``values``
        (never read)."""
        segments = plan[base:]
        block = cuda.blockIdx.x
        s = feature_of(segments, 0, count, block)
        threads = cuda.blockDim.x
        at = count + 1 + s * fields
        v0 = segments[at + FIRST_VALUE]
        n = segments[at + COUNT]
        bags = segments[at + BAGS]
        dim = segments[at + DIM]
        c0 = segments[at + COLUMN]
        o0 = segments[at + FIRST_OFFSET]
        p0 = segments[at + POOL_OFFSETS_AT]
        r0 = segments[at + ROWS_AT]
        run(segments[at + GEOMETRY], (block - segments[s]) * threads + cuda.threadIdx.x,
            (segments[s + 1] - segments[s]) * threads, segments[at + GROUP],
            as_rows(table, segments[at + TABLE], segments[at + ROWS], dim),
            values[v0:v0 + n], offsets[o0:o0 + bags + 1], weights[v0:v0 + n],
            segments[at + COMBINER],
            as_rows(out, segments[at + OUT], bags, segments[at + OUT_STRIDE])[:, c0:c0 + dim],
            segments[at + ROW_START], rows[r0:r0 + n], pool_offsets[p0:p0 + bags + 1],
            segments[at + POOL_FIRST_VALUE])

    return pool_tables_kernel


class Layout(NamedTuple):
    """A launch's plan on the host (:func:`layout`): the segments' first blocks, then
    their :data:`FIELDS`; calls whose segments differ in their counts alone take copies
    of it with those fields placed (:func:`placed`)."""

    plan: object  # int64 NumPy array
    count: int  # segments
    blocks: int
    kernel: object
    placed: object  # the positions in ``plan`` of each segment's PLACED fields, in turn


def layout(table, segments, weighted):
    """The :class:`Layout` of a launch of ``segments`` (at least one) over the flat
    ``table``, weights of ``weighted`` dtype (None: none)."""
    widths = tuple(sorted({s.block.width for s in segments}))  # one kernel per set of widths
    tpb = threads_per_block()
    firsts, fields = [0], []
    for s in segments:
        block = s.block
        firsts.append(firsts[-1] + blocks_for(s.bags, tpb // block.group))
        fields += [s.first_value, s.count, s.first_offset, s.bags, s.row_start, block.at,
                   block.rows, block.dim, s.combiner, s.out, s.out_stride, s.column, s.rows_at,
                   s.pool_offsets_at, s.pool_first_value, widths.index(block.width), block.group]
    kernel = pool_tables_kernel(dtype_key(table.dtype),
                                None if weighted is None else dtype_key(weighted), widths)
    count = len(segments)
    at = count + 1 + np.arange(count)[:, None] * len(FIELDS) + np.array(PLACED)
    return Layout(np.array(firsts + fields, np.int64), count, firsts[-1], kernel, at.reshape(-1))


#: the fields :func:`placed` writes, in the order of its ``columns``
PLACED = (FIRST_VALUE, COUNT, ROWS_AT, POOL_FIRST_VALUE)


def placed(lay, columns):
    """A copy of ``lay``'s plan with each segment's :data:`PLACED` fields from
    ``columns`` (their values, segment by segment: ``len(PLACED)`` each)."""
    plan = lay.plan.copy()
    plan[lay.placed] = columns
    return plan


class Pooled(NamedTuple):
    """One pooling launch's results and plan, on the device (:func:`reserve`)."""

    out: object
    rows: object
    pool_offsets: object
    plan: object  # the segments' first blocks and fields, from element ``base``
    base: int
    count: int  # segments
    blocks: int
    kernel: object


def reserve(family, table, segments, weighted, sizes, plan=None):
    """The :class:`Pooled` of a launch of ``segments`` over the flat ``table``, weights
    of ``weighted`` dtype (None: none): ``out``, ``rows`` and pool offsets of ``sizes``
    elements (``out`` of ``table``'s dtype, the others int64; the elements no segment
    writes are left as they are), and the plan (``plan``: ``(its Layout, the device
    array holding it, from element base, base)``, else made and copied here). Calls with
    the same segments may reuse it: each overwrites what the last wrote."""
    out = family.empty((sizes[0],), table.dtype)
    rows = family.empty((sizes[1],), np.int64)
    pool_offsets = family.empty((sizes[2],), np.int64)
    if plan is None:
        if not segments:
            return Pooled(out, rows, pool_offsets, None, 0, 0, 0, None)
        lay = layout(table, segments, weighted)
        plan = (lay, family.put(lay.plan), 0)
    lay, device, base = plan
    return Pooled(out, rows, pool_offsets, family.kernel_array(device), base, lay.count,
                  lay.blocks, lay.kernel)


def pool_tables(family, table, segments, values, offsets, weights, sizes, into=None, plan=None):
    """One launch pooling every segment: ``(out, rows, pool offsets)``, those of
    :func:`reserve` (made here, with ``plan`` if given, or ``into``, made for the same
    segments). ``table``: the flat array the segments' blocks lie in; ``values``,
    ``offsets`` (int64), ``weights`` (or None) as the module doc says."""
    pooled = into or reserve(family, table, segments, None if weights is None else weights.dtype,
                             sizes, plan)
    if pooled.count:
        k_values = family.kernel_array(values)
        launch(pooled.kernel, pooled.blocks, threads_per_block(), family.kernel_array(table),
               k_values, family.kernel_array(offsets),
               k_values if weights is None else family.kernel_array(weights), pooled.plan,
               pooled.base, pooled.count, family.kernel_array(pooled.out), pooled.rows,
               pooled.pool_offsets)
    return pooled.out, pooled.rows, pooled.pool_offsets
