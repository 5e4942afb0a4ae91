"""Vector loads and stores of ``width`` consecutive elements of a table row.

* :func:`geometry`: how a row group covers a row with such vectors.
* :func:`loader` ``(dtype, width, widen)``: a device function ``load(array, row, col)``
  giving ``array[row, col:col + width]`` as a tuple: of accumulator floats when
  ``widen`` (fp16 and bf16 bits to fp32, fp32 and fp64 as they are; as
  :func:`._launch.load_as_float`), else of the array's own elements.
* :func:`store` ``(array, row, col, values)``: ``array[row, col:col + len(values)] = values``
  (a tuple of the array's elements).
* :func:`fma_where` ``(ok, acc, w, v)``: ``acc + w * v`` element-wise where ``ok``,
  else ``acc`` (selected, never multiplied by 0).

On a GPU a load or store is one access of ``width * itemsize`` bytes, aligned to its
size (``LDG.E.128`` for 16 bytes, ``.64`` for 8; 2-byte elements travel packed in 32-bit
words): the caller guarantees the alignment, which :func:`vector_width` checks on the
host. Under Numba's simulator they are element accesses.
"""
import numpy as np
from numba import types

from .._machine import simulator_enabled
from .._validate import accumulator_dtype, is_bfloat16
from ._launch import group_size, load_as_float

VECTOR_BYTES = 16


def data_pointer(a):
    """Device address of ``a``'s first element (a simulator array: its NumPy buffer)."""
    ptr = getattr(getattr(a, "data", None), "ptr", None)  # CuPy's, without building an interface
    if ptr is not None:
        return ptr
    interface = getattr(a, "__cuda_array_interface__", None)
    return interface["data"][0] if interface is not None else a.ctypes.data


