"""The one dispatch layer: which backend runs a call, and how its arrays are made.

An *array family* is where the caller's arrays live and what type comes back
(the one notion of "where arrays live": the kernels, the collectives and the
sharded tables all ask the family):

* ``numpy``  -> the CPU kernels in :mod:`hbkernels.cpu`;
* ``cupy``   -> the CUDA kernels in :mod:`hbkernels.cuda`, results as CuPy arrays;
* ``numba``  -> the CUDA kernels, results as Numba device arrays (also the
  simulator's device arrays under ``NUMBA_ENABLE_CUDASIM=1``);
* ``simulated`` -> the CUDA kernels under the simulator, results as
  :class:`hbkernels._simulator.SimArray`: CuPy's stand-in there, so that code written
  for CuPy (a collection on ``device="cuda"``) runs without a GPU.

Any other object exposing ``__cuda_array_interface__`` or a CUDA ``__dlpack__``
is viewed, without a copy, as CuPy (or Numba when CuPy is not installed).
CuPy and ``numba.cuda`` are imported on first GPU use only, so
``import hbkernels`` works on machines with no GPU and no CUDA toolkit.
"""
import importlib
import sys
import warnings

import numpy as np

from . import _validate
from . import _simulator
from ._machine import cupy, has_cupy, numba_cuda, simulator_enabled
from .memory import aligned_full
from .threads import start_numba_pool

_DLPACK_CUDA_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged


class NumpyFamily:
    name = "numpy"
    is_cuda = False
    device_id = None
    device = "cpu"

    def __init__(self):
        self.kernels = "hbkernels.cpu"

    # -- computing with array-module code (NumPy) ------------------------------
    @property
    def xp(self):
        """The array module to compute on this family's arrays with."""
        return np

    def compute(self, x):
        """``x`` as an array of :attr:`xp` (no copy)."""
        return x

    def from_compute(self, a):
        """An :attr:`xp` result as an array of this family."""
        return a

    def put(self, a):
        """``a`` in this family: a NumPy array as is, a CUDA array copied to the host."""
        return a if isinstance(a, np.ndarray) else host(a)

    def sync(self):
        """Wait for the work queued on this family's arrays (none on the CPU)."""

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def full(self, shape, value, dtype, aligned=False):
        """``aligned``: data start on a cache line (:func:`hbkernels.memory.aligned_full`),
        for tables whose rows are read at random."""
        if aligned:
            return aligned_full(shape, value, dtype)
        return np.full(shape, value, dtype)

    def to_numpy(self, a):
        return np.asarray(a)

    def from_numpy(self, a):
        return a

    def reshape(self, a, shape):
        return a.reshape(shape)

    def view(self, a, dtype):
        return a.view(dtype)


