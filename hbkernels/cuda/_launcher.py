"""Every kernel launch of the CUDA backend: ``launch(kernel, blocks, threads, *args)``,
queued on the current stream (CuPy's; Numba's default under the simulator), or
``prepare(kernel, blocks, threads, *args)()`` for a launch repeated with the same
arguments (packed once).

Arguments are device arrays (CuPy, Numba, anything with ``__cuda_array_interface__``;
NumPy arrays under the simulator; bf16 arrays as their int16 bits), Python
``bool``/``int``/``float`` (Numba's boolean, int64, float64) and NumPy scalars.
Their *kinds* (an array's dtype, ndim and C-contiguity; a scalar's type) make the
launch's signature.

On a GPU a kernel is compiled once per signature and device, to a cubin
(:mod:`._kernel_cache`: memory, then disk, else :mod:`._compile`), loaded
through CuPy's driver module; a launch then packs its arguments in Numba's
kernel ABI (an array is ``meminfo, parent, nitems, itemsize, data, shape...,
strides...``, :mod:`._abi`; each parameter in an 8-byte slot of one per-thread
buffer, one ``struct.pack_into``) and calls ``cuLaunchKernel``: no ``DeviceNDArray``, no type
dispatch. A launch whose arguments have the types and kinds of the kernel's last launch
is packed by a function made for them (:func:`fast_packer`), which checks them and packs
in one call. Under the simulator the kernel's dispatcher runs it as Python.

:data:`LAUNCHES` counts launches; :data:`RECORDER` (when set) sees each launch's kernel
and signature (``tests/compile_kernels.py`` compiles those for an H100).
"""
import ctypes
import struct
import sys
import threading
import weakref

import numpy as np
from numba import from_dtype, types
from numba.np.numpy_support import as_dtype

from .._machine import cupy, simulator_enabled
from .._validate import is_bfloat16
from . import _device
from ._abi import parameters

LAUNCHES = [0]  # kernel launches since import
RECORDER = [None]  # None or f(kernel, argtypes, threads), called at every launch

_SCALARS = {bool: types.boolean, int: types.int64, float: types.float64}
_SLOT = 8  # bytes per parameter in the argument buffer
_SIMULATOR = simulator_enabled()
_PAD = {1: "7x", 2: "6x", 4: "4x", 8: ""}


# -- signatures ---------------------------------------------------------------------------------
def _element_type(dtype):
    return types.int16 if is_bfloat16(dtype) else from_dtype(np.dtype(dtype))


def numba_type(kind):
    """The Numba type of an argument kind: ``(dtype, ndim, c_contiguous)`` for an array,
    a Python or NumPy scalar type otherwise."""
    if isinstance(kind, tuple):
        dtype, ndim, contiguous = kind
        return types.Array(_element_type(dtype), ndim, "C" if contiguous else "A")
    if kind in _SCALARS:
        return _SCALARS[kind]
    return from_dtype(np.dtype(kind))


def packer(argtypes):
    """``struct.Struct`` packing the flattened arguments of ``argtypes``, one per 8 bytes."""
    codes = [code for code, _ in parameters(argtypes)]
    return struct.Struct("<" + "".join(c + _PAD[struct.calcsize(c)] for c in codes))


# -- arguments ----------------------------------------------------------------------------------
def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= max(int(extent), 1)
    return tuple(reversed(strides))


def _cupy_fields(a, flat):
    """Append the ABI fields of CuPy array ``a`` to ``flat``; returns its kind."""
    flat += (0, 0, a.size, a.itemsize, a.data.ptr, *a.shape, *a.strides)
    return a.dtype, a.ndim, a._c_contiguous


def _cupy_flags_fields(a, flat):
    """:func:`_cupy_fields` for a CuPy without ``ndarray._c_contiguous``."""
    flat += (0, 0, a.size, a.itemsize, a.data.ptr, *a.shape, *a.strides)
    return a.dtype, a.ndim, a.flags.c_contiguous


def _interface_fields(a, flat):
    """The same for any array with ``__cuda_array_interface__`` (Numba's device arrays)."""
    cai = a.__cuda_array_interface__
    dtype = np.dtype(getattr(a, "dtype", cai["typestr"]))
    shape = tuple(int(s) for s in cai["shape"])
    dense = _c_strides(shape, dtype.itemsize)
    strides = tuple(cai.get("strides") or dense)
    contiguous = all(s == d for s, d, n in zip(strides, dense, shape) if n > 1)
    size = int(np.prod(shape, dtype=np.int64))
    flat += (0, 0, size, dtype.itemsize, cai["data"][0] or 0, *shape, *strides)
    return dtype, len(shape), contiguous