def vector_width(a):
    """The widest ``V`` (a power of two, ``V * itemsize <= 16``) such that every
    ``a[row, k*V : (k+1)*V]`` of the 2-D kernel array ``a`` is one aligned access:
    ``V`` divides ``D``, elements are contiguous along a row, and the base address and
    the row stride are multiples of ``V * itemsize``. 1 otherwise."""
    itemsize = a.dtype.itemsize
    rows, dim = a.shape
    row_stride, column_stride = a.strides
    width = max(1, VECTOR_BYTES // itemsize)
    while width > 1:
        nbytes = width * itemsize
        if (dim % width == 0 and (column_stride == itemsize or dim == 1)
                and data_pointer(a) % nbytes == 0 and (row_stride % nbytes == 0 or rows <= 1)):
            break
        width //= 2
    return width


_GEOMETRY = {}  # what geometry depends on -> its answer


def geometry(a):
    """``(V, G, K)`` for the 2-D kernel array ``a``: ``V = vector_width(a)``, ``G`` lanes
    per row (the next power of two >= ``D / V``, at most 32), ``K`` vectors per lane per
    pass over a row (1 or 2; lane ``l`` takes vectors ``l`` and ``l + G``). Worked out
    once per item size, shape class, strides and address modulo :data:`VECTOR_BYTES`."""
    key = (a.dtype.itemsize, a.shape[1], a.shape[0] <= 1, a.strides,
           data_pointer(a) % VECTOR_BYTES)
    found = _GEOMETRY.get(key)
    if found is None:
        found = _GEOMETRY[key] = _geometry(a)
    return found


def _geometry(a):
    width = vector_width(a)
    vectors = a.shape[1] // width
    group = group_size(vectors)
    return width, group, max(1, min(2, -(-vectors // group)))


if simulator_enabled():

    def loader(dtype, width, widen=True):
        convert = load_as_float(dtype) if widen else (lambda x: x)

        def load(array, row, col):
            return tuple(convert(array[row, col + k]) for k in range(width))

        return load

    def store(array, row, col, values):
        for k, v in enumerate(values):
            array[row, col + k] = v

    def fma_where(ok, acc, w, v):
        return tuple(a + w * x if ok else a for a, x in zip(acc, v))

else:
    from llvmlite import ir

    try:
        from numba.cuda import cgutils
        from numba.cuda.extending import intrinsic
    except ImportError:  # numba-cuda before its own copy of the core
        from numba.core import cgutils
        from numba.core.extending import intrinsic

    def _pointer(context, builder, array_type, array, row_type, row, col_type, col, width):
        """``(&array[row, col]`` as a pointer to a vector of integer words, elements per
        word)``: ``width`` elements, packed ``min(width, 32 // bitwidth)`` (at least 1) to
        a word, low bits first (NVPTX would split ``<8 x i16>`` into two 8-byte accesses)."""
        ary = context.make_array(array_type)(context, builder, array)
        inds = [context.cast(builder, row, row_type, types.intp),
                context.cast(builder, col, col_type, types.intp)]
        ptr = cgutils.get_item_pointer(context, builder, array_type, ary, inds)
        bits = array_type.dtype.bitwidth
        per_word = max(1, min(width, 32 // bits))
        words = ir.VectorType(ir.IntType(bits * per_word), width // per_word)
        return builder.bitcast(ptr, words.as_pointer(ptr.type.addrspace)), per_word

    def loader(dtype, width, widen=True):
        acc = types.float64 if accumulator_dtype(dtype) == np.float64 else types.float32
        bf16 = is_bfloat16(dtype)
        half = np.dtype(dtype) == np.float16  # Numba's fp16 values are i16 bits
        align = width * np.dtype(dtype).itemsize

        @intrinsic
        def load(typingctx, array, row, col):
            out = types.UniTuple(acc if widen else array.dtype, width)

            def codegen(context, builder, sig, args):
                ptr, per_word = _pointer(context, builder, sig.args[0], args[0], sig.args[1],
                                         args[1], sig.args[2], args[2], width)
                vec = builder.load(ptr, align=align)
                element = context.get_data_type(sig.args[0].dtype)
                f32 = ir.FloatType()
                items = []
                for k in range(width):
                    x = builder.extract_element(vec, ir.Constant(ir.IntType(32), k // per_word))
                    if per_word > 1:  # element k % per_word of the word, from its low end
                        shift = ir.Constant(x.type, element.width * (k % per_word))
                        x = builder.trunc(builder.lshr(x, shift), element)
                    x = builder.bitcast(x, element)
                    if widen and bf16:  # the bits go on top of an fp32
                        x = builder.bitcast(builder.shl(builder.zext(x, ir.IntType(32)),
                                                        ir.Constant(ir.IntType(32), 16)), f32)
                    elif widen and half:
                        x = builder.fpext(builder.bitcast(x, ir.HalfType()), f32)
                    items.append(x)
                return context.make_tuple(builder, sig.return_type, items)

            return out(array, row, col), codegen

        return load

    @intrinsic
    def store(typingctx, array, row, col, values):
        width = len(values)

        def codegen(context, builder, sig, args):
            ptr, per_word = _pointer(context, builder, sig.args[0], args[0], sig.args[1],
                                     args[1], sig.args[2], args[2], width)
            words = ptr.type.pointee
            bits = sig.args[0].dtype.bitwidth
            vec = ir.Constant(words, ir.Undefined)
            for w in range(words.count):
                word = ir.Constant(words.element, 0)
                for k in range(per_word):  # element k of the word goes k * bits up
                    x = builder.bitcast(builder.extract_value(args[3], w * per_word + k),
                                        ir.IntType(bits))
                    if per_word > 1:
                        x = builder.shl(builder.zext(x, words.element),
                                        ir.Constant(words.element, bits * k))
                    word = builder.or_(word, x)
                vec = builder.insert_element(vec, word, ir.Constant(ir.IntType(32), w))
            builder.store(vec, ptr, align=width * sig.args[0].dtype.bitwidth // 8)
            return context.get_dummy_value()

        return types.void(array, row, col, values), codegen

    @intrinsic
    def fma_where(typingctx, ok, acc, w, v):
        def codegen(context, builder, sig, args):
            flag, total, weight, vals = args
            flag = context.cast(builder, flag, sig.args[0], types.boolean)
            weight = context.cast(builder, weight, sig.args[2], acc.dtype)
            out = total
            for k in range(acc.count):
                a = builder.extract_value(total, k)
                summed = builder.fadd(a, builder.fmul(weight, builder.extract_value(vals, k)))
                out = builder.insert_value(out, builder.select(flag, summed, a), k)
            return out

        return acc(ok, acc, w, v), codegen


def zeros(dtype, width):
    """A tuple of ``width`` accumulator zeros for a ``dtype`` table."""
    return (np.dtype(accumulator_dtype(dtype)).type(0),) * width