class CudaFamily:
    """CUDA arrays of one library (``cupy`` or ``numba``) on one device."""

    is_cuda = True

    def __init__(self, name, device_id):
        self.name = name
        self.device_id = device_id
        self.kernels = "hbkernels.cuda"

    def __eq__(self, other):
        return isinstance(other, CudaFamily) and (self.name, self.device_id) == (
            other.name,
            other.device_id,
        )

    def __hash__(self):
        return hash((self.name, self.device_id))

    device = "cuda"

    # -- computing with array-module code (CuPy; Numba arrays through the host) -
    def _module(self):
        """CuPy, its simulator stand-in, or None for Numba arrays."""
        if self.name == "cupy":
            return cupy()
        return _simulator.xp if self.name == "simulated" else None

    @property
    def xp(self):
        """The array module to compute on this family's arrays with."""
        return self._module() or np

    def compute(self, x):
        """``x`` as an array of :attr:`xp` (a host copy for Numba device arrays)."""
        return x if self._module() is not None else self.to_numpy(x)

    def from_compute(self, a):
        """An :attr:`xp` result as an array of this family."""
        if self.name == "numba" and isinstance(a, np.ndarray):
            return self.from_numpy(c_order(np, a))
        if self.name == "simulated":
            return _simulator.device(a)
        return a

    def put(self, a):
        """``a`` in this family (a copy only when it lives elsewhere)."""
        module = self._module()
        if module is not None:
            return module.asarray(a)
        return a if not isinstance(a, np.ndarray) else self.from_numpy(a)

    def sync(self):
        """Wait for the work queued on CuPy's current stream, then raise the first error
        of the checks ops left pending (:mod:`hbkernels.cuda._pending`)."""
        if self.name == "cupy":
            cupy().cuda.get_current_stream().synchronize()
        _flush_checks()

    # -- allocation, in the caller's family ---------------------------------
    def empty(self, shape, dtype):
        module = self._module()
        if module is not None:
            return module.empty(shape, dtype)
        return numba_cuda().device_array(shape, dtype)

    def zeros(self, shape, dtype):
        module = self._module()
        if module is not None:
            return module.zeros(shape, dtype)
        return self.full(shape, 0, dtype)

    def full(self, shape, value, dtype, aligned=False):
        """``aligned`` is always true here: CUDA allocations start on 256 bytes."""
        module = self._module()
        if module is not None:
            return module.full(shape, value, dtype)
        out = self.empty(shape, dtype)
        from .cuda._launch import fill

        element = np.array(value, dtype)  # bf16: filled as its bits, as the kernels see it
        fill(self.kernel_array(out), element.view(np.int16)[()] if _validate.is_bfloat16(dtype)
             else element[()])
        return out

    def to_numpy(self, a):
        """A host copy of ``a`` (a wait for the device: pending checks are read too)."""
        module = self._module()
        out = module.asnumpy(a) if module is not None else a.copy_to_host()
        _flush_checks()
        return out

    def from_numpy(self, a):
        module = self._module()
        if module is not None:
            return module.asarray(a)
        return numba_cuda().to_device(c_order(np, a))

    def copy_in(self, dst, a):
        """Copy the NumPy array ``a`` into the device array ``dst`` of its size (queued on
        the current stream; nothing allocated on the device)."""
        if self.name == "cupy":
            dst.set(a)
        elif self.name == "numba":
            dst.copy_to_device(a)
        else:
            dst[...] = a

    def reshape(self, a, shape):
        return a.reshape(shape)

    def view(self, a, dtype):
        return a.view(dtype)

    # -- what the kernels see -------------------------------------------------
    def kernel_array(self, a):
        """``a`` as the kernels take it (no copy): bf16 viewed as its int16 bits, which
        the kernels convert; every other array as it is."""
        return a.view(np.int16) if _validate.is_bfloat16(a.dtype) else a


NUMPY = NumpyFamily()


def _flush_checks():
    """Raise the first pending GPU check's error, if any op left one (after a wait)."""
    pending = sys.modules.get("hbkernels.cuda._pending")
    if pending is not None:
        pending.after_wait()


def host(a):
    """A NumPy array of ``a`` (a NumPy array as is; CuPy and Numba arrays copied, a wait
    for the device that reads the pending checks too)."""
    if isinstance(a, np.ndarray) and type(a) is not _simulator.SimArray:
        return a
    out = a.get() if hasattr(a, "get") else a.copy_to_host()
    _flush_checks()
    return out


def device_family(device):
    """The family a collection on ``device`` (``"cpu"`` or ``"cuda"``) keeps its arrays
    in: NumPy, or CuPy on the current GPU (its stand-in under the simulator)."""
    if device == "cpu":
        return NUMPY
    if simulator_enabled():
        return cuda_family("simulated", 0)
    return cuda_family("cupy", int(cupy().cuda.Device().id))


_FAMILIES = {}  # (library, device id) -> its CudaFamily, one object each
_CUPY_TYPES = set()  # the array types found to be CuPy's


def cuda_family(name, device_id):
    """The :class:`CudaFamily` of library ``name`` on device ``device_id`` (one object
    for each pair, so that families compare by identity first)."""
    family = _FAMILIES.get((name, device_id))
    if family is None:
        family = _FAMILIES[(name, device_id)] = CudaFamily(name, device_id)
    return family


def cupy_family_of(*arrays, contiguous=False):
    """The family of ``arrays`` when each is a CuPy array (of a type :func:`classify` has
    seen) on one device, and with ``contiguous`` C-contiguous (as :func:`resolve` would
    hand each over, read or updated in place), else None: :func:`resolve` decides then."""
    t = type(arrays[0])
    if t not in _CUPY_TYPES:
        return None
    device = arrays[0].data.device_id  # (``.device`` makes a Device object)
    for a in arrays:
        if type(a) is not t or a.data.device_id != device:
            return None
        if contiguous:  # (``.flags`` makes a Flags object; CuPy keeps the bit)
            bit = getattr(a, "_c_contiguous", None)
            if not (a.flags.c_contiguous if bit is None else bit):
                return None
    return cuda_family("cupy", device)


