"""The null device: the CUDA path's host code run with no GPU, no kernel and no library
call executed on a device, to count and time what a call costs the host.

**No kernel runs.** :func:`install` puts a stand-in in place of CuPy (``cupy`` in
``sys.modules``) before any hbkernels CUDA module is imported, in a process where Numba's
simulator is off. Then every op on the stand-in's arrays takes the GPU branch of its
code, validation, dispatch, the pending-check ledger, the launcher's argument packing,
as on a GPU, except:

* the driver's kernel launch is a counter, and a kernel is never compiled (the
  launcher's kernel cache answers with an empty cubin);
* each library call (CuPy's elementwise, scan, sort and search routines, a host to device
  copy) is counted; it runs in NumPy on the stand-in's host data so that shapes come out
  as on a GPU, and the time that takes is left out of the call's time;
* each device allocation (a new array from the pool) is counted;
* a wait for the device (a stream or device synchronize) is counted;
* a read of device memory (the host needs a size or a count) is answered with what the
  device would hold: the data of an array no kernel has written (a host copy, a fill),
  else the value the CPU op gives for the same inputs (:func:`answers`; the error
  slots of valid inputs read as clean). A read that no answer covers is an error naming
  the function that read, never a made-up value.

A profile's time per call is the host's Python time plus each counted event at its
stated cost (:data:`COSTS`, assumed until a GPU run measures them).
"""
import contextlib
import functools
import math
import os
import sys
import time
import types

import numpy as np

#: Host microseconds charged per event. Assumed until a GPU run measures them.
COSTS = {"launches": 2.5, "library": 6.0, "allocations": 1.0, "syncs": 4.0}
COSTS_SOURCE = "assumed (no GPU measured them)"
EVENTS = tuple(COSTS)

COUNTS = dict.fromkeys(EVENTS, 0)
EXCLUDED = [0.0]  # seconds spent running library calls in NumPy, left out of a call's time
_ANSWERS = {}  # read site -> f(shape, dtype) -> the host value of that read
_WRITTEN = set()  # ids of host buffers a kernel was launched on (their data is not the device's)
_SKIP = {__name__, "hbkernels.cuda._device", "hbkernels._dispatch"}


def _base(a):
    while a.base is not None and isinstance(a.base, np.ndarray):
        a = a.base
    return a


class _Pointer:  # CuPy's MemoryPointer
    __slots__ = ("ptr", "device_id")

    def __init__(self, ptr):
        self.ptr, self.device_id = ptr, 0


class NullArray:
    """A device array of the null device: the host NumPy array ``_a`` standing in for its
    memory (allocated, never filled by a kernel), with CuPy's attributes (plain
    attributes, read as fast as CuPy's)."""

    __slots__ = ("_a", "shape", "dtype", "ndim", "size", "itemsize", "nbytes", "strides",
                 "flags", "_c_contiguous", "data", "device")
    __array_priority__ = 100

    def __init__(self, a):
        self._a = a
        self.shape, self.dtype, self.ndim, self.size = a.shape, a.dtype, a.ndim, a.size
        self.itemsize, self.nbytes, self.strides, self.flags = a.itemsize, a.nbytes, a.strides, a.flags
        self._c_contiguous = a.flags.c_contiguous
        self.data = _Pointer(a.__array_interface__["data"][0] or 256)
        self.device = _DEVICE

    @property
    def T(self):
        return NullArray(self._a.T)

    @property
    def __cuda_array_interface__(self):  # built at each read, as CuPy does
        return {"shape": self.shape, "typestr": self.dtype.str, "descr": self.dtype.descr,
                "data": (self.data.ptr, False), "version": 3, "stream": 1,
                "strides": None if self.flags.c_contiguous else self.strides}

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"NullArray(shape={self.shape}, dtype={self.dtype})"

    # -- views: no device work -----------------------------------------------------------------
    def reshape(self, *shape, **kw):
        return NullArray(self._a.reshape(*shape, **kw))

    def ravel(self):
        return NullArray(self._a.ravel()) if self._a.flags.c_contiguous else self.copy()

    def view(self, dtype):
        return NullArray(self._a.view(dtype))

    def __getitem__(self, key):
        if _basic(key):
            return NullArray(self._a[key])
        return _library(lambda a, k: a[k], self, key)

    # -- device work: library calls ------------------------------------------------------------
    def __setitem__(self, key, value):
        _library(_setitem, self, key, value, out=self)

    def astype(self, dtype, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _library(lambda a: a.astype(dtype), self)

    def copy(self):
        return _library(np.copy, self)

    def fill(self, value):
        _library(lambda a: a.fill(value), self, out=self)

    def set(self, host):  # a host to device copy into this array
        _library(_setitem, self, Ellipsis, np.asarray(host), out=self)

    def __getattr__(self, name):  # sum, max, cumsum, argsort, ...: a library call each
        attr = getattr(self._a, name)
        if not callable(attr):
            raise AttributeError(name)
        return lambda *args, **kw: _library(lambda a, *r, **k: getattr(a, name)(*r, **k),
                                            self, *args, **kw)

    # -- reads: the host waits for the device -----------------------------------------------------
    def get(self):
        return asnumpy(self)

    def item(self):
        return asnumpy(self).item()

    def __int__(self):
        return int(asnumpy(self))

    def __index__(self):
        return int(asnumpy(self))

    def __float__(self):
        return float(asnumpy(self))

    def __bool__(self):
        return bool(asnumpy(self))


def _setitem(a, key, value):
    a[key] = value


def _basic(key):
    """Whether indexing by ``key`` is a view (ints, slices, None, Ellipsis)."""
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (slice, int, np.integer)) for k in keys)


