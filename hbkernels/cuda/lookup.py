"""Row gather on the GPU: ``out[i, d] = weights[ids[i], d]``.

Thread mapping: rows are copied as their bits (:func:`as_bits`: 4-byte elements as they
are, others as 32-bit words where rows are whole words), in vectors of ``V`` words
(:func:`._vector.geometry`: 16 bytes where the row length and the table's alignment
allow). A group of ``G`` lanes (the next power of two >= ``D / V``, at most a warp)
copies ``U = IDS_IN_FLIGHT`` consecutive ids per step, grid-stride over steps: each lane
reads the ``U`` ids, loads its ``K`` (1 or 2) vectors of all ``U`` rows, and only then
stores them (wider rows take further passes).
Out-of-range ids always give zero rows (all bits 0: +0.0); they load row 0, which is
not stored, so nothing is read out of range in any mode. Under ``bounds="raise"`` lane
0 also records the first bad position in an error slot left pending (:mod:`._pending`):
no mode reads anything back.
"""
import numpy as np
from numba import cuda

from .._modes import Bounds
from .._validate import raise_bad_id
from . import _device, _pending, _vector
from ._launch import (
    blocks_for,
    jit_kernel,
    kernel_factory,
    no_error_slots,
    threads_per_block,
)
from ._launcher import launch

IDS_IN_FLIGHT = 4  # U


@kernel_factory
def gather_kernel(dtype, width, group, chunks_per_lane):
    """The gather for a kernel array of ``dtype`` (:func:`as_bits`: copied as bits), ``width``
    elements per vector, ``group`` lanes per id and ``chunks_per_lane`` vectors per lane."""
    U = IDS_IN_FLIGHT
    two = chunks_per_lane > 1
    load = _vector.loader(dtype, width, widen=False)
    zero = (np.dtype(dtype).type(0),) * width

    @cuda.jit(device=True, inline=True)
    def read_row(table, ids, i, n, record, slots):
        """``ids[i]`` if it is a row of ``table``, else -1 (recorded when ``record``)."""
        if i >= n:
            return -1
        row = ids[i]
        if row < 0 or row >= table.shape[0]:
            if record:
                cuda.atomic.min(slots, 0, i)
            return -1
        return row

    @cuda.jit(device=True, inline=True)
    def put(out, i, n, col, ok, values):
        if i < n:
            _vector.store(out, i, col, values if ok else zero)

    @jit_kernel(4 if chunks_per_lane == 1 else 2)  # 64 / 128 registers, no spills (sm_90)
    def gather_kernel(table, ids, record, out, slots):
        n = ids.shape[0]
        vectors = table.shape[1] // width
        tid = cuda.grid(1)
        lane = tid % group
        step = U * (cuda.gridsize(1) // group)
        for i in range(U * (tid // group), n, step):
            first = record and lane == 0
            r0 = read_row(table, ids, i, n, first, slots)
            r1 = read_row(table, ids, i + 1, n, first, slots)
            r2 = read_row(table, ids, i + 2, n, first, slots)
            r3 = read_row(table, ids, i + 3, n, first, slots)
            ok0 = r0 >= 0
            ok1 = r1 >= 0
            ok2 = r2 >= 0
            ok3 = r3 >= 0
            s0 = r0 if ok0 else 0
            s1 = r1 if ok1 else 0
            s2 = r2 if ok2 else 0
            s3 = r3 if ok3 else 0
            for c0 in range(0, vectors, chunks_per_lane * group):
                ca = c0 + lane
                cb = ca + group
                col_a = ca * width if ca < vectors else 0  # a lane past the row reads vector 0
                col_b = cb * width if cb < vectors else 0
                e0a = load(table, s0, col_a)
                e1a = load(table, s1, col_a)
                e2a = load(table, s2, col_a)
                e3a = load(table, s3, col_a)
                e0b = load(table, s0, col_b) if two else zero
                e1b = load(table, s1, col_b) if two else zero
                e2b = load(table, s2, col_b) if two else zero
                e3b = load(table, s3, col_b) if two else zero
                if ca < vectors:
                    put(out, i, n, col_a, ok0, e0a)
                    put(out, i + 1, n, col_a, ok1, e1a)
                    put(out, i + 2, n, col_a, ok2, e2a)
                    put(out, i + 3, n, col_a, ok3, e3a)
                if two and cb < vectors:
                    put(out, i, n, col_b, ok0, e0b)
                    put(out, i + 1, n, col_b, ok1, e1b)
                    put(out, i + 2, n, col_b, ok2, e2b)
                    put(out, i + 3, n, col_b, ok3, e3b)

    return gather_kernel


def as_bits(a):
    """The 2-D kernel array ``a`` as the elements the gather copies: ``a`` itself when
    its elements are 4 bytes (copied as they are, bits unchanged), 32-bit words when it
    is C-contiguous with rows of whole words, else integers of its itemsize."""
    if a.dtype.itemsize == 4:
        return a
    if _device.c_contiguous(a) and a.shape[1] * a.dtype.itemsize % 4 == 0:
        return a.view(np.int32)
    return a.view({2: np.int16, 8: np.int64}[a.dtype.itemsize])


def lookup(family, weights, ids, bounds):
    """``(out [ids.size, D], -1)`` of the ids (any shape, gathered in C order); the
    check is left pending, its error naming the id by its index in ``ids``."""
    dim = weights.shape[1]
    flat = ids if ids.ndim == 1 else family.reshape(ids, (-1,))
    n = flat.shape[0]
    record = bounds == Bounds.RAISE
    if weights.shape[0] == 0:  # every id is bad: zero rows, the first bad position is 0
        return family.zeros((n, dim), weights.dtype), (0 if record and n else -1)
    out = family.empty((n, dim), weights.dtype)
    if n == 0:
        return out, -1
    num_rows = weights.shape[0]

    def report(bad):
        raise_bad_id(family, "ids", ids, bad[0], num_rows)

    k_weights = family.kernel_array(weights)
    key = (k_weights.dtype, dim, num_rows <= 1, k_weights.strides,
           _vector.data_pointer(k_weights) % _vector.VECTOR_BYTES)
    plan = _PLANS.get(key)
    if plan is None:
        table = as_bits(k_weights)
        width, group, chunks_per_lane = _vector.geometry(table)
        tpb = threads_per_block()
        plan = _PLANS[key] = (None if table is k_weights else table.dtype, tpb // group, tpb,
                              gather_kernel(np.dtype(table.dtype), width, group, chunks_per_lane))
    bits, ids_per_block, tpb, kernel = plan  # as_bits of the table and out: a view as ``bits``
    k_out = family.kernel_array(out)
    if bits is not None:
        k_weights, k_out = k_weights.view(bits), k_out.view(bits)
    with _pending.checks(1, "lookup", report, (ids,), when=record) as slots:
        launch(kernel, blocks_for(-(-n // IDS_IN_FLIGHT), ids_per_block), tpb, k_weights, flat,
               record, k_out, no_error_slots() if slots is None else slots)
    return out, -1


_PLANS = {}  # what the gather depends on -> (bits dtype or None, id groups per block, threads, kernel)
