"""CuPy's stand-in under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), where there
is no GPU and no CuPy: :class:`SimArray`, a NumPy array that hbkernels takes for a CUDA
array (its ops run the CUDA kernels in the simulator), and :data:`xp`, NumPy's functions
giving such arrays. Code written against CuPy (a collection on ``device="cuda"``, the
GPU training step) then runs unchanged on a machine without a GPU.
"""
import functools

import numpy as np


class SimArray(np.ndarray):
    """A simulated CUDA array: NumPy's arithmetic, indexing and methods keep the type;
    ``np.asarray`` of it is a plain view (what the simulator's kernels see)."""

    __array_priority__ = 100  # a mix with plain arrays gives a SimArray

    def get(self):
        """A plain NumPy copy, as ``cupy.ndarray.get``."""
        return np.array(self, copy=True).view(np.ndarray)


def device(a):
    """``a`` (any array or value NumPy takes) as a :class:`SimArray`, a view when it is
    already a NumPy array."""
    a = np.asarray(a)
    return a if type(a) is SimArray else a.view(SimArray)


def _on_device(result):
    if isinstance(result, np.ndarray):
        return result if type(result) is SimArray else result.view(SimArray)
    if isinstance(result, tuple):
        return tuple(_on_device(r) for r in result)
    if isinstance(result, list):
        return [_on_device(r) for r in result]
    return result


class _Module:
    """NumPy with every array result as a :class:`SimArray` (``xp.zeros``, ``xp.arange``,
    ``xp.concatenate``, ...); ``asarray`` copies a plain array to the "device"."""

    def __getattr__(self, name):
        attr = getattr(np, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        @functools.wraps(attr)
        def call(*args, **kwargs):
            return _on_device(attr(*args, **kwargs))

        setattr(self, name, call)
        return call

    @staticmethod
    def asarray(a, dtype=None):
        if type(a) is SimArray and (dtype is None or a.dtype == np.dtype(dtype)):
            return a
        return np.array(a, dtype=dtype).view(SimArray)

    @staticmethod
    def asnumpy(a):
        return np.array(a, copy=True).view(np.ndarray)


xp = _Module()
