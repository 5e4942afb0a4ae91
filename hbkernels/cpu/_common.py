"""Helpers shared by the CPU kernels: 2-byte float loads and stores, the checks of
ids and offsets, stack rows and prefetches.

Numba's CPU target has no float16 or bfloat16 type, so fp16 and bf16 tables
reach the kernels as their bits: fp16 as uint16, bf16 as int16 (the integer
type tells :func:`widen`, at compile time, which format it holds). ``widen``
is exact: bf16 bits are shifted into the top half of a float32; fp16 goes
through the CPU's conversion instruction (x86 F16C ``vcvtph2ps``, vectorised
by LLVM) where Numba's target has it, else through integer operations.
:func:`narrow_to` rounds a float back to fp16 (``vcvtps2ph``) or bf16 bits
inside a kernel, to nearest even, as NumPy's and ml_dtypes' ``astype`` do;
:func:`narrow` does it for a whole float32 array.
"""
import hashlib
import platform
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
import numba
from numba import config, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload, register_jitable

from .. import _bits
from .._numba_cache import cached_njit as numba_cached_njit
from .._validate import accumulator_dtype, is_bfloat16  # noqa: F401 (accumulator_dtype: for the kernels)
from ..memory import CACHE_LINE_BYTES


def _kernel_sources_digest():
    """12 hex digits of sha256 over the sources compiled into the CPU kernels: the
    modules of this package and hbkernels' ``_rules`` and ``_validate``."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(here.glob("*.py")) + [here.parent / "_rules.py", here.parent / "_validate.py"]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


KERNEL_SOURCES_DIGEST = _kernel_sources_digest()


def cached_njit(**options):
    """``njit(cache=True, **options)`` (through :func:`hbkernels._numba_cache.cached_njit`:
    a read-only install falls back to a temporary cache or none) whose on-disk cache entry also depends on
    :data:`KERNEL_SOURCES_DIGEST`. Numba invalidates a cached function only when its
    own file changes, so a kernel that inlines a helper of this file (``add_row``,
    ``widen``) kept the old helper after an edit here; the digest in the
    function's qualified name (which names its cache files) makes such a kernel
    compile again."""
    def decorate(function):
        function.__qualname__ = f"{function.__qualname__}__src{KERNEL_SOURCES_DIGEST}"
        return numba_cached_njit(function, **options)

    return decorate


def kernel_table(a):
    """The array a kernel reads for a float array: fp16 as its uint16 bits, bf16 as
    its int16 bits, other dtypes as they are (views, no copy)."""
    if a.dtype.itemsize != 2:
        return a
    if a.dtype == np.float16:
        return a.view(np.uint16)
    if is_bfloat16(a.dtype):
        return a.view(np.int16)
    return a


def native_half_conversion():
    """Whether Numba's CPU target has fp16 <-> fp32 instructions (x86 with F16C).

    Without them LLVM lowers the conversion to a runtime helper that Numba's
    JIT does not link (the call crashes), so the integer path is used instead.
    The features are Numba's: ``NUMBA_CPU_FEATURES`` (empty for
    ``NUMBA_CPU_NAME=generic``) or the host's."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    features = config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return "+f16c" in features.split(",")


NATIVE_HALF = native_half_conversion()


def _as_i32(builder, value):
    i32 = ir.IntType(32)
    if value.type.width > 32:
        return builder.trunc(value, i32)
    return builder.zext(value, i32) if value.type.width < 32 else value


@intrinsic
def float32_from_bits(typingctx, bits):
    """The float32 whose bits are the low 32 bits of the integer ``bits``."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(_as_i32(builder, args[0]), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def float32_bits(typingctx, x):
    """The bits of the float32 ``x`` as a uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@intrinsic
def _half_to_float_instruction(typingctx, bits):
    """fp16 bits (uint16) to float32 by LLVM's ``fpext half`` (needs :data:`NATIVE_HALF`)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _float_to_half_instruction(typingctx, x):
    """float32 to fp16 bits (uint16), rounded to nearest even by LLVM's ``fptrunc``
    (needs :data:`NATIVE_HALF`)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@njit(inline="always")