def device_family_of(*arrays, contiguous=False):
    """:func:`cupy_family_of`, and under Numba's simulator the simulated family when each
    array is a simulated CUDA array (with ``contiguous`` C-contiguous); else None."""
    found = cupy_family_of(*arrays, contiguous=contiguous)
    if found is None and type(arrays[0]) is _simulator.SimArray:
        for a in arrays:
            if type(a) is not _simulator.SimArray or (contiguous and not a.flags.c_contiguous):
                return None
        return cuda_family("simulated", 0)
    return found


def classify(x):
    """(family, array to use) for one argument, or raise TypeError."""
    t = type(x)
    if t in _CUPY_TYPES:
        return cuda_family("cupy", x.device.id), x
    if t is _simulator.SimArray:
        return cuda_family("simulated", 0), x
    if isinstance(x, np.ndarray):
        return NUMPY, x
    if isinstance(x, np.generic):  # a NumPy scalar: a 0-d array
        return NUMPY, np.asarray(x)
    mod = t.__module__ or ""
    if mod.startswith("cupy"):
        _CUPY_TYPES.add(t)
        return cuda_family("cupy", int(x.device.id)), x
    if mod.startswith("numba.cuda") or mod.startswith("numba_cuda"):
        return cuda_family("numba", _numba_device_id()), x
    if hasattr(x, "__cuda_array_interface__"):
        if has_cupy():
            arr = cupy().asarray(x)
            return cuda_family("cupy", int(arr.device.id)), arr
        return cuda_family("numba", _numba_device_id()), numba_cuda().as_cuda_array(x)
    if hasattr(x, "__dlpack_device__") and hasattr(x, "__dlpack__"):
        dev_type, dev_id = x.__dlpack_device__()
        if int(dev_type) in _DLPACK_CUDA_DEVICES:
            if not has_cupy():
                raise TypeError(
                    f"{type(x).__name__} is a CUDA array reachable only through DLPack; "
                    "install CuPy (pip install 'hbkernels[cuda12]' or '[cuda13]')"
                )
            return cuda_family("cupy", int(dev_id)), cupy().from_dlpack(x)
    if type(x).__name__ == "QuantizedTable":  # hbkernels.quantize's, not an array
        raise TypeError("a QuantizedTable is for inference: only embedding_bag and lookup take "
                        "one; backward ops and optimizers need a float table (q.dequantize())")
    raise TypeError(
        f"expected a NumPy array or a CUDA array (CuPy, __cuda_array_interface__, "
        f"CUDA __dlpack__), got {type(x).__module__}.{type(x).__name__}"
    )


def cupy_bfloat16(bits):
    """The CuPy array of 2-byte bits ``bits`` viewed as ``ml_dtypes.bfloat16`` (no copy),
    for adapters whose framework hands CuPy no bf16. CuPy knows bf16 from v14 on,
    with ml_dtypes installed; an older CuPy gets a clear ``ValueError``."""
    try:
        import ml_dtypes

        return bits.view(np.dtype(ml_dtypes.bfloat16))
    except (ImportError, TypeError, ValueError, NotImplementedError) as error:
        raise ValueError("bfloat16 CUDA arrays need CuPy >= 14 with ml_dtypes installed "
                         "(pip install -U cupy-cuda12x ml-dtypes, or cupy-cuda13x); this "
                         f"CuPy has no bfloat16: {error}") from error


def _numba_device_id():
    if simulator_enabled():
        return 0
    return int(numba_cuda().get_current_device().id)


def resolve(optional=(), inplace=(), row_tables=(), **arrays):
    """Check that all ``arrays`` (those named in ``optional`` may be None) share
    one family and device.

    Returns ``(family, dict of the same names -> arrays ready for that family)``.
    Mixing NumPy with CUDA arrays, CuPy with Numba arrays, or two devices is a
    ``TypeError``, never a silent copy. Arrays the kernels only read are handed
    over C-contiguous and in native byte order (a strided view, a Fortran-order
    or big-endian array is copied once, :func:`kernel_ready`); the arrays named in
    ``inplace`` are updated in place, so they must already be so and writable
    (:func:`in_place_ready`). The NumPy arrays named in ``row_tables`` are tables
    whose CPU kernels read each row as one contiguous run: any 2-D array whose
    rows are contiguous passes as it is (a column slice, every k-th row,
    reversed rows; :func:`rows_contiguous`), never copied.
    """
    family = None
    first = None
    out = {}
    for name, x in arrays.items():
        if x is None:
            if name not in optional:
                raise TypeError(f"{name} must be a NumPy or CUDA array, got None")
            out[name] = None
            continue
        fam, arr = classify(x)
        if family is None:
            family, first = fam, name
        elif fam is not family and fam != family:
            raise TypeError(
                f"{name} is a {_describe(fam)} array but {first} is a "
                f"{_describe(family)} array; move them to one device and library first"
            )
        by_rows = name in row_tables and rows_contiguous(arr)
        if name in inplace:
            out[name] = _writable(name, arr) if by_rows else in_place_ready(name, arr)
        else:
            out[name] = arr if by_rows else kernel_ready(arr, name if name in row_tables else None)
    return (family or NUMPY), out