_FIELDS = {}  # array type -> fields function, filled on first sight
_PLAIN = set(_SCALARS)  # scalar types passed as they are: Python's and NumPy's seen so far


def _first_sight(t, a):
    """Register the type ``t`` of argument ``a``: an array type in :data:`_FIELDS`, a NumPy
    scalar type in :data:`_PLAIN`; False for anything else."""
    if issubclass(t, np.generic):
        _PLAIN.add(t)
    elif (t.__module__ or "").startswith("cupy") and hasattr(a, "data"):
        _FIELDS[t] = _cupy_fields if hasattr(a, "_c_contiguous") else _cupy_flags_fields
    elif hasattr(a, "__cuda_array_interface__"):
        _FIELDS[t] = _interface_fields
    else:
        return False
    return True


def arguments(args):
    """``(kinds, flat values)`` of a launch's arguments on a GPU."""
    kinds, flat = [], []
    for a in args:
        t = type(a)
        fields = _FIELDS.get(t)
        if fields is not None:
            kinds.append(fields(a, flat))
        elif t in _PLAIN:
            kinds.append(t)
            flat.append(a)
        elif isinstance(a, int):  # an IntEnum member
            kinds.append(int)
            flat.append(int(a))
        elif _first_sight(t, a):
            return arguments(args)
        else:
            raise TypeError(f"a kernel argument must be a CUDA array or a scalar, "
                            f"got {t.__module__}.{t.__name__}")
    return tuple(kinds), flat


def simulator_kind(a):
    """The kind a simulator argument (NumPy array, FakeCUDAArray or scalar) has on a GPU."""
    if isinstance(a, np.generic) or type(a) in _SCALARS:
        return type(a)
    if isinstance(a, int):
        return int
    ary = getattr(a, "_ary", a)
    return (ary.dtype, ary.ndim, bool(ary.flags.c_contiguous))


# -- launching ----------------------------------------------------------------------------------
class _Loaded:
    """A kernel's cubin loaded on one device, and how to pack its arguments."""

    __slots__ = ("module", "function", "packer", "count", "local", "name", "fast")

    def __init__(self, module, function, argtypes, name):
        self.module = module  # keeps the module loaded
        self.function = function
        self.packer = packer(argtypes)
        self.count = len(parameters(argtypes))
        self.local = threading.local()
        self.name = name
        self.fast = {}  # argument types -> fast_packer of them, or None

    def buffers(self):
        """This thread's ``(argument buffer, parameter pointer array, its address)``, made
        on first use in the thread, which also makes the device's context current there
        (the driver's launch does not, and a thread that has made no CUDA runtime call has
        none)."""
        held = getattr(self.local, "held", None)
        if held is None:
            _GPU["context"]()
            buf = ctypes.create_string_buffer(max(self.count, 1) * _SLOT)
            base = ctypes.addressof(buf)
            pointers = (ctypes.c_void_p * max(self.count, 1))(
                *[base + _SLOT * i for i in range(self.count)])
            held = self.local.held = (buf, pointers, ctypes.addressof(pointers))
        return held


_LOADED = {}  # (kernel, kinds, device) -> _Loaded
_LOCK = threading.Lock()
_GPU = {}  # CuPy entry points, looked up once


def _gpu():
    if not _GPU:
        cp = cupy()
        _GPU.update(launch=cp.cuda.driver.launchKernel, device=cp.cuda.runtime.getDevice,
                    stream=cp.cuda.get_current_stream, module=cp.cuda.function.Module,
                    capability=lambda d: cp.cuda.Device(d).compute_capability,
                    context=cp.cuda.runtime.memGetInfo)  # makes the device's context current
    return _GPU


def _load(kernel, kinds, device):
    from . import _kernel_cache

    with _LOCK:
        loaded = _LOADED.get((kernel, kinds, device))
        if loaded is not None:
            return loaded
        gpu = _gpu()
        gpu["context"]()  # the linker and the module load need it current
        argtypes = tuple(numba_type(k) for k in kinds)
        cc = divmod(int(gpu["capability"](device)), 10)
        cubin, name = _kernel_cache.compiled(kernel, argtypes, cc)
        module = gpu["module"]()
        try:
            module.load(cubin)
        except Exception:  # noqa: BLE001 - a damaged cached file: compile afresh, once
            cubin, name = _kernel_cache.compiled(kernel, argtypes, cc, fresh=True)
            module.load(cubin)
        loaded = _Loaded(module, module.get_function(name).ptr, argtypes, name)
        _LOADED[(kernel, kinds, device)] = loaded
        return loaded