def half_to_float_by_integers(bits):
    """fp16 bits to float32 with integer operations only (exact, any target)."""
    x = np.uint32(bits)
    sign = (x & 0x8000) << 16
    magnitude = (x & 0x7FFF) << 13  # exponent and mantissa in float32's places
    exponent = magnitude & 0x0F800000
    if exponent == 0x0F800000:  # Inf and NaN: exponent 31 -> 255
        out = magnitude + (224 << 23)
    elif exponent == 0:  # zero and subnormals: mantissa * 2^-24, exact as 2^-14 * (1 + m) - 2^-14
        out = float32_bits(float32_from_bits(magnitude + (113 << 23)) - float32_from_bits(113 << 23))
    else:  # normal: rebias the exponent from 15 to 127
        out = magnitude + (112 << 23)
    return float32_from_bits(out | sign)


def widen(value):
    """An element of a kernel array as a float: fp16 (uint16) and bf16 (int16) bits
    to float32, floats as they are (a compile-time choice by type)."""


@overload(widen, inline="always")
def _widen(value):
    if value == types.uint16:
        if NATIVE_HALF:
            return lambda value: _half_to_float_instruction(value)
        return lambda value: half_to_float_by_integers(value)
    if value == types.int16:
        return lambda value: float32_from_bits(np.uint32(np.uint16(value)) << 16)
    if isinstance(value, types.Float):
        return lambda value: value
    return None


fib_hash = njit(inline="always")(_bits.fib_hash)
splitmix64 = njit(inline="always")(_bits.splitmix64)
fmix32 = njit(inline="always")(_bits.fmix32)
bfloat16_bits = njit(inline="always")(_bits.bfloat16_bits)


@njit(inline="always")
def float_to_bfloat16_bits(x):
    """float32 to bf16 bits (int16) by :func:`hbkernels._bits.bfloat16_bits`."""
    return np.int16(np.uint16(bfloat16_bits(float32_bits(np.float32(x)))))


def narrow_to(value, array):
    """``value`` (a float) as an element of the kernel array ``array``: rounded to fp16
    bits (uint16, needs :data:`NATIVE_HALF`) or bf16 bits (int16), to nearest even,
    or cast to its float type (a compile-time choice by type)."""


@overload(narrow_to, inline="always")
def _narrow_to(value, array):
    if not isinstance(value, types.Float):
        return None
    if array.dtype == types.uint16 and NATIVE_HALF:
        return lambda value, array: _float_to_half_instruction(np.float32(value))
    if array.dtype == types.int16:
        return lambda value, array: float_to_bfloat16_bits(value)
    if isinstance(array.dtype, types.Float):
        return lambda value, array: value
    return None


def narrows_in_kernel(dtype):
    """Whether kernels round float32 results into ``dtype`` themselves (:func:`narrow_to`):
    float dtypes and bf16 always, fp16 where the CPU converts it (:data:`NATIVE_HALF`)."""
    dtype = np.dtype(dtype)
    return dtype != np.float16 or NATIVE_HALF


@cached_njit(parallel=True)
def _narrow_elements(src, dst):
    for i in prange(src.shape[0]):
        dst[i] = narrow_to(src[i], dst)


