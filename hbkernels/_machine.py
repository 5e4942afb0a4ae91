"""Facts of the platform: the CPU's name, whether Numba's CUDA simulator is on, and
the optional GPU libraries (imported on first use, so ``import hbkernels`` works
on machines with no GPU and no CUDA toolkit)."""
import importlib
import importlib.util
import os
import platform

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
    """The ``cupy`` module; :class:`~hbkernels.errors.MissingDependencyError` naming the
    extras that install it when it is missing."""
    try:
        return importlib.import_module("cupy")
    except ImportError as error:
        raise MissingDependencyError("CUDA arrays reach the hbkernels CUDA kernels through CuPy: "
                                     "pip install 'hbkernels[cuda12]' or 'hbkernels[cuda13]'") from error


def numba_cuda():
    """The ``numba.cuda`` module."""
    return importlib.import_module("numba.cuda")