_SHARED_LOCK = threading.Lock()
_SHARED = weakref.WeakKeyDictionary()  # a simulated block's shared memory -> {call site: array}
_SIMULATOR_SHARED = [None]  # the simulator's own cuda.shared.array


def _shared_array(shared, shape, dtype, alignment=None):
    """``cuda.shared.array`` of a simulated block: one array per block and call site (the
    caller's file and line), made under a lock, as the block's threads all ask for it at
    once (the simulator's own, unlocked, may let two of them each make one, no longer
    shared). Dynamic shared memory (``shape`` 0) and alignments are the simulator's."""
    if shape == 0 or alignment is not None:
        return _SIMULATOR_SHARED[0](shared, shape, dtype, alignment)
    caller = sys._getframe(1)
    site = (caller.f_code.co_filename, caller.f_lineno)
    with _SHARED_LOCK:
        arrays = _SHARED.setdefault(shared, {})
        found = arrays.get(site)
        if found is None:
            found = arrays[site] = np.empty(shape, as_dtype(dtype) if isinstance(dtype, types.Type)
                                            else dtype)
    return found


def thread_safe_shared():
    """Give the simulator's blocks :func:`_shared_array` (once)."""
    from numba.cuda.simulator import kernelapi

    if kernelapi.FakeCUDAShared.array is not _shared_array:
        _SIMULATOR_SHARED[0] = kernelapi.FakeCUDAShared.array
        kernelapi.FakeCUDAShared.array = _shared_array


def _simulate(kernel, blocks, threads, args):
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    thread_safe_shared()

    views = []
    for a in args:
        if isinstance(a, np.ndarray):  # SimArrays too, as the plain arrays they view
            a = np.asarray(a)
            a = FakeCUDAArray(a.view(np.int16) if is_bfloat16(a.dtype) else a)
        elif isinstance(a, FakeCUDAArray) and is_bfloat16(a.dtype):
            a = a.view(np.int16)
        views.append(a)
    if RECORDER[0] is not None:
        RECORDER[0](kernel, tuple(numba_type(simulator_kind(a)) for a in views), threads)
    kernel[blocks, threads, 0](*views)


def _pack(loaded, buffer, flat):
    try:
        loaded.packer.pack_into(buffer, 0, *flat)
    except struct.error as error:
        _overflow(loaded, error)


def _overflow(loaded, error):
    raise OverflowError(f"an argument of kernel {loaded.name} does not fit its parameter "
                        f"type: {error}") from None


def launch(kernel, blocks, threads, *args):
    """Launch ``kernel`` (a ``cuda.jit`` kernel) on ``blocks`` x ``threads`` (1-D) threads
    with ``args`` on the current stream; returns at once (nothing is waited for)."""
    LAUNCHES[0] += 1
    _device.QUEUED[0] = True
    if _SIMULATOR:
        _simulate(kernel, blocks, threads, args)
        return
    gpu = _GPU or _gpu()
    device = gpu["device"]()
    last = _LAST.get(kernel)
    if last is not None and last[0] == device and last[3] == len(args) and RECORDER[0] is None:
        loaded = last[1]
        held = loaded.buffers()
        try:
            packed = last[2](held[0], *args)
        except struct.error as error:
            _overflow(loaded, error)
        if packed:
            gpu["launch"](loaded.function, blocks, 1, 1, threads, 1, 1, 0,
                          gpu["stream"]().ptr, held[2], 0)
            return
    kinds, flat = arguments(args)
    if RECORDER[0] is not None:
        RECORDER[0](kernel, tuple(numba_type(k) for k in kinds), threads)
    loaded = _LOADED.get((kernel, kinds, device)) or _load(kernel, kinds, device)
    held = loaded.buffers()
    _pack(loaded, held[0], flat)
    gpu["launch"](loaded.function, blocks, 1, 1, threads, 1, 1, 0,
                  gpu["stream"]().ptr, held[2], 0)
    fast = loaded.fast.get(tuple(map(type, args)), False)
    if fast is False:
        fast = loaded.fast[tuple(map(type, args))] = fast_packer(kinds, args, loaded.packer)
    if fast is not None:
        _LAST[kernel] = (device, loaded, fast, len(args))


_LAST = {}  # kernel -> (device, _Loaded, fast packer, arguments) of its last fast-packable launch