def narrow(a, dtype):
    """The float32 array ``a`` as ``dtype``, rounded to nearest even (``a`` itself when
    it has that dtype); fp16 and bf16 in a parallel kernel (:func:`narrow_to`), fp16
    by NumPy where the CPU has no conversion instruction."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    two_byte = dtype == np.float16 or is_bfloat16(dtype)
    if two_byte and narrows_in_kernel(dtype) and a.dtype == np.float32 and a.flags.c_contiguous:
        out = np.empty(a.shape, dtype)
        _narrow_elements(a.reshape(-1), kernel_table(out).reshape(-1))
        return out
    return a.astype(dtype)


@cached_njit()
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


@cached_njit()
def first_out_of_range(ids, limit):
    """First position with ids[i] outside [0, limit) (limit < 0: no upper limit), else -1."""
    for i in range(ids.shape[0]):
        v = ids[i]
        if v < 0 or (limit >= 0 and v >= limit):
            return i
    return -1


STACK_ROW_MAX_BYTES = 1 << 14


def stack_row_fits(length, itemsize):
    """Whether :func:`scratch_row` puts a row of ``length`` accumulators on the stack."""
    return length * itemsize <= STACK_ROW_MAX_BYTES


@intrinsic
def scratch_row(typingctx, size, out, index):
    """A row to accumulate ``out[index]`` in: ``size`` (a compile-time constant,
    e.g. a closure constant of the kernel factory) elements of ``out``'s dtype
    (float32 where ``out`` holds fp16 or bf16 bits) on the calling kernel's
    stack (``alloca`` in its entry block, so one per thread in a ``prange``
    body), or ``out[index]`` itself when the row would take more than
    ``STACK_ROW_MAX_BYTES`` (not for 2-byte floats: see :func:`stack_row_fits`).
    LLVM keeps a stack row in vector registers across a loop that adds table
    rows into it, where a row of ``out``, which might alias the table, is
    loaded and stored on every add. Uninitialised; it must not outlive the
    kernel (never return or store it)."""
    if not (isinstance(size, types.IntegerLiteral) and isinstance(out, types.Array)
            and out.ndim == 2 and out.layout == "C" and isinstance(index, types.Integer)):
        return None
    two_byte = out.dtype in (types.uint16, types.int16)
    row_dtype = types.float32 if two_byte else out.dtype
    row_type = types.Array(row_dtype, 1, "C")
    length, itemsize = size.literal_value, np.dtype(str(row_dtype)).itemsize
    sig = row_type(size, out, index)
    if not stack_row_fits(length, itemsize):
        if two_byte:
            return None
        def row_of_out(context, builder, sig, args):
            return context.compile_internal(builder, lambda size, out, index: out[index], sig, args)
        return sig, row_of_out

    def row_on_stack(context, builder, sig, args):
        elem = context.get_data_type(row_dtype)
        row = context.make_array(row_type)(context, builder)
        intp = context.get_value_type(types.intp)
        context.populate_array(row, data=cgutils.alloca_once(builder, elem, size=length),
                               shape=[ir.Constant(intp, length)],
                               strides=[ir.Constant(intp, itemsize)],
                               itemsize=ir.Constant(intp, itemsize), meminfo=None)
        return row._getvalue()

    return sig, row_on_stack


VECTOR_BYTES = 64


def vector_pieces(length, lanes):
    """``(start, width)`` pieces covering ``[0, length)``: vectors of ``lanes``
    elements, then the tail in halving widths (D = 24 in float32: 16 + 8)."""
    pieces, start, width = [], 0, lanes
    while start < length:
        while width > length - start:
            width //= 2
        pieces.append((start, width))
        start += width
    return pieces


def _splat(builder, value, vector_type):
    lanes = vector_type.count
    first = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value,
                                   ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, ir.Constant(vector_type, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def _widen_vector(builder, x, element, floats):
    """A vector of table elements (fp16 or bf16 bits, or floats) as the float vector
    type ``floats``, never narrower than the elements (exact)."""
    lanes = floats.count
    if element == types.uint16:
        x = builder.bitcast(x, ir.VectorType(ir.HalfType(), lanes))
    elif element == types.int16:
        words = ir.VectorType(ir.IntType(32), lanes)
        x = builder.bitcast(builder.shl(builder.zext(x, words), ir.Constant(words, [16] * lanes)),
                            ir.VectorType(ir.FloatType(), lanes))
    return x if x.type == floats else builder.fpext(x, floats)


def _row_pointer(context, builder, array_type, array, row_type, row):
    """LLVM pointer to ``array[row, 0]`` (no wraparound, no bounds check)."""
    arr = context.make_array(array_type)(context, builder, array)
    index = context.cast(builder, row, row_type, types.intp)
    return cgutils.get_item_pointer(context, builder, array_type, arr,
                                    [index, context.get_constant(types.intp, 0)], wraparound=False)


@intrinsic
def add_row(typingctx, acc, table, row, weight, size):
    """``acc[:size] += weight * widen(table[row, :size])`` (no multiply when ``weight``
    is None) in explicit SIMD vectors of :data:`VECTOR_BYTES` of accumulators, the
    tail in narrower vectors; ``size`` is a compile-time constant. Written as
    vectors because LLVM, given the scalar loop, fully unrolls rows of up to 32
    elements, splits a stack row into scalars and adds them one by one (D = 32
    ran 1.8x slower than this). fp16 without :data:`NATIVE_HALF` falls back to
    the scalar loop. ``row`` must be in range (no check). ``table`` may have any
    row stride (layout ``"A"``), but each row must be contiguous
    (:func:`hbkernels._dispatch.rows_contiguous`)."""
    if not (isinstance(size, types.IntegerLiteral) and isinstance(acc, types.Array)
            and isinstance(acc.dtype, types.Float) and isinstance(table, types.Array)
            and table.ndim == 2 and table.layout in "CA" and isinstance(row, types.Integer)):
        return None
    weighted = not isinstance(weight, types.NoneType)
    if weighted and not isinstance(weight, types.Float):
        return None
    sig = types.void(acc, table, row, weight, size)
    if table.dtype == types.uint16 and not NATIVE_HALF:
        def add_by_integers(acc, table, row, weight, size):
            for d in range(size):
                acc[d] += widen(table[row, d]) * (1.0 if weight is None else weight)

        return sig, lambda context, builder, sig, args: context.compile_internal(
            builder, add_by_integers, sig, args)
    length = size.literal_value

    def codegen(context, builder, sig, args):
        acc_arg, table_arg, row_arg, weight_arg, _ = args
        accs = context.make_array(sig.args[0])(context, builder, acc_arg)
        src = _row_pointer(context, builder, sig.args[1], table_arg, sig.args[2], row_arg)
        acc_dtype, elem_dtype = sig.args[0].dtype, sig.args[1].dtype
        acc_bytes, elem_bytes = acc_dtype.bitwidth // 8, elem_dtype.bitwidth // 8
        scale = context.cast(builder, weight_arg, sig.args[3], acc_dtype) if weighted else None
        for start, width in vector_pieces(length, VECTOR_BYTES // acc_bytes):
            floats = ir.VectorType(context.get_data_type(acc_dtype), width)
            elems = ir.VectorType(context.get_data_type(elem_dtype), width)
            offset = ir.Constant(ir.IntType(64), start)
            x = builder.load(builder.bitcast(builder.gep(src, [offset]), elems.as_pointer()),
                             align=elem_bytes)
            x = _widen_vector(builder, x, elem_dtype, floats)
            if weighted:
                x = builder.fmul(x, _splat(builder, scale, floats), flags=("contract",))
            dst = builder.bitcast(builder.gep(accs.data, [offset]), floats.as_pointer())
            total = builder.fadd(builder.load(dst, align=acc_bytes), x, flags=("contract",))
            builder.store(total, dst, align=acc_bytes)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def copy_row(typingctx, out, row, acc, scale, size):
    """``out[row, :size] = acc[:size]`` (same float dtype), times ``scale`` in float64
    unless ``scale`` is None, in explicit SIMD vectors as :func:`add_row` reads
    them; ``size`` is a compile-time constant. LLVM, given the element loop after a
    stack row was summed in vector registers, stores part of the row one scalar at a
    time (25 scalar stores a row at D = 64; all 16 at D = 16 with a scale)."""
    scaled = not isinstance(scale, types.NoneType)
    if not (isinstance(size, types.IntegerLiteral) and isinstance(out, types.Array)
            and out.ndim == 2 and out.layout in "CA" and isinstance(acc, types.Array)
            and isinstance(acc.dtype, types.Float) and out.dtype == acc.dtype
            and isinstance(row, types.Integer) and (not scaled or isinstance(scale, types.Float))):
        return None
    length = size.literal_value

    def codegen(context, builder, sig, args):
        out_arg, row_arg, acc_arg, scale_arg, _ = args
        accs = context.make_array(sig.args[2])(context, builder, acc_arg)
        dst = _row_pointer(context, builder, sig.args[0], out_arg, sig.args[1], row_arg)
        dtype = sig.args[2].dtype
        item = dtype.bitwidth // 8
        wide = context.get_data_type(types.float64)
        factor = context.cast(builder, scale_arg, sig.args[3], types.float64) if scaled else None
        for start, width in vector_pieces(length, VECTOR_BYTES // item):
            vec = ir.VectorType(context.get_data_type(dtype), width)
            offset = ir.Constant(ir.IntType(64), start)
            x = builder.load(builder.bitcast(builder.gep(accs.data, [offset]), vec.as_pointer()),
                             align=item)
            if scaled:  # as (float64) acc[d] * scale, rounded back
                wides = ir.VectorType(wide, width)
                y = builder.fmul(x if vec == wides else builder.fpext(x, wides),
                                 _splat(builder, factor, wides))
                x = y if vec == wides else builder.fptrunc(y, vec)
            builder.store(x, builder.bitcast(builder.gep(dst, [offset]), vec.as_pointer()),
                          align=item)
        return context.get_dummy_value()

    return types.void(out, row, acc, scale, size), codegen


def store_row(out, row, acc, scale, size):
    """``out[row, :size] = narrow_to(acc[:size] (* scale), out)`` (no multiply when
    ``scale`` is None): :func:`copy_row` where the dtypes match, else element by
    element."""


@overload(store_row, inline="always")
def _store_row(out, row, acc, scale, size):
    if out.dtype == acc.dtype:
        return lambda out, row, acc, scale, size: copy_row(out, row, acc, scale, size)
    if isinstance(scale, types.NoneType):  # (a branch on `scale is None` in one loop is not pruned)
        def impl(out, row, acc, scale, size):
            for d in range(size):
                out[row, d] = narrow_to(acc[d], out)
    else:
        def impl(out, row, acc, scale, size):
            for d in range(size):
                out[row, d] = narrow_to(acc[d] * scale, out)

    return impl


#: chunks per Numba thread in the parallel loops over bags or ids (static scheduling:
#: several a thread even out chunks of unequal cost)
CHUNKS_PER_THREAD = 4


def chunk_count(num_items):
    """How many chunks a parallel loop cuts ``num_items`` into: :data:`CHUNKS_PER_THREAD`
    per Numba thread, at most one item each, at least 1."""
    return max(1, min(num_items, numba.get_num_threads() * CHUNKS_PER_THREAD))


#: bytes of table rows a kernel keeps in flight: it prefetches the rows of the id about
#: this many bytes of rows ahead (:func:`prefetch_ids`)
PREFETCH_BYTES = 4096
MIN_PREFETCH_IDS, MAX_PREFETCH_IDS = 4, 32


@register_jitable
def prefetch_ids(row_bytes):
    """How many ids ahead a kernel prefetches rows of ``row_bytes`` bytes:
    :data:`PREFETCH_BYTES` of rows, within [:data:`MIN_PREFETCH_IDS`,
    :data:`MAX_PREFETCH_IDS`] (fp32 rows: 32 at D = 16, 16 at D = 64, 8 at D = 128).
    Callable from Python and from a kernel."""
    return min(MAX_PREFETCH_IDS, max(MIN_PREFETCH_IDS, PREFETCH_BYTES // max(row_bytes, 1)))


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
