"""Helpers shared by the CUDA kernels: grid sizes, device functions, fills and error
slots (the launches themselves go through :func:`._launcher.launch`).

Kernels report the first bad position of an input by ``cuda.atomic.min`` into
an int64 *error slot* that starts at ``NO_ERROR_SLOT``. An op that reads something
back anyway reads its slots with it (:func:`read_error_slots`, one host
synchronisation); the others take theirs from :mod:`._pending`, read at a later wait.
Under the simulator (``NUMBA_ENABLE_CUDASIM=1``) grids are kept tiny: every
simulated thread is a Python thread.
"""
import functools
import threading

import numpy as np
from numba import cuda
from numba.cuda import libdevice

from .. import _bits
from .._machine import simulator_enabled
from .._validate import accumulator_dtype, is_bfloat16
from . import _device
from ._launcher import launch


NO_ERROR_SLOT = np.iinfo(np.int64).max
UNROLL = 4  # columns a lane of a row group reads per pass (column_reader)
_SIM_MAX_BLOCKS = 2
_SIMULATOR = simulator_enabled()  # fixed for the process once numba.cuda is imported
_MAX_BLOCKS = 65535 * 16
WARP = 32


def kernel_factory(make):
    """Cache ``make(*args)``, a function that builds a kernel or a tuple of kernels,
    and tag each kernel it builds with ``built_by = (module, name, args, position)``
    (position None for a lone kernel), so a kernel launched under the simulator
    can be rebuilt for a real GPU (``tests/compile_kernels.py``). Parameters named
    ``tpb`` is launch geometry, rebuilt at the real GPU's value."""

    @functools.lru_cache(maxsize=None)
    @functools.wraps(make)
    def cached(*args):
        built = make(*args)
        for position, kernel in enumerate(built if isinstance(built, tuple) else (built,)):
            kernel.built_by = (make.__module__, make.__name__, args,
                               position if isinstance(built, tuple) else None)
        return built

    cached.builds_kernels = True
    return cached


def threads_per_block(preferred=256):
    return 32 if _SIMULATOR else preferred


def jit_kernel(min_blocks_per_sm):
    """``cuda.jit`` for a kernel launched with ``threads_per_block()`` threads, with
    launch bounds on a GPU: ptxas keeps the registers low enough for
    ``min_blocks_per_sm`` resident blocks (the simulator has no launch bounds)."""
    if simulator_enabled():
        return cuda.jit(cache=False)
    return cuda.jit(cache=False, launch_bounds=(threads_per_block(), min_blocks_per_sm))


def _inline_device():
    """``cuda.jit(device=True)`` for a device function inlined into its callers by NVVM
    (``forceinline``): compiled once per signature and copied at the LLVM level, where
    Numba's own inlining (``inline=True``) copies the function's IR at every call site and
    takes ten times longer on the large bodies of the optimizer rules. Numba's stays where
    a function returns an array view (NVVM's cannot) or its code was measured better (the
    forward kernels). The simulator calls the function as Python."""
    if simulator_enabled():
        return cuda.jit(device=True)
    return cuda.jit(device=True, forceinline=True)


inline_device = _inline_device()


def blocks_for(work_items, threads, max_blocks=_MAX_BLOCKS):
    """Blocks to cover ``work_items`` (kernels use grid-stride loops past the cap)."""
    blocks = (work_items + threads - 1) // threads
    cap = _SIM_MAX_BLOCKS if _SIMULATOR else max_blocks
    return 1 if blocks < 1 else (cap if blocks > cap else int(blocks))


def group_size(dim):
    """Lanes of a row group: the next power of two >= ``dim``, at most a warp.

    Row-wise kernels give each row (or bag) one group; lane ``d`` handles columns
    ``d, d + G, d + 2G, ...`` so a row load is coalesced. Small ``dim`` packs
    several groups in a warp; a power of two keeps groups inside one warp.
    """
    return min(WARP, 1 << max(int(dim) - 1, 0).bit_length())


@cuda.jit(device=True)
def widen32(x):
    """An element as fp32 (exact for fp16, a no-op for fp32)."""
    return np.float32(x)


@cuda.jit(device=True)
def widen64(x):
    return np.float64(x)


WIDEN = {np.dtype(np.float32): widen32, np.dtype(np.float64): widen64}