def _operator(name, inplace=False):
    op = getattr(np.ndarray, name)

    def method(self, *args):
        if inplace:
            _library(lambda a, *r: op(a, *r), self, *args, out=self)
            return self
        return _library(lambda a, *r: op(a, *r), self, *args)

    return method


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
              "lshift", "rshift", "lt", "le", "gt", "ge", "eq", "ne"):
    for _form in (f"__{_name}__", f"__r{_name}__"):
        if hasattr(np.ndarray, _form):
            setattr(NullArray, _form, _operator(_form))
    if hasattr(np.ndarray, f"__i{_name}__"):
        setattr(NullArray, f"__i{_name}__", _operator(f"__i{_name}__", inplace=True))
for _name in ("__neg__", "__invert__", "__abs__"):
    setattr(NullArray, _name, _operator(_name))
NullArray.__hash__ = object.__hash__
NullArray.__module__ = "cupy._core.core"  # how hbkernels tells CuPy's arrays


# -- counting ------------------------------------------------------------------------------------
def _unwrap(x):
    if isinstance(x, NullArray):
        return x._a
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return x


def _inputs(args, kwargs):
    found = []
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, NullArray):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            found += [v for v in x if isinstance(v, NullArray)]
    return found


def _wrap(result, written):
    if isinstance(result, np.generic):  # a reduction: a 0-d device array, not a host value
        result = np.asarray(result)
    if isinstance(result, np.ndarray):
        COUNTS["allocations"] += 1
        if written:
            _WRITTEN.add(id(_base(result)))
        return NullArray(result)
    if isinstance(result, tuple):
        return tuple(_wrap(r, written) for r in result)
    return result