def fast_packer(kinds, args, packer):
    """A function ``fast(buffer, *args)`` for launches whose arguments have ``kinds`` and
    the types of ``args``: it packs them with ``packer`` into ``buffer`` and returns True,
    or returns False, packing nothing, when one differs (then :func:`arguments` decides).
    None when an argument is neither a CuPy array nor a scalar passed as it is."""
    names, tests, fields, env = [], [], [], {"pack_into": packer.pack_into}
    for i, (kind, a) in enumerate(zip(kinds, args)):
        t, name = type(a), f"a{i}"
        names.append(name)
        env[f"t{i}"] = t
        if isinstance(kind, tuple):
            if _FIELDS.get(t) is not _cupy_fields:
                return None
            dtype, ndim, contiguous = kind
            env[f"d{i}"] = dtype
            tests.append(f"type({name}) is t{i} and {name}.dtype is d{i} and {name}.ndim == {ndim}"
                         f" and {name}._c_contiguous is {bool(contiguous)}")
            size = np.dtype(dtype).itemsize
            if ndim == 1 and contiguous:  # C order: its strides follow from its shape (a
                #                           stride matters where it has more than one
                #                           element alone)
                fields.append(f"0, 0, {name}.size, {size}, {name}.data.ptr, {name}.size, {size}")
            elif ndim == 2 and contiguous:
                fields.append(f"0, 0, {name}.size, {size}, {name}.data.ptr, {name}.shape[0], "
                              f"{name}.shape[1], {name}.shape[1] * {size}, {size}")
            elif ndim == 1:  # indexed: a call with no unpacking packs faster
                fields.append(f"0, 0, {name}.size, {name}.itemsize, {name}.data.ptr, "
                              f"{name}.shape[0], {name}.strides[0]")
            else:
                fields.append(f"0, 0, {name}.size, {name}.itemsize, {name}.data.ptr, "
                              f"*{name}.shape, *{name}.strides")
        elif t in _PLAIN or (isinstance(a, int) and kind is int):
            tests.append(f"type({name}) is t{i}")
            fields.append(name)
        else:
            return None
    source = (f"def fast(buffer, {', '.join(names)}):\n"
              f"    if not ({' and '.join(tests) or 'True'}):\n"
              f"        return False\n"
              f"    pack_into(buffer, 0, {', '.join(fields)})\n"
              f"    return True\n")
    exec(compile(source, f"<fast packer {len(names)} arguments>", "exec"), env)
    return env["fast"]


class Prepared:
    """A launch whose kernel, grid and arguments never change (:func:`prepare`): calling
    it launches again, on the current stream, with the arguments packed once. It keeps
    its arguments alive. On a device other than the one it was prepared on it launches
    as :func:`launch` does."""

    __slots__ = ("kernel", "blocks", "threads", "args", "device", "function", "kinds",
                 "buffer", "pointers", "address")

    def __init__(self, kernel, blocks, threads, args):
        self.kernel, self.blocks, self.threads, self.args = kernel, blocks, threads, args
        self.device = None
        if _SIMULATOR:
            return
        gpu = _GPU or _gpu()
        kinds, flat = arguments(args)
        self.kinds = tuple(numba_type(k) for k in kinds)
        self.device = gpu["device"]()
        loaded = _LOADED.get((kernel, kinds, self.device)) or _load(kernel, kinds, self.device)
        self.function = loaded.function
        self.buffer = ctypes.create_string_buffer(max(loaded.count, 1) * _SLOT)
        base = ctypes.addressof(self.buffer)
        self.pointers = (ctypes.c_void_p * max(loaded.count, 1))(
            *[base + _SLOT * i for i in range(loaded.count)])
        self.address = ctypes.addressof(self.pointers)
        _pack(loaded, self.buffer, flat)

    def __call__(self):
        if _SIMULATOR:
            launch(self.kernel, self.blocks, self.threads, *self.args)
            return
        gpu = _GPU
        if gpu["device"]() != self.device:
            launch(self.kernel, self.blocks, self.threads, *self.args)
            return
        LAUNCHES[0] += 1
        _device.QUEUED[0] = True
        if RECORDER[0] is not None:
            RECORDER[0](self.kernel, self.kinds, self.threads)
        gpu["launch"](self.function, self.blocks, 1, 1, self.threads, 1, 1, 0,
                      gpu["stream"]().ptr, self.address, 0)


def prepare(kernel, blocks, threads, *args):
    """A :class:`Prepared` launch of ``kernel`` with ``args`` (as :func:`launch` takes
    them), for a launch made many times with the same arguments: each call costs the host
    the driver's call alone."""
    return Prepared(kernel, blocks, threads, args)