# bf16 tables reach the kernels as their int16 bits (CudaFamily.kernel_array): Numba's
# CUDA target reads them as integers, and these functions convert, as the CPU backend
# does. The simulator runs kernels as Python and has no libdevice, so it gets NumPy views.
# half_to_float32: fp16 bits (uint16) as the float32 they denote (packed quantized rows
# keep their scales as bytes).
if simulator_enabled():

    def float32_from_bits(bits):
        return np.uint32(bits).view(np.float32)

    def float32_bits(x):
        return np.float32(x).view(np.uint32)

    def float64_from_bits(bits):
        return np.int64(bits).view(np.float64)

    def half_to_float32(bits):
        return np.float32(np.uint16(bits).view(np.float16))

    def as_rows(flat, start, rows, dim):
        return flat[start:start + rows * dim].reshape((rows, dim))

else:
    from llvmlite import ir
    from numba import types as _types

    try:
        from numba.cuda import cgutils
        from numba.cuda.extending import intrinsic
    except ImportError:  # numba-cuda before its own copy of the core
        from numba.core import cgutils
        from numba.core.extending import intrinsic

    @cuda.jit(device=True, inline=True)
    def float32_from_bits(bits):
        return libdevice.int_as_float(np.int32(bits))

    @cuda.jit(device=True, inline=True)
    def float32_bits(x):
        return np.uint32(libdevice.float_as_int(np.float32(x)))

    @cuda.jit(device=True, inline=True)
    def float64_from_bits(bits):
        return libdevice.longlong_as_double(np.int64(bits))

    @intrinsic
    def half_to_float32(typingctx, bits):
        if not isinstance(bits, _types.Integer):
            return None

        def codegen(context, builder, sig, args):
            value, i16 = args[0], ir.IntType(16)
            if value.type.width > 16:
                value = builder.trunc(value, i16)
            elif value.type.width < 16:
                value = builder.zext(value, i16)
            return builder.fpext(builder.bitcast(value, ir.HalfType()), ir.FloatType())

        return _types.float32(bits), codegen

    @intrinsic
    def as_rows(typingctx, flat, start, rows, dim):
        if not (isinstance(flat, _types.Array) and flat.ndim == 1 and flat.layout == "C"):
            return None
        view = _types.Array(flat.dtype, 2, "C")

        def codegen(context, builder, sig, args):
            intp = context.get_value_type(_types.intp)
            start, rows, dim = (context.cast(builder, a, t, _types.intp)
                                for a, t in zip(args[1:], sig.args[1:]))
            itemsize = intp(context.get_abi_sizeof(context.get_data_type(flat.dtype)))
            whole = context.make_array(flat)(context, builder, args[0])
            out = context.make_array(view)(context, builder)
            context.populate_array(out, data=builder.gep(whole.data, [start]),
                                   shape=cgutils.pack_array(builder, [rows, dim]),
                                   strides=cgutils.pack_array(builder, [builder.mul(dim, itemsize),
                                                                        itemsize]),
                                   itemsize=itemsize, meminfo=None)
            return out._getvalue()

        return view(flat, start, rows, dim), codegen


as_rows.__doc__ = """``as_rows(flat, start, rows, dim)``: the C-contiguous ``[rows, dim]`` view of
the elements ``[start, start + rows * dim)`` of the 1-D C-contiguous array ``flat`` (no
copy, no bounds check; Numba's own ``reshape`` needs a helper the launcher does not link)."""


@cuda.jit(device=True, inline=True)
def bfloat16_to_float32(bits):
    """bf16 bits (int16) as the float32 they denote (exact: the bits go on top)."""
    return float32_from_bits(np.uint32(np.uint16(bits)) << np.uint32(16))


fib_hash = cuda.jit(device=True, inline=True)(_bits.fib_hash)
fmix32 = cuda.jit(device=True, inline=True)(_bits.fmix32)
bfloat16_bits = cuda.jit(device=True, inline=True)(_bits.bfloat16_bits)


@cuda.jit(device=True, inline=True)
def float32_to_bfloat16(x):
    """float32 to bf16 bits (int16) by :func:`hbkernels._bits.bfloat16_bits`."""
    return np.int16(np.uint16(bfloat16_bits(float32_bits(x))))


@cuda.jit(device=True, inline=True)
def as_stored(x):
    """A value as stored in a float or integer array (the store converts it)."""
    return x


def load_as_float(dtype):
    """Device function reading an element of a ``dtype`` array as its accumulator
    float: fp16 and fp32 as fp32, fp64 as fp64, bf16 bits as fp32."""
    if is_bfloat16(dtype):
        return bfloat16_to_float32
    return WIDEN[accumulator_dtype(dtype)]


