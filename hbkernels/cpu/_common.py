"""Helpers shared by the CPU kernels: fp16 loads and the checks of ids and offsets.

Numba's CPU target has no float16 arithmetic, so fp16 tables are passed as
their uint16 bits and widened through an exact 65536-entry table.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
NO_LUT = np.zeros(1, np.float32)


def kernel_table(a):
    """(array the kernel reads, widening table) for a float table."""
    if a.dtype == np.float16:
        return a.view(np.uint16), HALF_TO_FLOAT
    return a, NO_LUT


def accumulator_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def widen(value, lut):
    """Element of a kernel table as a float (compile-time choice by dtype)."""


@overload(widen, inline="always")
def _widen(value, lut):
    if isinstance(value, types.Integer):  # uint16 bits of an fp16 value
        return lambda value, lut: lut[value]
    return lambda value, lut: value


@njit(cache=True)
def first_bad_offset(offsets, n_values):
    """First k where CSR breaks (offsets[0] != 0, a decrease, or offsets[-1] != n), else -1."""
    if offsets[0] != 0:
        return 0
    last = offsets.shape[0] - 1
    for k in range(1, last + 1):
        if offsets[k] < offsets[k - 1]:
            return k
    if offsets[last] != n_values:
        return last
    return -1


@njit(cache=True)
def first_out_of_range(ids, limit):
    """First position with ids[i] outside [0, limit) (limit < 0: no upper limit), else -1."""
    for i in range(ids.shape[0]):
        v = ids[i]
        if v < 0 or (limit >= 0 and v >= limit):
            return i
    return -1


@intrinsic
def prefetch(typingctx, array, row, col):
    """Hint the CPU to bring ``array[row, col]``'s cache line in (``llvm.prefetch``, read)."""

    def codegen(context, builder, sig, args):
        array_type = sig.args[0]
        ary = context.make_array(array_type)(context, builder, args[0])
        index = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:])]
        ptr = cgutils.get_item_pointer(context, builder, array_type, ary, index, wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8"
        )
        read, high_locality, data_cache = (ir.Constant(i32, v) for v in (0, 3, 1))
        builder.call(fn, [builder.bitcast(ptr, i8p), read, high_locality, data_cache])
        return context.get_dummy_value()

    return types.void(array, row, col), codegen
