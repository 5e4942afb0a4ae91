"""Helpers shared by the CPU kernels: 2-byte float loads and the checks of ids and offsets.

Numba's CPU target has no float16 or bfloat16 arithmetic, so fp16 and bf16
tables are passed as their uint16 bits and widened through an exact
65536-entry table (fp16: the IEEE half values; bf16: the bits shifted into the
top half of a float32). The kernels see one type either way.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .._validate import accumulator_dtype, is_bfloat16  # noqa: F401 (accumulator_dtype: for the kernels)

HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
BFLOAT16_TO_FLOAT = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
NO_LUT = np.zeros(1, np.float32)


def kernel_table(a):
    """(array the kernel reads, widening table) for a float table."""
    if a.dtype == np.float16:
        return a.view(np.uint16), HALF_TO_FLOAT
    if is_bfloat16(a.dtype):
        return a.view(np.uint16), BFLOAT16_TO_FLOAT
    return a, NO_LUT


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


STACK_ROW_MAX_BYTES = 1 << 14


@intrinsic
def scratch_row(typingctx, size, out, index):
    """A row to accumulate ``out[index]`` in: ``size`` (a compile-time constant,
    e.g. a closure constant of the kernel factory) elements of ``out``'s dtype
    on the calling kernel's stack (``alloca`` in its entry block, so one per
    thread in a ``prange`` body), or ``out[index]`` itself when the row would
    take more than ``STACK_ROW_MAX_BYTES``. LLVM keeps a stack row in vector
    registers across a loop that adds table rows into it, where a row of
    ``out``, which might alias the table, is loaded and stored on every add.
    Uninitialised; it must not outlive the kernel (never return or store it)."""
    if not (isinstance(size, types.IntegerLiteral) and isinstance(out, types.Array)
            and out.ndim == 2 and out.layout == "C" and isinstance(index, types.Integer)):
        return None
    row_type = types.Array(out.dtype, 1, "C")
    length, itemsize = size.literal_value, np.dtype(str(out.dtype)).itemsize
    sig = row_type(size, out, index)
    if length * itemsize > STACK_ROW_MAX_BYTES:
        def row_of_out(context, builder, sig, args):
            return context.compile_internal(builder, lambda size, out, index: out[index], sig, args)
        return sig, row_of_out

    def row_on_stack(context, builder, sig, args):
        elem = context.get_data_type(out.dtype)
        row = context.make_array(row_type)(context, builder)
        intp = context.get_value_type(types.intp)
        context.populate_array(row, data=cgutils.alloca_once(builder, elem, size=length),
                               shape=[ir.Constant(intp, length)],
                               strides=[ir.Constant(intp, itemsize)],
                               itemsize=ir.Constant(intp, itemsize), meminfo=None)
        return row._getvalue()

    return sig, row_on_stack


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


CACHE_LINE_BYTES = 64


def elements_per_line(array):
    """Elements of ``array`` in a cache line (a compile-time constant)."""


@overload(elements_per_line, inline="always")
def _elements_per_line(array):
    per_line = CACHE_LINE_BYTES * 8 // array.dtype.bitwidth
    return lambda array: per_line


@njit(inline="always")
def prefetch_row(table, row, width):
    """Prefetch every cache line of ``table[row, :width]``: one per line's
    worth of elements and one at the last element, which is a line of its own
    when rows do not start on a line (NumPy's large arrays start 16 bytes
    into a page, so a 256-byte row spans 5 lines)."""
    step = elements_per_line(table)
    for c in range(0, width + step - 1, step):
        prefetch(table, row, min(c, width - 1))