def rows_contiguous(a):
    """Whether ``a`` is a 2-D NumPy array in native byte order whose every row is
    contiguous (its last stride the item size), whatever its row stride."""
    return (isinstance(a, np.ndarray) and type(a) is not _simulator.SimArray and a.ndim == 2
            and a.dtype.isnative and (a.strides[1] == a.itemsize or a.shape[1] <= 1))


COPY_WARN_BYTES = 1 << 26
_warned_copy = []


def _warn_table_copy(name, a):
    if a.nbytes >= COPY_WARN_BYTES and not _warned_copy:
        _warned_copy.append(True)
        warnings.warn(f"{name} ({a.nbytes >> 20} MiB, strides {a.strides}, dtype {a.dtype.str}) "
                      f"is copied on every call: its rows are not contiguous in native byte "
                      f"order; pass np.ascontiguousarray({name}) once and keep using that "
                      f"array (warned once)", RuntimeWarning, stacklevel=4)


def _writable(name, a):
    """``a`` when it is writable, else a ``ValueError`` naming ``name``."""
    if not a.flags.writeable:
        raise ValueError(f"{name} is read-only; it is updated in place (pass a writable array, "
                         f"e.g. a copy)")
    return a


def c_order(xp, a, dtype=None):
    """``a`` as a C-contiguous array of ``xp`` (of ``dtype``), its shape kept (a 0-d array
    stays 0-d, which ``ascontiguousarray`` does not do); a copy only where needed."""
    return xp.asarray(a, dtype=dtype, order="C")


def _needs_copy(a):
    if type(a) in _CUPY_TYPES:  # CuPy arrays are in native byte order
        return not a.flags.c_contiguous
    flags = getattr(a, "flags", None)
    if flags is None:
        contiguous = True
    elif isinstance(flags, dict):  # Numba device arrays
        contiguous = flags.get("C_CONTIGUOUS", True)
    else:
        contiguous = bool(flags.c_contiguous)
    return not contiguous or not np.dtype(a.dtype).isnative


def kernel_ready(a, table_name=None):
    """``a`` C-contiguous in native byte order: itself, or a copy (NumPy or CuPy);
    a large NumPy table (``table_name`` given) that must be copied warns once."""
    if not _needs_copy(a):
        return a
    native = np.dtype(a.dtype).newbyteorder("=")
    if type(a) is _simulator.SimArray:
        return _simulator.device(c_order(np, a, native))
    if isinstance(a, np.ndarray):
        if table_name is not None:
            _warn_table_copy(table_name, a)
        return c_order(np, a, native)
    if (type(a).__module__ or "").startswith("cupy"):
        return c_order(cupy(), a, native)
    return a  # Numba device arrays: the kernels take their strides


def in_place_ready(name, a):
    """``a``, an array an op updates in place: C-contiguous, native byte order and
    writable (CUDA arrays always are), else a ``ValueError`` naming ``name``."""
    if isinstance(a, np.ndarray):
        _writable(name, a)
    if _needs_copy(a):
        raise ValueError(f"{name} is updated in place, so it must be C-contiguous in native "
                         f"byte order (got strides {getattr(a, 'strides', None)}, dtype "
                         f"{np.dtype(a.dtype).str}); pass np.ascontiguousarray of it and use "
                         f"that array from then on")
    return a


def _describe(fam):
    return "NumPy" if not fam.is_cuda else f"{fam.name} (cuda:{fam.device_id})"


def kernels(family, op):
    """The module holding ``op``'s kernels for ``family``'s backend (on the CPU,
    with Numba's thread pool started: :func:`hbkernels.threads.start_numba_pool`)."""
    module = _KERNELS.get((family.kernels, op))
    if module is not None:
        return module
    if not family.is_cuda:
        start_numba_pool()
    else:
        numba_cuda()  # a clear error when numba-cuda cannot be imported
    module = _KERNELS[(family.kernels, op)] = importlib.import_module(f"{family.kernels}.{op}")
    return module


_KERNELS = {}  # (family.kernels, op) -> its module, imported (what kernels returns)