def _library(fn, *args, out=None, **kwargs):
    """One library call: ``fn`` on the host data, its whole time (the stand-in's own
    bookkeeping included) left out, as the call is charged its stated cost; its array
    results are new device arrays, written by the device where an input was."""
    t0 = time.perf_counter()
    COUNTS["library"] += 1
    written = any(id(_base(x._a)) in _WRITTEN for x in _inputs(args, kwargs))
    result = fn(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
    if out is not None:
        if written:
            _WRITTEN.add(id(_base(out._a)))
        result = None
    else:
        result = _wrap(result, written)
    EXCLUDED[0] += time.perf_counter() - t0
    return result


def _allocate(fn, *args, **kwargs):
    """A new device array, filled by a library call where ``fill`` (zeros, full, ...);
    its time left out, as the allocation is charged its stated cost."""
    t0 = time.perf_counter()
    COUNTS["allocations"] += 1
    result = NullArray(fn(*args, **kwargs))
    EXCLUDED[0] += time.perf_counter() - t0
    return result


# -- reads -----------------------------------------------------------------------------------------
def _site():
    """``module.function`` of the code that asked for a read (the first frame outside the
    null device, the device module and the dispatch)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in _SKIP:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__')}.{frame.f_code.co_name}"


def asnumpy(a):
    """A read: the data where no kernel wrote the array, else the answer for the reading
    function (:func:`answers`); its time left out, as the wait is charged its cost."""
    if not isinstance(a, NullArray):
        return np.asarray(a)
    t0 = time.perf_counter()
    try:
        return _read(a)
    finally:
        EXCLUDED[0] += time.perf_counter() - t0


def _read(a):
    COUNTS["syncs"] += 1  # a copy to the host waits for the work queued before it
    if id(_base(a._a)) not in _WRITTEN:
        return a._a.copy()
    site = _site()
    answer = _ANSWERS.get(site)
    if answer is None:
        raise LookupError(f"the null device has no answer for a read of shape {a.shape} "
                          f"({a.dtype}) in {site}: the value is a kernel's; give it with "
                          f"hbkernels.bench.null_device.answers")
    out = np.asarray(answer(a.shape, a.dtype), a.dtype)
    if out.shape != a.shape:
        raise ValueError(f"the null device's answer for {site} has shape {out.shape}, the read "
                         f"{a.shape}")
    return out


@contextlib.contextmanager
def answers(by_site):
    """Answer the reads of kernels' results while the block runs: ``{"module.function":
    f(shape, dtype) -> array}``, the function being the one that reads (e.g.
    ``"hbkernels.cuda.unique.unique"``)."""
    before = dict(_ANSWERS)
    _ANSWERS.update(by_site)
    try:
        yield
    finally:
        _ANSWERS.clear()
        _ANSWERS.update(before)


def clean_error_slots(shape, dtype):
    """Error slots of valid inputs: no bad position (``NO_ERROR_SLOT``)."""
    return np.full(shape, np.iinfo(np.int64).max, dtype)


_DEFAULT_ANSWERS = {"hbkernels.cuda._pending._read": clean_error_slots,
                    "hbkernels.cuda._launch.read_error_slots": clean_error_slots}


# -- the stand-in module ---------------------------------------------------------------------------
class _Device:
    mem_info = (64 << 30, 80 << 30)  # (free, total) bytes

    def __init__(self, device_id=0):
        self.id = int(device_id)
        self.compute_capability = "90"

    def synchronize(self):
        COUNTS["syncs"] += 1

    def use(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Stream:
    ptr = 0x5EED

    def __init__(self, non_blocking=False):
        pass

    def synchronize(self):
        COUNTS["syncs"] += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def begin_capture(self):
        pass

    def end_capture(self):
        return _Graph()


class _Graph:
    """A captured CUDA graph: its launch is one library call."""

    def launch(self, stream=None):
        COUNTS["library"] += 1


class _Function:
    ptr = 0xF00D


class _Module:
    def load(self, cubin):
        pass

    def get_function(self, name):
        return _Function()


def _launch_kernel(*args):
    COUNTS["launches"] += 1


_STREAM = _Stream()
_DEVICE = _Device(0)
_CREATE = {"empty": np.empty, "zeros": np.zeros, "ones": np.ones, "full": np.full}
_LIKE = {"empty_like": np.empty_like, "zeros_like": np.zeros_like, "ones_like": np.ones_like,
         "full_like": np.full_like}


def _module():
    cp = types.ModuleType("cupy")
    cp.__doc__ = "The null device's stand-in for CuPy (hbkernels.bench.null_device)."
    cp.__version__ = "null"
    cp.ndarray = NullArray
    cp.asnumpy = asnumpy

    def creator(fn, fills):
        def make(*args, **kwargs):
            if fills:
                COUNTS["library"] += 1
            return _allocate(fn, *args, **kwargs)
        return make

    for name, fn in _CREATE.items():
        setattr(cp, name, creator(fn, name != "empty"))
    for name, fn in _LIKE.items():
        like = creator(fn, name != "empty_like")
        setattr(cp, name, lambda a, *r, _like=like, **k: _like(_unwrap(a), *r, **k))

    def asarray(a, dtype=None, order=None):
        if isinstance(a, NullArray):
            same = dtype is None or np.dtype(dtype) == a.dtype
            if same and (order != "C" or a.flags.c_contiguous):
                return a
            return _library(lambda h: np.asarray(h, dtype=dtype, order=order).copy(order="C"), a)
        COUNTS["library"] += 1  # a host to device copy
        return _allocate(np.array, a, dtype=dtype, copy=True)

    cp.asarray = asarray
    cp.array = lambda a, dtype=None, copy=True: (asarray(a, dtype) if not isinstance(a, NullArray)
                                                 else _library(np.array, a, dtype=dtype))
    cp.ascontiguousarray = lambda a, dtype=None: (
        a if isinstance(a, NullArray) and a.flags.c_contiguous and dtype in (None, a.dtype)
        else _library(np.ascontiguousarray, asarray(a), dtype=dtype))

    def anything(name):  # made once per name, then an attribute (as CuPy's functions are)
        fn = getattr(np, name)
        if not isinstance(fn, type) and callable(fn):
            fn = functools.partial(_library, fn)
        setattr(cp, name, fn)
        return fn

    cp.__getattr__ = anything  # where, cumsum, concatenate, arange, sort, ...: library calls
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64", "bool_", "dtype", "iinfo", "finfo", "newaxis"):
        setattr(cp, name, getattr(np, name))

    runtime = types.SimpleNamespace(
        getDevice=lambda: 0, getDeviceCount=lambda: 1, memGetInfo=lambda: (64 << 30, 80 << 30),
        deviceSynchronize=lambda: _Device().synchronize(), driverGetVersion=lambda: 13000,
        runtimeGetVersion=lambda: 13000,
        getDeviceProperties=lambda i: {"name": b"null device", "totalGlobalMem": 80 << 30,
                                       "major": 9, "minor": 0, "l2CacheSize": 50 << 20})
    cp.cuda = types.SimpleNamespace(
        runtime=runtime, Device=_Device, get_current_stream=lambda: _STREAM,
        driver=types.SimpleNamespace(launchKernel=_launch_kernel),
        function=types.SimpleNamespace(Module=_Module), Stream=_Stream)
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    return cp


def installed():
    """Whether the null device stands in for CuPy in this process."""
    return getattr(sys.modules.get("cupy"), "__version__", None) == "null"


def install():
    """Put the stand-in in place of CuPy, before any hbkernels CUDA module is imported;
    the kernels are then never compiled. Refused under Numba's simulator, or where
    hbkernels' CUDA modules or CuPy were imported already."""
    if installed():
        return
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        raise RuntimeError("the null device runs the GPU branch of the code: unset "
                           "NUMBA_ENABLE_CUDASIM")
    loaded = [m for m in ("cupy", "hbkernels.cuda._launcher") if m in sys.modules]
    if loaded:
        raise RuntimeError(f"the null device must be installed before {loaded} is imported")
    sys.modules["cupy"] = _module()
    _ANSWERS.update(_DEFAULT_ANSWERS)
    from hbkernels.cuda import _kernel_cache, _launcher

    _kernel_cache.compiled = lambda kernel, argtypes, cc, fresh=False: (b"", "null")
    launch, prepare = _launcher.launch, _launcher.prepare

    def written(args):
        t0 = time.perf_counter()  # the null device's own bookkeeping, left out
        for a in args:  # a kernel may write any array it is given
            if type(a) is NullArray:
                _WRITTEN.add(id(_base(a._a)))
        EXCLUDED[0] += time.perf_counter() - t0

    def counted_launch(kernel, blocks, threads, *args):
        written(args)
        return launch(kernel, blocks, threads, *args)

    def counted_prepare(kernel, blocks, threads, *args):  # (its launches write them all)
        written(args)
        return prepare(kernel, blocks, threads, *args)

    for name, module in list(sys.modules.items()):  # modules that imported them by name
        if name.startswith("hbkernels.cuda"):
            if getattr(module, "launch", None) is launch:
                module.launch = counted_launch
            if getattr(module, "prepare", None) is prepare:
                module.prepare = counted_prepare


def snapshot():
    """The event counts so far, and the seconds of library calls left out so far."""
    return dict(COUNTS), EXCLUDED[0]


def per_call(call, calls=100, loops=5, sync=None):
    """Profile ``call``: warmed up, then ``loops`` loops of ``calls`` calls each followed by
    ``sync`` (a wait, not counted in the call). Returns ``{"python_us": [per loop],
    events...: per call, "us": median Python µs + events at :data:`COSTS`}``."""
    sync = sync or (lambda: None)
    for _ in range(3):
        call()
    sync()
    before, _ = snapshot()
    call()
    after, _ = snapshot()
    events = {k: after[k] - before[k] for k in EVENTS}
    python = []
    for _ in range(loops):
        sync()
        _, excluded = snapshot()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        elapsed = time.perf_counter() - t0 - (snapshot()[1] - excluded)
        python.append(elapsed * 1e6 / calls)
    python_us = float(np.median(python))
    charged = math.fsum(events[k] * COSTS[k] for k in EVENTS)
    return {"python_us": python, "median_python_us": python_us, **events,
            "events_us": charged, "us": python_us + charged}