def store_as(dtype):
    """Device function turning an accumulator float into an element of a ``dtype``
    array: bf16 bits rounded to nearest even; other dtypes convert on the store
    (fp16 to nearest even)."""
    return float32_to_bfloat16 if is_bfloat16(dtype) else as_stored


def dtype_key(dtype):
    """``dtype`` as the hashable key the kernel factories are cached by (None stays None)."""
    return None if dtype is None else np.dtype(dtype)


@functools.lru_cache(maxsize=None)
def column_reader(dtype, columns):
    """Device function ``(array, row, c0, group) -> (v0, v1, v2, v3)``: columns
    ``c0 + k·group`` of ``array[row]`` (elements of ``dtype``, a :func:`dtype_key`)
    as accumulator floats, for ``k < columns`` (a compile-time constant, 1 to
    ``UNROLL`` = 4); the others are 0, with no load.

    The loads have no branch between them, so all are in flight at once (a load
    followed by ``if c1 < dim:`` waits for the first before issuing the second).
    A column past the row's end reads column ``c0`` again: callers must not store
    or sum it."""
    load = load_as_float(dtype)
    zero = np.dtype(accumulator_dtype(dtype)).type(0)

    @cuda.jit(device=True, inline=True)
    def read_columns(array, row, c0, group):
        dim = array.shape[1]
        c1 = c0 + group
        c2 = c1 + group
        c3 = c2 + group
        v0 = load(array[row, c0])
        v1 = load(array[row, c1 if c1 < dim else c0]) if columns > 1 else zero
        v2 = load(array[row, c2 if c2 < dim else c0]) if columns > 2 else zero
        v3 = load(array[row, c3 if c3 < dim else c0]) if columns > 3 else zero
        return v0, v1, v2, v3

    return read_columns


def columns_per_lane(dim, group):
    """Columns a lane of a ``group``-lane row group reads per pass: 1 to ``UNROLL``."""
    return max(1, min(UNROLL, -(-int(dim) // group)))


@cuda.jit
def fill_kernel(flat, value):
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, flat.shape[0], step):
        flat[i] = value


def fill(a, value):
    """Set every element of a contiguous device array to ``value``."""
    flat = a.reshape(a.size) if a.ndim != 1 else a
    if flat.shape[0] == 0:
        return
    tpb = threads_per_block()
    launch(fill_kernel, blocks_for(flat.shape[0], tpb), tpb, flat, value)


def error_slots(count):
    """``count`` error slots (int64, ``NO_ERROR_SLOT``), from the scratch pool."""
    return _device.full(count, NO_ERROR_SLOT, np.int64)


_READ_BACK = {}  # (thread, device, stream, count, extra) -> (array, its slots' view)


def read_back_slots(count, extra):
    """``(array, slots)``: an int64 array of ``extra`` entries then ``count`` error slots
    (``slots``, its view past ``extra``), held for the calling thread's current device and
    stream, for an op that reads the whole array back before it returns. Its slots are
    clean at each call: a read that finds them clean leaves them so on the device (only
    an error writes a slot); after a read that finds an error, :func:`drop_read_back`.
    The ``extra`` entries are the op's to write every call."""
    key = (threading.get_ident(), _device.device_id(),
           0 if _SIMULATOR else _device.current_stream().ptr, count, extra)
    held = _READ_BACK.get(key)
    if held is None:
        if len(_READ_BACK) >= 64:  # threads come and go: a new array for whoever calls next
            _READ_BACK.clear()
        array = error_slots(extra + count)
        held = _READ_BACK[key] = (array, array[extra:])
    return held


def drop_read_back(array):
    """Stop holding ``array`` (of :func:`read_back_slots`): its slots hold an error."""
    for key, held in list(_READ_BACK.items()):
        if held[0] is array:
            del _READ_BACK[key]


def no_error_slots():
    """Stand-in slots for a launch that records nothing (``bounds="unchecked"``):
    zero-sized, so nothing to fill or read back (one array per device, as every
    zero-sized scratch array)."""
    return _device.scratch(0, np.int64)


def error_positions(values):
    """Error-slot values read back to the host as first bad positions, -1 where none."""
    return [-1 if v == NO_ERROR_SLOT else int(v) for v in values]


def read_error_slots(slots):
    """Host list of first bad positions, -1 where none (one host synchronisation)."""
    return error_positions(_device.to_host(slots))
