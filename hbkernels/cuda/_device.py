"""Scratch memory, library calls and host reads of the CUDA backend.

* :func:`xp`: the array module the backend's library calls go through: CuPy on a
  GPU (its sort, argsort and cumsum are CUB/Thrust-backed), NumPy under Numba's
  simulator (``NUMBA_ENABLE_CUDASIM=1``), whose device arrays are NumPy arrays.
  Code written against ``xp`` runs unchanged on both, so the work decompositions
  the GPU builds are also built, at full size, by CPU-only tests.
* :func:`scratch` / :func:`full`: temporary arrays from CuPy's memory pool on
  the current stream (no ``cuMemAlloc``/``cuMemFree``, which synchronise the
  device); NumPy arrays under the simulator.
* :func:`kernel` / :func:`array`: the Numba view a kernel takes of an ``xp``
  array, and the ``xp`` view of a Numba device array; neither copies.
* :func:`to_host`: the backend's one way from device to host. It waits for the
  stream, so it is a host synchronisation; :data:`HOST_SYNCS` counts them (the
  tests hold each op to its documented number per ``bounds`` mode).

On a GPU, CuPy is required (``pip install "hbkernels[cuda12]"`` or ``[cuda13]``);
Numba device arrays are still accepted and returned, viewed by CuPy without a copy.
"""

import numpy as np

from .._machine import cupy as _cupy, simulator_enabled

HOST_SYNCS = [0]  # host synchronisations by to_host since import


def xp():
    """CuPy on a GPU, NumPy under the simulator."""
    return np if simulator_enabled() else _cupy()


def scratch(shape, dtype):
    """An uninitialised temporary ``xp`` array (CuPy's pool, current stream)."""
    return xp().empty(shape, dtype)


def zeros(shape, dtype):
    """A temporary ``xp`` array of zeros."""
    return xp().zeros(shape, dtype)


def full(shape, value, dtype):
    """A temporary ``xp`` array filled with ``value``."""
    return xp().full(shape, value, dtype)


def kernel(a):
    """The Numba device-array view of an ``xp`` array (no copy); a Numba device
    array passes through."""
    if not isinstance(a, np.ndarray) and not _is_cupy(a):
        return a
    if simulator_enabled():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(a)
    from numba import cuda

    return cuda.as_cuda_array(a, sync=False)


def array(k):
    """The ``xp`` view of a Numba device array or an ``xp`` array (no copy)."""
    if simulator_enabled():
        return k if isinstance(k, np.ndarray) else k._ary
    return _cupy().asarray(k)


def to_family(family, a):
    """An ``xp`` array as an array of ``family`` (CuPy as is, else a Numba view)."""
    return a if family.name == "cupy" else kernel(a)


def _is_cupy(a):
    return (type(a).__module__ or "").startswith("cupy")


def to_host(a):
    """A NumPy copy of a (small) device array or ``xp`` array, after the work queued
    before it on the current stream: one host synchronisation."""
    HOST_SYNCS[0] += 1
    if simulator_enabled():
        return np.array(array(a))
    return _cupy().asnumpy(array(a))
