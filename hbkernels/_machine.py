"""Facts of the platform: the CPU's name, whether Numba's CUDA simulator is on, and
the optional GPU libraries (imported on first use, so ``import hbkernels`` works
on machines with no GPU and no CUDA toolkit)."""
import importlib
import importlib.util
import os
import platform
import sys

from .errors import MissingDependencyError


def cpu_name():
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def simulator_enabled():
    """Whether Numba's CUDA simulator stands in for the GPU (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def has_cupy():
    """Whether CuPy is installed (without importing it)."""
    return importlib.util.find_spec("cupy") is not None


def cupy():
    """The ``cupy`` module (the one in ``sys.modules``, once imported);
    :class:`~hbkernels.errors.MissingDependencyError` naming the extras that install it
    when it is missing."""
    module = sys.modules.get("cupy")
    if module is not None:
        return module
    try:
        return importlib.import_module("cupy")
    except ImportError as error:
        raise MissingDependencyError("CUDA arrays reach the hbkernels CUDA kernels through CuPy: "
                                     "pip install 'hbkernels[cuda12]' or 'hbkernels[cuda13]'") from error


def numba_cuda():
    """The ``numba.cuda`` module; :class:`~hbkernels.errors.MissingDependencyError` naming
    the versions when it is missing or fails to import (numba-cuda 0.30 and older use
    ``np.row_stack``, which NumPy 2.5 removed)."""
    try:
        return importlib.import_module("numba.cuda")
    except Exception as error:  # noqa: BLE001 - any import failure gets the versions
        raise MissingDependencyError(_numba_cuda_problem(error)) from error


def _numba_cuda_problem(error):
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    found = (f"numba-cuda {version('numba-cuda')}, numba {version('numba')}, "
             f"NumPy {version('numpy')}")
    if isinstance(error, AttributeError) and "numpy" in str(error):
        return (f"numba-cuda cannot be imported with this NumPy ({found}): {error}. "
                f"Install a NumPy it supports (pip install 'numpy<2.5') or a numba-cuda "
                f"release that supports this NumPy")
    return (f"the CUDA kernels need numba-cuda ({found}): import numba.cuda failed with "
            f"{type(error).__name__}: {error}. pip install 'hbkernels[cuda12]' or "
            f"'hbkernels[cuda13]'")
