"""Scratch memory, library calls and host reads of the CUDA backend.

* :func:`xp`: the array module the backend's library calls go through: CuPy on a
  GPU (its sort, argsort and cumsum are CUB/Thrust-backed), NumPy under Numba's
  simulator (``NUMBA_ENABLE_CUDASIM=1``), whose device arrays are NumPy arrays.
  Code written against ``xp`` runs unchanged on both, so the work decompositions
  the GPU builds are also built, at full size, by CPU-only tests.
* :func:`scratch` / :func:`full`: temporary arrays from CuPy's memory pool on
  the current stream (no ``cuMemAlloc``/``cuMemFree``, which synchronise the
  device); NumPy arrays under the simulator.
* :func:`array`: the ``xp`` view of a device array (Numba's, CuPy's or a simulator
  array), no copy; :func:`c_contiguous` asks any of them for its layout.
* :func:`to_host`: the backend's one way from device to host. It waits for the
  stream, so it is a host synchronisation; :data:`HOST_SYNCS` counts them (the
  tests hold each op to its documented number per ``bounds`` mode). Having waited,
  it reads the checks ops left pending (:mod:`._pending`) and raises their first error.
* :func:`synchronize`: ``hbk.synchronize()`` on the GPU: once hbkernels has queued work
  (:data:`QUEUED`: set by :func:`xp`, which every allocation and library call goes
  through, and by every kernel launch), a wait for the whole device, then the same
  reads as :func:`to_host`.

On a GPU, CuPy is required (``pip install "hbkernels[cuda12]"`` or ``[cuda13]``);
Numba device arrays are still accepted and returned, viewed by CuPy without a copy.
"""

import numpy as np

from .. import _simulator
from .._machine import cupy as _cupy, simulator_enabled

_SIMULATOR = simulator_enabled()  # fixed for the process once numba.cuda is imported
HOST_SYNCS = [0]  # host synchronisations by to_host since import
AFTER_WAIT = []  # functions to_host calls after its read (registered by ._pending)
QUEUED = [False]  # whether hbkernels has queued device work (or allocated) since import


_RUNTIME = []  # CuPy's getDevice and get_current_stream, looked up once


def _runtime():
    if not _RUNTIME:
        cuda = _cupy().cuda
        _RUNTIME[:] = [cuda.runtime.getDevice, cuda.get_current_stream]
    return _RUNTIME


def device_id():
    """The current device's id (0 under the simulator)."""
    return 0 if _SIMULATOR else (_RUNTIME or _runtime())[0]()


def current_stream():
    """CuPy's current stream (a GPU only)."""
    return (_RUNTIME or _runtime())[1]()


def xp():
    """CuPy on a GPU, NumPy under the simulator."""
    QUEUED[0] = True
    return np if _SIMULATOR else _cupy()


_EMPTY = {}  # (shape, dtype, device) -> a zero-sized array: no memory, so one serves every call


def scratch(shape, dtype):
    """An uninitialised temporary ``xp`` array (CuPy's pool, current stream); a zero-sized
    one is made once per shape, dtype and device."""
    if shape == 0 or (type(shape) is tuple and 0 in shape):
        key = (shape, dtype, device_id())
        found = _EMPTY.get(key)
        if found is None:
            found = _EMPTY[key] = xp().empty(shape, dtype)
        return found
    return xp().empty(shape, dtype)


def zeros(shape, dtype):
    """A temporary ``xp`` array of zeros."""
    return xp().zeros(shape, dtype)


def full(shape, value, dtype):
    """A temporary ``xp`` array filled with ``value``."""
    return xp().full(shape, value, dtype)


def array(k):
    """The ``xp`` view of a Numba device array or an ``xp`` array (no copy)."""
    if _SIMULATOR:
        return k if isinstance(k, np.ndarray) else k._ary
    return _cupy().asarray(k)


def to_family(family, a):
    """An ``xp`` array as an array of ``family`` (CuPy as is, else a Numba view; under
    the simulator a FakeCUDAArray, or for CuPy's stand-in a SimArray)."""
    if family.name == "cupy":
        return a
    if family.name == "simulated":
        return _simulator.device(a)
    if _SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return a if not isinstance(a, np.ndarray) else FakeCUDAArray(a)
    from numba import cuda

    return cuda.as_cuda_array(a, sync=False)


def c_contiguous(a):
    """Whether the device array ``a`` (CuPy, Numba or simulator) is C-contiguous."""
    flags = a.flags
    return bool(flags["C_CONTIGUOUS"] if isinstance(flags, dict) else flags.c_contiguous)


def wait(stream=None):
    """Wait for ``stream`` (a CuPy stream), or for every stream of the current device
    when None; nothing to wait for under the simulator. Not counted: callers count."""
    if _SIMULATOR:
        return
    if stream is None:
        _cupy().cuda.Device().synchronize()
    else:
        stream.synchronize()


def read(a, count=True):
    """A NumPy copy of a (small) device array or ``xp`` array, after the work queued
    before it on the current stream; ``count``: a host synchronisation of its own."""
    if count:
        HOST_SYNCS[0] += 1
    if _SIMULATOR:
        return np.array(array(a))
    return _cupy().asnumpy(array(a))


def synchronize():
    """Wait for every stream of the current device when hbkernels has queued work
    (one host synchronisation), then the functions of :data:`AFTER_WAIT`."""
    if not QUEUED[0]:
        return
    wait()
    HOST_SYNCS[0] += 1
    for after in AFTER_WAIT:
        after()


def to_host(a):
    """:func:`read` of ``a`` (one host synchronisation), then the functions of
    :data:`AFTER_WAIT` (:mod:`._pending` reads the checks ops queued before it, with no
    further wait, and raises their first error)."""
    out = read(a)
    for after in AFTER_WAIT:
        after()
    return out
